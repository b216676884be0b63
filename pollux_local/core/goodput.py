"""Goodput of a job and its best batch configuration for an allocation.

GOODPUT(N, K, m, s) = THROUGHPUT(N, K, m, s) * E(K*m*s)   (examples/s, efficiency-weighted).
Dividing by M0 gives the rate of progress in base-batch iterations per second.
"""

from __future__ import annotations

import functools
import struct
from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike, NDArray

from pollux_local.core.correction import (
    BatchColumns,
    TimeCorrection,
    batch_columns,
    corrected_times,
)
from pollux_local.core.efficiency import efficiency as _efficiency
from pollux_local.core.efficiency import noise_scale
from pollux_local.core.throughput import ThroughputParams
from pollux_local.core.types import BatchBounds, BatchChoice, GradStats, split_batches

FloatArray = NDArray[np.float64]
IntArray = NDArray[np.int64]

#: Number of total-batch candidates tried per allocation (geometrically spaced).
BATCH_CANDIDATES = 48
#: Throughput grids kept (one per fit, bounds and query; P allocations take P x 48 x 16 bytes,
#: so 1,024 grids of 64 allocations about 50 MB).
GRID_CACHE_SIZE = 1024
#: Best-goodput answers kept (one per model and query; small).
RESULT_CACHE_SIZE = 4096
#: Bounds of a model made only to compute a throughput (which no bound enters).
_NO_BOUNDS = BatchBounds(base_batch=1, max_batch=1, min_local=1, max_local=1)


@dataclass(frozen=True)
class GoodputModel:
    """A job's throughput model, gradient statistics and batch bounds, combined."""

    params: ThroughputParams
    stats: GradStats
    bounds: BatchBounds
    #: Measured residuals that correct the model's times near what was measured (or None).
    correction: TimeCorrection | None = None

    def __hash__(self) -> int:
        """The fields' hash, computed once (a model is a key of the remembered answers and
        tables, looked up for every job on every pass)."""
        cached: int | None = self.__dict__.get("_hash")
        if cached is None:
            cached = hash((self.params, self.stats, self.bounds, self.correction))
            object.__setattr__(self, "_hash", cached)
        return cached

    @property
    def max_local(self) -> int:
        return self.bounds.largest_local

    def throughput(
        self,
        nodes: ArrayLike,
        replicas: ArrayLike,
        local_batch: ArrayLike,
        accum_steps: ArrayLike,
        columns: BatchColumns | None = None,
    ) -> FloatArray:
        """Examples per second, K*m*s / T_iter with T_iter = (s - 1) * T_c + T_sync (see
        ``core.throughput``), the times corrected near measured points (``core.correction``;
        ``columns``: the query's, as it takes them)."""
        k = np.asarray(replicas, dtype=float)
        m = np.asarray(local_batch, dtype=float)
        s = np.asarray(accum_steps, dtype=float)
        t_c, t_sync = corrected_times(self.params, self.correction, nodes, k, m, columns)
        return np.asarray(k * m * s / ((s - 1.0) * t_c + t_sync), dtype=np.float64)

    def efficiency(self, total_batch: ArrayLike) -> FloatArray:
        """E(M) at this job's current noise scale."""
        return _efficiency(self.stats, self.bounds.base_batch, total_batch)

    def goodput(
        self, nodes: ArrayLike, replicas: ArrayLike, local_batch: ArrayLike, accum_steps: ArrayLike
    ) -> FloatArray:
        """THROUGHPUT * E(K*m*s)."""
        k = np.asarray(replicas, dtype=float)
        m = np.asarray(local_batch, dtype=float)
        s = np.asarray(accum_steps, dtype=float)
        return self.throughput(nodes, k, m, s) * self.efficiency(k * m * s)

    def goodput_at(self, nodes: int, replicas: int, local_batch: int, accum_steps: int) -> float:
        """:meth:`goodput` of one configuration, as a number (remembered per model)."""
        return _goodput_at(self, int(nodes), int(replicas), int(local_batch), int(accum_steps))

    def candidates(self, replicas: ArrayLike) -> tuple[IntArray, IntArray, NDArray[np.bool_]]:
        """Candidate (m, s) per replica count, shape (P, BATCH_CANDIDATES), and feasibility.

        Total batches are spaced geometrically over [max(M0, K*m_min), M_max] (without
        accumulation at most K*m_max) and each is split by the core's one rule,
        :func:`~pollux_local.core.types.split_batches`.  An allocation is infeasible when even
        m_min per replica exceeds M_max.
        """
        return batch_candidates(self.bounds, replicas)

    def best_goodput(
        self, nodes: ArrayLike, replicas: ArrayLike
    ) -> tuple[FloatArray, IntArray, IntArray]:
        """For each (N, K) pair: the highest goodput over batch candidates and its (m, s).

        K = 0 or an infeasible K gives goodput 0 (m = m_min, s = 1).  The answer (read-only
        arrays) is remembered per model and query, the throughput grid per fit, bounds and
        query (a policy asks again every pass, mostly of models that did not change).
        """
        n = np.atleast_1d(np.asarray(nodes, dtype=float))
        k = np.atleast_1d(np.asarray(replicas, dtype=float))
        return _best_goodput(self, n.tobytes(), k.tobytes())

    def _best_goodput_uncached(
        self, n: FloatArray, k: FloatArray
    ) -> tuple[FloatArray, IntArray, IntArray]:
        grid = _throughput_grid(self.params, self.correction, self.bounds, n.tobytes(), k.tobytes())
        # E(M) = (phi + M0) / (phi + max(M, M0)), as :meth:`efficiency` computes it
        base = self.bounds.base_batch
        phi = noise_scale(self.stats, base)
        values = grid.throughput * ((phi + base) / (phi + grid.batch_floor))
        best = np.argmax(values, axis=1)
        rows = grid.rows
        good = values[rows, best]
        best_m = grid.local[rows, best]
        best_s = grid.steps[rows, best]
        if not grid.all_usable:
            ok = grid.usable
            good = np.where(ok, good, 0.0)
            best_m = np.where(ok, best_m, self.bounds.min_local)
            best_s = np.where(ok, best_s, 1)
        return good, best_m.astype(np.int64), best_s.astype(np.int64)

    def best_choice(self, nodes: int, replicas: int) -> BatchChoice:
        """The (m, s) maximising goodput on ``replicas`` devices over ``nodes`` nodes."""
        # the query's bytes as ``best_goodput`` makes them (one float64 each)
        _, m, s = _best_goodput(self, _one_float(nodes), _one_float(replicas))
        return BatchChoice(local_batch=int(m[0]), accum_steps=int(s[0]), replicas=int(replicas))


