"""Throughput measurements shared between the jobs of one *kind* (the same training script).

A job's throughput is a property of its model and the hardware, not of the run: a lab submits
the same script many times.  So a job's throughput model is fitted to every (N, K, m) point
any job of its kind has measured, its own points overriding the pool's where both have one::

    points_j = pool[kind_j]  updated with  own_j

and before a job has reported gradient statistics of its own, its goodput model uses the first
statistics a job of its kind reported in its first epoch (the noise scale at the start of
training).  The pool only informs the model; how far a job may grow (the policy's exploration
cap) still follows the counts the job itself has run.

A pool may be bounded (the daemon's are; the simulator's are not): at most ``max_points``
configurations per kind (a new configuration beyond it is not pooled, the job's own points
still count for its own model) and at most ``max_kinds`` kinds (the kind added to least
recently is dropped first).  Each kind carries a version, a number that changes whenever its
points do, so a caller refits a model only when its kind's points changed.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping

from pollux_local.core.types import GradStats

#: (nodes, replicas, local batch) of one measured configuration.
Point = tuple[int, int, int]
#: (compute seconds of one micro-batch, seconds of one synchronising step) measured there.
Times = tuple[float, float]


class ProfilePool:
    """Points and starting gradient statistics per job kind (bounded when ``max_points`` /
    ``max_kinds`` are given)."""

    def __init__(self, max_points: int | None = None, max_kinds: int | None = None) -> None:
        self.max_points = max_points
        self.max_kinds = max_kinds
        self._points: dict[str, dict[Point, Times]] = {}
        self._start_stats: dict[str, GradStats] = {}
        self._versions: dict[str, int] = {}
        self._next_version = itertools.count(1)

    def add(
        self,
        kind: str,
        points: Mapping[Point, Times],
        stats: GradStats | None = None,
        first_epoch: bool = False,
    ) -> bool:
        """Record a job's measured points (a later value of a configuration replaces the
        earlier one); ``stats`` become the kind's starting statistics when they were measured
        in the job's first epoch and the kind has none yet.  Whether the kind's points
        changed (then its :meth:`version` did too)."""
        changed = False
        if points:
            pooled = self._points.pop(kind, {})
            self._points[kind] = pooled  # the most recently added kind is the last dropped
            for point, times in points.items():
                if pooled.get(point) == times:
                    continue
                full = self.max_points is not None and len(pooled) >= self.max_points
                if full and point not in pooled:
                    continue
                pooled[point] = times
                changed = True
            if changed:
                self._versions[kind] = next(self._next_version)
        if stats is not None and first_epoch:
            self._start_stats.setdefault(kind, stats)
        self._drop_oldest()
        return changed

    def _drop_oldest(self) -> None:
        if self.max_kinds is None:
            return
        while len(self._points) > self.max_kinds:
            oldest = next(iter(self._points))
            del self._points[oldest]
            self._versions.pop(oldest, None)
            self._start_stats.pop(oldest, None)
        while len(self._start_stats) > self.max_kinds:
            del self._start_stats[next(iter(self._start_stats))]

    def version(self, kind: str) -> int:
        """A number that changes whenever the kind's pooled points change (0: none)."""
        return self._versions.get(kind, 0)

    def points_for(self, kind: str, own: Mapping[Point, Times]) -> dict[Point, Times]:
        """The kind's pooled points updated with the job's own (own measurements win)."""
        merged = dict(self._points.get(kind, {}))
        merged.update(own)
        return merged

    def covered_by(self, kind: str, own: Mapping[Point, Times]) -> bool:
        """Whether ``own`` measured every configuration the kind pooled (then
        :meth:`points_for` is ``own``)."""
        return self._points.get(kind, {}).keys() <= own.keys()

    def start_stats(self, kind: str) -> GradStats | None:
        """Gradient statistics of the kind's first epoch, or ``None`` if none was reported."""
        return self._start_stats.get(kind)

    def kinds(self) -> list[str]:
        return sorted(set(self._points) | set(self._start_stats))
