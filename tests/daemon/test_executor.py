"""Executor fault handling with a stand-in launcher: dead nodes, exits during a stop, stops
that never hold up a pass, starts waiting for devices still being released, one job's error
never stopping the others."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from pollux_local.api.launch import LaunchEnvironment
from pollux_local.api.states import StopIntent
from pollux_local.core.types import BatchChoice
from pollux_local.daemon.config import DaemonConfig, NodeConfig
from pollux_local.daemon.executor import Executor
from pollux_local.daemon.scheduler import Action, ActionKind
from pollux_local.daemon.state import StateStore
from pollux_local.errors import PolluxError
from pollux_local.launch.base import LaunchSpec, NodeHealth

pytestmark = [pytest.mark.timeout(30)]


class FakeGroup:
    def __init__(self, spec: LaunchSpec, stubborn: bool = False) -> None:
        self.spec = spec
        self.exit = asyncio.get_running_loop().create_future()
        self.stubborn = stubborn  # a stop is not obeyed: the test ends the group itself
        self.stops = 0

    def poll(self) -> int | None:
        return self.exit.result() if self.exit.done() else None

    async def wait(self) -> int:
        return int(await asyncio.shield(self.exit))

    async def stop(self, grace_s: float) -> int:
        self.stops += 1
        if not self.exit.done() and not self.stubborn:
            self.exit.set_result(75)
        return await self.wait()

    def pids(self) -> Mapping[int, int]:
        return {}

    def lost_nodes(self) -> set[str]:
        return set()

    def unanswered_nodes(self) -> set[str]:
        return set()


class FakeLauncher:
    def __init__(self) -> None:
        self.reachable = True
        self.stubborn = False
        self.groups: list[FakeGroup] = []

    async def launch(self, spec: LaunchSpec) -> FakeGroup:
        self.groups.append(FakeGroup(spec, self.stubborn))
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


def submit(store: StateStore, **spec: Any) -> int:
    return store.add_job(
        name="j", owner_uid=0, owner_gid=0, owner_name="root",
        spec={"argv": ["x"], "workdir": "/", "min_gpus": 1, **spec}, priority=0,
        submit_time=0.0,
    ).id  # fmt: skip


async def start(executor: Executor, store: StateStore, job_id: int) -> None:
    job = store.get_job(job_id)
    assert job is not None
    action = Action(
        ActionKind.START, job_id, {"far": ["cpu:0", "cpu:1"]}, BatchChoice(8, 1, 2), "test"
    )
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
async def test_a_start_whose_replicas_could_not_be_set_up_is_taken_as_their_failed_setup(
    setup,  # type: ignore[no-untyped-def]
) -> None:
    """Review s62: this machine's supervisor failed every start whose replicas could not be
    set up for good, where on SSH nodes and under Slurm it is the replica's exit.  Now both
    alike: a cause no retry can help (a working directory it cannot enter) fails the job at
    once; another (a replica that took over 30 s on a slow file system) is a crash, with its
    back-off and retries (a rigid job without ``--retries``: none)."""
    executor, store, launcher = setup

    async def fails(spec: LaunchSpec) -> None:
        raise PolluxError(launcher.why)

    launcher.launch = fails  # type: ignore[method-assign]
    launcher.why = "rank 0: did not reach its command within 30 s"  # type: ignore[attr-defined]
    elastic = submit(store)  # (elastic by default)
    await start(executor, store, elastic)
    job = store.get_job(elastic)
    assert job is not None and job.state == "queued" and job.failures == 1
    assert job.retry_after == 101.0 and "could not start: rank 0: did not reach" in job.reason
    rigid = submit(store, elastic=False, min_gpus=2, max_gpus=2)
    await start(executor, store, rigid)
    job = store.get_job(rigid)
    assert job is not None and job.state == "failed" and "a rigid job runs once" in job.reason
    launcher.why = "rank 1: cannot enter working directory /x: Permission denied"  # type: ignore[attr-defined]
    other = submit(store)
    await start(executor, store, other)
    job = store.get_job(other)
    assert job is not None and job.state == "failed" and "not retried" in job.reason
    assert "its working directory cannot be entered" in job.reason


@pytest.mark.asyncio
async def test_finishing_while_being_resized_counts_as_success(setup) -> None:  # type: ignore[no-untyped-def]
    from pollux_local.core.types import Decision
    from pollux_local.daemon.scheduler import Plan

    executor, store, launcher = setup
    job_id = submit(store)
    await start(executor, store, job_id)
    launcher.groups[0].exit.set_result(0)  # exits 0 exactly as the resize begins
    resize = Action(ActionKind.RESIZE, job_id, {"far": ["cpu:0"]}, BatchChoice(8, 1, 1), "shrink")
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
        env={"A": "1", "POLLUX_LOCAL_BATCH": "999", "POLLUX_JOB_ID": "forged",
             "POLLUX_RESIZE_JOIN": "3", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=1M"},
    ).id  # fmt: skip
    job = store.get_job(job_id)
    assert job is not None
    spec = executor.build_spec(
        job, Action(ActionKind.START, job_id, {"far": ["cpu:0", "cpu:1"]}, None, "")
    )
    env = dict(spec.env)
    pollux = {k for k in env if k.startswith("POLLUX_")}
    assert pollux == {
        "POLLUX_JOB_ID", "POLLUX_RESTARTS", "POLLUX_JOB_DIR", "POLLUX_CHECKPOINT_DIR",
        "POLLUX_DAEMON_SOCKET", "POLLUX_NUM_NODES", "POLLUX_PG_TIMEOUT_S", "POLLUX_DEVICE",
        "POLLUX_DEVICE_TYPE", "POLLUX_JOB_SECRET",
    }  # fmt: skip
    assert env["POLLUX_DEVICE_TYPE"] == "cpu"  # the node's devices' type
    assert len(env["POLLUX_JOB_SECRET"]) == 32  # random per start (verify_members)
    assert env["A"] == "1" and env["POLLUX_JOB_ID"] == str(job_id)
    assert "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT" not in env  # a raw request's, not the daemon's
    assert env["WORLD_SIZE"] == "2" and env["MASTER_ADDR"] == "127.0.0.1"
    assert env["POLLUX_DEVICE"] == "cpu" and env["POLLUX_PG_TIMEOUT_S"] == "60"
    launch = LaunchEnvironment.from_environ({**env, "RANK": "1", "LOCAL_WORLD_SIZE": "2"})
    assert (launch.world_size, launch.num_nodes, launch.local_batch) == (2, 1, None)
    assert launch.daemon_socket == str(executor.socket_path)
    with_batch = executor.build_spec(
        job, Action(ActionKind.START, job_id, {"far": ["cpu:0"]}, BatchChoice(16, 2, 1), "")
    )
    assert with_batch.env["POLLUX_JOB_SECRET"] != env["POLLUX_JOB_SECRET"]
    assert with_batch.env["POLLUX_LOCAL_BATCH"] == "16"
    assert with_batch.env["POLLUX_ACCUM_STEPS"] == "2"


def plan(*actions: Action) -> Any:
    from pollux_local.core.types import Decision
    from pollux_local.daemon.scheduler import Plan

    return Plan(actions=tuple(actions), decision=Decision(placements={}))


def state(store: StateStore, job_id: int) -> str:
    job = store.get_job(job_id)
    assert job is not None
    return str(job.state)


@pytest.mark.asyncio
async def test_a_stop_never_holds_up_the_pass_and_its_devices_wait(setup) -> None:  # type: ignore[no-untyped-def]
    executor, store, launcher = setup
    launcher.stubborn = True  # ignores SIGTERM: it ends only when the test says so
    first, second, third = submit(store), submit(store), submit(store)
    await start(executor, store, first)  # on both devices
    # preempt it for the second job, which gets one of its devices
    await asyncio.wait_for(
        executor.apply(
            plan(
                Action(ActionKind.STOP, first, {}, None, "preempted"),
                Action(ActionKind.START, second, {"far": ["cpu:0"]}, None, "its turn"),
            )
        ),
        1.0,
    )
    assert launcher.groups[0].stops == 1 and len(launcher.groups) == 1
    assert state(store, first) == "queued" and state(store, second) == "queued"
    assert first in executor.stopping and second in executor._deferred
    assert executor.draining_devices() == {"far": {"cpu:0", "cpu:1"}}
    # a cancel of the stubborn job returns at once as well
    await asyncio.wait_for(executor.cancel(first), 1.0)
    assert state(store, first) == "cancelled"
    # the third job's start takes the free device of its node... there is none: it waits too
    await executor.apply(plan(Action(ActionKind.START, third, {"far": ["cpu:1"]}, None, "")))
    assert state(store, third) == "queued" and len(launcher.groups) == 1
    # the newest plan decides what waits: the second job's start was dropped by that plan
    assert second not in executor._deferred and third in executor._deferred
    launcher.groups[0].exit.set_result(-9)  # killed at the end of its grace
    await asyncio.sleep(0.05)
    assert state(store, first) == "cancelled"  # a stop's exit does not change its outcome
    assert state(store, third) == "running" and len(launcher.groups) == 2
    assert launcher.groups[1].spec.slots[0].device == "cpu:1"


@pytest.mark.asyncio
async def test_a_start_on_a_device_still_held_takes_a_free_one(setup) -> None:  # type: ignore[no-untyped-def]
    executor, store, launcher = setup
    launcher.stubborn = True
    first, second = submit(store), submit(store)
    job = store.get_job(first)
    assert job is not None
    await executor.start_job(job, Action(ActionKind.START, first, {"far": ["cpu:0"]}, None, ""))
    await executor.stop_job(first, "cancel")
    await executor.apply(plan(Action(ActionKind.START, second, {"far": ["cpu:0"]}, None, "")))
    assert state(store, second) == "running"
    assert launcher.groups[1].spec.slots[0].device == "cpu:1"  # cpu:0 is still being released
    assert store.get_job(second).placement == {"far": ["cpu:1"]}  # type: ignore[union-attr]
    launcher.groups[0].exit.set_result(-9)
    await asyncio.sleep(0.05)


@pytest.mark.asyncio
async def test_a_resize_restarts_once_the_old_incarnation_has_ended(setup) -> None:  # type: ignore[no-untyped-def]
    executor, store, launcher = setup
    launcher.stubborn = True
    job_id = submit(store)
    await start(executor, store, job_id)
    shrink = Action(ActionKind.RESIZE, job_id, {"far": ["cpu:0"]}, BatchChoice(8, 1, 1), "shrink")
    await asyncio.wait_for(executor.apply(plan(shrink)), 1.0)
    assert state(store, job_id) == "rescaling" and len(launcher.groups) == 1
    assert job_id in executor.watchers  # the loop must not take it for lost
    kinds = [d["kind"] for d in store.decisions(job_id)]
    assert "resize" not in kinds  # recorded when it restarts
    launcher.groups[0].exit.set_result(75)
    await asyncio.sleep(0.05)
    job = store.get_job(job_id)
    assert job is not None and job.state == "running" and job.placement == {"far": ["cpu:0"]}
    assert len(launcher.groups) == 2 and job.restarts == 2
    assert "resize" in [d["kind"] for d in store.decisions(job_id)]
    launcher.groups[1].exit.set_result(0)
    await asyncio.sleep(0.05)
    assert state(store, job_id) == "succeeded"


@pytest.mark.asyncio
async def test_one_jobs_error_fails_that_job_and_the_pass_goes_on(setup) -> None:  # type: ignore[no-untyped-def]
    executor, store, launcher = setup
    broken = store.add_job(
        name="broken",
        owner_uid=0,
        owner_gid=0,
        owner_name="root",
        spec={"argv": ["x"], "workdir": "/", "min_gpus": 1},
        priority=0,
        submit_time=0.0,
    ).id  # fmt: skip
    build = executor.build_spec

    def build_or_fail(job, action):  # type: ignore[no-untyped-def]
        if job.id == broken:
            raise KeyError("argv")  # a launch spec that cannot be built
        return build(job, action)

    executor.build_spec = build_or_fail
    gone_uid = 2**31 - 7
    orphan = store.add_job(
        name="orphan", owner_uid=gone_uid, owner_gid=gone_uid, owner_name="deleted",
        spec={"argv": ["x"], "workdir": "/", "min_gpus": 1}, priority=0, submit_time=0.0,
    ).id  # fmt: skip
    fine = submit(store)
    await executor.apply(
        plan(
            Action(ActionKind.START, broken, {"far": ["cpu:0"]}, None, ""),
            Action(ActionKind.START, orphan, {"far": ["cpu:1"]}, None, ""),
            Action(ActionKind.START, fine, {"far": ["cpu:1"]}, None, ""),
        )
    )
    job = store.get_job(broken)
    assert job is not None and job.state == "failed"
    assert job.reason.startswith("could not start: KeyError") and "\n" not in job.reason
    job = store.get_job(orphan)
    assert job is not None and job.state == "failed"
    assert job.reason == f"owner uid {gone_uid} no longer exists"
    assert state(store, fine) == "running" and len(launcher.groups) == 1


@pytest.mark.asyncio
async def test_an_exit_75_nobody_asked_for_is_a_crash_with_its_back_off(setup) -> None:  # type: ignore[no-untyped-def]
    executor, store, launcher = setup
    job_id = submit(store)
    await start(executor, store, job_id)
    launcher.groups[0].exit.set_result(75)  # the rescale code, but no resize was asked
    await asyncio.sleep(0.05)
    job = store.get_job(job_id)
    assert job is not None and job.state == "queued" and job.failures == 1
    assert job.retry_after == 101.0  # backoff_s * 2^0 after the clock's 100
    assert job.reason.startswith("exited 75 (the rescale code) but no rescale was asked")
    await start(executor, store, job_id)
    launcher.groups[1].exit.set_result(75)
    await asyncio.sleep(0.05)
    job = store.get_job(job_id)
    assert job is not None and job.state == "failed" and job.failures == 2
    assert job.reason == (
        "exited 75 (the rescale code) but no rescale was asked; counted as a crash;"
        " gave up after 1 restart(s)"
    )


@pytest.mark.asyncio
async def test_an_exit_75_asked_for_by_a_resize_restarts_at_the_new_size(setup) -> None:  # type: ignore[no-untyped-def]
    from pollux_local.api.states import StopIntent
    from pollux_local.core.types import Decision
    from pollux_local.daemon.scheduler import Plan

    executor, store, launcher = setup
    job_id = submit(store)
    await start(executor, store, job_id)
    resize = Action(ActionKind.RESIZE, job_id, {"far": ["cpu:0"]}, BatchChoice(8, 1, 1), "shrink")
    await executor.apply(Plan(actions=(resize,), decision=Decision(placements={})))
    assert executor.intent[job_id] is StopIntent.RESIZE
    await asyncio.sleep(0.05)  # the fake group obeys the stop with 75
    job = store.get_job(job_id)
    assert job is not None and job.state == "running" and job.failures == 0
    assert len(launcher.groups) == 2 and job.placement == {"far": ["cpu:0"]}


@pytest.mark.asyncio
async def test_a_stopping_group_holds_its_devices_until_it_is_gone(setup) -> None:  # type: ignore[no-untyped-def]
    executor, store, launcher = setup
    launcher.stubborn = True  # ignores SIGTERM
    job_id = submit(store)
    await start(executor, store, job_id)
    assert executor.still_stopping() == {}
    await executor.cancel(job_id)
    job = store.get_job(job_id)
    assert job is not None and job.state == "cancelled"
    assert executor.still_stopping() == {job_id: {"far": ["cpu:0", "cpu:1"]}}
    launcher.groups[0].exit.set_result(-9)
    await asyncio.sleep(0.05)
    assert executor.still_stopping() == {}


def test_the_order_file_of_a_warm_resize_is_the_daemons_never_the_jobs(tmp_path: Path) -> None:
    """The job's supervisor writes warm resize orders as root: their path comes from the
    daemon (``LaunchSpec.resize_file`` under ``STATE_DIR/resize``), and a ``POLLUX_RESIZE_FILE``
    in a submitted environment (a raw request can carry any) is dropped, on every node.  An
    elastic job on SSH nodes, one or several, takes orders at a file its node agents make;
    one on this machine's and an SSH node does not."""
    config = DaemonConfig(
        nodes=(
            NodeConfig("here", ("cpu:0", "cpu:1")),
            NodeConfig("far", ("cpu:0",), host="far.example"),
            NodeConfig("farther", ("cpu:0",), host="farther.example"),
        ),
    )
    store = StateStore(tmp_path / "s.db")
    executor = Executor(store, config, tmp_path, tmp_path / "daemon.sock", clock=lambda: 100.0)
    forged = {"POLLUX_RESIZE_FILE": "/etc/cron.d/owned"}
    cases = [
        (True, ("here",), True),
        (False, ("here",), False),
        (True, ("far",), True),
        (True, ("far", "farther"), True),
        (False, ("far", "farther"), False),
        (True, ("here", "far"), False),
    ]
    for elastic, nodes, takes_orders in cases:
        job_id = store.add_job(
            name="j", owner_uid=0, owner_gid=0, owner_name="root",
            spec={"argv": ["x"], "workdir": "/", "min_gpus": 1, "elastic": elastic},
            priority=0, submit_time=0.0, env=forged,
        ).id  # fmt: skip
        job = store.get_job(job_id)
        assert job is not None
        allocation = {node: ["cpu:0"] for node in nodes}
        spec = executor.build_spec(job, Action(ActionKind.START, job_id, allocation, None, ""))
        assert spec.takes_orders == takes_orders, (elastic, nodes)
        if elastic and nodes == ("here",):
            assert spec.resize_file == tmp_path / "resize" / f"{job_id}-0.json"
            assert spec.env["POLLUX_RESIZE_FILE"] == str(spec.resize_file)
        else:
            assert spec.resize_file is None and "POLLUX_RESIZE_FILE" not in spec.env


