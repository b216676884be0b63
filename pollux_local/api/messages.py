"""Every request a client may send the daemon, and the reply it gets: one typed message each.

A request is ``{"v": 1, "type": T, ...fields}``; ``T`` names exactly one class below
(``Request.__subclasses__``), and its fields are checked strictly: a missing or unknown field,
a wrong type or a value out of range is refused with a one-line error naming the field.  The
caller's identity is never a field: the daemon takes it from the socket's peer credentials.

A reply is ``{"v": 1, "ok": true, ...fields of T.Reply}`` or ``{"v": 1, "ok": false,
"code": CODE, "error": "one line"}`` (``api.errors``).
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from typing import Annotated, Any, ClassVar, Generic, Literal, TypeVar

import msgspec
from msgspec import UNSET, UnsetType

from pollux_local.api.exits import Code, ReplicaExit, Signal
from pollux_local.api.report import JobReport
from pollux_local.api.spec import (
    BatchSize,
    Constraint,
    Count,
    Cpus,
    EpochSeconds,
    GroupName,
    HostMemory,
    JobId,
    MemoryBytes,
    NotifyUrl,
    NotifyWhen,
    Retries,
    Seconds,
    Target,
)
from pollux_local.api.states import JobState

PROTOCOL_VERSION = 1

# --- field types ---------------------------------------------------------------------------

Priority = Annotated[int, msgspec.Meta(ge=-1000, le=1000)]
#: The most characters a job name has.
JOB_NAME_MAX = 128
#: What a job name may not hold: C0 and C1 control characters and the Unicode controls that
#: reorder text (bidirectional embeddings, overrides and isolates; as ``untrusted`` escapes).
_NAME_CONTROLS = r"\x00-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069"
_NAME_CONTROL = re.compile(f"[{_NAME_CONTROLS}]")
#: A job name: printable (no control characters or escapes), at most 128 characters.
JobName = Annotated[
    str,
    msgspec.Meta(min_length=1, max_length=JOB_NAME_MAX, pattern=f"^[^{_NAME_CONTROLS}]+$"),
]


def job_name(base: str, suffix: str = "") -> str:
    """``base + suffix`` as :data:`JobName` takes it, for a name the submitter did not give
    (a script's file name, an array task's ``name[3]``): control characters as ``?``, ``base``
    cut so that the whole has at most :data:`JOB_NAME_MAX` characters, ``job`` for an empty
    ``base``."""
    clean = _NAME_CONTROL.sub("?", base) or "job"
    return clean[: max(JOB_NAME_MAX - len(suffix), 1)] + suffix


def default_job_name(argv: Sequence[str]) -> str:
    """The name of a job submitted without one: its script's file name (skipping a Python
    interpreter and its options), else its program's, made a :data:`JobName`
    (:func:`job_name`)."""
    program = os.path.basename(argv[0]) if argv else ""
    if program.startswith("python"):
        for arg in argv[1:]:
            if not arg.startswith("-"):
                return job_name(os.path.basename(arg))
    return job_name(program)


#: An absolute path.
AbsPath = Annotated[str, msgspec.Meta(min_length=1, max_length=4096, pattern=r"^/[^\x00]*$")]
#: a file-mode creation mask (``umask``), 0 to 0o777
Umask = Annotated[int, msgspec.Meta(ge=0, le=0o777)]
#: an environment variable's name: what ``execve`` can pass (no ``=``, no NUL, not empty)
EnvName = Annotated[str, msgspec.Meta(min_length=1, max_length=4096, pattern=r"^[^=\x00]+$")]
#: an environment variable's value (no NUL)
EnvValue = Annotated[str, msgspec.Meta(max_length=131072, pattern=r"^[^\x00]*$")]
Argument = Annotated[str, msgspec.Meta(max_length=131072, pattern=r"^[^\x00]*$")]


class Message(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Base of every typed message (strict: unknown fields are refused)."""


class Reply(Message):
    """Base of every reply."""


ReplyT = TypeVar("ReplyT", bound=Reply)


