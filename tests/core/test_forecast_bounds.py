"""Worst cases in the forecast (``core.schedule.forecast``): a job whose length is unknown but
whose time limit bounds it is replayed until its limit, its finish is marked "at the latest",
and so are the start and finish of a job that starts after that worst-case end; a job that
starts before it, and a run that began before it, are not marked."""

from __future__ import annotations

import pytest

from pollux_local.core.baselines import FifoPolicy
from pollux_local.core.schedule import JobInput, JobPhase, NodeInput, Snapshot
from pollux_local.core.schedule.forecast import EXACT_STEPS, forecast

ONE = [NodeInput("n", ("cpu:0",), device_type="cpu")]
TWO = [NodeInput("n", ("cpu:0", "cpu:1"), device_type="cpu")]


def rigid(job_id: int, submitted: float = 0.0, **fields: object) -> JobInput:
    return JobInput(id=job_id, submit_time=submitted, elastic=False, **fields)  # type: ignore[arg-type]


def running(job_id: int, device: str, since: float = 0.0, **fields: object) -> JobInput:
    return rigid(
        job_id,
        phase=JobPhase.RUNNING,
        allocation={"n": [device]},
        last_start=since,
        restarts=1,
        **fields,
    )


@pytest.mark.parametrize("exact_steps", [1, EXACT_STEPS])  # the tail, and the replayed passes
def test_a_bounded_jobs_finish_and_the_job_behind_it_are_at_the_latest(exact_steps: int) -> None:
    # job 1 has run 600 s of its 1 h limit, its length unknown: it runs until 3600 at worst
    jobs = [
        running(1, "cpu:0", time_limit_s=3600.0),
        rigid(2, submitted=1.0),
        rigid(3, submitted=2.0),
    ]
    found, _ = forecast(
        Snapshot(jobs=jobs, nodes=ONE, now=600.0), FifoPolicy(), {1: None, 2: 50.0, 3: 20.0},
        exact_steps=exact_steps,
    )  # fmt: skip
    one, two, three = found[1], found[2], found[3]
    assert (one.start, one.finish) == (0.0, 3600.0)
    assert one.finish_at_latest and not one.start_at_latest  # its start is a fact
    assert (two.start, two.finish) == (3600.0, 3650.0)
    assert two.start_at_latest and two.finish_at_latest
    assert (three.start, three.finish) == (3650.0, 3670.0)
    assert three.start_at_latest and three.finish_at_latest


@pytest.mark.parametrize("exact_steps", [1, EXACT_STEPS])
def test_what_does_not_wait_behind_a_worst_case_is_not_marked(exact_steps: int) -> None:
    # cpu:0: job 1 until its limit, 3600 at worst; cpu:1: job 2 ends at 700, then job 3
    # (700-750), then job 4 (750-5750: a run that began before 3600, its finish expected),
    # and job 5 waits for the first device free after that: cpu:0 at 3600
    jobs = [
        running(1, "cpu:0", time_limit_s=3600.0),
        running(2, "cpu:1"),
        rigid(3, submitted=1.0),
        rigid(4, submitted=2.0),
        rigid(5, submitted=3.0),
    ]
    remaining = {1: None, 2: 100.0, 3: 50.0, 4: 5000.0, 5: 10.0}
    found, _ = forecast(
        Snapshot(jobs=jobs, nodes=TWO, now=600.0), FifoPolicy(), remaining,
        exact_steps=exact_steps,
    )  # fmt: skip
    assert found[1].finish == 3600.0 and found[1].finish_at_latest
    assert found[2].finish == 700.0 and not found[2].finish_at_latest
    assert (found[3].start, found[3].finish) == (700.0, 750.0)
    assert not found[3].start_at_latest and not found[3].finish_at_latest
    assert (found[4].start, found[4].finish) == (750.0, 5750.0)
    assert not found[4].start_at_latest and not found[4].finish_at_latest
    assert (found[5].start, found[5].finish) == (3600.0, 3610.0)
    assert found[5].start_at_latest and found[5].finish_at_latest


def test_a_queued_job_of_unknown_length_runs_until_its_time_left() -> None:
    # ran 100 s of a 600 s limit before: 500 s left at worst; it starts at once, a fact
    jobs = [rigid(1, time_limit_s=600.0, run_time_s=100.0)]
    found, _ = forecast(Snapshot(jobs=jobs, nodes=ONE, now=50.0), FifoPolicy(), {})
    assert (found[1].start, found[1].finish) == (50.0, 550.0)
    assert not found[1].start_at_latest and found[1].finish_at_latest


def test_a_known_length_or_no_limit_is_no_worst_case() -> None:
    jobs = [running(1, "cpu:0", time_limit_s=3600.0), rigid(2, submitted=1.0)]
    found, _ = forecast(Snapshot(jobs=jobs, nodes=ONE, now=600.0), FifoPolicy(), {1: 100.0, 2: 5.0})
    assert found[1].finish == 700.0 and found[2].start == 700.0
    assert not any(p.start_at_latest or p.finish_at_latest for p in found.values())
    # no limit and no length: unknown, as before, and nothing is marked
    jobs = [running(1, "cpu:0"), rigid(2, submitted=1.0)]
    found, _ = forecast(Snapshot(jobs=jobs, nodes=ONE, now=600.0), FifoPolicy(), {2: 5.0})
    assert found[1].finish is None and found[2].start is None
    assert not any(p.start_at_latest or p.finish_at_latest for p in found.values())
