"""What one user's queue makes every scheduling pass do, counted (not timed): a job's
thousand ``--after`` ids are summarised once a pass and the forecast touches only the
dependents of the jobs that end; a kind's pool changing refits only the jobs whose merged
points changed, identical points share one fit and one owner's fits per pass are bounded; a
kind is a fixed-size key and ``Durations`` keeps a bounded number of kinds per owner.
``docs/benchmarks.md`` has the timings these counts stand for."""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pollux_local.api.states import JobState
from pollux_local.core.baselines import FifoPolicy
from pollux_local.core.schedule import (
    AfterMode,
    Dependency,
    JobInput,
    Limits,
    NodeInput,
    Outcome,
    Snapshot,
    Verdict,
    dependency_verdict,
)
from pollux_local.core.schedule.forecast import forecast
from pollux_local.daemon import commands, scheduler
from pollux_local.daemon.config import DaemonConfig, NodeConfig
from pollux_local.daemon.forecasting import KINDS_PER_OWNER, Durations, Forecasts
from pollux_local.daemon.jobrules import check_job
from pollux_local.daemon.scheduler import (
    FITS_PER_OWNER,
    ModelCache,
    after_mode,
    dependencies_of,
    job_kind,
    plan_round,
)
from pollux_local.daemon.state import JobRecord
from tests.daemon.test_report_models import job, report

RNG = np.random.default_rng(0)
NODES = [NodeInput("a", ("cpu:0", "cpu:1"))]


def queued(job_id: int, owner: int = 1000, **spec: object) -> JobRecord:
    return JobRecord(
        id=job_id, name=f"j{job_id}", owner_uid=owner, owner_gid=owner, owner_name=f"u{owner}",
        state=JobState.QUEUED, spec={"argv": ["x"], "workdir": "/", "elastic": False, **spec},
        submit_time=float(job_id),
    )  # fmt: skip


# --- dependencies ------------------------------------------------------------------------