class Request(Message, Generic[ReplyT], tag_field="type"):
    """Base of every request; ``Reply`` is the class its answer decodes to (and ``ReplyT``
    the same for the type checker)."""

    v: int = PROTOCOL_VERSION
    Reply: ClassVar[type[Reply]]


# --- replies -------------------------------------------------------------------------------


class Identity(Message):
    uid: int
    name: str


class PingReply(Reply):
    version: int
    pid: int
    state_dir: str
    devices: int
    policy: str
    you: Identity


class SubmitReply(Reply):
    """The new job's id and state; for an array, ``ids`` lists every task's id (``id`` is
    the first, which is also the array's id)."""

    id: str
    state: JobState
    ids: list[str] = msgspec.field(default_factory=list)


#: The ids of the jobs a job waits for that a ``status`` row lists (``show`` lists all): a
#: page of 1,000 rows, each of an array task waiting for 1,000 jobs, made every user's
#: ``status`` a 16 MB reply.
SUMMARY_AFTER_IDS = 8


class JobSummary(Message, kw_only=True):
    """One row of ``status``: a job as the CLI and the TUI list it.

    ``devices`` maps node -> device ids held now; ``batch_size`` is the total batch (m x s x K)
    while running, else the spec's; ``goodput``/``efficiency``/``speedup`` are the model's
    figures for the current allocation (``None`` when not running or not yet fitted);
    ``restarts`` counts resizes and retries after the first start; ``eta_s`` the estimated
    seconds to the end (``None``: unknown).
    """

    id: str
    name: str
    owner: str
    state: JobState
    gpus: int
    devices: dict[str, list[str]]
    nodes: list[str]
    batch_size: int | None
    local_batch: int | None
    accum_steps: int | None
    replicas: int
    goodput: float | None
    efficiency: float | None
    speedup: float | None
    progress: float | None
    epoch: int | None
    metrics: dict[str, float | None]
    eta_s: float | None
    min_gpus: int
    max_gpus: int | None
    priority: int
    restarts: int
    failures: int
    submit_time: float
    start_time: float | None
    end_time: float | None
    run_time_s: float
    reason: str
    target: Target | None
    elastic: bool = False
    preemptible: bool = False
    #: the jobs it waits for: in a ``status`` row the first :data:`SUMMARY_AFTER_IDS` only
    #: (``after_count``: how many in all), in ``show`` all of them
    after: list[str] = msgspec.field(default_factory=list)
    after_count: int = 0
    after_any: bool = False
    after_one: bool = False
    array_id: str | None = None
    array_index: int | None = None
    time_limit_s: float | None = None
    constraint: Constraint | None = None
    #: the device type of the devices it holds (``None`` when it holds none)
    device_type: str | None = None
    gpu_memory: int | None = None
    shared: bool = False
    #: rank 0 reads what ``pollux-local send`` sends it (``--stdin``)
    stdin: bool = False
    #: the group it joined (``--group``; ``None``: none)
    group: str | None = None
    #: the account it is charged to (``--account``; ``None``: none)
    account: str | None = None
    #: not started before this time (Unix time; ``--begin``, ``--delay``; ``None``: at once)
    begin_at: float | None = None
    #: the forecast (queued and running jobs, from the last scheduling pass replayed forward):
    #: when it is expected to start and to finish (Unix times; ``None``: unknown) and on how
    #: many devices; ``expected_start_at_latest`` / ``expected_finish_at_latest``: that time
    #: is an upper bound, not an expectation (it rests on a job of unknown length run until
    #: its time limit: ``core.schedule.forecast``)
    expected_start: float | None = None
    expected_finish: float | None = None
    expected_devices: int | None = None
    expected_start_at_latest: bool = False
    expected_finish_at_latest: bool = False
    #: how its latest incarnation that ended did (``api.exits``: a process killed by signal N
    #: has ``exit_code`` ``None`` and ``exit_signal`` N): the job's code (its first failing
    #: rank's, else 0, or 75 when all checkpointed) and each rank's; ``None`` and empty until
    #: an incarnation ended (a cancel's exit comes a moment after the job reads cancelled)
    exit_code: Code | None = None
    exit_signal: Signal | None = None
    replica_exits: list[ReplicaExit] = msgspec.field(default_factory=list)


