"""Throughput measurements shared between the jobs of one *kind* (the same training script).

A job's throughput is a property of its model and the hardware, not of the run: a lab submits
the same script many times.  So a job's throughput model is fitted to every (N, K, m) point
any job of its kind has measured, its own points overriding the pool's where both have one::

    points_j = pool[kind_j]  updated with  own_j

and before a job has reported gradient statistics of its own, its goodput model uses the first
statistics a job of its kind reported in its first epoch (the noise scale at the start of
training).  The pool only informs the model; how far a job may grow (the policy's exploration
cap) still follows the counts the job itself has run.
"""

from __future__ import annotations

from collections.abc import Mapping

from pollux_local.core.types import GradStats

#: (nodes, replicas, local batch) of one measured configuration.
Point = tuple[int, int, int]
#: (compute seconds of one micro-batch, seconds of one synchronising step) measured there.
Times = tuple[float, float]


class ProfilePool:
    """Points and starting gradient statistics per job kind."""

    def __init__(self) -> None:
        self._points: dict[str, dict[Point, Times]] = {}
        self._start_stats: dict[str, GradStats] = {}

    def add(
        self,
        kind: str,
        points: Mapping[Point, Times],
        stats: GradStats | None = None,
        first_epoch: bool = False,
    ) -> None:
        """Record a job's measured points; ``stats`` become the kind's starting statistics
        when they were measured in the job's first epoch and the kind has none yet."""
        if points:
            self._points.setdefault(kind, {}).update(points)
        if stats is not None and first_epoch:
            self._start_stats.setdefault(kind, stats)

    def points_for(self, kind: str, own: Mapping[Point, Times]) -> dict[Point, Times]:
        """The kind's pooled points updated with the job's own (own measurements win)."""
        merged = dict(self._points.get(kind, {}))
        merged.update(own)
        return merged

    def start_stats(self, kind: str) -> GradStats | None:
        """Gradient statistics of the kind's first epoch, or ``None`` if none was reported."""
        return self._start_stats.get(kind)

    def kinds(self) -> list[str]:
        return sorted(set(self._points) | set(self._start_stats))
