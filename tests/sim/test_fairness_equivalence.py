"""The daemon decides as the simulator does: same arrivals, same fitted models, same decisions.

A short trace (more jobs than devices, so least-attained-service admission decides who runs)
is simulated with the goodput policy.  At every round, inside the simulator's call to its
policy, the daemon's own scheduling pass runs on the same instant (the real scheduling loop,
executor and store, a fake clock and a launcher that starts nothing,
``tests/scheduler_harness.py``) with its own policy object.  The daemon learns what a daemon
learns: arrivals as submits, each job's reports (its measured profile and progress) and, from
its own starts and stops, how long each job ran on how many devices; the models are the
simulator's (the same fitted models).  Both policies must see the same jobs (attained service,
run time, restarts, age, placement, progress) and make the same decisions, round after round.

The simulator runs with no restart cost (its jobs then run for all the time they hold their
devices, as the daemon counts it), and each job's report carries its progress at the
simulator's resolution (``epoch / epochs``: the fraction done, in billionths).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pytest

from pollux_local.core.policy import GoodputPolicy
from pollux_local.core.types import Decision, JobView, NodeView, Placement
from pollux_local.daemon.scheduler import ModelCache
from pollux_local.daemon.state import JobRecord
from pollux_local.sim.engine import SimConfig, Simulator
from pollux_local.sim.jobs import SimJob
from pollux_local.sim.profiles import AppProfile, load_profiles
from pollux_local.sim.workload import WorkloadJob
from tests.scheduler_harness import Harness

pytestmark = pytest.mark.timeout(300)

INTERVAL_S = 60.0
ROUNDS = 30
#: (arrival seconds, application): seven jobs on four devices
TRACE = [
    (0.0, "cifar10"),
    (15.0, "bert"),
    (70.0, "deepspeech2"),
    (130.0, "cifar10"),
    (200.0, "bert"),
    (390.0, "deepspeech2"),
    (620.0, "cifar10"),
]
#: the view fields both sides must agree on (floats to rounding)
EXACT = ("restarts", "min_replicas", "max_replicas", "placement", "max_profiled_replicas")
CLOSE = ("age_s", "attained_gpu_s", "run_time_s", "progress_fraction")


def policy() -> GoodputPolicy:
    return GoodputPolicy(restart_cost_s=30.0, interval_s=INTERVAL_S)


class Recording:
    """A policy that remembers what it was shown and what it decided (``rounds``)."""

    name = "goodput"

    def __init__(self, inner: GoodputPolicy) -> None:
        self.inner = inner
        self.rounds: list[tuple[float, list[JobView], Decision]] = []

    def decide(
        self, jobs: Sequence[JobView], nodes: Sequence[NodeView], now: float, rng: Any
    ) -> Decision:
        decision = self.inner.decide(jobs, nodes, now, rng)
        self.rounds.append((now, list(jobs), decision))
        return decision


class SimModels(ModelCache):
    """The daemon's model cache answering with the simulator's fitted model of each job."""

    def __init__(self, sim: Simulator, by_id: dict[int, SimJob]) -> None:
        super().__init__()
        self.sim = sim
        self.by_id = by_id

    def model_for(self, job: JobRecord, memory_bytes: int | None = None) -> Any | None:
        return self.sim._model(self.by_id[job.id])


def report_of(job: SimJob) -> dict[str, Any]:
    """What the simulated job would report: its measured profile, gradient statistics and
    progress."""
    rows = [
        {"nodes": n, "replicas": k, "local_batch": m, "compute_s": c, "step_s": s, "count": 1}
        for (n, k, m), (c, s) in job.profile.items()
    ]
    report: dict[str, Any] = {"version": 1, "profile": rows}
    if job.grad is not None:
        report["grad_stats"] = {"sqr": job.grad[0], "var": job.grad[1]}
    # a report's epochs are whole numbers: the fraction done in billionths
    report["epochs"] = 10**9
    report["epoch"] = round(job.progress / float(job.app.epoch_target[-1]) * 10**9)
    return report


@dataclass
class DaemonSide:
    """The daemon, driven from inside the simulator's rounds."""

    sim: Simulator
    harness: Harness
    recording: Recording
    loop: asyncio.AbstractEventLoop
    ids: dict[str, int] = field(default_factory=dict)  # simulated name -> daemon job id
    compared: int = 0

    def round(self, now: float, sim_views: list[JobView], sim_decision: Decision) -> None:
        self.loop.run_until_complete(self._round(now, sim_views, sim_decision))

    async def _round(self, now: float, sim_views: list[JobView], sim_decision: Decision) -> None:
        h = self.harness
        # the simulator's pass names its jobs by their index in the trace
        sim_names = {str(job.id): job.name for job in self.sim.jobs}
        sim_views = [replace(view, id=sim_names[view.id]) for view in sim_views]
        sim_decision = replace(
            sim_decision,
            placements={sim_names[k]: v for k, v in sim_decision.placements.items()},
        )
        h.now = now
        for job in self.sim.jobs:  # jobs the simulation finished end in the daemon too
            job_id = self.ids.get(job.name)
            if job.completion_s is not None and job_id and h.job(job_id).state == "running":
                await h.finish(job_id)
        for job in sorted(self.sim.jobs, key=lambda j: j.spec.time):  # arrivals
            if job.spec.time <= now and job.name not in self.ids:
                self.ids[job.name] = self._submit(job)
        for job in self.sim.jobs:
            if job.name in self.ids and job.completion_s is None:
                h.store.update_job(self.ids[job.name], report=report_of(job))
        before = len(self.recording.rounds)
        await h.tick()
        # the pass's own call comes first (forecasts then replay later instants)
        daemon_now, daemon_views, daemon_decision = self.recording.rounds[before]
        assert daemon_now == now
        names = {job_id: name for name, job_id in self.ids.items()}
        by_name = {v.id: v for v in sim_views}
        assert [names[int(v.id)] for v in daemon_views] == [v.id for v in sim_views]
        for view in daemon_views:
            mine, theirs = view, by_name[names[int(view.id)]]
            for name in EXACT:
                assert getattr(mine, name) == getattr(theirs, name), (now, view.id, name)
            for name in CLOSE:
                assert getattr(mine, name) == pytest.approx(
                    getattr(theirs, name), rel=1e-9, abs=1e-6
                ), (now, view.id, name)
            assert mine.model is theirs.model
        decided = {names[int(k)]: tuple(v) for k, v in daemon_decision.placements.items()}
        expected = {k: tuple(v) for k, v in sim_decision.placements.items()}
        assert decided == expected, (now, decided, expected)
        # and the daemon did what it decided
        for name, placement in expected.items():
            assert _counts(h.job(self.ids[name]), h) == placement, (now, name)
        self.compared += 1

    def _submit(self, job: SimJob) -> int:
        bounds = job.app.bounds
        spec = {
            "argv": [f"{job.app.name}.py", job.name],
            "workdir": "/",
            "min_gpus": 1,
            "max_gpus": self.sim._max_replicas(job),
            "batch_size": bounds.base_batch,
            "max_batch_size": bounds.max_batch,
            "elastic": True,
        }
        h = self.harness
        job_id = self.harness.store.add_job(
            name=job.name, owner_uid=os.geteuid(), owner_gid=os.getegid(), owner_name="default",
            spec=spec,
            priority=0, submit_time=job.spec.time,
        ).id  # fmt: skip
        h.store.record_decision(job_id, h.now, "submitted", "by default")
        return job_id