@pytest.mark.asyncio
async def test_a_held_job_that_exits_0_has_finished_and_never_runs_again(setup) -> None:  # type: ignore[no-untyped-def]
    executor, store, launcher = setup
    launcher.stubborn = True  # its script ignores SIGTERM and ends its work
    job_id = submit(store)
    await start(executor, store, job_id)
    await executor.hold(job_id)
    assert state(store, job_id) == "held"
    launcher.groups[0].exit.set_result(0)  # done within its grace
    await asyncio.sleep(0.05)
    job = store.get_job(job_id)
    assert job is not None and job.state == "succeeded" and job.end_time == 100.0
    # released, it would have run its finished work a second time
    await executor.apply(plan(Action(ActionKind.START, job_id, {"far": ["cpu:0"]}, None, "")))
    assert state(store, job_id) == "succeeded" and len(launcher.groups) == 1


@pytest.mark.asyncio
async def test_a_held_rigid_script_that_exits_0_on_sigterm_stays_held(setup) -> None:  # type: ignore[no-untyped-def]
    """A rigid script's exit 0 after SIGTERM may be its graceful stop (``trap 'exit 0'
    TERM``), not its end: it stays held, and its release runs it again."""
    executor, store, launcher = setup
    launcher.stubborn = True
    job_id = submit(store, elastic=False, max_gpus=1)
    job = store.get_job(job_id)
    assert job is not None
    await executor.start_job(job, Action(ActionKind.START, job_id, {"far": ["cpu:0"]}, None, ""))
    await executor.hold(job_id)
    launcher.groups[0].exit.set_result(0)
    await asyncio.sleep(0.05)
    assert state(store, job_id) == "held"


