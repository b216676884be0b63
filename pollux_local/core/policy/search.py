"""The allocation search: admission (who may run), a greedy fill by marginal utility, then a
bounded local search of moves between jobs."""

from __future__ import annotations

import heapq

import numpy as np

from pollux_local.core.policy.objective import NEG, JobPlan, Objective, hold_rule, nan_to
from pollux_local.core.types import (
    Holder,
    Waiting,
)

#: Increments the greedy step compares one by one (more: as one array operation).
_LOOP_STEPS = 96


class Search(Objective):
    """How many devices each job gets."""

    # ------------------------------------------------------------------ admission
    def _admit(
        self,
        plans: list[JobPlan],
        total: int,
        pinned: tuple[Holder, ...] = (),
        offered: int | None = None,
    ) -> None:
        """Give each admitted job its minimum; least attained service first when short.
        ``pinned``: the jobs holding the devices the nodes ``offered`` beyond ``total``."""
        runnable = [pl for pl in plans if pl.min_k <= pl.cap and pl.utility[pl.min_k] > NEG]
        offered = total if offered is None else offered
        can_run = {id(pl) for pl in runnable}
        behind_pinned: list[JobPlan] = []  # waiting for devices that pinned jobs hold
        for pl in plans:
            if id(pl) not in can_run:
                if total < pl.min_k <= offered:
                    pl.waiting = Waiting("devices", pl.min_k, pinned)
                    behind_pinned.append(pl)
                elif pl.min_k > total:
                    pl.waiting = Waiting("size", pl.min_k)
                    pl.note = f"cannot run: needs {pl.min_k} devices, cluster offers {offered}"
                else:
                    pl.waiting = Waiting("bounds", pl.min_k)
                    pl.note = "cannot run: no feasible replica count within its bounds"

        # A waiting job's turn among its owner's waiting jobs (0: the owner's first in the
        # queue): between jobs alike in priority and service, the owners take turns, so one
        # user's thousand queued jobs no longer hold another user's one back until every
        # one of them has started (a job of 600 s each, 40 of them on 4 devices: 6,600 s)
        turns: dict[int, int] = {}
        owners_waiting: dict[str, int] = {}
        for pl in sorted(runnable + behind_pinned, key=lambda pl: pl.index):
            if pl.current_k == 0:
                turns[id(pl)] = owners_waiting.get(pl.job.owner, 0)
                owners_waiting[pl.job.owner] = turns[id(pl)] + 1

        def service_key(pl: JobPlan) -> tuple[float, float, int, int, int]:
            # A running job's first round of service is free and it wins ties, so jobs that
            # arrive together do not preempt each other before any has trained.
            service = max(pl.job.attained_gpu_s, 0.0)
            running = pl.current_k > 0
            if running:
                service = max(service - self.interval_s * pl.current_k, 0.0) / self.preempt_ratio
            turn = turns.get(id(pl), 0)
            return (-float(pl.job.priority), service, 0 if running else 1, turn, pl.index)

        used = 0
        ahead: list[JobPlan] = []
        # the first job left waiting for devices that has waited ``reserve_after_s``
        blocked: JobPlan | None = None
        waiting_anyway = {id(pl) for pl in behind_pinned}
        for pl in sorted(runnable + behind_pinned, key=service_key):
            if id(pl) in waiting_anyway:
                if blocked is None and pl.job.waited_s >= self.reserve_after_s:
                    blocked = pl
                continue
            if (
                blocked is not None
                and pl.current_k == 0
                and pl.job.rigid
                and not pl.job.preemptible
            ):
                # a job that would keep its devices until it ends (rigid, not preemptible)
                # starts only behind the first one waiting long for devices: else a stream
                # of narrow ones, each started before the last ends, holds a wide one back
                # for ever (review s65); before that, narrow ones fill the devices left
                pl.waiting = Waiting("reserved", pl.min_k, (Holder(blocked.job.id, "ahead"),))
                continue
            if used + pl.min_k <= total:
                pl.admitted = True
                pl.k = pl.min_k
                used += pl.min_k
                ahead.append(pl)
            else:
                holders = pinned + tuple(Holder(a.job.id, hold_rule(a, pl)) for a in ahead)
                pl.waiting = Waiting("devices", pl.min_k, holders)
                if blocked is None and pl.job.waited_s >= self.reserve_after_s:
                    blocked = pl

    # ------------------------------------------------------------------ greedy
    @staticmethod
    def _best_step(pl: JobPlan, free: int, utility: list[float] | None = None) -> tuple[float, int]:
        """Highest utility gain per device over the increments k -> k' (k' <= cap, free):
        max over k' of (U(k') - U(k)) / (k' - k), the first k' on ties, a NaN gain (-inf to
        -inf) counting as -inf.  ``utility``: ``pl.utility`` as a list (read faster)."""
        top = min(pl.cap, pl.k + free)
        if top <= pl.k:
            return NEG, pl.k
        if top - pl.k > _LOOP_STEPS:  # a long range: at once
            here_value = pl.utility[pl.k]
            ahead = pl.utility[pl.k + 1 : top + 1]
            with np.errstate(invalid="ignore"):
                gains = (ahead - here_value) / np.arange(1, top - pl.k + 1)
            gains = np.where(np.isnan(gains), NEG, gains)
            index = int(np.argmax(gains))
            return float(gains[index]), pl.k + 1 + index
        values = pl.utility.tolist() if utility is None else utility
        here = values[pl.k]
        best_gain, best = NEG, pl.k + 1
        first = True
        for target in range(pl.k + 1, top + 1):
            gain = (values[target] - here) / (target - pl.k)
            if gain != gain:  # NaN
                gain = NEG
            if first or gain > best_gain:
                best_gain, best = gain, target
                first = False
        return float(best_gain), best

    def _greedy(self, plans: list[JobPlan], total: int) -> int:
        """Hand out the remaining devices by utility gain per device; returns devices left."""
        free = total - sum(pl.k for pl in plans if pl.admitted)
        utilities = {pl.index: pl.utility.tolist() for pl in plans if pl.admitted}
        heap: list[tuple[float, int, int]] = []
        for pl in plans:
            if pl.admitted:
                gain, target = self._best_step(pl, free, utilities[pl.index])
                if gain > 0:
                    heap.append((-gain, pl.index, target))
        heapq.heapify(heap)
        while heap and free > 0:
            neg_gain, index, target = heapq.heappop(heap)
            pl = plans[index]
            if target - pl.k > free or target <= pl.k:
                gain, target = self._best_step(pl, free, utilities[index])
                if gain > 0:
                    heapq.heappush(heap, (-gain, index, target))
                continue
            free -= target - pl.k
            pl.k = target
            gain, target = self._best_step(pl, free, utilities[index])
            if gain > 0:
                heapq.heappush(heap, (-gain, index, target))
        return free

    # ------------------------------------------------------------------ local search
    def _local_search(self, plans: list[JobPlan], free: int) -> None:
        """Move d devices from one job to another (or from the free pool) while it helps."""
        active = [pl for pl in plans if pl.admitted]
        if len(active) < 1:
            return
        width = max(pl.cap for pl in active) + 1
        table = np.full((len(active), width), NEG)
        lower = np.array([pl.min_k for pl in active])
        for row, pl in enumerate(active):
            table[row, : pl.cap + 1] = pl.utility[: pl.cap + 1]
            table[row, : pl.min_k] = NEG
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
        gain_up = np.where(up_idx < width, table[rows[:, None], np.minimum(up_idx, width - 1)], NEG)
        gain_up = nan_to(gain_up - here[:, None], NEG)
        down_idx = k[:, None] - deltas[None, :]
        loss_down = np.where(
            down_idx >= lower[:, None],
            here[:, None] - table[rows[:, None], np.maximum(down_idx, 0)],
            np.inf,
        )
        loss_down = nan_to(loss_down, np.inf)
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
        masked_gain[receiver, cols] = NEG
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
        net = nan_to(net, NEG)
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
