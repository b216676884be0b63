"""Pilot tests: drive the app with keys against a real daemon's recorded replies.

The recording (``fixtures/daemon_replies.json``) holds seven jobs on one node with two CPU
devices: 1 tabular-mlp (succeeded), 2 preprocess (failed), 3 steady-a and 4 steady-b (running,
one device each), 5 on-hold (held), 6 mistake (cancelled), 7 wide (queued, needs both devices).
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from textual.widgets import Input

from pollux_local import api
from pollux_local.tui.recording import Recording
from pollux_local.tui.screens.confirm import ConfirmScreen
from pollux_local.tui.screens.help import HelpScreen
from pollux_local.tui.screens.job_detail import JobScreen
from pollux_local.tui.screens.logs import LogScreen
from pollux_local.tui.screens.priority import PriorityScreen
from pollux_local.tui.screens.submit import SubmitScreen
from pollux_local.tui.source import FixedSource
from pollux_local.tui.widgets.device_grid import DeviceGrid
from pollux_local.tui.widgets.job_table import JobTable
from pollux_local.tui.widgets.plot_view import PlotView

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(60)]
SIZE = (120, 40)
#: From the first row (job 1) to the running job steady-a (job 3) / steady-b (job 4).
TO_STEADY_A = ("down", "down")
TO_STEADY_B = ("down", "down", "down")


def table_ids(app: Any) -> list[str]:
    return app.query_one("#jobs", JobTable).row_ids()


def status_text(app: Any, selector: str = "#status") -> str:
    return str(app.screen.query_one(selector).render())


def row(app: Any, job_id: str) -> Any:
    return next(r for r in app.rows if r.id == job_id)


async def test_main_screen_shows_jobs_grid_and_cluster(source: FixedSource, make_app: Any) -> None:
    app = make_app(source, sync=True)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause()
        assert table_ids(app) == [str(i) for i in range(1, 8)]
        assert [r.state for r in app.rows] == [
            "succeeded", "failed", "running", "running", "held", "cancelled", "queued",
        ]  # fmt: skip
        text = app.query_one("#grid", DeviceGrid).render().plain
        assert "0:steady-a" in text and "1:steady-b" in text
        figures = str(app.query_one("#cluster-figures").render())
        assert "utilisation 100% (2/2 devices)" in figures
        assert "running 2 · queue 1" in figures
        assert "7 jobs" in status_text(app)
        assert row(app, "3").batch_text == "64×1×1=64" and row(app, "3").goodput


async def test_sort_and_filter_keys(source: FixedSource, make_app: Any) -> None:
    app = make_app(source, sync=True)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause()
        await pilot.press("s")  # id -> name
        assert app.main.sort_key == "name"
        names = [r.name for r in app.main.visible_rows()]
        assert names == sorted(names, key=str.lower)
        await pilot.press("S")
        assert app.main.sort_reverse
        assert [r.name for r in app.main.visible_rows()] == sorted(
            names, key=str.lower, reverse=True
        )
        await pilot.press("slash")
        assert app.query_one("#filter", Input).has_focus
        await pilot.press(*"state:running,held", "enter")
        await pilot.pause()
        assert sorted(table_ids(app)) == ["3", "4", "5"]
        assert "state:held,running" in status_text(app) and "(3 shown)" in status_text(app)
        owner = row(app, "1").owner
        await pilot.press("slash", "ctrl+u", *f"owner:{owner} steady", "enter")
        await pilot.pause()
        assert sorted(table_ids(app)) == ["3", "4"]
        await pilot.press("slash", "ctrl+u", *"owner:nobody", "enter")
        await pilot.pause()
        assert table_ids(app) == []


async def test_detail_screen_plots_decisions_and_logs(source: FixedSource, make_app: Any) -> None:
    app = make_app(source, sync=True)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause()
        await pilot.press(*TO_STEADY_A, "enter")
        await pilot.pause()
        screen = app.screen
        assert isinstance(screen, JobScreen) and screen.job_id == "3"
        assert api.Show(id="3") in source.calls
        tp = screen.query_one("#plot-throughput", PlotView)
        assert tp.spec.note is None and tp.spec.title == "throughput vs devices"
        assert "throughput vs devices" in tp.render().plain
        assert screen.query_one("#plot-efficiency", PlotView).spec.note is None
        assert screen.query_one("#plot-history", PlotView).spec.note is None
        decisions = str(screen.query_one("#decisions").render())
        assert "resize" in decisions and "start" in decisions and "submitted" in decisions
        assert screen.log_lines and screen.log_lines[-1].startswith("epoch ")
        assert "steady-a" in status_text(app, "#job-status")
        await pilot.press("escape")
        assert not isinstance(app.screen, JobScreen)


async def test_detail_of_a_job_without_a_model(source: FixedSource, make_app: Any) -> None:
    app = make_app(source, sync=True)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause()
        await pilot.press("enter")  # job 1, succeeded: a report (profile) but no model
        await pilot.pause()
        screen = app.screen
        assert isinstance(screen, JobScreen) and screen.job_id == "1"
        tp = screen.query_one("#plot-throughput", PlotView).spec
        assert tp.title == "throughput vs devices (fit of profile)" and tp.note is None
        assert "TARGET REACHED" in screen.log_lines[-1]
        await pilot.press("escape", "down", "enter")  # job 2, failed: nothing reported
        await pilot.pause()
        screen = app.screen
        assert isinstance(screen, JobScreen) and screen.job_id == "2"
        assert "no fitted model" in (screen.query_one("#plot-throughput", PlotView).spec.note or "")
        assert "failed" in str(screen.query_one("#decisions").render())


async def test_cancel_asks_first_and_refuses_on_no(source: FixedSource, make_app: Any) -> None:
    app = make_app(source, sync=True)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause()
        await pilot.press(*TO_STEADY_A, "c")
        assert isinstance(app.screen, ConfirmScreen)
        await pilot.press("n")
        assert not any(isinstance(call, api.Cancel) for call in source.calls)
        await pilot.press("c")
        await pilot.press("y")
        await pilot.pause()
        assert api.Cancel(ids=["3"]) in source.calls
        assert row(app, "3").state == "cancelled"
        grid = {(c.device, c.status) for n in app.cells for c in n.devices}
        assert ("cpu:0", "free") in grid and ("cpu:1", "job") in grid


async def test_hold_release_and_priority(source: FixedSource, make_app: Any) -> None:
    app = make_app(source, sync=True)
    async with app.run_test(size=SIZE, notifications=True) as pilot:
        await pilot.pause()
        await pilot.press(*TO_STEADY_B, "h", "y")
        await pilot.pause()
        assert api.Hold(id="4") in source.calls
        assert row(app, "4").state == "held" and row(app, "4").gpus == 0
        await pilot.press("u")
        await pilot.pause()
        assert api.Release(id="4") in source.calls
        assert row(app, "4").state == "queued"
        await pilot.press("p")
        assert isinstance(app.screen, PriorityScreen)
        await pilot.press("ctrl+u", *"x1", "enter")
        assert isinstance(app.screen, PriorityScreen)  # not an integer: stays open
        assert "not an integer" in str(app.screen.query_one("#error").render())
        await pilot.press("ctrl+u", "7", "enter")
        await pilot.pause()
        assert api.SetPriority(id="4", priority=7) in source.calls
        assert row(app, "4").priority == 7
        messages = [n.message for n in app._notifications]
        assert "hold 4: done" in messages and "set priority 4: done" in messages


async def test_daemon_errors_are_shown_not_crashed_on(source: FixedSource, make_app: Any) -> None:
    source.fail[api.Cancel] = api.PermissionDenied(
        "job 3 belongs to alice; only its owner or an admin may cancel it"
    )
    app = make_app(source, sync=True)
    async with app.run_test(size=SIZE, notifications=True) as pilot:
        await pilot.pause()
        await pilot.press(*TO_STEADY_A, "c", "y")
        await pilot.pause()
        await pilot.press("home", "u")  # job 1 has succeeded: the daemon says it is not held
        await pilot.pause()
        messages = [n.message for n in app._notifications]
        assert any(m.startswith("cancel 3 failed: job 3 belongs to alice") for m in messages)
        assert "release 1 failed: job 1 is not held (it is succeeded)" in messages
        assert row(app, "3").state == "running"
        assert app.is_running and app.connected is True


async def test_daemon_down_is_said_and_reconnects(source: FixedSource, make_app: Any) -> None:
    app = make_app(source, sync=True, refresh_s=0.05)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause()
        source.down = True
        await pilot.pause(0.2)
        assert app.connected is False
        assert "DAEMON DOWN" in status_text(app)
        assert table_ids(app), "the last known jobs stay visible"
        source.down = False
        await pilot.pause(0.2)
        assert app.connected is True
        assert "DAEMON DOWN" not in status_text(app)


class ErrorSource(FixedSource):
    """``status`` fails with ``error`` (once set)."""

    error: api.PolluxError | None = None

    def call(self, request: Any) -> Any:
        if self.error is not None and isinstance(request, api.Status):
            raise self.error
        return super().call(request)


@pytest.mark.parametrize(
    ("error", "down"),
    [
        (api.DaemonUnavailable("the words do not matter"), True),
        (api.PolluxError("no daemon is running (but this is a refusal)"), False),
        (api.InternalError("lost the connection to the database"), False),
        (api.ProtocolError("unexpected reply from the daemon"), False),
    ],
)
async def test_down_is_told_by_the_error_class_not_its_text(
    recording: Recording, make_app: Any, error: api.PolluxError, down: bool
) -> None:
    source = ErrorSource(recording)
    app = make_app(source, sync=True, refresh_s=3600)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause()
        source.error = error
        app.refresh_data()
        await pilot.pause()
        assert app.connected is (not down)
        assert ("DAEMON DOWN" in status_text(app)) is down
        assert str(error) in status_text(app)


async def test_submit_form_sends_what_the_cli_sends(
    source: FixedSource, make_app: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The form builds its request with the CLI's code, in this user's environment (the
    active venv's Python for a .py script; a plain script is rigid), and a refused or
    invalid form sends nothing at all."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to(sys.executable)
    monkeypatch.setenv("VIRTUAL_ENV", str(venv))
    (tmp_path / "train.py").write_text("print('plain script')\n")
    (tmp_path / "elastic.py").write_text("from pollux_local.torch import ElasticTrainer\n")
    app = make_app(source, sync=True, workdir=str(tmp_path))
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause()
        before = list(source.calls)
        await pilot.press("n")
        assert isinstance(app.screen, SubmitScreen)
        form = app.screen
        form.query_one("#f-min_gpus", Input).value = "3"
        form.query_one("#f-max_gpus", Input).value = "2"
        form.query_one("#f-script", Input).value = "elastic.py"
        form.query_one("#f-args", Input).value = "--epochs 3 --lr '0.1'"
        await pilot.click("#submit")
        assert isinstance(app.screen, SubmitScreen)
        assert "min devices 3 > max devices 2" in str(form.query_one("#error").render())
        form.query_one("#f-min_gpus", Input).value = "1"
        form.query_one("#f-script", Input).value = "missing.py"
        await pilot.pause(0.3)  # a button ignores presses during its 0.2 s press animation
        await pilot.click("#submit")
        assert "does not exist" in str(form.query_one("#error").render())
        form.query_one("#f-script", Input).value = "elastic.py"
        form.query_one("#f-name", Input).value = "\x1b[31mred"  # the contract refuses it
        await pilot.pause(0.3)
        await pilot.click("#submit")
        assert isinstance(app.screen, SubmitScreen)
        assert "name" in str(form.query_one("#error").render())
        # the refresh timer's reads may come; nothing else may be sent
        refreshes = (api.Status, api.Nodes)
        assert not [c for c in source.calls[len(before) :] if not isinstance(c, refreshes)]
        form.query_one("#f-name", Input).value = "tiny"
        await pilot.pause(0.3)
        await pilot.click("#submit")
        await pilot.pause()
        assert not isinstance(app.screen, SubmitScreen)
        sent = [call for call in source.calls if isinstance(call, api.Submit)]
        assert len(sent) == 1
        submit = sent[0]
        assert submit.argv == [
            str(venv / "bin" / "python"), "-u", str(tmp_path / "elastic.py"),
            "--epochs", "3", "--lr", "0.1",
        ]  # fmt: skip
        assert (submit.name, submit.min_gpus, submit.max_gpus, submit.elastic) == (
            "tiny", 1, 2, True,
        )  # fmt: skip
        assert submit.workdir == str(tmp_path) and submit.env["VIRTUAL_ENV"] == str(venv)
        assert row(app, "8").name == "tiny" and row(app, "8").state == "queued"
        await pilot.press("n")
        app.screen.query_one("#f-script", Input).value = "train.py"
        app.screen.query_one("#f-min_gpus", Input).value = "2"
        await pilot.pause(0.3)
        await pilot.click("#submit")
        await pilot.pause()
        rigid = [call for call in source.calls if isinstance(call, api.Submit)][-1]
        assert (rigid.elastic, rigid.min_gpus, rigid.max_gpus) == (False, 2, 2)


async def test_help_and_log_follow(source: FixedSource, make_app: Any) -> None:
    app = make_app(source, sync=True, refresh_s=0.05)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause()
        await pilot.press("question_mark")
        assert isinstance(app.screen, HelpScreen)
        await pilot.press("escape")
        await pilot.press(*TO_STEADY_A, "l")
        screen = app.screen
        assert isinstance(screen, LogScreen) and screen.job_id == "3"
        await pilot.pause()
        assert screen.lines[-1].startswith("epoch ")
        source.append_log("3", "epoch 9999 a new line\n")
        await pilot.pause(0.8)  # the log view polls every 0.5 s at least
        assert screen.lines[-1] == "epoch 9999 a new line"
        await pilot.press("f")
        assert not screen.following
        source.append_log("3", "while paused\n")
        await pilot.pause(0.8)
        assert screen.lines[-1] == "epoch 9999 a new line"


class SlowSource(FixedSource):
    """Every request blocks until ``gate`` is set (a hung daemon)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.gate = threading.Event()

    def call(self, request: Any) -> Any:
        self.gate.wait(timeout=20)
        return super().call(request)


