"""Typed choice: on a cluster of several device types, a type per job (per-type models and
prices that clear each type, ``core.policy.prices``), then the search within each type."""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import partial

import numpy as np

from pollux_local.core.policy.objective import (
    NEG,
    JobPlan,
    min_nodes_table,
    set_pinned_aside,
)
from pollux_local.core.policy.prices import assign_types, complete_models
from pollux_local.core.policy.reasons import Reasons, WordedWhenRead, waiting_words
from pollux_local.core.types import (
    Decision,
    GoodputModelLike,
    Holder,
    JobView,
    NodeView,
    Placement,
    Waiting,
)


class TypedChoice(Reasons):
    """The choice of a device type per job."""

    # ------------------------------------------------------------------ several device types
    def _decide_typed(
        self, jobs: Sequence[JobView], nodes: Sequence[NodeView], node_sizes: list[int]
    ) -> Decision:
        """Nodes of several device types: every job runs on one type.  Tables per type (the
        job's model there, measured or predicted: ``core.hetero``), one normaliser per job
        across types, admission over the whole cluster, a type per admitted job from prices
        that clear each type's devices, then per type the homogeneous search and placement."""
        pinned, node_sizes, multi_node_on, shared = set_pinned_aside(jobs, node_sizes)
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
        placed = self._placed(shared, len(nodes))
        current = self._current_types(placed, nodes, names)
        ones = np.ones(len(shared))
        models = [
            complete_models(job.models_by_type, job.type_rates, names)
            if job.models_by_type is not None
            else None
            for job in shared
        ]
        tables: list[tuple[list[JobPlan], list[int], np.ndarray]] = []
        for ti, (device_type, idx) in enumerate(groups):
            sizes = [node_sizes[i] for i in idx]
            min_nodes_t = min_nodes_table(sizes, capacity[ti])
            here = placed[:, idx].tolist()
            views = [
                self._typed_view(job, device_type, idx, tuple(here[j]), models[j])
                for j, job in enumerate(shared)
            ]
            moving = [0 <= current[j] != ti for j in range(len(shared))]
            shares = (weights, np.minimum(fair, capacity[ti]), ones, moving, self.payback_margin)
            plans = self._build_plans(views, sizes, capacity[ti], min_nodes_t, shares)
            for view, pl in zip(views, plans, strict=True):
                if view.allowed_nodes is not None and not view.allowed_nodes:
                    pl.utility[:] = NEG
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
        utility = np.full((len(admitted), len(groups), width + 1), NEG)
        for a, j in enumerate(admitted):
            for ti in range(len(groups)):
                pl = tables[ti][0][j]
                utility[a, ti, : pl.cap + 1] = pl.utility[: pl.cap + 1]
        utility[:, :, 0] = NEG
        for a, j in enumerate(admitted):
            if current[j] >= 0:
                for ti in self._closed_types(j, current[j], tables):
                    utility[a, ti, :] = NEG
        choice = assign_types(utility, capacity, [current[j] for j in admitted])
        final: dict[int, tuple[int, JobPlan]] = {}
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
        j: int, here: int, tables: list[tuple[list[JobPlan], list[int], np.ndarray]]
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
        tables: list[tuple[list[JobPlan], list[int], np.ndarray]],
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
    def _placed(jobs: Sequence[JobView], node_count: int) -> np.ndarray:
        """Devices per job (rows) and node (columns); zeros for a job placed elsewhere."""
        placed = np.zeros((len(jobs), node_count), dtype=np.int64)
        for j, job in enumerate(jobs):
            if len(job.placement) == node_count and any(job.placement):
                placed[j] = job.placement
        return placed

    @staticmethod
    def _current_types(
        placed: np.ndarray, nodes: Sequence[NodeView], names: list[str]
    ) -> list[int]:
        """Index (into ``names``) of the type each job runs on, -1 when it does not run (or
        runs on a type not offered now)."""
        kinds = sorted({node.device_type for node in nodes})
        of_node = np.array([kinds.index(node.device_type) for node in nodes], dtype=np.int64)
        used = np.zeros((placed.shape[0], len(kinds)), dtype=bool)
        for t in range(len(kinds)):
            used[:, t] = (placed[:, of_node == t] > 0).any(axis=1)
        current = []
        for row in used:
            found = np.nonzero(row)[0]
            kind = kinds[int(found[0])] if found.size == 1 else None
            current.append(names.index(kind) if kind in names else -1)
        return current

    @staticmethod
    def _typed_view(
        job: JobView,
        device_type: str,
        indices: list[int],
        placement: tuple[int, ...],
        models: dict[str, GoodputModelLike] | None,
    ) -> JobView:
        """The job as seen on the nodes of one type: its ``placement`` there, its allowed
        nodes there (re-indexed), its model of that type."""
        allowed = None
        if job.allowed_nodes is not None:
            allowed = frozenset(p for p, i in enumerate(indices) if i in job.allowed_nodes)
        model = job.model if models is None else models.get(device_type)
        # a copy with three fields changed (``dataclasses.replace`` would check every field
        # again, once per job and type of every decision)
        view: JobView = object.__new__(JobView)
        fields = view.__dict__
        fields.update(job.__dict__)
        fields["placement"] = placement
        fields["allowed_nodes"] = allowed
        fields["model"] = model
        return view

    def _common_normaliser(
        self,
        tables: list[tuple[list[JobPlan], list[int], np.ndarray]],
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
        tables: list[tuple[list[JobPlan], list[int], np.ndarray]],
        fair: np.ndarray,
    ) -> list[JobPlan]:
        """One plan per job over all types, for admission: its best utility per count."""
        summary: list[JobPlan] = []
        for j, job in enumerate(jobs):
            plans = [table[0][j] for table in tables]
            cap = max(pl.cap for pl in plans)
            utility = np.full(cap + 1, NEG)
            for pl in plans:
                utility[: pl.cap + 1] = np.maximum(utility[: pl.cap + 1], pl.utility[: pl.cap + 1])
            running = job.replicas if len(job.placement) == len(nodes) else 0
            summary.append(
                JobPlan(
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
        tables: list[tuple[list[JobPlan], list[int], np.ndarray]],
        summary: list[JobPlan],
        final: dict[int, tuple[int, JobPlan]],
        current: list[int],
    ) -> Decision:
        placements: dict[str, Placement] = {}
        reasons = WordedWhenRead()
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
            moved_from = groups[current[j]][0] if 0 <= current[j] != ti else None
            reasons.later(
                job.id, partial(self._typed_reason, pl, tables[ti][2], groups[ti][0], moved_from)
            )
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
                reasons.later(job.id, partial(waiting_words, pl.note, pl.waiting, max(free, 0)))
            else:
                reasons.later(job.id, partial(_unplaced_words, pl.note, pl.fair_share))
        return Decision(placements=placements, reasons=reasons, waiting=waiting)

    def _typed_reason(
        self, pl: JobPlan, min_nodes: np.ndarray, type_name: str, moved_from: str | None
    ) -> str:
        """A placed job's reason, on its device type (and the type it moved from)."""
        reason = self._reason(pl, pl.placement, min_nodes)
        if moved_from is not None:
            reason = reason.replace("; started", f"; moved from {moved_from}")
        return f"{type_name}: {reason}"


def _unplaced_words(note: str, fair_share: float) -> str:
    """An unplaced job's reason when no rule says why it waits."""
    return note or f"waiting (fair share {fair_share:.1f})"
