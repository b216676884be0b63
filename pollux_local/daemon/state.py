"""The daemon's durable state: jobs and the decision log in SQLite (WAL).

Every acknowledged submit is committed with ``synchronous=FULL`` before the daemon replies, so
nothing submitted is lost when the daemon (or the machine) dies.  Other updates use WAL with
``synchronous=NORMAL``: safe against the process being killed, at most the last few state
changes lost on a power cut, which the next scheduling pass repairs.

Opening the database (:class:`StateStore`, :func:`open_state`) checks it before anything uses
it, each problem refused as one line naming the file and what to do (:class:`StateError`):

* the file is created 0600 before SQLite opens it (its ``-wal`` and ``-shm`` take its mode), it
  must be a plain file of the daemon's user (not a symlink), and older files are made 0600;
* ``PRAGMA quick_check`` must pass: a damaged database is never served from;
* ``meta.schema_version`` says which of :data:`MIGRATIONS` were applied; the missing ones are
  applied in order, each in one transaction; a database from a newer version is refused;
* an empty (0-byte) or missing ``state.db`` beside a ``jobs/`` directory that has entries or a
  ``state.db-wal`` is refused: job history was expected there (:func:`missing_history`).

With ``reset=True`` (``pollux-local daemon --reset-state``) a database refused for any of these
reasons is moved aside, with its ``-wal``/``-shm`` and ``jobs/``, into
``STATE_DIR/reset-<time>/`` (nothing is deleted) and the daemon starts with no job history; a
healthy database is left alone.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import sqlite3
import stat
import time
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import msgspec

from pollux_local.api import errors as api_errors
from pollux_local.api.errors import PolluxError
from pollux_local.api.spec import JobSpec, decode_spec
from pollux_local.api.states import (
    ACTIVE_STATES,
    PLACED_STATES,
    TERMINAL_STATES,
    DecisionKind,
    JobState,
)

__all__ = [
    "ACTIVE_STATES",
    "MIGRATIONS",
    "SCHEMA_VERSION",
    "STATES",
    "TERMINAL_STATES",
    "JobRecord",
    "DecisionEntry",
    "IllegalTransition",
    "JobState",
    "StateDiskFull",
    "StateError",
    "StateStore",
    "open_state",
]

#: Every state, in the order of :class:`JobState` (the database stores their string values).
STATES = tuple(JobState)
#: The files SQLite keeps beside the database.
SIDE_FILES = ("-wal", "-shm", "-journal")


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


class _Connection(sqlite3.Connection):
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


_SCHEMA_V1 = """
CREATE TABLE IF NOT EXISTS jobs (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    name TEXT NOT NULL,
    owner_uid INTEGER NOT NULL,
    owner_gid INTEGER NOT NULL,
    owner_name TEXT NOT NULL,
    state TEXT NOT NULL,
    spec TEXT NOT NULL,
    env TEXT NOT NULL DEFAULT '{}',
    priority INTEGER NOT NULL DEFAULT 0,
    submit_time REAL NOT NULL,
    start_time REAL,
    end_time REAL,
    restarts INTEGER NOT NULL DEFAULT 0,
    failures INTEGER NOT NULL DEFAULT 0,
    retry_after REAL NOT NULL DEFAULT 0,
    reason TEXT NOT NULL DEFAULT '',
    placement TEXT NOT NULL DEFAULT '{}',
    batch TEXT NOT NULL DEFAULT '{}',
    pids TEXT NOT NULL DEFAULT '[]',
    attained_gpu_s REAL NOT NULL DEFAULT 0,
    run_time_s REAL NOT NULL DEFAULT 0,
    last_start REAL,
    report TEXT,
    prediction TEXT NOT NULL DEFAULT '{}'
);
CREATE INDEX IF NOT EXISTS jobs_state ON jobs(state);
CREATE TABLE IF NOT EXISTS decisions (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    time REAL NOT NULL,
    job_id INTEGER NOT NULL,
    kind TEXT NOT NULL,
    placement TEXT NOT NULL DEFAULT '{}',
    batch TEXT NOT NULL DEFAULT '{}',
    reason TEXT NOT NULL DEFAULT ''
);
CREATE INDEX IF NOT EXISTS decisions_job ON decisions(job_id);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS history (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    job_id INTEGER NOT NULL,
    time REAL NOT NULL,
    goodput REAL,
    noise_scale REAL
);
CREATE INDEX IF NOT EXISTS history_job ON history(job_id, id);
"""

_SCHEMA_V2 = """
CREATE INDEX IF NOT EXISTS jobs_end_time ON jobs(end_time);
CREATE INDEX IF NOT EXISTS jobs_owner ON jobs(owner_name);
"""

_SCHEMA_V3 = """
ALTER TABLE jobs ADD COLUMN device_seconds TEXT NOT NULL DEFAULT '{}';
CREATE TABLE IF NOT EXISTS job_ends (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    job_id INTEGER NOT NULL,
    time REAL NOT NULL,
    state TEXT NOT NULL,
    reason TEXT NOT NULL DEFAULT '',
    notified INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS job_ends_pending ON job_ends(notified, id);
CREATE TABLE IF NOT EXISTS withheld (target TEXT PRIMARY KEY, time REAL NOT NULL);
CREATE INDEX IF NOT EXISTS jobs_submit_time ON jobs(submit_time);
"""

_SCHEMA_V4 = """
CREATE TABLE IF NOT EXISTS blobs (
    digest TEXT PRIMARY KEY,
    data TEXT NOT NULL,
    size INTEGER NOT NULL DEFAULT 0
);
ALTER TABLE jobs ADD COLUMN env_ref TEXT;
ALTER TABLE jobs ADD COLUMN argv_ref TEXT;
CREATE INDEX IF NOT EXISTS jobs_owner_state ON jobs(owner_uid, state);
"""

#: The schema's migrations, applied in order: (version, what it does, SQL).  A database
#: records the version it reached in ``meta.schema_version`` (version 1 is the schema of the
#: daemons that recorded none; its statements create only what is missing).
MIGRATIONS: tuple[tuple[int, str, str], ...] = (
    (1, "jobs, decisions, history and meta tables", _SCHEMA_V1),
    (2, "indexes on jobs' end time and owner (status filters)", _SCHEMA_V2),
    (
        3,
        "device-seconds by device type, the outbox of job ends (notifications) and the"
        " devices drained at run time",
        _SCHEMA_V3,
    ),
    (
        4,
        "environments and commands stored once, by content (blobs), and referenced by the"
        " jobs that share them (an array's tasks, a job's restarts); rows written before keep"
        " theirs inline",
        _SCHEMA_V4,
    ),
)
#: The version this daemon writes.
SCHEMA_VERSION = MIGRATIONS[-1][0]

#: Samples of goodput / noise scale kept per job (older ones are dropped as new ones come).
HISTORY_LIMIT = 720

_JSON_COLUMNS = frozenset(
    {"env", "placement", "batch", "pids", "report", "prediction", "device_seconds"}
)


class IllegalTransition(api_errors.Conflict):
    """A state change the :class:`JobState` machine does not allow; nothing was changed."""

    def __init__(self, job_id: int, before: JobState, after: JobState) -> None:
        super().__init__(f"job {job_id} cannot become {after.value}: it is {before.value}")
        self.job_id, self.before, self.after = job_id, before, after


@dataclass(frozen=True)
class DecisionEntry:
    """A line of a job's decision log: what was decided (``kind``) and why; the devices and
    batch it was given, for a start or a resize."""

    kind: DecisionKind
    reason: str
    placement: dict[str, list[str]] | None = None
    batch: dict[str, Any] | None = None


@dataclass(frozen=True)
class JobEnd:
    """One entry of the outbox of job ends: job ``job_id`` reached ``state`` at ``time``."""

    seq: int
    job_id: int
    time: float
    state: JobState
    reason: str


@dataclass
class JobRecord:
    """One job as stored.  ``placement`` maps node name -> device ids; ``batch`` holds the
    current (local_batch, accum_steps, replicas); ``pids`` lists ``{"rank", "pid", "node",
    "create_time"}`` of the running incarnation; ``prediction`` the model's figures
    (goodput, efficiency, speedup) for the current allocation; ``device_seconds`` the
    device-seconds it used by device type (runs that ended; ``attained_gpu_s`` is their sum).
    ``spec`` is typed (:class:`~pollux_local.api.spec.JobSpec`); a dict given here is
    converted (strictly)."""

    id: int
    name: str
    owner_uid: int
    owner_gid: int
    owner_name: str
    state: JobState
    spec: JobSpec
    priority: int = 0
    submit_time: float = 0.0
    start_time: float | None = None
    end_time: float | None = None
    restarts: int = 0
    failures: int = 0
    retry_after: float = 0.0
    reason: str = ""
    placement: dict[str, list[str]] = field(default_factory=dict)
    batch: dict[str, Any] = field(default_factory=dict)
    pids: list[dict[str, Any]] = field(default_factory=list)
    attained_gpu_s: float = 0.0
    run_time_s: float = 0.0
    last_start: float | None = None
    report: dict[str, Any] | None = None
    prediction: dict[str, Any] = field(default_factory=dict)
    #: the submitter's environment; ``None`` when loaded without it (listing many jobs)
    env: dict[str, str] | None = None
    device_seconds: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if isinstance(self.spec, dict):
            self.spec = decode_spec(self.spec)

    @property
    def job_id(self) -> str:
        return str(self.id)

    @property
    def replicas(self) -> int:
        return sum(len(devices) for devices in self.placement.values())


_JOB_COLUMNS = tuple(f.name for f in fields(JobRecord))


#: What a listing reads: every column but the environment (``argv_ref``: the command's blob).
_COLUMNS_WITHOUT_ENV = ", ".join([*(name for name in _JOB_COLUMNS if name != "env"), "argv_ref"])

#: Decoded blobs kept in memory (bytes of their JSON text, in all): a pass reads every queued
#: job's command, and an array's tasks share one.
BLOB_CACHE_BYTES = 64 * 1024 * 1024


def _blob_text(value: list[str] | dict[str, str]) -> tuple[str, bytes]:
    """A blob's digest (SHA-256 of its text) and its text: ``value`` as JSON, keys sorted."""
    text = msgspec.json.encode(value, order="sorted")
    return hashlib.sha256(text).hexdigest(), text


def _row_to_job(row: sqlite3.Row) -> JobRecord:
    values: dict[str, Any] = {}
    present = set(row.keys())
    for name in _JOB_COLUMNS:
        if name not in present:
            continue
        value = row[name]
        if name in _JSON_COLUMNS and value is not None:
            value = json.loads(value)
        elif name == "spec":
            value = _stored_spec(value)
        elif name == "state":
            value = JobState(value)
        values[name] = value
    return JobRecord(**values)


def _stored_spec(raw: str) -> JobSpec:
    """A row's spec.  One without a command or folder (never written by this daemon: a row
    edited by hand, or a test's) still loads, as ``?`` in ``/``, so that one odd row never
    keeps the others from being listed; any other malformation is an error."""
    try:
        return decode_spec(raw)
    except msgspec.ValidationError:
        data = json.loads(raw)
        if not isinstance(data, dict):
            raise
        return decode_spec({"argv": ["?"], "workdir": "/", **data})


def _column_value(name: str, value: Any) -> Any:
    """A job field as its column stores it: JSON text, a state's string value, or as is."""
    if name in _JSON_COLUMNS and value is not None:
        return json.dumps(value)
    if name == "spec":
        spec = decode_spec(value) if isinstance(value, dict) else value
        return spec.to_json()
    if name == "state":
        return JobState(value).value
    return value


# --- opening: files, integrity, schema versions ----------------------------------------------

_WHAT_TO_DO = (
    "stop here and restore it from a backup, or start the daemon with --reset-state to move"
    " it (with jobs/) aside into {dir}/reset-<time>/ and begin with no job history"
)


def _what_to_do(path: Path) -> str:
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
        f" that belongs there is gone; {_what_to_do(path)}"
    )


