"""Review s74: a start on an SSH node that a killed daemon never recorded.

The daemon was killed after a launch started replicas but before the store recorded the
start: the job stays queued with the same incarnation, and its next start wrote the same exit
record (same path, same token) while the earlier agent still ran.  That agent stops its
replicas only after ``orphan_grace_s`` (two incarnations ran at once, on the same devices),
and its last write ("ended") replaced the new incarnation's record: a later restart read the
running job as ended."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from pathlib import Path

import pytest

from pollux_local.launch.base import LaunchSpec, ReplicaSlot
from pollux_local.launch.ssh import SshLauncher
from tests.pids import alive, parent_of

from .conftest import ssh_nodes
from .testbed import Testbed

pytestmark = pytest.mark.timeout(150)

#: A replica that takes its time to stop (SIGTERM ignored, as a job checkpointing would).
STUBBORN = "trap '' TERM; echo started; exec sleep 120"


@pytest.mark.parametrize("agent_killed", [False, True], ids=["agent-ending", "agent-killed"])
def test_a_start_a_killed_daemon_never_recorded_is_ended_before_the_job_starts_again(
    testbed: Testbed, tmp_path: Path, agent_killed: bool
) -> None:
    """The earlier start's replica (it ignores SIGTERM) is gone before the next one starts,
    and the record names the next one, running; with its agent SIGKILLed too (nothing on the
    node would end the replica), the launch ends it and goes on without waiting longer."""
    host = testbed.hosts[0]
    control = testbed.dir / "ctl"
    spec = LaunchSpec(
        job_id="unrecorded",
        argv=["/bin/sh", "-c", STUBBORN],
        workdir=tmp_path,
        env={"PATH": "/usr/bin:/bin", "WORLD_SIZE": "1", "POLLUX_RESTARTS": "0"},
        slots=[ReplicaSlot(0, host.name, "cpu:0", 0, 0)],
        log_dir=tmp_path / "logs",
    )

    async def started(group: object) -> int:
        deadline = time.monotonic() + 30
        while not group.pids() and time.monotonic() < deadline:  # type: ignore[attr-defined]
            await asyncio.sleep(0.1)
        return group.pids()[0]  # type: ignore[attr-defined,no-any-return]

    async def run() -> tuple[bool, dict | None, int, int, float]:
        first = SshLauncher(ssh_nodes(testbed), control_dir=control, orphan_grace_s=6.0)
        group = await first.launch(spec)
        old = await started(group)
        await asyncio.sleep(1.0)  # its agent has written the record
        if agent_killed:
            os.kill(parent_of(old), signal.SIGKILL)
        for session in group._sessions:  # the daemon is SIGKILLed: the agents' stdin closes
            session.proc.kill()
        # the restarted daemon (same state directory) starts the still queued job again
        second = SshLauncher(ssh_nodes(testbed), control_dir=control, orphan_grace_s=6.0)
        began = time.monotonic()
        again = await second.launch(spec)
        took = time.monotonic() - began
        new = -1
        try:
            new = await started(again)
            both = alive(old) and alive(new)  # two incarnations at once
            await asyncio.sleep(9.0)  # past the earlier agent's grace and its last write
            record = await second.read_record(host.name, spec.job_id)
            return both, record, old, new, took
        finally:
            for pid in (old, new):
                with contextlib.suppress(OSError):
                    if pid > 1:
                        os.kill(pid, signal.SIGKILL)
            await again.wait()
            await second.forget_records(spec.job_id, [host.name], "unrecorded:0")
            await second.close()

    both, record, old, new, took = asyncio.run(run())
    assert not both, "the earlier start ran on beside the job's next one"
    assert record is not None
    assert record.get("state") == "running", record  # not the earlier agent's "ended"
    assert [r["pid"] for r in record["replicas"]] == [new], (record, old, new)
    assert took < 6.0 + 8.0, took  # SIGKILL after the grace, then no wait for a dead agent
