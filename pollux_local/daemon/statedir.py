"""The state directory: made and checked (the daemon's own, never a symlink), its lock,
its private files, and the daemon's log.

Layout (owned by the daemon's user, mode 0755; a symlink, or a directory of another user, is
refused)::

    daemon.sock    the socket: 0666 for a root daemon (identity from SO_PEERCRED), 0600 for a
                   user's, 0660 with [daemon] allow_group's group (see auth.py)
    daemon.lock    held (flock) while a daemon runs on this directory, 0600
    daemon.log     the daemon's own log, 0600; at MAX_LOG_BYTES moved to daemon.log.1 (the
                   one older file kept) and begun again
    state.db       SQLite (WAL), 0600 from the first byte, like its -wal and -shm (state/)
    jobs/<id>/     per-job logs (rank<r>.log), report.json and, by default, checkpoint/
    alive          empty, 0600; its times set to the daemon's clock at each scheduling pass:
                   when the daemon was last known alive (note_alive, last_alive)

Every state file is created under ``umask 077`` and opened without following symlinks; once
they exist the daemon gives its jobs back the umask it was started with.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import stat
import sys
from pathlib import Path
from typing import IO

from pollux_local.api.errors import (
    PolluxError,
)
from pollux_local.untrusted import printable

log = logging.getLogger("pollux_local.daemon")

#: Size at which ``daemon.log`` is moved to ``daemon.log.1`` and begun again: the two files
#: take at most twice this on the state's disk, whatever is logged.
MAX_LOG_BYTES = 64 * 1024 * 1024


def own_directory(path: Path, what: str, create_mode: int) -> None:
    """Make ``path`` a directory of the daemon's user (created with ``create_mode``); refuse a
    symlink, anything not a directory, or one of another user; remove group/other write."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        with contextlib.suppress(FileExistsError):
            os.mkdir(path, create_mode)
            os.chmod(path, create_mode)
        info = os.lstat(path)
    if stat.S_ISLNK(info.st_mode):
        raise PolluxError(
            f"{what} {path} is a symlink (to {os.path.realpath(path)}); give the real path"
        )
    if not stat.S_ISDIR(info.st_mode):
        raise PolluxError(f"{what} {path} is not a directory")
    if info.st_uid != os.geteuid():
        raise PolluxError(f"{what} {path} belongs to uid {info.st_uid}, not to the daemon's user")
    if info.st_mode & 0o022:
        os.chmod(path, stat.S_IMODE(info.st_mode) & ~0o022)


def prepare_state_dir(state_dir: Path) -> None:
    """Create the state directory (0755) and ``jobs/`` in it; refuse a state dir that is a
    symlink or that the daemon's user does not own, and remove group/other write (others could
    replace the socket)."""
    state_dir.parent.mkdir(parents=True, exist_ok=True)
    own_directory(state_dir, "state dir", 0o755)
    own_directory(state_dir / "jobs", "jobs dir", 0o755)


