"""The simulation loop on small seeded traces, checked against hand-computed timings."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from pollux_local.core.baselines import FifoPolicy, OptimusPolicy, TiresiasPolicy
from pollux_local.core.goodput import GoodputModel
from pollux_local.core.types import Decision, JobView, NodeView
from pollux_local.errors import PolluxError
from pollux_local.sim.engine import SimConfig, Simulator, _with_changes
from pollux_local.sim.profiles import AppProfile, load_profiles
from pollux_local.sim.workload import WorkloadJob

pytestmark = pytest.mark.timeout(120)

#: Applications that train in simulated hours, not days.
SHORT_APPS = {"bert": (1, 12, 24), "cifar10": (1, 128, 512), "ncf": (1, 32768, 32768)}


@pytest.fixture(scope="module")
def profiles(artifact_dir: Path) -> dict[str, AppProfile]:
    return load_profiles(artifact_dir / "models", set(SHORT_APPS) | {"deepspeech2"})


def make_trace(seed: int, jobs: int, span_s: float = 3600.0) -> list[WorkloadJob]:
    """A small random trace in the workload format: Poisson-ish arrivals, static configs."""
    rng = np.random.default_rng(seed)
    names = sorted(SHORT_APPS)
    out = []
    for i in range(jobs):
        app = names[int(rng.integers(len(names)))]
        _, lo, hi = SHORT_APPS[app]
        replicas = int(rng.choice([1, 2, 4, 6]))
        if app == "ncf":
            replicas = 1
        batch = int(rng.choice([lo, hi]))
        out.append(WorkloadJob(f"{app}-{i}", float(rng.uniform(0, span_s)), app, replicas, batch))
    return sorted(out, key=lambda j: j.time)


def alone_jct(app: AppProfile, counts: tuple[int, ...], batch: int, restart_s: float) -> float:
    """Hand computation: restart, then sum over epochs of work / (gain / T_iter)."""
    k = sum(counts)
    m = batch // k
    step, _ = app.step_sync_time(counts, m)
    total = restart_s
    for epoch in range(app.epochs):
        work = app.epoch_target[epoch + 1] - app.epoch_target[epoch]
        total += work / (app.gain(batch, epoch) / step)
    return total


@pytest.mark.parametrize("submit", [0.0, 100.0])
def test_single_job_matches_hand_computation(
    profiles: dict[str, AppProfile], submit: float
) -> None:
    job = WorkloadJob("solo", submit, "bert", 2, 24)
    sim = Simulator([job], profiles, FifoPolicy(), SimConfig(nodes=2, gpus_per_node=4))
    result = sim.run()
    wait = -submit % 60.0  # decisions happen on the minute
    expected = wait + alone_jct(profiles["bert"], (2,), 24, 30.0)
    assert result.jct_s["solo"] == pytest.approx(expected, rel=1e-9)
    assert result.restarts["solo"] == 0
    assert result.completed == 1


def test_restart_cost_is_paid_once_per_start(profiles: dict[str, AppProfile]) -> None:
    job = [WorkloadJob("solo", 0.0, "bert", 1, 12)]
    slow = Simulator(job, profiles, FifoPolicy(), SimConfig(nodes=1, restart_cost_s=90)).run()
    fast = Simulator(job, profiles, FifoPolicy(), SimConfig(nodes=1, restart_cost_s=0)).run()
    assert slow.jct_s["solo"] - fast.jct_s["solo"] == pytest.approx(90.0)


@pytest.mark.parametrize("policy_cls", [FifoPolicy, TiresiasPolicy, OptimusPolicy])
def test_small_trace_completes_and_is_deterministic(
    profiles: dict[str, AppProfile], policy_cls: type
) -> None:
    trace = make_trace(seed=7, jobs=10)
    config = SimConfig(nodes=2, gpus_per_node=4, seed=3)
    first = Simulator(trace, profiles, policy_cls(), config).run()
    again = Simulator(
        trace, profiles, policy_cls(), SimConfig(nodes=2, gpus_per_node=4, seed=3)
    ).run()
    assert first.completed == len(trace)
    assert first.jct_s == again.jct_s
    assert first.restarts == again.restarts
    summary = first.summary()
    for key in (
        "policy",
        "jobs",
        "avg_jct_s",
        "p99_jct_s",
        "makespan_s",
        "restarts_per_job",
        "max_finish_time_fairness",
        "decision_ms_median",
        "decision_ms_p95",
        "wall_s",
    ):
        assert key in summary
    assert summary["avg_jct_s"] == pytest.approx(np.mean(list(first.jct_s.values())))
    # nobody finishes faster than its restart cost, and contention makes someone wait
    assert min(first.jct_s.values()) > config.restart_cost_s
    assert max(first.finish_time_fairness.values()) > 1.0


def test_fifo_runs_jobs_in_order_without_preemption(profiles: dict[str, AppProfile]) -> None:
    trace = [
        WorkloadJob("first", 0.0, "cifar10", 4, 512),
        WorkloadJob("second", 10.0, "cifar10", 4, 512),
    ]
    result = Simulator(trace, profiles, FifoPolicy(), SimConfig(nodes=1)).run()
    alone = alone_jct(profiles["cifar10"], (4,), 512, 30.0)
    assert result.jct_s["first"] == pytest.approx(alone, rel=1e-9)
    # the second waits for the first: its JCT covers both runs
    assert result.jct_s["second"] > result.jct_s["first"] + alone * 0.9
    assert result.restarts == {"first": 0, "second": 0}


class _Greedy:
    """A broken policy that puts every job on node 0 with all its devices."""

    name = "greedy"

    def decide(
        self,
        jobs: Sequence[JobView],
        nodes: Sequence[NodeView],
        now: float,
        rng: np.random.Generator,
    ) -> Decision:
        return Decision({j.id: (nodes[0].devices,) + (0,) * (len(nodes) - 1) for j in jobs})


def test_over_committing_policy_is_caught(profiles: dict[str, AppProfile]) -> None:
    trace = [WorkloadJob("a", 0.0, "bert", 1, 12), WorkloadJob("b", 0.0, "bert", 1, 12)]
    with pytest.raises(RuntimeError, match="over-committed"):
        Simulator(trace, profiles, _Greedy(), SimConfig(nodes=2), adaptive=False).run()


def test_adaptive_job_refits_and_grows_its_batch(profiles: dict[str, AppProfile]) -> None:
    pytest.importorskip("pollux_local.core.goodput")
    job = WorkloadJob("c", 0.0, "cifar10", 4, 512)
    sim = Simulator([job], profiles, FifoPolicy(), SimConfig(nodes=1), adaptive=True)
    result = sim.run()
    state = sim.jobs[0]
    assert result.completed == 1
    local_batches = {point[2] for point in state.profile}
    assert len(local_batches) > 1  # it re-chose m as its statistics changed
    bounds = profiles["cifar10"].bounds
    assert all(bounds.min_local <= m <= (bounds.max_local or m) for m in local_batches)
    assert state.local_batch * state.accum_steps * 4 > bounds.base_batch


def test_goodput_policy_small_trace(profiles: dict[str, AppProfile]) -> None:
    policy_mod = pytest.importorskip("pollux_local.core.policy")
    trace = make_trace(seed=11, jobs=8)
    config = SimConfig(nodes=2, gpus_per_node=4, seed=5)
    first = Simulator(trace, profiles, policy_mod.GoodputPolicy(), config).run()
    again = Simulator(trace, profiles, policy_mod.GoodputPolicy(), SimConfig(nodes=2, seed=5)).run()
    assert first.completed == len(trace)
    assert first.jct_s == again.jct_s


def test_bad_input(profiles: dict[str, AppProfile]) -> None:
    with pytest.raises(PolluxError, match="unknown application 'resnet'"):
        Simulator([WorkloadJob("a", 0, "resnet", 1, 8)], profiles, FifoPolicy())
    with pytest.raises(PolluxError, match="impossible cluster size: job a needs 12 GPUs"):
        Simulator([WorkloadJob("a", 0, "bert", 12, 48)], profiles, FifoPolicy(), SimConfig(nodes=2))
    with pytest.raises(PolluxError, match="impossible cluster size: 0 nodes"):
        Simulator([WorkloadJob("a", 0, "bert", 1, 12)], profiles, FifoPolicy(), SimConfig(nodes=0))


@pytest.mark.parametrize("share", [True, False])
def test_jobs_of_one_application_share_their_points(
    profiles: dict[str, AppProfile], share: bool
) -> None:
    policy_mod = pytest.importorskip("pollux_local.core.policy")

    class Recording(policy_mod.GoodputPolicy):  # type: ignore[name-defined,misc]
        first_views: dict[str, JobView] = {}

        def decide(self, jobs, nodes, now, rng):  # type: ignore[no-untyped-def]
            for view in jobs:
                self.first_views.setdefault(view.id, view)
            return super().decide(jobs, nodes, now, rng)

    trace = [WorkloadJob("a", 0.0, "cifar10", 1, 128), WorkloadJob("b", 300.0, "cifar10", 1, 128)]
    policy = Recording()
    sim = Simulator(trace, profiles, policy, SimConfig(nodes=1, share_profiles=share))
    assert sim.run().completed == 2
    second = policy.first_views[str(sim.jobs[1].id)]  # the pass names jobs by id
    assert second.max_profiled_replicas == 0  # its exploration still starts from its own runs
    if share:  # a model before it has run: its application's points and first-epoch stats
        assert second.model is not None
        assert len(sim.pool.points_for("cifar10", {})) >= len(sim.jobs[0].profile)
    else:
        assert second.model is None
        assert sim.pool.kinds() == []


@pytest.mark.parametrize("correct", [True, False])
def test_models_carry_the_measured_correction_unless_turned_off(
    profiles: dict[str, AppProfile], correct: bool
) -> None:
    """With ``correct_times`` each adaptive job's model predicts the configurations it ran
    closer to what the profile measured than its fitted parameters alone do."""
    policy_mod = pytest.importorskip("pollux_local.core.policy")
    trace = [WorkloadJob("a", 0.0, "deepspeech2", 1, 20)]
    sim = Simulator(
        trace, profiles, policy_mod.GoodputPolicy(), SimConfig(nodes=1, correct_times=correct)
    )
    assert sim.run().completed == 1
    job = sim.jobs[0]
    model = sim._model(job)
    assert model is not None and (model.correction is not None) == correct
    if not correct:
        return
    plain = replace(model, correction=None)

    def median_error(m: GoodputModel) -> float:
        return float(
            np.median(
                [
                    abs(float(m.throughput(n, k, b, 1)) / (k * b / step) - 1)
                    for (n, k, b), (_, step) in job.profile.items()
                ]
            )
        )

    assert median_error(model) < 0.75 * median_error(plain)


def test_a_views_changes_are_made_as_dataclasses_replace_makes_them() -> None:
    view = JobView(id="7", owner="ana", placement=(2, 0), restarts=3, allowed_nodes=frozenset({0}))
    changes = {"static_replicas": 4, "restart_cost_s": 12.5, "restoring": True, "model": None}
    made = _with_changes(view, **changes)
    assert made == replace(view, **changes)
    assert made is not view and view.static_replicas == 1  # the view itself unchanged
    with pytest.raises(TypeError, match="no field 'restart_cost'"):
        _with_changes(view, restart_cost=1.0)
