"""Measured corrections on top of the throughput model: trust what was measured, near it.

The parametric model (``core.throughput``) has seven parameters for every placement and batch;
a real job deviates from it in ways it cannot express (compute slowed by co-located replicas, a
compute time convex in m, a two-node all-reduce slower than a four-node one).  Where the job
(or its kind) has *measured* a configuration, the measurement is better than the model.  So each
predicted time is multiplied by a correction smoothed from the log-residuals at the measured
points i, with kernel weights in (log N, log K, log m)::

    r_i = log(T_obs,i / T_model,i)                  (compute and synchronising step, separately)
    w_i(x) = exp(-|(x - x_i) / l|^2 / 2)
    log c(x) = sum_i w_i(x) r_i / (w_0 + sum_i w_i(x))

At a measured point the prediction is (nearly) the measurement; away from every measured point
(w_i -> 0) it is the model's, so the model alone still extrapolates.  ``w_0`` is the weight of
the model's own prediction (shrinks a single measurement's correction slightly).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike, NDArray

from pollux_local.core.throughput import (
    ThroughputParams,
    fit_throughput,
    predict_compute_time,
    predict_step_time,
)

FloatArray = NDArray[np.float64]

#: Kernel length scales in log N, log K and log m.
LENGTH_NODES = 0.3
LENGTH_REPLICAS = 0.3
LENGTH_BATCH = 0.25
#: Weight of the model's own prediction against the measured residuals.
PRIOR_WEIGHT = 0.1


@dataclass(frozen=True, eq=False)
class TimeCorrection:
    """Log-residuals of measured compute and step times against the model, at their points."""

    log_nodes: FloatArray
    log_replicas: FloatArray
    log_batch: FloatArray
    residual_compute: FloatArray
    residual_step: FloatArray

    @classmethod
    def from_points(
        cls,
        params: ThroughputParams,
        nodes: ArrayLike,
        replicas: ArrayLike,
        local_batch: ArrayLike,
        compute_s: ArrayLike,
        step_s: ArrayLike,
    ) -> TimeCorrection:
        """Residuals r = log(observed / predicted) at the measured (N, K, m) points."""
        n = np.atleast_1d(np.asarray(nodes, dtype=float))
        k = np.atleast_1d(np.asarray(replicas, dtype=float))
        m = np.atleast_1d(np.asarray(local_batch, dtype=float))
        tc = np.atleast_1d(np.asarray(compute_s, dtype=float))
        ts = np.maximum(np.atleast_1d(np.asarray(step_s, dtype=float)), tc)
        pred_c = np.maximum(predict_compute_time(params, m), 1e-12)
        pred_s = np.maximum(predict_step_time(params, n, k, m), 1e-12)
        return cls(
            log_nodes=np.log(n),
            log_replicas=np.log(k),
            log_batch=np.log(m),
            residual_compute=np.log(tc / pred_c),
            residual_step=np.log(ts / pred_s),
        )

    def factors(
        self,
        nodes: ArrayLike,
        replicas: ArrayLike,
        local_batch: ArrayLike,
        columns: BatchColumns | None = None,
    ) -> tuple[FloatArray, FloatArray]:
        """Multiplicative corrections (compute, step) at the queried points (broadcast);
        ``columns``: :func:`batch_columns` of the query, when the caller has kept them."""
        n = np.asarray(nodes, dtype=float)
        k = np.asarray(replicas, dtype=float)
        # The kernel is a product of an (N, K) part and an m part.  The (N, K) part is
        # evaluated on the (N, K) arrays as given (a batch-candidate grid passes one row per
        # allocation), the m part once per distinct m; the sums over measured points are then
        # matrix products, and each query picks its entry.
        n, k = np.broadcast_arrays(n, k)
        if columns is None:
            columns = batch_columns(n.shape, local_batch)
        ln = np.log(np.maximum(n.reshape(-1), 1.0))[:, None]
        lk = np.log(np.maximum(k.reshape(-1), 1.0))[:, None]
        w_nk = np.exp(
            -0.5
            * (
                ((ln - self.log_nodes[None, :]) / LENGTH_NODES) ** 2
                + ((lk - self.log_replicas[None, :]) / LENGTH_REPLICAS) ** 2
            )
        )
        w_m = np.exp(-0.5 * ((columns.log_batch - self.log_batch[None, :]) / LENGTH_BATCH) ** 2)
        total = PRIOR_WEIGHT + w_nk @ w_m.T
        log_c = (w_nk @ (w_m * self.residual_compute[None, :]).T) / total
        log_s = (w_nk @ (w_m * self.residual_step[None, :]).T) / total
        rows, cols = columns.rows, columns.cols
        log_c, log_s = log_c[rows, cols], log_s[rows, cols]
        return np.exp(log_c).reshape(columns.shape), np.exp(log_s).reshape(columns.shape)


@dataclass(frozen=True, eq=False)
class BatchColumns:
    """Where each queried m falls in :meth:`TimeCorrection.factors`' matrices: the query's
    shape, its row (the (N, K) entry) and column (the distinct m) per point, flattened, and
    log m of the distinct m (a column vector).  No fit enters: a caller asking the same
    grid of every fit keeps them."""

    shape: tuple[int, ...]
    rows: NDArray[np.intp]
    cols: NDArray[np.intp]
    log_batch: FloatArray


def batch_columns(nodes_shape: tuple[int, ...], local_batch: ArrayLike) -> BatchColumns:
    """:class:`BatchColumns` of a query with (N, K) of ``nodes_shape`` and ``local_batch``."""
    m = np.asarray(local_batch, dtype=float)
    shape = np.broadcast_shapes(nodes_shape, m.shape)
    size = int(np.prod(nodes_shape, dtype=np.int64))
    rows = np.broadcast_to(np.arange(size).reshape(nodes_shape), shape).reshape(-1)
    ms, cols = np.unique(np.broadcast_to(m, shape).reshape(-1), return_inverse=True)
    log_batch = np.log(np.maximum(ms, 1e-12))[:, None]
    return BatchColumns(shape=shape, rows=rows, cols=cols.reshape(-1), log_batch=log_batch)


def corrected_times(
    params: ThroughputParams,
    correction: TimeCorrection | None,
    nodes: ArrayLike,
    replicas: ArrayLike,
    local_batch: ArrayLike,
    columns: BatchColumns | None = None,
) -> tuple[FloatArray, FloatArray]:
    """(T_c, T_sync): the model's compute and synchronising-step times, each multiplied by its
    correction factor when there is one (T_sync >= T_c); ``columns`` as
    :meth:`TimeCorrection.factors` takes them."""
    t_c = predict_compute_time(params, local_batch)
    t_sync = predict_step_time(params, nodes, replicas, local_batch)
    if correction is not None:
        factor_c, factor_s = correction.factors(nodes, replicas, local_batch, columns)
        t_c = t_c * factor_c
        t_sync = np.maximum(t_sync * factor_s, t_c)
    return np.asarray(t_c, dtype=np.float64), np.asarray(t_sync, dtype=np.float64)


def fit_corrected(
    nodes: ArrayLike,
    replicas: ArrayLike,
    local_batch: ArrayLike,
    compute_s: ArrayLike,
    step_s: ArrayLike,
) -> tuple[ThroughputParams, TimeCorrection]:
    """The throughput model fitted to the measured points, and its residuals at them."""
    params = fit_throughput(nodes, replicas, local_batch, compute_s, step_s)
    return params, TimeCorrection.from_points(
        params, nodes, replicas, local_batch, compute_s, step_s
    )
