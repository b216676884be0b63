"""Woken passes take at most a share of the daemon (``loop.PASS_SHARE``): a user's loop of
cheap changes, each waking a pass over a queue of thousands, kept the daemon busy (a review
measured 83% of a core at ``interval_s = 60``)."""

from __future__ import annotations

import asyncio
import time

from pollux_local.daemon import loop as loop_module
from tests.daemon.test_loop_stop import bare_loop

PASS_S = 0.1


def test_passes_woken_without_pause_take_at_most_their_share() -> None:
    async def scenario() -> tuple[int, float]:
        loop, passes = bare_loop()
        busy = 0.0

        async def costly_pass() -> None:
            # a pass's work, on the event loop: PASS_S of processor time, counted as the loop
            # counts it (on a loaded machine a busy wait by the wall clock gets less, and the
            # loop rests by what it got)
            nonlocal busy
            began = time.process_time()
            while time.process_time() - began < PASS_S:
                pass
            busy += time.process_time() - began
            passes.append(1)

        loop.schedule_once = costly_pass  # type: ignore[method-assign]
        task = asyncio.ensure_future(loop.run())
        began = time.monotonic()
        while time.monotonic() - began < 2.0:  # woken every 10 ms, as by a request loop
            loop.wake()
            await asyncio.sleep(0.01)
        loop.stop()
        loop.wake()
        await asyncio.wait_for(task, 5)
        return len(passes), busy / (time.monotonic() - began)

    count, share = asyncio.run(scenario())
    # without the rest after each pass: about 16 passes, 80% of the time
    assert count >= 2
    assert share <= loop_module.PASS_SHARE + 0.1, (count, share)


def test_a_pass_that_mostly_waits_is_not_made_to_rest() -> None:
    """What a pass waits for (launches answering, the mutex) is no work of the daemon's: the
    rest follows the processor time it used, never more than ``interval_s``."""

    async def scenario() -> int:
        loop, passes = bare_loop()

        async def waiting_pass() -> None:
            await asyncio.sleep(0.2)  # a launch answering
            passes.append(1)

        loop.schedule_once = waiting_pass  # type: ignore[method-assign]
        task = asyncio.ensure_future(loop.run())
        began = time.monotonic()
        while time.monotonic() - began < 2.0:
            loop.wake()
            await asyncio.sleep(0.01)
        loop.stop()
        loop.wake()
        await asyncio.wait_for(task, 5)
        return len(passes)

    assert asyncio.run(scenario()) >= 7  # about 2 s / 0.2 s; with a 2x rest, about 3