def set_aside(state_dir: Path, name: str = "state.db", now: float | None = None) -> Path:
    """Move the database, its ``-wal``/``-shm`` and ``jobs/`` into a new
    ``state_dir/reset-<time>/`` (0700; nothing is deleted) and make an empty ``jobs/``."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
    aside = state_dir / f"reset-{stamp}"
    suffix = 0
    while os.path.lexists(aside):
        suffix += 1
        aside = state_dir / f"reset-{stamp}-{suffix}"
    aside.mkdir(mode=0o700)
    for entry in (name, *(name + side for side in SIDE_FILES), "jobs"):
        source = state_dir / entry
        if os.path.lexists(source):
            os.rename(source, aside / entry)
    (state_dir / "jobs").mkdir(mode=0o755)
    os.chmod(state_dir / "jobs", 0o755)
    return aside


class StateStore:
    """SQLite-backed store; one instance per daemon, used from the event-loop thread only.

    Opening it creates the file 0600 when absent, checks it (``quick_check``) and brings its
    schema up to :data:`SCHEMA_VERSION`; :class:`StateError` when it cannot be used."""

    def __init__(self, path: Path) -> None:
        self.path = path
        #: decoded blobs by digest (value, bytes of text), least recently used first
        self._blobs: OrderedDict[str, tuple[Any, int]] = OrderedDict()
        self._blob_bytes = 0
        create_private_file(path)
        try:
            self.db = sqlite3.connect(
                str(path), isolation_level=None, timeout=30.0, factory=_Connection
            )
            self.db._state_path = str(path)
        except sqlite3.Error as exc:
            raise StateError(f"cannot open the state database {path}: {exc}") from None
        try:
            self.db.row_factory = sqlite3.Row
            self._check_integrity()
            self.db.execute("PRAGMA journal_mode=WAL")
            self.db.execute("PRAGMA synchronous=NORMAL")
            self.version = self._migrate()
        except StateError:
            self.db.close()
            raise
        except sqlite3.DatabaseError as exc:
            self.db.close()
            raise StateError(
                f"the state database {path} is damaged ({exc}); {_what_to_do(path)}"
            ) from None
        create_private_file(path)  # the -wal and -shm SQLite made: checked, and 0600
        #: where :func:`open_state` moved a refused database (``None``: nothing was moved)
        self.set_aside_to: Path | None = None

    def _check_integrity(self) -> None:
        """``PRAGMA quick_check``: :class:`StateError` naming the first problem found."""
        rows = [str(row[0]) for row in self.db.execute("PRAGMA quick_check").fetchall()]
        problems = [row for row in rows if row != "ok"]
        if problems:
            more = f" and {len(problems) - 1} more problem(s)" if len(problems) > 1 else ""
            raise StateError(
                f"the state database {self.path} is damaged ({problems[0][:200]}{more});"
                f" {_what_to_do(self.path)}"
            )

    def schema_version(self) -> int:
        """The version the database reached: ``meta.schema_version``, else 0 (an empty
        database, or one written before versions were recorded: migration 1 creates only what
        is missing)."""
        tables = {
            str(row[0])
            for row in self.db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")
        }
        if "meta" in tables:
            row = self.db.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
            if row is not None:
                try:
                    return int(row[0])
                except (TypeError, ValueError):
                    raise StateError(
                        f"the state database {self.path} records schema version {row[0]!r},"
                        f" not a number; {_what_to_do(self.path)}"
                    ) from None
        return 0

    def _migrate(self) -> int:
        """Apply the migrations the database lacks, in order, each in one transaction."""
        version = self.schema_version()
        if version > SCHEMA_VERSION:
            raise StateError(
                f"the state database {self.path} has schema version {version}, newer than this"
                f" pollux-local knows ({SCHEMA_VERSION}): run the version that wrote it (or a"
                f" newer one); starting with --reset-state would set its history aside"
            )
        for number, _what, sql in MIGRATIONS:
            if number <= version:
                continue
            try:
                self.db.executescript(
                    f"BEGIN IMMEDIATE;\n{sql}\nINSERT OR REPLACE INTO meta (key, value)"
                    f" VALUES ('schema_version', '{number}');\nCOMMIT;"
                )
            except sqlite3.Error:
                if self.db.in_transaction:
                    self.db.execute("ROLLBACK")
                raise
            version = number
        return version

    def close(self) -> None:
        self.db.close()

    @contextlib.contextmanager
    def transaction(self) -> Iterator[None]:
        """``BEGIN IMMEDIATE`` ... ``COMMIT``; on any failure the transaction is rolled back
        if it is still open (a ``COMMIT`` refused for a full disk has already ended it) and
        the original error is raised, never one of the rollback's."""
        self.db.execute("BEGIN IMMEDIATE")
        try:
            yield
            self.db.execute("COMMIT")
        except BaseException:
            if self.db.in_transaction:
                with contextlib.suppress(sqlite3.Error):
                    self.db.execute("ROLLBACK")
            raise

    # --- jobs ---------------------------------------------------------------------------

    def add_job(
        self,
        *,
        name: str,
        owner_uid: int,
        owner_gid: int,
        owner_name: str,
        spec: JobSpec | dict[str, Any],
        priority: int,
        submit_time: float,
        held: bool = False,
        env: dict[str, str] | None = None,
        env_of: int | None = None,
    ) -> JobRecord:
        """Insert a job and commit durably (fsync) before returning."""
        job_spec = decode_spec(spec) if isinstance(spec, dict) else spec
        return self.add_jobs(
            name=[name],
            owner_uid=owner_uid,
            owner_gid=owner_gid,
            owner_name=owner_name,
            specs=[job_spec],
            priority=priority,
            submit_time=submit_time,
            held=held,
            env=env,
            env_of=env_of,
        )[0]

    def add_jobs(
        self,
        *,
        name: Sequence[str],
        owner_uid: int,
        owner_gid: int,
        owner_name: str,
        specs: Sequence[JobSpec],
        priority: int,
        submit_time: float,
        held: bool = False,
        env: dict[str, str] | None = None,
        env_of: int | None = None,
        array: bool = False,
    ) -> list[JobRecord]:
        """Insert jobs (one per spec) in one transaction and commit durably (fsync) before
        returning them (without their environment).  With ``array``, they are the tasks of
        one array: each spec's ``array_id`` is set to the first job's id.

        The environment (``env``, or with ``env_of`` the one job ``env_of`` has) and each
        command are stored once, as blobs named by their content: an array's tasks, and a
        job restarted a hundred times, reference one copy (:meth:`_put_blob`)."""
        state = JobState.HELD if held else JobState.QUEUED
        ids: list[int] = []
        self.db.execute("PRAGMA synchronous=FULL")
        try:
            with self.transaction():
                env_ref = self._env_ref(env_of) if env_of is not None else self._put_blob(env or {})
                argv_refs: dict[int, str] = {}  # id(argv) -> digest: tasks sharing one list
                bare: list[JobSpec] = []
                for job_name, spec in zip(name, specs, strict=True):
                    argv_ref = argv_refs.get(id(spec.argv))
                    if argv_ref is None:
                        argv_ref = argv_refs[id(spec.argv)] = self._put_blob(spec.argv)
                    bare.append(msgspec.structs.replace(spec, argv=[]))
                    cursor = self.db.execute(
                        "INSERT INTO jobs (name, owner_uid, owner_gid, owner_name, state, spec,"
                        " env, env_ref, argv_ref, priority, submit_time)"
                        " VALUES (?, ?, ?, ?, ?, ?, '{}', ?, ?, ?, ?)",
                        (
                            job_name,
                            owner_uid,
                            owner_gid,
                            owner_name,
                            state.value,
                            bare[-1].to_json(),
                            env_ref,
                            argv_ref,
                            priority,
                            submit_time,
                        ),
                    )
                    ids.append(int(cursor.lastrowid or 0))
                if array and ids:
                    for job_id, spec in zip(ids, bare, strict=True):
                        tagged = msgspec.structs.replace(spec, array_id=str(ids[0]))
                        self.db.execute(
                            "UPDATE jobs SET spec = ? WHERE id = ?", (tagged.to_json(), job_id)
                        )
        finally:
            self.db.execute("PRAGMA synchronous=NORMAL")
        return self._jobs_by_id(ids)

    def _jobs_by_id(self, ids: Sequence[int]) -> list[JobRecord]:
        """The jobs among ``ids`` that exist, in id order, without environments."""
        found: list[JobRecord] = []
        for start in range(0, len(ids), 500):
            chunk = list(ids[start : start + 500])
            rows = self.db.execute(
                f"SELECT {_COLUMNS_WITHOUT_ENV} FROM jobs"
                f" WHERE id IN ({','.join('?' * len(chunk))}) ORDER BY id",
                chunk,
            ).fetchall()
            found.extend(self._job(row) for row in rows)
        return found

    def get_job(self, job_id: int) -> JobRecord | None:
        """One job, with its environment."""
        row = self.db.execute("SELECT * FROM jobs WHERE id = ?", (job_id,)).fetchone()
        return self._job(row) if row is not None else None

    def count_active(self, owner_uid: int) -> int:
        """The jobs ``owner_uid`` has queued, held or running: what ``[limits]
        max_queued_per_user`` bounds (the one count of what a user holds in the queue)."""
        wanted = sorted(state.value for state in ACTIVE_STATES)
        row = self.db.execute(
            "SELECT COUNT(*) FROM jobs WHERE owner_uid = ?"
            f" AND state IN ({','.join('?' * len(wanted))})",
            (owner_uid, *wanted),
        ).fetchone()
        return int(row[0])

    # --- blobs: environments and commands stored once -----------------------------------

    def stored_bytes(
        self, owner_uid: int, adding: Sequence[list[str] | dict[str, str]] = ()
    ) -> tuple[int, int]:
        """``(held, new)``: bytes of the commands and environments that ``owner_uid``'s queued,
        held and running jobs keep in the state (each blob once, however many jobs share it),
        and bytes of those among ``adding`` that are not kept yet: what ``[limits]
        max_stored_per_user`` bounds."""
        wanted = sorted(state.value for state in ACTIVE_STATES)
        marks = ",".join("?" * len(wanted))
        mine = f"owner_uid = ? AND state IN ({marks})"
        rows = self.db.execute(
            "SELECT digest, size FROM blobs WHERE digest IN ("
            f" SELECT env_ref FROM jobs WHERE {mine}"
            f" UNION SELECT argv_ref FROM jobs WHERE {mine})",
            (owner_uid, *wanted, owner_uid, *wanted),
        ).fetchall()
        kept = {str(digest): int(size) for digest, size in rows}
        (inline,) = self.db.execute(  # rows written before blobs keep their environment inline
            f"SELECT COALESCE(SUM(LENGTH(env)), 0) FROM jobs WHERE {mine} AND env_ref IS NULL",
            (owner_uid, *wanted),
        ).fetchone()
        new: dict[str, int] = {}
        for value in adding:
            digest, text = _blob_text(value)
            if digest not in kept:
                new[digest] = len(text)
        return sum(kept.values()) + int(inline), sum(new.values())

    def _put_blob(self, value: list[str] | dict[str, str]) -> str:
        """Store ``value`` (JSON) under the SHA-256 of its text, once; its digest."""
        digest, text = _blob_text(value)
        self.db.execute(
            "INSERT OR IGNORE INTO blobs (digest, data, size) VALUES (?, ?, ?)",
            (digest, text.decode(), len(text)),
        )
        return digest

    def _env_ref(self, job_id: int) -> str:
        """The blob of job ``job_id``'s environment; a row written before blobs has its inline
        environment moved into one (and then references it)."""
        row = self.db.execute("SELECT env_ref, env FROM jobs WHERE id = ?", (job_id,)).fetchone()
        if row is None:
            return self._put_blob({})
        if row[0] is not None:
            return str(row[0])
        digest = self._put_blob(json.loads(row[1] or "{}"))
        self.db.execute("UPDATE jobs SET env_ref = ?, env = '{}' WHERE id = ?", (digest, job_id))
        return digest

    def _blob(self, digest: str) -> Any:
        """A blob's decoded value, from the in-memory cache when there (``None``: no such
        blob).  Callers copy what they keep."""
        cached = self._blobs.get(digest)
        if cached is not None:
            self._blobs.move_to_end(digest)
            return cached[0]
        row = self.db.execute("SELECT data FROM blobs WHERE digest = ?", (digest,)).fetchone()
        if row is None:
            return None
        text = str(row[0])
        value = msgspec.json.decode(text)
        self._blobs[digest] = (value, len(text))
        self._blob_bytes += len(text)
        while self._blob_bytes > BLOB_CACHE_BYTES and len(self._blobs) > 1:
            _, (_, size) = self._blobs.popitem(last=False)
            self._blob_bytes -= size
        return value

    def _job(self, row: sqlite3.Row) -> JobRecord:
        """A row as a :class:`JobRecord`, its command (and environment, when the row has the
        column) read from their blobs."""
        job = _row_to_job(row)
        present = set(row.keys())
        if "argv_ref" in present and row["argv_ref"] is not None:
            argv = self._blob(row["argv_ref"])
            job.spec = msgspec.structs.replace(
                job.spec, argv=list(argv) if isinstance(argv, list) else ["?"]
            )
        if "env_ref" in present and row["env_ref"] is not None:
            env = self._blob(row["env_ref"])
            job.env = dict(env) if isinstance(env, dict) else {}
        return job

    def jobs(self, states: Iterable[str] | None = None) -> list[JobRecord]:
        """Jobs (without their environments), in submission order."""
        if states is None:
            rows = self.db.execute(
                f"SELECT {_COLUMNS_WITHOUT_ENV} FROM jobs ORDER BY id"
            ).fetchall()
        else:
            wanted = [JobState(state).value for state in states]
            marks = ",".join("?" * len(wanted))
            rows = self.db.execute(
                f"SELECT {_COLUMNS_WITHOUT_ENV} FROM jobs WHERE state IN ({marks}) ORDER BY id",
                wanted,
            ).fetchall()
        return [self._job(row) for row in rows]

    def page_jobs(
        self,
        *,
        states: Iterable[str] | None = None,
        user: str | None = None,
        finished_since: float | None = None,
        before_id: int | None = None,
        limit: int = 1000,
    ) -> tuple[list[JobRecord], int, int]:
        """``(jobs, more, hidden)``: the newest ``limit`` jobs (without environments) that
        match, newest first; ``more`` counts those that match but are older than the page, and
        ``hidden`` the finished jobs left out because they ended before ``finished_since``.

        Filters: ``states``; ``user`` (the owner's name); ``finished_since`` (a time: finished
        jobs only if they ended since; active jobs always); ``before_id`` (ids below it, the
        next page).  The indexes on state, end time and owner do the work (migration 2)."""
        where: list[str] = []
        args: list[Any] = []
        if states is not None:
            wanted = sorted({JobState(state).value for state in states})
            where.append(f"state IN ({','.join('?' * len(wanted))})" if wanted else "0")
            args.extend(wanted)
        if user is not None:
            where.append("owner_name = ?")
            args.append(user)
        if before_id is not None:
            where.append("id < ?")
            args.append(before_id)
        matching, matching_args = list(where), list(args)
        if finished_since is not None:  # each term has its index: the OR is a union
            active = sorted(state.value for state in ACTIVE_STATES)
            marks = ",".join("?" * len(active))
            matching.append(f"(state IN ({marks}) OR end_time IS NULL OR end_time >= ?)")
            matching_args.extend([*active, finished_since])
        clause = f" WHERE {' AND '.join(matching)}" if matching else ""
        # Filtered: find the matches through the indexes, then sort them (``+id``: not by
        # walking every row in id order, which the planner would otherwise pick for the LIMIT).
        order = "+id" if len(matching) > (before_id is not None) else "id"
        rows = self.db.execute(
            f"SELECT {_COLUMNS_WITHOUT_ENV} FROM jobs{clause} ORDER BY {order} DESC LIMIT ?",
            (*matching_args, limit),
        ).fetchall()
        jobs = [self._job(row) for row in rows]
        more = 0
        if len(jobs) == limit:
            more = int(
                self.db.execute(
                    f"SELECT COUNT(*) FROM jobs{clause}{' AND' if clause else ' WHERE'} id < ?",
                    (*matching_args, jobs[-1].id),
                ).fetchone()[0]
            )
        hidden = 0
        if finished_since is not None:
            terminal = [state.value for state in TERMINAL_STATES]
            old = [*where, f"state IN ({','.join('?' * len(terminal))})", "end_time < ?"]
            hidden = int(
                self.db.execute(
                    f"SELECT COUNT(*) FROM jobs WHERE {' AND '.join(old)}",
                    (*args, *terminal, finished_since),
                ).fetchone()[0]
            )
        return jobs, more, hidden

    def update_job(self, job_id: int, **changes: Any) -> None:
        """Change a job's columns other than its state (a state changes through
        :meth:`transition` only: ``ValueError`` here)."""
        if not changes:
            return
        if "state" in changes:
            raise ValueError("a job's state changes through StateStore.transition")
        self._write_job(job_id, changes)

    def transition(
        self,
        job_id: int,
        state: JobState,
        now: float,
        decision: DecisionEntry | None,
        *,
        only_from: Iterable[JobState] | None = None,
        **changes: Any,
    ) -> bool:
        """Move job ``job_id`` to ``state``, with ``changes`` to its other columns, its
        ``decision`` line and, for an end, its entry in the outbox of ends, all in one
        transaction: either all are written or nothing is.

        A move the :class:`JobState` machine does not allow (``JobState.can_become``) raises
        :class:`IllegalTransition`, changing nothing.  With ``only_from``, a job found in
        another state is left as it is and ``False`` returned (a later record of how it ended
        is never overwritten); ``KeyError`` for a job that does not exist."""
        state = JobState(state)
        allowed = None if only_from is None else frozenset(JobState(s) for s in only_from)
        with self.transaction():
            row = self.db.execute("SELECT state, reason FROM jobs WHERE id = ?", (job_id,))
            found = row.fetchone()
            if found is None:
                raise KeyError(f"no job {job_id}")
            before = JobState(found[0])
            if allowed is not None and before not in allowed:
                return False
            if not before.can_become(state):
                raise IllegalTransition(job_id, before, state)
            self._write_job(job_id, {"state": state, **changes})
            if state in TERMINAL_STATES:
                # a job's end and its entry in the outbox of ends (notifications) are one
                # transaction: an end is never recorded without being announced, nor twice
                reason = changes.get("reason", found[1])
                end_time = changes.get("end_time")
                self.db.execute(
                    "INSERT INTO job_ends (job_id, time, state, reason) VALUES (?, ?, ?, ?)",
                    (
                        job_id,
                        float(end_time) if end_time is not None else now,
                        state.value,
                        str(reason),
                    ),
                )
            if decision is not None:
                self.record_decision(
                    job_id, now, decision.kind, decision.reason, decision.placement,
                    decision.batch,
                )  # fmt: skip
        return True

    def _write_job(self, job_id: int, changes: dict[str, Any]) -> None:
        for name in changes:
            if name not in _JOB_COLUMNS or name == "id":
                raise KeyError(f"no such job column {name!r}")
        columns = {name: _column_value(name, value) for name, value in changes.items()}
        if "spec" in changes:  # the command is stored as a blob (shared with equal ones)
            spec = changes["spec"]
            spec = decode_spec(spec) if isinstance(spec, dict) else spec
            columns["spec"] = msgspec.structs.replace(spec, argv=[]).to_json()
            columns["argv_ref"] = self._put_blob(spec.argv)
        if "env" in changes:
            columns["env"], columns["env_ref"] = "{}", self._put_blob(changes["env"] or {})
        assignments = ", ".join(f"{name} = ?" for name in columns)
        values = list(columns.values())
        self.db.execute(f"UPDATE jobs SET {assignments} WHERE id = ?", (*values, job_id))

    # --- the outbox of job ends -----------------------------------------------------------

    def pending_ends(self, limit: int = 100) -> list[JobEnd]:
        """Job ends not yet announced, oldest first."""
        rows = self.db.execute(
            "SELECT id, job_id, time, state, reason FROM job_ends WHERE notified = 0"
            " ORDER BY id LIMIT ?",
            (limit,),
        ).fetchall()
        return [
            JobEnd(
                seq=int(row[0]),
                job_id=int(row[1]),
                time=float(row[2]),
                state=JobState(row[3]),
                reason=str(row[4]),
            )
            for row in rows
        ]

    def pending_ends_by_owner(self, per_owner: int) -> dict[int, tuple[int, list[JobEnd]]]:
        """Job ends not yet announced, by the uid of the job's owner: ``(how many are
        pending, the oldest per_owner of them)``, so that one owner's many ends never hide
        another's (the ends of a job no longer stored come under uid -1)."""
        rows = self.db.execute(
            "SELECT id, job_id, time, state, reason, owner_uid, rank, pending FROM ("
            " SELECT e.id, e.job_id, e.time, e.state, e.reason,"
            "  COALESCE(j.owner_uid, -1) AS owner_uid,"
            "  ROW_NUMBER() OVER (PARTITION BY COALESCE(j.owner_uid, -1) ORDER BY e.id) AS rank,"
            "  COUNT(*) OVER (PARTITION BY COALESCE(j.owner_uid, -1)) AS pending"
            " FROM job_ends e LEFT JOIN jobs j ON j.id = e.job_id WHERE e.notified = 0"
            ") WHERE rank <= ? ORDER BY id",
            (per_owner,),
        ).fetchall()
        by_owner: dict[int, tuple[int, list[JobEnd]]] = {}
        for row in rows:
            end = JobEnd(
                seq=int(row[0]),
                job_id=int(row[1]),
                time=float(row[2]),
                state=JobState(row[3]),
                reason=str(row[4]),
            )
            by_owner.setdefault(int(row[5]), (int(row[7]), []))[1].append(end)
        return by_owner

    def drop_oldest_ends(self, owner_uid: int, keep: int) -> int:
        """Mark announced (never to be sent) the pending ends of ``owner_uid``'s jobs but the
        newest ``keep``; how many."""
        cursor = self.db.execute(
            "UPDATE job_ends SET notified = 1 WHERE id IN ("
            " SELECT e.id FROM job_ends e JOIN jobs j ON j.id = e.job_id"
            " WHERE e.notified = 0 AND j.owner_uid = ? ORDER BY e.id DESC LIMIT -1 OFFSET ?)",
            (owner_uid, keep),
        )
        return int(cursor.rowcount)

    def mark_announced(self, *seqs: int) -> None:
        """Mark the ends ``seqs`` announced (500 to a statement)."""
        for start in range(0, len(seqs), 500):
            chunk = seqs[start : start + 500]
            self.db.execute(
                f"UPDATE job_ends SET notified = 1 WHERE id IN ({','.join('?' * len(chunk))})",
                chunk,
            )

    # --- devices withheld at run time ---------------------------------------------------------

    def withheld(self) -> list[str]:
        """Nodes and devices drained at run time (``node`` or ``node:device``)."""
        rows = self.db.execute("SELECT target FROM withheld ORDER BY target").fetchall()
        return [str(row[0]) for row in rows]

    def set_withheld(self, target: str, withheld: bool, now: float) -> None:
        if withheld:
            self.db.execute(
                "INSERT OR IGNORE INTO withheld (target, time) VALUES (?, ?)", (target, now)
            )
        else:
            self.db.execute("DELETE FROM withheld WHERE target = ?", (target,))

    # --- accounting -------------------------------------------------------------------------

    def usage_rows(self, since: float | None, user: str | None) -> list[JobRecord]:
        """The jobs that ran (or are running) and were submitted or ended since ``since``,
        without environments: what ``usage`` counts."""
        where = ["(attained_gpu_s > 0 OR last_start IS NOT NULL OR start_time IS NOT NULL)"]
        args: list[Any] = []
        if since is not None:
            where.append("(end_time IS NULL OR end_time >= ?)")
            args.append(since)
        if user is not None:
            where.append("owner_name = ?")
            args.append(user)
        rows = self.db.execute(
            f"SELECT {_COLUMNS_WITHOUT_ENV} FROM jobs WHERE {' AND '.join(where)} ORDER BY id",
            args,
        ).fetchall()
        return [self._job(row) for row in rows]

    def requeue_if_placed(self, job_id: int, reason: str, now: float) -> bool:
        """Queue the job again, without placement or processes, if it is still recorded as
        running or rescaling (a later record of how it ended is never overwritten), with a
        ``requeued`` decision."""
        try:
            return self.transition(
                job_id, JobState.QUEUED, now, DecisionEntry(DecisionKind.REQUEUED, reason),
                only_from=PLACED_STATES, placement={}, pids=[], last_start=None, reason=reason,
            )  # fmt: skip
        except KeyError:
            return False

    def array_tasks(self, array_id: int) -> list[JobRecord]:
        """Every task of the array whose first task is job ``array_id`` (restarted tasks
        included), in id order, without environments."""
        rows = self.db.execute(
            f"SELECT {_COLUMNS_WITHOUT_ENV} FROM jobs WHERE id >= ?"
            " AND json_extract(spec, '$.array_id') = ? ORDER BY id",
            (array_id, str(array_id)),
        ).fetchall()
        return [self._job(row) for row in rows]

    def states_of(self, ids: Iterable[int]) -> dict[int, JobState]:
        """The current state of each job that exists among ``ids``."""
        wanted = sorted(set(ids))
        found: dict[int, JobState] = {}
        for start in range(0, len(wanted), 500):
            chunk = wanted[start : start + 500]
            rows = self.db.execute(
                f"SELECT id, state FROM jobs WHERE id IN ({','.join('?' * len(chunk))})", chunk
            ).fetchall()
            found.update((int(row[0]), JobState(row[1])) for row in rows)
        return found

    def count_jobs(self) -> int:
        return int(self.db.execute("SELECT COUNT(*) FROM jobs").fetchone()[0])

    # --- decision log -------------------------------------------------------------------

    def record_decision(
        self,
        job_id: int,
        time: float,
        kind: DecisionKind,
        reason: str,
        placement: dict[str, list[str]] | None = None,
        batch: dict[str, Any] | None = None,
    ) -> None:
        """One line of a job's decision log (a state change writes its own through
        :meth:`transition`)."""
        self.db.execute(
            "INSERT INTO decisions (time, job_id, kind, placement, batch, reason)"
            " VALUES (?, ?, ?, ?, ?, ?)",
            (
                time,
                job_id,
                DecisionKind(kind).value,
                json.dumps(placement or {}),
                json.dumps(batch or {}),
                reason,
            ),
        )

    def decisions(self, job_id: int | None = None, limit: int = 50) -> list[dict[str, Any]]:
        if job_id is None:
            rows = self.db.execute(
                "SELECT * FROM decisions ORDER BY id DESC LIMIT ?", (limit,)
            ).fetchall()
        else:
            rows = self.db.execute(
                "SELECT * FROM decisions WHERE job_id = ? ORDER BY id DESC LIMIT ?",
                (job_id, limit),
            ).fetchall()
        return [
            {
                "time": row["time"],
                "job_id": str(row["job_id"]),
                "kind": row["kind"],
                "placement": json.loads(row["placement"]),
                "batch": json.loads(row["batch"]),
                "reason": row["reason"],
            }
            for row in reversed(rows)
        ]

    # --- per-job history of goodput and noise scale ----------------------------------------

    def add_history(
        self,
        job_id: int,
        time: float,
        goodput: float | None,
        noise_scale: float | None,
        limit: int = HISTORY_LIMIT,
    ) -> None:
        """Append one sample and drop the job's samples beyond the newest ``limit``."""
        self.db.execute(
            "INSERT INTO history (job_id, time, goodput, noise_scale) VALUES (?, ?, ?, ?)",
            (job_id, time, goodput, noise_scale),
        )
        self.db.execute(
            "DELETE FROM history WHERE job_id = ? AND id <= (SELECT id FROM history"
            " WHERE job_id = ? ORDER BY id DESC LIMIT 1 OFFSET ?)",
            (job_id, job_id, limit),
        )

    def history(self, job_id: int) -> list[dict[str, float | None]]:
        """The job's samples, oldest first: ``{"time", "goodput", "noise_scale"}``."""
        rows = self.db.execute(
            "SELECT time, goodput, noise_scale FROM history WHERE job_id = ? ORDER BY id",
            (job_id,),
        ).fetchall()
        return [
            {"time": row["time"], "goodput": row["goodput"], "noise_scale": row["noise_scale"]}
            for row in rows
        ]

    def ids_with_state(self, states: Sequence[str]) -> list[int]:
        marks = ",".join("?" * len(states))
        wanted = [JobState(state).value for state in states]
        rows = self.db.execute(f"SELECT id FROM jobs WHERE state IN ({marks})", wanted)
        return [int(row[0]) for row in rows]


def open_state(state_dir: Path, reset: bool = False, name: str = "state.db") -> StateStore:
    """The daemon's store in ``state_dir``, checked (:class:`StateStore`,
    :func:`missing_history`).  With ``reset``, a database refused for any reason is first moved
    aside (:func:`set_aside`; ``store.set_aside_to`` says where) and a new one started."""
    path = state_dir / name
    try:
        problem = missing_history(state_dir, name)
        if problem is not None:
            raise StateError(problem)
        store = StateStore(path)
    except StateError:
        if not reset:
            raise
        aside = set_aside(state_dir, name)
        store = StateStore(path)
        store.set_aside_to = aside
    return store
