"""Throughput model of one data-parallel job, and its fit from observed step times.

Notation: N nodes, K replicas (devices), m micro-batch per replica, s micro-batches per
iteration (gradient accumulation), M = K*m*s.

* compute time of one micro-batch:   T_c(m) = alpha_c + beta_c * m
* all-reduce time:                   T_net(N, K) = 0                          if K = 1
                                                 = alpha_r + beta_r * (K - 2)  if N = 1
                                                 = alpha_n + beta_n * (K - 2)  if N > 1
* a synchronising micro-batch:       T_sync = (T_c^gamma + T_net^gamma)^(1/gamma)
* one iteration:                     T_iter = (s - 1) * T_c + T_sync
* throughput (examples/s):           M / T_iter
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np
from numpy.typing import ArrayLike, NDArray

from pollux_local.core.lsq import solve_bounded

FloatArray = NDArray[np.float64]

#: Upper bound of the overlap exponent gamma.
GAMMA_MAX = 10.0
#: When a job has not run across nodes, the inter-node all-reduce is assumed this much slower
#: than the intra-node one.
MULTI_NODE_PRIOR_FACTOR = 1.1


@dataclass(frozen=True)
class ThroughputParams:
    """Parameters of the throughput model (seconds, seconds per example, dimensionless)."""

    alpha_c: float
    beta_c: float
    alpha_r: float
    beta_r: float
    alpha_n: float
    beta_n: float
    gamma: float

    def as_array(self) -> FloatArray:
        return np.array([getattr(self, f.name) for f in fields(self)], dtype=float)

    @classmethod
    def from_array(cls, values: ArrayLike) -> ThroughputParams:
        arr = np.asarray(values, dtype=float)
        return cls(*(float(v) for v in arr))

    def to_dict(self) -> dict[str, float]:
        return {f.name: float(getattr(self, f.name)) for f in fields(self)}

    @classmethod
    def from_dict(cls, data: dict[str, float]) -> ThroughputParams:
        return cls(**{f.name: float(data[f.name]) for f in fields(cls)})


def predict_compute_time(params: ThroughputParams, local_batch: ArrayLike) -> FloatArray:
    """T_c(m) = alpha_c + beta_c * m."""
    m = np.asarray(local_batch, dtype=float)
    return params.alpha_c + params.beta_c * m


def predict_network_time(
    params: ThroughputParams, nodes: ArrayLike, replicas: ArrayLike
) -> FloatArray:
    """T_net(N, K): 0 for K = 1, else alpha + beta*(K-2) with the intra- or inter-node terms."""
    n = np.asarray(nodes, dtype=float)
    k = np.asarray(replicas, dtype=float)
    extra = np.maximum(k - 2.0, 0.0)
    intra = params.alpha_r + params.beta_r * extra
    inter = params.alpha_n + params.beta_n * extra
    t = np.where(n > 1, inter, intra)
    return np.where(k > 1, t, 0.0)


def _overlap(t_compute: FloatArray, t_network: FloatArray, gamma: float) -> FloatArray:
    """(T_c^g + T_net^g)^(1/g), computed stably by factoring out the larger term."""
    big = np.maximum(t_compute, t_network)
    safe = np.where(big > 0, big, 1.0)
    ratio_c = t_compute / safe
    ratio_n = t_network / safe
    return big * (ratio_c**gamma + ratio_n**gamma) ** (1.0 / gamma)


def predict_step_time(
    params: ThroughputParams, nodes: ArrayLike, replicas: ArrayLike, local_batch: ArrayLike
) -> FloatArray:
    """T_sync = (T_c^gamma + T_net^gamma)^(1/gamma): one synchronising micro-batch."""
    t_c = predict_compute_time(params, local_batch)
    t_n = predict_network_time(params, nodes, replicas)
    return _overlap(t_c, t_n, params.gamma)  # (its operations broadcast the two)


def predict_iter_time(
    params: ThroughputParams,
    nodes: ArrayLike,
    replicas: ArrayLike,
    local_batch: ArrayLike,
    accum_steps: ArrayLike,
) -> FloatArray:
    """T_iter = (s - 1) * T_c + T_sync."""
    s = np.asarray(accum_steps, dtype=float)
    t_c = predict_compute_time(params, local_batch)
    return (s - 1.0) * t_c + predict_step_time(params, nodes, replicas, local_batch)


def predict_throughput(
    params: ThroughputParams,
    nodes: ArrayLike,
    replicas: ArrayLike,
    local_batch: ArrayLike,
    accum_steps: ArrayLike = 1,
) -> FloatArray:
    """Examples per second: K*m*s / T_iter."""
    k: FloatArray = np.asarray(replicas, dtype=float)
    m: FloatArray = np.asarray(local_batch, dtype=float)
    s: FloatArray = np.asarray(accum_steps, dtype=float)
    return k * m * s / predict_iter_time(params, nodes, replicas, local_batch, accum_steps)


# --------------------------------------------------------------------------------------------
# Fitting
# --------------------------------------------------------------------------------------------

_NAMES = [f.name for f in fields(ThroughputParams)]
_IDX = {name: i for i, name in enumerate(_NAMES)}
#: Weight of the regulariser pulling gamma toward 1, relative to one squared log-error.
_REG_GAMMA = 1e-3
#: Weight (per observation) of the regulariser pulling the retrogression terms beta_r, beta_n
#: toward 0 relative to alpha_r, alpha_n: an optimistic prior on scaling to more replicas.
_REG_RETRO = 2e-3


def _median(values: FloatArray) -> float:
    """``np.median`` of a few finite numbers (the same value: the middle one, or the mean of
    the middle two), without its cost per call."""
    ordered: list[float] = sorted(values.tolist())
    middle = len(ordered) // 2
    if len(ordered) % 2:
        return float(ordered[middle])
    return float((ordered[middle - 1] + ordered[middle]) / 2.0)


def _initial_guess(
    local_batch: FloatArray, compute_s: FloatArray, step_s: FloatArray, replicas: FloatArray
) -> FloatArray:
    """A starting point read off the data: compute time split evenly into fixed and per-example
    parts, network time from the gap between step and compute time."""
    per_example = _median(compute_s / local_batch)
    alpha_c = 0.5 * _median(compute_s)
    beta_c = 0.5 * per_example
    gap = np.maximum(step_s - compute_s, 0.0)
    multi = replicas > 1
    alpha_r = _median(gap[multi]) if multi.any() else 0.0
    alpha_r = max(alpha_r, 1e-4 * alpha_c)
    return np.array([alpha_c, beta_c, alpha_r, 0.01 * alpha_r, alpha_r * 1.5, 0.015 * alpha_r, 1.5])


def fit_throughput(
    nodes: ArrayLike,
    replicas: ArrayLike,
    local_batch: ArrayLike,
    compute_s: ArrayLike,
    step_s: ArrayLike,
) -> ThroughputParams:
    """Fit the model to observed (N, K, m) -> (compute time, synchronising step time).

    Minimises sum(log(T_c_pred/T_c_obs)^2 + log(T_sync_pred/T_sync_obs)^2) plus small
    regularisers pulling gamma toward 1 and the retrogression terms beta_r, beta_n toward 0
    relative to alpha_r, alpha_n, with every
    parameter >= 0 and 1 <= gamma <= 10.  Parameters the data says nothing about are pinned:
    no multi-replica data -> all network terms 0 (an optimistic, linear-scaling prior that the
    scheduler bounds by capping exploration); no multi-node data -> the inter-node terms are
    ``MULTI_NODE_PRIOR_FACTOR`` x the intra-node ones; no multi-replica single-node data but
    multi-node data -> the intra-node terms equal the inter-node ones divided by that factor.
    Solved by ``lsq.solve_bounded``; where its answer is not trusted, by scipy's trust-region
    reflective solver from the same start.
    """
    n = np.atleast_1d(np.asarray(nodes, dtype=float))
    k = np.atleast_1d(np.asarray(replicas, dtype=float))
    m = np.atleast_1d(np.asarray(local_batch, dtype=float))
    tc = np.atleast_1d(np.asarray(compute_s, dtype=float))
    ts = np.atleast_1d(np.asarray(step_s, dtype=float))
    if not (n.shape == k.shape == m.shape == tc.shape == ts.shape):
        raise ValueError("observation arrays must all have the same length")
    if n.size == 0:
        raise ValueError("cannot fit a throughput model without observations")
    if (tc <= 0).any() or (ts <= 0).any() or (m <= 0).any() or (k < 1).any() or (n < 1).any():
        raise ValueError("observations must have positive times, batch sizes and counts")
    ts = np.maximum(ts, tc)  # a synchronising step is never faster than its compute

    single_node_multi = bool(((k > 1) & (n == 1)).any())
    multi_node = bool(((k > 1) & (n > 1)).any())
    one_batch_size = bool(np.unique(m).size == 1)

    x0 = _initial_guess(m, tc, ts, k)
    free = np.ones(len(_NAMES), dtype=bool)
    if not single_node_multi and not multi_node:
        free[[_IDX[p] for p in ("alpha_r", "beta_r", "alpha_n", "beta_n", "gamma")]] = False
        x0[[_IDX[p] for p in ("alpha_r", "beta_r", "alpha_n", "beta_n")]] = 0.0
        x0[_IDX["gamma"]] = 1.0
    elif not multi_node:
        free[[_IDX["alpha_n"], _IDX["beta_n"]]] = False
    elif not single_node_multi:
        free[[_IDX["alpha_r"], _IDX["beta_r"]]] = False
    if one_batch_size:
        # One m cannot separate the fixed from the per-example compute cost: keep the even
        # split of the initial guess.
        free[[_IDX["alpha_c"], _IDX["beta_c"]]] = False
        x0[_IDX["alpha_c"]] = 0.5 * float(np.median(tc))
        x0[_IDX["beta_c"]] = 0.5 * float(np.median(tc / m))
    if not (k > 2).any():
        free[[_IDX["beta_r"], _IDX["beta_n"]]] = False
        x0[_IDX["beta_r"]] = 0.0
        x0[_IDX["beta_n"]] = 0.0

    def complete(free_values: FloatArray) -> FloatArray:
        full = x0.copy()
        full[free] = free_values
        if not multi_node:
            full[_IDX["alpha_n"]] = MULTI_NODE_PRIOR_FACTOR * full[_IDX["alpha_r"]]
            full[_IDX["beta_n"]] = MULTI_NODE_PRIOR_FACTOR * full[_IDX["beta_r"]]
        elif not single_node_multi:
            full[_IDX["alpha_r"]] = full[_IDX["alpha_n"]] / MULTI_NODE_PRIOR_FACTOR
            full[_IDX["beta_r"]] = full[_IDX["beta_n"]] / MULTI_NODE_PRIOR_FACTOR
        return full

    retro_weight = float(np.sqrt(_REG_RETRO * n.size))
    log_tc = np.log(tc)
    log_ts = np.log(ts)
    extra = np.maximum(k - 2.0, 0.0)
    multi_mask = k > 1
    inter_mask = n > 1

    floor = 1e-12
    #: the last point's shared terms (the solver asks the Jacobian where it just asked the
    #: residuals): its values, then p, T_c, T_net, max(T_c, T_net) (1 where 0), the two
    #: ratios to it, their gamma-th powers, their sum q and T_sync
    last: list[tuple[bytes, tuple[FloatArray, ...]]] = []

    def terms(free_values: FloatArray) -> tuple[FloatArray, ...]:
        key = free_values.tobytes()
        if last and last[0][0] == key:
            return last[0][1]
        p = complete(free_values)
        alpha_c, beta_c, alpha_r, beta_r, alpha_n, beta_n, gamma = p
        t_c = alpha_c + beta_c * m
        t_net = np.where(inter_mask, alpha_n + beta_n * extra, alpha_r + beta_r * extra)
        t_net = np.where(multi_mask, t_net, 0.0)
        # T_sync = (T_c^g + T_net^g)^(1/g), the larger term factored out (``_overlap``)
        big = np.maximum(t_c, t_net)
        safe = np.where(big > 0, big, 1.0)
        ratio_c, ratio_n = t_c / safe, t_net / safe
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            power_c, power_n = ratio_c**gamma, ratio_n**gamma
            q = power_c + power_n
            t_sync = big * q ** (1.0 / gamma)
        found = (p, t_c, t_net, big, safe, ratio_c, ratio_n, power_c, power_n, q, t_sync)
        last[:] = [(key, found)]
        return found

    def residuals(free_values: FloatArray) -> FloatArray:
        p, t_c, *_, t_sync = terms(free_values)
        _, _, alpha_r, beta_r, alpha_n, beta_n, gamma = p
        res_c = np.log(np.maximum(t_c, floor)) - log_tc
        res_s = np.log(np.maximum(t_sync, floor)) - log_ts
        reg = [
            np.sqrt(_REG_GAMMA) * (gamma - 1.0),
            retro_weight * beta_r / (alpha_r + 1e-8),
            retro_weight * beta_n / (alpha_n + 1e-8),
        ]
        return np.concatenate([res_c, res_s, reg])

    # d(full parameters)/d(free parameters): the free ones, and the ties of ``complete``
    chain = np.zeros((len(_NAMES), int(free.sum())))
    chain[np.nonzero(free)[0], np.arange(chain.shape[1])] = 1.0
    if not multi_node:
        chain[_IDX["alpha_n"]] = MULTI_NODE_PRIOR_FACTOR * chain[_IDX["alpha_r"]]
        chain[_IDX["beta_n"]] = MULTI_NODE_PRIOR_FACTOR * chain[_IDX["beta_r"]]
    elif not single_node_multi:
        chain[_IDX["alpha_r"]] = chain[_IDX["alpha_n"]] / MULTI_NODE_PRIOR_FACTOR
        chain[_IDX["beta_r"]] = chain[_IDX["beta_n"]] / MULTI_NODE_PRIOR_FACTOR
    intra_rows = (multi_mask & ~inter_mask).astype(float)
    inter_rows = (multi_mask & inter_mask).astype(float)

    def jacobian(free_values: FloatArray) -> FloatArray:
        """The residuals' derivatives (the loss is smooth; saves the finite differences)."""
        p, t_c, _, _, safe, ratio_c, ratio_n, power_c, power_n, q, t_sync = terms(free_values)
        gamma = p[_IDX["gamma"]]
        with np.errstate(divide="ignore", invalid="ignore"):
            # d log T_sync / d T_c and / d T_net: T^(g-1) / (T_c^g + T_net^g)
            d_c = ratio_c ** (gamma - 1.0) / (safe * q)
            d_n = ratio_n ** (gamma - 1.0) / (safe * q)
            log_c = np.where(ratio_c > 0, np.log(ratio_c), 0.0)
            log_n = np.where(ratio_n > 0, np.log(ratio_n), 0.0)
            d_g = (power_c * log_c + power_n * log_n) / (gamma * q) - np.log(q) / gamma**2
        sync_ok = (t_sync > floor) & np.isfinite(d_c)
        d_c = np.where(sync_ok, d_c, 0.0)
        d_n = np.where(sync_ok, d_n, 0.0)
        d_g = np.where(sync_ok, d_g, 0.0)
        compute_ok = t_c > floor
        inv_c = np.where(compute_ok, 1.0 / np.where(compute_ok, t_c, 1.0), 0.0)
        rows = m.size
        full = np.zeros((2 * rows + 3, len(_NAMES)))
        full[:rows, _IDX["alpha_c"]] = inv_c
        full[:rows, _IDX["beta_c"]] = inv_c * m
        full[rows : 2 * rows, _IDX["alpha_c"]] = d_c
        full[rows : 2 * rows, _IDX["beta_c"]] = d_c * m
        full[rows : 2 * rows, _IDX["alpha_r"]] = d_n * intra_rows
        full[rows : 2 * rows, _IDX["beta_r"]] = d_n * intra_rows * extra
        full[rows : 2 * rows, _IDX["alpha_n"]] = d_n * inter_rows
        full[rows : 2 * rows, _IDX["beta_n"]] = d_n * inter_rows * extra
        full[rows : 2 * rows, _IDX["gamma"]] = d_g
        full[2 * rows, _IDX["gamma"]] = np.sqrt(_REG_GAMMA)
        for row, (a, b) in enumerate((("alpha_r", "beta_r"), ("alpha_n", "beta_n")), 2 * rows + 1):
            denominator = p[_IDX[a]] + 1e-8
            full[row, _IDX[b]] = retro_weight / denominator
            full[row, _IDX[a]] = -retro_weight * p[_IDX[b]] / denominator**2
        return full @ chain

    if not free.any():
        return ThroughputParams.from_array(complete(np.empty(0)))

    lower = np.zeros(len(_NAMES))
    upper = np.full(len(_NAMES), np.inf)
    lower[_IDX["gamma"]] = 1.0
    upper[_IDX["gamma"]] = GAMMA_MAX
    start = np.clip(x0[free], lower[free], upper[free])
    # A strictly feasible start (the trust-region fallback needs one).
    start = np.where(start <= lower[free], lower[free] + 1e-9 + 1e-6 * np.abs(start), start)
    start = np.minimum(start, np.where(np.isfinite(upper[free]), upper[free] - 1e-9, start))
    quick = solve_bounded(residuals, jacobian, start, lower[free], upper[free])
    if quick.trusted:
        return ThroughputParams.from_array(complete(quick.x))
    # Imported here: scipy.optimize costs ~0.5 s to import, and job processes that only
    # predict (never fit) should not pay it at start-up.
    from scipy.optimize import least_squares

    result = least_squares(
        residuals,
        start,
        jac=jacobian,
        bounds=(lower[free], upper[free]),
        method="trf",
        x_scale="jac",
        max_nfev=200,
    )
    return ThroughputParams.from_array(complete(result.x))