def _counts(job: JobRecord, h: Harness) -> Placement:
    return tuple(len(job.placement.get(node.name, ())) for node in h.config.nodes)


class SimPolicy(Recording):
    """The simulator's policy: decides, then lets the daemon decide the same instant."""

    daemon: DaemonSide

    def decide(
        self, jobs: Sequence[JobView], nodes: Sequence[NodeView], now: float, rng: Any
    ) -> Decision:
        decision = super().decide(jobs, nodes, now, rng)
        self.daemon.round(now, list(jobs), decision)
        return decision


@pytest.fixture(scope="module")
def profiles(artifact_dir: Path) -> dict[str, AppProfile]:
    return load_profiles(artifact_dir / "models", {app for _, app in TRACE})


def test_daemon_and_simulator_make_the_same_decisions(
    profiles: dict[str, AppProfile], tmp_path: Path
) -> None:
    trace = [WorkloadJob(str(i + 1), t, app, 1, 0) for i, (t, app) in enumerate(TRACE)]
    config = SimConfig(
        nodes=1,
        gpus_per_node=4,
        interval_s=INTERVAL_S,
        restart_cost_s=0.0,
        share_profiles=False,
        max_time_s=ROUNDS * INTERVAL_S,
    )
    sim_policy = SimPolicy(policy())
    sim = Simulator(trace, profiles, sim_policy, config)
    by_id: dict[int, SimJob] = {}
    recording = Recording(policy())
    loop = asyncio.new_event_loop()
    try:
        harness = loop.run_until_complete(_harness(tmp_path, recording, sim, by_id))
        daemon = DaemonSide(sim, harness, recording, loop)
        sim_policy.daemon = daemon
        original = daemon._submit

        def submit(job: SimJob) -> int:
            job_id = original(job)
            by_id[job_id] = job
            return job_id

        daemon._submit = submit  # type: ignore[method-assign]
        sim.run()
        loop.run_until_complete(harness.executor.shutdown())
    finally:
        loop.close()
    assert daemon.compared >= ROUNDS
    # the trace is one where fairness decides: jobs were stopped for less served ones
    stops = [d for job_id in by_id for d in harness.decisions(job_id) if d["kind"] == "stop"]
    assert stops, "no job was ever preempted: the trace does not test admission"


async def _harness(
    root: Path, recording: Recording, sim: Simulator, by_id: dict[int, SimJob]
) -> Harness:
    return Harness(root, [4], recording, interval_s=INTERVAL_S, models=SimModels(sim, by_id))