class StatusReply(Reply):
    """A page of ``status``: the jobs, oldest first; ``more`` jobs match but are older than
    the page (ask again with ``before_id=next_before_id``); ``hidden`` finished jobs ended
    before the recent window (``all`` shows them)."""

    jobs: list[JobSummary]
    more: Annotated[int, msgspec.Meta(ge=0)] = 0
    hidden: Annotated[int, msgspec.Meta(ge=0)] = 0
    next_before_id: str | None = None


class BatchBoundsView(Message):
    batch_size: int | None
    max_batch_size: int | None
    min_local_batch: int | None
    max_local_batch: int | None


class ReplicaPid(Message):
    rank: int
    pid: int
    node: str
    create_time: float | None = None


class ModelSummary(Message):
    """The job's fitted throughput model: ``params`` (``core.ThroughputParams`` by name), how
    many profile points the job reported itself, how many its kind shares (fitted), and the
    base batch the efficiency is measured against."""

    params: dict[str, float]
    profile_points: int
    fitted_points: int
    base_batch: int


class HistorySample(Message):
    time: float
    goodput: float | None
    noise_scale: float | None


class JobDetail(JobSummary, kw_only=True):
    """``show``: the row of ``status`` and what the job runs, its report, model and history.
    ``env`` is the submitted environment, present only for the job's owner, root or the
    daemon's user (``auth.may_act_for``)."""

    argv: list[str]
    workdir: str
    batch_bounds: BatchBoundsView
    job_dir: str
    pids: list[ReplicaPid]
    report: JobReport | None
    noise_scale: float | None
    model: ModelSummary | None
    history: list[HistorySample]
    env: dict[str, str] | None = None
    #: crash restarts: how many it has had, and how many it may have
    #: (``daemon.executor.exits.retries_allowed``: its ``--retries``, else its kind's default)
    retries_used: int = 0
    retries_allowed: int = 0
    #: the median downtime of its recent resizes as the daemon measured them, by
    #: checkpoint-restart (cold) and in place (warm); ``None``: none measured (the policy
    #: then counts the configured ``restart_cost_s``); and how many resizes each is of
    resize_cold_s: float | None = None
    resize_warm_s: float | None = None
    resizes_cold: int = 0
    resizes_warm: int = 0
    #: where rank 0 of a running job runs: on the daemon's machine (``True``: a ``--stdin``
    #: job's input FIFO is there, for ``pollux-local send``) or on another node; ``None``: not
    #: running
    rank0_local: bool | None = None


class DecisionRecord(Message):
    """One line of a job's decision log: what was decided (``kind``), where, and why."""

    time: float
    job_id: str
    kind: str
    placement: dict[str, list[str]]
    batch: dict[str, int]
    reason: str


class ShowReply(Reply):
    job: JobDetail
    decisions: list[DecisionRecord]


class LogsReply(Reply):
    data: str
    offset: int
    size: int
    state: JobState


class SkippedJob(Message):
    id: str
    state: JobState


class CancelReply(Reply):
    cancelled: list[str]
    skipped: list[SkippedJob]


class JobStateReply(Reply):
    id: str
    state: JobState


class StateChangeReply(Reply):
    """``hold`` and ``release``: the jobs now ``state`` (the one named, or every one that
    ``all`` took: maybe none), and those ``all`` left as they were, with why (id -> one line)."""

    state: JobState
    ids: list[str]
    refused: dict[str, str] = msgspec.field(default_factory=dict)


class PriorityReply(Reply):
    id: str
    priority: int


