"""Executor fault handling with a stand-in launcher: dead nodes, exits during a stop."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from pathlib import Path

import pytest

from pollux_local.api.launch import LaunchEnvironment
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
    status = executor.nodes["far"]
    assert status.up is False and status.error == "ssh: timeout" and status.checked == 100.0
    assert not executor.nodes.is_up("far")
    launcher.reachable = True
    await executor.check_nodes()
    assert executor.nodes["far"].up is True and executor.nodes.is_up("far")


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
    await asyncio.sleep(0.05)  # the exit is handled when it arrives, after apply returned
    job = store.get_job(job_id)
    assert job is not None and job.state == "succeeded" and len(launcher.groups) == 1


@pytest.mark.asyncio
async def test_replica_environment_follows_the_launch_contract(setup) -> None:  # type: ignore[no-untyped-def]
    executor, store, launcher = setup
    job_id = store.add_job(
        name="j", owner_uid=0, owner_gid=0, owner_name="root",
        spec={"argv": ["x"], "workdir": "/", "min_gpus": 1}, priority=0, submit_time=0.0,
        env={"A": "1", "POLLUX_LOCAL_BATCH": "999", "POLLUX_JOB_ID": "forged"},
    ).id  # fmt: skip
    job = store.get_job(job_id)
    assert job is not None
    spec = executor.build_spec(job, Action("start", job_id, {"far": ["cpu:0", "cpu:1"]}, None, ""))
    env = dict(spec.env)
    pollux = {k for k in env if k.startswith("POLLUX_")}
    assert pollux == {
        "POLLUX_JOB_ID", "POLLUX_RESTARTS", "POLLUX_JOB_DIR", "POLLUX_CHECKPOINT_DIR",
        "POLLUX_DAEMON_SOCKET", "POLLUX_NUM_NODES", "POLLUX_PG_TIMEOUT_S", "POLLUX_DEVICE",
    }  # fmt: skip
    assert env["A"] == "1" and env["POLLUX_JOB_ID"] == str(job_id)
    assert env["WORLD_SIZE"] == "2" and env["MASTER_ADDR"] == "127.0.0.1"
    assert env["POLLUX_DEVICE"] == "cpu" and env["POLLUX_PG_TIMEOUT_S"] == "60"
    launch = LaunchEnvironment.from_environ({**env, "RANK": "1", "LOCAL_WORLD_SIZE": "2"})
    assert (launch.world_size, launch.num_nodes, launch.local_batch) == (2, 1, None)
    assert launch.daemon_socket == str(executor.socket_path)
    with_batch = executor.build_spec(
        job, Action("start", job_id, {"far": ["cpu:0"]}, BatchChoice(16, 2, 1), "")
    )
    assert with_batch.env["POLLUX_LOCAL_BATCH"] == "16"
    assert with_batch.env["POLLUX_ACCUM_STEPS"] == "2"
