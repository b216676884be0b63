"""Rigid jobs (plain scripts): exactly their size or wait, never resized or moved, stopped only
when preemptible, no batch choice in their environment; and a waiting job's reason names the
job holding its devices.

Scheduler-level tests run the daemon's loop, executor and store on a fake clock with a launcher
that starts nothing (``tests/scheduler_harness.py``); the end-to-end test runs a real daemon on
``--devices cpu:3`` with a script that counts its own starts.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from dataclasses import replace
from pathlib import Path

import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pollux_local.api.errors import InvalidRequest
from pollux_local.api.messages import Submit
from pollux_local.core.baselines import FifoPolicy, OptimusPolicy, TiresiasPolicy
from pollux_local.core.policy import GoodputPolicy
from pollux_local.core.schedule import Action, ActionKind
from pollux_local.core.types import BatchChoice, JobView, NodeView, Policy
from pollux_local.daemon.auth import Peer
from pollux_local.daemon.config import DaemonConfig, NodeConfig
from pollux_local.daemon.context import Context
from pollux_local.daemon.handlers.submit import check_submit, submit
from tests.daemon_process import DaemonFactory, DaemonProcess, quick_config, wait_for
from tests.scheduler_harness import Harness

FOUR_DEVICES = DaemonConfig(nodes=(NodeConfig("n", tuple(f"cpu:{i}" for i in range(4))),))

pytestmark = [pytest.mark.timeout(120)]

BATCH_ENV = {"POLLUX_LOCAL_BATCH", "POLLUX_ACCUM_STEPS"}


def make_policy(name: str) -> Policy:
    if name == "goodput":
        return GoodputPolicy(restart_cost_s=30.0, interval_s=60.0)
    return {"fifo": FifoPolicy, "tiresias": TiresiasPolicy, "optimus": OptimusPolicy}[name]()


# --- the policies -----------------------------------------------------------------------


class Linear:
    """Goodput = K (a job with a profile, for the goodput policy)."""

    def best_goodput(
        self, nodes: np.ndarray, replicas: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        k = np.asarray(replicas, dtype=float)
        return k, np.full(k.shape, 32, dtype=np.int64), np.ones(k.shape, dtype=np.int64)


@st.composite
def clusters(draw: st.DrawFn) -> tuple[list[JobView], list[NodeView]]:
    nodes = [NodeView(f"n{i}", draw(st.integers(1, 6))) for i in range(draw(st.integers(1, 3)))]
    jobs = []
    for i in range(draw(st.integers(1, 10))):
        kind = draw(st.sampled_from(["elastic", "rigid", "preemptible"]))
        low = draw(st.integers(1, 4))
        high = low if kind != "elastic" else draw(st.integers(low, 8))
        jobs.append(
            JobView(
                id=str(i + 1),
                owner=f"u{draw(st.integers(0, 2))}",
                model=Linear() if draw(st.booleans()) else None,
                submit_time=float(i),
                min_replicas=low,
                max_replicas=high,
                static_replicas=high,
                max_profiled_replicas=draw(st.integers(0, 4)),
                attained_gpu_s=draw(st.floats(0.0, 1e4)),
                priority=draw(st.integers(0, 1)),
                rigid=kind != "elastic",
                preemptible=kind == "preemptible",
            )
        )
    return jobs, nodes


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(clusters(), st.sampled_from(["goodput", "fifo", "tiresias", "optimus"]))
def test_policies_run_rigid_jobs_on_their_size_and_leave_them_where_they_are(
    scenario: tuple[list[JobView], list[NodeView]], policy_name: str
) -> None:
    """Round after round (service accruing, a job leaving now and then): a rigid job runs on
    exactly its size or not at all; running, it keeps its placement, or (preemptible only)
    is stopped."""
    jobs, nodes = scenario
    policy = make_policy(policy_name)
    capacity = np.array([n.devices for n in nodes])
    for round_ in range(6):
        decision = policy.decide(jobs, nodes, 60.0 * round_, np.random.default_rng(round_))
        used = np.zeros(len(nodes), dtype=int)
        for job in jobs:
            new = tuple(decision.placements[job.id])
            used += np.array(new if sum(new) else (0,) * len(nodes))
            if not job.rigid:
                continue
            assert sum(new) in (0, job.min_replicas), (job, new)
            if job.replicas:
                assert new == job.placement or (job.preemptible and sum(new) == 0), (job, new)
        assert (used <= capacity).all()
        jobs = [
            replace(
                j,
                placement=tuple(decision.placements[j.id]),
                age_s=j.age_s + 60.0,
                attained_gpu_s=j.attained_gpu_s + 60.0 * sum(decision.placements[j.id]),
            )
            for j in jobs
            if round_ % 2 == 0 or j.id != jobs[0].id  # the oldest leaves every other round
        ]


# --- the daemon's pass ---------------------------------------------------------------------


def allocation(harness: Harness, job_id: int) -> dict[str, list[str]]:
    return {node: sorted(devs) for node, devs in harness.job(job_id).placement.items() if devs}


@pytest.mark.asyncio
@pytest.mark.parametrize("policy_name", ["goodput", "fifo", "tiresias", "optimus"])
async def test_a_rigid_job_gets_exactly_its_size_and_is_never_resized(
    tmp_path: Path, policy_name: str
) -> None:
    """``--gpus 2`` on four devices while elastic jobs of every size arrive and leave: it
    starts once, on exactly two devices, and keeps them until it ends."""
    h = Harness(tmp_path, [4], make_policy(policy_name))
    running_elastic = [h.submit(elastic=True, max_gpus=4, batch_size=64)]
    await h.tick()
    rigid = h.submit(elastic=False, min_gpus=2, max_gpus=2, batch_size=64)
    held: dict[str, list[str]] | None = None
    for round_ in range(40):
        if round_ % 3 == 0:
            size = (1, 2, 4)[round_ % 9 // 3]
            running_elastic.append(h.submit(elastic=True, max_gpus=size, batch_size=64))
        if round_ % 4 == 3:  # the longest-running elastic job ends
            live = [j for j in running_elastic if h.job(j).state == "running"]
            if live:
                await h.finish(live[0])
        if round_ == 32 and h.job(rigid).state == "running":
            await h.finish(rigid)
        await h.tick(60.0)
        job = h.job(rigid)
        if job.state == "running":
            assert job.replicas == 2, (round_, job.placement)
            held = held or allocation(h, rigid)
            assert allocation(h, rigid) == held, round_
        else:
            assert job.replicas == 0
    assert held is not None, "the rigid job never started"
    launches = h.launcher.launches[str(rigid)]
    assert len(launches) == 1 and len(launches[0].spec.slots) == 2
    assert not BATCH_ENV & set(launches[0].spec.env)
    kinds = [d["kind"] for d in h.decisions(rigid)]
    assert kinds == ["submitted", "start", "finished"], kinds
    # the elastic jobs did get resized around it (the goodput policy), so the test is not idle
    if policy_name == "goodput":
        resized = [
            d for j in running_elastic for d in h.decisions(j) if d["kind"] in ("resize", "stop")
        ]
        assert resized


@pytest.mark.asyncio
async def test_a_rigid_job_waits_for_exactly_its_size(tmp_path: Path) -> None:
    """Three devices, a rigid job of two holding two: another rigid job of two is never
    started on the one left, and its reason names the job that holds its devices."""
    h = Harness(tmp_path, [3], make_policy("goodput"))
    first = h.submit(owner="alice", elastic=False, min_gpus=2, max_gpus=2)
    await h.tick()
    h.store.update_job(first, report={"version": 1, "epoch": 1, "epochs": 4})
    second = h.submit(owner="bob", elastic=False, min_gpus=2, max_gpus=2)
    for _ in range(5):
        await h.tick(60.0)
        assert h.job(second).state == "queued" and h.job(second).replicas == 0
    reason = h.job(second).reason
    assert reason.startswith("waiting: needs 2 devices, 1 free"), reason
    # alice's job ran 300 s for a quarter of its declared length: 900 s to go
    holder = f"job {first} (alice) holds 2 (rigid, not preemptible; expected to finish in 15m)"
    assert holder in reason, reason
    await h.finish(first)
    await h.tick(60.0)
    assert h.job(second).state == "running" and h.job(second).replicas == 2


@pytest.mark.asyncio
@pytest.mark.parametrize("preemptible", [True, False])
async def test_only_a_preemptible_rigid_job_is_stopped_and_never_resized(
    tmp_path: Path, preemptible: bool
) -> None:
    """A rigid job that has run a while, and a new job with no service whose three devices do
    not fit beside its two: the preemptible one goes back to the queue (and comes back on
    two), the other keeps its devices and the new job waits, naming it."""
    h = Harness(tmp_path, [4], make_policy("goodput"))
    old = h.submit(elastic=False, min_gpus=2, max_gpus=2, preemptible=preemptible)
    for _ in range(5):
        await h.tick(60.0)
    new = h.submit(elastic=False, min_gpus=3, max_gpus=3)
    await h.tick(60.0)
    if preemptible:
        assert h.job(old).state == "queued" and h.job(new).replicas == 3
        # stopped for the job with less service (300 s on two devices: 0.17 device-hours)
        assert h.job(old).reason == (
            f"preempted, waiting: needs 2 devices, 1 free; job {new} (ann) holds 3"
            " (fair share: it has used 0.00 device-hours, this job 0.2)"
        ), h.job(old).reason
        await h.tick(60.0)  # which now runs, and keeps its devices
        assert f"job {new} (ann) holds 3 (rigid, not preemptible)" in h.job(old).reason
        await h.finish(new)
        await h.tick(60.0)
        assert h.job(old).replicas == 2
        kinds = [d["kind"] for d in h.decisions(old) if d["kind"] != "submitted"]
        assert kinds == ["start", "stop", "start"], kinds
        assert [len(g.spec.slots) for g in h.launcher.launches[str(old)]] == [2, 2]
    else:
        assert h.job(old).replicas == 2 and h.job(new).state == "queued"
        assert f"job {old} (ann) holds 2 (rigid, not preemptible)" in h.job(new).reason
        assert [d["kind"] for d in h.decisions(old)] == ["submitted", "start"]


@pytest.mark.asyncio
async def test_the_launch_environment_of_a_rigid_job_has_no_batch_choice(tmp_path: Path) -> None:
    h = Harness(tmp_path, [2], make_policy("goodput"))
    rigid = h.job(h.submit(elastic=False, min_gpus=2, max_gpus=2, batch_size=64))
    elastic = h.job(h.submit(elastic=True, min_gpus=2, max_gpus=2, batch_size=64))
    action = Action(
        ActionKind.START, 0, {"node0": ["cpu:0", "cpu:1"]}, BatchChoice(32, 1, 2), "test"
    )
    rigid_env = h.executor.build_spec(rigid, action).env
    elastic_env = h.executor.build_spec(elastic, action).env
    assert elastic_env["POLLUX_LOCAL_BATCH"] == "32" and elastic_env["POLLUX_ACCUM_STEPS"] == "1"
    # and, elastic on this machine's node, where its warm resize orders come
    assert set(elastic_env) - set(rigid_env) == BATCH_ENV | {"POLLUX_RESIZE_FILE"}
    assert set(rigid_env) <= set(elastic_env)


@pytest.mark.asyncio
async def test_submit_stores_elastic_and_preemptible(tmp_path: Path) -> None:
    h = Harness(tmp_path, [4], make_policy("goodput"))
    ctx = Context(
        peer=Peer(pid=1, uid=os.getuid(), gid=os.getgid()),
        store=h.store,
        executor=h.executor,
        config=h.config,
        state_dir=tmp_path,
        clock=h.clock,
        models=h.loop.models,
        metrics=h.loop.metrics,
        mutex=asyncio.Lock(),
        wake=lambda: None,
        daemon_uid=os.getuid(),
        policy_name="goodput",
    )

    def request(**fields: object) -> Submit:
        raw = {"v": 1, "type": "submit", "argv": ["train.py"], "workdir": "/", **fields}
        return msgspec.convert(raw, Submit)

    plain = h.job(int(submit(ctx, request(min_gpus=2)).id))  # a raw request: rigid
    assert (plain.spec.elastic, plain.spec.preemptible) == (False, False)
    resizable = h.job(int(submit(ctx, request(elastic=True, max_gpus=4)).id))
    assert resizable.spec.elastic is True
    stoppable = h.job(int(submit(ctx, request(preemptible=True)).id))
    assert (stoppable.spec.elastic, stoppable.spec.preemptible) == (False, True)
    held = h.job(int(submit(ctx, request(hold=True)).id))
    assert held.reason == "waiting: held"
    with pytest.raises(InvalidRequest, match="rigid job runs on exactly min_gpus"):
        check_submit(request(min_gpus=1, max_gpus=3), FOUR_DEVICES)
    check_submit(request(min_gpus=2, max_gpus=2), FOUR_DEVICES)
    check_submit(request(elastic=True, min_gpus=1, max_gpus=3), FOUR_DEVICES)


# --- end to end ------------------------------------------------------------------------------

COUNTING = """\
import os, signal, sys, time
from pathlib import Path