def batch_candidates(
    bounds: BatchBounds, replicas: ArrayLike
) -> tuple[IntArray, IntArray, NDArray[np.bool_]]:
    """:meth:`GoodputModel.candidates` of models with these bounds (no fit enters)."""
    b = bounds
    k = np.maximum(np.atleast_1d(np.asarray(replicas, dtype=float)), 1.0)[:, None]
    m_max = float(b.largest_local)
    low = np.maximum(float(b.base_batch), k * b.min_local)
    high = np.full_like(low, float(b.max_batch))
    if not b.accumulation:
        high = np.minimum(high, k * m_max)
        low = np.minimum(low, high)
    feasible = (k * b.min_local <= b.max_batch)[:, 0]
    high = np.maximum(high, low)
    t = np.linspace(0.0, 1.0, BATCH_CANDIDATES)[None, :]
    total = low * (high / low) ** t
    local, steps = split_batches(total, k, b)
    return local, steps, feasible


@dataclass(frozen=True)
class _Grid:
    """Batch candidates of a query (P allocations x ``BATCH_CANDIDATES``), their feasibility
    and throughput; the total batches max(K*m*s, M0) the efficiency needs, which allocations
    have a candidate (feasible, K > 0), and the row numbers (what every answer of the query
    uses, computed once)."""

    local: NDArray[np.int32]
    steps: NDArray[np.int32]
    feasible: NDArray[np.bool_]
    throughput: FloatArray
    batch_floor: FloatArray
    usable: NDArray[np.bool_]
    all_usable: bool
    rows: IntArray


def _one_float(value: float) -> bytes:
    """The bytes of ``np.array([value], dtype=float)``."""
    return struct.pack("=d", float(value))


def _read_only(*arrays: NDArray[np.generic]) -> None:
    for array in arrays:
        array.setflags(write=False)