@pytest.mark.asyncio
async def test_replicas_the_store_did_not_record_that_end_their_work_have_finished(setup) -> None:  # type: ignore[no-untyped-def]
    """A start whose record was not written leaves the job queued beside its replicas; the
    pass stops them (a reconcile).  An elastic job's stop is a checkpoint (exit 75): its exit 0
    then is its end, and queued it would have run its finished work again (review s66).  A
    rigid script's 0 after SIGTERM may be its graceful stop: it stays queued."""
    executor, store, launcher = setup
    launcher.stubborn = True
    for elastic, after in ((True, "succeeded"), (False, "queued")):
        job_id = submit(store, elastic=elastic, max_gpus=1)
        job = store.get_job(job_id)
        assert job is not None
        action = Action(ActionKind.START, job_id, {"far": ["cpu:0"]}, None, "")
        await executor.start_job(job, action)
        assert store.requeue_if_placed(job_id, "its start was not recorded", 100.0)
        await executor.stop_job(job_id, StopIntent.RECONCILE)
        launcher.groups[-1].exit.set_result(0)
        await asyncio.sleep(0.05)
        assert state(store, job_id) == after, elastic


@pytest.mark.asyncio
async def test_a_job_cancelled_or_held_while_it_starts_is_stopped_at_once(setup) -> None:  # type: ignore[no-untyped-def]
    """A start made outside the daemon's lock (after a resize's checkpoint, or once its
    devices were released) can take a while; a cancel or hold recorded meanwhile found no
    group to stop, and the start then ran the job until the next pass (review s66)."""
    executor, store, launcher = setup
    for after, intent in (("cancelled", StopIntent.CANCEL), ("held", StopIntent.HOLD)):
        job_id = submit(store)
        job = store.get_job(job_id)
        assert job is not None
        gate = asyncio.Event()
        plain = FakeLauncher.launch

        async def slow(
            self: FakeLauncher, spec: LaunchSpec, gate: asyncio.Event = gate, plain: Any = plain
        ) -> FakeGroup:
            await gate.wait()
            return await plain(self, spec)  # type: ignore[no-any-return]

        launcher.launch = slow.__get__(launcher)  # type: ignore[method-assign]
        action = Action(ActionKind.START, job_id, {"far": ["cpu:0"]}, None, "")
        starting = asyncio.ensure_future(executor.start_job(job, action))
        await asyncio.sleep(0.01)
        store.transition(
            job_id, after, 100.0, None, end_time=100.0 if after == "cancelled" else None
        )
        await executor.stop_job(job_id, intent)  # what cancel and hold do: nothing runs yet
        gate.set()
        await starting
        await asyncio.sleep(0.05)
        assert launcher.groups[-1].stops == 1, after  # stopped at once
        assert state(store, job_id) == after
        assert job_id not in executor.groups
        del launcher.launch


