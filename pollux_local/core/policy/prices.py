"""Several device types: per-type models and the choice of a device type per job.

**Per-type models.**  A job's throughput model is kept per device type, fitted to what was
measured on that type (by the job or, pooled, by earlier jobs of its kind).  A type with no
measurement is predicted from the measured type B nearest in single-device speed, scaled by
the ratio of the kind's single-device throughputs (``JobView.type_rates``, a short
single-device profile)::

    G_t(n, k) = G_B(n, k) * rate_t / rate_B

evaluated on the nodes type t would use; as soon as the type is measured its own fit replaces
the prediction.  Without rates the ratio is 1; without any measurement there is no model (the
policy assumes linear speed-up, the same on every type).

**Type choice.**  Every admitted job runs on exactly one type.  With utility tables
U_jt(k) (the policy's p-mean utility of k devices of type t, restart discount included), each
type gets a price lambda_t per device and each job the type and count that maximise
U_jt(k) - lambda_t k; the prices rise, type by type, until no type is asked for more devices
than it has (Gauss-Seidel over the types, each price the smallest on a geometric grid that
clears its type).  Jobs then keep the type chosen; how many devices each gets is decided per
type by the homogeneous search.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from pollux_local.core.types import GoodputModelLike

FloatArray = NDArray[np.float64]
IntArray = NDArray[np.int64]

#: Price steps per type and round of the price search.
PRICE_GRID = 40
#: Rounds of the price search over all types.
PRICE_ROUNDS = 4


@dataclass(frozen=True)
class ScaledModel:
    """A model of another type, its goodput scaled by a speed ratio (a prediction)."""

    base: GoodputModelLike
    ratio: float

    def __hash__(self) -> int:
        """The fields' hash, computed once (the key of a remembered table)."""
        cached: int | None = self.__dict__.get("_hash")
        if cached is None:
            cached = hash((self.base, self.ratio))
            object.__setattr__(self, "_hash", cached)
        return cached

    def best_goodput(
        self, nodes: np.ndarray, replicas: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        values, local, steps = self.base.best_goodput(nodes, replicas)
        return np.asarray(values, dtype=float) * self.ratio, local, steps


def speed_ratio(rates: Mapping[str, float] | None, target: str, source: str) -> float:
    """rate_target / rate_source, 1 when either is unknown."""
    if not rates:
        return 1.0
    a, b = rates.get(target, 0.0), rates.get(source, 0.0)
    if a > 0 and b > 0 and math.isfinite(a) and math.isfinite(b):
        return float(a / b)
    return 1.0


def complete_models(
    models: Mapping[str, GoodputModelLike],
    rates: Mapping[str, float] | None,
    device_types: Sequence[str],
) -> dict[str, GoodputModelLike]:
    """A model for every type: the measured ones, the others predicted from the measured type
    nearest in single-device speed (``ScaledModel``); empty when nothing was measured."""
    measured = [t for t in device_types if t in models]
    if not measured:
        return {}
    out: dict[str, GoodputModelLike] = {}
    for device_type in device_types:
        if device_type in models:
            out[device_type] = models[device_type]
            continue
        source = min(measured, key=lambda b: abs(math.log(speed_ratio(rates, device_type, b))))
        out[device_type] = ScaledModel(models[source], speed_ratio(rates, device_type, source))
    return out


def _type_values(utility_t: FloatArray, price: float) -> FloatArray:
    """Each job's best value on one type at its price: max over k of U_t(k) - lambda_t k
    (a NaN, -inf minus -inf, counting as -inf)."""
    counts = np.arange(utility_t.shape[1], dtype=np.float64)
    with np.errstate(invalid="ignore"):
        net = utility_t - price * counts[None, :]
    net = np.where(np.isnan(net), -np.inf, net)
    best = np.argmax(net, axis=1)
    return np.asarray(np.take_along_axis(net, best[:, None], axis=1)[:, 0], dtype=np.float64)


def _clearing_price(
    utility_t: FloatArray, other: FloatArray, capacity: float, high: float
) -> float:
    """The smallest grid price at which the jobs choosing this type (its value above
    ``other``, their best elsewhere) ask for at most ``capacity`` devices.

    A job whose best utility here is not above ``other`` never chooses this type at a price
    >= 0 (U_t(k) - lambda k <= U_t(k)): it is left out.  Only the counts that some job values
    above every smaller count are looked at: at a price >= 0 a count that a smaller one
    matches never wins (``argmax`` keeps the first)."""
    grid = np.concatenate([[0.0], np.geomspace(high * 1e-6, high, PRICE_GRID)])
    with np.errstate(invalid="ignore"):
        candidates = np.fmax.reduce(utility_t, axis=1) > other
    utility_t, other = utility_t[candidates], other[candidates]
    with np.errstate(invalid="ignore"):
        before = np.fmax.accumulate(utility_t, axis=1)
    rises = np.ones(utility_t.shape, dtype=bool)
    rises[:, 1:] = utility_t[:, 1:] > before[:, :-1]
    keep = np.asarray(rises.any(axis=0), dtype=bool)
    keep[0] = True  # (no jobs: one column all the same)
    columns = np.nonzero(keep)[0]
    counts = columns.astype(np.float64)
    sub = utility_t[:, columns]
    with np.errstate(invalid="ignore"):
        net = sub[:, None, :] - grid[None, :, None] * counts[None, None, :]
    if np.isnan(net).any():
        net = np.where(np.isnan(net), -np.inf, net)
    best_column = np.argmax(net, axis=2)
    value = np.take_along_axis(net, best_column[:, :, None], axis=2)[:, :, 0]  # the maxima
    best = columns[best_column]
    takes = (value > other[:, None]) & np.isfinite(value)
    demand = np.where(takes, best, 0).sum(axis=0)
    fits = np.nonzero(demand <= capacity)[0]
    index = int(fits[0]) if fits.size else len(grid) - 1
    return float(grid[index])


def assign_types(
    utility: FloatArray, capacity: Sequence[float], current: Sequence[int] | None = None
) -> IntArray:
    """The type (index into the second axis of ``utility``) each job runs on.

    ``utility[j, t, k]``: job j's utility of k devices of type t (-inf where infeasible;
    k = 0 must be -inf: every job given here runs).  Prices per type clear the capacities
    (see the module docstring); a job with no feasible type gets -1.  ``current``: each job's
    type now (-1: none), kept on ties.
    """
    jobs, types, _ = utility.shape
    if jobs == 0:
        return np.zeros(0, dtype=np.int64)
    finite = utility[np.isfinite(utility)]
    spread = float(finite.max() - finite.min()) if finite.size else 1.0
    high = max(spread, 1e-12) * 2.0
    prices = np.zeros(types)
    cap = np.asarray(capacity, dtype=np.float64)
    # each job's best value per type at the current prices (a type's column is computed
    # again when its price moves)
    value = np.empty((jobs, types))
    for t in range(types):
        value[:, t] = _type_values(utility[:, t, :], prices[t])
    for _ in range(PRICE_ROUNDS):
        moved = False
        for t in range(types):
            others = np.delete(value, t, axis=1)
            other = others.max(axis=1) if others.shape[1] else np.full(jobs, -np.inf)
            price = _clearing_price(utility[:, t, :], other, float(cap[t]), high)
            if not math.isclose(price, prices[t], rel_tol=1e-9, abs_tol=1e-15):
                prices[t] = price
                value[:, t] = _type_values(utility[:, t, :], prices[t])
                moved = True
        if not moved:
            break
    choice = np.argmax(value, axis=1).astype(np.int64)
    if current is not None:
        now = np.asarray(current, dtype=np.int64)
        running = now >= 0
        rows = np.nonzero(running)[0]
        tie = value[rows, now[rows]] >= value[rows, choice[rows]]
        choice[rows[tie]] = now[rows[tie]]
    choice[~np.isfinite(value.max(axis=1))] = -1
    return _repair(choice, value, utility, cap)


def _repair(choice: IntArray, value: FloatArray, utility: FloatArray, cap: FloatArray) -> IntArray:
    """Move jobs off types whose minimum demands exceed their devices: while one does, the
    job on it that loses least moves to a type that still holds its minimum."""
    feasible = np.isfinite(utility)
    smallest = np.where(feasible.any(axis=2), np.argmax(feasible, axis=2), 0)  # (J, T)
    load = np.zeros(len(cap))
    for j, chosen in enumerate(choice):
        if chosen >= 0:
            load[chosen] += smallest[j, chosen]
    for _ in range(len(choice)):
        over = np.nonzero(load > cap)[0]
        if over.size == 0:
            break
        t = int(over[np.argmax(load[over] - cap[over])])
        best: tuple[float, int, int] | None = None
        for j in (int(i) for i in np.nonzero(choice == t)[0]):
            for u in range(len(cap)):
                need = smallest[j, u]
                if u == t or not feasible[j, u].any() or load[u] + need > cap[u]:
                    continue
                loss = float(value[j, t] - value[j, u])
                if best is None or loss < best[0]:
                    best = (loss, j, u)
        if best is None:
            break
        _, j, u = best
        load[t] -= smallest[j, t]
        load[u] += smallest[j, u]
        choice[j] = u
    return choice
