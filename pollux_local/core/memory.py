"""Per-type batch limits from measured peak memory: the largest local batch that fits a device.

A job on CUDA reports, per local batch m it ran, the peak memory its replica allocated
(``torch.cuda.max_memory_allocated``).  Training memory is nearly linear in m (weights,
gradients and optimizer state are fixed; activations grow with every example)::

    peak(m) = a + b m           (least squares over the measured points)

and a device of ``total`` bytes holds a local batch m when ``peak(m)`` stays within its budget,
a fraction ``1 - margin`` of the total less ``reserve`` (the CUDA context and the allocator's
fragmentation, which ``max_memory_allocated`` does not count)::

    m_max = floor((total (1 - margin) - reserve - a) / b)

With one measured batch, or a fit that barely grows (``b m_max < 0.001 peak_max``: rounding
noise, which would be extrapolated without bound), the peak is taken as proportional to m
through the point of the largest batch (``a = 0``), which over-estimates the growth and so errs
on the side of a smaller batch.  Memory use is a property of the model, not
of the card, so points measured on one type predict the limit of another.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import numpy as np

#: The fraction of a device's memory kept free by default.
DEFAULT_MARGIN = 0.1
#: Bytes kept for the CUDA context and fragmentation by default (512 MiB).
DEFAULT_RESERVE = 512 * 2**20
#: A fitted slope is trusted when b m_max is at least this fraction of the largest peak.
MIN_GROWTH = 1e-3


def fit_peak_memory(points: Iterable[tuple[int, float]]) -> tuple[float, float] | None:
    """(a, b) of ``peak(m) = a + b m`` from (local batch, peak bytes) points, each batch's
    largest peak; ``None`` without a valid point."""
    peaks: dict[int, float] = {}
    for batch, peak in points:
        if batch >= 1 and math.isfinite(peak) and peak > 0:
            peaks[int(batch)] = max(peak, peaks.get(int(batch), 0.0))
    if not peaks:
        return None
    batches = np.array(sorted(peaks), dtype=float)
    values = np.array([peaks[int(m)] for m in batches])
    if len(batches) >= 2:
        slope, intercept = np.polyfit(batches, values, 1)
        if slope * batches[-1] > MIN_GROWTH * values[-1]:
            return float(intercept), float(slope)
    return 0.0, float(values[-1] / batches[-1])


def largest_local_batch(
    points: Iterable[tuple[int, float]],
    total_bytes: float,
    margin: float = DEFAULT_MARGIN,
    reserve_bytes: float = DEFAULT_RESERVE,
) -> int | None:
    """The largest local batch whose predicted peak fits ``total_bytes`` (the module's
    equation); ``None`` without measurements, ``0`` when not even one example fits."""
    if not 0.0 <= margin < 1.0:
        raise ValueError(f"margin must be in [0, 1), got {margin}")
    if total_bytes <= 0 or reserve_bytes < 0:
        raise ValueError(f"need total_bytes > 0 and reserve_bytes >= 0, got {total_bytes}")
    fit = fit_peak_memory(points)
    if fit is None:
        return None
    intercept, slope = fit
    budget = total_bytes * (1.0 - margin) - reserve_bytes
    return max(0, math.floor((budget - intercept) / slope + 1e-9))  # 1e-9: the fit's rounding
