"""The pollux-local Textual app: cluster grid, jobs table, job detail, actions.

Data comes from a :class:`~pollux_local.tui.source.DataSource`.  Requests are made in worker
threads (``sync=False``, the default) so that a slow or dead daemon never blocks input; with
canned data (tests, screenshots) ``sync=True`` makes them inline.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

from rich.text import Text
from textual import on
from textual.app import App, ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.css.query import NoMatches
from textual.screen import ModalScreen, Screen
from textual.widgets import Button, Footer, Input, Label, Log, Static

from pollux_local.tui import plots
from pollux_local.tui.source import DaemonDown, DataSource, SourceError
from pollux_local.tui.view import (
    SORT_KEYS,
    ClusterSample,
    JobFilter,
    JobRow,
    NodeCells,
    as_number,
    cluster_sample,
    filter_rows,
    fmt_duration,
    fmt_number,
    fmt_placement,
    job_colour,
    job_rows,
    node_cells,
    samples_from_history,
    sort_rows,
)
from pollux_local.tui.widgets import DeviceGrid, JobTable, PlotView

#: Samples of cluster-wide figures kept for the cluster plot.
HISTORY_SAMPLES = 720
#: Log lines shown in the job detail / kept in the log view.
LOG_TAIL_LINES = 60
LOG_FOLLOW_LINES = 2000
LOG_TAIL_BYTES = 65536


class ConfirmScreen(ModalScreen[bool]):
    """Yes/no question before a destructive action."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("y", "answer(True)", "Yes"),
        Binding("n,escape", "answer(False)", "No"),
    ]
    DEFAULT_CSS = """
    ConfirmScreen { align: center middle; }
    ConfirmScreen > Vertical { width: 60; height: auto; border: thick $warning; padding: 1 2; background: $surface; }
    ConfirmScreen Horizontal { height: auto; margin-top: 1; }
    ConfirmScreen Button { margin-right: 2; }
    """

    def __init__(self, question: str) -> None:
        super().__init__()
        self.question = question

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Label(self.question, id="question")
            with Horizontal():
                yield Button("Yes (y)", variant="error", id="yes")
                yield Button("No (n)", variant="primary", id="no")

    def action_answer(self, answer: bool) -> None:
        self.dismiss(answer)

    @on(Button.Pressed)
    def _pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id == "yes")


class PriorityScreen(ModalScreen[int | None]):
    """Asks for a job's new priority (an integer)."""

    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape", "cancel", "Cancel")]
    DEFAULT_CSS = """
    PriorityScreen { align: center middle; }
    PriorityScreen > Vertical { width: 60; height: auto; border: thick $primary; padding: 1 2; background: $surface; }
    PriorityScreen #error { color: $error; }
    """

    def __init__(self, job_label: str, current: int | None) -> None:
        super().__init__()
        self.job_label = job_label
        self.current = current

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Label(f"Priority of {self.job_label} (integer, higher runs first):")
            yield Input(value="" if self.current is None else str(self.current), id="priority")
            yield Label("", id="error")

    @on(Input.Submitted)
    def _submitted(self, event: Input.Submitted) -> None:
        try:
            value = int(event.value.strip())
        except ValueError:
            self.query_one("#error", Label).update(f"not an integer: {event.value!r}")
            return
        self.dismiss(value)

    def action_cancel(self) -> None:
        self.dismiss(None)


