"""A job asked to stop holds its devices until its processes are gone: in its owner's caps
(``max_devices_per_user``, ``max_running_per_user``) and in the node views the policy gets,
with the pure scheduling pass and the loop's one account of them (``stopping_jobs``)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from pollux_local.api.states import JobState
from pollux_local.core.baselines import FifoPolicy
from pollux_local.core.schedule import Holding, Limits, NodeInput
from pollux_local.daemon.config import DaemonConfig, NodeConfig
from pollux_local.daemon.executor import Executor
from pollux_local.daemon.loop import node_snapshot, stopping_jobs
from pollux_local.daemon.readmodel import node_rows
from pollux_local.daemon.scheduler import ModelCache, plan_round
from pollux_local.daemon.state import StateStore
from tests.daemon.test_admission import record, started

RNG = np.random.default_rng(0)
TWO = [NodeInput("n", ("cpu:0", "cpu:1"), stopping={"cpu:0": 1})]
#: ann's job 1 was cancelled; its processes still hold n:cpu:0
ANNS = (Holding(job_id=1, owner="ann", devices={"n": ["cpu:0"]}),)


def test_a_stopping_job_counts_in_its_owners_device_cap_but_not_in_others() -> None:
    jobs = [record(2, owner="ann"), record(3, owner="bob")]
    limits = Limits(max_devices_per_user=1)
    plan = plan_round(FifoPolicy(), jobs, TWO, ModelCache(), 1.0, RNG, limits, stopping=ANNS)
    assert started(plan.actions) == [3]
    (action,) = plan.actions
    assert action.allocation == {"n": ["cpu:1"]}  # never the device still held
    assert plan.reasons[2] == (
        "waiting: ann's jobs hold 1 devices (job(s) 1 still stopping), this job needs 1 more,"
        " a user may hold 1 ([limits] max_devices_per_user)"
    )


def test_a_stopping_job_counts_as_running_for_max_running_per_user() -> None:
    limits = Limits(max_running_per_user=1)
    plan = plan_round(
        FifoPolicy(), [record(2, owner="ann")], TWO, ModelCache(), 1.0, RNG, limits, stopping=ANNS
    )
    assert started(plan.actions) == []
    assert "job(s) 1 still stopping" in plan.reasons[2]


def test_a_device_still_held_is_offered_to_nobody() -> None:
    plan = plan_round(
        FifoPolicy(),
        [record(2, owner="ann"), record(3, owner="bob")],
        TWO,
        ModelCache(),
        1.0,
        RNG,
        stopping=ANNS,
    )
    assert started(plan.actions) == [2]  # one device is free, FIFO gives it to job 2
    assert plan.actions[0].allocation == {"n": ["cpu:1"]}


class _Group:
    def __init__(self, node: str, devices: list[str]) -> None:
        from pollux_local.launch.base import ReplicaSlot

        self.spec = type("Spec", (), {})()
        self.spec.slots = [ReplicaSlot(i, node, d, i, 0) for i, d in enumerate(devices)]


def test_the_loop_counts_what_stopping_jobs_hold_in_nodes_and_node_views(tmp_path: Path) -> None:
    config = DaemonConfig(nodes=(NodeConfig("n", ("cpu:0", "cpu:1")),))
    store = StateStore(tmp_path / "s.db")
    executor = Executor(store, config, tmp_path, tmp_path / "daemon.sock")
    job = store.add_job(
        name="j", owner_uid=1000, owner_gid=1000, owner_name="ann",
        spec={"argv": ["x"], "workdir": "/", "min_gpus": 1}, priority=0, submit_time=0.0,
    )  # fmt: skip
    store.transition(job.id, JobState.CANCELLED, 1.0, None)
    executor.stopping[job.id] = _Group("n", ["cpu:0"])  # type: ignore[assignment]
    stopping = stopping_jobs(store, executor)
    assert stopping == [Holding(job_id=job.id, owner="ann", devices={"n": ["cpu:0"]})]
    (snap,) = node_snapshot(config, executor, (), [], stopping)
    assert snap.free_devices == ("cpu:1",)
    (row,) = node_rows(config, executor.nodes, [snap], [], [], stopping)
    assert row.jobs == {"cpu:0": str(job.id)} and row.stopping == ["cpu:0"]
    del executor.stopping[job.id]  # its processes are gone
    assert stopping_jobs(store, executor) == []
