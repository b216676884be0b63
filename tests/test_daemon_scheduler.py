"""The pure scheduling pass: models from reports, policy answers turned into concrete plans."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import pytest

from pollux_local.core.types import Decision, GradStats, JobView, NodeView, Placement
from pollux_local.daemon.scheduler import (
    ModelCache,
    NodeSnapshot,
    assign_devices,
    job_kind,
    job_view,
    plan_round,
    static_batch,
)
from pollux_local.daemon.state import JobRecord

RNG = np.random.default_rng(0)
NODES = [NodeSnapshot("a", ("cpu:0", "cpu:1")), NodeSnapshot("b", ("cpu:0", "cpu:1"))]


class FixedPolicy:
    """Answers with placements set by the test and remembers what it was shown."""

    name = "fixed"

    def __init__(self, placements: Mapping[str, Placement]) -> None:
        self.placements = dict(placements)
        self.seen_jobs: list[JobView] = []
        self.seen_nodes: list[NodeView] = []

    def decide(
        self,
        jobs: Sequence[JobView],
        nodes: Sequence[NodeView],
        now: float,
        rng: np.random.Generator,
    ) -> Decision:
        self.seen_jobs, self.seen_nodes = list(jobs), list(nodes)
        return Decision(
            placements={j.id: self.placements.get(j.id, (0,) * len(nodes)) for j in jobs},
            reasons={j.id: "because" for j in jobs},
        )


def job(
    job_id: int, state: str = "queued", placement: dict | None = None, **spec: object
) -> JobRecord:
    base = {"argv": ["x"], "workdir": "/", "min_gpus": 1, "max_gpus": 4, "batch_size": 64}
    base.update(spec)
    return JobRecord(
        id=job_id, name=f"j{job_id}", owner_uid=1000, owner_gid=1000, owner_name="ann",
        state=state, spec=base, submit_time=0.0, placement=placement or {},
    )  # fmt: skip


def report(points: list[tuple[int, int, int, float, float]]) -> dict:
    return {
        "version": 1,
        "bounds": {"base_batch": 64, "max_batch": 1024, "min_local": 8, "max_local": 256},
        "profile": [
            {"nodes": n, "replicas": k, "local_batch": m, "compute_s": c, "step_s": s, "count": 10}
            for n, k, m, c, s in points
        ],
        "grad_stats": {"sqr": 1.0, "var": 4.0},
        "progress": 10.0,
    }


def test_start_resize_stop_and_unchanged() -> None:
    jobs = [
        job(1),  # queued -> start on 2 devices of node a
        job(2, "running", {"b": ["cpu:0", "cpu:1"]}),  # running -> keeps its devices
        job(3, "running", {"a": ["cpu:0"]}),  # running -> preempted
        job(4, "held"),  # never shown to the policy
    ]
    policy = FixedPolicy({"1": (2, 0), "2": (0, 2), "3": (0, 0), "4": (1, 0)})
    plan = plan_round(policy, jobs, NODES, ModelCache(), now=100.0, rng=RNG)
    assert [j.id for j in policy.seen_jobs] == ["1", "2", "3"]
    assert policy.seen_jobs[2].placement == (1, 0)
    kinds = {a.job_id: a.kind for a in plan.actions}
    assert kinds == {1: "start", 3: "stop"}
    assert plan.unchanged == (2,)
    start = plan.for_job(1)
    assert start is not None and start.allocation == {"a": ["cpu:0", "cpu:1"]}
    assert start.batch is not None and start.batch.local_batch == 32  # static: ceil(64 / 2)
    assert "because" in start.reason and "batch 32x1x2=64" in start.reason


def test_resize_keeps_devices_on_nodes_whose_count_is_unchanged() -> None:
    jobs = [job(1, "running", {"a": ["cpu:1"]}), job(2, "running", {"b": ["cpu:1"]})]
    policy = FixedPolicy({"1": (1, 1), "2": (0, 1)})
    plan = plan_round(policy, jobs, NODES, ModelCache(), now=1.0, rng=RNG)
    action = plan.for_job(1)
    assert action is not None and action.kind == "resize"
    assert action.allocation == {"a": ["cpu:1"], "b": ["cpu:0"]}
    assert plan.unchanged == (2,)


def test_devices_busy_outside_the_scheduler_are_left_alone() -> None:
    nodes = [NodeSnapshot("a", ("cuda:0", "cuda:1", "cuda:2"), busy=frozenset({"cuda:0"}))]
    policy = FixedPolicy({"1": (2,)})
    plan = plan_round(policy, [job(1)], nodes, ModelCache(), now=1.0, rng=RNG)
    assert policy.seen_nodes[0].devices == 2
    action = plan.for_job(1)
    assert action is not None and action.allocation == {"a": ["cuda:1", "cuda:2"]}


def test_down_nodes_offer_no_devices() -> None:
    nodes = [NodeSnapshot("a", ("cpu:0",)), NodeSnapshot("b", ("cpu:0",), up=False)]
    policy = FixedPolicy({})
    plan_round(policy, [job(1)], nodes, ModelCache(), now=1.0, rng=RNG)
    assert [(n.devices, n.up) for n in policy.seen_nodes] == [(1, True), (0, False)]


def test_jobs_in_backoff_wait() -> None:
    waiting = job(1)
    waiting.retry_after = 50.0
    policy = FixedPolicy({"1": (1, 0)})
    assert plan_round(policy, [waiting], NODES, ModelCache(), now=10.0, rng=RNG).actions == ()
    assert len(plan_round(policy, [waiting], NODES, ModelCache(), now=60.0, rng=RNG).actions) == 1


def test_assign_cuts_a_count_that_cannot_be_met() -> None:
    result = assign_devices({1: (3,)}, {}, [NodeSnapshot("a", ("cpu:0", "cpu:1"))])
    assert result == {1: {"a": ["cpu:0", "cpu:1"]}}


def test_static_batch_respects_local_bounds() -> None:
    choice = static_batch(job(1, max_local_batch=16), 2)
    assert choice is not None and (choice.local_batch, choice.accum_steps) == (16, 1)
    assert static_batch(job(1, batch_size=None), 2) is None


def test_model_from_report_refits_only_when_profile_changes() -> None:
    record = job(1, "running", {"a": ["cpu:0"]})
    record.report = report([(1, 1, 32, 0.05, 0.05), (1, 1, 64, 0.09, 0.09)])
    cache = ModelCache()
    assert cache.model_for(job(2)) is None  # never reported
    model = cache.model_for(record)
    assert model is not None and cache.fit_count == 1
    cache.model_for(record)
    assert cache.fit_count == 1
    record.report = report([(1, 1, 32, 0.05, 0.05), (1, 2, 32, 0.05, 0.07)])
    cache.model_for(record)
    assert cache.fit_count == 2
    choice = model.best_choice(1, 2)
    assert choice.replicas == 2 and 8 <= choice.local_batch <= 256


def test_plan_uses_model_batch_and_predictions() -> None:
    record = job(1)
    record.report = report([(1, 1, 32, 0.05, 0.05), (1, 1, 64, 0.09, 0.09), (1, 2, 32, 0.05, 0.08)])
    plan = plan_round(FixedPolicy({"1": (2, 0)}), [record], NODES, ModelCache(), 1.0, RNG)
    action = plan.for_job(1)
    assert action is not None and action.batch is not None
    assert set(action.prediction) == {"goodput", "efficiency", "speedup"}
    assert 0 < action.prediction["efficiency"] <= 1.0
    assert action.prediction["goodput"] > 0
    assert "efficiency" in action.reason


def test_min_replicas_not_met_means_not_running() -> None:
    policy = FixedPolicy({"1": (1, 0)})
    plan = plan_round(policy, [job(1, min_gpus=2)], NODES, ModelCache(), 1.0, RNG)
    assert plan.actions == () and plan.unchanged == (1,)


@pytest.mark.parametrize("policy_name", ["goodput", "fifo"])
def test_core_policies_drive_the_pass(policy_name: str) -> None:
    from pollux_local.daemon.config import DaemonConfig
    from pollux_local.daemon.server import make_policy

    policy = make_policy(DaemonConfig(nodes=(), policy=policy_name))
    plan = plan_round(policy, [job(1), job(2, max_gpus=1)], NODES, ModelCache(), 1.0, RNG)
    started = {a.job_id: sum(map(len, a.allocation.values())) for a in plan.actions}
    if policy_name == "goodput":  # both share the four devices
        assert started.get(2) == 1 and started.get(1, 0) >= 1
    else:  # first come, first served: job 1 takes its static 4 devices, job 2 waits
        assert started == {1: 4}
    assert sum(started.values()) <= 4


def test_job_view_carries_the_declared_progress_fraction() -> None:
    with_length = job(1)
    with_length.report = {**report([]), "epoch": 3, "epochs": 12}
    view = job_view(with_length, None, NODES, now=10.0)
    assert view.progress_fraction == pytest.approx(0.25)
    without = job(2)
    without.report = {**report([]), "epoch": 3, "epochs": None}
    assert job_view(without, None, NODES, now=10.0).progress_fraction is None
    assert job_view(job(3), None, NODES, now=10.0).progress_fraction is None


def test_jobs_of_one_kind_share_their_throughput_points() -> None:
    cache = ModelCache()
    first = job(1, "running", {"a": ["cpu:0"]})
    first.report = report([(1, 1, 32, 0.05, 0.05), (1, 2, 32, 0.05, 0.08)])
    first.report["epoch"] = 0
    same_kind, other_kind = job(2), job(3, argv=["y"])
    assert cache.model_for(same_kind) is None  # the kind has reported nothing yet
    assert cache.model_for(first) is not None
    pooled = cache.model_for(same_kind)  # no report of its own: the kind's points and stats
    assert pooled is not None and pooled.stats == GradStats(sqr=1.0, var=4.0)
    assert cache.model_for(other_kind) is None
    # its own points win where both measured the same configuration
    same_kind.report = report([(1, 2, 32, 0.05, 0.20)])
    own = cache.model_for(same_kind)
    assert own is not None
    assert own.params != pooled.params
    assert job_kind(same_kind) == job_kind(first) != job_kind(other_kind)


def test_daemon_models_predict_measured_configurations_as_measured() -> None:
    """The daemon's model carries the residual correction: a configuration the job reported
    (here, compute on 4 devices much slower than on 1, which the model's single compute line
    cannot express) is predicted close to its measured throughput."""
    points = [
        (1, 1, 32, 0.050, 0.050),
        (1, 1, 64, 0.090, 0.090),
        (1, 4, 32, 0.080, 0.095),
        (1, 4, 64, 0.140, 0.160),
    ]
    record = job(1, "running", {"a": ["cpu:0"]})
    record.report = report(points)
    model = ModelCache().model_for(record)
    assert model is not None and model.correction is not None
    for n, k, m, _, step in points:
        measured = k * m / step
        predicted = float(model.throughput(n, k, m, 1))
        assert abs(predicted / measured - 1) < 0.05, (k, m, predicted, measured)