def open_private(path: Path, flags: int) -> int:
    """A descriptor of the daemon's own file ``path``, created 0600 when absent, never through
    a symlink; an older file readable by others is made 0600."""
    try:
        fd = os.open(path, flags | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise PolluxError(f"cannot open {path}: {exc.strerror} (a symlink?)") from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid():
        os.close(fd)
        raise PolluxError(f"{path} is not a plain file of the daemon's user")
    if stat.S_IMODE(info.st_mode) & 0o077:
        os.fchmod(fd, 0o600)
    return fd


#: The file whose times say when the daemon was last known alive (:func:`note_alive`).
ALIVE_FILE = "alive"


def note_alive(state_dir: Path, now: float) -> None:
    """Set ``STATE_DIR/alive``'s times to ``now`` (made 0600 when absent): read at the next
    start (:func:`last_alive`).  A failure is ignored (the next pass tries again)."""
    path = state_dir / ALIVE_FILE
    with contextlib.suppress(OSError, PolluxError):
        try:
            os.utime(path, (now, now), follow_symlinks=False)
        except FileNotFoundError:
            os.close(open_private(path, os.O_WRONLY))
            os.utime(path, (now, now), follow_symlinks=False)


def last_alive(state_dir: Path) -> float | None:
    """When the daemon that ran here before was last known alive: the time its last
    scheduling pass gave ``STATE_DIR/alive`` (:func:`note_alive`); ``None`` when there is
    no such file of the daemon's user (a first start, a daemon from before it was kept)."""
    try:
        info = os.lstat(state_dir / ALIVE_FILE)
    except OSError:
        return None
    if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid():
        return None
    return info.st_mtime


def acquire_lock(state_dir: Path) -> IO[str]:
    """Hold ``STATE_DIR/daemon.lock`` (flock, 0600) with this process's pid in it, or refuse:
    another daemon runs on this directory."""
    handle = os.fdopen(open_private(state_dir / "daemon.lock", os.O_RDWR), "r+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        raise PolluxError(f"another daemon is already running on {state_dir}") from None
    handle.seek(0)
    handle.truncate()
    handle.write(f"{os.getpid()}\n")
    handle.flush()
    return handle


class EscapedFormatter(logging.Formatter):
    """A log line with every control character but the newline shown as an escape
    (``untrusted.printable``): a line may quote what a user or a job wrote (a report's field
    name, a path), and an admin reading the log on a terminal must not get its escapes."""

    def format(self, record: logging.LogRecord) -> str:
        return printable(super().format(record))


class JournalFormatter(EscapedFormatter):
    """Lines for journald: each line of a record starts with its syslog priority (``<3>``
    error, ``<4>`` warning, ``<6>`` info, ``<7>`` debug) and has no time (the journal adds
    it), so that a traceback's lines keep the priority of their record."""

    #: lowest level -> syslog priority, most severe first; below INFO: 7 (debug)
    PRIORITIES = {logging.CRITICAL: 2, logging.ERROR: 3, logging.WARNING: 4, logging.INFO: 6}

    def format(self, record: logging.LogRecord) -> str:
        priority = next((p for level, p in self.PRIORITIES.items() if record.levelno >= level), 7)
        text = super().format(record)
        return "\n".join(f"<{priority}>{line}" for line in text.splitlines() or [""])


def stderr_is_journal() -> bool:
    """Whether stderr is the journal stream systemd gave us: ``$JOURNAL_STREAM`` is
    ``DEVICE:INODE`` of that stream, and stderr is still it (not redirected since)."""
    device, _, inode = os.environ.get("JOURNAL_STREAM", "").partition(":")
    try:
        info = os.fstat(2)
        return (info.st_dev, info.st_ino) == (int(device), int(inode))
    except (OSError, ValueError):
        return False


class LogFileHandler(logging.StreamHandler[IO[str]]):
    """``daemon.log``: a line it cannot write (a full disk) is lost from the file alone (every
    line goes to stderr too), said once on stderr in one line instead of a traceback a line.
    With ``path``, once the file reaches ``max_bytes`` it is moved to ``PATH.1`` (replacing
    the one there) and a new one begun."""

    failing = False

    def __init__(
        self, stream: IO[str], path: Path | None = None, max_bytes: int = MAX_LOG_BYTES
    ) -> None:
        super().__init__(stream)
        self.path = path
        self.max_bytes = max_bytes

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.stream.write(self.format(record) + self.terminator)
            self.flush()
            if self.path is not None and self.stream.tell() >= self.max_bytes:
                self._begin_again(self.path)
        except RecursionError:
            raise
        except Exception as exc:  # noqa: BLE001 - whatever the file refuses, the daemon goes on
            if not self.failing:
                reason = getattr(exc, "strerror", None) or exc
                sys.stderr.write(f"daemon.log: cannot write ({reason}); lines go to stderr only\n")
            self.failing = True
            return
        self.failing = False

    def _begin_again(self, path: Path) -> None:
        """Move the full file to ``PATH.1`` and write to a new one (both the daemon's own, in
        its own directory)."""
        with contextlib.suppress(FileNotFoundError):  # moved already by a try that failed
            os.replace(path, path.with_name(path.name + ".1"))
        fresh = os.fdopen(open_private(path, os.O_WRONLY | os.O_APPEND), "a", encoding="utf-8")
        old = self.setStream(fresh)
        if old is not None:
            old.close()


def setup_logging(state_dir: Path, verbose: bool = False) -> None:
    """Log to stderr and to ``STATE_DIR/daemon.log`` (0600, never through a symlink); on a
    stderr that is the journal (:func:`stderr_is_journal`), in :class:`JournalFormatter`'s
    lines."""
    root = logging.getLogger("pollux_local")
    root.setLevel(logging.DEBUG if verbose else logging.INFO)
    fmt = EscapedFormatter("%(asctime)s %(levelname)s %(message)s")
    path = state_dir / "daemon.log"
    stream = os.fdopen(open_private(path, os.O_WRONLY | os.O_APPEND), "a", encoding="utf-8")
    stderr = logging.StreamHandler()
    stderr.setFormatter(JournalFormatter("%(message)s") if stderr_is_journal() else fmt)
    logfile = LogFileHandler(stream, path)
    logfile.setFormatter(fmt)
    root.addHandler(stderr)
    root.addHandler(logfile)
