"""Pacing of the requests, so that one user's loop cannot take the scheduling passes' turn
or the daemon's time from the others.

* ``estimate`` (a forecast of the whole queue, tens of milliseconds): per user, one in flight
  and at most ``per_minute`` started in any 60 seconds (:class:`UserPacer`);
* every request but a ping and a job's report (``dispatch.in_turns``; a page of 10,000 jobs
  takes a second, a 100-task array tens of milliseconds): per user, one at a time, and each
  user's requests at most a share of the daemon's time (:class:`LoopShare`), however many
  connections they open.  Waiting for the daemon's mutex (a pass under way) is not charged
  (:class:`Uncharged`); reading and writing every request's frames is
  (:meth:`LoopShare.charge`), and so is a ping or a report, which are also held to
  :data:`UNPACED_PER_S` per user (:meth:`LoopShare.admit_unpaced`).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from contextvars import ContextVar

from pollux_local.api.errors import LimitExceeded

#: Estimates one user may start in any 60 seconds (a person checking a few submits is far
#: below it; a loop is not).
ESTIMATES_PER_MINUTE = 30
#: The share of the daemon's time one user's requests may take over time (a person's
#: ``status`` of 10 ms holds their next for 30 ms; a loop of 10,000-job pages gets one in four
#: seconds of the daemon).
READ_SHARE = 0.25
#: The requests served outside the turns (a ping, a job's report) one user may send per
#: second over time, and how many at once above that rate (a job reports every few seconds;
#: a loop of 11,000 pings a second took a core).
UNPACED_PER_S = 50.0
UNPACED_BURST = 100


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


class _Meter:
    """The time a request's handler has run, the turns it gave the others left out."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.spent = 0.0
        self.since: float | None = clock()

    def pause(self) -> None:
        if self.since is not None:
            self.spent += self.clock() - self.since
            self.since = None

    def resume(self) -> None:
        self.since = self.clock()

    def total(self) -> float:
        return self.spent + (self.clock() - self.since if self.since is not None else 0.0)


#: The meter of the request in a user's turn under way in this task (``None``: none).
_METER: ContextVar[_Meter | None] = ContextVar("pollux_turn_meter", default=None)


@contextmanager
def _not_charged() -> Iterator[None]:
    """The time in the block is not charged to the request in a user's turn under way."""
    meter = _METER.get()
    if meter is not None:
        meter.pause()
    try:
        yield
    finally:
        if meter is not None:
            meter.resume()


async def give_way() -> None:
    """Let the event loop serve the others for a turn, in the middle of a long request; the
    time away is not charged to the request's user (:class:`LoopShare`)."""
    with _not_charged():
        await asyncio.sleep(0)


class Uncharged:
    """A lock (the daemon's mutex, held by every pass) whose waiting is not charged to the
    request in a user's turn that waits for it: a pass under way is not the user's work."""

    def __init__(self, lock: asyncio.Lock) -> None:
        self.lock = lock

    async def __aenter__(self) -> None:
        with _not_charged():
            await self.lock.acquire()

    async def __aexit__(self, *exc_info: object) -> None:
        self.lock.release()


class LoopShare:
    """Per user, requests (``dispatch.in_turns``) are served one at a time, and one that
    took ``t`` seconds (from its start to its reply, less the turns it gave the others,
    :func:`give_way`, and its waits for the daemon's mutex, :class:`Uncharged`) holds that
    user's next until ``t / share`` after it began: over time one user's requests take at
    most ``share`` of the daemon,
    whatever the number of their connections.  A held request waits asleep; the
    ``unlimited`` uids (root, the daemon's user) are never held."""

    def __init__(
        self,
        share: float,
        clock: Callable[[], float],
        unlimited: frozenset[int] = frozenset(),
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        if not 0.0 < share <= 1.0:
            raise ValueError(f"a share is in (0, 1], got {share}")
        self.share = share
        self.clock = clock
        self.unlimited = unlimited
        self.sleep = sleep
        #: per user with a request under way or waiting: its lock and how many hold or await it
        self._turns: dict[int, tuple[asyncio.Lock, list[int]]] = {}
        self._not_before: dict[int, float] = {}
        #: per user, when their next request outside the turns is due (``admit_unpaced``)
        self._due: dict[int, float] = {}

    @asynccontextmanager
    async def turn(self, uid: int) -> AsyncIterator[None]:
        """``uid``'s turn for one request (waited for asleep, behind their earlier ones)."""
        if uid in self.unlimited:
            yield
            return
        lock, count = self._turns.setdefault(uid, (asyncio.Lock(), [0]))
        count[0] += 1
        try:
            async with lock:
                wait = self._not_before.get(uid, 0.0) - self.clock()
                if wait > 0:
                    await self.sleep(wait)
                began = self.clock()
                meter = _Meter(self.clock)
                token = _METER.set(meter)
                try:
                    yield
                finally:
                    _METER.reset(token)
                    # what ``charge`` added meanwhile (frames read on other connections) stays
                    since = max(began, self._not_before.get(uid, began))
                    self._not_before[uid] = since + meter.total() / self.share
        finally:
            count[0] -= 1
            if count[0] == 0:  # an idle user holds nothing but a time still to come
                del self._turns[uid]
                if self._not_before.get(uid, 0.0) <= self.clock():
                    self._not_before.pop(uid, None)

    def charge(self, uid: int, seconds: float) -> None:
        """Charge ``uid`` for ``seconds`` of the daemon's time spent outside a turn (reading
        and writing a request's frames, a request served outside the turns): their next
        request in a turn waits ``seconds / share`` longer."""
        if uid in self.unlimited or seconds <= 0.0:
            return
        now = self.clock()
        self._not_before[uid] = max(self._not_before.get(uid, now), now) + seconds / self.share

    async def admit_unpaced(self, uid: int, *, wait: bool = True) -> bool:
        """Whether ``uid`` may send one more request served outside the turns: at most
        :data:`UNPACED_PER_S` a second over time, :data:`UNPACED_BURST` at once (the generic
        cell rate algorithm: ``_due`` is when the user's next one would be due at that
        rate).  Over it, with ``wait`` the request waits asleep until it may (and is
        admitted); without, it is not admitted (and not counted)."""
        if uid in self.unlimited:
            return True
        now = self.clock()
        step = 1.0 / UNPACED_PER_S
        due = max(self._due.get(uid, now), now)
        late = due - now - UNPACED_BURST * step
        if late > 0 and not wait:
            return False
        self._due[uid] = due + step
        if len(self._due) > 4096:  # the users who are not ahead of the rate hold nothing
            self._due = {u: t for u, t in self._due.items() if t > now}
        if late > 0:
            await self.sleep(late)
        return True

    def users(self) -> int:
        """How many users have a request under way or a next one held (what is kept)."""
        return len(self._turns.keys() | self._not_before.keys())