@pytest.mark.asyncio
async def test_a_held_job_stopped_with_its_checkpoint_stays_held(setup) -> None:  # type: ignore[no-untyped-def]
    executor, store, launcher = setup
    job_id = submit(store)
    await start(executor, store, job_id)
    await executor.hold(job_id)
    await asyncio.sleep(0.05)  # the group obeys: checkpointed, exit 75
    assert state(store, job_id) == "held"


@pytest.mark.asyncio
async def test_a_cold_resize_keeps_the_run_file_of_the_incarnation_it_starts(
    tmp_path: Path,
) -> None:
    """A resize by checkpoint-restart starts the new incarnation from the old one's end
    (``Exits._on_stopped``); the old one's run file is then forgotten.  It used to be
    forgotten by the job's id after the new start, which removed the new incarnation's run
    file: a daemon restarted while it ran found no record of it, stopped it and ran it again
    instead of adopting it (review s66)."""
    import os

    config = DaemonConfig(nodes=(NodeConfig("vm", ("cpu:0", "cpu:1")),), stop_grace_s=10.0)
    store = StateStore(tmp_path / "s.db")
    executor = Executor(store, config, tmp_path, tmp_path / "daemon.sock")
    script = 'trap "exit 75" TERM; while :; do sleep 0.05; done'
    job_id = store.add_job(
        name="j", owner_uid=os.getuid(), owner_gid=os.getgid(), owner_name="root",
        spec={"argv": ["sh", "-c", script], "workdir": str(tmp_path), "min_gpus": 1,
              "max_gpus": 2, "elastic": True},
        priority=0, submit_time=0.0, env={"PATH": os.environ["PATH"]},
    ).id  # fmt: skip
    job = store.get_job(job_id)
    assert job is not None
    start = Action(ActionKind.START, job_id, {"vm": ["cpu:0", "cpu:1"]}, None, "test")
    await executor.start_job(job, start)
    try:
        assert state(store, job_id) == "running"
        shrink = Action(ActionKind.RESIZE, job_id, {"vm": ["cpu:0"]}, None, "shrink")
        await executor.apply(plan(shrink))
        for _ in range(200):
            job = store.get_job(job_id)
            if job is not None and job.state == "running" and job.restarts == 2:
                break
            await asyncio.sleep(0.05)
        assert job is not None and job.state == "running" and job.restarts == 2
        await asyncio.sleep(0.3)  # the old incarnation's end fully handled
        run_file = tmp_path / "run" / f"{job_id}.json"
        assert run_file.exists(), "the running incarnation's run file was removed"
        assert '"incarnation":1' in run_file.read_text()
    finally:
        for group in [*executor.groups.values(), *executor.stopping.values()]:
            await group.stop(0.5)
        await asyncio.sleep(0.2)


