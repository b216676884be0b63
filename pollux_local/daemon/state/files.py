"""The state database's file: opening it safely (a private plain file), the errors that
name what to do, a full disk told apart, and a refused database set aside."""

from __future__ import annotations

import errno
import os
import sqlite3
import stat
import time
from pathlib import Path
from typing import Any

from pollux_local.api import errors as api_errors
from pollux_local.api.errors import PolluxError

#: The files SQLite keeps beside the database.
SIDE_FILES = ("-wal", "-shm", "-journal")
#: The daemon's key of checkpoint directory names (``executor.launchspec.checkpoint_key``):
#: it names each job's directory after the job's id, so it belongs to the database whose ids
#: it names, and goes with it (job ids start at 1 again in a new database).
CHECKPOINT_KEY = "checkpoint.key"


class StateError(PolluxError):
    """The state database cannot be used as it is (damaged, from a newer version, missing
    where one is expected, not a plain file); the message is one line naming the file and
    what to do."""


#: SQLite's primary result code for a full disk (``SQLITE_FULL``).
SQLITE_FULL = 13


class StateDiskFull(api_errors.StateDiskFull, sqlite3.OperationalError):
    """A write refused because the state database's filesystem is full.  Still an
    ``sqlite3.Error`` (every path that handles a failed write handles it) and an
    ``InternalError`` the client gets as ``state disk full: ...`` (one line)."""


def disk_full_error(exc: sqlite3.Error, path: Path) -> sqlite3.Error:
    """The one classification of SQLite's errors: a full disk (``SQLITE_FULL``, "database or
    disk is full") becomes :class:`StateDiskFull` naming the state directory and its free
    space; any other error is returned as it is."""
    code = getattr(exc, "sqlite_errorcode", None)
    full = (isinstance(code, int) and code & 0xFF == SQLITE_FULL) or "disk is full" in str(exc)
    if not full or isinstance(exc, StateDiskFull):
        return exc
    try:
        fs = os.statvfs(path.parent)
        left = f"{fs.f_bavail * fs.f_frsize // 1024} KiB left"
    except OSError:
        left = "free space unknown"
    return StateDiskFull(
        f"state disk full: the filesystem of {path.parent} ({left}) cannot take the write;"
        " nothing of this request was stored; free space there and try again"
    )


class StateConnection(sqlite3.Connection):
    """A connection whose statements raise :class:`StateDiskFull` for a full disk."""

    def execute(self, sql: str, parameters: Any = (), /) -> sqlite3.Cursor:
        try:
            return super().execute(sql, parameters)
        except sqlite3.Error as exc:
            raise disk_full_error(exc, Path(self._state_path)) from exc

    def executescript(self, sql_script: str, /) -> sqlite3.Cursor:
        try:
            return super().executescript(sql_script)
        except sqlite3.Error as exc:
            raise disk_full_error(exc, Path(self._state_path)) from exc

    _state_path = "."


_WHAT_TO_DO = (
    "stop here and restore it from a backup, or start the daemon with --reset-state to move"
    " it (with jobs/) aside into {dir}/reset-<time>/ and begin with no job history"
)


def what_to_do(path: Path) -> str:
    return _WHAT_TO_DO.format(dir=path.parent)


def _check_plain_file(path: Path) -> bool:
    """``path`` is absent (False) or a regular file of the daemon's user, not a symlink
    (True); :class:`StateError` otherwise."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return False
    if stat.S_ISLNK(info.st_mode):
        raise StateError(f"{path} is a symlink; the state files must be plain files")
    if not stat.S_ISREG(info.st_mode):
        raise StateError(f"{path} is not a regular file")
    if info.st_uid != os.geteuid():
        raise StateError(f"{path} belongs to uid {info.st_uid}, not to the daemon's user")
    if stat.S_IMODE(info.st_mode) & 0o077:
        os.chmod(path, 0o600)  # written by an older daemon: job environments are private
    return True


def create_private_file(path: Path) -> None:
    """Create ``path`` empty with mode 0600 from the first byte (never following a symlink),
    unless it exists; check it and SQLite's files beside it (:func:`_check_plain_file`)."""
    if not _check_plain_file(path):
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            os.close(os.open(path, flags, 0o600))
        except FileExistsError:
            pass
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise StateError(
                    f"{path} is a symlink; the state files must be plain files"
                ) from None
            raise StateError(f"cannot create {path}: {exc.strerror}") from None
        _check_plain_file(path)
    for suffix in SIDE_FILES:
        _check_plain_file(path.with_name(path.name + suffix))


def new_database(state_dir: Path, name: str = "state.db") -> bool:
    """Whether ``state_dir`` has no database yet (none, or an empty file): one made there
    numbers its jobs from 1."""
    try:
        return os.lstat(state_dir / name).st_size == 0
    except FileNotFoundError:
        return True


def missing_history(state_dir: Path, name: str = "state.db") -> str | None:
    """Why the database in ``state_dir`` is missing where one is expected (``None``: it is
    not): ``state.db`` is absent or empty (0 bytes) while ``jobs/`` has entries or
    ``state.db-wal`` exists.  Starting afresh there would lose the history without a word and
    hand new jobs the directories (reports, logs) of old ones."""
    path = state_dir / name
    try:
        size: int | None = os.lstat(path).st_size
    except FileNotFoundError:
        size = None
    if size:
        return None
    evidence = []
    if os.path.lexists(path.with_name(name + "-wal")):
        evidence.append(f"{name}-wal exists")
    jobs = state_dir / "jobs"
    try:
        entries = sum(1 for _ in os.scandir(jobs)) if jobs.is_dir() else 0
    except OSError:
        entries = 0
    if entries:
        evidence.append(f"jobs/ holds {entries} entr{'y' if entries == 1 else 'ies'}")
    if not evidence:
        return None
    what = "is missing" if size is None else "is empty (0 bytes)"
    return (
        f"the state database {path} {what} but {' and '.join(evidence)}: the job history"
        f" that belongs there is gone; {what_to_do(path)}"
    )


def set_aside(
    state_dir: Path, name: str = "state.db", now: float | None = None, key_only: bool = False
) -> Path:
    """Move the database, its ``-wal``/``-shm``, ``jobs/`` and the checkpoint key
    (:data:`CHECKPOINT_KEY`) into a new ``state_dir/reset-<time>/`` (0700; nothing is
    deleted) and make an empty ``jobs/``; with ``key_only``, the key alone (a new database
    is begun where none was).  The new database numbers its jobs from 1 again: with the old
    key, new job 1 was given old job 1's checkpoint directory under a ``checkpoint_root``
    (review s64: root's, chowned to the new job's user with its checkpoints)."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
    aside = state_dir / f"reset-{stamp}"
    suffix = 0
    while os.path.lexists(aside):
        suffix += 1
        aside = state_dir / f"reset-{stamp}-{suffix}"
    aside.mkdir(mode=0o700)
    entries = (name, *(name + side for side in SIDE_FILES), "jobs")
    for entry in (CHECKPOINT_KEY,) if key_only else (*entries, CHECKPOINT_KEY):
        source = state_dir / entry
        if os.path.lexists(source):
            os.rename(source, aside / entry)
    if key_only:
        return aside
    (state_dir / "jobs").mkdir(mode=0o755)
    os.chmod(state_dir / "jobs", 0o755)
    return aside
