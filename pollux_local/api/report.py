"""The job report: what rank 0 of a job tells the daemon about itself (schema version 1).

Rank 0 writes ``$POLLUX_JOB_DIR/report.json`` atomically and, when ``POLLUX_DAEMON_SOCKET`` is
set, sends the same object as a ``report`` request.  Every field is optional but its type is
not: a report with an unknown field or a wrong type is rejected as a whole, with a one-line
reason naming the field.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

REPORT_VERSION = 1

#: Positive integers that fit every consumer (SQLite, numpy int64) with room to spare.
Count = Annotated[int, msgspec.Meta(ge=1, le=2**40)]
NonNegative = Annotated[float, msgspec.Meta(ge=0.0)]
Seconds = Annotated[float, msgspec.Meta(gt=0.0, le=1e9)]


class _Strict(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, omit_defaults=False):
    pass


class ReportBounds(_Strict):
    """The batch bounds the job runs under (its spec's, with its measured largest local batch).

    ``base_batch`` is the batch size the learning rate was tuned for; ``max_batch`` the largest
    total batch; ``min_local``/``max_local`` the per-replica range; ``accumulation`` whether
    gradient accumulation (s > 1) is allowed.
    """

    base_batch: Count
    max_batch: Count | None = None
    min_local: Count | None = None
    max_local: Count | None = None
    accumulation: bool = True


class ProfileRow(_Strict):
    """Mean timings at one configuration: N nodes, K replicas, local batch m.

    ``compute_s`` is the mean time of a micro-batch that does not synchronise, ``step_s`` of one
    that does (compute plus the overlapped all-reduce); ``count`` how many steps were timed.
    """

    nodes: Count
    replicas: Count
    local_batch: Count
    compute_s: Seconds
    step_s: Seconds
    count: Annotated[int, msgspec.Meta(ge=0, le=2**62)] = 0
    #: the type of the devices it was measured on (``None``: untyped)
    device_type: (
        Annotated[str, msgspec.Meta(max_length=64, pattern=r"^[A-Za-z0-9_.+-]+$")] | None
    ) = None


class ReportGradStats(_Strict):
    """Gradient statistics at the base batch: ``sqr`` = |E g|^2 and ``var`` = tr Var(g)."""

    sqr: float
    var: float


class ReportBatch(_Strict):
    """The (m, s, K) the job is running with."""

    local_batch: Count
    accum_steps: Count = 1
    replicas: Count = 1


class MemoryPoint(_Strict):
    """The peak memory one replica allocated (``torch.cuda.max_memory_allocated``) while
    training at local batch ``local_batch`` on a device of type ``device_type`` with
    ``total_bytes`` of memory (from which the scheduler bounds the local batch per type:
    ``core.memory.largest_local_batch``)."""

    device_type: Annotated[
        str, msgspec.Meta(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.:@+-]+$")
    ]
    local_batch: Count
    peak_bytes: Annotated[int, msgspec.Meta(ge=0, le=2**50)]
    total_bytes: Annotated[int, msgspec.Meta(ge=1, le=2**50)]


class JobReport(_Strict):
    """One report.  ``progress`` counts examples trained (scaled by efficiency, as the job
    measures it), ``epoch`` the current epoch and ``epochs`` the declared length (``None``:
    unknown), from which the scheduler estimates the fraction done: ``epoch / epochs``."""

    version: Annotated[int, msgspec.Meta(ge=1, le=REPORT_VERSION)] = REPORT_VERSION
    job_id: str | None = None
    time: float | None = None
    bounds: ReportBounds | None = None
    profile: list[ProfileRow] = msgspec.field(default_factory=list)
    grad_stats: ReportGradStats | None = None
    progress: NonNegative | None = None
    epoch: Annotated[int, msgspec.Meta(ge=0, le=2**40)] | None = None
    epochs: Count | None = None
    batch: ReportBatch | None = None
    metrics: dict[str, float | None] = msgspec.field(default_factory=dict)
    #: seconds to the end, when the job can tell better than the scheduler
    eta_s: NonNegative | None = None
    #: peak memory per local batch on CUDA (``None``: not measured, e.g. on CPU devices)
    memory: Annotated[list[MemoryPoint], msgspec.Meta(max_length=1024)] | None = None
