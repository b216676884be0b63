"""A queued job keeps the rules a submit, an edit and a release keep (``jobrules.check_job``)
under the config in use: one a changed config refuses is held, not started with what it asked
when it was queued (``SchedulingLoop.hold_refused``)."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

from pollux_local.core.baselines import FifoPolicy
from tests.scheduler_harness import Harness


def test_a_stored_environment_past_a_lowered_command_size_is_held_not_started(
    tmp_path: Path,
) -> None:
    """The environment counts at a start as it does at a submit (a review: a lowered
    ``max_command_size`` held a release of the job but not its start)."""

    async def main() -> None:
        harness = Harness(tmp_path / "state", [1], FifoPolicy(), interval_s=1.0)
        big = harness.submit()
        harness.store.update_job(big, env={"PAD": "x" * 4096})
        small = harness.submit()
        harness.store.update_job(small, env={"PAD": "x"})
        harness.config = dataclasses.replace(harness.config, max_command_bytes=1024)
        harness.loop.config = harness.config
        await harness.tick(1.0)
        held = harness.job(big)
        assert held.state == "held", held.reason
        assert "max_command_size" in held.reason and "config changed" in held.reason
        assert harness.job(small).state == "running"

    asyncio.run(main())