signal.signal(signal.SIGTERM, lambda *_: sys.exit(75))
rank = os.environ.get("RANK", "0")
line = "world {} batch {}\\n".format(
    os.environ.get("WORLD_SIZE"), os.environ.get("POLLUX_LOCAL_BATCH"))
with open(Path(sys.argv[1]) / ("starts-" + rank + ".txt"), "a") as out:
    out.write(line)
time.sleep(float(sys.argv[2]))
"""

NEIGHBOUR = """\
import signal, sys, time

signal.signal(signal.SIGTERM, lambda *_: sys.exit(75))
time.sleep(float(sys.argv[1]))
"""


@pytest.fixture
def daemon(daemon_factory: DaemonFactory) -> DaemonProcess:
    return daemon_factory(devices="cpu:3", config=quick_config(restart_cost_s=1), interval=1)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_rigid_job_runs_once_on_its_size_while_elastic_jobs_come_and_go(
    daemon: DaemonProcess, tmp_path: Path
) -> None:
    work = tmp_path / "work"
    work.mkdir()
    (work / "count.py").write_text(COUNTING)
    (work / "neighbour.py").write_text(NEIGHBOUR)
    client = daemon.client

    def submit(*argv: str, **fields: object) -> str:
        reply = client.request("submit", argv=[sys.executable, *argv], workdir=str(work), **fields)
        return str(reply["id"])

    def show(job_id: str) -> dict[str, object]:
        return dict(client.request("show", id=job_id))

    def state(job_id: str) -> str:
        return str(client.request("show", id=job_id)["job"]["state"])

    rigid = submit("count.py", str(work), "12", min_gpus=2, max_gpus=2)  # no `elastic`: rigid
    wait_for(lambda: state(rigid) == "running", 30, "the rigid job to start")
    # elastic jobs arrive and leave beside it, one after the other
    neighbours = []
    for seconds in ("2", "3", "2"):
        neighbours.append(submit("neighbour.py", seconds, elastic=True, max_gpus=3))
        wait_for(lambda: state(neighbours[-1]) == "succeeded", 60, "an elastic neighbour")
    # meanwhile another rigid job of two waits, and says for whom
    second = submit("count.py", str(tmp_path), "0", min_gpus=2, max_gpus=2)
    reason = wait_for(
        lambda: (r := str(show(second)["job"]["reason"])).startswith("waiting") and r,
        30,
        "the second rigid job's reason",
    )
    assert "needs 2 devices" in reason and f"job {rigid} (" in reason and "rigid" in reason
    wait_for(lambda: state(rigid) == "succeeded", 60, "the rigid job to finish")
    wait_for(lambda: state(second) == "succeeded", 60, "the second rigid job to finish")
    for rank in (0, 1):
        assert (work / f"starts-{rank}.txt").read_text() == "world 2 batch None\n"
    shown = show(rigid)
    job = shown["job"]
    assert isinstance(job, dict)
    assert (job["elastic"], job["preemptible"], job["min_gpus"], job["max_gpus"]) == (
        False, False, 2, 2,
    )  # fmt: skip
    decisions = shown["decisions"]
    assert isinstance(decisions, list)
    kinds = [d["kind"] for d in decisions]
    assert kinds == ["submitted", "start", "finished"], json.dumps(decisions, indent=1)
