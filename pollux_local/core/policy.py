"""The goodput allocation policy: devices and placements that maximise the p-mean of speed-ups.

For every job j and replica count k the policy looks up the best goodput its model predicts on
the fewest nodes that can hold k devices, and turns it into a *speed-up* over the job's fair
share::

    SPEEDUP_j(k) = G_j(k) / G_j(f_j),    f_j = G_total * w_j / sum_i w_i,   w_j = 1 / n_owner(j)

so every user (not every job) is entitled to the same share of devices.  The objective is the
weighted p-mean of the speed-ups, maximised through the separable utility
``sum_j w_j v_j U(SPEEDUP_j)`` with ``U(x) = x^p / p`` (``log x`` for p = 0; p = -1 by default) and
a shortest-expected-remaining-time factor from the jobs' *ranks*::

    v_j = (rank_j / J)^gamma,   rank 1 = the longest expected remaining run time, J = the shortest

(gamma = ``rank_exponent``, 2 by default; 0 gives the plain p-mean; tied jobs share their
average rank).  Ranks, not the times themselves, after the optimal allocation for parallel
jobs with a common speed-up curve (heSRPT: every job runs, and the shares grow with the rank of
the job's remaining size), which makes the factor scale-free: ten long jobs are ordered among
themselves as firmly as ten short ones.  R_j is the job's expected remaining run time: from its
declared length when it has one (f = share of its declared epochs done, t_j its run time so
far)::

    R_j = (t_j + interval) * (1 - f) / max(f, 0.05)

and otherwise its run time so far, R_j = t_j (job lengths are heavy-tailed: a job that has run
longer is expected to run longer still).  Favouring the jobs expected to finish soonest (no job
is starved while p <= 0: its utility falls without bound as its speed-up goes to 0) lowers the
average completion time.

The search, in four steps, all on tables computed once per decision:

1. *admission* — when the jobs' minimum demands exceed the devices, the jobs with the least
   attained service run (least-attained-service favours short jobs and cuts the average
   completion time); a running job keeps its place against a waiting job unless it has
   received more than twice the waiting job's service, not counting its first round of
   service, and it wins ties (hysteresis bounds preemptions);
2. *greedy marginal gain* — devices go one increment at a time to the job whose utility rises
   most per device (looking ahead over several devices, so steps in the goodput curve such as
   crossing onto a second node are seen);
3. *local search* — moves of d devices between two jobs while the objective improves;
4. *placement* — jobs that keep their replica count keep their devices; the others are packed
   onto as few nodes as possible, avoiding devices that jobs still to be placed hold, and two
   jobs spanning several nodes never share a node; when the free devices are too fragmented
   to hold a job as tightly as the tables assumed, fewer devices on fewer nodes are taken if
   its model predicts more goodput there; a running job whose larger target does not fit
   stays where it is rather than moving.  A running job spread over more nodes than its
   count needs (placed while the cluster was fragmented) is valued at the goodput its model
   predicts where it really runs, so it moves onto fewer nodes when that pays for the restart
   and room is free.

Rigid jobs (``JobView.rigid``: scripts the policy cannot resize) hold their devices, as Sia
treats them; elastic jobs share the rest.  A running rigid job that may not be preempted keeps
its placement and is left out of the search (its devices are not offered); any other rigid
job is searched with exactly its size as the only count, so it is started on exactly that
many devices or waits, and once running it keeps its placement or (preemptible, losing
admission) is stopped.

Waiting jobs: ``Decision.waiting`` holds the facts of why each job left waiting waits (the
devices it needs and the jobs admitted ahead of it, each with the rule that put it there).

Whole nodes: a job spanning nodes takes the devices of whole nodes (the counts the n largest
nodes add up to): a partly used extra node slows every step with inter-node synchronisation and
blocks the rest of that node for other multi-node jobs.

Exploration: a job gets at most four times the largest replica count it has been profiled on
(``EXPLORATION_FACTOR``: two doublings per restart, so a job reaches its scalable size in few
restarts while its model is never trusted far beyond its data); a job
with nothing profiled starts on one node, within its fair share.

Restarts: changing a running job's allocation costs it d = ``restart_cost_s`` of no progress.
A new allocation is expected to last as long as the job's allocations lasted so far,
H = age / (restarts + 1), but no longer than the job's expected remaining run time R_j when it
declared its length (and at least one interval).  A change to speed-up x' beats staying at x
only when it earns back m times its restart cost within H (m = ``payback_margin``, 6 by
default, a margin for optimistic predictions and for the uncertainty of H):
``x' * H >= x * (H + m * d)``; so every allocation other than the current one is discounted by
``H / (H + m * d)`` in the objective: a young job's small gain never pays for a restart, and a
job that keeps being re-allocated needs ever larger gains.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from pollux_local.core.hetero import assign_types, complete_models
from pollux_local.core.types import (
    Decision,
    GoodputModelLike,
    Holder,
    JobView,
    NodeView,
    Placement,
    Waiting,
)

_NEG = -np.inf
#: A job gets at most this many times the largest replica count it has been profiled on.
EXPLORATION_FACTOR = 4
#: Smallest share of its declared length a job is taken to have done when estimating its
#: remaining time (keeps the estimate finite and steady right after the start).
_MIN_PROGRESS_FRACTION = 0.05
#: How many spread-out placements of a job the placement step evaluates before giving up on
#: finding a tighter one (bounds the work on large, fragmented clusters).
_MAX_SPREAD_TRIES = 8


#: Per-job quantities shared by the device types of a cluster (owner weights, fair shares in
#: devices, service weights, whether the job runs on another type, in the jobs' order) and the
#: payback margin of a change within a type (a move between types uses ``type_margin``).
_Shares = tuple[np.ndarray, np.ndarray, np.ndarray, Sequence[bool], float]


@dataclass
class _JobPlan:
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


def _min_nodes_table(node_sizes: Sequence[int], max_k: int) -> np.ndarray:
    """``table[k]`` = fewest nodes whose devices add up to at least k (0 for k = 0)."""
    sizes = np.sort(np.asarray([s for s in node_sizes if s > 0], dtype=np.int64))[::-1]
    cumulative = np.cumsum(sizes)
    ks = np.arange(max_k + 1)
    table = np.searchsorted(cumulative, ks, side="left") + 1
    table[0] = 0
    return np.minimum(table, len(sizes)).astype(np.int64)


def _nodes_spanned(placement: Placement) -> int:
    """How many nodes a placement uses (nodes with at least one of its devices)."""
    return sum(1 for c in placement if c > 0)


def _fewest_nodes(min_nodes: np.ndarray, replicas: int) -> int:
    """The fewest nodes that hold ``replicas`` devices (the table's last entry beyond it)."""
    return int(min_nodes[min(replicas, len(min_nodes) - 1)])


def _whole_node_mask(node_sizes: Sequence[int], max_k: int) -> np.ndarray:
    """``mask[k]``: k devices fit on one node, or are the devices of the n largest nodes (n >= 2).

    A job that spans nodes pays inter-node synchronisation on every step, so it takes whole
    nodes: a partly used extra node slows it and blocks the rest of that node for every other
    multi-node job.
    """
    sizes = sorted((s for s in node_sizes if s > 0), reverse=True)
    mask = np.zeros(max_k + 1, dtype=bool)
    mask[: min(sizes[0] if sizes else 0, max_k) + 1] = True
    spans = np.cumsum(sizes)[1:]
    mask[spans[spans <= max_k]] = True
    return mask


def _goodput_on(model: GoodputModelLike, nodes: int, replicas: int) -> float:
    """The model's best goodput for ``replicas`` devices over ``nodes`` nodes (0 if undefined)."""
    goodput, _, _ = model.best_goodput(np.array([nodes]), np.array([replicas]))
    return float(np.nan_to_num(goodput[0], nan=0.0, posinf=0.0))


def _pinned(jobs: Sequence[JobView], node_sizes: Sequence[int]) -> dict[str, Placement]:
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


def _pinned_reason(placement: Placement) -> str:
    k, n = int(sum(placement)), _nodes_spanned(placement)
    return f"{k} dev on {n} node{'s' if n > 1 else ''}; rigid: keeps its devices until it ends"


def _hold_rule(ahead: _JobPlan, waiting: _JobPlan) -> str:
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


def _waiting_reason(waiting: Waiting, free: int) -> str:
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
    order = np.argsort(-remaining, kind="stable")
    ranks = np.empty(count, dtype=np.float64)
    ranks[order] = np.arange(1, count + 1, dtype=np.float64)
    _, groups = np.unique(remaining, return_inverse=True)
    ranks = (np.bincount(groups, weights=ranks) / np.bincount(groups))[groups]
    return np.asarray((ranks / count) ** exponent, dtype=np.float64)


def _utility(speedup: np.ndarray, p: float) -> np.ndarray:
    """U(x) = x^p / p (log x for p = 0); -inf for x <= 0 when p <= 0."""
    x = np.asarray(speedup, dtype=np.float64)
    out = np.full_like(x, _NEG)
    positive = x > 0
    if p == 0:
        out[positive] = np.log(x[positive])
    else:
        out[positive] = np.power(x[positive], p) / p
        if p > 0:
            out[~positive] = 0.0
    return out


class GoodputPolicy:
    """Pollux-style goodput allocation with a fast, deterministic search.

    ``p`` is the exponent of the p-mean (-1: harmonic, the default; 0: geometric; 1: total
    speed-up; towards -inf: max-min fairness); ``restart_cost_s`` the seconds of progress an allocation
    change costs; ``interval_s`` the time between decisions (the smallest lifetime estimate a
    running job's allocation gets); ``preempt_ratio`` how much more service a running job must
    have received than a waiting one before the waiting one takes its place;
    ``local_search_steps`` bounds the move search (per job); ``rank_exponent`` (gamma) how
    strongly jobs expected to finish sooner are favoured (0: plain p-mean); ``payback_margin``
    (m) how many times over a change must earn back its restart cost; ``type_aware`` whether
    it chooses a device type per job on a cluster of several types (off: every device counts
    alike, a job's single model serves all types); ``type_payback_margin`` is m for a move to
    another device type (24: such a move is a restart on a model predicted from another type,
    and the value was chosen on held-out heterogeneous traces); a change of count within a
    type keeps ``payback_margin``.
    """

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
        type_payback_margin: float = 24.0,
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
        if not self.type_aware:
            self.name = "goodput-unaware"

    # ------------------------------------------------------------------ entry point
    def decide(
        self,
        jobs: Sequence[JobView],
        nodes: Sequence[NodeView],
        now: float,
        rng: np.random.Generator,
    ) -> Decision:
        """Place every job; zeros for jobs that do not run this round."""
        del now, rng  # the search is deterministic and needs neither
        node_sizes = [n.devices if n.up and n.devices > 0 else 0 for n in nodes]
        if not jobs:
            return Decision(placements={}, reasons={})
        if self.type_aware:
            types = {n.device_type for n, size in zip(nodes, node_sizes, strict=True) if size}
            if len(types) > 1:
                return self._decide_typed(jobs, nodes, node_sizes)
        # running rigid jobs that may not be preempted hold their devices; the others share
        # the rest
        pinned = _pinned(jobs, node_sizes)
        multi_node_on = [False] * len(node_sizes)
        for placement in pinned.values():
            node_sizes = [size - c for size, c in zip(node_sizes, placement, strict=True)]
            if _nodes_spanned(placement) > 1:
                multi_node_on = [m or c > 0 for m, c in zip(multi_node_on, placement, strict=True)]
        shared = [j for j in jobs if j.id not in pinned] if pinned else list(jobs)
        total = int(sum(node_sizes))
        if total == 0 or not shared:
            return self._all_waiting(jobs, shared, pinned, nodes)
        min_nodes = _min_nodes_table(node_sizes, total)
        plans = self._build_plans(shared, node_sizes, total, min_nodes)
        holders = tuple(Holder(job_id, "rigid") for job_id in pinned)
        offered = sum(n.devices if n.up and n.devices > 0 else 0 for n in nodes)
        self._admit(plans, total, holders, offered)
        free = self._greedy(plans, total)
        self._local_search(plans, free)
        self._place(plans, node_sizes, min_nodes, multi_node_on)
        decision = self._decision(plans, nodes, min_nodes, total)
        if not pinned:
            return decision
        return self._with_pinned(decision, jobs, pinned)

    def _all_waiting(
        self,
        jobs: Sequence[JobView],
        shared: Sequence[JobView],
        pinned: dict[str, Placement],
        nodes: Sequence[NodeView],
    ) -> Decision:
        """No devices left to share: the pinned jobs keep theirs, every other job waits."""
        empty: Placement = tuple(0 for _ in nodes)
        placements: dict[str, Placement] = {j.id: pinned.get(j.id, empty) for j in jobs}
        reasons = {job_id: _pinned_reason(placement) for job_id, placement in pinned.items()}
        waiting: dict[str, Waiting] = {}
        holders = tuple(Holder(job_id, "rigid") for job_id in pinned)
        for job in shared:
            needs = max(1, int(job.min_replicas))
            if holders:
                waiting[job.id] = Waiting("devices", needs, holders)
                reasons[job.id] = _waiting_reason(waiting[job.id], 0)
            else:
                reasons[job.id] = "waiting: no devices available"
        return Decision(placements=placements, reasons=reasons, waiting=waiting)

    @staticmethod
    def _with_pinned(
        decision: Decision, jobs: Sequence[JobView], pinned: dict[str, Placement]
    ) -> Decision:
        """The shared devices' decision with the pinned jobs added (in the jobs' order)."""
        placements = {j.id: pinned.get(j.id) or decision.placements[j.id] for j in jobs}
        reasons = {
            j.id: _pinned_reason(pinned[j.id]) if j.id in pinned else decision.reasons[j.id]
            for j in jobs
        }
        return Decision(placements=placements, reasons=reasons, waiting=decision.waiting)

    # ------------------------------------------------------------------ several device types
    def _decide_typed(
        self, jobs: Sequence[JobView], nodes: Sequence[NodeView], node_sizes: list[int]
    ) -> Decision:
        """Nodes of several device types: every job runs on one type.  Tables per type (the
        job's model there, measured or predicted: ``core.hetero``), one normaliser per job
        across types, admission over the whole cluster, a type per admitted job from prices
        that clear each type's devices, then per type the homogeneous search and placement."""
        pinned = _pinned(jobs, node_sizes)
        multi_node_on = [False] * len(node_sizes)
        for placement in pinned.values():
            node_sizes = [size - c for size, c in zip(node_sizes, placement, strict=True)]
            if _nodes_spanned(placement) > 1:
                multi_node_on = [m or c > 0 for m, c in zip(multi_node_on, placement, strict=True)]
        shared = [j for j in jobs if j.id not in pinned]
        total = int(sum(node_sizes))
        if total == 0 or not shared:
            return self._all_waiting(jobs, shared, pinned, nodes)
        members: dict[str, list[int]] = {}
        for i, node in enumerate(nodes):
            if node_sizes[i] > 0:
                members.setdefault(node.device_type, []).append(i)
        groups = list(members.items())
        names = [t for t, _ in groups]
        capacity = [sum(node_sizes[i] for i in idx) for _, idx in groups]
        owners: dict[str, int] = {}
        for job in shared:
            owners[job.owner] = owners.get(job.owner, 0) + 1
        weights = np.array([1.0 / owners[j.owner] for j in shared])
        fair = total * weights / weights.sum()
        current = [self._current_type(job, nodes, names) for job in shared]
        ones = np.ones(len(shared))
        models = [
            complete_models(job.models_by_type, job.type_rates, names)
            if job.models_by_type is not None
            else None
            for job in shared
        ]
        tables: list[tuple[list[_JobPlan], list[int], np.ndarray]] = []
        for ti, (device_type, idx) in enumerate(groups):
            sizes = [node_sizes[i] for i in idx]
            min_nodes_t = _min_nodes_table(sizes, capacity[ti])
            views = [
                self._typed_view(job, device_type, idx, len(nodes), models[j])
                for j, job in enumerate(shared)
            ]
            moving = [0 <= current[j] != ti for j in range(len(shared))]
            shares = (weights, np.minimum(fair, capacity[ti]), ones, moving, self.payback_margin)
            plans = self._build_plans(views, sizes, capacity[ti], min_nodes_t, shares)
            for view, pl in zip(views, plans, strict=True):
                if view.allowed_nodes is not None and not view.allowed_nodes:
                    pl.utility[:] = _NEG
            tables.append((plans, sizes, min_nodes_t))
        self._common_normaliser(tables, capacity, total, fair)
        service = self._service_weights(shared)
        for plans, _, _ in tables:
            for j, pl in enumerate(plans):
                pl.utility = pl.utility * float(service[j])
        self._restart_floor(shared, tables, current, weights * service)
        summary = self._typed_summary(shared, nodes, tables, fair)
        holders = tuple(Holder(job_id, "rigid") for job_id in pinned)
        offered = sum(n.devices if n.up and n.devices > 0 else 0 for n in nodes)
        self._admit(summary, total, holders, offered)
        admitted = [j for j, pl in enumerate(summary) if pl.admitted]
        width = max(
            (tables[ti][0][j].cap for j in admitted for ti in range(len(groups))), default=0
        )
        utility = np.full((len(admitted), len(groups), width + 1), _NEG)
        for a, j in enumerate(admitted):
            for ti in range(len(groups)):
                pl = tables[ti][0][j]
                utility[a, ti, : pl.cap + 1] = pl.utility[: pl.cap + 1]
        utility[:, :, 0] = _NEG
        for a, j in enumerate(admitted):
            if current[j] >= 0:
                for ti in self._closed_types(j, current[j], tables):
                    utility[a, ti, :] = _NEG
        choice = assign_types(utility, capacity, [current[j] for j in admitted])
        final: dict[int, tuple[int, _JobPlan]] = {}
        for ti, (_, idx) in enumerate(groups):
            plans_all, sizes, min_nodes_t = tables[ti]
            chosen = [j for a, j in enumerate(admitted) if choice[a] == ti]
            plans = [plans_all[j] for j in chosen]
            if not plans:
                continue
            for position, pl in enumerate(plans):
                pl.index = position
            self._admit(plans, capacity[ti])
            free = self._greedy(plans, capacity[ti])
            self._local_search(plans, free)
            self._place(plans, sizes, min_nodes_t, [multi_node_on[i] for i in idx])
            for j, pl in zip(chosen, plans, strict=True):
                final[j] = (ti, pl)
        decision = self._typed_decision(shared, nodes, groups, tables, summary, final, current)
        if not pinned:
            return decision
        return self._with_pinned(decision, jobs, pinned)

    @staticmethod
    def _closed_types(
        j: int, here: int, tables: list[tuple[list[_JobPlan], list[int], np.ndarray]]
    ) -> list[int]:
        """The types a running job may not move to: those where it would be faster but the
        move does not pay for itself (its goodput there on at most its current count,
        discounted for the restart, stays below its goodput now).  A type where it is slower
        stays open: it may give its devices to others."""
        current = tables[here][0][j]
        k = current.current_k
        if k <= 0:
            return []
        now = current.spread_goodput
        if now is None:
            now = float(current.goodput[k]) if k < len(current.goodput) else 0.0
        closed = []
        for ti, (plans, _, _) in enumerate(tables):
            if ti == here:
                continue
            pl = plans[j]
            top = min(k, pl.cap, len(pl.goodput) - 1)
            there = float(pl.goodput[1 : top + 1].max()) if top >= 1 else 0.0
            if there > now and there * pl.discount <= now:
                closed.append(ti)
        return closed

    def _restart_floor(
        self,
        jobs: Sequence[JobView],
        tables: list[tuple[list[_JobPlan], list[int], np.ndarray]],
        current: list[int],
        weights: np.ndarray,
    ) -> None:
        """Value a running job's restart cost at no less than the mean job weight.

        A restart delays its job by the same seconds whatever the job's weight, and a second
        of delay counts the same in the average completion time; valued at a long job's small
        weight alone, other jobs' small gains would restart it again and again.  So a new
        allocation x' of a running job is worth w_j U(x') - max(w_mean, w_j) (U(x') -
        U(delta x')) instead of w_j U(delta x') (delta its restart discount): for p != 0 its
        entries are scaled by (w_j + w_mean (delta^p - 1)) / (w_j delta^p)."""
        mean = float(weights.mean()) if len(weights) else 0.0
        for j in range(len(jobs)):
            here = current[j]
            weight = float(weights[j])
            if here < 0 or weight >= mean or weight <= 0:
                continue
            k = tables[here][0][j].current_k
            delta = tables[here][0][j].discount
            if k <= 0 or not 0 < delta < 1:
                continue
            for ti, (plans, _, _) in enumerate(tables):
                pl = plans[j]
                keep = pl.utility[k] if ti == here and k <= pl.cap else None
                if self.p == 0:
                    pl.utility = pl.utility + (mean - weight) * math.log(delta)
                else:
                    scaled = delta**self.p
                    pl.utility = pl.utility * ((weight + mean * (scaled - 1.0)) / (weight * scaled))
                if keep is not None:
                    pl.utility[k] = keep

    @staticmethod
    def _current_type(job: JobView, nodes: Sequence[NodeView], names: list[str]) -> int:
        """Index (into ``names``) of the type the job runs on, -1 when it does not run."""
        if len(job.placement) != len(nodes):
            return -1
        used = {nodes[i].device_type for i, c in enumerate(job.placement) if c > 0}
        if len(used) != 1:
            return -1
        (device_type,) = used
        return names.index(device_type) if device_type in names else -1

    @staticmethod
    def _typed_view(
        job: JobView,
        device_type: str,
        indices: list[int],
        node_count: int,
        models: dict[str, GoodputModelLike] | None,
    ) -> JobView:
        """The job as seen on the nodes of one type: its placement and allowed nodes there
        (re-indexed), its model of that type."""
        if len(job.placement) == node_count:
            placement = tuple(int(job.placement[i]) for i in indices)
        else:
            placement = tuple(0 for _ in indices)
        allowed = None
        if job.allowed_nodes is not None:
            allowed = frozenset(p for p, i in enumerate(indices) if i in job.allowed_nodes)
        model = job.model if models is None else models.get(device_type)
        return replace(job, placement=placement, allowed_nodes=allowed, model=model)

    def _common_normaliser(
        self,
        tables: list[tuple[list[_JobPlan], list[int], np.ndarray]],
        capacity: list[int],
        total: int,
        fair: np.ndarray,
    ) -> None:
        """One normaliser per job across types, ref_j = sum_t (C_t / C) G_jt(f_j) (the average
        over the cluster's devices of its goodput on its fair share); every type's utilities
        (computed against that type's own fair goodput, unit service weight) rescaled to it."""
        for j in range(len(fair)):
            plans = [table[0][j] for table in tables]
            ref = sum(c / total * pl.fair_goodput for c, pl in zip(capacity, plans, strict=True))
            ref = max(ref, 1e-300)
            for pl in plans:
                ratio = pl.fair_goodput / ref
                if self.p == 0:
                    pl.utility = pl.utility + pl.weight * math.log(ratio)
                else:
                    pl.utility = pl.utility * ratio**self.p
                pl.fair_goodput = ref
                pl.fair_share = float(fair[j])

    def _typed_summary(
        self,
        jobs: Sequence[JobView],
        nodes: Sequence[NodeView],
        tables: list[tuple[list[_JobPlan], list[int], np.ndarray]],
        fair: np.ndarray,
    ) -> list[_JobPlan]:
        """One plan per job over all types, for admission: its best utility per count."""
        summary: list[_JobPlan] = []
        for j, job in enumerate(jobs):
            plans = [table[0][j] for table in tables]
            cap = max(pl.cap for pl in plans)
            utility = np.full(cap + 1, _NEG)
            for pl in plans:
                utility[: pl.cap + 1] = np.maximum(utility[: pl.cap + 1], pl.utility[: pl.cap + 1])
            running = job.replicas if len(job.placement) == len(nodes) else 0
            summary.append(
                _JobPlan(
                    index=j,
                    job=job,
                    cap=cap,
                    min_k=max(1, int(job.min_replicas)),
                    current_k=running,
                    goodput=np.zeros(cap + 1),
                    fair_share=float(fair[j]),
                    fair_goodput=plans[0].fair_goodput,
                    weight=plans[0].weight,
                    discount=1.0,
                    utility=utility,
                )
            )
        return summary

    def _typed_decision(
        self,
        jobs: Sequence[JobView],
        nodes: Sequence[NodeView],
        groups: list[tuple[str, list[int]]],
        tables: list[tuple[list[_JobPlan], list[int], np.ndarray]],
        summary: list[_JobPlan],
        final: dict[int, tuple[int, _JobPlan]],
        current: list[int],
    ) -> Decision:
        placements: dict[str, Placement] = {}
        reasons: dict[str, str] = {}
        waiting: dict[str, Waiting] = {}
        empty: Placement = tuple(0 for _ in nodes)
        for j, job in enumerate(jobs):
            entry = final.get(j)
            if entry is None or not entry[1].admitted or entry[1].k <= 0:
                continue
            ti, pl = entry
            placement = [0] * len(nodes)
            for position, i in enumerate(groups[ti][1]):
                placement[i] = int(pl.placement[position])
            placements[job.id] = tuple(placement)
            reason = self._reason(pl, pl.placement, tables[ti][2])
            if 0 <= current[j] != ti:
                reason = reason.replace("; started", f"; moved from {groups[current[j]][0]}")
            reasons[job.id] = f"{groups[ti][0]}: {reason}"
        free = sum(n.devices if n.up and n.devices > 0 else 0 for n in nodes) - sum(
            sum(p) for p in placements.values()
        )
        for j, job in enumerate(jobs):
            if job.id in placements:
                continue
            placements[job.id] = empty
            entry = final.get(j)
            pl = entry[1] if entry is not None and entry[1].waiting else summary[j]
            if pl.waiting is not None:
                waiting[job.id] = pl.waiting
                reasons[job.id] = pl.note or _waiting_reason(pl.waiting, max(free, 0))
            else:
                reasons[job.id] = pl.note or f"waiting (fair share {pl.fair_share:.1f})"
        return Decision(placements=placements, reasons=reasons, waiting=waiting)

    # ------------------------------------------------------------------ tables
    def _build_plans(
        self,
        jobs: Sequence[JobView],
        node_sizes: list[int],
        total: int,
        min_nodes: np.ndarray,
        shares: _Shares | None = None,
    ) -> list[_JobPlan]:
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
        whole_nodes = _whole_node_mask(node_sizes, total)
        plans: list[_JobPlan] = []
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
                first = max(1, min(max(node_sizes), int(fair[index]))) if current_k == 0 else 1
                cap = min(cap, max(min_k, current_k, first))
            fair_hi = min(total, int(math.ceil(fair[index])) + 1)
            table_len = max(cap, fair_hi, 1) + 1
            goodput = self._goodput_table(job, min_nodes, table_len)
            fair_goodput = self._fair_goodput(goodput, float(fair[index]))
            foreign = moving is not None and moving[index]  # runs on another device type
            if foreign:  # a move to another device type
                discount = self._discount(job, self.type_margin)
            else:
                discount = self._discount(job, margin) if current_k > 0 else 1.0
            speedup = goodput[: cap + 1] / fair_goodput
            weight = float(weights[index] * service[index])
            utility = weight * _utility(speedup, self.p)
            if foreign:
                utility = weight * _utility(speedup * discount, self.p)
            consolidate = False
            spread_goodput: float | None = None
            if current_k > 0:
                keep = utility[current_k] if current_k <= cap else _NEG
                spread_goodput = self._spread_goodput(job, min_nodes)
                if spread_goodput is not None and current_k <= cap:
                    # staying is worth what the job really gets where it runs, not the table's
                    # value of its count on the fewest nodes
                    keep = weight * float(
                        _utility(np.array([spread_goodput]) / fair_goodput, self.p)[0]
                    )
                utility = weight * _utility(speedup * discount, self.p)
                if current_k <= cap:
                    consolidate = bool(utility[current_k] > keep) and not job.rigid
                    utility[current_k] = max(keep, utility[current_k])
            utility[1:min_k] = _NEG
            spread = ~whole_nodes[: cap + 1]
            spread[[k for k in (current_k, min_k) if k <= cap]] = False
            utility[spread] = _NEG
            plans.append(
                _JobPlan(
                    index=index,
                    job=job,
                    cap=cap,
                    min_k=min_k,
                    current_k=current_k,
                    goodput=goodput,
                    fair_share=float(fair[index]),
                    fair_goodput=fair_goodput,
                    weight=float(weights[index]),
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
        spans = _nodes_spanned(job.placement)
        if k == 0 or job.model is None or spans <= _fewest_nodes(min_nodes, k):
            return None
        return max(_goodput_on(job.model, spans, k), 1e-12)

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
        estimate = run * (1.0 - f) / max(f, _MIN_PROGRESS_FRACTION)
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

    def _discount(self, job: JobView, margin: float | None = None) -> float:
        """Factor on the speed-up of any allocation but a running job's current one.

        A change is worth it when x' * H >= x * (H + m * d): it must earn back m times its
        restart cost d within the allocation's expected lifetime H.  So the factor is
        H / (H + m * d): in (0, 1], near 1 for long-lived allocations, small for young or
        often re-allocated jobs.
        """
        horizon = self._horizon(job)
        cost = self.restart_cost_s if job.restart_cost_s is None else float(job.restart_cost_s)
        margin = self.payback_margin if margin is None else margin
        return horizon / (horizon + margin * cost)

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
        """Best goodput for k = 0..length-1 devices on the fewest nodes (0 = infeasible)."""
        ks = np.arange(length, dtype=np.int64)
        if job.model is None:
            return ks.astype(np.float64)  # no data yet: assume linear speed-up
        replicas = ks[1:]
        nodes_needed = min_nodes[np.minimum(replicas, len(min_nodes) - 1)]
        values, _, _ = job.model.best_goodput(nodes_needed, replicas)
        table = np.zeros(length, dtype=np.float64)
        finite = np.nan_to_num(np.asarray(values, dtype=np.float64), nan=0.0, posinf=0.0)
        table[1:] = np.maximum(finite, 0.0)
        return table

    @staticmethod
    def _fair_goodput(goodput: np.ndarray, fair_share: float) -> float:
        """Goodput at a fractional share, linear between the neighbouring integers."""
        lo = int(math.floor(fair_share))
        lo = min(lo, len(goodput) - 2)
        hi = lo + 1
        frac = fair_share - lo
        value = float(goodput[lo] + frac * (goodput[hi] - goodput[lo]))
        if value <= 0:
            positive = goodput[goodput > 0]
            value = float(positive.min()) if positive.size else 1.0
        return value

    # ------------------------------------------------------------------ admission
    def _admit(
        self,
        plans: list[_JobPlan],
        total: int,
        pinned: tuple[Holder, ...] = (),
        offered: int | None = None,
    ) -> None:
        """Give each admitted job its minimum; least attained service first when short.
        ``pinned``: the jobs holding the devices the nodes ``offered`` beyond ``total``."""
        runnable = [pl for pl in plans if pl.min_k <= pl.cap and pl.utility[pl.min_k] > _NEG]
        offered = total if offered is None else offered
        for pl in plans:
            if pl not in runnable:
                if total < pl.min_k <= offered:
                    pl.waiting = Waiting("devices", pl.min_k, pinned)
                elif pl.min_k > total:
                    pl.waiting = Waiting("size", pl.min_k)
                    pl.note = f"cannot run: needs {pl.min_k} devices, cluster offers {offered}"
                else:
                    pl.waiting = Waiting("bounds", pl.min_k)
                    pl.note = "cannot run: no feasible replica count within its bounds"

        def service_key(pl: _JobPlan) -> tuple[float, float, int, int]:
            # A running job's first round of service is free and it wins ties, so jobs that
            # arrive together do not preempt each other before any has trained.
            service = max(pl.job.attained_gpu_s, 0.0)
            running = pl.current_k > 0
            if running:
                service = max(service - self.interval_s * pl.current_k, 0.0) / self.preempt_ratio
            return (-float(pl.job.priority), service, 0 if running else 1, pl.index)

        used = 0
        ahead: list[_JobPlan] = []
        for pl in sorted(runnable, key=service_key):
            if used + pl.min_k <= total:
                pl.admitted = True
                pl.k = pl.min_k
                used += pl.min_k
                ahead.append(pl)
            else:
                holders = pinned + tuple(Holder(a.job.id, _hold_rule(a, pl)) for a in ahead)
                pl.waiting = Waiting("devices", pl.min_k, holders)

    # ------------------------------------------------------------------ greedy
    @staticmethod
    def _best_step(pl: _JobPlan, free: int) -> tuple[float, int]:
        """Highest utility gain per device over the increments k -> k' (k' <= cap, free)."""
        top = min(pl.cap, pl.k + free)
        if top <= pl.k:
            return _NEG, pl.k
        here = pl.utility[pl.k]
        ahead = pl.utility[pl.k + 1 : top + 1]
        with np.errstate(invalid="ignore"):
            gains = (ahead - here) / np.arange(1, top - pl.k + 1)
        gains = np.where(np.isnan(gains), _NEG, gains)
        best = int(np.argmax(gains))
        return float(gains[best]), pl.k + 1 + best

    def _greedy(self, plans: list[_JobPlan], total: int) -> int:
        """Hand out the remaining devices by utility gain per device; returns devices left."""
        free = total - sum(pl.k for pl in plans if pl.admitted)
        heap: list[tuple[float, int, int]] = []
        for pl in plans:
            if pl.admitted:
                gain, target = self._best_step(pl, free)
                if gain > 0:
                    heap.append((-gain, pl.index, target))
        heapq.heapify(heap)
        while heap and free > 0:
            neg_gain, index, target = heapq.heappop(heap)
            pl = plans[index]
            if target - pl.k > free or target <= pl.k:
                gain, target = self._best_step(pl, free)
                if gain > 0:
                    heapq.heappush(heap, (-gain, index, target))
                continue
            free -= target - pl.k
            pl.k = target
            gain, target = self._best_step(pl, free)
            if gain > 0:
                heapq.heappush(heap, (-gain, index, target))
        return free

    # ------------------------------------------------------------------ local search
    def _local_search(self, plans: list[_JobPlan], free: int) -> None:
        """Move d devices from one job to another (or from the free pool) while it helps."""
        active = [pl for pl in plans if pl.admitted]
        if len(active) < 1:
            return
        width = max(pl.cap for pl in active) + 1
        table = np.full((len(active), width), _NEG)
        lower = np.array([pl.min_k for pl in active])
        for row, pl in enumerate(active):
            table[row, : pl.cap + 1] = pl.utility[: pl.cap + 1]
            table[row, : pl.min_k] = _NEG
        k = np.array([pl.k for pl in active])
        max_delta = max(1, min(width - 1, 16))
        deltas = np.arange(1, max_delta + 1)
        for _ in range(self.local_search_steps * len(active) + 1):
            with np.errstate(over="ignore", invalid="ignore"):
                move, _ = self._best_move(table, k, lower, deltas, free)
            if move is None:
                break
            donor_row, receiver_row, delta = move
            if donor_row < 0:
                free -= delta
            else:
                k[donor_row] -= delta
            k[receiver_row] += delta
        for row, pl in enumerate(active):
            pl.k = int(k[row])

    @staticmethod
    def _best_move(
        table: np.ndarray, k: np.ndarray, lower: np.ndarray, deltas: np.ndarray, free: int
    ) -> tuple[tuple[int, int, int] | None, float]:
        """The best improving move: (donor row, or -1 for the free pool; receiver row; d)."""
        rows = np.arange(table.shape[0])
        cols = np.arange(len(deltas))
        width = table.shape[1]
        here = table[rows, k]
        up_idx = k[:, None] + deltas[None, :]
        gain_up = np.where(
            up_idx < width, table[rows[:, None], np.minimum(up_idx, width - 1)], _NEG
        )
        gain_up = np.nan_to_num(gain_up - here[:, None], nan=_NEG)
        down_idx = k[:, None] - deltas[None, :]
        loss_down = np.where(
            down_idx >= lower[:, None],
            here[:, None] - table[rows[:, None], np.maximum(down_idx, 0)],
            np.inf,
        )
        loss_down = np.nan_to_num(loss_down, nan=np.inf)
        best_gain = 1e-12
        move: tuple[int, int, int] | None = None
        if free > 0:  # devices from the free pool
            usable = deltas <= free
            sub = gain_up[:, usable]
            if sub.size:
                row, col = np.unravel_index(int(np.argmax(sub)), sub.shape)
                if sub[row, col] > best_gain:
                    best_gain = float(sub[row, col])
                    move = (-1, int(row), int(deltas[usable][col]))
        if table.shape[0] < 2:
            return move, best_gain
        # transfers of d devices between two different jobs: best receiver and best donor
        # per d, falling back to the runner-up when both are the same job
        receiver = np.argmax(gain_up, axis=0)
        receiver_gain = gain_up[receiver, cols]
        masked_gain = gain_up.copy()
        masked_gain[receiver, cols] = _NEG
        second_gain = masked_gain.max(axis=0)
        donor = np.argmin(loss_down, axis=0)
        donor_loss = loss_down[donor, cols]
        masked_loss = loss_down.copy()
        masked_loss[donor, cols] = np.inf
        second_loss = masked_loss.min(axis=0)
        same = receiver == donor
        keep_receiver = receiver_gain - second_loss >= second_gain - donor_loss
        net = np.where(
            same,
            np.where(keep_receiver, receiver_gain - second_loss, second_gain - donor_loss),
            receiver_gain - donor_loss,
        )
        net = np.nan_to_num(net, nan=_NEG)
        d = int(np.argmax(net))
        if net[d] > best_gain:
            r, g = int(receiver[d]), int(donor[d])
            if r == g:
                if keep_receiver[d]:
                    g = int(np.argmin(masked_loss[:, d]))
                else:
                    r = int(np.argmax(masked_gain[:, d]))
            best_gain = float(net[d])
            move = (g, r, int(deltas[d]))
        return move, best_gain

    # ------------------------------------------------------------------ placement
    def _place(
        self,
        plans: list[_JobPlan],
        node_sizes: list[int],
        min_nodes: np.ndarray,
        multi_node_on: list[bool] | None = None,
    ) -> None:
        """Put replica counts onto nodes: keep unchanged jobs, pack the rest, no shared
        node between two multi-node jobs (``multi_node_on``: nodes already used by one); a job
        that cannot be placed shrinks."""
        free = list(node_sizes)
        multi_node_on = list(multi_node_on) if multi_node_on else [False] * len(node_sizes)
        running = [pl for pl in plans if pl.admitted and pl.k > 0]
        pending: list[_JobPlan] = []
        # 1. jobs keeping their replica count keep their devices when still valid
        for pl in sorted(running, key=lambda q: (-q.k, q.index)):
            old = pl.job.placement
            if (
                pl.k == pl.current_k
                and not pl.consolidate
                and self._still_fits(old, pl.job.usable(free), multi_node_on)
            ):
                self._take(pl, old, free, multi_node_on)
                continue
            pending.append(pl)
        # 2. the rest, largest first: on one node when possible, else whole nodes first
        # devices the jobs still to be placed hold now: avoided while possible, so that a job
        # which ends up at its old count can stay where it is instead of being moved
        held = [0] * len(node_sizes)
        for pl in pending:
            if len(pl.job.placement) == len(node_sizes):
                held = [h + c for h, c in zip(held, pl.job.placement, strict=True)]
        for pl in sorted(pending, key=lambda q: (-q.k, q.index)):
            if len(pl.job.placement) == len(node_sizes):
                held = [h - c for h, c in zip(held, pl.job.placement, strict=True)]
            placement = self._choose_placement(pl, free, multi_node_on, min_nodes, held)
            if placement is None:
                pl.k = 0
                pl.placement = tuple(0 for _ in node_sizes)
                pl.waiting = Waiting("placement", pl.min_k)
                pl.note = "waiting: no placement fits its minimum without sharing nodes"
            else:
                self._take(pl, placement, free, multi_node_on)

    def _choose_placement(
        self,
        pl: _JobPlan,
        free: list[int],
        multi_node_on: list[bool],
        min_nodes: np.ndarray,
        held: list[int],
    ) -> Placement | None:
        """The best placement of at most ``pl.k`` (at least ``pl.min_k``) devices.

        The tables assumed k devices on the fewest nodes that hold them.  When the free devices
        are too fragmented for that, spreading k over more nodes slows the job (inter-node
        synchronisation), so fewer devices on fewer nodes may be worth more: every count from
        k down is tried and the highest predicted goodput on the nodes it would really span
        wins, stopping at the first count that fits as tightly as assumed.  A job without a
        model prefers a tight fit at any smaller count over a spread one.  A running job whose
        count is unchanged and whose devices are still free stays where it is.
        """
        best: tuple[float, Placement] | None = None
        spread_tries = 0
        free = pl.job.usable(free)
        unheld = [max(f - h, 0) for f, h in zip(free, held, strict=True)]
        for k in range(pl.k, pl.min_k - 1, -1):
            fewest = _fewest_nodes(min_nodes, k)
            candidate: Placement | None
            can_stay = k == pl.current_k and self._still_fits(pl.job.placement, free, multi_node_on)
            if can_stay and not pl.consolidate:
                candidate = pl.job.placement
            else:
                candidate = self._fit(k, unheld, multi_node_on)
                if candidate is None or _nodes_spanned(candidate) > fewest:
                    candidate = self._fit(k, free, multi_node_on)
            if candidate is None:
                continue
            spans = _nodes_spanned(candidate)
            tight = spans <= fewest
            if not tight and can_stay and pl.consolidate:
                candidate = pl.job.placement  # no tighter room: stay rather than move
                spans = _nodes_spanned(candidate)
            if tight:
                value = float(pl.goodput[k]) if k < len(pl.goodput) else 0.0
            elif pl.job.model is None:
                value = 0.0
            else:
                value = _goodput_on(pl.job.model, spans, k)
            if best is None or value > best[0]:
                best = (value, candidate)
            if tight:
                break
            spread_tries += 1
            if spread_tries >= _MAX_SPREAD_TRIES:
                break
        return None if best is None else best[1]

    @staticmethod
    def _still_fits(old: Placement, free: list[int], multi_node_on: list[bool]) -> bool:
        """Whether a job's current placement is still free (and clashes with no multi-node
        job when it spans several nodes)."""
        if len(old) != len(free) or sum(old) == 0:
            return False
        if any(c > f for c, f in zip(old, free, strict=True)):
            return False
        spans = _nodes_spanned(old) > 1
        return not (spans and any(c > 0 and multi_node_on[i] for i, c in enumerate(old)))

    @staticmethod
    def _take(
        pl: _JobPlan, placement: Placement, free: list[int], multi_node_on: list[bool]
    ) -> None:
        spans = _nodes_spanned(placement) > 1
        for i, c in enumerate(placement):
            free[i] -= c
            if spans and c > 0:
                multi_node_on[i] = True
        pl.placement = tuple(int(c) for c in placement)
        pl.k = int(sum(placement))

    @staticmethod
    def _fit(k: int, free: list[int], multi_node_on: list[bool]) -> Placement | None:
        """A placement of k devices on as few nodes as possible, or None."""
        order = sorted(range(len(free)), key=lambda i: (free[i], i))
        for i in order:  # best fit on a single node
            if free[i] >= k:
                placement = [0] * len(free)
                placement[i] = k
                return tuple(placement)
        # several nodes, none already used by another multi-node job; largest free first
        candidates = sorted(
            (i for i in range(len(free)) if free[i] > 0 and not multi_node_on[i]),
            key=lambda i: (-free[i], i),
        )
        if sum(free[i] for i in candidates) < k:
            return None
        placement = [0] * len(free)
        left = k
        chosen: list[int] = []
        for i in candidates:
            if left == 0:
                break
            chosen.append(i)
            left -= min(free[i], left)
        # fill the last node chosen as little as needed: best fit for the remainder
        left = k
        for i in chosen[:-1]:
            placement[i] = free[i]
            left -= free[i]
        rest = [i for i in candidates if i not in chosen[:-1] and free[i] >= left]
        last = min(rest, key=lambda i: (free[i], i)) if rest else chosen[-1]
        placement[last] = left
        return tuple(placement)

    # ------------------------------------------------------------------ result
    def _decision(
        self, plans: list[_JobPlan], nodes: Sequence[NodeView], min_nodes: np.ndarray, total: int
    ) -> Decision:
        placements: dict[str, Placement] = {}
        reasons: dict[str, str] = {}
        waiting: dict[str, Waiting] = {}
        empty: Placement = tuple(0 for _ in nodes)
        for pl in plans:
            placements[pl.job.id] = pl.placement if pl.admitted and pl.k > 0 else empty
        free = total - sum(sum(p) for p in placements.values())
        for pl in plans:
            placement = placements[pl.job.id]
            if sum(placement) == 0 and pl.waiting is not None:
                waiting[pl.job.id] = pl.waiting
                reasons[pl.job.id] = pl.note or _waiting_reason(pl.waiting, free)
            else:
                reasons[pl.job.id] = self._reason(pl, placement, min_nodes)
        return Decision(placements=placements, reasons=reasons, waiting=waiting)

    @staticmethod
    def _placed_goodput(pl: _JobPlan, k: int, nodes: int, min_nodes: np.ndarray) -> float:
        """Predicted goodput of k devices on the ``nodes`` nodes they really span: the table's
        value (k on the fewest nodes) unless they span more and the job has a model."""
        if pl.job.model is not None and nodes > _fewest_nodes(min_nodes, k):
            return _goodput_on(pl.job.model, nodes, k)
        return float(pl.goodput[k]) if k < len(pl.goodput) else float("nan")

    def _reason(self, pl: _JobPlan, placement: Placement, min_nodes: np.ndarray) -> str:
        k = int(sum(placement))
        fair = f"fair share {pl.fair_share:.1f}"
        if k == 0:
            if pl.note:
                return pl.note
            return f"waiting ({fair})"
        n = _nodes_spanned(placement)
        placed = self._placed_goodput(pl, k, n, min_nodes)
        share = placed / pl.fair_goodput
        # speed-up over the job's goodput on one device: the figure its predictions show
        single = float(pl.goodput[1]) if len(pl.goodput) > 1 else 0.0
        speedup = placed / single if single > 0 else float("nan")
        head = (
            f"{k} dev on {n} node{'s' if n > 1 else ''}, speed-up {speedup:.2f}x over 1 device,"
            f" {share:.2f}x its fair share's goodput ({fair})"
        )
        if pl.job.rigid:
            head += "; rigid"
        if pl.job.model is None:
            head += ", no profile yet: linear speed-up assumed"
        if pl.current_k == 0:
            return head + "; started"
        if placement == pl.job.placement:
            threshold = share / max(pl.discount, 1e-9)
            return head + f"; kept (a restart pays only above {threshold:.2f}x)"
        before = pl.goodput[pl.current_k] if pl.current_k < len(pl.goodput) else 0.0
        if pl.spread_goodput is not None:
            before = pl.spread_goodput
        change = (pl.goodput[k] / before - 1.0) * 100 if before > 0 else float("inf")
        verb = "grown" if k > pl.current_k else "shrunk" if k < pl.current_k else "moved"
        return head + f"; {verb} from {pl.current_k} (own goodput {change:+.0f}%)"