class FakeWarmGroup(FakeGroup):
    """A group that takes warm resize orders (``launch.base.WarmResizable``)."""

    warm_capable = True

    def resizes_onto(self, nodes: object) -> bool:
        return True

    async def resize_warm(self, spec: LaunchSpec, order: object, ready_timeout_s: float) -> None:
        return None


@pytest.mark.asyncio
async def test_an_incarnation_past_its_order_numbers_is_resized_by_a_restart(
    setup: tuple[Executor, StateStore, FakeLauncher],
) -> None:
    """Review s72: an incarnation numbers its warm orders below the next incarnation's
    (``warm.GENERATIONS`` of them); the next one's number wrapped below the last, the
    replicas ignored it and the resize fell back only after ``warm_timeout_s``.  Past the
    numbers, the resize is a checkpoint-restart (a new incarnation numbers from 1 again)."""
    from pollux_local.api.report import JobReport
    from pollux_local.daemon.executor.warm import GENERATIONS

    executor, store, launcher = setup
    executor.config = dataclasses.replace(executor.config, warm_resize=True)

    async def launch(spec: LaunchSpec) -> FakeGroup:
        launcher.groups.append(FakeWarmGroup(spec))
        return launcher.groups[-1]

    launcher.launch = launch  # type: ignore[method-assign]
    job_id = submit(store, elastic=True, max_gpus=2)
    await start(executor, store, job_id)
    store.update_job(job_id, report=JobReport(resizes_in_place=True))
    shrink = Action(ActionKind.RESIZE, job_id, {"far": ["cpu:0"]}, BatchChoice(8, 1, 1), "test")
    assert executor._warm_action(shrink, set()) is not None  # in place
    executor._warm_count[job_id] = GENERATIONS - 2  # the last number it may give
    assert executor._warm_action(shrink, set()) is not None
    executor._warm_count[job_id] = GENERATIONS - 1
    assert executor._warm_action(shrink, set()) is None  # a checkpoint-restart
