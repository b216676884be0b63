"""A start that finds no free master port waits and is tried again: another user holding the
whole port range (12,000 bound sockets) made every other user's job fail for good."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from pollux_local.core.baselines import FifoPolicy
from pollux_local.daemon.executor import launchspec
from pollux_local.launch.base import NoFreePort
from tests.scheduler_harness import Harness


def test_a_start_without_a_free_port_waits_and_is_tried_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = launchspec.pick_master_port
    held = [True]

    def pick(*args: Any, **kwargs: Any) -> int:
        if held[0]:
            raise NoFreePort("no free master port in 20000-31999 on 127.0.0.1")
        return real(*args, **kwargs)

    monkeypatch.setattr(launchspec, "pick_master_port", pick)

    async def main() -> None:
        harness = Harness(tmp_path / "state", [1], FifoPolicy(), interval_s=1.0)
        job_id = harness.submit()
        await harness.tick(1.0)
        job = harness.job(job_id)
        assert job.state == "queued", job.reason
        assert "no free master port" in job.reason and "tried again" in job.reason
        held[0] = False  # the range given back
        await harness.tick(1.0)
        assert harness.job(job_id).state == "running"

    asyncio.run(main())