class SubmitScreen(ModalScreen[dict[str, Any] | None]):
    """The submit form; dismisses with the request fields, or ``None`` when abandoned."""

    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape", "cancel", "Cancel")]
    DEFAULT_CSS = """
    SubmitScreen { align: center middle; }
    SubmitScreen > Vertical { width: 80; height: auto; border: thick $primary; padding: 0 2; background: $surface; }
    SubmitScreen Horizontal.field { height: 3; }
    SubmitScreen Horizontal.field Label { width: 22; padding-top: 1; }
    SubmitScreen Horizontal.field Input { width: 1fr; }
    SubmitScreen #error { color: $error; height: auto; }
    SubmitScreen #buttons { height: 3; }
    SubmitScreen Button { margin-right: 2; }
    """

    #: (field id, label, placeholder, kind) — kind: "text", "int" or "args".
    FIELDS: ClassVar[tuple[tuple[str, str, str, str], ...]] = (
        ("script", "Script *", "train.py", "text"),
        ("args", "Arguments", "--epochs 10", "args"),
        ("name", "Name", "(the script's name)", "text"),
        ("min_gpus", "Min devices", "1", "int"),
        ("max_gpus", "Max devices", "(all)", "int"),
        ("batch_size", "Base batch size M0", "(the script's)", "int"),
        ("max_batch_size", "Max batch size", "(the script's)", "int"),
        ("priority", "Priority", "0", "int"),
        ("workdir", "Working directory", "(current directory)", "text"),
    )

    def __init__(self, workdir: str) -> None:
        super().__init__()
        self.workdir = workdir

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Label("[b]Submit a job[/b]  (Enter or the button submits, Escape abandons)")
            for field_id, label, placeholder, _ in self.FIELDS:
                with Horizontal(classes="field"):
                    yield Label(label)
                    value = self.workdir if field_id == "workdir" else ""
                    yield Input(value=value, placeholder=placeholder, id=f"f-{field_id}")
            yield Label("", id="error")
            with Horizontal(id="buttons"):
                yield Button("Submit", variant="primary", id="submit")
                yield Button("Cancel", id="cancel")

    def collect(self) -> dict[str, Any]:
        """The request fields, or raise ValueError naming the bad field."""
        import shlex

        out: dict[str, Any] = {}
        for field_id, label, _, kind in self.FIELDS:
            raw = self.query_one(f"#f-{field_id}", Input).value.strip()
            if not raw:
                continue
            if kind == "int":
                try:
                    number = int(raw)
                except ValueError:
                    raise ValueError(f"{label.rstrip(' *')}: not an integer: {raw!r}") from None
                if field_id != "priority" and number <= 0:
                    raise ValueError(f"{label}: must be positive, got {number}")
                out[field_id] = number
            elif kind == "args":
                try:
                    out[field_id] = shlex.split(raw)
                except ValueError as exc:
                    raise ValueError(f"{label}: {exc}") from None
            else:
                out[field_id] = raw
        if "script" not in out:
            raise ValueError("Script: required")
        out["argv"] = [out.pop("script"), *out.pop("args", [])]
        out.setdefault("workdir", self.workdir)
        if "min_gpus" in out and "max_gpus" in out and out["min_gpus"] > out["max_gpus"]:
            raise ValueError(f"min devices {out['min_gpus']} > max devices {out['max_gpus']}")
        if (
            "batch_size" in out
            and "max_batch_size" in out
            and out["max_batch_size"] < out["batch_size"]
        ):
            raise ValueError(
                f"max batch size {out['max_batch_size']} < base batch size {out['batch_size']}"
            )
        return out

    def _try_submit(self) -> None:
        try:
            fields = self.collect()
        except ValueError as exc:
            self.query_one("#error", Label).update(str(exc))
            return
        self.dismiss(fields)

    @on(Input.Submitted)
    def _submitted(self) -> None:
        self._try_submit()

    @on(Button.Pressed, "#submit")
    def _submit_pressed(self) -> None:
        self._try_submit()

    @on(Button.Pressed, "#cancel")
    def action_cancel(self) -> None:
        self.dismiss(None)


HELP_TEXT = """\
[b]pollux-local[/b] — live view of the shared machine

[b]Main screen[/b]
  ↑/↓ or j/k   move in the jobs table        enter / d   job detail
  s / S        sort by next column / reverse  /           filter (owner:NAME state:STATE words)
  n            submit a job (form)            c           cancel the job (asks first)
  h / u        hold (asks first) / release     p           set priority
  l            follow the job's log            r           refresh now
  ?            this help                       q           quit

[b]Job detail[/b]   escape back · l follow logs · c cancel · h hold · u release · p priority
[b]Log view[/b]     escape back · f pause/resume following

Device grid: each device shows its index and the job holding it, in the job's colour;
grey = free, amber = used by a process outside the scheduler, dark red = down.
Batch size m×s×K = micro-batch × accumulation steps × replicas.  Goodput is in examples/s
weighted by statistical efficiency; speedup is over the job's fair share of the devices.
When the daemon is down the title bar says so and the view keeps retrying.
"""


