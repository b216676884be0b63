"""Pilot tests: drive the app with keys against canned data and check its state."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from textual.widgets import Input

from pollux_local.tui.screens.confirm import ConfirmScreen
from pollux_local.tui.screens.help import HelpScreen
from pollux_local.tui.screens.job_detail import JobScreen
from pollux_local.tui.screens.logs import LogScreen
from pollux_local.tui.screens.priority import PriorityScreen
from pollux_local.tui.screens.submit import SubmitScreen
from pollux_local.tui.source import FixedSource, SourceError, demo_data
from pollux_local.tui.widgets.device_grid import DeviceGrid
from pollux_local.tui.widgets.job_table import JobTable
from pollux_local.tui.widgets.plot_view import PlotView

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(60)]
SIZE = (120, 40)


def table_ids(app: Any) -> list[str]:
    return app.query_one("#jobs", JobTable).row_ids()


def status_text(app: Any, selector: str = "#status") -> str:
    return str(app.screen.query_one(selector).render())


async def test_main_screen_shows_jobs_grid_and_cluster(source: FixedSource, make_app: Any) -> None:
    app = make_app(source, sync=True)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause()
        assert table_ids(app) == [f"j{i:03d}" for i in range(1, 13)]
        grid = app.query_one("#grid", DeviceGrid)
        text = grid.render().plain
        assert "ws1" in text and "ws3" in text and "down" in text and "external" in text
        assert "resnet-1" in text  # the job holding ws1's first device
        figures = str(app.query_one("#cluster-figures").render())
        assert "utilisation" in figures and "queue" in figures
        assert "12 jobs" in status_text(app)


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
        await pilot.press(*"owner:alice", "enter")
        await pilot.pause()
        ids = table_ids(app)
        owners = {r.owner for r in app.rows if r.id in ids}
        assert ids and owners == {"alice"}
        assert len(ids) < 12
        assert "owner:alice" in status_text(app)
        await pilot.press("slash", "ctrl+u", *"state:queued", "enter")
        await pilot.pause()
        assert {r.state for r in app.rows if r.id in table_ids(app)} == {"queued"}


async def test_detail_screen_plots_decisions_and_logs(source: FixedSource, make_app: Any) -> None:
    app = make_app(source, sync=True)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause()
        await pilot.press("down", "enter")
        await pilot.pause()
        screen = app.screen
        assert isinstance(screen, JobScreen) and screen.job_id == "j002"
        assert ("show", {"id": "j002"}) in source.calls
        tp = screen.query_one("#plot-throughput", PlotView)
        assert tp.spec.note is None and tp.spec.series
        assert "throughput vs devices" in tp.render().plain
        assert screen.query_one("#plot-efficiency", PlotView).spec.note is None
        assert "speedup" in str(screen.query_one("#decisions").render())
        assert screen.log_lines and "epoch 29" in screen.log_lines[-1]
        await pilot.press("escape")
        assert not isinstance(app.screen, JobScreen)


async def test_cancel_asks_first_and_refuses_on_no(source: FixedSource, make_app: Any) -> None:
    app = make_app(source, sync=True)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause()
        await pilot.press("c")
        assert isinstance(app.screen, ConfirmScreen)
        await pilot.press("n")
        assert not any(kind == "cancel" for kind, _ in source.calls)
        await pilot.press("c")
        await pilot.press("y")
        await pilot.pause()
        assert ("cancel", {"ids": ["j001"]}) in source.calls
        assert next(r for r in app.rows if r.id == "j001").state == "cancelled"


async def test_hold_release_and_priority(source: FixedSource, make_app: Any) -> None:
    app = make_app(source, sync=True)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause()
        await pilot.press("h", "y")
        await pilot.pause()
        assert ("hold", {"id": "j001"}) in source.calls
        assert next(r for r in app.rows if r.id == "j001").state == "held"
        await pilot.press("u")
        await pilot.pause()
        assert ("release", {"id": "j001"}) in source.calls
        await pilot.press("p")
        assert isinstance(app.screen, PriorityScreen)
        await pilot.press("ctrl+u", *"x1", "enter")
        assert isinstance(app.screen, PriorityScreen)  # not an integer: stays open
        assert "not an integer" in str(app.screen.query_one("#error").render())
        await pilot.press("ctrl+u", "7", "enter")
        await pilot.pause()
        assert ("set_priority", {"id": "j001", "priority": 7}) in source.calls
        assert next(r for r in app.rows if r.id == "j001").priority == 7


async def test_daemon_errors_are_shown_not_crashed_on(source: FixedSource, make_app: Any) -> None:
    source.fail["cancel"] = "only alice (or an admin) may cancel job j001"
    app = make_app(source, sync=True)
    async with app.run_test(size=SIZE, notifications=True) as pilot:
        await pilot.pause()
        await pilot.press("c", "y")
        await pilot.pause()
        messages = [n.message for n in app._notifications]
        assert any("cancel failed: only alice" in m for m in messages)
        assert next(r for r in app.rows if r.id == "j001").state != "cancelled"
        assert app.is_running


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


async def test_submit_form_validates_and_sends(source: FixedSource, make_app: Any) -> None:
    app = make_app(source, sync=True)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause()
        await pilot.press("n")
        assert isinstance(app.screen, SubmitScreen)
        app.screen.query_one("#f-min_gpus", Input).value = "3"
        app.screen.query_one("#f-max_gpus", Input).value = "2"
        app.screen.query_one("#f-script", Input).value = "train.py"
        app.screen.query_one("#f-args", Input).value = "--epochs 3 --lr '0.1'"
        await pilot.click("#submit")
        assert isinstance(app.screen, SubmitScreen)
        assert "min devices 3 > max devices 2" in str(app.screen.query_one("#error").render())
        app.screen.query_one("#f-min_gpus", Input).value = "1"
        app.screen.query_one("#f-name", Input).value = "tiny"
        await pilot.pause(0.3)  # a button ignores presses during its 0.2 s press animation
        await pilot.click("#submit")
        await pilot.pause()
        assert not isinstance(app.screen, SubmitScreen)
        sent = [f for kind, f in source.calls if kind == "submit"]
        assert sent == [
            {
                "argv": ["train.py", "--epochs", "3", "--lr", "0.1"],
                "name": "tiny",
                "min_gpus": 1,
                "max_gpus": 2,
                "workdir": "/work/lab",
            }
        ]
        assert any(r.name == "tiny" and r.state == "queued" for r in app.rows)


async def test_help_and_log_follow(source: FixedSource, make_app: Any) -> None:
    app = make_app(source, sync=True, refresh_s=0.05)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause()
        await pilot.press("question_mark")
        assert isinstance(app.screen, HelpScreen)
        await pilot.press("escape")
        await pilot.press("l")
        screen = app.screen
        assert isinstance(screen, LogScreen)
        await pilot.pause()
        assert screen.lines[-1].startswith("[rank 0] epoch 29")
        source.data["logs"]["j001"].append("[rank 0] a new line")
        await pilot.pause(0.8)  # the log view polls every 0.5 s at least
        assert screen.lines[-1] == "[rank 0] a new line"
        await pilot.press("f")
        assert not screen.following
        source.data["logs"]["j001"].append("[rank 0] while paused")
        await pilot.pause(0.8)
        assert screen.lines[-1] == "[rank 0] a new line"


class SlowSource(FixedSource):
    """Every request blocks until ``gate`` is set (a hung daemon)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.gate = threading.Event()

    def request(self, type: str, **fields: Any) -> dict[str, Any]:
        self.gate.wait(timeout=20)
        return super().request(type, **fields)


async def test_slow_daemon_never_blocks_input(make_app: Any) -> None:
    slow = SlowSource(demo_data(n_jobs=12, n_nodes=3))
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
        assert app.query_one("#jobs", JobTable).row_count == 12
        assert app.connected is True


async def test_threaded_errors_reach_the_status_line(source: FixedSource, make_app: Any) -> None:
    source.fail["status"] = "internal error: database is locked"
    app = make_app(source, sync=False, refresh_s=0.1)
    async with app.run_test(size=SIZE) as pilot:
        for _ in range(60):
            await pilot.pause(0.05)
            if app.last_error:
                break
        assert app.last_error == "internal error: database is locked"
        assert app.connected is True  # reachable, it just refused
        assert "database is locked" in status_text(app)


@pytest.mark.filterwarnings("ignore::pytest.PytestWarning")
def test_fixed_source_refuses_what_the_daemon_refuses(source: FixedSource) -> None:
    with pytest.raises(SourceError, match="unexpected field 'id'"):
        source.request("cancel", id="j001")
