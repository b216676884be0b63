"""Value types shared by the models, the policies, the simulator and the daemon.

Everything here is plain data: no I/O, no clock, no randomness.  A *placement* is a tuple with
one entry per node (in the order of the ``nodes`` sequence given to a policy) holding the number
of replicas (devices) the job uses on that node; ``()`` or all zeros means "not running".
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
from numpy.typing import ArrayLike, NDArray

Placement = tuple[int, ...]
IntArray = NDArray[np.int64]


@dataclass(frozen=True)
class BatchBounds:
    """The user's batch-size contract.

    ``base_batch`` is M0, the batch the user's hyper-parameters were tuned for; ``max_batch`` is
    M_max; ``min_local``/``max_local`` bound the per-device micro-batch m (memory); with
    ``accumulation`` off, s is always 1.
    """

    base_batch: int
    max_batch: int
    min_local: int = 1
    max_local: int | None = None
    accumulation: bool = True

    @property
    def largest_local(self) -> int:
        """m_max: ``max_local``, else ``max_batch``."""
        return int(self.max_local or self.max_batch)

    def __post_init__(self) -> None:
        if self.base_batch <= 0:
            raise ValueError(f"base batch size must be positive, got {self.base_batch}")
        if self.max_batch < self.base_batch:
            raise ValueError(
                f"max batch size {self.max_batch} is below the base batch size {self.base_batch}"
            )
        if self.min_local <= 0:
            raise ValueError(f"minimum local batch size must be positive, got {self.min_local}")
        if self.max_local is not None and self.max_local < self.min_local:
            raise ValueError(
                f"maximum local batch size {self.max_local} is below the minimum {self.min_local}"
            )


@dataclass(frozen=True)
class GradStats:
    """Gradient statistics: ``sqr`` estimates |G|^2, ``var`` estimates tr(S)/M0."""

    sqr: float
    var: float


@dataclass(frozen=True)
class BatchChoice:
    """A per-job batch configuration: micro-batch m, accumulation steps s, replicas K.

    Total batch M = K * m * s.
    """

    local_batch: int
    accum_steps: int
    replicas: int

    @property
    def total_batch(self) -> int:
        """M = K * m * s, the reverse of :func:`split_batch`."""
        return self.replicas * self.local_batch * self.accum_steps


#: Slack of the roundings in :func:`split_batches` (total batches may be non-integer floats).
_ROUND_EPS = 1e-9


def split_batches(
    total_batch: ArrayLike, replicas: ArrayLike, bounds: BatchBounds
) -> tuple[IntArray, IntArray]:
    """The batch-split rule: total batches M on K replicas as micro-batch m and accumulation
    steps s (vectorised; ``total_batch`` and ``replicas`` broadcast), with M' = min(M, M_max)
    and m_max = ``bounds.largest_local``::

        s = max(1, ceil(M' / (K * m_max)))           (s = 1 without accumulation)
        m = ceil(M' / (K * s))                        if K * ceil(M' / (K * s)) * s <= M_max
            floor(M_max / (K * s))                    otherwise
        m = min(max(m, m_min), m_max)

    i.e. the fewest steps that keep m <= m_max, m rounded up (a full last micro-batch) unless
    that would exceed M_max.  The reverse is M = K * m * s (``BatchChoice.total_batch``).
    With m_min <= m_max, m stays within [m_min, m_max], and K * m * s <= M_max unless m_min
    cannot be met at those s (floor(M_max / (K * s)) < m_min, e.g. K * m_min > M_max): then m
    is m_min.  K < 1 counts as 1.
    """
    k = np.maximum(np.asarray(replicas, dtype=float), 1.0)
    total = np.minimum(np.asarray(total_batch, dtype=float), float(bounds.max_batch))
    m_max = float(bounds.largest_local)
    if bounds.accumulation:
        steps = np.maximum(np.ceil(total / (k * m_max) - _ROUND_EPS), 1.0)
    else:
        steps = np.ones(np.broadcast(total, k).shape)
    up = np.ceil(total / (k * steps) - _ROUND_EPS)
    down = np.floor(float(bounds.max_batch) / (k * steps))
    local = np.where(k * up * steps <= bounds.max_batch, up, down)
    local = np.clip(local, bounds.min_local, m_max)
    return local.astype(np.int64), steps.astype(np.int64)


def split_batch(total_batch: float, replicas: int, bounds: BatchBounds) -> BatchChoice:
    """One total batch M on K replicas as (m, s): :func:`split_batches`' rule."""
    local, steps = split_batches(total_batch, replicas, bounds)
    return BatchChoice(local_batch=int(local), accum_steps=int(steps), replicas=int(replicas))


@dataclass(frozen=True)
class NodeView:
    """A node as a policy sees it: how many devices it offers to the scheduler right now, and
    their type (``""``: untyped; a node's devices are all of one type)."""

    name: str
    devices: int
    up: bool = True
    device_type: str = ""


@dataclass(frozen=True)
class JobView:
    """A job as a policy sees it at one decision instant.

    ``model`` is the job's fitted goodput model (``None`` until it has reported anything: a
    policy then assumes linear speed-up).  ``age_s`` is seconds since submission, ``restarts``
    how many times its allocation changed so far.  ``static_replicas``/``static_batch`` are the
    user's fixed configuration (used by FIFO/Tiresias/Optimus, ignored by goodput policies).
    ``attained_gpu_s`` is GPU-seconds consumed so far (Tiresias).  ``remaining_iters`` is an
    oracle of remaining iterations at ``static_batch`` (Optimus only; ``None`` elsewhere);
    ``static_iter_time_s[k - 1]`` is the (oracle or predicted) seconds per iteration at
    ``static_batch`` on k packed replicas (Optimus; empty elsewhere).  ``progress_fraction`` is
    the share of its declared length the job has done (progress / progress at its last declared
    epoch, in [0, 1]); ``None`` when the job declared no length.  ``time_left_s`` bounds the
    remaining run time from above (a declared time limit); ``allowed_nodes`` restricts where
    it may be placed (a constraint, or the device type chosen for it).

    On a cluster with several device types (``NodeView.device_type``), ``models_by_type`` holds
    the job's model per type, fitted to what was measured on that type (a type absent has none
    yet) and ``model`` the one of the type it runs on; ``type_rates`` are its kind's examples/s
    on one device of each type (a short single-device profile: the speed ratio between types);
    ``restart_cost_s`` is what a restart costs this job (``None``: the policy's default) and
    ``restoring`` says it is still restoring from its last start.  A job's replicas are all of
    one type.

    A ``rigid`` job (a script that does not use the job library) runs on exactly
    ``min_replicas`` devices or waits, and once running is never resized or moved; unless it is
    ``preemptible`` it keeps its devices until it ends (a preemptible one may be stopped and
    queued again, never resized).  Elastic jobs share the devices rigid jobs leave.
    """

    id: str
    owner: str = "default"
    model: GoodputModelLike | None = None
    age_s: float = 0.0
    #: seconds a queued job has waited to run (since it was last queued, its begin time or
    #: the end of its back-off)
    waited_s: float = 0.0
    restarts: int = 0
    min_replicas: int = 1
    max_replicas: int = 1 << 30
    placement: Placement = ()
    submit_time: float = 0.0
    priority: int = 0
    max_profiled_replicas: int = 0
    static_replicas: int = 1
    static_batch: int | None = None
    attained_gpu_s: float = 0.0
    remaining_iters: float | None = None
    run_time_s: float = 0.0
    static_iter_time_s: tuple[float, ...] = ()
    progress_fraction: float | None = None
    rigid: bool = False
    preemptible: bool = False
    #: seconds left before the job's time limit (``None``: no limit): an upper bound on its
    #: remaining run time
    time_left_s: float | None = None
    #: indices (into the policy's ``nodes``) of the nodes the job may run on (``None``: any)
    allowed_nodes: frozenset[int] | None = None
    #: the job's model per device type (``None``: no per-type models; ``model`` serves all)
    models_by_type: Mapping[str, GoodputModelLike] | None = None
    #: examples/s of the job's kind on one device of each type (``None``: not profiled)
    type_rates: Mapping[str, float] | None = None
    #: seconds of progress a restart costs this job (``None``: the policy's default)
    restart_cost_s: float | None = None
    #: seconds a warm resize costs it (a change of count that keeps its running replicas;
    #: ``None``: as a restart)
    warm_resize_cost_s: float | None = None
    #: still restoring from its last (re)start
    restoring: bool = False

    @property
    def replicas(self) -> int:
        return int(sum(self.placement))

    def usable(self, free: Sequence[int]) -> list[int]:
        """``free`` (devices per node) with the nodes the job may not use
        (``allowed_nodes``) at zero."""
        if self.allowed_nodes is None:
            return list(free)
        return [room if i in self.allowed_nodes else 0 for i, room in enumerate(free)]

    @property
    def pinned(self) -> bool:
        """A running rigid job that may not be preempted: it keeps its devices."""
        return self.rigid and not self.preemptible and self.replicas > 0


class GoodputModelLike(Protocol):
    """What a policy needs from a job's model (implemented by ``core.goodput.GoodputModel``)."""

    def best_goodput(
        self, nodes: np.ndarray, replicas: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Vectorised: for each (nodes, replicas) pair the best goodput and its (m, s)."""
        ...


#: Why a job ahead of a waiting one holds devices (:class:`Holder`): a running rigid job that
#: may not be preempted; a higher priority; a running job kept against a less served waiting
#: one (preemption hysteresis); less attained service (least-attained-service admission); the
#: first job waiting for devices, which a rigid job not preempted waits behind
#: (``Waiting("reserved")``).
HOLD_RULES = ("rigid", "priority", "kept", "service", "ahead")


@dataclass(frozen=True)
class Holder:
    """A job holding devices a waiting job would need, and the rule that put it ahead."""

    id: str
    rule: str


@dataclass(frozen=True)
class Waiting:
    """Why a policy left a job waiting, as facts its caller can word.

    ``rule``: ``"size"`` (it needs more devices than the nodes offer now), ``"bounds"`` (no
    replica count within its bounds is feasible), ``"devices"`` (its minimum ``needs`` did not
    fit beside the jobs ahead of it, ``holders``), ``"placement"`` (the devices are there but
    no placement of them fits without sharing nodes with a multi-node job), ``"reserved"`` (a
    rigid job that may not be preempted waits behind the first job left waiting for devices,
    its one holder, with rule ``"ahead"``: started, it would keep its devices until it ends,
    and a stream of such jobs could hold the one ahead back for ever).
    """

    rule: str
    needs: int
    holders: tuple[Holder, ...] = ()


@dataclass(frozen=True)
class Decision:
    """What a policy returns: a placement for every job it was given (zeros = not running)
    and, for the record, a human-readable reason per job; ``waiting`` says, as facts, why
    jobs left waiting wait (a policy may leave it empty)."""

    placements: Mapping[str, Placement]
    reasons: Mapping[str, str] = field(default_factory=dict)
    waiting: Mapping[str, Waiting] = field(default_factory=dict)


class Policy(Protocol):
    """An allocation policy.  The simulator and the daemon call exactly this."""

    name: str

    def decide(
        self,
        jobs: Sequence[JobView],
        nodes: Sequence[NodeView],
        now: float,
        rng: np.random.Generator,
    ) -> Decision: ...
