"""What a job is asked to be, as the daemon stores it: :class:`JobSpec`.

A spec is built once, from a checked ``Submit`` (or ``Restart``/``Edit``), stored as JSON in the
job's row and read back strictly: every part of the daemon (scheduler, executor, read model)
reads these typed fields, never a dict.  Fields added later have defaults, so the rows of an
older daemon still decode (a row without ``elastic`` was stored when every job was elastic).
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

#: A job id as sent on the wire: decimal digits.
JobId = Annotated[str, msgspec.Meta(pattern=r"^[0-9]{1,15}$", description="a job id")]
#: Device counts: positive, and far below anything that overflows.
Count = Annotated[int, msgspec.Meta(ge=1, le=1_000_000)]
BatchSize = Annotated[int, msgspec.Meta(ge=1, le=2**31 - 1)]
#: A time limit in seconds: at least one second, at most a year.
Seconds = Annotated[float, msgspec.Meta(ge=1.0, le=366 * 86400.0)]
#: Bytes of device memory a job declares it uses.
MemoryBytes = Annotated[int, msgspec.Meta(ge=1, le=2**50)]
#: A node name or a device type as a constraint names it.
Word = Annotated[str, msgspec.Meta(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.:@+-]+$")]
#: A notification destination: an ``apprise`` URL (``mailto://``, ``ntfy://``, ``json://``...).
NotifyUrl = Annotated[
    str, msgspec.Meta(min_length=3, max_length=2048, pattern=r"^[a-z][a-z0-9+.-]*://[^\s\x00]+$")
]
#: A group's name: a word users type (``--group small``).
GroupName = Annotated[str, msgspec.Meta(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")]
#: Crash restarts a job may have before it fails.
Retries = Annotated[int, msgspec.Meta(ge=0, le=100)]
#: A time as seconds since the epoch (from 2020 to 2100).
EpochSeconds = Annotated[float, msgspec.Meta(ge=1.5e9, le=4.1e9)]
#: Host memory a job may use (bytes): at least 4 MiB.
HostMemory = Annotated[int, msgspec.Meta(ge=4 << 20, le=2**50)]
#: CPUs a job may use (fractions allowed: ``0.5``).
Cpus = Annotated[float, msgspec.Meta(ge=0.01, le=4096.0)]
#: When a job's notifications are sent: when it ends however it ends, or only when it fails.
NotifyWhen = Literal["end", "failure"]


class Target(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The quality a job aims for: ``metric`` reaches ``value`` (``mode`` max: at least it)."""

    metric: Annotated[str, msgspec.Meta(min_length=1, max_length=128)]
    value: float
    mode: Literal["max", "min"] = "max"

    def reached(self, measured: float) -> bool:
        """``measured >= value`` (mode max) or ``measured <= value`` (mode min)."""
        return measured >= self.value if self.mode == "max" else measured <= self.value

    def final_line(self, measured: float) -> str:
        """``TARGET REACHED metric=… value=…`` or ``TARGET MISSED metric=… value=… target=…``
        (the line a job prints last)."""
        if self.reached(measured):
            return f"TARGET REACHED metric={self.metric} value={measured:.4f}"
        sign = ">=" if self.mode == "max" else "<="
        return (
            f"TARGET MISSED metric={self.metric} value={measured:.4f} target={sign}{self.value:g}"
        )


class Constraint(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Where a job may run: only on ``nodes`` (when given) and only on devices of
    ``device_type`` (when given)."""

    nodes: Annotated[list[Word], msgspec.Meta(max_length=256)] = msgspec.field(default_factory=list)
    device_type: Word | None = None

    def allows_node(self, name: str, device_type: str) -> bool:
        if self.nodes and name not in self.nodes:
            return False
        return self.device_type is None or self.device_type == device_type

    def describe(self) -> str:
        parts = []
        if self.nodes:
            parts.append("nodes " + ",".join(self.nodes))
        if self.device_type:
            parts.append(f"type {self.device_type}")
        return " and ".join(parts)


class JobSpec(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """A stored job's specification.

    ``after``: job ids that must end first; with ``after_any`` and ``after_one`` false they must
    all succeed (one that fails or is cancelled fails this job), with ``after_any`` true it is
    enough that they ended, with ``after_one`` true that one of them succeeded (the job fails
    once every one ended and none succeeded).  ``array_id``/``array_index``: the array this job
    is a task of (the array's id is its first task's id) and its index in it;
    ``array_max_running`` caps the array's tasks running at once.  ``time_limit_s``: the most
    seconds the job may run (its time running, across restarts), then it is stopped and fails.
    ``notify``: destinations told when it ends (``notify_on`` ``failure``: only when it fails).
    ``shared``: a small rigid job on one device that may be packed onto a device with other
    shared jobs while their declared ``gpu_memory`` fits the device's.
    """

    argv: list[str]
    workdir: str
    min_gpus: int = 1
    max_gpus: int | None = None
    batch_size: int | None = None
    max_batch_size: int | None = None
    min_local_batch: int | None = None
    max_local_batch: int | None = None
    target: Target | None = None
    #: uses the job library: the scheduler may resize it (default for rows stored before)
    elastic: bool = True
    preemptible: bool = False
    after: list[str] = msgspec.field(default_factory=list)
    after_any: bool = False
    after_one: bool = False
    array_id: str | None = None
    array_index: int | None = None
    array_max_running: int | None = None
    time_limit_s: float | None = None
    notify: list[str] = msgspec.field(default_factory=list)
    notify_on: NotifyWhen = "end"
    constraint: Constraint | None = None
    #: device memory the job declares it uses (bytes), and whether it may share its device
    #: with other such jobs (a rigid one-device job only)
    gpu_memory: int | None = None
    shared: bool = False
    #: crash restarts before it fails (``None``: the default for its kind,
    #: ``daemon.executor.exits.retries_allowed``)
    retries: int | None = None
    #: not started before this time (seconds since the epoch; ``--begin``, ``--delay``)
    begin_at: float | None = None
    #: the group it belongs to (``--group``): the group's caps and pause apply to it
    group: str | None = None
    #: the account it is charged to (``--account``: an ``[accounts.NAME]`` of the config)
    account: str | None = None
    #: host memory (bytes) and CPUs it may use, enforced with cgroups (``--mem``, ``--cpus``)
    host_memory: int | None = None
    cpus: float | None = None
    #: the file-mode creation mask its processes get (the submitter's; ``None``: the daemon's)
    umask: int | None = None
    #: rank 0 reads its input from the FIFO ``JOB_DIR/stdin`` (``--stdin``), which
    #: ``pollux-local send`` writes to; otherwise every rank reads ``/dev/null``
    stdin: bool = False

    def to_json(self) -> str:
        return msgspec.json.encode(self).decode()


def decode_spec(raw: str | bytes | dict[str, object]) -> JobSpec:
    """A stored spec (JSON text or its dict) as a :class:`JobSpec`; ``msgspec.ValidationError``
    names the field when it is not one."""
    if isinstance(raw, dict):
        return msgspec.convert(raw, JobSpec)
    return msgspec.json.decode(raw, type=JobSpec)
