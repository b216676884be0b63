"""``daemon.pacing.UserPacer``: one call in flight per user, at most N a minute."""

from __future__ import annotations

import asyncio

import pytest

from pollux_local.api.errors import LimitExceeded
from pollux_local.daemon.pacing import LoopShare, Uncharged, UserPacer, give_way


def test_one_call_in_flight_per_user_and_a_budget_per_minute() -> None:
    now = [1000.0]
    pacer = UserPacer("estimate", 3, lambda: now[0], unlimited=frozenset({0}))
    with pacer.slot(1000):
        with pytest.raises(LimitExceeded, match="one at a time per user"), pacer.slot(1000):
            pass
        with pacer.slot(1001):  # another user is not held up
            pass
    for _ in range(2):
        with pacer.slot(1000):
            now[0] += 1.0
    full = r"at most 3 a minute per user; try again in 58 s"
    with pytest.raises(LimitExceeded, match=full), pacer.slot(1000):
        pass
    now[0] += 58.0  # the first call leaves the window
    with pacer.slot(1000):
        pass
    for _ in range(10):  # root is not paced
        with pacer.slot(0):
            pass


def test_a_users_reads_take_turns_and_a_share_of_the_daemon() -> None:
    """A read that took t holds its user's next until t / share after it began; the same
    user's reads on other connections wait their turn (asleep), another user's do not, root
    is never held, and an idle user leaves nothing behind but a time still to come."""
    now = [100.0]
    slept: list[float] = []

    async def sleep(seconds: float) -> None:
        slept.append(seconds)
        now[0] += seconds

    share = LoopShare(0.25, lambda: now[0], unlimited=frozenset({0}), sleep=sleep)
    began: dict[str, float] = {}

    async def read(uid: int, name: str, cost: float) -> None:
        async with share.turn(uid):
            began[name] = now[0]
            await asyncio.sleep(0)  # the others run meanwhile (a read yields in parts)
            now[0] += cost

    async def together(*reads: tuple[int, str, float]) -> None:
        await asyncio.gather(*(read(*r) for r in reads))

    asyncio.run(together((1000, "a1", 1.0), (1000, "a2", 0.5), (1001, "b", 0.1)))
    # a1 and b ran side by side (100 -> 101.1); a2 waited for a1, then slept until 104
    assert began == {"a1": 100.0, "b": 100.0, "a2": 104.0}
    assert slept == [pytest.approx(104.0 - 101.1)]
    assert share.users() == 2  # 1000 (until 106) and 1001 (until 104.4): no lock kept
    slept.clear()
    asyncio.run(together(*((0, f"r{i}", 5.0) for i in range(4))))
    assert slept == []  # root is never held
    asyncio.run(together((1000, "a3", 0.0)))
    assert slept == [] and share.users() == 1  # the others' times passed; a3's is kept
    # a held user's connections pile up asleep, in turn: each waits 4x the one before it
    slept.clear()
    asyncio.run(together(*((1001, f"b{i}", 1.0) for i in range(3))))
    assert slept == [pytest.approx(3.0), pytest.approx(3.0)]


def test_a_share_is_a_fraction() -> None:
    with pytest.raises(ValueError, match="share"):
        LoopShare(0.0, lambda: 0.0)


def sleepy_share(fraction: float) -> tuple[LoopShare, list[float], list[float]]:
    """A ``LoopShare`` on a clock that only its sleeps and the test move: (share, [now],
    the sleeps it took)."""
    now = [0.0]
    slept: list[float] = []

    async def sleep(seconds: float) -> None:
        slept.append(seconds)
        now[0] += seconds

    return LoopShare(fraction, lambda: now[0], sleep=sleep), now, slept


def test_the_turns_a_request_gives_the_others_are_not_charged_to_it() -> None:
    """A long request that gives way (``give_way``) between its parts is charged its own
    time: what others ran meanwhile does not hold its user's next request."""
    share, now, slept = sleepy_share(0.5)

    async def long_read() -> None:
        async with share.turn(1000):
            now[0] += 1.0  # its first part
            await give_way()
            now[0] += 1.0  # its second part

    async def others() -> None:  # started once the read gives way, it runs to its end
        now[0] += 5.0  # another user's work while the read gave way

    async def main() -> None:
        await asyncio.gather(long_read(), others())
        async with share.turn(1000):  # its next: held until 2 s / 0.5 after the first began
            pass

    asyncio.run(main())
    # charged 2 s, so held until 4 s: at 7 s its next goes at once (charged the 7 s it
    # lasted, it would have waited until 14 s)
    assert now[0] == 7.0 and slept == []


def test_the_time_a_request_took_is_charged_when_it_gives_no_way() -> None:
    share, now, slept = sleepy_share(0.5)

    async def main() -> None:
        async with share.turn(1000):
            now[0] += 2.0
        async with share.turn(1000):
            pass

    asyncio.run(main())
    assert slept == [pytest.approx(2.0)]  # held until 2 / 0.5 = 4 s after it began


def charged_after_a_pass(uncharged: bool) -> float:
    """When a user's next request may start after one that waited 5 s for a pass to let go
    of the daemon's mutex and then worked 1 s under it (share 0.5, it began at 0)."""
    share, now, slept = sleepy_share(0.5)
    mutex = asyncio.Lock()
    lock = Uncharged(mutex) if uncharged else mutex
    asked = asyncio.Event()

    async def a_pass() -> None:
        async with mutex:
            await asyncio.wait_for(asked.wait(), 1.0)
            await asyncio.sleep(0)  # the request waits for the mutex now
            now[0] += 5.0  # the pass's own work

    async def request() -> None:
        async with share.turn(1000):
            asked.set()
            async with lock:
                now[0] += 1.0  # the request's own work, under the mutex

    async def main() -> None:
        await asyncio.gather(a_pass(), request())
        async with share.turn(1000):
            pass

    asyncio.run(main())
    return now[0]


def test_a_wait_for_the_daemons_mutex_is_not_charged_to_the_request() -> None:
    """A ``cancel`` that waits for a pass under way (:class:`Uncharged`, as the handlers'
    ``Context.mutex`` is) is charged its own 1 s: held until 2 s, its next goes at once at
    6 s; waiting on the plain lock it is charged 6 s, held until 12 s."""
    assert charged_after_a_pass(uncharged=True) == pytest.approx(6.0)
    assert charged_after_a_pass(uncharged=False) == pytest.approx(12.0)