class NodeRow(Message):
    """One node of ``nodes``: whether it is up, its devices, which are busy outside the
    scheduler, which job holds each (device -> job id), and its load per core."""

    name: str
    host: str
    local: bool
    up: bool
    error: str | None
    devices: list[str]
    busy: list[str]
    jobs: dict[str, str]
    load: float | None
    #: the type of its devices (``[nodes.NAME] type``; ``cpu`` for CPU-backed devices)
    device_type: str = "gpu"
    #: devices reserved by the admin (``[devices] reserved``) or drained at run time: never
    #: given to a new job
    withheld: list[str] = msgspec.field(default_factory=list)
    #: the whole node is drained (``pollux-local drain NODE``)
    drained: bool = False
    #: memory of each of its devices in bytes (``None``: not known)
    memory: int | None = None
    #: devices still held by a job asked to stop whose processes are not yet gone (their
    #: holder is in ``jobs``): free only once those processes are
    stopping: list[str] = msgspec.field(default_factory=list)


class NodesReply(Reply):
    nodes: list[NodeRow]


class ReportReply(Reply):
    accepted: bool


# --- requests ------------------------------------------------------------------------------


class Ping(Request[PingReply], tag="ping", kw_only=True):
    """Is a daemon there, and who am I to it?"""

    Reply = PingReply


class ArrayTask(Message):
    """One task of an array: its index (``POLLUX_ARRAY_INDEX``) and, for a sweep, its own
    command (the sweep's values substituted; ``None``: the array's command)."""

    index: Annotated[int, msgspec.Meta(ge=0, le=1_000_000)]
    argv: Annotated[list[Argument], msgspec.Meta(min_length=1, max_length=4096)] | None = None
    name: JobName | None = None


class Submit(Request[SubmitReply], tag="submit", kw_only=True):
    """Queue a new job: ``argv`` run in ``workdir`` with ``env``; an elastic job between
    ``min_gpus`` and ``max_gpus`` devices and within the batch bounds, a rigid one on exactly
    ``min_gpus``; ``hold`` queues it held."""

    Reply = SubmitReply
    argv: Annotated[list[Argument], msgspec.Meta(min_length=1, max_length=4096)]
    workdir: AbsPath
    name: JobName | None = None
    env: dict[EnvName, EnvValue] = msgspec.field(default_factory=dict)
    #: the submitter's umask, which the job's processes get (``None``: the daemon's)
    umask: Umask | None = None
    min_gpus: Count = 1
    max_gpus: Count | None = None
    batch_size: BatchSize | None = None
    max_batch_size: BatchSize | None = None
    min_local_batch: BatchSize | None = None
    max_local_batch: BatchSize | None = None
    priority: Priority = 0
    target: Target | None = None
    hold: bool = False
    #: the job uses the job library (``ElasticTrainer``): the scheduler may resize it between
    #: ``min_gpus`` and ``max_gpus`` by checkpoint-restart.  Otherwise the job is *rigid*: it
    #: runs on exactly ``min_gpus`` devices and is never resized.
    elastic: bool = False
    #: a rigid job that may be stopped and queued again (it resumes from its own snapshot)
    preemptible: bool = False
    #: start only after these jobs ended: all succeeded, or (``after_any``) however they
    #: ended, or (``after_one``) once one of them succeeded
    after: Annotated[list[JobId], msgspec.Meta(max_length=1000)] = msgspec.field(
        default_factory=list
    )
    after_any: bool = False
    after_one: bool = False
    #: an array: one job per task (``None``: a single job); ``max_running`` caps how many of
    #: them run at once
    array: Annotated[list[ArrayTask], msgspec.Meta(min_length=1, max_length=10_000)] | None = None
    max_running: Count | None = None
    #: the most seconds the job may run (``None``: the daemon's default, if any)
    time_limit_s: Seconds | None = None
    notify: Annotated[list[NotifyUrl], msgspec.Meta(max_length=16)] = msgspec.field(
        default_factory=list
    )
    notify_on: NotifyWhen = "end"
    constraint: Constraint | None = None
    #: the device memory the job uses (bytes); with ``shared``, the job (rigid, one device)
    #: may be packed onto a device with other shared jobs while their memory fits
    gpu_memory: MemoryBytes | None = None
    shared: bool = False
    #: crash restarts before the job fails (``None``: 0 for a rigid job, the daemon's
    #: ``max_retries`` for an elastic one)
    retries: Retries | None = None
    #: start no earlier than this time (seconds since the epoch: ``--begin``, ``--delay``)
    begin_at: EpochSeconds | None = None
    #: the group the job joins (``--group``): its caps and its pause apply
    group: GroupName | None = None
    #: the account it is charged to (one of the config's ``[accounts.NAME]`` its owner may use)
    account: GroupName | None = None
    #: the host memory (bytes) and CPUs the job may use, enforced with cgroups
    host_memory: HostMemory | None = None
    cpus: Cpus | None = None
    #: rank 0 reads its input from a FIFO in the job's directory (``pollux-local send``)
    stdin: bool = False


