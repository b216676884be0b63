"""Groups in the pure scheduling pass: a paused group's queued jobs wait (its running jobs go
on), a group at its ``max_running`` or ``max_devices`` holds its next job back with a reason
naming the group and the cap, stopping jobs count in their group, an elastic job is trimmed
to its group's device cap, a group the limits do not list caps nothing, and the forecast gives
a paused group's queued job no start."""

from __future__ import annotations

from pollux_local.core.baselines import FifoPolicy
from pollux_local.core.schedule import (
    ActionKind,
    GroupLimit,
    Holding,
    JobInput,
    Limits,
    Snapshot,
)
from pollux_local.core.schedule.admission import admit
from pollux_local.core.schedule.forecast import forecast
from tests.core.test_schedule_pass import TWO_NODES, Answers, run, running


def started(plan: object) -> list[int]:
    return sorted(
        a.job_id
        for a in plan.actions  # type: ignore[attr-defined]
        if a.kind is ActionKind.START
    )


def limits(**groups: GroupLimit) -> Limits:
    return Limits(groups=groups)


def test_a_paused_groups_queued_jobs_wait_and_its_running_jobs_go_on() -> None:
    jobs = [
        running(1, {"a": ["cpu:0"]}, group="exp"),
        JobInput(id=2, group="exp"),
        JobInput(id=3, group="other"),
        JobInput(id=4),
    ]
    plan = run(jobs, limits=limits(exp=GroupLimit(paused=True), other=GroupLimit()))
    assert started(plan) == [3, 4]
    assert plan.reasons[2] == "waiting: group exp is paused"
    assert not [a for a in plan.actions if a.job_id == 1]  # not stopped, not resized
    assert 1 in plan.unchanged
    resumed = run(jobs, limits=limits(exp=GroupLimit(paused=False)))
    assert 2 in started(resumed)


def test_a_group_at_its_max_running_holds_its_next_job_back() -> None:
    jobs = [JobInput(id=i, group="exp") for i in (1, 2, 3)] + [JobInput(id=4, owner="bob")]
    plan = run(jobs, limits=limits(exp=GroupLimit(max_running=2)))
    assert started(plan) == [1, 2, 4]
    assert plan.reasons[3] == "waiting: group exp has 2 jobs running, its max_running is 2"


def test_a_group_at_its_max_devices_holds_its_next_job_back() -> None:
    jobs = [
        running(1, {"a": ["cpu:0", "cpu:1"]}, group="exp", min_devices=2, elastic=False),
        JobInput(id=2, group="exp", min_devices=2, elastic=False),
        JobInput(id=3, group="exp", elastic=False),
    ]
    plan = run(jobs, limits=limits(exp=GroupLimit(max_devices=3)))
    assert started(plan) == [3]  # 2 + 2 > 3 waits; 2 + 1 fits
    assert plan.reasons[2] == (
        "waiting: group exp's jobs hold 2 devices, this job needs 2 more, its max_devices is 3"
    )


def test_a_stopping_jobs_devices_count_in_its_group() -> None:
    stop = Holding(job_id=9, owner="ann", devices={"a": ["cpu:0", "cpu:1"]}, group="exp")
    jobs = [JobInput(id=2, group="exp"), JobInput(id=3, group="exp", owner="bob")]
    admitted, waiting = admit(jobs, limits(exp=GroupLimit(max_devices=2)), [stop])
    assert admitted == []
    assert waiting[2] == (
        "waiting: group exp's jobs hold 2 devices (job(s) 9 still stopping), this job needs"
        " 1 more, its max_devices is 2"
    )
    admitted, waiting = admit(jobs, limits(exp=GroupLimit(max_running=2)), [stop])
    assert [job.id for job in admitted] == [2]
    assert "group exp has 2 jobs running (job(s) 9 still stopping)" in waiting[3]


def test_an_elastic_job_is_trimmed_to_its_groups_device_cap() -> None:
    elastic = JobInput(id=1, group="exp", elastic=True, max_devices=4, batch_size=32)
    policy = Answers({"1": (2, 2)})
    plan = run([elastic], policy, limits=limits(exp=GroupLimit(max_devices=3)))
    (action,) = plan.actions
    assert sum(len(d) for d in action.allocation.values()) == 3


def test_a_group_the_limits_do_not_list_caps_nothing() -> None:
    jobs = [JobInput(id=i, group="gone") for i in (1, 2, 3, 4)]
    assert started(run(jobs, limits=limits(exp=GroupLimit(max_running=1)))) == [1, 2, 3, 4]


def test_the_group_reason_comes_before_the_owners_cap() -> None:
    jobs = [running(1, {"a": ["cpu:0"]}), JobInput(id=2, group="exp")]
    both = Limits(max_running_per_user=1, groups={"exp": GroupLimit(paused=True)})
    assert run(jobs, limits=both).reasons[2] == "waiting: group exp is paused"
    jobs = [running(1, {"a": ["cpu:0"]}), JobInput(id=2, group="exp")]
    free = Limits(max_running_per_user=1, groups={"exp": GroupLimit()})
    assert "max_running_per_user" in run(jobs, limits=free).reasons[2]


def test_the_forecast_gives_a_paused_groups_queued_job_no_start() -> None:
    jobs = [JobInput(id=1, group="exp"), JobInput(id=2), running(3, {"a": ["cpu:0"]})]
    paused = Snapshot(
        jobs=jobs, nodes=TWO_NODES, now=0.0, limits=limits(exp=GroupLimit(paused=True))
    )
    predictions, reasons = forecast(paused, FifoPolicy(), {1: 60.0, 2: 60.0, 3: 30.0})
    assert predictions[1].start is None and predictions[1].finish is None
    assert predictions[2].start == 0.0
    assert reasons[1] == "waiting: group exp is paused"
    open_ = Snapshot(jobs=jobs, nodes=TWO_NODES, now=0.0, limits=limits(exp=GroupLimit()))
    predictions, _ = forecast(open_, FifoPolicy(), {1: 60.0, 2: 60.0, 3: 30.0})
    assert predictions[1].start == 0.0
