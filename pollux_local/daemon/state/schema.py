"""The schema of the state database and its migrations, applied in order."""

from __future__ import annotations

import sqlite3
from collections.abc import Callable

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

_SCHEMA_V5 = """
ALTER TABLE jobs ADD COLUMN exit_code INTEGER;
ALTER TABLE jobs ADD COLUMN exit_signal INTEGER;
ALTER TABLE jobs ADD COLUMN replica_exits TEXT NOT NULL DEFAULT '[]';
CREATE TABLE IF NOT EXISTS groups (
    name TEXT PRIMARY KEY,
    owner_uid INTEGER,
    owner_name TEXT,
    max_devices INTEGER,
    max_running INTEGER,
    paused INTEGER NOT NULL DEFAULT 0,
    time REAL NOT NULL
);
"""

_SCHEMA_V6 = """
CREATE INDEX IF NOT EXISTS jobs_argv_ref ON jobs(argv_ref);
CREATE INDEX IF NOT EXISTS jobs_env_ref ON jobs(env_ref);
CREATE INDEX IF NOT EXISTS jobs_owner_kept
    ON jobs(owner_uid, state, (LENGTH(spec) + LENGTH(name)), argv_ref, env_ref);
DELETE FROM blobs WHERE digest NOT IN (SELECT argv_ref FROM jobs WHERE argv_ref IS NOT NULL)
    AND digest NOT IN (SELECT env_ref FROM jobs WHERE env_ref IS NOT NULL);
"""

_SCHEMA_V7 = """
CREATE INDEX IF NOT EXISTS blobs_size ON blobs(digest, size);
"""

_SCHEMA_V8 = """
CREATE TABLE IF NOT EXISTS dependency_outcomes (
    id INTEGER PRIMARY KEY,
    state TEXT NOT NULL
);
"""


def _schema_v9(db: sqlite3.Connection) -> None:
    """The holds admins put on other users' jobs; when each job was last queued.  Written to
    run again on a database that has them (as the SQL ones do: a column is added only where
    it is missing)."""
    db.execute("CREATE TABLE IF NOT EXISTS admin_holds (id INTEGER PRIMARY KEY)")
    columns = {str(row[1]) for row in db.execute("PRAGMA table_info(jobs)")}
    if "queued_since" not in columns:
        db.execute("ALTER TABLE jobs ADD COLUMN queued_since REAL")


#: The schema's migrations, applied in order: (version, what it does, SQL, or a function
#: of the connection run in the migration's transaction).  A database
#: records the version it reached in ``meta.schema_version`` (version 1 is the schema of the
#: daemons that recorded none; its statements create only what is missing).
MIGRATIONS: tuple[tuple[int, str, str | Callable[[sqlite3.Connection], None]], ...] = (
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
    (
        5,
        "a job's exit code and signal, for the job and per replica; groups (a user's own"
        " groups, and every group's pause)",
        _SCHEMA_V5,
    ),
    (
        6,
        "indexes on the blobs a job references, and on what an owner's jobs keep (each"
        " row's size: counting it read every row in full); the blobs no job references"
        " removed (an edit left its job's old command behind, for ever)",
        _SCHEMA_V6,
    ),
    (
        7,
        "an index of each blob's size, so that what a user's jobs keep is summed without"
        " reading the blobs (the ended jobs' bytes, counted each minute: 20 ms for 3,000)",
        _SCHEMA_V7,
    ),
    (
        8,
        "how each removed ended job that active jobs wait for ended (its id and state), so"
        " that retention removes its row: an --after list kept a thousand rows each, for"
        " as long as the job waiting stayed",
        _SCHEMA_V8,
    ),
    (
        9,
        "the held jobs an admin (not their owner) held, which only an admin releases; when"
        " each job was last queued (how long it has waited for devices)",
        _schema_v9,
    ),
)
#: The version this daemon writes.
SCHEMA_VERSION = MIGRATIONS[-1][0]

#: Decisions kept per job, the newest, as many as ``show`` prints: a user's loop of edits, or
#: of holds and releases, on one job added a row each, 850 a second, for as long as the job
#: was active (retention removes only ended jobs); and the 10,000 ended jobs a user keeps
#: would keep 1,000 each (about 620 MB) at a cap of 1,000.
DECISIONS_LIMIT = 100
#: Samples of goodput / noise scale kept per job (older ones are dropped as new ones come).
HISTORY_LIMIT = 720
