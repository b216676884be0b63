"""How the CLI shows a forecast that is an upper bound (it rests on a job of unknown length run
until its time limit): ``status``'s START says ``within``, ``show`` and ``estimate`` say ``by
... at the latest``, and ``--json`` carries the marks; an expectation reads as before."""

from __future__ import annotations

import datetime
import json
import time

import pytest

from pollux_local.api.messages import EstimateReply, JobForecast, StatusReply
from pollux_local.api.states import JobState
from pollux_local.cli.common import print_json
from pollux_local.cli.estimate import forecast_line, print_estimate
from pollux_local.cli.format import status_table, timestamp
from pollux_local.cli.query import forecast_lines
from tests.cli.test_lab import summary


def clock(stamp: float) -> str:
    return datetime.datetime.fromtimestamp(stamp).strftime("%H:%M:%S")


def test_status_start_is_within_a_bound_and_in_an_expectation() -> None:
    now = time.time()
    bound = summary("7", JobState.QUEUED, expected_start=now + 7230.0,
                    expected_start_at_latest=True)  # fmt: skip
    expected = summary("8", JobState.QUEUED, expected_start=now + 7230.0)
    rows = {line.split()[0]: line for line in status_table([bound, expected]).splitlines()}
    assert "within 2h00m" in rows["7"] and " in 2h00m" not in rows["7"]
    assert " in 2h00m" in rows["8"] and "within" not in rows["8"]


def test_show_says_by_when_at_the_latest() -> None:
    start, finish = 1_800_000_000.0, 1_800_003_600.0
    queued = summary("7", JobState.QUEUED, expected_start=start, expected_finish=finish,
                     expected_start_at_latest=True, expected_finish_at_latest=True,
                     expected_devices=1)  # fmt: skip
    (line,) = forecast_lines(queued)
    assert line == (
        f"  expected    start by {timestamp(start)} at the latest  "
        f"finish by {timestamp(finish)} at the latest  on 1 device(s)"
    )
    # a running job of unknown length under its limit: its finish alone is a bound
    running = summary("8", JobState.RUNNING, expected_finish=finish,
                      expected_finish_at_latest=True)  # fmt: skip
    assert forecast_lines(running) == [f"  expected    finish by {timestamp(finish)} at the latest"]
    plain = summary("9", JobState.QUEUED, expected_start=start, expected_finish=finish)
    assert forecast_lines(plain) == [
        f"  expected    start {timestamp(start)}  finish {timestamp(finish)}"
    ]


def forecast(**fields: object) -> JobForecast:
    base: dict[str, object] = dict(name="train.py", start=None, finish=None, devices=1,
                                   device_type="cpu", waiting="", length_s=None)  # fmt: skip
    base.update(fields)
    return JobForecast(**base)  # type: ignore[arg-type]


def test_estimate_says_by_when_at_the_latest(capsys: pytest.CaptureFixture[str]) -> None:
    now = 1_800_000_000.0
    job = forecast(start=now + 725.0, finish=now + 725.0 + 7200.0, start_at_latest=True,
                   finish_at_latest=True)  # fmt: skip
    assert forecast_line(job, now) == (
        f"train.py: starts by {clock(now + 725.0)} at the latest (in 12m05s), "
        f"finishes by {clock(now + 7925.0)} at the latest (in 2h12m), on 1 device (cpu), "
        "runs at most 2h00m (its time limit)"
    )
    # no finish, no length: nothing to bound it
    unbounded = forecast(start=now + 725.0)
    assert forecast_line(unbounded, now).endswith("expected to run unknown")
    # the job's own limit bounds its finish; its start is expected
    mixed = forecast(start=now + 725.0, finish=now + 7925.0, finish_at_latest=True)
    assert forecast_line(mixed, now).startswith(
        f"train.py: starts in 12m05s ({clock(now + 725.0)}), "
        f"finishes by {clock(now + 7925.0)} at the latest (in 2h12m)"
    )
    print_estimate(EstimateReply(now=now, jobs=[job]), as_json=True)
    (said,) = json.loads(capsys.readouterr().out)["jobs"]
    assert said["start_at_latest"] is True and said["finish_at_latest"] is True


def test_status_json_carries_the_marks(capsys: pytest.CaptureFixture[str]) -> None:
    job = summary("7", JobState.QUEUED, expected_start=1.0, expected_start_at_latest=True)
    print_json(StatusReply(jobs=[job]))
    (said,) = json.loads(capsys.readouterr().out)["jobs"]
    assert said["expected_start_at_latest"] is True
    assert said["expected_finish_at_latest"] is False