#: A user name as ``status`` filters by it.
UserName = Annotated[str, msgspec.Meta(min_length=1, max_length=256, pattern=r"^[^\x00-\x1f]+$")]


class Status(Request[StatusReply], tag="status", kw_only=True):
    """Jobs, the newest ``limit`` that match, returned oldest first.  By default the active
    jobs and those that finished in the last 24 hours; ``all``: every finished job too.
    ``user`` (an owner's name), ``group`` and ``states`` filter; ``before_id`` asks for the jobs older
    than that id (the next page, ``StatusReply.next_before_id``)."""

    Reply = StatusReply
    all: bool = False
    user: UserName | None = None
    states: Annotated[list[JobState], msgspec.Meta(min_length=1, max_length=16)] | None = None
    limit: Annotated[int, msgspec.Meta(ge=1, le=10_000)] = 1000
    before_id: JobId | None = None
    #: only the jobs of this group (``--group``)
    group: GroupName | None = None


class Show(Request[ShowReply], tag="show", kw_only=True):
    """One job in full, with its decision log."""

    Reply = ShowReply
    id: JobId


class Logs(Request[LogsReply], tag="logs", kw_only=True):
    """Up to ``max_bytes`` of rank ``rank``'s log from ``offset`` (negative: from the end)."""

    Reply = LogsReply
    id: JobId
    rank: Annotated[int, msgspec.Meta(ge=0, le=1_000_000)] = 0
    offset: Annotated[int, msgspec.Meta(ge=-(2**62), le=2**62)] = 0
    max_bytes: Annotated[int, msgspec.Meta(ge=1, le=2**62)] = 65536


class Cancel(Request[CancelReply], tag="cancel", kw_only=True):
    """Cancel jobs (the owner's or, for an admin, anyone's): ``ids``, and every task of the
    arrays ``arrays`` (an array's id is its first task's id)."""

    Reply = CancelReply
    ids: Annotated[list[JobId], msgspec.Meta(max_length=10_000)] = msgspec.field(
        default_factory=list
    )
    arrays: Annotated[list[JobId], msgspec.Meta(max_length=100)] = msgspec.field(
        default_factory=list
    )


class Hold(Request[StateChangeReply], tag="hold", kw_only=True):
    """Keep a job from being started (stopping it if it runs): the job ``id``, or with ``all``
    every queued job of the caller (running ones keep running); an admin's ``all`` takes the
    admin's own jobs, or ``user``'s when given.  Exactly one of ``id`` and ``all``."""

    Reply = StateChangeReply
    id: JobId | None = None
    all: bool = False
    user: UserName | None = None


class Release(Request[StateChangeReply], tag="release", kw_only=True):
    """Let a held job be scheduled again: the job ``id``, or with ``all`` every held job of
    the caller (an admin: of ``user``, when given).  Exactly one of ``id`` and ``all``."""

    Reply = StateChangeReply
    id: JobId | None = None
    all: bool = False
    user: UserName | None = None


class SetPriority(Request[PriorityReply], tag="set_priority", kw_only=True):
    """Change a job's priority."""

    Reply = PriorityReply
    id: JobId
    priority: Priority


class Nodes(Request[NodesReply], tag="nodes", kw_only=True):
    """The nodes, their health, devices and who holds them."""

    Reply = NodesReply


