"""Admission in the pure scheduling pass: dependencies, array caps, per-user caps, withheld
devices, constraints and time limits, with a policy that answers what the test says."""

from __future__ import annotations

import numpy as np
import pytest

from pollux_local.api.states import JobState
from pollux_local.core.baselines import FifoPolicy
from pollux_local.core.schedule import ActionKind, Limits, NodeInput, Verdict, dependency_verdict
from pollux_local.core.schedule.views import job_view
from pollux_local.daemon.scheduler import (
    ModelCache,
    after_mode,
    dependencies_of,
    job_input,
    plan_round,
)
from pollux_local.daemon.state import JobRecord
from tests.daemon.test_scheduler import FixedPolicy

RNG = np.random.default_rng(0)
FOUR = [NodeInput("a", ("cpu:0", "cpu:1")), NodeInput("b", ("cpu:0", "cpu:1"))]


def record(
    job_id: int,
    state: str = "queued",
    owner: str = "ann",
    placement: dict[str, list[str]] | None = None,
    priority: int = 0,
    **spec: object,
) -> JobRecord:
    return JobRecord(
        id=job_id, name=f"j{job_id}", owner_uid=1000, owner_gid=1000, owner_name=owner,
        state=JobState(state), spec={"argv": ["x"], "workdir": "/", "elastic": False, **spec},
        placement=placement or {}, priority=priority, last_start=0.0 if placement else None,
    )  # fmt: skip


def started(plan_actions: tuple) -> list[int]:  # type: ignore[type-arg]
    return sorted(a.job_id for a in plan_actions if a.kind is ActionKind.START)


def test_dependency_verdicts() -> None:
    job = record(5, after=["1", "2"])
    done, failed, cancelled, running = (
        JobState.SUCCEEDED,
        JobState.FAILED,
        JobState.CANCELLED,
        JobState.RUNNING,
    )

    def verdict(job: JobRecord, states: dict[int, JobState]) -> tuple[Verdict, str]:
        return dependency_verdict(dependencies_of(job, states), after_mode(job.spec))

    assert verdict(job, {1: done, 2: done}) == (Verdict.READY, "")
    assert verdict(job, {1: done, 2: running}) == (
        Verdict.WAIT,
        "waiting: after job 2 (running)",
    )
    assert verdict(job, {1: failed, 2: done}) == (Verdict.FAIL, "dependency 1 failed")
    assert verdict(job, {1: done, 2: cancelled}) == (
        Verdict.FAIL,
        "dependency 2 was cancelled",
    )
    assert verdict(job, {1: done}) == (Verdict.FAIL, "dependency 2 does not exist")
    anyway = record(6, after=["1", "2"], after_any=True)
    assert verdict(anyway, {1: failed, 2: cancelled}) == (Verdict.READY, "")
    assert verdict(anyway, {1: failed, 2: running})[0] is Verdict.WAIT
    one = record(7, after=["1", "2", "3"], after_one=True)
    assert verdict(one, {1: failed, 2: done, 3: running}) == (Verdict.READY, "")
    assert verdict(one, {1: failed, 2: running, 3: cancelled}) == (
        Verdict.WAIT,
        "waiting: until one of its dependencies succeeds (job 2: running)",
    )
    assert verdict(one, {2: failed, 3: cancelled}) == (
        Verdict.FAIL,
        "no dependency succeeded (dependency 1 does not exist)",
    )
    assert verdict(one, {1: cancelled, 2: failed, 3: failed}) == (
        Verdict.FAIL,
        "no dependency succeeded (dependency 1 was cancelled)",
    )


def test_a_job_waiting_on_a_dependency_is_not_shown_to_the_policy() -> None:
    policy = FixedPolicy({"1": (1, 0), "2": (0, 1)})
    jobs = [record(1), record(2, after=["7"])]
    plan = plan_round(policy, jobs, FOUR, ModelCache(), 1.0, RNG, states={7: JobState.RUNNING})
    assert [view.id for view in policy.seen_jobs] == ["1"]
    assert started(plan.actions) == [1]
    assert plan.reasons[2] == "waiting: after job 7 (running)"


