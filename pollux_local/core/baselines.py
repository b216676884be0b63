"""Baseline allocation policies with the same interface as the goodput policy.

* :class:`FifoPolicy` — first come, first served, each job on its user-given device count; a
  running job is never preempted and the queue head blocks those behind it.
* :class:`TiresiasPolicy` — two-queue discretised least-attained-service: jobs that have used
  less than ``threshold_gpu_s`` device-seconds (16 GPU-hours by default) come first; within a
  queue, first come first served (the low queue in order of demotion).  Each job runs on its
  static device count or waits; a job in a lower position is preempted when the devices are
  needed by one ahead of it.
* :class:`OptimusPolicy` — every job first gets one device (in submission order), then devices
  go one at a time to the job whose remaining run time drops the most:
  gain_j(k) = remaining_iters_j * (T_j(k) - T_j(k + 1)), T_j(k) the seconds per iteration on k
  devices at the job's static batch.

All three are pure (no clock, no I/O) and deterministic; they place a job on as few nodes as
possible: the fullest node that still fits it, else the emptiest nodes first.  A rigid job
(``JobView.rigid``) runs on exactly its size or waits and is never resized; running, unless
preemptible, it keeps its devices ahead of every other job.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from pollux_local.core.types import Decision, JobView, NodeView, Placement

#: Tiresias' queue threshold: 16 GPU-hours of attained service.
TIRESIAS_THRESHOLD_GPU_S = 16 * 3600.0


def node_capacity(nodes: Sequence[NodeView]) -> list[int]:
    """Devices each node offers right now (0 when it is down)."""
    return [max(0, n.devices) if n.up else 0 for n in nodes]


def valid_placement(placement: Placement, free: Sequence[int]) -> bool:
    """Whether ``placement`` (one entry per node) fits into ``free`` and is non-empty."""
    return (
        len(placement) == len(free)
        and sum(placement) > 0
        and all(0 <= used <= room for used, room in zip(placement, free, strict=True))
    )


def pack(replicas: int, free: Sequence[int]) -> Placement | None:
    """Place ``replicas`` devices on as few nodes as possible, or ``None`` when they don't fit.

    One node if any can hold them all (the one with the least room that does, so large gaps
    stay open); otherwise nodes in decreasing order of free devices.
    """
    if replicas <= 0 or replicas > sum(free):
        return None
    fitting = [i for i, room in enumerate(free) if room >= replicas]
    counts = [0] * len(free)
    if fitting:
        best = min(fitting, key=lambda i: (free[i], i))
        counts[best] = replicas
        return tuple(counts)
    left = replicas
    for i in sorted(range(len(free)), key=lambda i: (-free[i], i)):
        if left == 0:
            break
        take = min(free[i], left)
        counts[i] = take
        left -= take
    return tuple(counts)


def _static_need(job: JobView, total: int) -> int:
    """The device count a static-configuration job asks for, within its bounds and the cluster
    (a rigid job: exactly its size, even beyond the cluster, where it waits)."""
    if job.rigid:
        return max(job.min_replicas, 1)
    need = max(job.static_replicas, job.min_replicas, 1)
    return min(need, max(job.max_replicas, 1), total)


def _keep_pinned(jobs: Sequence[JobView], free: list[int]) -> dict[str, Placement]:
    """The running rigid jobs that may not be preempted keep their devices (taken from
    ``free``) while those are still offered."""
    pinned: dict[str, Placement] = {}
    for job in jobs:
        if job.pinned and valid_placement(job.placement, free):
            pinned[job.id] = job.placement
            _subtract(free, job.placement)
    return pinned


def _arrival_order(jobs: Sequence[JobView]) -> list[JobView]:
    return sorted(jobs, key=lambda j: (j.submit_time, j.id))


def _finish(
    jobs: Sequence[JobView], placed: Mapping[str, Placement], width: int, reasons: dict[str, str]
) -> Decision:
    empty = (0,) * width
    placements = {job.id: placed.get(job.id, empty) for job in jobs}
    for job in jobs:
        reasons.setdefault(job.id, "running" if sum(placements[job.id]) else "waiting")
    return Decision(placements=placements, reasons=reasons)


def _subtract(free: list[int], placement: Placement) -> None:
    for i, used in enumerate(placement):
        free[i] -= used


class FifoPolicy:
    """First come, first served on the user's static device count, without preemption."""

    name = "fifo"

    def decide(
        self,
        jobs: Sequence[JobView],
        nodes: Sequence[NodeView],
        now: float,
        rng: np.random.Generator,
    ) -> Decision:
        free = node_capacity(nodes)
        total = sum(free)
        placed: dict[str, Placement] = {}
        reasons: dict[str, str] = {}
        ordered = _arrival_order(jobs)
        for job in ordered:  # running jobs keep their devices
            if valid_placement(job.placement, free):
                placed[job.id] = job.placement
                _subtract(free, job.placement)
        blocked = False
        for job in ordered:
            if job.id in placed:
                continue
            spot = None if blocked else pack(_static_need(job, total), job.usable(free))
            if spot is None:
                blocked = True
                reasons[job.id] = "queued behind an earlier job"
                continue
            placed[job.id] = spot
            _subtract(free, spot)
        return _finish(jobs, placed, len(free), reasons)