class HelpScreen(ModalScreen[None]):
    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape,q,question_mark", "close", "Close")]
    DEFAULT_CSS = """
    HelpScreen { align: center middle; }
    HelpScreen > Vertical { width: 100; height: auto; border: thick $primary; padding: 1 2; background: $surface; }
    """

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Static(HELP_TEXT, id="help-text")
            yield Label("[dim]escape closes[/dim]")

    def action_close(self) -> None:
        self.dismiss(None)


class StatusLine(Static):
    DEFAULT_CSS = """
    StatusLine { height: 1; background: $primary-background; color: $text; padding: 0 1; }
    StatusLine.down { background: $error; }
    """


def _job_actions_bindings() -> list[BindingType]:
    return [
        Binding("c", "cancel_job", "Cancel"),
        Binding("h", "hold_job", "Hold"),
        Binding("u", "release_job", "Release"),
        Binding("p", "priority_job", "Priority"),
        Binding("l", "follow_logs", "Logs"),
    ]


class JobScreen(Screen[None]):
    """One job: fitted throughput model, efficiency curve, history, decisions, log tail."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape,q", "app.pop_screen", "Back"),
        *_job_actions_bindings(),
    ]
    DEFAULT_CSS = """
    JobScreen #summary { height: 3; padding: 0 1; }
    JobScreen #plots { height: 16; }
    JobScreen #plots PlotView { border: round $primary-darken-2; }
    JobScreen #bottom { height: 1fr; }
    JobScreen #decisions-box { width: 1fr; border: round $primary-darken-2; }
    JobScreen #log-tail { width: 1fr; border: round $primary-darken-2; }
    """

    def __init__(self, job_id: Any) -> None:
        super().__init__()
        self.job_id = job_id
        self.detail: dict[str, Any] = {}
        self.log_lines: list[str] = []

    @property
    def pollux(self) -> PolluxApp:
        app = self.app
        assert isinstance(app, PolluxApp)
        return app

    def compose(self) -> ComposeResult:
        yield StatusLine("", id="job-status")
        yield Static("loading…", id="summary")
        with Horizontal(id="plots"):
            yield PlotView(id="plot-throughput")
            yield PlotView(id="plot-efficiency")
            yield PlotView(id="plot-history")
        with Horizontal(id="bottom"):
            with VerticalScroll(id="decisions-box"):
                yield Static("", id="decisions")
            yield Log(id="log-tail", auto_scroll=True)
        yield Footer()

    def on_mount(self) -> None:
        self.query_one("#decisions-box").border_title = "scheduler decisions"
        self.query_one("#log-tail").border_title = "log tail"
        self.query_one("#job-status", StatusLine).update(f"job {self.job_id}")
        self.fetch()
        self.set_interval(self.pollux.refresh_s, self.fetch)

    def fetch(self) -> None:
        self.pollux.run_request(self._load, self._loaded, group=f"job-{self.job_id}")

    def _load(self) -> tuple[dict[str, Any], list[str]]:
        source = self.pollux.source
        shown = source.request("show", id=str(self.job_id))
        detail = shown.get("job", shown)
        if isinstance(detail, Mapping) and "decisions" not in detail and "decisions" in shown:
            detail = {**detail, "decisions": shown["decisions"]}
        try:
            lines = _log_lines(source.request("logs", **_tail_fields(self.job_id)))[
                -LOG_TAIL_LINES:
            ]
        except SourceError as exc:
            lines = [f"(logs unavailable: {exc})"]
        return (dict(detail) if isinstance(detail, Mapping) else {}), lines

    def _loaded(self, result: tuple[dict[str, Any], list[str]] | BaseException) -> None:
        status = self.query_one("#job-status", StatusLine)
        if isinstance(result, BaseException):
            down = isinstance(result, DaemonDown)
            status.set_class(down, "down")
            status.update(
                f"job {self.job_id} · {'daemon down, retrying: ' if down else 'error: '}{result}"
            )
            return
        status.remove_class("down")
        self.detail, lines = result
        self.show_detail(lines)

    def show_detail(self, lines: list[str]) -> None:
        detail = self.detail
        row = job_row_safe(detail)
        status = self.query_one("#job-status", StatusLine)
        status.update(f"job {row.id} · {row.name} · {row.owner} · {row.state}")
        noise = plots.noise_scale(detail)
        summary = Text()
        summary.append(f"{row.name} ", style=f"bold {job_colour(row.id)}")
        summary.append(f"({row.id}, {row.owner}) {row.state}   ")
        summary.append(f"devices {row.gpus} {row.where}   batch {row.batch_text}\n")
        summary.append(
            f"goodput {fmt_number(row.goodput)} ex/s   efficiency "
            f"{'-' if row.efficiency is None else f'{row.efficiency:.2f}'}   speedup "
            f"{'-' if row.speedup is None else f'{row.speedup:.2f}x'}   noise scale "
            f"{fmt_number(noise)}   progress {fmt_progress_text(row.progress)}   ETA "
            f"{fmt_duration(row.eta_s)}   restarts {row.restarts if row.restarts is not None else '-'}"
        )
        self.query_one("#summary", Static).update(summary)
        max_devices, per_node = self.pollux.device_counts()
        self.query_one("#plot-throughput", PlotView).show(
            plots.throughput_plot(detail, max_devices, per_node)
        )
        self.query_one("#plot-efficiency", PlotView).show(plots.efficiency_plot(detail))
        self.query_one("#plot-history", PlotView).show(plots.history_plot(detail))
        self.query_one("#decisions", Static).update(decisions_text(detail.get("decisions")))
        if lines != self.log_lines:
            self.log_lines = lines
            log = self.query_one("#log-tail", Log)
            log.clear()
            log.write_lines(lines)

    def action_cancel_job(self) -> None:
        self.pollux.confirm_and_act("cancel", self.job_id, str(self.job_id))

    def action_hold_job(self) -> None:
        self.pollux.confirm_and_act("hold", self.job_id, str(self.job_id))

    def action_release_job(self) -> None:
        self.pollux.act("release", self.job_id)

    def action_priority_job(self) -> None:
        self.pollux.ask_priority(self.job_id, str(self.job_id), None)

    def action_follow_logs(self) -> None:
        self.pollux.push_screen(LogScreen(self.job_id))


class LogScreen(Screen[None]):
    """Follows a job's log: re-reads the tail every refresh."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape,q", "app.pop_screen", "Back"),
        Binding("f", "toggle_follow", "Pause/follow"),
    ]

    def __init__(self, job_id: Any) -> None:
        super().__init__()
        self.job_id = job_id
        self.following = True
        self.lines: list[str] = []

    @property
    def pollux(self) -> PolluxApp:
        app = self.app
        assert isinstance(app, PolluxApp)
        return app

    def compose(self) -> ComposeResult:
        yield StatusLine(f"log of job {self.job_id} · following", id="log-status")
        yield Log(id="log", auto_scroll=True)
        yield Footer()

    def on_mount(self) -> None:
        self.fetch()
        self.set_interval(max(0.5, self.pollux.refresh_s / 2), self.fetch)

    def fetch(self) -> None:
        if self.following:
            self.pollux.run_request(self._load, self._loaded, group=f"log-{self.job_id}")

    def _load(self) -> list[str]:
        reply = self.pollux.source.request("logs", **_tail_fields(self.job_id))
        return _log_lines(reply)[-LOG_FOLLOW_LINES:]

    def _loaded(self, result: list[str] | BaseException) -> None:
        status = self.query_one("#log-status", StatusLine)
        if isinstance(result, BaseException):
            status.set_class(isinstance(result, DaemonDown), "down")
            status.update(f"log of job {self.job_id} · {result}")
            return
        status.remove_class("down")
        status.update(f"log of job {self.job_id} · {'following' if self.following else 'paused'}")
        if result == self.lines:
            return
        log = self.query_one("#log", Log)
        common = len(self.lines)
        if self.lines and result[: len(self.lines)] == self.lines:
            log.write_lines(result[common:])
        else:
            log.clear()
            log.write_lines(result)
        self.lines = result

    def action_toggle_follow(self) -> None:
        self.following = not self.following
        self.query_one("#log-status", StatusLine).update(
            f"log of job {self.job_id} · {'following' if self.following else 'paused'}"
        )
        self.fetch()


