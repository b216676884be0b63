"""What the store holds, typed: a job's record, a decision-log line, an end in the outbox,
and how a record's fields map to its columns (a job's report is decoded once, as its row is
loaded, into an :class:`~pollux_local.api.report.JobReport`)."""

from __future__ import annotations

import hashlib
import json
import sqlite3
from dataclasses import dataclass, field, fields
from typing import Any

import msgspec

from pollux_local.api import errors as api_errors
from pollux_local.api.exits import ReplicaExit
from pollux_local.api.report import JobReport
from pollux_local.api.spec import JobSpec, decode_spec
from pollux_local.api.states import (
    DecisionKind,
    JobState,
)

#: Every state, in the order of :class:`JobState` (the database stores their string values).
STATES = tuple(JobState)

JSON_COLUMNS = frozenset(
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
    ``exit_code``/``exit_signal`` and ``replica_exits`` say how its latest incarnation that
    ended did, for the job and per rank (``api.exits``: a signal has no code).
    ``spec`` and ``report`` (the job's latest, :class:`~pollux_local.api.report.JobReport`)
    are typed; a dict given here is converted (strictly)."""

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
    report: JobReport | None = None
    prediction: dict[str, Any] = field(default_factory=dict)
    #: the submitter's environment; ``None`` when loaded without it (listing many jobs)
    env: dict[str, str] | None = None
    device_seconds: dict[str, float] = field(default_factory=dict)
    exit_code: int | None = None
    exit_signal: int | None = None
    replica_exits: list[ReplicaExit] = field(default_factory=list)
    #: when it last became queued (``None``: not since it was submitted)
    queued_since: float | None = None

    def __post_init__(self) -> None:
        if isinstance(self.spec, dict):
            self.spec = decode_spec(self.spec)
        if isinstance(self.report, dict):
            self.report = msgspec.convert(self.report, JobReport)
        if any(not isinstance(item, ReplicaExit) for item in self.replica_exits):
            self.replica_exits = msgspec.convert(self.replica_exits, list[ReplicaExit])

    @property
    def job_id(self) -> str:
        return str(self.id)

    @property
    def replicas(self) -> int:
        return sum(len(devices) for devices in self.placement.values())


JOB_COLUMNS = tuple(f.name for f in fields(JobRecord))


#: What a listing reads: every column but the environment (``argv_ref``: the command's blob).
COLUMNS_WITHOUT_ENV = ", ".join([*(name for name in JOB_COLUMNS if name != "env"), "argv_ref"])

#: Decoded blobs kept in memory (bytes of their JSON text, in all): a pass reads every queued
#: job's command, and an array's tasks share one.
BLOB_CACHE_BYTES = 64 * 1024 * 1024


def blob_text(value: list[str] | dict[str, str]) -> tuple[str, bytes]:
    """A blob's digest (SHA-256 of its text) and its text: ``value`` as JSON, keys sorted."""
    text = msgspec.json.encode(value, order="sorted")
    return hashlib.sha256(text).hexdigest(), text


def stored_row(spec: JobSpec) -> str:
    """The ``spec`` column of a job's row: its settings without its command (a blob)."""
    return msgspec.structs.replace(spec, argv=[]).to_json()


def row_to_job(row: sqlite3.Row) -> JobRecord:
    values: dict[str, Any] = {}
    present = set(row.keys())
    for name in JOB_COLUMNS:
        if name not in present:
            continue
        value = row[name]
        if name == "report":
            value = stored_report(value)
        elif name == "replica_exits":
            value = stored_replica_exits(value)
        elif name in JSON_COLUMNS and value is not None:
            value = json.loads(value)
        elif name == "spec":
            value = _stored_spec(value)
        elif name == "state":
            value = JobState(value)
        values[name] = value
    return JobRecord(**values)


_report_decoder = msgspec.json.Decoder(JobReport)


def stored_report(raw: str | bytes | None) -> JobReport | None:
    """A row's report as its :class:`JobReport`; ``None`` for none, and for one that no longer
    follows the schema (a row from an older daemon, or edited by hand), so that one odd row
    never keeps the job from being listed or scheduled: the job's next report replaces it."""
    if raw is None:
        return None
    try:
        return _report_decoder.decode(raw)
    except (msgspec.ValidationError, msgspec.DecodeError):
        return None


_exits_decoder = msgspec.json.Decoder(list[ReplicaExit])


def stored_replica_exits(raw: str | bytes | None) -> list[ReplicaExit]:
    """A row's replica exits; none for a row that does not hold a list of them (edited by
    hand), so that one odd row never keeps the job from being listed."""
    if not raw:
        return []
    try:
        return _exits_decoder.decode(raw)
    except (msgspec.ValidationError, msgspec.DecodeError):
        return []


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


def column_value(name: str, value: Any) -> Any:
    """A job field as its column stores it: JSON text, a state's string value, or as is."""
    if name == "report" and value is not None:
        report = msgspec.convert(value, JobReport) if isinstance(value, dict) else value
        return msgspec.json.encode(report).decode()
    if name == "replica_exits":
        exits = msgspec.convert(value or [], list[ReplicaExit])
        return msgspec.json.encode(exits).decode()
    if name in JSON_COLUMNS and value is not None:
        return json.dumps(value)
    if name == "spec":
        spec = decode_spec(value) if isinstance(value, dict) else value
        return spec.to_json()
    if name == "state":
        return JobState(value).value
    return value
