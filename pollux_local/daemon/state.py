"""The daemon's durable state: jobs and the decision log in SQLite (WAL).

Every acknowledged submit is committed with ``synchronous=FULL`` before the daemon replies, so
nothing submitted is lost when the daemon (or the machine) dies.  Other updates use WAL with
``synchronous=NORMAL``: safe against the process being killed, at most the last few state
changes lost on a power cut, which the next scheduling pass repairs.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from pollux_local.api.states import ACTIVE_STATES, TERMINAL_STATES, JobState

__all__ = ["ACTIVE_STATES", "STATES", "TERMINAL_STATES", "JobRecord", "JobState", "StateStore"]

#: Every state, in the order of :class:`JobState` (the database stores their string values).
STATES = tuple(JobState)

_SCHEMA = """
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

#: Samples of goodput / noise scale kept per job (older ones are dropped as new ones come).
HISTORY_LIMIT = 720

_JSON_COLUMNS = frozenset({"spec", "env", "placement", "batch", "pids", "report", "prediction"})


@dataclass
class JobRecord:
    """One job as stored.  ``placement`` maps node name -> device ids; ``batch`` holds the
    current (local_batch, accum_steps, replicas); ``pids`` lists ``{"rank", "pid", "node",
    "create_time"}`` of the running incarnation; ``prediction`` the model's figures
    (goodput, efficiency, speedup) for the current allocation."""

    id: int
    name: str
    owner_uid: int
    owner_gid: int
    owner_name: str
    state: JobState
    spec: dict[str, Any]
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

    @property
    def job_id(self) -> str:
        return str(self.id)

    @property
    def replicas(self) -> int:
        return sum(len(devices) for devices in self.placement.values())


_JOB_COLUMNS = tuple(f.name for f in fields(JobRecord))


_COLUMNS_WITHOUT_ENV = ", ".join(name for name in _JOB_COLUMNS if name != "env")


def _row_to_job(row: sqlite3.Row) -> JobRecord:
    values: dict[str, Any] = {}
    present = set(row.keys())
    for name in _JOB_COLUMNS:
        if name not in present:
            continue
        value = row[name]
        if name in _JSON_COLUMNS and value is not None:
            value = json.loads(value)
        elif name == "state":
            value = JobState(value)
        values[name] = value
    return JobRecord(**values)


def _column_value(name: str, value: Any) -> Any:
    """A job field as its column stores it: JSON text, a state's string value, or as is."""
    if name in _JSON_COLUMNS and value is not None:
        return json.dumps(value)
    if name == "state":
        return JobState(value).value
    return value


class StateStore:
    """SQLite-backed store; one instance per daemon, used from the event-loop thread only."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.db = sqlite3.connect(str(path), isolation_level=None, timeout=30.0)
        self.db.row_factory = sqlite3.Row
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")
        self.db.executescript(_SCHEMA)

    def close(self) -> None:
        self.db.close()

    # --- jobs ---------------------------------------------------------------------------

    def add_job(
        self,
        *,
        name: str,
        owner_uid: int,
        owner_gid: int,
        owner_name: str,
        spec: dict[str, Any],
        priority: int,
        submit_time: float,
        held: bool = False,
        env: dict[str, str] | None = None,
    ) -> JobRecord:
        """Insert a job and commit durably (fsync) before returning."""
        state = JobState.HELD if held else JobState.QUEUED
        self.db.execute("PRAGMA synchronous=FULL")
        try:
            cursor = self.db.execute(
                "INSERT INTO jobs (name, owner_uid, owner_gid, owner_name, state, spec, env,"
                " priority, submit_time) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    name,
                    owner_uid,
                    owner_gid,
                    owner_name,
                    state.value,
                    json.dumps(spec),
                    json.dumps(env or {}),
                    priority,
                    submit_time,
                ),
            )
        finally:
            self.db.execute("PRAGMA synchronous=NORMAL")
        job_id = int(cursor.lastrowid or 0)
        job = self.get_job(job_id)
        assert job is not None
        return job

    def get_job(self, job_id: int) -> JobRecord | None:
        row = self.db.execute("SELECT * FROM jobs WHERE id = ?", (job_id,)).fetchone()
        return _row_to_job(row) if row is not None else None

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
        return [_row_to_job(row) for row in rows]

    def update_job(self, job_id: int, **changes: Any) -> None:
        if not changes:
            return
        for name in changes:
            if name not in _JOB_COLUMNS or name == "id":
                raise KeyError(f"no such job column {name!r}")
        assignments = ", ".join(f"{name} = ?" for name in changes)
        values = [_column_value(name, value) for name, value in changes.items()]
        self.db.execute(f"UPDATE jobs SET {assignments} WHERE id = ?", (*values, job_id))

    def count_jobs(self) -> int:
        return int(self.db.execute("SELECT COUNT(*) FROM jobs").fetchone()[0])

    # --- decision log -------------------------------------------------------------------

    def record_decision(
        self,
        job_id: int,
        time: float,
        kind: str,
        reason: str,
        placement: dict[str, list[str]] | None = None,
        batch: dict[str, Any] | None = None,
    ) -> None:
        self.db.execute(
            "INSERT INTO decisions (time, job_id, kind, placement, batch, reason)"
            " VALUES (?, ?, ?, ?, ?, ?)",
            (time, job_id, kind, json.dumps(placement or {}), json.dumps(batch or {}), reason),
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