def _tail_fields(job_id: Any) -> dict[str, Any]:
    """A ``logs`` request for the last :data:`LOG_TAIL_BYTES` of rank 0's log."""
    return {"id": str(job_id), "offset": -LOG_TAIL_BYTES, "max_bytes": LOG_TAIL_BYTES}


def _log_lines(reply: Mapping[str, Any]) -> list[str]:
    """The lines of a ``logs`` reply (a list under ``lines``, or text under text/data/log)."""
    lines = reply.get("lines")
    if isinstance(lines, list):
        return [str(line).rstrip("\n") for line in lines]
    for key in ("text", "data", "log", "content"):
        text = reply.get(key)
        if isinstance(text, str):
            out = text.splitlines()
            size, end = as_number(reply.get("size")), as_number(reply.get("offset"))
            if out and size is not None and end is not None and end - len(text.encode()) > 0:
                out = out[1:]  # the chunk starts mid-line
            return out
    return []


def fmt_progress_text(value: float | None) -> str:
    from pollux_local.tui.view import fmt_progress

    return fmt_progress(value)


def job_row_safe(detail: Mapping[str, Any]) -> JobRow:
    from pollux_local.tui.view import job_row

    return job_row(detail)


def decisions_text(decisions: Any) -> Text:
    """Recent decisions, newest first: time, what changed, and the policy's reason."""
    text = Text()
    items = [d for d in decisions if isinstance(d, Mapping)] if isinstance(decisions, list) else []
    if not items:
        text.append("no decisions recorded yet", style="italic")
        return text
    items.sort(key=lambda d: as_number(d.get("time")) or 0.0, reverse=True)
    for item in items[:30]:
        t = as_number(item.get("time"))
        stamp = time.strftime("%H:%M:%S", time.localtime(t)) if t is not None else "--:--:--"
        text.append(stamp + " ", style="dim")
        kind = item.get("kind")
        if kind:
            text.append(f"{kind} ", style="bold")
        placement = item.get("placement")
        if isinstance(placement, Mapping):
            text.append(fmt_placement(placement) + " ")
        elif placement not in (None, "", [], ()):
            text.append(f"{placement} ")
        elif item.get("replicas") is not None:
            text.append(f"{item.get('replicas')} dev ")
        batch = item.get("batch")
        if isinstance(batch, Mapping):
            parts = [batch.get(k) for k in ("local_batch", "accum_steps", "replicas")]
            if all(p is not None for p in parts):
                text.append("batch {}×{}×{} ".format(*parts))
        elif batch not in (None, ""):
            text.append(f"batch {batch} ")
        text.append(str(item.get("reason") or ""), style="italic")
        text.append("\n")
    return text


