"""The job report: what rank 0 of a job tells the daemon about itself (schema version 1).

Rank 0 writes ``$POLLUX_JOB_DIR/report.json`` atomically and, when ``POLLUX_DAEMON_SOCKET`` is
set, sends the same object as a ``report`` request.  Every field is optional but its type is
not: a report with an unknown field or a wrong type is rejected as a whole, with a one-line
reason naming the field.

A report is bounded, so that what one job sends costs the daemon a bounded amount whatever
it sends: at most :data:`MAX_PROFILE_ROWS` profile rows, :data:`MAX_MEMORY_POINTS` memory
points and :data:`MAX_METRICS` metrics (names of at most :data:`MAX_NAME_CHARS` characters),
and every number finite and in a range (NaN and infinity are refused).  A job with more
measurements than fit sends the most-timed ones (:func:`bounded_report`, which the job
library applies); the daemon refuses a report over a bound, naming the field.
"""

from __future__ import annotations

import math
from typing import Annotated

import msgspec

from pollux_local.api.spec import BatchSize

REPORT_VERSION = 1

#: Profile rows in one report: configurations (N, K, m, device type) a job measured.
MAX_PROFILE_ROWS = 256
#: Peak-memory points in one report (one per local batch and device type).
MAX_MEMORY_POINTS = 256
#: User metrics in one report, and the length of a metric's name.
MAX_METRICS = 64
MAX_NAME_CHARS = 64
#: The largest magnitude of a free-valued number (a metric, a gradient statistic).
MAX_MAGNITUDE = 1e300

#: Positive integers that fit every consumer (SQLite, numpy int64) with room to spare.
Count = Annotated[int, msgspec.Meta(ge=1, le=2**40)]
NonNegative = Annotated[float, msgspec.Meta(ge=0.0, le=1e18)]
Seconds = Annotated[float, msgspec.Meta(gt=0.0, le=1e9)]
#: A finite number (NaN and infinity are outside every range).
Finite = Annotated[float, msgspec.Meta(ge=-MAX_MAGNITUDE, le=MAX_MAGNITUDE)]
FiniteNonNegative = Annotated[float, msgspec.Meta(ge=0.0, le=MAX_MAGNITUDE)]
MetricName = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_NAME_CHARS)]


class _Strict(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, omit_defaults=False):
    pass


class ReportBounds(_Strict):
    """The batch bounds the job runs under (its spec's, with its measured largest local batch).

    ``base_batch`` is the batch size the learning rate was tuned for; ``max_batch`` the largest
    total batch; ``min_local``/``max_local`` the per-replica range; ``accumulation`` whether
    gradient accumulation (s > 1) is allowed.
    """

    # batch sizes within what a submit accepts (``spec.BatchSize``): the pass's batch
    # candidates are int32 (a reported 2^40 once launched a job at batch -1646287629)
    base_batch: BatchSize
    max_batch: BatchSize | None = None
    min_local: BatchSize | None = None
    max_local: BatchSize | None = None
    accumulation: bool = True


class ProfileRow(_Strict):
    """Mean timings at one configuration: N nodes, K replicas, local batch m.

    ``compute_s`` is the mean time of a micro-batch that does not synchronise, ``step_s`` of one
    that does (compute plus the overlapped all-reduce); ``count`` how many steps were timed.
    """

    nodes: Count
    replicas: Count
    local_batch: BatchSize
    compute_s: Seconds
    step_s: Seconds
    count: Annotated[int, msgspec.Meta(ge=0, le=2**62)] = 0
    #: the type of the devices it was measured on (``None``: untyped)
    device_type: (
        Annotated[str, msgspec.Meta(max_length=64, pattern=r"^[A-Za-z0-9_.+-]+$")] | None
    ) = None


class ReportGradStats(_Strict):
    """Gradient statistics at the base batch: ``sqr`` = |E g|^2 and ``var`` = tr Var(g)."""

    sqr: FiniteNonNegative
    var: FiniteNonNegative


class ReportBatch(_Strict):
    """The (m, s, K) the job is running with."""

    local_batch: BatchSize
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
    local_batch: BatchSize
    peak_bytes: Annotated[int, msgspec.Meta(ge=0, le=2**50)]
    total_bytes: Annotated[int, msgspec.Meta(ge=1, le=2**50)]


Profile = Annotated[list[ProfileRow], msgspec.Meta(max_length=MAX_PROFILE_ROWS)]
Memory = Annotated[list[MemoryPoint], msgspec.Meta(max_length=MAX_MEMORY_POINTS)]
Metrics = Annotated[dict[MetricName, Finite | None], msgspec.Meta(max_length=MAX_METRICS)]


class JobReport(_Strict):
    """One report.  ``progress`` counts examples trained (scaled by efficiency, as the job
    measures it), ``epoch`` the current epoch and ``epochs`` the declared length (``None``:
    unknown), from which the scheduler estimates the fraction done: ``epoch / epochs``."""

    version: Annotated[int, msgspec.Meta(ge=1, le=REPORT_VERSION)] = REPORT_VERSION
    job_id: Annotated[str, msgspec.Meta(max_length=32)] | None = None
    #: when it was made (seconds since the epoch)
    time: Annotated[float, msgspec.Meta(ge=0.0, le=1e11)] | None = None
    bounds: ReportBounds | None = None
    profile: Profile = msgspec.field(default_factory=list)
    grad_stats: ReportGradStats | None = None
    progress: NonNegative | None = None
    epoch: Annotated[int, msgspec.Meta(ge=0, le=2**40)] | None = None
    epochs: Count | None = None
    batch: ReportBatch | None = None
    metrics: Metrics = msgspec.field(default_factory=dict)
    #: seconds to the end, when the job can tell better than the scheduler
    eta_s: NonNegative | None = None
    #: peak memory per local batch on CUDA (``None``: not measured, e.g. on CPU devices)
    memory: Memory | None = None
    #: the job acts on warm resize orders (``api/resize.py``; the job library says so when
    #: its launcher named ``POLLUX_RESIZE_FILE``): only such a job is resized in place
    resizes_in_place: bool = False


def bounded_report(report: JobReport) -> JobReport:
    """``report`` within the bounds the daemon accepts: the :data:`MAX_PROFILE_ROWS`
    most-timed profile rows (largest ``count``; in their order), the first
    :data:`MAX_MEMORY_POINTS` memory points, the first :data:`MAX_METRICS` metrics whose names
    fit, and a metric that is not a finite number of at most :data:`MAX_MAGNITUDE` sent as
    ``None``.  A report within the bounds is returned as it is."""
    profile = report.profile
    if len(profile) > MAX_PROFILE_ROWS:
        ranked = sorted(range(len(profile)), key=lambda i: -profile[i].count)
        keep = set(ranked[:MAX_PROFILE_ROWS])
        profile = [row for i, row in enumerate(profile) if i in keep]
    memory = report.memory
    if memory is not None and len(memory) > MAX_MEMORY_POINTS:
        memory = memory[:MAX_MEMORY_POINTS]
    metrics: dict[str, float | None] = {}
    for name, value in report.metrics.items():
        if len(metrics) == MAX_METRICS:
            break
        if not 1 <= len(name) <= MAX_NAME_CHARS:
            continue
        finite = value is not None and math.isfinite(value) and abs(value) <= MAX_MAGNITUDE
        metrics[name] = value if finite else None
    if profile is report.profile and memory is report.memory and metrics == report.metrics:
        return report
    return msgspec.structs.replace(report, profile=profile, memory=memory, metrics=metrics)