class Report(Request[ReportReply], tag="report", kw_only=True):
    """A job's report (sent by its rank 0; only the job's owner may send it)."""

    Reply = ReportReply
    job_id: JobId
    report: JobReport


class Restart(Request[SubmitReply], tag="restart", kw_only=True):
    """Submit a job that ended again: the same command, environment and options, a new id."""

    Reply = SubmitReply
    id: JobId
    hold: bool = False


class Edit(Request[JobStateReply], tag="edit", kw_only=True):
    """Change a queued or held job: only the fields given (``UNSET`` leaves one as it is;
    ``time_limit_s`` ``None`` removes the limit, ``max_gpus`` ``None`` the upper bound,
    ``retries`` ``None`` gives back the default for its kind, ``begin_at`` ``None`` lets it
    start now)."""

    Reply = JobStateReply
    id: JobId
    argv: Annotated[list[Argument], msgspec.Meta(min_length=1, max_length=4096)] | UnsetType = UNSET
    min_gpus: Count | UnsetType = UNSET
    max_gpus: Count | None | UnsetType = UNSET
    time_limit_s: Seconds | None | UnsetType = UNSET
    priority: Priority | UnsetType = UNSET
    retries: Retries | None | UnsetType = UNSET
    begin_at: EpochSeconds | None | UnsetType = UNSET


class DeviceUsage(Message):
    """What one user (or everyone, ``user`` ``*``) used: device-hours held in all and by device
    type, how the jobs that ran ended, how long they waited and how well they used what they
    held.

    ``device_hours`` are *held*: devices allocated x time.  ``median_wait_s`` is the median of
    each job's wait from its submit (or its ``--begin`` time, when later: a wait asked for is
    not the queue's) to its first start (``None``: no job started).  ``used_device_hours``
    weighs the held device-hours of each job whose report carries gradient statistics and its
    batch by the statistical efficiency of that batch, E(M) = (phi + M0) / (phi + M) from
    the job's latest report (``core.efficiency``): the device-hours a run at the base batch
    would have needed for the same progress per example; ``measured_device_hours`` are the
    held device-hours of those same jobs (their ratio is the efficiency of what was measured);
    ``None`` and 0 when no job reported both.  Reports are the jobs' own (self-reported)."""

    user: str
    device_hours: float
    by_type: dict[str, float]
    jobs: int
    succeeded: int
    failed: int
    cancelled: int
    running: int
    median_wait_s: float | None = None
    used_device_hours: float | None = None
    measured_device_hours: float = 0.0
    #: in a row of ``usage`` by account: the account (``""``: jobs charged to none)
    account: str | None = None


class UsageReply(Reply):
    """``usage``: one row per user, or per account (``Usage.by``; most device-hours first),
    and the total; ``since`` is the start of the period (``None``: all the history)."""

    users: list[DeviceUsage]
    total: DeviceUsage
    since: float | None


class Usage(Request[UsageReply], tag="usage", kw_only=True):
    """Accounting from the job history: device-hours and jobs per user, since ``since`` (a
    Unix time; ``None``: everything), for ``user`` only when given."""

    Reply = UsageReply
    user: UserName | None = None
    since: Annotated[float, msgspec.Meta(ge=0)] | None = None
    #: one row per user, or (``account``) per account jobs were charged to
    by: Literal["user", "account"] = "user"


class JobForecast(Message):
    """When one job as submitted now is expected to run: ``start`` and ``finish`` (Unix times;
    ``None``: unknown, when a job it waits behind, or itself, has no known length and no time
    limit), on ``devices`` devices of ``device_type`` (``""``: not known yet), ``waiting``
    what it waits for (empty when it would start now) and ``length_s`` the running time it is
    expected to need (``None``: none of its kind has finished); ``start_at_latest`` /
    ``finish_at_latest``: that time is an upper bound, not an expectation (it rests on a job
    of unknown length run until its time limit, this one or one it waits behind)."""

    name: str
    start: float | None
    finish: float | None
    devices: int
    device_type: str
    waiting: str
    length_s: float | None
    start_at_latest: bool = False
    finish_at_latest: bool = False