async def test_slow_daemon_never_blocks_input(recording: Recording, make_app: Any) -> None:
    slow = SlowSource(recording)
    app = make_app(slow, sync=False, refresh_s=0.2)
    async with app.run_test(size=SIZE) as pilot:
        started = time.monotonic()
        await pilot.press("question_mark")
        await pilot.pause()
        assert isinstance(app.screen, HelpScreen)  # handled while the request is still pending
        assert time.monotonic() - started < 5
        assert app.query_one("#jobs", JobTable).row_count == 0
        await pilot.press("escape")
        slow.gate.set()
        for _ in range(100):
            await pilot.pause(0.05)
            if app.query_one("#jobs", JobTable).row_count:
                break
        assert app.query_one("#jobs", JobTable).row_count == 7
        assert app.connected is True


async def test_threaded_errors_reach_the_status_line(source: FixedSource, make_app: Any) -> None:
    source.fail[api.Status] = api.InternalError("database is locked")
    app = make_app(source, sync=False, refresh_s=0.1)
    async with app.run_test(size=SIZE) as pilot:
        for _ in range(60):
            await pilot.pause(0.05)
            if app.last_error:
                break
        assert app.last_error == "database is locked"
        assert app.connected is True  # reachable, it just refused
        assert "database is locked" in status_text(app)


