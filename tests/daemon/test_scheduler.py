"""The pure scheduling pass: models from reports, policy answers turned into concrete plans."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pollux_local.api.report import JobReport
from pollux_local.api.spec import Target
from pollux_local.core.schedule import ActionKind, NodeInput
from pollux_local.core.schedule.placement import assign_devices
from pollux_local.core.schedule.views import job_view, static_batch
from pollux_local.core.types import Decision, GradStats, JobView, NodeView, Placement
from pollux_local.daemon.scheduler import ModelCache, job_input, job_kind, plan_round
from pollux_local.daemon.state import JobRecord

RNG = np.random.default_rng(0)
NODES = [NodeInput("a", ("cpu:0", "cpu:1")), NodeInput("b", ("cpu:0", "cpu:1"))]


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


def report(points: list[tuple[int, int, int, float, float]], **more: object) -> JobReport:
    return msgspec.convert(
        {
            "version": 1,
            "bounds": {"base_batch": 64, "max_batch": 1024, "min_local": 8, "max_local": 256},
            "profile": [
                {
                    "nodes": n,
                    "replicas": k,
                    "local_batch": m,
                    "compute_s": c,
                    "step_s": s,
                    "count": 10,
                }
                for n, k, m, c, s in points
            ],
            "grad_stats": {"sqr": 1.0, "var": 4.0},
            "progress": 10.0,
            **more,
        },
        JobReport,
    )


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
    assert kinds == {1: ActionKind.START, 3: ActionKind.STOP}
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
    assert action is not None and action.kind is ActionKind.RESIZE
    assert action.allocation == {"a": ["cpu:1"], "b": ["cpu:0"]}
    assert plan.unchanged == (2,)


def test_devices_busy_outside_the_scheduler_are_left_alone() -> None:
    nodes = [NodeInput("a", ("cuda:0", "cuda:1", "cuda:2"), busy=frozenset({"cuda:0"}))]
    policy = FixedPolicy({"1": (2,)})
    plan = plan_round(policy, [job(1)], nodes, ModelCache(), now=1.0, rng=RNG)
    assert policy.seen_nodes[0].devices == 2
    action = plan.for_job(1)
    assert action is not None and action.allocation == {"a": ["cuda:1", "cuda:2"]}


def test_down_nodes_offer_no_devices() -> None:
    nodes = [NodeInput("a", ("cpu:0",)), NodeInput("b", ("cpu:0",), up=False)]
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
    result = assign_devices({1: (3,)}, {}, [NodeInput("a", ("cpu:0", "cpu:1"))])
    assert result == {1: {"a": ["cpu:0", "cpu:1"]}}


def test_static_batch_respects_local_bounds() -> None:
    choice = static_batch(job_input(job(1, max_local_batch=16)), 2)
    assert choice is not None and (choice.local_batch, choice.accum_steps) == (16, 1)
    assert static_batch(job_input(job(1, batch_size=None)), 2) is None


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
    with_length.report = report([], epoch=3, epochs=12)
    view = job_view(job_input(with_length), NODES, now=10.0)
    assert view.progress_fraction == pytest.approx(0.25)
    without = job(2)
    without.report = report([], epoch=3, epochs=None)
    assert job_view(job_input(without), NODES, now=10.0).progress_fraction is None
    assert job_view(job_input(job(3)), NODES, now=10.0).progress_fraction is None


def test_jobs_of_one_kind_share_their_throughput_points() -> None:
    cache = ModelCache()
    first = job(1, "running", {"a": ["cpu:0"]})
    first.report = report([(1, 1, 32, 0.05, 0.05), (1, 2, 32, 0.05, 0.08)], epoch=0)
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


# --- rigid jobs, whatever the policy answers ------------------------------------------------


def test_rigid_jobs_are_never_resized_moved_or_started_on_another_size() -> None:
    rigid = job(1, "running", {"a": ["cpu:0", "cpu:1"]}, elastic=False, min_gpus=2, max_gpus=2)
    stoppable = job(2, "running", {"b": ["cpu:0"]}, elastic=False, preemptible=True, max_gpus=1)
    waiting = job(3, elastic=False, min_gpus=2, max_gpus=2)
    # the policy tries to move the first, grow the second and start the third on one device
    policy = FixedPolicy({"1": (0, 2), "2": (1, 1), "3": (0, 1)})
    plan = plan_round(policy, [rigid, stoppable, waiting], NODES, ModelCache(), 1.0, RNG)
    assert plan.actions == () and set(plan.unchanged) == {1, 2, 3}
    assert [v.rigid for v in policy.seen_jobs] == [True, True, True]
    assert [v.preemptible for v in policy.seen_jobs] == [False, True, False]
    assert policy.seen_jobs[0].max_replicas == 2  # exactly its size
    # stopping: only the preemptible one
    plan = plan_round(FixedPolicy({}), [rigid, stoppable], NODES, ModelCache(), 1.0, RNG)
    assert [(a.kind, a.job_id) for a in plan.actions] == [(ActionKind.STOP, 2)]
    # started on exactly its size, with no batch choice
    plan = plan_round(FixedPolicy({"3": (2, 0)}), [waiting], NODES, ModelCache(), 1.0, RNG)
    start = plan.for_job(3)
    assert start is not None and start.kind is ActionKind.START and start.batch is None
    assert start.allocation == {"a": ["cpu:0", "cpu:1"]}


# --- what a waiting job says ------------------------------------------------------------


def test_a_job_larger_than_the_devices_open_to_jobs_is_taken_and_says_why_it_waits() -> None:
    """Four devices, one reserved by the config and one drained: a job needing four is taken
    (a reload or ``resume`` may give them back) and its reason says what is withheld."""
    import types

    from pollux_local.core.baselines import FifoPolicy
    from pollux_local.daemon.config import DaemonConfig, NodeConfig
    from pollux_local.daemon.jobrules import check_shape
    from pollux_local.daemon.loop import node_snapshot

    node = NodeConfig("n", ("cpu:0", "cpu:1", "cpu:2", "cpu:3"))
    config = DaemonConfig(nodes=(node,), reserved=("n:cpu:3",))
    check_shape(argv=["x"], workdir="/", min_gpus=4, max_gpus=4, elastic=False, config=config)
    executor = types.SimpleNamespace(groups={}, nodes=types.SimpleNamespace(is_up=lambda _: True))
    nodes = node_snapshot(config, executor, ["n:cpu:2"])  # type: ignore[arg-type]
    wide = job(1, min_gpus=4, max_gpus=4)
    plan = plan_round(FifoPolicy(), [wide], nodes, ModelCache(), 1.0, RNG)
    assert plan.actions == ()
    assert plan.reasons[1] == (
        "waiting: needs 4 devices; 2 are open to jobs (2 reserved or drained)"
    )
    # given back: it starts
    nodes = node_snapshot(DaemonConfig(nodes=(node,)), executor)  # type: ignore[arg-type]
    plan = plan_round(FifoPolicy(), [wide], nodes, ModelCache(), 1.0, RNG)
    assert [a.kind for a in plan.actions] == [ActionKind.START]


def test_a_waiting_jobs_reason_names_the_jobs_holding_its_devices() -> None:
    """Two devices, two jobs that need both: the less served runs; the other says so with
    the facts (its owner's and the holder's device-hours)."""
    from pollux_local.core.policy import GoodputPolicy

    nodes = [NodeInput("a", ("cpu:0", "cpu:1"))]
    light = job(1, min_gpus=2, max_gpus=2)
    light.owner_name, light.attained_gpu_s = "bob", 0.4 * 3600
    heavy = job(2, min_gpus=2, max_gpus=2)
    heavy.owner_name, heavy.attained_gpu_s = "alice", 3.2 * 3600
    plan = plan_round(GoodputPolicy(), [heavy, light], nodes, ModelCache(), 1.0, RNG)
    assert plan.for_job(1) is not None and plan.for_job(1).kind is ActionKind.START  # type: ignore[union-attr]
    assert plan.reasons[2] == (
        "waiting: needs 2 devices, 0 free; job 1 (bob) holds 2"
        " (fair share: it has used 0.4 device-hours, this job 3.2)"
    )
    assert plan.decision.waiting["2"].holders[0].id == "1"
    # the holder's expected end, when it declared its length: 1 of 4 epochs in 600 s
    running = job(1, "running", {"a": ["cpu:0", "cpu:1"]}, min_gpus=2, max_gpus=2)
    running.owner_name, running.run_time_s, running.last_start = "bob", 500.0, 900.0
    running.report = JobReport(epoch=1, epochs=4)
    plan = plan_round(GoodputPolicy(), [running, heavy], nodes, ModelCache(), 1000.0, RNG)
    holder = "job 1 (bob) holds 2 (fair share: it has used 0.06 device-hours, this job 3.2;"
    assert holder in plan.reasons[2]
    assert plan.reasons[2].endswith("expected to finish in 30m)")
    # an unchanged reason is not written again
    heavy.reason = plan.reasons[2]
    again = plan_round(GoodputPolicy(), [running, heavy], nodes, ModelCache(), 1000.0, RNG)
    assert 2 not in again.reasons


def test_reasons_of_jobs_in_back_off_and_of_policies_without_facts() -> None:
    backing = job(1)
    backing.retry_after = 112.0
    plan = plan_round(FixedPolicy({}), [backing], NODES, ModelCache(), 100.0, RNG)
    assert plan.reasons[1] == "waiting: retry in 12s (back-off after a crash)"
    from pollux_local.core.baselines import FifoPolicy

    first = job(1, "running", {"a": ["cpu:0", "cpu:1"], "b": ["cpu:0", "cpu:1"]})
    first.owner_name = "alice"
    plan = plan_round(FifoPolicy(), [first, job(2)], NODES, ModelCache(), 100.0, RNG)
    assert plan.reasons[2] == (
        "waiting: queued behind an earlier job; needs 1 device, 0 free; job 1 (alice) holds 4"
    )


# --- the service a running job has had -----------------------------------------------------


def test_attained_service_and_run_time_accrue_while_a_job_runs() -> None:
    running = job(1, "running", {"a": ["cpu:0", "cpu:1"]})
    running.attained_gpu_s, running.run_time_s, running.last_start = 50.0, 25.0, 100.0
    running.restarts = 3  # three starts: two changes after the first
    view = job_view(job_input(running), NODES, now=160.0)
    assert view.attained_gpu_s == 50.0 + 2 * 60.0 and view.run_time_s == 25.0 + 60.0
    assert view.restarts == 2
    queued = job(2)
    queued.attained_gpu_s, queued.run_time_s = 50.0, 25.0
    view = job_view(job_input(queued), NODES, now=160.0)
    assert (view.attained_gpu_s, view.run_time_s, view.restarts) == (50.0, 25.0, 0)


# --- predictions: one place, the policy's figures ------------------------------------------


def test_predictions_of_running_jobs_are_the_policys_figures() -> None:
    """The prediction stored for a job (``status``, ``show``, the TUI) is computed for every
    placed job by the pass, and its speed-up is the one the policy's reason states."""
    from pollux_local.core.policy import GoodputPolicy

    record = job(1)
    record.report = report([(1, 1, 32, 0.05, 0.05), (1, 1, 64, 0.09, 0.09), (1, 2, 32, 0.05, 0.08)])
    nodes = [NodeInput("a", ("cpu:0", "cpu:1"))]
    plan = plan_round(GoodputPolicy(), [record], nodes, ModelCache(), 1.0, RNG)
    start = plan.for_job(1)
    assert start is not None and start.prediction
    speedup = start.prediction["speedup"]
    assert f"speed-up {speedup:.2f}x over 1 device" in plan.decision.reasons["1"]
    assert f"predicted speedup x{speedup:.2f} vs 1 device" in start.reason
    # running as decided, with nothing stored yet: the pass gives its figures to store
    record.state, record.placement = "running", dict(start.allocation)  # type: ignore[assignment]
    record.restarts, record.last_start = 1, 1.0
    plan = plan_round(GoodputPolicy(), [record], nodes, ModelCache(), 61.0, RNG)
    assert plan.unchanged == (1,) and plan.predictions[1] == start.prediction
    record.prediction = dict(plan.predictions[1])
    assert plan_round(GoodputPolicy(), [record], nodes, ModelCache(), 121.0, RNG).predictions == {}


