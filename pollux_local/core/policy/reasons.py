"""The result: each job's placement and batch choice, and the reason of every placed and
waiting job."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from functools import partial

import numpy as np

from pollux_local.core.policy.objective import (
    JobPlan,
    fewest_nodes,
    goodput_on,
    nodes_spanned,
    pinned_reason,
    waiting_reason,
)
from pollux_local.core.policy.placement import Placing
from pollux_local.core.types import (
    Decision,
    Holder,
    JobView,
    NodeView,
    Placement,
    Waiting,
)


class WordedWhenRead(Mapping[str, str]):
    """Reasons each worded the first time it is read: a pass that explains nothing (every
    simulated one) reads none of them.  An entry is its text or what makes it."""

    def __init__(self) -> None:
        self._entries: dict[str, str | Callable[[], str]] = {}

    def later(self, job_id: str, make: Callable[[], str]) -> None:
        self._entries[job_id] = make

    def __getitem__(self, job_id: str) -> str:
        entry = self._entries[job_id]
        if not isinstance(entry, str):
            entry = self._entries[job_id] = entry()
        return entry

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)


class Reasons(Placing):
    """Decisions and the reasons given with them."""

    # ------------------------------------------------------------------ result
    def _decision(
        self, plans: list[JobPlan], nodes: Sequence[NodeView], min_nodes: np.ndarray, total: int
    ) -> Decision:
        placements: dict[str, Placement] = {}
        reasons = WordedWhenRead()
        waiting: dict[str, Waiting] = {}
        empty: Placement = tuple(0 for _ in nodes)
        for pl in plans:
            placements[pl.job.id] = pl.placement if pl.admitted and pl.k > 0 else empty
        free = total - sum(sum(p) for p in placements.values())
        for pl in plans:
            placement = placements[pl.job.id]
            if sum(placement) == 0 and pl.waiting is not None:
                waiting[pl.job.id] = pl.waiting
                reasons.later(pl.job.id, partial(waiting_words, pl.note, pl.waiting, free))
            else:
                reasons.later(pl.job.id, partial(self._reason, pl, placement, min_nodes))
        return Decision(placements=placements, reasons=reasons, waiting=waiting)

    @staticmethod
    def _placed_goodput(pl: JobPlan, k: int, nodes: int, min_nodes: np.ndarray) -> float:
        """Predicted goodput of k devices on the ``nodes`` nodes they really span: the table's
        value (k on the fewest nodes) unless they span more and the job has a model."""
        if pl.job.model is not None and nodes > fewest_nodes(min_nodes, k):
            return goodput_on(pl.job.model, nodes, k)
        return float(pl.goodput[k]) if k < len(pl.goodput) else float("nan")

    def _reason(self, pl: JobPlan, placement: Placement, min_nodes: np.ndarray) -> str:
        k = int(sum(placement))
        fair = f"fair share {pl.fair_share:.1f}"
        if k == 0:
            if pl.note:
                return pl.note
            return f"waiting ({fair})"
        n = nodes_spanned(placement)
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
        reasons = {job_id: pinned_reason(placement) for job_id, placement in pinned.items()}
        waiting: dict[str, Waiting] = {}
        holders = tuple(Holder(job_id, "rigid") for job_id in pinned)
        for job in shared:
            needs = max(1, int(job.min_replicas))
            if holders:
                waiting[job.id] = Waiting("devices", needs, holders)
                reasons[job.id] = waiting_reason(waiting[job.id], 0)
            else:
                reasons[job.id] = "waiting: no devices available"
        return Decision(placements=placements, reasons=reasons, waiting=waiting)

    @staticmethod
    def _with_pinned(
        decision: Decision, jobs: Sequence[JobView], pinned: dict[str, Placement]
    ) -> Decision:
        """The shared devices' decision with the pinned jobs added (in the jobs' order)."""
        placements = {j.id: pinned.get(j.id) or decision.placements[j.id] for j in jobs}
        reasons = WordedWhenRead()
        for j in jobs:
            if j.id in pinned:
                reasons.later(j.id, partial(pinned_reason, pinned[j.id]))
            else:
                reasons.later(j.id, partial(decision.reasons.__getitem__, j.id))
        return Decision(placements=placements, reasons=reasons, waiting=decision.waiting)


def waiting_words(note: str, waiting: Waiting, free: int) -> str:
    """A waiting job's reason: its plan's note, else the words of why it waits."""
    return note or waiting_reason(waiting, free)
