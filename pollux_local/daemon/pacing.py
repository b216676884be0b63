"""Pacing of the requests that cost the daemon real work per call (``estimate``: a forecast of
the whole queue, tens of milliseconds): per user, one in flight and at most ``per_minute``
started in any 60 seconds, so that one user's loop cannot take the scheduling passes' turn
or the daemon's time from the others."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from pollux_local.api.errors import LimitExceeded

#: Estimates one user may start in any 60 seconds (a person checking a few submits is far
#: below it; a loop is not).
ESTIMATES_PER_MINUTE = 30


class UserPacer:
    """Per user: at most one call in flight and ``per_minute`` started in any 60 s window
    (the ``unlimited`` uids, root and the daemon's user, are not paced)."""

    def __init__(
        self,
        what: str,
        per_minute: int,
        clock: Callable[[], float],
        unlimited: frozenset[int] = frozenset(),
    ) -> None:
        self.what = what
        self.unlimited = unlimited
        self.per_minute = per_minute
        self.clock = clock
        self._in_flight: set[int] = set()
        self._started: dict[int, deque[float]] = {}

    @contextmanager
    def slot(self, uid: int) -> Iterator[None]:
        """Hold ``uid``'s one slot for the call (:class:`LimitExceeded`, in one line, when it
        already has a call in flight or started ``per_minute`` in the last minute)."""
        if uid in self.unlimited:
            yield
            return
        if uid in self._in_flight:
            raise LimitExceeded(
                f"{self.what}: one at a time per user; your previous one is still running"
            )
        now = self.clock()
        started = self._started.setdefault(uid, deque())
        while started and started[0] <= now - 60.0:
            started.popleft()
        if len(started) >= self.per_minute:
            wait = started[0] + 60.0 - now
            raise LimitExceeded(
                f"{self.what}: at most {self.per_minute} a minute per user; try again in"
                f" {max(wait, 1.0):.0f} s"
            )
        started.append(now)
        self._in_flight.add(uid)
        try:
            yield
        finally:
            self._in_flight.discard(uid)
            if not started:
                self._started.pop(uid, None)
