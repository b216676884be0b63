"""Executor fault handling with a stand-in launcher: dead nodes, exits during a stop."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from pathlib import Path

import pytest

from pollux_local.core.types import BatchChoice
from pollux_local.daemon.config import DaemonConfig, NodeConfig
from pollux_local.daemon.executor import Executor
from pollux_local.daemon.scheduler import Action
from pollux_local.daemon.state import StateStore
from pollux_local.launch.base import LaunchSpec, NodeHealth

pytestmark = [pytest.mark.timeout(30)]


class FakeGroup:
    def __init__(self, spec: LaunchSpec) -> None:
        self.spec = spec
        self.exit = asyncio.get_running_loop().create_future()

    def poll(self) -> int | None:
        return self.exit.result() if self.exit.done() else None

    async def wait(self) -> int:
        return int(await asyncio.shield(self.exit))

    async def stop(self, grace_s: float) -> int:
        if not self.exit.done():
            self.exit.set_result(75)
        return await self.wait()

    def pids(self) -> Mapping[int, int]:
        return {}


class FakeLauncher:
    def __init__(self) -> None:
        self.reachable = True
        self.groups: list[FakeGroup] = []

    async def launch(self, spec: LaunchSpec) -> FakeGroup:
        self.groups.append(FakeGroup(spec))
        return self.groups[-1]

    async def check_node(self, node: str) -> NodeHealth:
        return NodeHealth(node, self.reachable, error=None if self.reachable else "ssh: timeout")


@pytest.fixture
def setup(tmp_path: Path) -> tuple[Executor, StateStore, FakeLauncher]:
    config = DaemonConfig(
        nodes=(NodeConfig("far", ("cpu:0", "cpu:1"), host="far.example"),),
        node_retry_s=0.0, max_retries=1, backoff_s=1.0,
    )  # fmt: skip
    store = StateStore(tmp_path / "s.db")
    executor = Executor(store, config, tmp_path, tmp_path / "daemon.sock", clock=lambda: 100.0)
    launcher = FakeLauncher()
    executor._ssh = launcher  # type: ignore[assignment]
    return executor, store, launcher


def submit(store: StateStore) -> int:
    return store.add_job(
        name="j", owner_uid=0, owner_gid=0, owner_name="root",
        spec={"argv": ["x"], "workdir": "/", "min_gpus": 1}, priority=0, submit_time=0.0,
    ).id  # fmt: skip


async def start(executor: Executor, store: StateStore, job_id: int) -> None:
    job = store.get_job(job_id)
    assert job is not None
    action = Action("start", job_id, {"far": ["cpu:0", "cpu:1"]}, BatchChoice(8, 1, 2), "test")
    await executor.start_job(job, action)


@pytest.mark.asyncio
async def test_unreachable_node_is_marked_down_and_its_job_requeued(setup) -> None:  # type: ignore[no-untyped-def]
    executor, store, launcher = setup
    job_id = submit(store)
    await start(executor, store, job_id)
    job = store.get_job(job_id)
    assert job is not None and job.state == "running" and job.replicas == 2
    assert launcher.groups[0].spec.env["POLLUX_LOCAL_BATCH"] == "8"
    launcher.reachable = False
    launcher.groups[0].exit.set_result(255)  # ssh lost the node
    await asyncio.sleep(0.05)
    job = store.get_job(job_id)
    assert job is not None and job.state == "queued" and job.failures == 0
    assert "unreachable" in job.reason and job.placement == {}
    assert executor.node_up["far"] is False and executor.node_error["far"] == "ssh: timeout"
    launcher.reachable = True
    await executor.check_nodes()
    assert executor.node_up["far"] is True


@pytest.mark.asyncio
async def test_crash_then_give_up(setup) -> None:  # type: ignore[no-untyped-def]
    executor, store, launcher = setup
    job_id = submit(store)
    await start(executor, store, job_id)
    launcher.groups[0].exit.set_result(1)
    await asyncio.sleep(0.05)
    job = store.get_job(job_id)
    assert job is not None and job.state == "queued" and job.retry_after == 101.0
    await start(executor, store, job_id)
    launcher.groups[1].exit.set_result(1)
    await asyncio.sleep(0.05)
    job = store.get_job(job_id)
    assert job is not None and job.state == "failed" and "gave up after 1 restart" in job.reason


@pytest.mark.asyncio
async def test_finishing_while_being_resized_counts_as_success(setup) -> None:  # type: ignore[no-untyped-def]
    from pollux_local.core.types import Decision
    from pollux_local.daemon.scheduler import Plan

    executor, store, launcher = setup
    job_id = submit(store)
    await start(executor, store, job_id)
    launcher.groups[0].exit.set_result(0)  # exits 0 exactly as the resize begins
    resize = Action("resize", job_id, {"far": ["cpu:0"]}, BatchChoice(8, 1, 1), "shrink")
    await executor.apply(Plan(actions=(resize,), decision=Decision(placements={})))
    job = store.get_job(job_id)
    assert job is not None and job.state == "succeeded" and len(launcher.groups) == 1
