"""The pure core: throughput, efficiency and goodput models, and allocation policies.

numpy/scipy only: no I/O, no clock, no environment, no torch.  Time and randomness are passed in.
"""

from pollux_local.core.correction import TimeCorrection, fit_corrected
from pollux_local.core.efficiency import (
    efficiency,
    estimate_grad_stats,
    lr_scale,
    noise_scale,
    progress_gain,
)
from pollux_local.core.fitting import FittedTimes, fit_points, points_from_rows
from pollux_local.core.goodput import GoodputModel
from pollux_local.core.pool import ProfilePool
from pollux_local.core.throughput import (
    ThroughputParams,
    fit_throughput,
    predict_compute_time,
    predict_iter_time,
    predict_step_time,
    predict_throughput,
)
from pollux_local.core.types import (
    BatchBounds,
    BatchChoice,
    Decision,
    GradStats,
    JobView,
    NodeView,
    Placement,
    Policy,
    split_batch,
    split_batches,
)

__all__ = [
    "BatchBounds",
    "BatchChoice",
    "Decision",
    "FittedTimes",
    "GoodputModel",
    "GradStats",
    "JobView",
    "NodeView",
    "Placement",
    "Policy",
    "ProfilePool",
    "ThroughputParams",
    "TimeCorrection",
    "efficiency",
    "estimate_grad_stats",
    "fit_corrected",
    "fit_points",
    "fit_throughput",
    "lr_scale",
    "noise_scale",
    "points_from_rows",
    "predict_compute_time",
    "predict_iter_time",
    "predict_step_time",
    "predict_throughput",
    "progress_gain",
    "split_batch",
    "split_batches",
]