# --- ETA ---------------------------------------------------------------------------------


def test_eta_from_the_declared_length_and_the_metric_trend() -> None:
    from pollux_local.core.schedule.views import MAX_ETA_S
    from pollux_local.daemon.readmodel import MetricHistory, job_eta
    from pollux_local.daemon.scheduler import progress_eta

    running = job(1, "running", {"a": ["cpu:0"]})
    running.run_time_s, running.last_start = 100.0, 1000.0
    running.report = JobReport(epoch=1, epochs=4)
    assert progress_eta(running, 1100.0) == pytest.approx(600.0)  # 200 s for a quarter
    assert job_eta(running, 1100.0) == pytest.approx(600.0)
    running.report = JobReport(epoch=0, epochs=4)
    assert job_eta(running, 1100.0) is None  # nothing done yet: unknown
    # the target metric's trend, when sooner
    running.spec.target = Target(metric="acc", value=0.9, mode="max")
    metrics = MetricHistory()
    for t, acc in ((1000.0, 0.5), (1010.0, 0.6), (1020.0, 0.7)):
        metrics.note(running, JobReport(metrics={"acc": acc}, time=t), t)
    assert job_eta(running, 1020.0, metrics) == pytest.approx(20.0)
    # a trend that barely moves: long, but not absurd
    slow = MetricHistory()
    for t, acc in ((0.0, 0.5), (1e3, 0.5 + 1e-12), (2e3, 0.5 + 2e-12)):
        slow.note(running, JobReport(metrics={"acc": acc}, time=t), t)
    assert job_eta(running, 2e3, slow) == MAX_ETA_S
    assert job_eta(job(2), 0.0, metrics) is None  # not running


