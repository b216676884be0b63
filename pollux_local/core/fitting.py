"""The one way a job's throughput model is fitted from its measurements.

The simulator, the daemon's model cache, the job library's batch choice and the TUI all call
:func:`fit_points`; none of them calls ``fit_throughput`` or ``fit_corrected`` directly.  A
profile point is ``(N, K, m) -> (T_c, T_sync)``: nodes, replicas and local batch of a measured
configuration, and the mean compute time of a non-synchronising micro-batch and of a
synchronising step there.  With ``correct`` the parametric fit carries its measured
log-residuals (``core.correction``), so::

    T_pred(N, K, m) = T_model(N, K, m; theta*) * c(N, K, m),   theta* = argmin fit loss
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from pollux_local.core.correction import TimeCorrection, fit_corrected
from pollux_local.core.pool import Point, Times
from pollux_local.core.throughput import ThroughputParams, fit_throughput

#: The keys of one profile row in a job report (see the report contract in ``pollux_local.api``).
PROFILE_KEYS = ("nodes", "replicas", "local_batch", "compute_s", "step_s")
#: Fits remembered by their points (the most recently used are kept).
FITS_REMEMBERED = 512


@dataclass(frozen=True, eq=False)
class FittedTimes:
    """A fitted throughput model and its measured correction (``None``: the model alone)."""

    params: ThroughputParams
    correction: TimeCorrection | None
    points: int


def points_from_rows(rows: Iterable[Mapping[str, Any]]) -> dict[Point, Times]:
    """Profile rows (``{"nodes", "replicas", "local_batch", "compute_s", "step_s", ...}``) as
    points; a later row for the same (N, K, m) wins.  Raises ``ValueError`` on a malformed row
    (missing key, non-number, non-positive or non-finite value) or a non-iterable ``rows``."""
    try:
        listed = list(rows)
    except TypeError:
        raise ValueError(f"a profile is a list of rows, got {rows!r}") from None
    points: dict[Point, Times] = {}
    for row in listed:
        try:
            key = (int(row["nodes"]), int(row["replicas"]), int(row["local_batch"]))
            times = (float(row["compute_s"]), float(row["step_s"]))
        except (KeyError, TypeError, ValueError, OverflowError) as exc:
            raise ValueError(f"malformed profile row {row!r}: {exc}") from None
        if min(key) < 1 or not all(math.isfinite(t) and t > 0 for t in times):
            raise ValueError(f"profile row out of range: {row!r}")
        points[key] = times
    return points


def fit_points(points: Mapping[Point, Times], *, correct: bool = True) -> FittedTimes:
    """Fit the throughput model to measured points, in the order given (a caller that wants
    an order-free result passes them sorted); with ``correct`` also its residual correction.
    Raises ``ValueError`` when the points cannot be fitted (none, or numerically hopeless).

    The fit is a function of the points alone: the same points in the same order (jobs of
    one kind fitting the same pooled points) get the same, remembered, fit."""
    if not points:
        raise ValueError("cannot fit a throughput model without measured points")
    ordered = tuple(points.items())
    try:
        hash(ordered)
    except TypeError:  # times given as lists or arrays: as numbers
        ordered = tuple(
            ((int(k[0]), int(k[1]), int(k[2])), (float(v[0]), float(v[1])))
            for k, v in points.items()
        )
    return _fit_ordered(ordered, correct)


@functools.lru_cache(maxsize=FITS_REMEMBERED)
def _fit_ordered(ordered: tuple[tuple[Point, Times], ...], correct: bool) -> FittedTimes:
    keys = np.array([k for k, _ in ordered], dtype=float)
    values = np.array([v for _, v in ordered], dtype=float)
    columns = (keys[:, 0], keys[:, 1], keys[:, 2], values[:, 0], values[:, 1])
    try:
        if correct:
            params, correction = fit_corrected(*columns)
        else:
            params, correction = fit_throughput(*columns), None
    except (ArithmeticError, FloatingPointError, np.linalg.LinAlgError) as exc:
        raise ValueError(f"throughput fit failed: {exc}") from None
    return FittedTimes(params=params, correction=correction, points=len(ordered))
