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


def test_time_spent_outside_a_turn_holds_the_users_next_request() -> None:
    """``charge``: reading a frame, or a ping, costs its user as a turn would."""
    share, now, slept = sleepy_share(0.25)
    share.charge(1000, 0.5)  # half a second decoding a 16 MiB frame

    async def main() -> None:
        async with share.turn(1001):  # another user's is not held
            pass
        async with share.turn(1000):
            pass

    asyncio.run(main())
    assert slept == [pytest.approx(2.0)]


def test_requests_outside_the_turns_are_admitted_at_their_users_rate() -> None:
    """``admit_unpaced``: a burst goes at once, then one per 1/rate; another user and root
    are not held."""
    from pollux_local.daemon.pacing import UNPACED_BURST, UNPACED_PER_S

    share, now, slept = sleepy_share(0.25)

    async def main() -> None:
        for _ in range(UNPACED_BURST + 10):
            await share.admit_unpaced(1000)
            await share.admit_unpaced(0)
        await share.admit_unpaced(1001)

    asyncio.run(main())
    assert len(slept) == 10
    assert sum(slept) == pytest.approx(10 / UNPACED_PER_S, rel=0.2)


def test_a_ping_is_admitted_at_its_users_rate_and_charged_to_them() -> None:
    """``dispatch.answer``: a ping (served outside the turns) waits for its user's rate and
    its time, decoding and encoding included, holds the user's next request in a turn."""
    from types import SimpleNamespace

    from pollux_local.api import wire
    from pollux_local.api.messages import Ping
    from pollux_local.daemon.auth import Peer
    from pollux_local.daemon.dispatch import answer

    share, now, slept = sleepy_share(0.25)
    admitted: list[int] = []
    admit = share.admit_unpaced

    async def counted(uid: int, *, wait: bool = True) -> bool:
        admitted.append(uid)
        return await admit(uid, wait=wait)

    share.admit_unpaced = counted  # type: ignore[method-assign]
    ctx = SimpleNamespace(
        read_share=share, peer=Peer(1, 1000, 1000), state_dir="/s", policy_name="fifo",
        config=SimpleNamespace(total_devices=2),
    )  # fmt: skip
    body = wire.encode_request(Ping())[wire.HEADER.size :]
    reply = asyncio.run(answer(ctx, body))  # type: ignore[arg-type]
    assert b'"ok":true' in reply
    assert admitted == [1000]
    assert share._not_before[1000] > now[0]


def test_a_charge_made_during_a_turn_is_kept_when_the_turn_ends() -> None:
    """A user whose one connection always has a turn under way could read frames on the
    others for free: the end of the turn overwrote what ``charge`` had added."""
    share, now, slept = sleepy_share(0.25)

    async def main() -> None:
        async with share.turn(1000):
            share.charge(1000, 1.0)  # a 16 MiB frame decoded on another connection
            now[0] += 0.05
        async with share.turn(1000):
            pass

    asyncio.run(main())
    # held 1 / 0.25 = 4 s for the frame, then 0.05 / 0.25 for the turn
    assert slept == [pytest.approx(4.2 - 0.05)]


def test_a_report_over_its_users_rate_is_not_taken_and_holds_nothing() -> None:
    """A report past the rate is answered at once, not taken (its job reports again), where
    it slept on one of its user's connections; a ping past it waits."""
    from types import SimpleNamespace

    from pollux_local.api import wire
    from pollux_local.api.messages import Ping, Report
    from pollux_local.api.report import JobReport
    from pollux_local.daemon.auth import Peer
    from pollux_local.daemon.dispatch import answer
    from pollux_local.daemon.pacing import UNPACED_BURST

    share, now, slept = sleepy_share(0.25)
    handled: list[str] = []

    def job(job_id: str) -> object:
        handled.append("looked up")
        raise LookupError

    ctx = SimpleNamespace(
        read_share=share, peer=Peer(1, 1000, 1000), state_dir="/s", policy_name="fifo",
        config=SimpleNamespace(total_devices=2), job=job,
    )  # fmt: skip

    async def main() -> list[bytes]:
        for _ in range(UNPACED_BURST + 1):  # the burst is used up
            await share.admit_unpaced(1000)
        report = wire.encode_request(Report(job_id="7", report=JobReport()))
        over = await answer(ctx, report[wire.HEADER.size :])  # type: ignore[arg-type]
        ping = await answer(ctx, wire.encode_request(Ping())[wire.HEADER.size :])  # type: ignore[arg-type]
        return [over, ping]

    over, ping = asyncio.run(main())
    assert b'"accepted":false' in over and handled == []  # not decoded further, not looked up
    assert b'"ok":true' in ping and slept  # the ping waited its turn at the rate
