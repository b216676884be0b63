"""Placement: which devices of which nodes a job's count lands on (packed, the fewest nodes,
its current placement kept when it still fits, and a node it runs on kept when a job that
resizes in place changes its count)."""

from __future__ import annotations

import operator

import numpy as np

from pollux_local.core.policy.objective import (
    MAX_SPREAD_TRIES,
    JobPlan,
    fewest_nodes,
    goodput_on,
    nodes_spanned,
)
from pollux_local.core.policy.search import Search
from pollux_local.core.types import (
    Placement,
    Waiting,
)


class Placing(Search):
    """Counts turned into placements."""

    # ------------------------------------------------------------------ placement
    def _place(
        self,
        plans: list[JobPlan],
        node_sizes: list[int],
        min_nodes: np.ndarray,
        multi_node_on: list[bool] | None = None,
    ) -> None:
        """Put replica counts onto nodes: keep unchanged jobs, pack the rest (largest first,
        the most constrained first among equals), no shared node between two multi-node jobs
        (``multi_node_on``: nodes already used by one); a job that cannot be placed
        shrinks."""
        free = list(node_sizes)
        multi_node_on = list(multi_node_on) if multi_node_on else [False] * len(node_sizes)
        running = [pl for pl in plans if pl.admitted and pl.k > 0]
        pending: list[JobPlan] = []
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
        # (at equal counts, a job that may use fewer nodes first: its nodes go to it, and a
        # job free to go anywhere takes another)
        for pl in sorted(pending, key=lambda q: (-q.k, allowed_count(q, len(free)), q.index)):
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
        pl: JobPlan,
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
            fewest = fewest_nodes(min_nodes, k)
            candidate: Placement | None
            can_stay = k == pl.current_k and self._still_fits(pl.job.placement, free, multi_node_on)
            if can_stay and not pl.consolidate:
                candidate = pl.job.placement
            else:
                # a job that resizes in place keeps one of its nodes where it can
                warm = pl.current_k > 0 and pl.job.warm_resize_cost_s is not None
                now_on = pl.job.placement if warm else ()
                candidate = self._fit(k, unheld, multi_node_on, now_on)
                if candidate is None or nodes_spanned(candidate) > fewest:
                    candidate = self._fit(k, free, multi_node_on, now_on)
            if candidate is None:
                continue
            spans = nodes_spanned(candidate)
            tight = spans <= fewest
            if not tight and can_stay and pl.consolidate:
                candidate = pl.job.placement  # no tighter room: stay rather than move
                spans = nodes_spanned(candidate)
            if tight:
                value = float(pl.goodput[k]) if k < len(pl.goodput) else 0.0
            elif pl.job.model is None:
                value = 0.0
            else:
                value = goodput_on(pl.job.model, spans, k)
            if best is None or value > best[0]:
                best = (value, candidate)
            if tight:
                break
            spread_tries += 1
            if spread_tries >= MAX_SPREAD_TRIES:
                break
        return None if best is None else best[1]

    @staticmethod
    def _still_fits(old: Placement, free: list[int], multi_node_on: list[bool]) -> bool:
        """Whether a job's current placement is still free (and clashes with no multi-node
        job when it spans several nodes)."""
        if len(old) != len(free) or sum(old) == 0:
            return False
        if any(map(operator.gt, old, free)):  # (the lengths are equal)
            return False
        spans = nodes_spanned(old) > 1
        return not (spans and any(c > 0 and multi_node_on[i] for i, c in enumerate(old)))

    @staticmethod
    def _take(
        pl: JobPlan, placement: Placement, free: list[int], multi_node_on: list[bool]
    ) -> None:
        spans = nodes_spanned(placement) > 1
        for i, c in enumerate(placement):
            if c:
                free[i] -= c
                if spans and c > 0:
                    multi_node_on[i] = True
        pl.placement = tuple(map(int, placement))
        pl.k = int(sum(placement))

    @staticmethod
    def _fit(
        k: int, free: list[int], multi_node_on: list[bool], now_on: Placement = ()
    ) -> Placement | None:
        """A placement of k devices on as few nodes as possible, or None.

        ``now_on``: the running job's placement.  A node it runs on comes first (one that
        holds all k, else at equal free devices), so that a resize keeps one of its nodes and
        can be done in place instead of by a restart elsewhere."""
        kept = [len(now_on) == len(free) and now_on[i] > 0 for i in range(len(free))]
        order = sorted(range(len(free)), key=lambda i: (not kept[i], free[i], i))
        for i in order:  # a node it runs on, else best fit on a single node
            if free[i] >= k:
                placement = [0] * len(free)
                placement[i] = k
                return tuple(placement)
        # several nodes, none already used by another multi-node job; largest free first
        candidates = sorted(
            (i for i in range(len(free)) if free[i] > 0 and not multi_node_on[i]),
            key=lambda i: (-free[i], not kept[i], i),
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


def allowed_count(plan: JobPlan, nodes: int) -> int:
    """How many of the ``nodes`` nodes the job may use (``allowed_nodes``; all without)."""
    allowed = plan.job.allowed_nodes
    return nodes if allowed is None else len(allowed)