_numbers = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(10**12), 10**12),
    st.floats(allow_nan=True, allow_infinity=True),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    epoch=_numbers,
    epochs=_numbers,
    own=_numbers,
    run_time=st.floats(0.0, 1e12),
    started=st.one_of(st.none(), st.floats(-1e12, 1e12)),
    now=st.floats(-1e12, 1e12),
    points=st.lists(
        st.tuples(st.floats(-1e9, 1e9), st.floats(allow_nan=True, allow_infinity=True)),
        max_size=8,
    ),
    goal=st.floats(allow_nan=True, allow_infinity=True),
    mode=st.sampled_from(["max", "min"]),
)
def test_eta_is_never_absurd(
    epoch: object, epochs: object, own: object, run_time: float, started: float | None,
    now: float, points: list[tuple[float, float]], goal: float, mode: str,
) -> None:  # fmt: skip
    from pollux_local.core.schedule.views import MAX_ETA_S
    from pollux_local.daemon.readmodel import MetricHistory, job_eta

    record = job(
        1, "running", {"a": ["cpu:0"]}, target={"metric": "m", "value": goal, "mode": mode}
    )
    record.run_time_s, record.last_start = run_time, started
    try:  # a report outside the schema is refused (the job keeps none)
        record.report = msgspec.convert({"epoch": epoch, "epochs": epochs, "eta_s": own}, JobReport)
    except msgspec.ValidationError:
        record.report = None
    metrics = MetricHistory()
    for t, value in points:  # unchecked values, as if a report had escaped the schema
        metrics.note(record, JobReport(metrics={"m": value}, time=t), t)
    with np.errstate(all="ignore"):
        eta = job_eta(record, now, metrics)
    assert eta is None or (isinstance(eta, float) and 0.0 <= eta <= MAX_ETA_S)
