"""The objective: per-job goodput tables, speed-ups and their utility (the p-mean,
weighted by expected remaining time), fair shares and the restart-cost discount."""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pollux_local.core.goodput import GoodputModel
from pollux_local.core.policy.prices import ScaledModel
from pollux_local.core.types import (
    GoodputModelLike,
    JobView,
    Placement,
    Waiting,
)

NEG = -np.inf
#: The largest float, which ``nan_to`` gives for an infinity.
_LARGEST = float(np.finfo(np.float64).max)
#: A job gets at most this many times the largest replica count it has been profiled on.
EXPLORATION_FACTOR = 4
#: Smallest share of its declared length a job is taken to have done when estimating its
#: remaining time (keeps the estimate finite and steady right after the start).
MIN_PROGRESS_FRACTION = 0.05
#: How many spread-out placements of a job the placement step evaluates before giving up on
#: finding a tighter one (bounds the work on large, fragmented clusters).
MAX_SPREAD_TRIES = 8
#: Shortest goodput table a model is asked for (tables are asked in powers of two).
TABLE_LENGTH_MIN = 16
#: Jobs up to which ``rank_weights`` ranks them one by one (faster than the arrays for few).
_RANK_LOOP_JOBS = 64
#: Goodput tables remembered (per model and query).
TABLES_REMEMBERED = 4096


#: Per-job quantities shared by the device types of a cluster (owner weights, fair shares in
#: devices, service weights, whether the job runs on another type, in the jobs' order) and the
#: payback margin of a change within a type (a move between types uses ``type_margin``).
Shares = tuple[np.ndarray, np.ndarray, np.ndarray, Sequence[bool], float]


@dataclass
class JobPlan:
    """Per-job tables and the search state for one decision."""

    index: int
    job: JobView
    cap: int  # largest replica count the policy may give (exploration cap, max, cluster)
    min_k: int
    current_k: int
    goodput: np.ndarray  # goodput[k] for k = 0..len-1, packed placement; 0 where infeasible
    fair_share: float
    fair_goodput: float
    weight: float
    discount: float  # factor on the speed-up of any allocation other than the current one
    utility: np.ndarray  # weight * U(speed-up) for k = 0..cap, discounted, -inf if infeasible
    admitted: bool = False
    k: int = 0
    placement: Placement = ()
    note: str = ""
    consolidate: bool = False  # runs spread out; the same count on fewer nodes pays
    spread_goodput: float | None = None  # predicted goodput where it runs, when spread out
    waiting: Waiting | None = None  # why it waits, as facts (set when it is left waiting)


def nan_to(values: np.ndarray, nan: float) -> np.ndarray:
    """``np.nan_to_num(values, nan=nan)``: NaN -> ``nan``, +-inf -> +-the largest float, the
    same values for a fraction of its cost on the small arrays of one pass."""
    out = np.asarray(np.minimum(np.maximum(values, -_LARGEST), _LARGEST))  # NaN stays NaN
    out[np.isnan(values)] = nan
    return out


def min_nodes_table(node_sizes: Sequence[int], max_k: int) -> np.ndarray:
    """``table[k]`` = fewest nodes whose devices add up to at least k (0 for k = 0); read-only
    (remembered: a cluster's sizes change seldom between passes)."""
    return _min_nodes_table(tuple(int(s) for s in node_sizes), int(max_k))


@functools.lru_cache(maxsize=256)
def _min_nodes_table(node_sizes: tuple[int, ...], max_k: int) -> np.ndarray:
    sizes = np.sort(np.asarray([s for s in node_sizes if s > 0], dtype=np.int64))[::-1]
    cumulative = np.cumsum(sizes)
    ks = np.arange(max_k + 1)
    table = np.searchsorted(cumulative, ks, side="left") + 1
    table[0] = 0
    table = np.minimum(table, len(sizes)).astype(np.int64)
    table.setflags(write=False)
    return table


def nodes_spanned(placement: Placement) -> int:
    """How many nodes a placement uses (nodes with at least one of its devices)."""
    return sum(1 for c in placement if c > 0)


def fewest_nodes(min_nodes: np.ndarray, replicas: int) -> int:
    """The fewest nodes that hold ``replicas`` devices (the table's last entry beyond it)."""
    return int(min_nodes[min(replicas, len(min_nodes) - 1)])


