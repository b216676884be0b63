"""What each job's resizes cost it: the downtime of every resize, measured by the daemon.

A resize's downtime runs from the moment the daemon asks the job to change (it ends its step
in progress, checkpoints and exits; or, for a warm resize, forms its new group in place) to
its first step at the new size, which the job library reports at once (its first report of
an incarnation follows its first step).  The end is the report's own time, held between the
new incarnation's launch and the report's arrival, so a job cannot claim a resize shorter
than what the daemon saw.  A resize that did not go straight to the new size (the job queued
again, waited for its devices, crashed and was retried) is not measured: its wait is not
the resize's cost.

The policy takes the median of a job's :data:`KEPT` newest resizes of each kind, cold
(checkpoint-restart) and warm (``JobInput.restart_cost_s`` / ``warm_resize_cost_s``).  The
measurements live in the daemon's memory (:func:`resizes_of` its store): after a restart of
the daemon a job's next resizes are measured again, and until then the configured
``restart_cost_s`` stands.
"""

from __future__ import annotations

import statistics
import weakref
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from pollux_local.api.report import JobReport

#: Newest resizes of each kind kept per job.
KEPT = 8
#: Jobs whose measurements are kept (the oldest forgotten beyond).
MAX_JOBS = 4096
#: A resize not finished within this long is dropped (the job is stuck or was stopped).
GIVE_UP_S = 6 * 3600.0


@dataclass(frozen=True)
class ResizeCosts:
    """The median downtime of a job's recent resizes, cold and warm (``None``: none yet)."""

    cold_s: float | None = None
    warm_s: float | None = None
    cold_count: int = 0
    warm_count: int = 0


@dataclass
class _Pending:
    asked_at: float
    warm: bool
    progress: float | None
    launched_at: float | None = None
    #: the replicas of the new size (a warm resize: the old ones report until they change)
    replicas: int | None = None


@dataclass
class _Measured:
    cold: deque[float] = field(default_factory=lambda: deque(maxlen=KEPT))
    warm: deque[float] = field(default_factory=lambda: deque(maxlen=KEPT))


class ResizeBook:
    """The resizes under way and the downtimes measured, per job."""

    def __init__(self) -> None:
        self._pending: dict[int, _Pending] = {}
        self._measured: dict[int, _Measured] = {}

    def begin(
        self, job_id: int, now: float, report: JobReport | None, *, warm: bool = False
    ) -> None:
        """The daemon asked ``job_id`` to resize at ``now``; ``report`` is its newest."""
        self._pending = {
            k: p for k, p in self._pending.items() if now - p.asked_at < GIVE_UP_S and k != job_id
        }
        progress = report.progress if report is not None else None
        self._pending[job_id] = _Pending(asked_at=now, warm=warm, progress=progress)

    def launched(
        self,
        job_id: int,
        now: float,
        resizing: bool,
        report: JobReport | None = None,
        replicas: int | None = None,
    ) -> None:
        """The job's new incarnation was launched (or, warm, its order given) at ``now``;
        ``resizing``: straight from its resize (else it was queued meanwhile, and the resize
        is not measured); ``report``: its newest (the old incarnation's last: a report that
        does not go beyond it is no step of the new one); ``replicas``: the new size (only a
        report at that size ends a warm resize)."""
        pending = self._pending.get(job_id)
        if pending is None:
            return
        if not resizing or pending.launched_at is not None:  # queued, or a retry after a crash
            del self._pending[job_id]
            return
        pending.launched_at = now
        pending.replicas = replicas
        if report is not None and report.progress is not None:
            pending.progress = max(report.progress, pending.progress or 0.0)

    def drop(self, job_id: int) -> None:
        """Measure no resize of ``job_id`` under way (it was stopped, held or failed)."""
        self._pending.pop(job_id, None)

    def reported(self, job_id: int, report: JobReport, now: float) -> float | None:
        """Take a report that arrived at ``now``: the first step of a resized job's new
        incarnation ends its resize (its downtime returned and kept)."""
        pending = self._pending.get(job_id)
        if pending is None or pending.launched_at is None or report.progress is None:
            return None
        if pending.progress is not None and report.progress <= pending.progress:
            return None  # no step trained since the resize
        if pending.replicas is not None and (
            report.batch is None or report.batch.replicas != pending.replicas
        ):
            return None  # a step of the old size, before the order was acted on
        del self._pending[job_id]
        stepped = report.time if report.time is not None else now
        downtime = min(max(stepped, pending.launched_at), now) - pending.asked_at
        if downtime < 0:
            return None
        measured = self._measured.pop(job_id, None) or _Measured()
        (measured.warm if pending.warm else measured.cold).append(downtime)
        self._measured[job_id] = measured  # the newest last
        if len(self._measured) > MAX_JOBS:
            del self._measured[next(iter(self._measured))]
        return downtime

    def costs(self, job_id: int) -> ResizeCosts:
        """The medians of ``job_id``'s kept resizes."""
        measured = self._measured.get(job_id)
        if measured is None:
            return ResizeCosts()
        return ResizeCosts(
            cold_s=statistics.median(measured.cold) if measured.cold else None,
            warm_s=statistics.median(measured.warm) if measured.warm else None,
            cold_count=len(measured.cold),
            warm_count=len(measured.warm),
        )

    def costs_of(self, job_ids: Iterable[int]) -> dict[int, ResizeCosts]:
        """:meth:`costs` of those of ``job_ids`` measured (a pass's jobs: not every job kept,
        ended ones included, on every pass)."""
        return {job_id: self.costs(job_id) for job_id in job_ids if job_id in self._measured}


_books: weakref.WeakKeyDictionary[object, ResizeBook] = weakref.WeakKeyDictionary()


def resizes_of(owner: object) -> ResizeBook:
    """The :class:`ResizeBook` of one daemon, keyed by an object it holds (its store)."""
    book = _books.get(owner)
    if book is None:
        book = _books[owner] = ResizeBook()
    return book