class TiresiasPolicy:
    """Two-queue least-attained-service (discretised 2D-LAS) on static device counts.

    The policy remembers the order in which jobs were demoted to the low queue (forgetting
    jobs that leave); everything else comes from the job views.
    """

    name = "tiresias"

    def __init__(self, threshold_gpu_s: float = TIRESIAS_THRESHOLD_GPU_S) -> None:
        if threshold_gpu_s <= 0:
            raise ValueError(f"queue threshold must be positive, got {threshold_gpu_s}")
        self.threshold_gpu_s = threshold_gpu_s
        self._demotions: dict[str, int] = {}
        self._next_demotion = 0

    def decide(
        self,
        jobs: Sequence[JobView],
        nodes: Sequence[NodeView],
        now: float,
        rng: np.random.Generator,
    ) -> Decision:
        present = {job.id for job in jobs}
        self._demotions = {k: v for k, v in self._demotions.items() if k in present}
        ordered = _arrival_order(jobs)
        for job in ordered:
            if job.attained_gpu_s >= self.threshold_gpu_s and job.id not in self._demotions:
                self._demotions[job.id] = self._next_demotion
                self._next_demotion += 1
        high = [j for j in ordered if j.id not in self._demotions]
        low = sorted(
            (j for j in ordered if j.id in self._demotions), key=lambda j: self._demotions[j.id]
        )

        free = node_capacity(nodes)
        total = sum(free)
        placed = _keep_pinned(ordered, free)
        remaining = sum(free)
        admitted: list[JobView] = []
        reasons: dict[str, str] = {}
        for queue_name, queue in (("high", high), ("low", low)):
            for job in queue:
                if job.id in placed:
                    continue
                need = _static_need(job, total)
                if need <= remaining:
                    admitted.append(job)
                    remaining -= need
                else:
                    reasons[job.id] = f"waiting in the {queue_name} queue"
        for job in admitted:  # admitted jobs that already run keep their devices
            if sum(job.placement) == _static_need(job, total) and valid_placement(
                job.placement, free
            ):
                placed[job.id] = job.placement
                _subtract(free, job.placement)
        for job in admitted:
            if job.id in placed:
                continue
            spot = pack(_static_need(job, total), job.usable(free))
            if spot is None:  # cannot happen: admission counted the devices
                reasons[job.id] = "no room"
                continue
            placed[job.id] = spot
            _subtract(free, spot)
        return _finish(jobs, placed, len(free), reasons)


class OptimusPolicy:
    """Greedy marginal-gain device allocation with an oracle of each job's remaining work."""

    name = "optimus"

    def decide(
        self,
        jobs: Sequence[JobView],
        nodes: Sequence[NodeView],
        now: float,
        rng: np.random.Generator,
    ) -> Decision:
        free = node_capacity(nodes)
        total = sum(free)
        ordered = _arrival_order(jobs)
        pinned = _keep_pinned(ordered, free)
        remaining = sum(free)
        counts = {job.id: sum(pinned.get(job.id, ())) for job in ordered}
        limit: dict[str, int] = {}
        for job in ordered:
            if job.id in pinned:
                limit[job.id] = counts[job.id]
                continue
            if job.rigid:  # exactly its size, or nothing
                need = _static_need(job, total)
                limit[job.id] = need
                if need <= remaining:
                    counts[job.id] = need
                    remaining -= need
                continue
            cap = min(job.max_replicas, total)
            if job.static_iter_time_s:
                cap = min(cap, len(job.static_iter_time_s))
            limit[job.id] = max(cap, 0)
            if remaining > 0 and limit[job.id] >= 1:
                counts[job.id] = 1
                remaining -= 1

        def gain(job: JobView) -> float:
            k = counts[job.id]
            if k == 0 or k + 1 > limit[job.id] or job.rigid:
                return 0.0
            work = job.remaining_iters if job.remaining_iters is not None else 1.0
            if job.static_iter_time_s:
                times = job.static_iter_time_s
                return max(0.0, (times[k - 1] - times[k]) * work)
            return work * (1.0 / k - 1.0 / (k + 1))  # no profile: assume linear speed-up

        gains = {job.id: gain(job) for job in ordered}
        by_id = {job.id: job for job in ordered}
        while remaining > 0 and ordered:
            best = max(ordered, key=lambda j: gains[j.id]).id
            if gains[best] <= 0.0:
                break
            counts[best] += 1
            remaining -= 1
            gains[best] = gain(by_id[best])

        placed: dict[str, Placement] = dict(pinned)
        reasons: dict[str, str] = {}
        for job in ordered:  # keep the devices of jobs whose count did not change
            if job.id in placed:
                continue
            if (
                counts[job.id]
                and sum(job.placement) == counts[job.id]
                and valid_placement(job.placement, free)
            ):
                placed[job.id] = job.placement
                _subtract(free, job.placement)
        for job in sorted(ordered, key=lambda j: (counts[j.id], j.submit_time, j.id)):
            if job.id in placed or counts[job.id] == 0:
                continue
            spot = pack(counts[job.id], job.usable(free))
            if spot is None:
                reasons[job.id] = "no room"
                continue
            placed[job.id] = spot
            _subtract(free, spot)
        return _finish(jobs, placed, len(free), reasons)