def whole_node_mask(node_sizes: Sequence[int], max_k: int) -> np.ndarray:
    """``mask[k]``: k devices fit on one node, or are the devices of the n largest nodes (n >= 2).

    A job that spans nodes pays inter-node synchronisation on every step, so it takes whole
    nodes: a partly used extra node slows it and blocks the rest of that node for every other
    multi-node job.  Read-only (remembered, as :func:`min_nodes_table`).
    """
    return _whole_node_mask(tuple(int(s) for s in node_sizes), int(max_k))


@functools.lru_cache(maxsize=256)
def _whole_node_mask(node_sizes: tuple[int, ...], max_k: int) -> np.ndarray:
    sizes = sorted((s for s in node_sizes if s > 0), reverse=True)
    mask = np.zeros(max_k + 1, dtype=bool)
    mask[: min(sizes[0] if sizes else 0, max_k) + 1] = True
    spans = np.cumsum(sizes)[1:]
    mask[spans[spans <= max_k]] = True
    mask.setflags(write=False)
    return mask


def goodput_on(model: GoodputModelLike, nodes: int, replicas: int) -> float:
    """The model's best goodput for ``replicas`` devices over ``nodes`` nodes (0 if undefined)."""
    goodput, _, _ = model.best_goodput(np.array([nodes]), np.array([replicas]))
    return float(np.nan_to_num(goodput[0], nan=0.0, posinf=0.0))


def pinned_placements(jobs: Sequence[JobView], node_sizes: Sequence[int]) -> dict[str, Placement]:
    """The running rigid jobs that may not be preempted and whose devices are all still
    offered: they keep them (id -> placement)."""
    room = list(node_sizes)
    pinned: dict[str, Placement] = {}
    for job in jobs:
        if not job.pinned or len(job.placement) != len(room):
            continue
        if any(c > r for c, r in zip(job.placement, room, strict=True)):
            continue
        room = [r - c for r, c in zip(room, job.placement, strict=True)]
        pinned[job.id] = tuple(int(c) for c in job.placement)
    return pinned


def set_pinned_aside(
    jobs: Sequence[JobView], node_sizes: Sequence[int]
) -> tuple[dict[str, Placement], list[int], list[bool], list[JobView]]:
    """The pinned jobs (:func:`pinned_placements`) taken out of the nodes: their placements,
    the devices left on each node, the nodes a pinned job spanning several nodes uses (others
    that span nodes keep off them), and the jobs left to share the rest."""
    pinned = pinned_placements(jobs, node_sizes)
    sizes = list(node_sizes)
    multi_node_on = [False] * len(sizes)
    for placement in pinned.values():
        sizes = [size - c for size, c in zip(sizes, placement, strict=True)]
        if nodes_spanned(placement) > 1:
            multi_node_on = [m or c > 0 for m, c in zip(multi_node_on, placement, strict=True)]
    shared = [j for j in jobs if j.id not in pinned]
    return pinned, sizes, multi_node_on, shared


def pinned_reason(placement: Placement) -> str:
    k, n = int(sum(placement)), nodes_spanned(placement)
    return f"{k} dev on {n} node{'s' if n > 1 else ''}; rigid: keeps its devices until it ends"


def hold_rule(ahead: JobPlan, waiting: JobPlan) -> str:
    """Why ``ahead`` was admitted before ``waiting`` (``types.HOLD_RULES``)."""
    if ahead.job.priority > waiting.job.priority:
        return "priority"
    if ahead.current_k > 0 and ahead.job.attained_gpu_s > waiting.job.attained_gpu_s:
        return "kept"
    return "service"


#: How a waiting job's reason words each rule of a job holding devices ahead of it.
HOLD_RULE_TEXT = {
    "rigid": "rigid, not preemptible",
    "priority": "higher priority",
    "kept": "running, not preempted until it has had well over its share of service",
    "service": "less attained service",
}


