"""The downtime of each resize, measured by the daemon (``daemon/resizes.py``): the rules on
their own, then on a real daemon whose elastic job is resized by checkpoint-restart."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from pollux_local.api.report import JobReport
from pollux_local.daemon.resizes import KEPT, ResizeBook
from tests.daemon.test_e2e import CONFIG, TRAIN, Daemon, daemon_show
from tests.daemon_process import DaemonFactory
from tests.store_spy import count_job_loads


def report(progress: float, at: float | None = None) -> JobReport:
    return JobReport(progress=progress, time=at)


def test_a_resize_runs_from_the_ask_to_the_first_step_after() -> None:
    book = ResizeBook()
    book.begin(1, 100.0, report(10.0))
    assert book.reported(1, report(11.0, 101.0), 101.0) is None  # the old incarnation's step
    book.launched(1, 103.0, resizing=True, report=report(12.0))  # checkpointed at 12
    assert book.reported(1, report(12.0, 103.5), 103.5) is None  # no step since
    assert book.reported(1, report(13.0, 104.0), 104.2) == pytest.approx(4.0)
    assert book.costs(1).cold_s == pytest.approx(4.0) and book.costs(1).warm_s is None


def test_the_jobs_own_time_is_held_within_what_the_daemon_saw() -> None:
    book = ResizeBook()
    book.begin(1, 100.0, None)
    book.launched(1, 105.0, resizing=True)
    # a report claiming a step before its launch counts from the launch
    assert book.reported(1, report(1.0, 90.0), 106.0) == pytest.approx(5.0)
    book.begin(1, 200.0, report(1.0))
    book.launched(1, 202.0, resizing=True)
    # one claiming a step after it arrived counts to its arrival
    assert book.reported(1, report(2.0, 999.0), 203.0) == pytest.approx(3.0)


def test_warm_and_cold_have_their_own_medians_of_the_newest() -> None:
    book = ResizeBook()
    now = 0.0
    for downtime in [50.0] * 3 + [2.0, 3.0, 4.0] * 3:
        book.begin(7, now, report(now))
        book.launched(7, now + 1.0, resizing=True)
        book.reported(7, report(now + 1.0), now + downtime)
        now += 100.0
    book.begin(7, now, report(now), warm=True)
    book.launched(7, now, resizing=True)
    book.reported(7, report(now + 1.0), now + 0.4)
    costs = book.costs(7)
    assert costs.cold_count == KEPT and costs.cold_s == pytest.approx(3.0)  # the 50 s aged out
    assert costs.warm_count == 1 and costs.warm_s == pytest.approx(0.4)


def test_a_pass_is_given_the_costs_of_its_own_jobs_only() -> None:
    book = ResizeBook()
    for job_id in range(1, 6):  # five jobs measured, of which the pass holds two
        book.begin(job_id, 0.0, report(0.0))
        book.launched(job_id, 1.0, resizing=True)
        book.reported(job_id, report(1.0), float(job_id))
    costs = book.costs_of([2, 4, 9])
    assert sorted(costs) == [2, 4]  # (9: never measured)
    assert costs[4].cold_s == pytest.approx(4.0)


def test_a_warm_resize_ends_at_the_first_step_at_its_new_size() -> None:
    """The replicas that stay report steps of the old size until they act on the order:
    only a step at the new size ends a warm resize."""
    from pollux_local.api.report import ReportBatch

    def sized(progress: float, replicas: int, at: float) -> JobReport:
        return JobReport(
            progress=progress, time=at, batch=ReportBatch(local_batch=16, replicas=replicas)
        )

    book = ResizeBook()
    book.begin(3, 50.0, sized(5.0, 1, 49.0), warm=True)
    book.launched(3, 50.0, True, sized(5.0, 1, 49.0), replicas=2)
    assert book.reported(3, sized(6.0, 1, 50.2), 50.3) is None  # still one replica
    assert book.reported(3, sized(7.0, 2, 50.9), 51.0) == pytest.approx(0.9)
    assert book.costs(3).warm_count == 1 and book.costs(3).cold_count == 0


def test_a_resize_that_did_not_go_straight_to_its_new_size_is_not_measured() -> None:
    book = ResizeBook()
    book.begin(1, 0.0, report(1.0))
    book.launched(1, 300.0, resizing=False)  # it was queued meanwhile
    assert book.reported(1, report(2.0), 301.0) is None
    book.begin(2, 0.0, report(1.0))
    book.launched(2, 1.0, resizing=True)
    book.launched(2, 60.0, resizing=True)  # crashed before a step and was started again
    assert book.reported(2, report(2.0), 61.0) is None
    assert book.costs(1).cold_s is None and book.costs(2).cold_s is None


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_real_resize_is_measured_shown_and_given_to_the_policy(
    tmp_path: Path, daemon_factory: DaemonFactory
) -> None:
    """An elastic job on both CPU devices shrinks when a second job arrives: ``show`` gives
    the downtime the daemon measured, bounded by what its log says of the resize (the resize
    decision, then the new incarnation's first step, then the report read at a 1 s pass)."""
    (tmp_path / "train.py").write_text(TRAIN)
    daemon = Daemon(daemon_factory, CONFIG)
    daemon.start()
    first = daemon.submit(
        "--elastic", "--max-gpus", "2", "--batch-size", "64", "train.py", "400", "0.05"
    )
    daemon.wait_for(lambda j: j[first]["gpus"] == 2 and (j[first]["progress"] or 0) >= 5, 90)
    second = daemon.submit("--batch-size", "64", "train.py", "40", "0.05")

    def measured() -> dict[str, object]:
        return dict(json.loads(daemon.cli("show", first, "--json").stdout))

    daemon.wait_for(lambda _: measured()["job"]["resizes_cold"] >= 1, 120)  # type: ignore[index]
    show = measured()
    job = show["job"]
    assert isinstance(job, dict) and isinstance(show["decisions"], list)
    # the resize's decision is recorded as its new incarnation starts
    relaunched = next(d for d in show["decisions"] if d["kind"] == "resize")["time"]
    submitted = next(d for d in daemon_show(daemon, second) if d["kind"] == "submitted")["time"]
    log = daemon.cli("logs", first).stdout
    starts = [float(t) for t in re.findall(r"first step at ([0-9.]+)", log)]
    after = next(t for t in starts if t > relaunched)
    downtime = float(job["resize_cold_s"])
    # it was asked after the second job's submission and before the relaunch; it ended at
    # the new incarnation's first step, read within a pass (1 s) of it
    assert after - relaunched <= downtime <= after - submitted + 2.5, log
    assert job["resize_warm_s"] is None and job["resizes_warm"] == 0
    text = daemon.cli("show", first).stdout
    assert re.search(r"resize cost +\d+\.\d s \(median of \d+\) cold, not measured warm", text)
    daemon.cli("cancel", first, second)


def test_waiting_for_a_warm_resizes_first_step_reads_no_environment(tmp_path: Path) -> None:
    """The executor looks at a warm-resized job's report every 0.1 s until it steps at its new
    size, for up to ``warm_timeout_s`` (120 s), on the daemon's event loop.  It loaded the
    whole job each time, environment included: a job whose 4 MB environment holds 200,000
    variables cost 13 ms a look, some 13% of the event loop for each such resize for two
    minutes (its user's job need only never step at the new size; review s69).  The report
    is all it needs."""
    import asyncio
    from types import SimpleNamespace

    from pollux_local.api.states import JobState
    from pollux_local.daemon.executor.warm import Warm
    from pollux_local.daemon.state import StateStore

    store = StateStore(tmp_path / "s.db")
    env = {f"V{i}": "x" for i in range(20_000)}
    job = store.add_job(
        name="big", owner_uid=1001, owner_gid=1001, owner_name="a", priority=0,
        spec={"argv": ["python", "t.py"], "workdir": "/tmp"}, submit_time=0.0, env=env,
    )  # fmt: skip
    store.transition(job.id, JobState.RUNNING, 1.0, None, placement={"n": ["cpu:0"]})
    group = object()
    loads = count_job_loads(store)
    executor = SimpleNamespace(
        store=store, groups={job.id: group}, config=SimpleNamespace(warm_timeout_s=0.5)
    )

    async def wait(progress: float | None) -> bool:
        return await Warm._stepped_at(executor, job.id, group, 2, progress)  # type: ignore[arg-type]

    assert asyncio.run(wait(None)) is False  # no report: not confirmed, after the timeout
    store.update_job(job.id, report={"progress": 5.0, "batch": {"local_batch": 8, "replicas": 2}})
    assert asyncio.run(wait(1.0)) is True  # a step at the new size beyond the old progress
    assert loads == []  # the environment was never read for it