class PolluxApp(App[None]):
    """The live view of a pollux-local daemon."""

    TITLE = "pollux-local"
    CSS = """
    #top { height: 15; }
    #grid-box { width: 1fr; height: 100%; border: round $primary-darken-2; padding: 0 1; }
    #cluster-panel { width: 56; height: 100%; border: round $primary-darken-2; }
    #cluster-figures { height: 3; }
    #cluster-plot { height: 1fr; min-height: 8; }
    #jobs { height: 1fr; border: round $primary-darken-2; }
    #filter { dock: bottom; display: none; }
    #filter.visible { display: block; }
    """
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("q", "quit", "Quit"),
        Binding("question_mark", "help", "Help"),
        Binding("d", "detail", "Detail", show=False),
        Binding("n", "submit", "Submit"),
        *_job_actions_bindings(),
        Binding("s", "sort_next", "Sort"),
        Binding("S", "sort_reverse", "Reverse", show=False),
        Binding("slash", "filter", "Filter"),
        Binding("r", "refresh_now", "Refresh", show=False),
        Binding("j", "cursor(1)", "Down", show=False),
        Binding("k", "cursor(-1)", "Up", show=False),
    ]

    def __init__(
        self,
        source: DataSource,
        *,
        refresh_s: float = 2.0,
        sync: bool = False,
        clock: Callable[[], float] = time.time,
        workdir: str | None = None,
    ) -> None:
        super().__init__()
        self.source = source
        self.refresh_s = refresh_s
        self.sync = sync
        self.clock = clock
        self.workdir = workdir
        self.status: dict[str, Any] = {}
        self.nodes: dict[str, Any] = {}
        self.rows: list[JobRow] = []
        self.cells: list[NodeCells] = []
        self.samples: deque[ClusterSample] = deque(maxlen=HISTORY_SAMPLES)
        self.connected: bool | None = None
        self.last_error: str | None = None
        self.sort_key = "id"
        self.sort_reverse = False
        self.job_filter = JobFilter()
        self._raw_ids: dict[str, Any] = {}
        self._last_refresh: float | None = None

    # ---------------------------------------------------------------- layout

    def compose(self) -> ComposeResult:
        yield StatusLine("connecting…", id="status")
        with Horizontal(id="top"):
            with VerticalScroll(id="grid-box"):
                yield DeviceGrid(id="grid")
            with Vertical(id="cluster-panel"):
                yield Static("", id="cluster-figures")
                yield PlotView(id="cluster-plot")
        yield JobTable(id="jobs")
        yield Input(placeholder="filter: owner:NAME state:running,queued words…", id="filter")
        yield Footer()

    def on_mount(self) -> None:
        table = self._q("#jobs", JobTable)
        self._q("#grid-box").border_title = "devices"
        self._q("#cluster-panel").border_title = "cluster"
        self._q("#jobs").border_title = "jobs"
        table.focus()
        self.refresh_data()
        self.set_interval(self.refresh_s, self.refresh_data)

    def _q(self, selector: str, expect_type: type[Any] | None = None) -> Any:
        """A widget of the main screen (whatever screen is on top)."""
        base = self.screen_stack[0] if self.screen_stack else self.screen
        return (
            base.query_one(selector)
            if expect_type is None
            else base.query_one(selector, expect_type)
        )

    # ---------------------------------------------------------------- requests

    def run_request(
        self,
        call: Callable[[], Any],
        done: Callable[[Any], None],
        group: str = "request",
    ) -> None:
        """Run ``call`` (blocking I/O) off the UI thread, then ``done(result or exception)``."""
        if self.sync:
            try:
                result = call()
            except SourceError as exc:
                result = exc
            self._deliver(done, result)
            return
        self._threaded(call, done, group)

    @staticmethod
    def _deliver(done: Callable[[Any], None], result: Any) -> None:
        with contextlib.suppress(NoMatches):  # the screen that asked was closed meanwhile
            done(result)

    def _threaded(self, call: Callable[[], Any], done: Callable[[Any], None], group: str) -> None:
        def job() -> None:
            try:
                result = call()
            except SourceError as exc:
                result = exc
            except Exception as exc:  # a bug in a reply must not kill the app
                result = SourceError(f"{type(exc).__name__}: {exc}")
            with contextlib.suppress(Exception):  # the app is shutting down
                self.call_from_thread(self._deliver, done, result)

        self.run_worker(job, thread=True, group=group, exclusive=True, exit_on_error=False)

    def refresh_data(self) -> None:
        self.run_request(self._load, self._loaded, group="refresh")

    def _load(self) -> tuple[dict[str, Any], dict[str, Any], str | None]:
        status = self.source.request("status")
        try:
            nodes = self.source.request("nodes")
            note = None
        except DaemonDown:
            raise
        except SourceError as exc:
            nodes, note = {}, f"nodes: {exc}"
        return status, nodes, note

    def _loaded(
        self, result: tuple[dict[str, Any], dict[str, Any], str | None] | BaseException
    ) -> None:
        line = self._q("#status", StatusLine)
        if isinstance(result, BaseException):
            self.connected = not isinstance(result, DaemonDown)
            self.last_error = str(result)
            line.set_class(not self.connected, "down")
            self.update_status_line()
            return
        self.connected = True
        line.remove_class("down")
        self.status, self.nodes, self.last_error = result
        self._last_refresh = self.clock()
        self.apply_data()

    def apply_data(self) -> None:
        """Recompute rows, grid and cluster figures from the last replies and redraw."""
        self.rows = job_rows(self.status)
        jobs = self.status.get("jobs")
        self._raw_ids = {
            str(job.get("id")): job.get("id")
            for job in (jobs if isinstance(jobs, list) else [])
            if isinstance(job, Mapping)
        }
        self.cells = node_cells(self.nodes, self.status)
        now = self.clock()
        cluster = self.status.get("cluster")
        seeded = (
            samples_from_history(cluster.get("history")) if isinstance(cluster, Mapping) else []
        )
        if seeded:
            self.samples = deque(seeded, maxlen=HISTORY_SAMPLES)
        else:
            sample = cluster_sample(self.rows, self.cells, now)
            if self.samples and self.samples[-1].time == now:
                self.samples.pop()
            self.samples.append(sample)
        self.render_main()

    def render_main(self) -> None:
        names = {row.id: row.name for row in self.rows}
        self._q("#grid", DeviceGrid).update_grid(self.cells, names)
        self.update_table()
        self.update_cluster_panel()
        self.update_status_line()

    def visible_rows(self) -> list[JobRow]:
        return sort_rows(filter_rows(self.rows, self.job_filter), self.sort_key, self.sort_reverse)

    def update_table(self) -> None:
        self._q("#jobs", JobTable).set_rows(self.visible_rows(), self.sort_key, self.sort_reverse)

    def update_cluster_panel(self) -> None:
        last = self.samples[-1] if self.samples else None
        figures = Text()
        if last is not None:
            util = "-" if last.utilisation is None else f"{100 * last.utilisation:.0f}%"
            eff = "-" if last.efficiency is None else f"{last.efficiency:.2f}"
            figures.append(f"utilisation {util} ({last.devices_busy}/{last.devices_up} devices)\n")
            figures.append(f"efficiency {eff} · goodput {fmt_number(last.goodput)} ex/s\n")
            figures.append(f"running {last.running} · queue {last.queued}")
        self._q("#cluster-figures", Static).update(figures)
        samples = list(self.samples)
        self._q("#cluster-plot", PlotView).show(
            plots.cluster_plot(
                [s.time for s in samples],
                [s.goodput for s in samples],
                [s.efficiency for s in samples],
                [s.utilisation for s in samples],
            )
        )

    def update_status_line(self) -> None:
        line = self._q("#status", StatusLine)
        parts = [f"pollux-local · {self.source.description}"]
        if self.connected is None:
            parts.append("connecting…")
        elif not self.connected:
            parts.append(f"DAEMON DOWN: {self.last_error} — retrying every {self.refresh_s:g} s")
        else:
            shown = len(filter_rows(self.rows, self.job_filter))
            parts.append(
                f"{len(self.rows)} jobs" + ("" if self.job_filter.empty else f" ({shown} shown)")
            )
            if not self.job_filter.empty:
                parts.append(f"filter {self.job_filter.describe()}")
            parts.append(f"sort {self.sort_key}{' ↓' if self.sort_reverse else ''}")
            if self.last_error:
                parts.append(f"error: {self.last_error}")
        line.update(" · ".join(parts))

    def device_counts(self) -> tuple[int, int]:
        """(devices up in the cluster, most devices on one node), at least (1, 1)."""
        up = [sum(1 for d in n.devices if d.status != "down") for n in self.cells]
        return max(sum(up), 1), max(up + [1])

    # ---------------------------------------------------------------- selection

    def selected_job_id(self) -> str | None:
        try:
            return self._q("#jobs", JobTable).selected_id
        except NoMatches:
            return None

    def _selected(self) -> tuple[Any, str] | None:
        job_id = self.selected_job_id()
        if job_id is None:
            self.notify("no job selected", severity="warning")
            return None
        name = next((r.name for r in self.rows if r.id == job_id), job_id)
        return self._raw_ids.get(job_id, job_id), f"{job_id} ({name})"

    # ---------------------------------------------------------------- actions

    def action_cursor(self, delta: int) -> None:
        self._q("#jobs", JobTable).action_move(delta)

    def action_refresh_now(self) -> None:
        self.refresh_data()

    def action_help(self) -> None:
        self.push_screen(HelpScreen())

    def action_detail(self) -> None:
        selected = self._selected()
        if selected is not None:
            self.push_screen(JobScreen(selected[0]))

    @on(JobTable.Selected)
    def _row_selected(self, event: JobTable.Selected) -> None:
        self.push_screen(JobScreen(self._raw_ids.get(event.job_id, event.job_id)))

    @on(JobTable.HeaderClicked)
    def _header_selected(self, event: JobTable.HeaderClicked) -> None:
        key = event.key
        if key in SORT_KEYS:
            if key == self.sort_key:
                self.sort_reverse = not self.sort_reverse
            else:
                self.sort_key, self.sort_reverse = key, False
            self.update_table()
            self.update_status_line()

    def action_sort_next(self) -> None:
        index = SORT_KEYS.index(self.sort_key)
        self.sort_key = SORT_KEYS[(index + 1) % len(SORT_KEYS)]
        self.update_table()
        self.update_status_line()

    def action_sort_reverse(self) -> None:
        self.sort_reverse = not self.sort_reverse
        self.update_table()
        self.update_status_line()

    def action_filter(self) -> None:
        box = self._q("#filter", Input)
        box.value = self.job_filter.describe()
        box.add_class("visible")
        box.focus()

    @on(Input.Submitted, "#filter")
    def _filter_submitted(self, event: Input.Submitted) -> None:
        self.job_filter = JobFilter.parse(event.value)
        event.input.remove_class("visible")
        self._q("#jobs", JobTable).focus()
        self.update_table()
        self.update_status_line()

    def on_key(self, event: Any) -> None:
        box = self._q("#filter", Input)
        if event.key == "escape" and box.has_focus:
            box.remove_class("visible")
            self._q("#jobs", JobTable).focus()
            event.stop()

    def action_submit(self) -> None:
        import os

        def submitted(fields: dict[str, Any] | None) -> None:
            if fields:
                self.act("submit", None, **fields)

        self.push_screen(SubmitScreen(self.workdir or os.getcwd()), submitted)

    def action_cancel_job(self) -> None:
        selected = self._selected()
        if selected is not None:
            self.confirm_and_act("cancel", *selected)

    def action_hold_job(self) -> None:
        selected = self._selected()
        if selected is not None:
            self.confirm_and_act("hold", *selected)

    def action_release_job(self) -> None:
        selected = self._selected()
        if selected is not None:
            self.act("release", selected[0])

    def action_priority_job(self) -> None:
        selected = self._selected()
        if selected is not None:
            current = next((r.priority for r in self.rows if r.id == str(selected[0])), None)
            self.ask_priority(selected[0], selected[1], current)

    def action_follow_logs(self) -> None:
        selected = self._selected()
        if selected is not None:
            self.push_screen(LogScreen(selected[0]))

    def confirm_and_act(self, action: str, job_id: Any, label: str) -> None:
        """Ask before ``action`` (cancel/hold) on ``job_id``; act only on yes."""
        question = {
            "cancel": f"Cancel job {label}? Its replicas are stopped and it will not run again.",
            "hold": f"Hold job {label}? Its replicas are stopped (checkpointed) until released.",
        }.get(action, f"{action} job {label}?")

        def answered(yes: bool | None) -> None:
            if yes:
                self.act(action, job_id)

        self.push_screen(ConfirmScreen(question), answered)

    def ask_priority(self, job_id: Any, label: str, current: int | None) -> None:
        def answered(value: int | None) -> None:
            if value is not None:
                self.act("set_priority", job_id, priority=value)

        self.push_screen(PriorityScreen(label, current), answered)

    def act(self, action: str, job_id: Any, **fields: Any) -> None:
        """Send an action request; show the daemon's answer (or error) and refresh."""
        if action == "cancel":
            fields = {"ids": [str(job_id)], **fields}
        elif job_id is not None:
            fields = {"id": str(job_id), **fields}

        def call() -> dict[str, Any]:
            return self.source.request(action, **fields)

        def done(result: dict[str, Any] | BaseException) -> None:
            if isinstance(result, BaseException):
                self.notify(f"{action} failed: {result}", severity="error", timeout=8)
                return
            what = (
                f"job {result['id']} submitted"
                if action == "submit" and "id" in result
                else (f"{action.replace('_', ' ')} {job_id}: done")
            )
            self.notify(what)
            self.refresh_data()

        self.run_request(call, done, group=f"action-{action}")