def test_a_thousand_ids_per_job_cost_a_pass_a_few_objects_per_job(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """alice's queue: jobs each after one held job and a thousand cancelled ones (``after_any``).
    Each pass built a ``Dependency`` per id and per job several times (plan, forecast): 28 s
    a pass at 999 jobs; now one or two per job."""
    made = 0

    class Counted(Dependency):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            nonlocal made
            made += 1
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(scheduler, "Dependency", Counted)
    held, cancelled = 1, list(range(2, 1002))
    states = {held: JobState.HELD, **dict.fromkeys(cancelled, JobState.CANCELLED)}
    after = [str(held), *map(str, cancelled)]
    jobs = [queued(i, after=after, after_any=True) for i in range(2000, 2040)]
    plan = plan_round(FifoPolicy(), jobs, NODES, ModelCache(), 1.0, RNG, states=states)
    forecasts = Forecasts()
    forecasts.update(FifoPolicy(), jobs, NODES, ModelCache(), Limits(), 1.0, states=states)
    assert plan.reasons[2000] == f"waiting: after job {held} (held)"
    assert made <= 2 * 2 * len(jobs)  # was 2 x 40 x 1001


def counting(tally: list[int], ids: tuple[Dependency, ...]) -> tuple[Dependency, ...]:
    class Counted(tuple):  # type: ignore[type-arg]
        def __iter__(self) -> Iterator[Dependency]:
            for dep in super().__iter__():
                tally[0] += 1
                yield dep

    return Counted(ids)


def test_the_forecast_touches_only_the_dependents_of_the_jobs_that_end() -> None:
    """Each replayed step looked through every job's whole list for the jobs that ended (15 s
    at 999 jobs x 1000 ids, 12 steps); now each list is read once a forecast."""
    tally = [0]
    running = [
        JobInput(id=i, allocation={"a": [f"cpu:{i - 1}"]}, last_start=0.0, elastic=False)
        for i in (1, 2, 3, 4)
    ]
    never = tuple(Dependency(j, Outcome.PENDING, "held") for j in range(5000, 5200))
    enders = tuple(Dependency(i, Outcome.PENDING, "running") for i in (1, 2, 3, 4))
    waiting = [
        JobInput(id=i, submit_time=float(i), elastic=False,
                 after=counting(tally, never + enders), after_mode=AfterMode.ALL_ENDED)
        for i in range(100, 200)
    ]  # fmt: skip
    nodes = [NodeInput("a", ("cpu:0", "cpu:1", "cpu:2", "cpu:3"))]
    lengths = {1: 1.0, 2: 2.0, 3: 3.0, 4: 4.0}
    found, reasons = forecast(
        Snapshot(jobs=[*running, *waiting], nodes=nodes, now=0.0), FifoPolicy(), lengths
    )
    assert found[4].finish == 4.0 and found[150].start is None
    assert reasons[100] == "waiting: after job 5000 (held)"
    assert tally[0] <= 1.5 * len(waiting) * (len(never) + len(enders))  # was 5 times that


def test_a_dependency_ending_in_the_replay_lets_a_compact_dependent_start() -> None:
    """The daemon's summary (the first dependency not met, one that fails the job whatever
    ends, the pending ids between): the dependent starts once every one of them ended in the
    replay, not before; one that fails it keeps it waiting."""
    running = [
        JobInput(id=i, allocation={"a": [f"cpu:{i - 1}"]}, last_start=0.0, elastic=False)
        for i in (1, 2)
    ]
    dependent = JobInput(
        id=10, elastic=False, after=(Dependency(1, Outcome.PENDING, "running"),),
        after_pending=(2,),
    )  # fmt: skip
    found, reasons = forecast(
        Snapshot(jobs=[*running, dependent], nodes=NODES, now=0.0),
        FifoPolicy(), {1: 5.0, 2: 8.0, 10: 1.0},
    )  # fmt: skip
    assert found[10].start == 8.0
    assert reasons[10] == "waiting: after job 1 (running)"
    first, failed = Dependency(1, Outcome.PENDING, "running"), Dependency(9, Outcome.FAILED, "x")
    assert dependency_verdict((first, failed), AfterMode.ALL_SUCCEEDED, (2,)) == (
        Verdict.WAIT, "waiting: after job 1 (running)",
    )  # fmt: skip
    done = Dependency(1, Outcome.SUCCEEDED, "succeeded")
    assert dependency_verdict((done, failed), AfterMode.ALL_SUCCEEDED, ())[0] is Verdict.FAIL
    assert dependency_verdict((done,), AfterMode.ALL_SUCCEEDED, (2,)) == (
        Verdict.WAIT,
        "waiting: after job 2",
    )


def test_a_job_after_one_of_its_dependencies_is_forecast_to_start_at_the_first_end() -> None:
    """After one of jobs 1 and 2 (ending at 8 s and 5 s): the replay starts it at 5 s, when
    the first of them ends; one that already succeeded lets it start now; and the daemon's
    summary of its list forecasts the same start as the whole list."""
    running = [
        JobInput(id=i, allocation={"a": [f"cpu:{i - 1}"]}, last_start=0.0, elastic=False)
        for i in (1, 2)
    ]
    whole = JobInput(
        id=10, elastic=False, after_mode=AfterMode.ONE_SUCCEEDED,
        after=(Dependency(1, Outcome.PENDING, "running"), Dependency(2, Outcome.PENDING, "running")),
    )  # fmt: skip
    record = queued(10, after=["1", "2"], after_one=True)
    states = {1: JobState.RUNNING, 2: JobState.RUNNING}
    summary = scheduler.DependencyStates(states).summary(record)
    summarised = replace(whole, after=summary.after, after_pending=summary.pending)
    for dependent in (whole, summarised):
        found, reasons = forecast(
            Snapshot(jobs=[*running, dependent], nodes=NODES, now=0.0),
            FifoPolicy(), {1: 8.0, 2: 5.0, 10: 1.0},
        )  # fmt: skip
        assert found[10].start == 5.0
        assert reasons[10] == ("waiting: until one of its dependencies succeeds (job 1: running)")
    failed_one = replace(whole, after=(Dependency(1, Outcome.FAILED, "failed"), whole.after[1]))
    found, _ = forecast(
        Snapshot(jobs=[running[1], failed_one], nodes=NODES, now=0.0),
        FifoPolicy(), {2: 5.0, 10: 1.0},
    )  # fmt: skip
    assert found[10].start == 5.0  # one failing does not fail it: the other may succeed
    done = replace(whole, after=(Dependency(1, Outcome.SUCCEEDED, "succeeded"), whole.after[1]))
    found, _ = forecast(
        Snapshot(jobs=[running[1], done], nodes=NODES, now=0.0),
        FifoPolicy(), {2: 5.0, 10: 1.0},
    )  # fmt: skip
    assert found[10].start == 0.0


def test_a_job_after_one_of_many_is_made_ready_once_in_a_forecast(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A job after one of a thousand jobs is watched under each: each of them that ended in
    the replay made its ready copy again (one ``replace`` a dependency ended and a
    dependent), half of a forecast of a thousand such jobs; now once a job."""
    from pollux_local.core.schedule import forecast as module

    made = [0]

    def counted(obj: Any, /, **changes: Any) -> Any:
        if changes.keys() == {"after", "after_pending"}:
            made[0] += 1
        return replace(obj, **changes)

    monkeypatch.setattr(module, "replace", counted)
    nodes = [NodeInput("a", tuple(f"cpu:{i}" for i in range(8)))]
    running = [
        JobInput(id=i, allocation={"a": [f"cpu:{i - 1}"]}, last_start=0.0, elastic=False)
        for i in range(1, 9)
    ]
    waiting = [
        JobInput(id=i, submit_time=float(i), elastic=False, after_mode=AfterMode.ONE_SUCCEEDED,
                 after=(Dependency(1, Outcome.PENDING, "running"),), after_pending=tuple(range(2, 9)))
        for i in range(100, 150)
    ]  # fmt: skip
    lengths = {i: float(i) for i in range(1, 9)}
    found, _ = forecast(
        Snapshot(jobs=[*running, *waiting], nodes=nodes, now=0.0), FifoPolicy(), lengths
    )
    assert found[100].start == 1.0
    assert made[0] == len(waiting)  # was 400: 8 dependencies ended x 50


def old_resolve(jobs: list[JobRecord], states: dict[int, JobState]) -> list[tuple[int, str]]:
    """The loop's resolution before: every job scanned again until none fails."""
    failed = []
    changed = True
    while changed:
        changed = False
        for record in jobs:
            if record.state is JobState.FAILED:
                continue
            verdict, why = dependency_verdict(
                dependencies_of(record, states), after_mode(record.spec)
            )
            if verdict is not Verdict.FAIL:
                continue
            failed.append((record.id, why))
            record.state = JobState.FAILED
            if record.id in states:
                states[record.id] = JobState.FAILED
            changed = True
    return failed


@pytest.mark.parametrize("seed", range(20))
def test_resolving_dependencies_fails_the_same_jobs_with_the_same_reasons(seed: int) -> None:
    rnd = random.Random(seed)
    ended = {i: rnd.choice(list(JobState)) for i in range(1, 30)}
    jobs: list[JobRecord] = []
    for i in range(30, 90):
        named = rnd.sample(range(1, i), rnd.randint(1, 6)) + [999] * (rnd.random() < 0.05)
        state = JobState.HELD if rnd.random() < 0.2 else JobState.QUEUED
        mode = rnd.choice(["after", "after_any", "after_one"])
        flags = {"after_any": mode == "after_any", "after_one": mode == "after_one"}
        record = queued(i, after=[str(d) for d in named], **flags)
        record.state = state
        jobs.append(record)
    wanted = {int(d) for job in jobs for d in job.spec.after}
    states = {i: s for i, s in {**ended, **{j.id: j.state for j in jobs}}.items() if i in wanted}
    expected_states = dict(states)
    expected = old_resolve([_copy(j) for j in jobs], expected_states)
    summaries, failures = scheduler.resolve_dependencies(jobs, states)
    assert [(record.id, why) for record, why in failures] == expected
    assert states == expected_states
    for record in jobs:
        if record.id in summaries:
            mode = after_mode(record.spec)
            assert summaries[record.id].verdict(mode) == dependency_verdict(
                dependencies_of(record, states), mode
            )


def _copy(record: JobRecord) -> JobRecord:
    spec = record.spec
    copy = queued(
        record.id, after=list(spec.after), after_any=spec.after_any, after_one=spec.after_one
    )
    copy.state = record.state
    return copy


# --- fits --------------------------------------------------------------------------------

CONFIGS = [(1, k, m) for k in (1, 2, 4) for m in (16, 32, 64, 128)]


def measured(scale: float, extra: float = 2.0) -> list[tuple[int, int, int, float]]:
    rows = [(n, k, m, 0.001 * m * scale + 0.01 * k) for n, k, m in CONFIGS]
    return [*rows, (1, 1, 512, extra)]


def test_one_jobs_new_report_refits_only_the_jobs_whose_points_changed() -> None:
    """alice's 1000 queued jobs of one kind, each measured everywhere (its own points are its
    whole model), and one job re-reporting every 0.6 s: each re-report changed the kind's
    pool and refitted all 1000 (25-50 s a pass); now only the job whose points changed."""
    jobs = [job(i, owner=2001, state="queued") for i in range(1, 31)]
    for i, record in enumerate(jobs):
        record.report = report(measured(1 + 1e-3 * i))
    cache = ModelCache()
    for _ in range(6):  # the first fits, spread over passes by the budget
        plan_round(FifoPolicy(), jobs, NODES, cache, 1.0, RNG)
    assert cache.fit_count == len(jobs)
    for extra in (2.001, 2.002, 2.003):
        jobs[0].report = report(measured(1.0, extra))
        before = cache.fit_count
        plan_round(FifoPolicy(), jobs, NODES, cache, 1.0, RNG)
        assert cache.fit_count - before == 1  # was 30


def test_jobs_with_the_same_merged_points_share_one_fit() -> None:
    jobs = [job(i, owner=2001, state="queued") for i in range(1, 41)]
    for record in jobs:
        record.report = report(measured(1.0))
    cache = ModelCache()
    plan_round(FifoPolicy(), jobs, NODES, cache, 1.0, RNG)
    assert cache.fit_count == 1  # was 40
    assert all(cache.model_for(record) is not None for record in jobs)


def test_one_owners_fits_per_pass_are_bounded_and_reach_every_job_in_turn() -> None:
    """Jobs measuring one configuration each, over a pool a job keeps adding to: every pass
    changes every job's merged points.  At most ``FITS_PER_OWNER`` fits run for that owner
    a pass (the others keep their older model meanwhile), another owner's job is fitted in
    the same pass, and every job is fitted in turn."""
    jobs = [job(i, owner=2001, state="queued") for i in range(1, 41)]
    for i, record in enumerate(jobs):
        record.report = report([(1, 1, 32, 0.05 + 1e-4 * i), (1, 2, 32, 0.06)])
    bob = job(100, owner=2002, state="queued", argv=["bob.py"])
    bob.report = report([(1, 1, 32, 0.05), (1, 2, 32, 0.06)])
    cache = ModelCache()
    for _ in range(6):
        plan_round(FifoPolicy(), jobs, NODES, cache, 1.0, RNG)
    models = {record.id: cache.model_for(record) for record in jobs}
    assert all(model is not None for model in models.values())
    for step in range(6):
        jobs[0].report = report([(1, 1, 32, 0.05), (1, 2, 32, 0.06), (1, 4, 32 + step, 0.07)])
        bob.report = report([(1, 1, 32, 0.05), (1, 2, 32, 0.06), (1, 4, 32 + step, 0.07)])
        before = cache.fit_count
        plan_round(FifoPolicy(), [*jobs, bob], NODES, cache, 1.0, RNG)
        assert cache.fit_count - before <= FITS_PER_OWNER + 1  # was 41
        assert cache.model_for(bob) is not None
    refitted = {
        record.id for record in jobs
        if cache.model_for(record).params is not models[record.id].params  # type: ignore[union-attr]
    }  # fmt: skip
    assert len(refitted) == len(jobs)  # every job got a newer model within those passes


def test_a_job_that_cannot_start_this_pass_is_not_fitted() -> None:
    later = job(1, owner=2001, state="queued", begin_at=1e9)
    later.report = report(measured(1.0))
    cache = ModelCache()
    plan_round(FifoPolicy(), [later], NODES, cache, 1.0, RNG)
    assert cache.fit_count == 0  # was 1
    plan_round(FifoPolicy(), [later], NODES, cache, 2e9, RNG)  # its --begin has come
    assert cache.fit_count == 1


# --- kinds -------------------------------------------------------------------------------


def test_a_kind_is_a_fixed_size_key_however_long_the_command() -> None:
    huge = job(1, owner=2001, argv=["python", "\u00e9" * 1_000_000])
    other = job(2, owner=2001, argv=["python", "\u00e9" * 999_999])
    assert len(job_kind(huge)) == 64 and job_kind(huge) != job_kind(other)
    huge.report = report(measured(1.0))
    cache = ModelCache()
    cache.model_for(huge)
    assert all(len(kind) <= 64 for kind in cache.pool(2001).kinds())


def test_a_commands_digest_is_made_once_not_once_a_job_and_pass() -> None:
    """alice's 300 queued tasks share one command of 3.7 MB of two-byte characters (stored
    once).  Each pass digested it, as escaped JSON, for every job in the plan and again in
    the forecast: 36 ms a job, 200 such tasks held every pass (and the mutex, and so another
    user's start, release and hold) for 15 s or more.  Now once, and its size (checked for
    each task of a submit, and for each new job at its first pass) with it; a command the
    memory let go, or another one, is worked out again, with the same kind as before."""
    argv = ["/bin/true", *["\u00e9" * 62_000] * 30]
    jobs = [queued(i, argv=list(argv)) for i in range(1, 301)]
    facts = commands.CommandFacts()
    kind = job_kind(jobs[0])
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(commands, "FACTS", facts)
        for _ in range(3):
            plan_round(FifoPolicy(), jobs, NODES, ModelCache(), 1.0, RNG)
            Forecasts().update(FifoPolicy(), jobs, NODES, ModelCache(), Limits(), 1.0)
        config = DaemonConfig(nodes=(NodeConfig("a", ("cpu:0", "cpu:1")),))
        for job in jobs:
            check_job(job.spec, config)
        assert facts.made == 1
        assert commands.command_bytes(argv) == 9 + 1 + 30 * (124_000 + 1)
        assert {job_kind(job) for job in jobs} == {kind}
        small = commands.CommandFacts(limit_bytes=10)
        patch.setattr(commands, "FACTS", small)
        for other in (["python", "a.py"], argv, ["python", "a.py"]):
            job_kind(queued(1, argv=other))
        assert small.made == 3  # over its room, the least recently used went
        assert job_kind(jobs[0]) == kind and job_kind(queued(1, argv=["x", "y"])) != kind


def test_durations_keep_a_bounded_number_of_kinds_per_owner() -> None:
    durations = Durations()
    for i in range(KINDS_PER_OWNER + 50):
        done = job(i, owner=2001, argv=["python", f"t{i}.py"], state="succeeded")
        done.run_time_s = 10.0 + i
        durations.note(done)
    bobs = job(10_000, owner=2002, state="succeeded")
    bobs.run_time_s = 5.0
    durations.note(bobs)
    assert durations.kinds(2001) == KINDS_PER_OWNER and durations.kinds(2002) == 1
    newest = KINDS_PER_OWNER + 49
    assert durations.typical(job(0, owner=2001, argv=["python", f"t{newest}.py"])) == 10.0 + newest
    assert durations.typical(job(0, owner=2001, argv=["python", "t0.py"])) is None  # forgotten
    assert durations.typical(job(0, owner=2002)) == 5.0


@pytest.mark.asyncio
async def test_a_jobs_metric_points_are_kept_while_it_runs_only(tmp_path: Path) -> None:
    """The target metric's points (the ETA's trend) of a job that no longer runs are
    forgotten by the next pass: every job that ever reported kept about 900 bytes until the
    daemon stopped, and one user's held arrays grew the daemon by 65 MB an hour."""
    from pollux_local.api.report import JobReport
    from pollux_local.api.spec import Target
    from tests.scheduler_harness import Harness

    h = Harness(tmp_path, [2], FifoPolicy())
    ids = [h.submit(target=Target(metric="acc", value=0.9, mode="max")) for _ in range(2)]
    await h.tick()
    for job_id in ids:
        assert h.job(job_id).state == JobState.RUNNING
        h.loop.metrics.note(h.job(job_id), JobReport(metrics={"acc": 0.5}, time=1.0), 1.0)
    await h.tick(1.0)
    assert len(h.loop.metrics) == 2
    await h.finish(ids[0])
    await h.tick(1.0)
    assert len(h.loop.metrics) == 1  # the running one's points stay
