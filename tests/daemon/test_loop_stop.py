"""The scheduling loop stops when the daemon stops (``daemon/loop.py``): a cancel that comes
in the same turn as a wake-up is not lost, and no pass starts after ``stop()``.

A lost cancel left the loop running into a pass that waited for the mutex the stopping daemon
held: the daemon never stopped (seen as 30 s teardowns in the test suite).  And after the
daemon has stopped, a task that does not end when cancelled no longer keeps its process
alive (``server.run_to_the_end``)."""

from __future__ import annotations

import asyncio
import logging
import time
from types import SimpleNamespace

import pytest

from pollux_local.daemon.loop import SchedulingLoop
from pollux_local.daemon.server import run_to_the_end


def bare_loop() -> tuple[SchedulingLoop, list[int]]:
    """A loop with only what ``run`` and ``stop`` touch; its passes are counted, not run."""
    loop = SchedulingLoop.__new__(SchedulingLoop)
    loop.config = SimpleNamespace(interval_s=30.0)  # type: ignore[assignment]
    loop.retry_s = 0.0
    loop._stopped = False
    loop._dir_removers = {}
    loop.prune_soon = False
    loop._wake = asyncio.Event()
    passes: list[int] = []

    async def schedule_once() -> None:
        passes.append(1)

    loop.schedule_once = schedule_once  # type: ignore[method-assign]
    loop.next_time_limit = lambda: None  # type: ignore[method-assign]
    return loop, passes


@pytest.mark.parametrize("turns", [0, 1, 2])
def test_a_cancel_in_the_same_turn_as_a_wake_up_stops_the_loop(turns: int) -> None:
    async def scenario() -> list[int]:
        loop, passes = bare_loop()
        task = asyncio.ensure_future(loop.run())
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        loop.wake()
        for _ in range(turns):
            await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, 5)
        return passes

    assert asyncio.run(scenario()) == []


def test_no_pass_starts_after_stop() -> None:
    async def scenario() -> list[int]:
        loop, passes = bare_loop()
        task = asyncio.ensure_future(loop.run())
        await asyncio.sleep(0)
        loop.wake()
        await asyncio.sleep(0.3)  # one pass after the wake-up
        loop.stop()
        loop.wake()
        await asyncio.wait_for(task, 5)  # returns by itself
        return passes

    assert asyncio.run(scenario()) == [1]


async def polite(ended: list[str]) -> None:
    """A task that sleeps until cancelled and notes, as it ends, that it did."""
    try:
        await asyncio.sleep(3600)
    finally:
        ended.append("polite")


def test_a_task_that_ignores_its_cancel_does_not_keep_a_stopped_daemon_alive(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """``run_to_the_end``: once ``main`` has returned, the tasks still running are cancelled
    and given a bounded time to end; one that swallows its cancel is logged with where it
    waits and left behind, where ``asyncio.run`` would wait for it for ever."""
    ended: list[str] = []

    async def stubborn() -> None:
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                continue  # the bug being guarded against

    async def main() -> None:
        asyncio.ensure_future(stubborn()).set_name("stubborn-task")
        asyncio.ensure_future(polite(ended))
        await asyncio.sleep(0)

    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="pollux_local.daemon"):
        run_to_the_end(main(), leftover_timeout_s=0.5)
    assert time.monotonic() - started < 5.0
    assert ended == ["polite"]
    [warning] = [r.getMessage() for r in caplog.records if "did not end" in r.getMessage()]
    assert "stubborn-task" in warning and "stubborn (" in warning and "test_loop_stop.py" in warning


def test_the_tasks_left_by_a_failed_start_are_ended_too() -> None:
    """``main`` raising (a daemon that could not start): its error comes out, and the tasks
    it left are cancelled and ended first, as ``asyncio.run`` ends them."""
    ended: list[str] = []

    async def main() -> None:
        asyncio.ensure_future(polite(ended))
        await asyncio.sleep(0)
        raise RuntimeError("cannot start")

    with pytest.raises(RuntimeError, match="cannot start"):
        run_to_the_end(main(), leftover_timeout_s=0.5)
    assert ended == ["polite"]
