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

Placement = tuple[int, ...]


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
        return self.replicas * self.local_batch * self.accum_steps


@dataclass(frozen=True)
class NodeView:
    """A node as a policy sees it: how many devices it offers to the scheduler right now."""

    name: str
    devices: int
    up: bool = True


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
    epoch, in [0, 1]); ``None`` when the job declared no length.
    """

    id: str
    owner: str = "default"
    model: GoodputModelLike | None = None
    age_s: float = 0.0
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

    @property
    def replicas(self) -> int:
        return int(sum(self.placement))


class GoodputModelLike(Protocol):
    """What a policy needs from a job's model (implemented by ``core.goodput.GoodputModel``)."""

    def best_goodput(
        self, nodes: np.ndarray, replicas: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Vectorised: for each (nodes, replicas) pair the best goodput and its (m, s)."""
        ...


@dataclass(frozen=True)
class Decision:
    """What a policy returns: a placement for every job it was given (zeros = not running)
    and, for the record, a human-readable reason per job."""

    placements: Mapping[str, Placement]
    reasons: Mapping[str, str] = field(default_factory=dict)


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