def waiting_reason(waiting: Waiting, free: int) -> str:
    """The reason line of a job left waiting, from the facts of the decision."""
    plural = "s" if waiting.needs > 1 else ""
    if waiting.rule == "devices":
        shown = ", ".join(
            f"{h.id} ({HOLD_RULE_TEXT.get(h.rule, h.rule)})" for h in waiting.holders[:4]
        )
        more = len(waiting.holders) - 4
        held = f"; held by {shown}" + (f" and {more} more" if more > 0 else "") if shown else ""
        return f"waiting: needs {waiting.needs} device{plural}, {free} free{held}"
    if waiting.rule == "placement":
        return "waiting: no placement fits its minimum without sharing nodes"
    if waiting.rule == "reserved" and waiting.holders:
        return (
            f"waiting: needs {waiting.needs} device{plural}, {free} free; rigid jobs start after"
            f" {waiting.holders[0].id}, which waits for more"
        )
    if waiting.rule == "size":
        return f"cannot run: needs {waiting.needs} device{plural}"
    return "cannot run: no feasible replica count within its bounds"


def rank_weights(remaining: np.ndarray, exponent: float) -> np.ndarray:
    """(rank / J)^exponent with rank 1 for the largest remaining time, J for the smallest.

    Equal remaining times share the average of their ranks, so identical jobs weigh the same.
    """
    count = len(remaining)
    if count == 0:
        return np.zeros(0, dtype=np.float64)
    values = remaining.tolist()
    if count <= _RANK_LOOP_JOBS and not any(v != v for v in values):  # no NaN
        # the same ranks, one by one: equal values are neighbours in the sorted order and
        # share the mean of their (whole-number, so exactly summed) ranks
        by_value = sorted(range(count), key=lambda i: -values[i])
        averaged = [0.0] * count
        start = 0
        while start < count:
            end = start + 1
            while end < count and values[by_value[end]] == values[by_value[start]]:
                end += 1
            mean = sum(range(start + 1, end + 1)) / (end - start)
            for position in range(start, end):
                averaged[by_value[position]] = mean
            start = end
        return np.asarray((np.array(averaged) / count) ** exponent, dtype=np.float64)
    order = np.argsort(-remaining, kind="stable")
    ranks = np.empty(count, dtype=np.float64)
    ranks[order] = np.arange(1, count + 1, dtype=np.float64)
    _, groups = np.unique(remaining, return_inverse=True)
    ranks = (np.bincount(groups, weights=ranks) / np.bincount(groups))[groups]
    return np.asarray((ranks / count) ** exponent, dtype=np.float64)


def utility_of(speedup: np.ndarray, p: float) -> np.ndarray:
    """U(x) = x^p / p (log x for p = 0); -inf for x <= 0 when p <= 0."""
    x = np.asarray(speedup, dtype=np.float64)
    positive = x > 0
    if p != 0 and x.flags.c_contiguous:  # the same values, computed unmasked
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            powered = np.power(x, p) / p
        if p > 0:
            return np.asarray(np.where(positive, powered, 0.0), dtype=np.float64)
        return np.asarray(np.where(positive, powered, NEG), dtype=np.float64)
    out = np.full_like(x, NEG)
    if p == 0:
        out[positive] = np.log(x[positive])
    else:
        out[positive] = np.power(x[positive], p) / p
        if p > 0:
            out[~positive] = 0.0
    return out


#: Seconds a job waits for devices before a rigid job that may not be preempted (it would keep
#: its devices until it ends) starts only after it: until then such jobs fill the devices it
#: cannot use yet (backfill); after, they wait, so that it cannot be held back for ever.
RESERVE_AFTER_S = 7200.0


