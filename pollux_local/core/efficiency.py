"""Statistical efficiency from the gradient noise scale, and learning-rate scaling rules.

With ``sqr`` ~ |G|^2 and ``var`` ~ tr(S)/M0 (see ``estimate_grad_stats``):

* noise scale       phi = M0 * var / sqr                      (examples)
* efficiency        E(M) = (phi + M0) / (phi + M)   for M >= M0, and 1 for M <= M0
* progress gain     r(M) = M/M0 * E(M)  base-batch iterations per iteration at batch M
* AdaScale          lr(M) = lr0 * r,  r = (var + sqr) / (var/S + sqr),  S = M/M0

The AdaScale gain equals the progress gain: S(var+sqr)/(var+S*sqr) = S(phi+M0)/(phi+S*M0).
"""

from __future__ import annotations

from typing import Literal

import numpy as np
from numpy.typing import ArrayLike, NDArray

from pollux_local.core.types import GradStats

FloatArray = NDArray[np.float64]
LrRule = Literal["adascale", "sqrt", "linear", "legw"]
LR_RULES: tuple[LrRule, ...] = ("adascale", "sqrt", "linear", "legw")

#: Floor on |G|^2 so that a vanishing gradient gives a huge, finite noise scale.
_SQR_FLOOR = 1e-30


def noise_scale(stats: GradStats, base_batch: float) -> float:
    """phi = M0 * var / sqr (clamped to be finite and non-negative)."""
    var = max(float(stats.var), 0.0)
    sqr = max(float(stats.sqr), _SQR_FLOOR)
    return float(base_batch) * var / sqr


def efficiency(stats: GradStats, base_batch: float, total_batch: ArrayLike) -> FloatArray:
    """E(M) = (phi + M0) / (phi + max(M, M0)), in (0, 1] and non-increasing in M."""
    phi = noise_scale(stats, base_batch)
    m: FloatArray = np.maximum(np.asarray(total_batch, dtype=float), float(base_batch))
    return (phi + base_batch) / (phi + m)


def progress_gain(stats: GradStats, base_batch: float, total_batch: ArrayLike) -> FloatArray:
    """r(M) = M/M0 * E(M): base-batch iterations of progress made by one iteration at M."""
    m = np.asarray(total_batch, dtype=float)
    return m / float(base_batch) * efficiency(stats, base_batch, m)


def lr_scale(
    stats: GradStats | None,
    base_batch: float,
    total_batch: float,
    rule: LrRule = "adascale",
) -> float:
    """Factor to multiply the base learning rate by when training at batch M.

    ``adascale``: r = (var + sqr)/(var/S + sqr) (needs stats; 1 without them),
    ``sqrt`` and ``legw``: sqrt(S), ``linear``: S, with S = M/M0.  LEGW also stretches warm-up
    by S; that is the caller's schedule's business (progress-based warm-up does it for free).
    """
    scale = float(total_batch) / float(base_batch)
    if rule == "linear":
        return scale
    if rule in ("sqrt", "legw"):
        return float(np.sqrt(scale))
    if rule == "adascale":
        if stats is None:
            return 1.0
        return float(progress_gain(stats, base_batch, total_batch))
    raise ValueError(f"unknown learning-rate rule {rule!r}; expected one of {', '.join(LR_RULES)}")


def estimate_grad_stats(
    mean_sq_norm_single: float,
    sq_norm_mean: float,
    count: int,
    batch_each: float,
    base_batch: float,
) -> GradStats:
    """Unbiased |G|^2 and tr(S)/M0 from ``count`` independent gradient estimates of ``batch_each``
    examples each.

    E|g_i|^2 = |G|^2 + tr(S)/b and E|gbar|^2 = |G|^2 + tr(S)/(c*b), so
    tr(S) = b*c*(mean|g_i|^2 - |gbar|^2)/(c - 1) and |G|^2 = |gbar|^2 - tr(S)/(c*b).
    ``mean_sq_norm_single`` is mean_i |g_i|^2, ``sq_norm_mean`` is |gbar|^2.
    """
    if count < 2:
        raise ValueError("at least two independent gradient estimates are needed")
    c = float(count)
    b = float(batch_each)
    trace = b * c * (mean_sq_norm_single - sq_norm_mean) / (c - 1.0)
    sqr = sq_norm_mean - trace / (c * b)
    return GradStats(sqr=float(sqr), var=float(trace / base_batch))
