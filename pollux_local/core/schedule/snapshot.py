"""The typed inputs of a scheduling pass: jobs, nodes, what stopping jobs still hold, limits.

Everything is plain, frozen data that a caller builds from its own state (the daemon from its
store, the simulator from its trace): node names and device ids are strings, job ids integers,
models the fitted goodput models (``core.goodput.GoodputModel``) or ``None``.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum

from pollux_local.core.goodput import GoodputModel
from pollux_local.core.sharing import DEFAULT_MAX_JOBS_PER_DEVICE

#: node name -> device ids
Allocation = dict[str, list[str]]


class JobPhase(Enum):
    """Where a job the pass is shown stands: waiting for devices, running, or between two
    sizes (its old processes stopping; the pass leaves it alone)."""

    QUEUED = "queued"
    RUNNING = "running"
    RESCALING = "rescaling"

    @property
    def placed(self) -> bool:
        """Whether the job holds devices (running or rescaling)."""
        return self is not JobPhase.QUEUED


class Outcome(Enum):
    """How far a job another depends on has got: not ended yet, or how it ended."""

    PENDING = "pending"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"


class AfterMode(Enum):
    """What a job's dependencies must do before it starts: all of them succeed (``--after``;
    one that fails or is cancelled fails the job), all of them end however they end
    (``--after-any``), or one of them succeed (``--after-one-of``; the job fails once every
    one has ended without succeeding)."""

    ALL_SUCCEEDED = "all succeeded"
    ALL_ENDED = "all ended"
    ONE_SUCCEEDED = "one succeeded"


@dataclass(frozen=True)
class Dependency:
    """A job this one runs after: its id, its outcome (``None``: no such job) and its state's
    name as a user reads it (``running``, ``held``)."""

    job_id: int
    outcome: Outcome | None
    state: str = ""


@dataclass(frozen=True)
class Constraint:
    """Where a job may run: only on ``nodes`` (when not empty) and only on devices of
    ``device_type`` (when given)."""

    nodes: frozenset[str] = frozenset()
    device_type: str | None = None

    def allows_node(self, name: str, device_type: str) -> bool:
        if self.nodes and name not in self.nodes:
            return False
        return self.device_type is None or self.device_type == device_type


@dataclass(frozen=True)
class JobInput:
    """Everything a pass needs of one job.

    ``allocation`` is what it holds now (node -> device ids), ``replicas`` their count.
    ``attained_gpu_s`` and ``run_time_s`` count its finished runs; the run in progress (since
    ``last_start``) is added at the pass's ``now``.  ``restarts`` counts its starts.  A rigid job
    (``elastic`` false) runs on exactly ``min_devices`` or waits and is never resized; it may
    be stopped only when ``preemptible``.  ``model`` is its model on the cluster's smallest
    device memory; on a cluster of several device types ``models_by_type`` holds its model
    per type and ``type_rates`` its kind's examples/s on one device of each.  ``reason`` and
    ``prediction`` are what is stored now (the plan lists only changes)."""

    id: int
    owner: str = "default"
    phase: JobPhase = JobPhase.QUEUED
    submit_time: float = 0.0
    #: when it last became queued (``None``: at ``submit_time``)
    queued_since: float | None = None
    priority: int = 0
    restarts: int = 0
    allocation: Mapping[str, Sequence[str]] = field(default_factory=dict)
    last_start: float | None = None
    attained_gpu_s: float = 0.0
    run_time_s: float = 0.0
    #: a queued job waits out a back-off after a crash until then
    retry_after: float = 0.0
    min_devices: int = 1
    max_devices: int | None = None
    elastic: bool = True
    preemptible: bool = False
    #: the batch the user's hyper-parameters were tuned for, and the local batch bounds
    batch_size: int | None = None
    min_local_batch: int | None = None
    max_local_batch: int | None = None
    time_limit_s: float | None = None
    constraint: Constraint | None = None
    #: the jobs it runs after, in order; a caller may pass only those that decide (the first
    #: one not met: ``admission.dependency_verdict``) and the ids of the other ones not ended
    #: as ``after_pending`` (the daemon does: a thousand ids cost a pass one object, and the
    #: forecast lets them end one by one)
    after: tuple[Dependency, ...] = ()
    after_mode: AfterMode = AfterMode.ALL_SUCCEEDED
    after_pending: tuple[int, ...] = ()
    array_id: str | None = None
    array_max_running: int | None = None
    shared: bool = False
    #: not started before this time (``--begin``); the group it belongs to (``--group``)
    begin_at: float | None = None
    group: str | None = None
    #: the device memory a shared job declared (bytes)
    gpu_memory: int | None = None
    #: measured seconds a resize cost it (median of its recent ones; ``None``: not measured),
    #: by checkpoint-restart and warm (in place)
    restart_cost_s: float | None = None
    warm_resize_cost_s: float | None = None
    model: GoodputModel | None = None
    models_by_type: Mapping[str, GoodputModel] = field(default_factory=dict)
    type_rates: Mapping[str, float] = field(default_factory=dict)
    #: the most replicas it measured itself on
    max_profiled_replicas: int = 0
    #: share of its declared length done (``None``: no declared length)
    progress_fraction: float | None = None
    reason: str = ""
    prediction: Mapping[str, float] = field(default_factory=dict)

    @property
    def job_id(self) -> str:
        """The id as the policies name jobs."""
        return str(self.id)

    @property
    def replicas(self) -> int:
        return sum(len(devices) for devices in self.allocation.values())

    @property
    def may_stop(self) -> bool:
        """Whether the pass may stop it and queue it again: every elastic job, and a rigid one
        submitted as preemptible."""
        return self.elastic or self.preemptible

    @property
    def needs(self) -> int:
        """The fewest devices it runs on."""
        return int(self.min_devices or 1)

    @property
    def running(self) -> bool:
        """Running on devices now (a resize leaves it to the next pass)."""
        return self.phase is JobPhase.RUNNING and self.replicas > 0


@dataclass(frozen=True)
class NodeInput:
    """A node at decision time: its schedulable devices (in order), whether it is up, their
    type, which are busy outside the scheduler and which are withheld from new jobs (reserved
    or drained, and not held by a job now)."""

    name: str
    devices: tuple[str, ...]
    up: bool = True
    busy: frozenset[str] = frozenset()  # in use by processes outside the scheduler
    device_type: str = "gpu"
    withheld: frozenset[str] = frozenset()
    #: each device's memory (bytes; ``None``: unknown) and, on GPUs that report it, the
    #: memory free on each device now
    memory: int | None = None
    free_memory: Mapping[str, int] = field(default_factory=dict)
    #: CPU-backed test devices: their declared slowdown (``[nodes.NAME] slowdown``)
    slowdown: float | None = None
    #: devices still held by jobs asked to stop whose processes are not yet gone
    #: (device -> job id): no other job is placed there until they are
    stopping: Mapping[str, int] = field(default_factory=dict)

    @functools.cached_property
    def free_devices(self) -> tuple[str, ...]:
        """The devices up and neither busy, withheld nor stopping (computed once: a node's
        facts do not change after it is made)."""
        if not self.up:
            return ()
        return tuple(
            d
            for d in self.devices
            if d not in self.busy and d not in self.withheld and d not in self.stopping
        )


@dataclass(frozen=True)
class Holding:
    """A job asked to stop (cancelled, held, preempted, at its time limit) whose processes
    are not yet gone: its owner still holds its ``devices`` (node -> device ids), in every
    cap and on every node view, until they are gone."""

    job_id: int
    owner: str
    devices: Mapping[str, Sequence[str]]
    #: the group it belongs to (``None``: none): it counts in its group's caps too
    group: str | None = None
    #: the array it is a task of (``None``: none): it counts in its ``--max-running`` too
    array_id: str | None = None

    @property
    def count(self) -> int:
        return sum(len(devices) for devices in self.devices.values())


@dataclass(frozen=True)
class GroupLimit:
    """A group's caps on its jobs (``None``: none): devices they hold and jobs running at
    once; while ``paused`` none of its queued jobs starts (its running jobs go on).
    ``owner``: the user whose group it is, whose jobs alone are in it (``None``: an admin's
    group, which any job may join)."""

    max_devices: int | None = None
    max_running: int | None = None
    paused: bool = False
    owner: str | None = None

    def has_member(self, owner: str) -> bool:
        """Whether a job of ``owner`` naming this group is in it."""
        return self.owner is None or self.owner == owner


@dataclass(frozen=True)
class Limits:
    """Per-user caps (``None``: none), the slowdown beta of jobs sharing a device
    (``core.sharing``) and each group's caps and pause by name (a job naming a group not
    listed has no group caps)."""

    max_devices_per_user: int | None = None
    max_running_per_user: int | None = None
    share_slowdown: float = 0.25
    #: how many shared jobs one device may run (``[devices] max_jobs_per_device``)
    max_jobs_per_device: int = DEFAULT_MAX_JOBS_PER_DEVICE
    groups: Mapping[str, GroupLimit] = field(default_factory=dict)


@dataclass(frozen=True)
class Snapshot:
    """One pass's inputs: the jobs (queued, running, rescaling), the nodes in order, the
    devices stopping jobs still hold, the limits and the time.  ``explain``: whether the plan
    carries what people read, the predicted figures of placed jobs and the words of the
    reasons (the simulator, which applies allocations only, asks for neither; the decisions
    are the same either way)."""

    jobs: Sequence[JobInput]
    nodes: Sequence[NodeInput]
    now: float
    limits: Limits = Limits()
    holdings: Sequence[Holding] = ()
    explain: bool = True