class Objective:
    """The policy's settings and the per-job tables its search optimises."""

    name = "goodput"

    def __init__(
        self,
        p: float = -1.0,
        restart_cost_s: float = 30.0,
        interval_s: float = 60.0,
        preempt_ratio: float = 2.0,
        local_search_steps: int = 2,
        rank_exponent: float = 2.0,
        payback_margin: float = 6.0,
        type_aware: bool = True,
        type_payback_margin: float = 10.0,
        reserve_after_s: float = RESERVE_AFTER_S,
    ) -> None:
        if not math.isfinite(p):
            raise ValueError(f"p must be finite, got {p}")
        if restart_cost_s < 0:
            raise ValueError(f"restart cost must be non-negative, got {restart_cost_s}")
        if interval_s <= 0:
            raise ValueError(f"interval must be positive, got {interval_s}")
        if preempt_ratio < 1:
            raise ValueError(f"preempt ratio must be at least 1, got {preempt_ratio}")
        if not (math.isfinite(rank_exponent) and rank_exponent >= 0):
            raise ValueError(f"rank exponent must be >= 0, got {rank_exponent}")
        if not (math.isfinite(payback_margin) and payback_margin >= 1):
            raise ValueError(f"payback margin must be at least 1, got {payback_margin}")
        self.p = float(p)
        self.restart_cost_s = float(restart_cost_s)
        self.interval_s = float(interval_s)
        self.preempt_ratio = float(preempt_ratio)
        self.local_search_steps = int(local_search_steps)
        self.rank_exponent = float(rank_exponent)
        self.payback_margin = float(payback_margin)
        if not (math.isfinite(type_payback_margin) and type_payback_margin >= 1):
            raise ValueError(f"payback margin must be at least 1, got {type_payback_margin}")
        #: choose each job's device type on a cluster of several types (else: all one pool)
        self.type_aware = bool(type_aware)
        #: the payback margin of a move to another device type
        self.type_margin = float(type_payback_margin)
        if not (math.isfinite(reserve_after_s) and reserve_after_s >= 0):
            raise ValueError(f"reserve_after_s must be >= 0, got {reserve_after_s}")
        #: how long a job waits for devices before rigid jobs not preempted start only after
        #: it (``Search._admit``)
        self.reserve_after_s = float(reserve_after_s)
        if not self.type_aware:
            self.name = "goodput-unaware"

    # ------------------------------------------------------------------ tables
    def _build_plans(
        self,
        jobs: Sequence[JobView],
        node_sizes: list[int],
        total: int,
        min_nodes: np.ndarray,
        shares: Shares | None = None,
    ) -> list[JobPlan]:
        """Per-job tables on these nodes; ``shares``: the owner weights, fair shares, service
        weights and moving flags computed over a larger cluster (several device types)."""
        moving: Sequence[bool] | None = None
        margin = self.payback_margin
        if shares is None:
            owners: dict[str, int] = {}
            for job in jobs:
                owners[job.owner] = owners.get(job.owner, 0) + 1
            weights = np.array([1.0 / owners[j.owner] for j in jobs])
            fair = total * weights / weights.sum()
            service = self._service_weights(jobs)
        else:
            weights, fair, service, moving, margin = shares
        partial_nodes = ~whole_node_mask(node_sizes, total)
        largest_node = max(node_sizes)
        # the query of every job's table, made once per pass (``_goodput_table``)
        nodes_query = np.ascontiguousarray(min_nodes, dtype=np.int64)
        nodes_key = nodes_query.tobytes()
        # per-job numbers as Python floats (the same values, read faster one by one)
        fair_of = np.asarray(fair, dtype=np.float64).tolist()
        weight_of = (np.asarray(weights, dtype=np.float64) * service).tolist()
        owner_weight_of = np.asarray(weights, dtype=np.float64).tolist()
        plans: list[JobPlan] = []
        for index, job in enumerate(jobs):
            current_k = job.replicas if len(job.placement) == len(node_sizes) else 0
            min_k = max(1, int(job.min_replicas))
            cap = min(int(job.max_replicas), total)
            profiled = int(job.max_profiled_replicas)
            if job.rigid:  # exactly its size, or nothing
                cap = min(min_k, total)
            elif profiled > 0:  # exploration cap: a multiple of the largest count profiled
                cap = min(cap, max(EXPLORATION_FACTOR * profiled, min_k, current_k))
            else:
                # nothing profiled yet: the first run stays within one node and at most the
                # fair share (one start instead of a ladder of restarts up from one device)
                first = max(1, min(largest_node, int(fair_of[index]))) if current_k == 0 else 1
                cap = min(cap, max(min_k, current_k, first))
            fair_hi = min(total, int(math.ceil(fair_of[index])) + 1)
            table_len = max(cap, fair_hi, 1) + 1
            goodput = _table(job.model, nodes_query, nodes_key, table_len)
            fair_goodput = self._fair_goodput(goodput, fair_of[index])
            foreign = moving is not None and moving[index]  # runs on another device type
            if foreign:  # a move to another device type
                discount = self._discount(job, self.type_margin, warm=False)
            else:
                discount = self._discount(job, margin) if current_k > 0 else 1.0
            speedup = goodput[: cap + 1] / fair_goodput
            weight = weight_of[index]
            # a running job's (and a foreign one's) utility is that of its discounted speed-up;
            # the undiscounted one is needed only for a running job's count where it runs
            if foreign:
                utility = weight * utility_of(speedup * discount, self.p)
            elif current_k == 0:
                utility = weight * utility_of(speedup, self.p)
            consolidate = False
            spread_goodput: float | None = None
            if current_k > 0:
                spread_goodput = self._spread_goodput(job, min_nodes)
                keep = NEG
                if spread_goodput is not None and current_k <= cap:
                    # staying is worth what the job really gets where it runs, not the table's
                    # value of its count on the fewest nodes
                    keep = weight * float(
                        utility_of(np.array([spread_goodput]) / fair_goodput, self.p)[0]
                    )
                elif current_k <= cap:
                    # (the table's value of its count, as computed before the discount)
                    undiscounted = utility if foreign else weight * utility_of(speedup, self.p)
                    keep = undiscounted[current_k]
                if not foreign:
                    utility = weight * utility_of(speedup * discount, self.p)
                if current_k <= cap:
                    consolidate = bool(utility[current_k] > keep) and not job.rigid
                    utility[current_k] = max(keep, utility[current_k])
            utility[1:min_k] = NEG
            spread = partial_nodes[: cap + 1].copy()
            for allowed in (current_k, min_k):
                if allowed <= cap:
                    spread[allowed] = False
            utility[spread] = NEG
            plans.append(
                JobPlan(
                    index=index,
                    job=job,
                    cap=cap,
                    min_k=min_k,
                    current_k=current_k,
                    goodput=goodput,
                    fair_share=fair_of[index],
                    fair_goodput=fair_goodput,
                    weight=owner_weight_of[index],
                    discount=discount,
                    utility=utility,
                    consolidate=consolidate,
                    spread_goodput=spread_goodput,
                )
            )
        return plans

    @staticmethod
    def _spread_goodput(job: JobView, min_nodes: np.ndarray) -> float | None:
        """Predicted goodput of a running job on the nodes it really spans, when it spans more
        than the fewest that hold its devices (None otherwise: the tables already hold it)."""
        k = job.replicas
        spans = nodes_spanned(job.placement)
        if k == 0 or job.model is None or spans <= fewest_nodes(min_nodes, k):
            return None
        return max(goodput_on(job.model, spans, k), 1e-12)

    def _remaining(self, job: JobView) -> float | None:
        """Expected remaining run time, or None when neither a declared length nor a time
        limit gives one.

        R = (t + interval) * (1 - f) / max(f, f_min): the job keeps its average pace so far
        (t its run time, f the share of its declared length done; f_min = 0.05 keeps the
        estimate of a job that has barely started finite); a time limit with L seconds left
        bounds it: R = min(R, L) (R = L without a declared length).
        """
        bound = job.time_left_s
        if bound is not None:
            bound = max(float(bound), 0.0) if math.isfinite(bound) else None
        f = job.progress_fraction
        if f is None or not math.isfinite(f):
            return bound
        f = min(max(float(f), 0.0), 1.0)
        run = max(float(job.run_time_s), 0.0) + self.interval_s
        estimate = run * (1.0 - f) / max(f, MIN_PROGRESS_FRACTION)
        return estimate if bound is None else min(estimate, bound)

    def _horizon(self, job: JobView) -> float:
        """Expected lifetime H of a new allocation: min(age / (restarts + 1), R), >= interval.

        The job's allocations so far lasted age / (restarts + 1) on average; the next one is
        expected to last as long, but not beyond the job's expected remaining run time R when it
        declared its length.
        """
        horizon = job.age_s / (job.restarts + 1)
        remaining = self._remaining(job)
        if remaining is not None:
            horizon = min(horizon, remaining)
        return max(horizon, self.interval_s)

    def _discount(self, job: JobView, margin: float | None = None, warm: bool = True) -> float:
        """Factor on the speed-up of any allocation but a running job's current one.

        A change is worth it when x' * H >= x * (H + m * d): it must earn back m times its
        restart cost d within the allocation's expected lifetime H.  So the factor is
        H / (H + m * d): in (0, 1], near 1 for long-lived allocations, small for young or
        often re-allocated jobs.  d is the job's own measured cost (a warm resize's when
        ``warm`` and it has one: a change within its device type), else the configured one.
        """
        horizon = self._horizon(job)
        margin = self.payback_margin if margin is None else margin
        return horizon / (horizon + margin * self.resize_cost(job, warm))

    def resize_cost(self, job: JobView, warm: bool = True) -> float:
        """Seconds of progress a change of ``job``'s allocation costs it (:meth:`_discount`)."""
        if warm and job.warm_resize_cost_s is not None:
            return float(job.warm_resize_cost_s)
        if job.restart_cost_s is not None:
            return float(job.restart_cost_s)
        return self.restart_cost_s

    def _service_weights(self, jobs: Sequence[JobView]) -> np.ndarray:
        """Shortest-expected-remaining-time factor v_j = (rank_j / J)^gamma, in (0, 1].

        rank_j orders the jobs from the longest expected remaining run time (rank 1) to the
        shortest (rank J); tied jobs share their average rank.  R_j is ``_remaining``; without
        a declared length it is the time t_j the job has run so far (heavy-tailed lengths: a job
        that has run longer is expected to run longer still).
        """
        remaining = []
        for job in jobs:
            estimate = self._remaining(job)
            if estimate is None:
                estimate = max(float(job.run_time_s), 0.0)
            remaining.append(estimate)
        return rank_weights(np.asarray(remaining, dtype=np.float64), self.rank_exponent)

    @staticmethod
    def _goodput_table(job: JobView, min_nodes: np.ndarray, length: int) -> np.ndarray:
        """Best goodput for k = 0..length-1 devices on the fewest nodes (0 = infeasible).

        The model is asked for a table of a length rounded up to a power of two and the table
        cut, so that a job asks the same question pass after pass (the answer is remembered
        per model) while its table's length moves with its count and fair share."""
        nodes = np.ascontiguousarray(min_nodes, dtype=np.int64)
        return _table(job.model, nodes, nodes.tobytes(), length)

    @staticmethod
    def _fair_goodput(goodput: np.ndarray, fair_share: float) -> float:
        """Goodput at a fractional share, linear between the neighbouring integers."""
        lo = int(math.floor(fair_share))
        lo = min(lo, len(goodput) - 2)
        hi = lo + 1
        frac = fair_share - lo
        low, high = float(goodput[lo]), float(goodput[hi])
        value = low + frac * (high - low)
        if value <= 0:
            positive = goodput[goodput > 0]
            value = float(positive.min()) if positive.size else 1.0
        return value