def test_an_array_starts_no_more_than_its_max_running() -> None:
    tasks = [record(i, array_id="1", array_index=i, array_max_running=2) for i in range(1, 5)]
    tasks[0] = record(1, "running", placement={"a": ["cpu:0"]}, array_id="1", array_max_running=2)
    plan = plan_round(FifoPolicy(), tasks, FOUR, ModelCache(), 1.0, RNG)
    assert started(plan.actions) == [2]  # one already runs: one more, not three
    assert "array 1 has 2 tasks running, its --max-running is 2" in plan.reasons[3]


@pytest.mark.parametrize("cap", ["devices", "running"])
def test_a_user_at_a_cap_waits_and_others_start(cap: str) -> None:
    jobs = [record(i, owner="ann") for i in (1, 2, 3)] + [record(4, owner="bob")]
    limits = Limits(max_devices_per_user=2) if cap == "devices" else Limits(max_running_per_user=2)
    plan = plan_round(FifoPolicy(), jobs, FOUR, ModelCache(), 1.0, RNG, limits)
    assert started(plan.actions) == [1, 2, 4]
    assert f"max_{cap}_per_user" in plan.reasons[3] and "ann" in plan.reasons[3]


def test_an_elastic_job_is_trimmed_to_its_owners_device_cap() -> None:
    elastic = record(1, elastic=True, max_gpus=4, batch_size=32)
    policy = FixedPolicy({"1": (2, 2)})
    plan = plan_round(
        policy, [elastic], FOUR, ModelCache(), 1.0, RNG, Limits(max_devices_per_user=3)
    )
    (action,) = plan.actions
    assert sum(len(d) for d in action.allocation.values()) == 3
    assert policy.seen_jobs[0].max_replicas == 3  # the policy is told the cap too


def test_withheld_devices_are_not_offered_and_a_constraint_is_kept() -> None:
    nodes = [
        NodeInput("a", ("cpu:0", "cpu:1"), device_type="small", withheld=frozenset({"cpu:0"})),
        NodeInput("b", ("cpu:0", "cpu:1"), device_type="big"),
    ]
    assert nodes[0].free_devices == ("cpu:1",)
    from pollux_local.api.spec import Constraint

    on_big = record(1, constraint=Constraint(device_type="big"))
    view = job_view(job_input(on_big), nodes, 1.0)
    assert view.allowed_nodes == frozenset({1})
    # a policy that ignores the constraint gets the job kept off the other node
    plan = plan_round(FixedPolicy({"1": (1, 0)}), [on_big], nodes, ModelCache(), 1.0, RNG)
    assert plan.actions == ()
    plan = plan_round(FifoPolicy(), [on_big], nodes, ModelCache(), 1.0, RNG)
    (action,) = plan.actions
    assert action.allocation == {"b": ["cpu:0"]}


def test_a_time_limit_bounds_the_remaining_time_the_policy_sees() -> None:
    running = record(1, "running", placement={"a": ["cpu:0"]}, time_limit_s=600.0)
    view = job_view(job_input(running), FOUR, 100.0)  # started at 0: 100 s run
    assert view.time_left_s == pytest.approx(500.0)
    assert job_view(job_input(record(2)), FOUR, 100.0).time_left_s is None


def test_the_goodput_policy_takes_a_time_limit_as_a_bound_on_the_remaining_time() -> None:
    from pollux_local.core.policy import GoodputPolicy
    from pollux_local.core.types import JobView

    policy = GoodputPolicy()
    assert policy._remaining(JobView(id="1")) is None
    assert policy._remaining(JobView(id="1", time_left_s=50.0)) == 50.0
    halfway = JobView(id="1", progress_fraction=0.5, run_time_s=1000.0)
    estimate = policy._remaining(halfway)
    assert estimate is not None and estimate > 1000.0
    bounded = JobView(id="1", progress_fraction=0.5, run_time_s=1000.0, time_left_s=200.0)
    assert policy._remaining(bounded) == 200.0