class EstimateReply(Reply):
    """``now``: the daemon's time of the forecast; one forecast per job the submit would make
    (an array: one per task)."""

    now: float
    jobs: list[JobForecast]


class Estimate(Request[EstimateReply], tag="estimate", kw_only=True):
    """When would ``submit`` run if it were sent now: checked as a submit is, forecast on the
    live state, stored nowhere."""

    Reply = EstimateReply
    submit: Submit


class DrainReply(Reply):
    """The devices and nodes withheld from new jobs after the request (``node`` or
    ``node:device``)."""

    withheld: list[str]


#: A node (``box2``), a device of this machine (``cuda:3``) or a node's device (``box2:cuda:3``).
DrainTarget = Annotated[
    str, msgspec.Meta(min_length=1, max_length=256, pattern=r"^[A-Za-z0-9_.:@+-]+$")
]


class Drain(Request[DrainReply], tag="drain", kw_only=True):
    """Withhold a node or a device from new jobs (an admin's; jobs running there go on)."""

    Reply = DrainReply
    target: DrainTarget


class Resume(Request[DrainReply], tag="resume", kw_only=True):
    """Give a drained node or device back to the scheduler (an admin's)."""

    Reply = DrainReply
    target: DrainTarget


class GroupRow(Message):
    """One group of ``groups``: ``owner`` is ``None`` for an admin's group (``[groups.NAME]``
    in the config; any job may join it), else the user who made it (only that user's jobs
    may); its caps (``None``: none), whether it is paused (its queued jobs do not start; its
    running jobs go on), and its jobs now: running (stopping ones included), holding
    ``devices``, and queued (held ones included)."""

    name: str
    owner: str | None
    max_devices: int | None
    max_running: int | None
    paused: bool
    running: int
    devices: int
    queued: int


class GroupsReply(Reply):
    """Every group: the admin's first, then the users', each by name."""

    groups: list[GroupRow]


class GroupReply(Reply):
    """The group a request made, changed or deleted, as it is now (deleted: as it was)."""

    group: GroupRow


class ListGroups(Request[GroupsReply], tag="groups", kw_only=True):
    """Every group, its caps, pause and jobs."""

    Reply = GroupsReply


class SetGroup(Request[GroupReply], tag="set_group", kw_only=True):
    """Make one of the caller's own groups, or change its caps (``UNSET`` keeps a cap as it
    is, ``None`` removes it; a new group starts without the caps not given).  A user may
    make ``[limits] user_groups`` groups; an admin's groups are the config's alone."""

    Reply = GroupReply
    name: GroupName
    max_devices: Count | None | UnsetType = UNSET
    max_running: Count | None | UnsetType = UNSET


class DeleteGroup(Request[GroupReply], tag="delete_group", kw_only=True):
    """Delete a user's group that no queued, held or running job is in (its owner's, or an
    admin's)."""

    Reply = GroupReply
    name: GroupName


class PauseGroup(Request[GroupReply], tag="pause_group", kw_only=True):
    """Pause a group: its queued jobs wait, its running jobs go on (an admin's group: admins
    only; a user's: its owner or an admin)."""

    Reply = GroupReply
    name: GroupName


class ResumeGroup(Request[GroupReply], tag="resume_group", kw_only=True):
    """Resume a paused group (who may: as ``pause_group``)."""

    Reply = GroupReply
    name: GroupName


#: type tag -> request class
REQUEST_TYPES: dict[str, type[Request[Any]]] = {
    cls.__struct_config__.tag: cls  # type: ignore[misc]
    for cls in (
        Ping,
        Submit,
        Status,
        Show,
        Logs,
        Cancel,
        Hold,
        Release,
        SetPriority,
        Nodes,
        Report,
        Restart,
        Edit,
        Usage,
        Drain,
        Resume,
        Estimate,
        ListGroups,
        SetGroup,
        DeleteGroup,
        PauseGroup,
        ResumeGroup,
    )
}