def _table(
    model: GoodputModelLike | None, min_nodes: np.ndarray, min_nodes_key: bytes, length: int
) -> np.ndarray:
    """:meth:`Objective._goodput_table` of a model, ``min_nodes`` (int64) given with its
    bytes."""
    if model is None:
        return np.arange(length, dtype=np.float64)  # no data yet: assume linear speed-up
    # a power of two (tables of similar lengths are one table), but no row past the nodes'
    # devices (``min_nodes`` has one entry per count up to them)
    asked = min(max(TABLE_LENGTH_MIN, 1 << (length - 1).bit_length()), max(len(min_nodes), length))
    if isinstance(model, GoodputModel | ScaledModel):  # immutable: remembered
        table = _remembered_table(model, min_nodes_key, asked)
    else:
        table = _goodput_table_of(model, min_nodes, asked)
    return table[:length].copy()


def _goodput_table_of(model: GoodputModelLike, min_nodes: np.ndarray, length: int) -> np.ndarray:
    """``model``'s best goodput for k = 0..length-1 devices on ``min_nodes[k]`` nodes."""
    replicas = np.arange(1, length, dtype=np.int64)
    nodes_needed = min_nodes[np.minimum(replicas, len(min_nodes) - 1)]
    found, _, _ = model.best_goodput(nodes_needed, replicas)
    values = np.asarray(found, dtype=np.float64)
    table = np.zeros(length, dtype=np.float64)
    # NaN and +inf -> 0, the rest at least 0 (as ``np.nan_to_num(nan=0, posinf=0)`` then
    # ``np.maximum(., 0)``)
    table[1:] = np.where(np.isnan(values) | (values == np.inf), 0.0, np.maximum(values, 0.0))
    return table


@functools.lru_cache(maxsize=TABLES_REMEMBERED)
def _remembered_table(
    model: GoodputModel | ScaledModel, min_nodes: bytes, length: int
) -> np.ndarray:
    """:func:`_goodput_table_of`, remembered per (immutable) model and query."""
    table = _goodput_table_of(model, np.frombuffer(min_nodes, dtype=np.int64), length)
    table.flags.writeable = False
    return table