async def test_waiting_reason_and_expected_start_in_the_table_and_the_detail(
    source: FixedSource, make_app: Any
) -> None:
    """The queued job's line shows what it waits for across the figures it lacks and its
    expected start from the daemon's forecast; its screen shows both, with its finish."""
    import msgspec

    fixed_now = 1_732_323_000.0  # conftest.FIXED_NOW, the app's clock
    jobs = [
        msgspec.structs.replace(
            job, expected_start=fixed_now + 245, expected_finish=fixed_now + 845
        )
        if job.id == "7"
        else job
        for job in source.status.jobs
    ]
    source.status = msgspec.structs.replace(source.status, jobs=jobs)
    app = make_app(source, sync=True)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause()
        table = app.query_one("#jobs", JobTable)
        waiting = row(app, "7")
        assert waiting.start_text == "4m05s"
        line = table._row_strip(app.rows.index(waiting), SIZE[0]).text
        assert "waiting: needs 2 devices" in line and "4m05s" in line
        assert "held" in table._row_strip(app.rows.index(row(app, "5")), SIZE[0]).text
        assert row(app, "3").waiting_text is None  # a running job shows its figures
        for _ in range(6):
            await pilot.press("down")
        await pilot.press("enter")
        await pilot.pause(0.3)
        assert isinstance(app.screen, JobScreen)
        summary = str(app.screen.query_one("#summary").render())
        assert "expected start in 4m05s" in summary and "finish in 14m" in summary
        assert "reason: waiting: needs 2 devices" in summary
