"""One job: its fitted throughput model, efficiency curve, history, decisions and log tail."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar, cast

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal, VerticalScroll
from textual.screen import Screen
from textual.widgets import Footer, Log, Static

from pollux_local.api.errors import DaemonUnavailable, PolluxError
from pollux_local.api.messages import DecisionRecord, Release, Show, ShowReply
from pollux_local.tui import plots
from pollux_local.tui.literal import Part, literal, literal_parts, plain_lines
from pollux_local.tui.view import (
    LOG_TAIL_LINES,
    WAITING_STATES,
    JobRow,
    fmt_duration,
    fmt_number,
    fmt_placement,
    fmt_progress,
    job_colour,
    job_row,
    log_lines,
    tail_request,
)
from pollux_local.tui.widgets.plot_view import PlotView
from pollux_local.tui.widgets.status_line import StatusLine

if TYPE_CHECKING:
    from pollux_local.tui.app import PolluxApp


def job_actions_bindings() -> list[BindingType]:
    """The keys that act on a job, on the main screen and on the job's own screen."""
    return [
        Binding("c", "cancel_job", "Cancel"),
        Binding("h", "hold_job", "Hold"),
        Binding("u", "release_job", "Release"),
        Binding("p", "priority_job", "Priority"),
        Binding("l", "follow_logs", "Logs"),
    ]


def decisions_text(decisions: Sequence[DecisionRecord]) -> Text:
    """Recent decisions, newest first: time, what was decided, where, and the reason (a
    decision's reason may quote a job's last log line: shown literally)."""
    if not decisions:
        return literal("no decisions recorded yet", "italic")
    parts: list[Part] = []
    for item in sorted(decisions, key=lambda d: d.time, reverse=True)[:30]:
        parts.append((time.strftime("%H:%M:%S ", time.localtime(item.time)), "dim"))
        parts.append((f"{item.kind} ", "bold"))
        if item.placement:
            parts.append(fmt_placement(item.placement) + " ")
        batch = [item.batch.get(k) for k in ("local_batch", "accum_steps", "replicas")]
        if all(p is not None for p in batch):
            parts.append("batch {}×{}×{} ".format(*batch))
        parts += [(item.reason, "italic"), "\n"]
    return literal_parts(*parts)


def summary_text(row: JobRow, noise: float | None) -> Text:
    """The job's name, id, owner and state, then its figures; a queued job's expected start
    and finish (``within``: at the latest, an upper bound) and, for a waiting one, what it
    waits for (the name and the reason shown literally)."""
    parts: list[Part] = [
        (f"{row.name} ", f"bold {job_colour(row.id)}"),
        f"({row.id}, {row.owner}) {row.state}   ",
        f"devices {row.gpus} {row.where}   batch {row.batch_text}\n",
        f"goodput {fmt_number(row.goodput)} ex/s   efficiency "
        f"{'-' if row.efficiency is None else f'{row.efficiency:.2f}'}   speedup "
        f"{'-' if row.speedup is None else f'{row.speedup:.2f}x'}   noise scale "
        f"{fmt_number(noise)}   progress {fmt_progress(row.progress)}   ETA "
        f"{fmt_duration(row.eta_s)}   restarts {row.restarts}",
    ]
    if row.state == "queued":
        parts.append(f"\nexpected start {row.start_phrase}   finish {row.finish_text}")
    if row.state in WAITING_STATES and row.reason:
        parts += [
            "\n",
            ("reason: ", "bold"),
            row.reason,
        ]
    return literal_parts(*parts)


class JobScreen(Screen[None]):
    """One job: fitted throughput model, efficiency curve, history, decisions, log tail."""

    CSS_PATH = "job_detail.tcss"
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape,q", "app.pop_screen", "Back"),
        *job_actions_bindings(),
    ]

    def __init__(self, job_id: str) -> None:
        super().__init__()
        self.job_id = job_id
        self.shown: ShowReply | None = None
        self.log_lines: list[str] = []

    @property
    def pollux(self) -> PolluxApp:
        return cast("PolluxApp", self.app)

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
        self.query_one("#job-status", StatusLine).update(literal(f"job {self.job_id}"))
        self.fetch()
        self.set_interval(self.pollux.refresh_s, self.fetch)

    def fetch(self) -> None:
        self.pollux.run_request(self._load, self._loaded, group=f"job-{self.job_id}")

    def _load(self) -> tuple[ShowReply, list[str]]:
        source = self.pollux.source
        shown = source.call(Show(id=self.job_id))
        try:
            lines = log_lines(source.call(tail_request(self.job_id)))[-LOG_TAIL_LINES:]
        except DaemonUnavailable:
            raise
        except PolluxError as exc:
            lines = [f"(logs unavailable: {exc})"]
        return shown, lines

    def _loaded(self, result: tuple[ShowReply, list[str]] | BaseException) -> None:
        status = self.query_one("#job-status", StatusLine)
        if isinstance(result, BaseException):
            down = isinstance(result, DaemonUnavailable)
            status.set_class(down, "down")
            status.update(
                literal(
                    f"job {self.job_id} · {'daemon down, retrying: ' if down else 'error: '}"
                    f"{result}"
                )
            )
            return
        status.remove_class("down")
        self.shown, lines = result
        self.show_detail(lines)

    def show_detail(self, lines: list[str]) -> None:
        if self.shown is None:
            return
        detail = self.shown.job
        row = job_row(detail, self.pollux.clock())
        status = self.query_one("#job-status", StatusLine)
        status.update(literal(f"job {row.id} · {row.name} · {row.owner} · {row.state}"))
        self.query_one("#summary", Static).update(summary_text(row, detail.noise_scale))
        max_devices, per_node = self.pollux.device_counts()
        self.query_one("#plot-throughput", PlotView).show(
            plots.throughput_plot(detail, max_devices, per_node)
        )
        self.query_one("#plot-efficiency", PlotView).show(plots.efficiency_plot(detail))
        self.query_one("#plot-history", PlotView).show(plots.history_plot(detail))
        self.query_one("#decisions", Static).update(decisions_text(self.shown.decisions))
        if lines != self.log_lines:
            self.log_lines = lines
            log = self.query_one("#log-tail", Log)
            log.clear()
            log.write_lines(plain_lines(lines))

    def label(self) -> str:
        """``12 (name)``: the job as the questions about it name it."""
        return f"{self.job_id} ({self.shown.job.name})" if self.shown is not None else self.job_id

    def action_cancel_job(self) -> None:
        self.pollux.confirm_and_act("cancel", self.job_id, self.label())

    def action_hold_job(self) -> None:
        self.pollux.confirm_and_act("hold", self.job_id, self.label())

    def action_release_job(self) -> None:
        self.pollux.act(Release(id=self.job_id), f"release {self.job_id}")

    def action_priority_job(self) -> None:
        priority = self.shown.job.priority if self.shown is not None else None
        self.pollux.ask_priority(self.job_id, self.label(), priority)

    def action_follow_logs(self) -> None:
        self.pollux.show_logs(self.job_id)