@functools.lru_cache(maxsize=GRID_CACHE_SIZE)
def _throughput_grid(
    params: ThroughputParams,
    correction: TimeCorrection | None,
    bounds: BatchBounds,
    nodes: bytes,
    replicas: bytes,
) -> _Grid:
    """The batch candidates of each (N, K) of the query and their (corrected) throughput; a
    model's gradient statistics do not enter, so models that differ only there share it."""
    model = GoodputModel(params, GradStats(sqr=1.0, var=0.0), bounds, correction)
    n = np.frombuffer(nodes, dtype=np.float64)
    part = _batch_candidates(bounds, replicas)
    throughput = model.throughput(
        n[:, None], part.replicas, part.local_float, part.steps_float, part.columns
    )
    _read_only(throughput)
    return _Grid(
        local=part.local,
        steps=part.steps,
        feasible=part.feasible,
        throughput=throughput,
        batch_floor=part.batch_floor,
        usable=part.usable,
        all_usable=part.all_usable,
        rows=part.rows,
    )


@dataclass(frozen=True)
class _Candidates:
    """What a query's batch candidates are, whatever the fit: K (at least 1, one row per
    allocation), m and s (as floats for the throughput, as int32 for the answers),
    feasibility, max(K*m*s, M0), the usable allocations and the row numbers."""

    replicas: FloatArray
    local_float: FloatArray
    steps_float: FloatArray
    local: NDArray[np.int32]
    steps: NDArray[np.int32]
    feasible: NDArray[np.bool_]
    batch_floor: FloatArray
    usable: NDArray[np.bool_]
    all_usable: bool
    rows: IntArray
    #: where each candidate's m falls in a correction's matrices
    columns: BatchColumns


@functools.lru_cache(maxsize=GRID_CACHE_SIZE)
def _batch_candidates(bounds: BatchBounds, replicas: bytes) -> _Candidates:
    """:meth:`GoodputModel.candidates` of a query and what follows from them alone
    (remembered: the fits of one application share them)."""
    k = np.frombuffer(replicas, dtype=np.float64)
    local, steps, feasible = batch_candidates(bounds, k)
    kk = np.maximum(k, 1.0)[:, None]
    local32, steps32 = local.astype(np.int32), steps.astype(np.int32)
    usable = feasible & (k > 0)
    part = _Candidates(
        replicas=kk,
        local_float=np.asarray(local, dtype=float),
        steps_float=np.asarray(steps, dtype=float),
        local=local32,
        steps=steps32,
        feasible=feasible,
        batch_floor=np.maximum(kk * local32 * steps32, float(bounds.base_batch)),
        usable=usable,
        all_usable=bool(usable.all()),
        rows=np.arange(k.size),
        columns=batch_columns((k.size, 1), local),
    )
    _read_only(part.replicas, part.local_float, part.steps_float, part.local, part.steps)
    _read_only(part.feasible, part.batch_floor, part.usable, part.rows)
    _read_only(part.columns.rows, part.columns.cols, part.columns.log_batch)
    return part


@functools.lru_cache(maxsize=RESULT_CACHE_SIZE)
def _best_goodput(
    model: GoodputModel, nodes: bytes, replicas: bytes
) -> tuple[FloatArray, IntArray, IntArray]:
    """:meth:`GoodputModel.best_goodput` of a query (as bytes), remembered."""
    n = np.frombuffer(nodes, dtype=np.float64)
    k = np.frombuffer(replicas, dtype=np.float64)
    result = model._best_goodput_uncached(n, k)
    _read_only(*result)
    return result


@functools.lru_cache(maxsize=RESULT_CACHE_SIZE)
def _goodput_at(model: GoodputModel, nodes: int, replicas: int, local: int, steps: int) -> float:
    """:meth:`GoodputModel.goodput_at`, remembered: :meth:`GoodputModel.goodput` computed the
    same way, its throughput remembered per fit (models that differ only in their gradient
    statistics share it)."""
    k = np.asarray(replicas, dtype=float)
    m = np.asarray(local, dtype=float)
    s = np.asarray(steps, dtype=float)
    throughput = _throughput_at(model.params, model.correction, nodes, replicas, local, steps)
    goodput = throughput * model.efficiency(k * m * s)
    return float(np.asarray(goodput).reshape(-1)[0])


@functools.lru_cache(maxsize=RESULT_CACHE_SIZE)
def _throughput_at(
    params: ThroughputParams,
    correction: TimeCorrection | None,
    nodes: int,
    replicas: int,
    local: int,
    steps: int,
) -> FloatArray:
    """:meth:`GoodputModel.throughput` of one configuration (a read-only array), remembered."""
    model = GoodputModel(params, GradStats(sqr=1.0, var=0.0), _NO_BOUNDS, correction)
    k = np.asarray(replicas, dtype=float)
    m = np.asarray(local, dtype=float)
    s = np.asarray(steps, dtype=float)
    throughput = model.throughput(nodes, k, m, s)
    _read_only(throughput)
    return throughput
