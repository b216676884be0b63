"""Sia (heterogeneity-aware goodput scheduling with an integer program) as a baseline policy.

Every round Sia picks, for every job, at most one *configuration* (device type t, nodes n,
devices g) from a fixed menu per type: one-node power-of-two counts 1, 2, 4, ..., R_t, then
whole nodes n * R_t for n = 2..N_t (R_t devices per node, N_t nodes).

Goodput of job j on configuration c, G_jc:

* the job has a model on type t: its goodput, maximised over the batch size by Pollux's search
  (:func:`sia_batch_search`; total batch at most the job's declared batch, micro-batch within
  the type's memory limit);
* no model on t but one on another type B (the first, in cluster order, that has one): B's
  goodput for g devices on ceil(g / R_B) nodes times rate_t / rate_B, the ratio of the job's
  single-device throughputs on the two types (``JobView.type_rates``);
* no model anywhere: 1 on the one-device configuration of every type, the others invalid.

Configurations beyond the job's replica limit, min(max(2 * largest count profiled, 1), 64,
``JobView.max_replicas``), are invalid.  Each row is divided by its smallest valid entry (so the
row minimum is 1); invalid entries become 1e-4.  A running job's other configurations are
multiplied by the restart factor f = max(T - R d, 0) / (T + d) (T its age, R its restarts, d
its restart cost; f = 1 while T < d).  With A = round(G^p, 2) capped at 3000, the integer
program is::

    minimise  sum_jc X_jc A_jc + lambda_n (J - sum_jc X_jc)      (p < 0; maximise for p > 0)
    s.t.      sum_c X_jc <= 1,   sum_j sum_{c of type t} g_c X_jc <= devices of type t,
              X_jc = 1 for a job still restoring on its current configuration c

solved with HiGHS (``scipy.optimize.milp``).  Placement per type: jobs by device count,
largest first; whole-node configurations take empty nodes, the others the fullest node that
holds them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from pollux_local.core.throughput import ThroughputParams, predict_network_time
from pollux_local.core.types import (
    BatchBounds,
    Decision,
    GoodputModelLike,
    GradStats,
    JobView,
    NodeView,
    Placement,
)

FloatArray = NDArray[np.float64]
IntArray = NDArray[np.int64]

#: Goodput given to an invalid configuration (before the power p).
INVALID_GOODPUT = 1e-4
#: Number of total-batch candidates in Pollux's batch search.
SEARCH_CANDIDATES = 50
#: Cost advantage of a job's current configuration, below the 0.01 rounding of the costs: it
#: only breaks exact ties.
TIE_BREAK = 1e-3
#: Largest replica count Sia gives a job.
MAX_REPLICAS = 64
_EPS = 1e-8


def sia_batch_search(
    params: ThroughputParams,
    stats: GradStats,
    base_batch: int,
    nodes: FloatArray | Sequence[float],
    replicas: FloatArray | Sequence[float],
    max_batch: float,
    local_range: tuple[int, int],
) -> tuple[FloatArray, IntArray, IntArray]:
    """Pollux's batch search as Sia runs it, per (N, K): the best goodput and its (m, a).

    Total batches M: 50 geometric steps from max(M0, m_min K) to ``max_batch``; per replica
    L = M / K, accumulation steps a = ceil(L / m_max) - 1 (at least 1 on one replica when
    L > M0) and micro-batch m = ceil(L / (a + 1)).  Goodput = K m (a + 1) / (a T_c + T_sync)
    x EFF(K m (a + 1)); a candidate whose m leaves ``local_range`` is worth 0.  Note: ``a``
    counts the micro-batches *besides* the synchronising one (the core's s is a + 1).
    """
    n = np.atleast_1d(np.asarray(nodes, dtype=float))
    k = np.atleast_1d(np.asarray(replicas, dtype=float))
    m_min, m_max = float(local_range[0]), float(local_range[1])
    low = np.maximum(float(base_batch), m_min * k)
    batch = np.geomspace(low, np.full_like(low, float(max_batch)), SEARCH_CANDIDATES)
    local = batch / k
    accum = np.ceil(local / m_max - _EPS) - 1.0
    accum = np.where((k == 1) & (local > base_batch + _EPS), np.maximum(accum, 1.0), accum)
    micro = np.ceil(local / (accum + 1.0) - _EPS)
    t_c = params.alpha_c + params.beta_c * micro
    t_net = np.broadcast_to(predict_network_time(params, n, k), micro.shape)
    big = np.maximum(t_c, t_net)
    gamma = params.gamma
    t_sync = big * ((t_c / big) ** gamma + (t_net / big) ** gamma) ** (1.0 / gamma)
    total = k * micro * (accum + 1.0)
    throughput = total / (accum * t_c + t_sync)
    scale = total / base_batch
    denom = stats.var / scale + stats.sqr
    with np.errstate(divide="ignore", invalid="ignore"):
        gain = np.where(denom > 0, (stats.var + stats.sqr) / denom, 1.0)
    goodput = throughput * gain / scale
    goodput = np.where((micro >= m_min) & (micro <= m_max), goodput, 0.0)
    goodput = np.nan_to_num(goodput, nan=0.0, posinf=0.0)
    best = np.argmax(goodput, axis=0)
    cols = np.arange(goodput.shape[1])
    return (
        goodput[best, cols],
        micro[best, cols].astype(np.int64),
        accum[best, cols].astype(np.int64),
    )


def restart_factor(age_s: float, restarts: int, cost_s: float) -> float:
    """f = max(T - R d, 0) / (T + d), and 1 while T < d (T age, R restarts, d restart cost)."""
    if age_s < cost_s:
        return 1.0
    return max(age_s - restarts * cost_s, 0.0) / (age_s + cost_s)


@dataclass(frozen=True)
class _Config:
    device_type: str
    nodes: int
    devices: int


@dataclass(frozen=True)
class _TypeGroup:
    """The nodes of one device type: their indices, devices per node and total devices."""

    name: str
    indices: tuple[int, ...]
    per_node: int
    total: int


def _groups(nodes: Sequence[NodeView]) -> list[_TypeGroup]:
    """The device types of the up nodes in order of first appearance (the cluster order)."""
    order: list[str] = []
    members: dict[str, list[int]] = {}
    for i, node in enumerate(nodes):
        if not node.up or node.devices <= 0:
            continue
        if node.device_type not in members:
            order.append(node.device_type)
            members[node.device_type] = []
        members[node.device_type].append(i)
    return [
        _TypeGroup(
            name=t,
            indices=tuple(members[t]),
            per_node=max(nodes[i].devices for i in members[t]),
            total=sum(nodes[i].devices for i in members[t]),
        )
        for t in order
    ]


def _menu(group: _TypeGroup, max_nodes: int | None) -> list[_Config]:
    """One-node power-of-two counts up to R, then whole nodes n R for n = 2..N."""
    configs: list[_Config] = []
    size = 1
    while size < group.per_node:
        configs.append(_Config(group.name, 1, size))
        size *= 2
    configs.append(_Config(group.name, 1, group.per_node))
    count = len(group.indices) if max_nodes is None else min(len(group.indices), max_nodes)
    for n in range(2, count + 1):
        configs.append(_Config(group.name, n, n * group.per_node))
    return configs


class SiaPolicy:
    """Sia's policy (see the module docstring): ``p`` the power of the goodputs (-0.5),
    ``lambda_n`` the cost of leaving a job without devices (1.1), ``clip`` the cap of G^p,
    ``project`` whether types without a model are projected from one with a model,
    ``share_max_replicas`` whether every type uses the largest replica limit over types,
    ``restart_cost_s`` the restart cost of a job that declares none, ``max_nodes_by_type`` the
    most nodes a configuration may span per type (the profiles' coverage)."""

    name = "sia"

    def __init__(
        self,
        p: float = -0.5,
        lambda_n: float = 1.1,
        clip: float = 3000.0,
        project: bool = True,
        share_max_replicas: bool = True,
        restart_cost_s: float = 30.0,
        max_nodes_by_type: dict[str, int] | None = None,
    ) -> None:
        if p == 0 or not math.isfinite(p):
            raise ValueError(f"Sia's p must be finite and non-zero, got {p}")
        self.p = float(p)
        self.lambda_n = float(lambda_n)
        self.clip = float(clip)
        self.project = bool(project or share_max_replicas)
        self.share_max_replicas = bool(share_max_replicas or project)
        self.restart_cost_s = float(restart_cost_s)
        self.max_nodes_by_type = dict(max_nodes_by_type or {})

    # ------------------------------------------------------------------ entry point
    def decide(
        self,
        jobs: Sequence[JobView],
        nodes: Sequence[NodeView],
        now: float,
        rng: np.random.Generator,
    ) -> Decision:
        """One configuration (or none) per job from the integer program, placed per type."""
        del now, rng
        empty: Placement = tuple(0 for _ in nodes)
        groups = _groups(nodes)
        if not jobs or not groups:
            return Decision(placements={j.id: empty for j in jobs})
        configs = [c for g in groups for c in _menu(g, self.max_nodes_by_type.get(g.name))]
        group_of = {g.name: g for g in groups}
        node_type = {i: g.name for g in groups for i in g.indices}
        costs = np.empty((len(jobs), len(configs)))
        previous: list[int | None] = []
        for row, job in enumerate(jobs):
            prev = self._previous_config(job, configs, node_type)
            previous.append(prev)
            goodput = self._goodput_row(job, configs, group_of)
            if prev is not None:
                factor = restart_factor(job.age_s, job.restarts, self._restart_cost(job))
                keep = goodput[prev]
                goodput = goodput * factor
                goodput[prev] = keep
            with np.errstate(divide="ignore", over="ignore"):
                powered = np.round(np.power(goodput, self.p), 2)
            costs[row] = np.minimum(powered, self.clip)
        pinned = [
            previous[row] if job.restoring and previous[row] is not None else None
            for row, job in enumerate(jobs)
        ]
        chosen = self._solve(costs, configs, groups, pinned, previous)
        return self._placements(jobs, nodes, configs, groups, chosen, empty)

    # ------------------------------------------------------------------ goodputs
    def _restart_cost(self, job: JobView) -> float:
        return self.restart_cost_s if job.restart_cost_s is None else float(job.restart_cost_s)

    @staticmethod
    def _previous_config(
        job: JobView, configs: list[_Config], node_type: dict[int, str]
    ) -> int | None:
        """The menu entry of the job's current allocation (None when it does not run or runs
        on something off the menu)."""
        used = [i for i, c in enumerate(job.placement) if c > 0]
        if not used:
            return None
        types = {node_type.get(i) for i in used}
        if len(types) != 1 or None in types:
            return None
        (device_type,) = types
        count = int(sum(job.placement))
        for index, config in enumerate(configs):
            if config.device_type == device_type and config.devices == count:
                return index
        return None

    def _replica_limits(self, job: JobView) -> tuple[int, int]:
        """(min, max) devices: max = min(max(2 x largest count profiled, 1), 64, the job's)."""
        upper = min(max(2 * int(job.max_profiled_replicas), 1), MAX_REPLICAS, job.max_replicas)
        return max(1, int(job.min_replicas)), max(1, upper)

    def _model_goodput(
        self, model: GoodputModelLike, job: JobView, nodes: IntArray, devices: IntArray
    ) -> FloatArray:
        """The model's best goodput per (nodes, devices), Pollux's search capped at the job's
        declared batch (models without parameters: their own ``best_goodput``)."""
        params = getattr(model, "params", None)
        stats = getattr(model, "stats", None)
        bounds = getattr(model, "bounds", None)
        if not (
            isinstance(params, ThroughputParams)
            and isinstance(stats, GradStats)
            and isinstance(bounds, BatchBounds)
        ):
            values, _, _ = model.best_goodput(nodes, devices)
            return np.asarray(values, dtype=float)
        top = float(bounds.max_batch if job.static_batch is None else job.static_batch)
        top = max(top, float(bounds.base_batch))
        values, _, _ = sia_batch_search(
            params,
            stats,
            bounds.base_batch,
            nodes.astype(float),
            devices.astype(float),
            top,
            (bounds.min_local, bounds.largest_local),
        )
        return values

    def _goodput_row(
        self, job: JobView, configs: list[_Config], groups: dict[str, _TypeGroup]
    ) -> FloatArray:
        """Normalised goodput of every configuration (invalid: ``INVALID_GOODPUT``)."""
        models = dict(job.models_by_type or {})
        if not models and job.model is not None and len(groups) == 1:
            models = {next(iter(groups)): job.model}
        lo, hi = self._replica_limits(job)
        devices = np.array([c.devices for c in configs], dtype=np.int64)
        nodes = np.array([c.nodes for c in configs], dtype=np.int64)
        valid = (devices >= lo) & (devices <= hi)
        row = np.full(len(configs), INVALID_GOODPUT)
        base = next((t for t in groups if t in models), None)
        estimated: set[str] = set()
        for device_type in groups:
            mask = valid & np.array([c.device_type == device_type for c in configs])
            if not mask.any():
                continue
            model = models.get(device_type)
            if model is not None:
                row[mask] = self._model_goodput(model, job, nodes[mask], devices[mask])
            elif self.project and base is not None:
                rates = job.type_rates or {}
                ratio = (
                    rates[device_type] / rates[base]
                    if rates.get(device_type, 0) > 0 and rates.get(base, 0) > 0
                    else 1.0
                )
                on_base = np.ceil(devices[mask] / groups[base].per_node).astype(np.int64)
                row[mask] = ratio * self._model_goodput(models[base], job, on_base, devices[mask])
            else:
                continue
            estimated.add(device_type)
        typed = np.array([c.device_type in estimated for c in configs])
        positive = typed & valid & (row > INVALID_GOODPUT)
        if positive.any():
            row[typed] = row[typed] / row[positive].min()
        for device_type in groups:  # no estimate: 1 on its one-device configuration
            if device_type in estimated:
                continue
            for index, config in enumerate(configs):
                if config.device_type == device_type and config.devices == 1 and lo <= 1:
                    row[index] = 1.0
        return np.asarray(np.maximum(np.nan_to_num(row, nan=0.0), INVALID_GOODPUT))

    # ------------------------------------------------------------------ integer program
    def _solve(
        self,
        costs: FloatArray,
        configs: list[_Config],
        groups: list[_TypeGroup],
        pinned: list[int | None],
        previous: list[int | None],
    ) -> list[int | None]:
        """The chosen configuration per job (None: no devices)."""
        from scipy.optimize import Bounds, LinearConstraint, milp
        from scipy.sparse import coo_matrix

        jobs, width = costs.shape
        sign = 1.0 if self.p < 0 else -1.0
        # sum X A + lambda_n (J - sum X) = sum X (A - lambda_n) + const; on exact ties (A is
        # rounded to 2 decimals) a job keeps its current configuration
        objective = sign * (costs - self.lambda_n)
        for row, prev in enumerate(previous):
            if prev is not None:
                objective[row, prev] -= TIE_BREAK
        objective = objective.ravel()
        rows: list[np.ndarray] = []
        cols: list[np.ndarray] = []
        vals: list[np.ndarray] = []
        job_index = np.repeat(np.arange(jobs), width)
        var_index = np.arange(jobs * width)
        rows.append(job_index)
        cols.append(var_index)
        vals.append(np.ones(jobs * width))
        type_row = {g.name: jobs + i for i, g in enumerate(groups)}
        config_rows = np.array([type_row[c.device_type] for c in configs])
        config_devices = np.array([c.devices for c in configs], dtype=float)
        rows.append(np.tile(config_rows, jobs))
        cols.append(var_index)
        vals.append(np.tile(config_devices, jobs))
        matrix = coo_matrix(
            (np.concatenate(vals), (np.concatenate(rows), np.concatenate(cols))),
            shape=(jobs + len(groups), jobs * width),
        ).tocsr()
        upper = np.concatenate([np.ones(jobs), [float(g.total) for g in groups]])
        lower_vars = np.zeros(jobs * width)
        for row, prev in enumerate(pinned):
            if prev is not None:
                lower_vars[row * width + prev] = 1.0
        result = milp(
            objective,
            constraints=LinearConstraint(matrix, np.zeros(len(upper)), upper),
            integrality=np.ones(jobs * width),
            bounds=Bounds(lower_vars, np.ones(jobs * width)),
            options={"mip_rel_gap": 1e-4},
        )
        if result.x is None:  # infeasible pins (devices went away): solve without them
            if any(p is not None for p in pinned):
                return self._solve(costs, configs, groups, [None] * len(pinned), previous)
            return [None] * jobs
        solution = np.round(result.x).reshape(jobs, width)
        return [int(np.argmax(r)) if r.sum() > 0 else None for r in solution]

    # ------------------------------------------------------------------ placement
    @staticmethod
    def _placements(
        jobs: Sequence[JobView],
        nodes: Sequence[NodeView],
        configs: list[_Config],
        groups: list[_TypeGroup],
        chosen: list[int | None],
        empty: Placement,
    ) -> Decision:
        placements: dict[str, Placement] = {j.id: empty for j in jobs}
        reasons: dict[str, str] = {}
        free = [n.devices if n.up and n.devices > 0 else 0 for n in nodes]
        for group in groups:
            members = [
                (row, configs[c])
                for row, c in enumerate(chosen)
                if c is not None and configs[c].device_type == group.name
            ]
            members.sort(key=lambda item: (-item[1].devices, item[0]))
            for row, config in members:
                placement = [0] * len(nodes)
                if config.nodes > 1 or config.devices > group.per_node:
                    whole = [i for i in group.indices if free[i] == nodes[i].devices]
                    left = config.devices
                    for i in whole:
                        if left == 0:
                            break
                        take = min(free[i], left)
                        placement[i] = take
                        left -= take
                    for i in group.indices:  # fragmented: any room left
                        if left == 0:
                            break
                        take = min(free[i] - placement[i], left)
                        placement[i] += take
                        left -= take
                else:
                    fitting = [i for i in group.indices if free[i] >= config.devices]
                    if fitting:
                        best = min(fitting, key=lambda i: (free[i], i))
                        placement[best] = config.devices
                    else:
                        left = config.devices
                        for i in sorted(group.indices, key=lambda i: (-free[i], i)):
                            if left == 0:
                                break
                            take = min(free[i], left)
                            placement[i] = take
                            left -= take
                for i, c in enumerate(placement):
                    free[i] -= c
                job = jobs[row]
                placements[job.id] = tuple(placement)
                reasons[job.id] = (
                    f"{config.devices} {config.device_type or 'device'}"
                    f"{'s' if config.devices > 1 else ''} on {config.nodes}"
                    f" node{'s' if config.nodes > 1 else ''}"
                )
        for job in jobs:
            reasons.setdefault(job.id, "waiting: not chosen by the integer program")
        return Decision(placements=placements, reasons=reasons)
