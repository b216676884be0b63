"""The pollux-local Textual app: key bindings, screen wiring and the refresh timer.

Data comes from a :class:`~pollux_local.tui.source.DataSource`.  Requests are made in worker
threads (``sync=False``, the default) so that a slow or dead daemon never blocks input; with
canned data (tests, screenshots) ``sync=True`` makes them inline.  The screens are in
``tui/screens/`` (one per file, each with its stylesheet beside it), the widgets in
``tui/widgets/``.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections import deque
from collections.abc import Callable
from typing import Any, ClassVar

from textual.app import App
from textual.binding import Binding, BindingType
from textual.css.query import NoMatches
from textual.notifications import SeverityLevel

from pollux_local.api.errors import DaemonUnavailable, PolluxError
from pollux_local.api.messages import (
    Cancel,
    CancelReply,
    Hold,
    Nodes,
    NodesReply,
    Release,
    Reply,
    Request,
    SetPriority,
    StatusReply,
    Submit,
    SubmitReply,
    Usage,
    UsageReply,
)
from pollux_local.client import job_list
from pollux_local.tui.literal import literal, plain
from pollux_local.tui.screens.confirm import ConfirmScreen
from pollux_local.tui.screens.help import HelpScreen
from pollux_local.tui.screens.job_detail import JobScreen, job_actions_bindings
from pollux_local.tui.screens.logs import LogScreen
from pollux_local.tui.screens.main import MainScreen
from pollux_local.tui.screens.priority import PriorityScreen
from pollux_local.tui.screens.submit import SubmitScreen
from pollux_local.tui.source import DataSource
from pollux_local.tui.view import (
    ClusterSample,
    JobRow,
    NodeCells,
    cluster_sample,
    job_rows,
    node_cells,
)

#: Samples of cluster-wide figures kept for the cluster plot.
HISTORY_SAMPLES = 720
#: Seconds between two ``usage`` requests (the accounting reads the whole job history).
USAGE_REFRESH_S = 30.0

#: What each action that asks first asks.
QUESTIONS = {
    "cancel": "Cancel job {}? Its replicas are stopped and it will not run again.",
    "hold": "Hold job {}? Its replicas are stopped (checkpointed) until released.",
}


class PolluxApp(App[None]):
    """The live view of a pollux-local daemon."""

    TITLE = "pollux-local"
    CSS_PATH = "widgets/widgets.tcss"
    #: The main screen is the one mode (a mode's screen loads its own stylesheet).
    MODES: ClassVar[dict[str, Any]] = {"main": MainScreen}
    DEFAULT_MODE = "main"
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("q", "quit", "Quit"),
        Binding("question_mark", "help", "Help"),
        Binding("d", "detail", "Detail", show=False),
        Binding("n", "submit", "Submit"),
        *job_actions_bindings(),
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
        self.status = StatusReply(jobs=[])
        self.nodes = NodesReply(nodes=[])
        #: the accounting shown in the cluster panel (``None``: not known)
        self.usage: UsageReply | None = None
        self._usage_at: float | None = None
        self.rows: list[JobRow] = []
        self.cells: list[NodeCells] = []
        self.samples: deque[ClusterSample] = deque(maxlen=HISTORY_SAMPLES)
        self.connected: bool | None = None
        self.last_error: str | None = None
        self._refreshing = False

    @property
    def main(self) -> MainScreen:
        """The main screen (at the bottom of the stack, whatever screen is on top)."""
        screen = self.screen_stack[0] if self.screen_stack else self.screen
        assert isinstance(screen, MainScreen)
        return screen

    def notify(
        self,
        message: str,
        *,
        title: str = "",
        severity: SeverityLevel = "information",
        timeout: float | None = None,
        markup: bool = False,
    ) -> None:
        """A notification, always shown literally (``markup`` is ignored): what it says may
        quote a job's name or the daemon's error about it."""
        super().notify(
            plain(message), title=plain(title), severity=severity, timeout=timeout, markup=False
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
            except PolluxError as exc:
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
            except PolluxError as exc:
                result = exc
            except Exception as exc:  # a bug must not kill the app
                result = PolluxError(f"{type(exc).__name__}: {exc}")
            with contextlib.suppress(Exception):  # the app is shutting down
                self.call_from_thread(self._deliver, done, result)

        self.run_worker(job, thread=True, group=group, exclusive=True, exit_on_error=False)

    # ---------------------------------------------------------------- the refresh timer

    def start_refreshing(self) -> None:
        """Refresh now and then every ``refresh_s`` (once the main screen is up)."""
        if not self._refreshing:
            self._refreshing = True
            self.refresh_data()
            self.set_interval(self.refresh_s, self.refresh_data)

    def refresh_data(self) -> None:
        self.run_request(self._load, self._loaded, group="refresh")

    def _load(self) -> tuple[StatusReply, NodesReply | None, str | None]:
        status = job_list(self.source.call)
        try:
            nodes = self.source.call(Nodes())
        except DaemonUnavailable:
            raise
        except PolluxError as exc:
            return status, None, f"nodes: {exc}"
        self._load_usage()
        return status, nodes, None

    def _load_usage(self) -> None:
        """Ask for the accounting at most every :data:`USAGE_REFRESH_S`; a daemon that does not
        give it leaves the panel's usage unknown (not an error of the view)."""
        now = self.clock()
        if self._usage_at is not None and now - self._usage_at < USAGE_REFRESH_S:
            return
        self._usage_at = now
        try:
            self.usage = self.source.call(Usage())
        except DaemonUnavailable:
            raise
        except PolluxError:
            self.usage = None

    def _loaded(
        self, result: tuple[StatusReply, NodesReply | None, str | None] | BaseException
    ) -> None:
        if isinstance(result, BaseException):
            self.connected = not isinstance(result, DaemonUnavailable)
            self.last_error = str(result)
            self.main.update_status_line()
            return
        self.connected = True
        self.status, nodes, self.last_error = result
        self.nodes = nodes if nodes is not None else NodesReply(nodes=[])
        self.apply_data()

    def apply_data(self) -> None:
        """Recompute rows, grid and cluster figures from the last replies and redraw."""
        now = self.clock()
        self.rows = job_rows(self.status, now)
        self.cells = node_cells(self.nodes.nodes)
        if self.samples and self.samples[-1].time == now:
            self.samples.pop()
        self.samples.append(cluster_sample(self.rows, self.cells, now))
        self.main.render_all()

    def device_counts(self) -> tuple[int, int]:
        """(devices up in the cluster, most devices on one node), at least (1, 1)."""
        up = [sum(1 for d in n.devices if d.status != "down") for n in self.cells]
        return max(sum(up), 1), max(up + [1])

    # ---------------------------------------------------------------- screens

    def _selected(self) -> tuple[str, str] | None:
        """The selected job's id and a label naming it, or ``None`` (said) when none is."""
        job_id = self.main.selected_job_id()
        if job_id is None:
            self.notify("no job selected", severity="warning")
            return None
        name = next((r.name for r in self.rows if r.id == job_id), job_id)
        return job_id, f"{job_id} ({name})"

    def show_job(self, job_id: str) -> None:
        self.push_screen(JobScreen(job_id))

    def show_logs(self, job_id: str) -> None:
        self.push_screen(LogScreen(job_id))

    def action_help(self) -> None:
        self.push_screen(HelpScreen())

    def action_detail(self) -> None:
        selected = self._selected()
        if selected is not None:
            self.show_job(selected[0])

    def action_follow_logs(self) -> None:
        selected = self._selected()
        if selected is not None:
            self.show_logs(selected[0])

    def action_cursor(self, delta: int) -> None:
        self.main.table.action_move(delta)

    def action_refresh_now(self) -> None:
        self.refresh_data()

    def action_sort_next(self) -> None:
        self.main.sort_next()

    def action_sort_reverse(self) -> None:
        self.main.sort_reversed()

    def action_filter(self) -> None:
        self.main.open_filter()

    # ---------------------------------------------------------------- actions on jobs

    def action_submit(self) -> None:
        def submitted(request: Submit | None) -> None:
            if request is not None:
                self.act(request, "submit")

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
            self.act(Release(id=selected[0]), f"release {selected[0]}")

    def action_priority_job(self) -> None:
        selected = self._selected()
        if selected is not None:
            current = next((r.priority for r in self.rows if r.id == selected[0]), None)
            self.ask_priority(selected[0], selected[1], current)

    def confirm_and_act(self, action: str, job_id: str, label: str) -> None:
        """Ask before ``action`` (``cancel`` or ``hold``) on ``job_id``; act only on yes."""
        request: Request[Any] = Cancel(ids=[job_id]) if action == "cancel" else Hold(id=job_id)

        def answered(yes: bool | None) -> None:
            if yes:
                self.act(request, f"{action} {job_id}")

        self.push_screen(ConfirmScreen(literal(QUESTIONS[action].format(label))), answered)

    def ask_priority(self, job_id: str, label: str, current: int | None) -> None:
        def answered(value: int | None) -> None:
            if value is not None:
                self.act(SetPriority(id=job_id, priority=value), f"set priority {job_id}")

        self.push_screen(PriorityScreen(literal(label), current), answered)

    def act(self, request: Request[Any], what: str) -> None:
        """Send an action request; say how it went (the daemon's error if it refused) and
        refresh."""

        def done(result: Reply | BaseException) -> None:
            if isinstance(result, BaseException):
                self.notify(f"{what} failed: {result}", severity="error", timeout=8)
                return
            if isinstance(result, SubmitReply):
                self.notify(f"job {result.id} submitted ({result.state})")
            elif isinstance(result, CancelReply) and result.skipped:
                skipped = ", ".join(f"{s.id} ({s.state})" for s in result.skipped)
                self.notify(f"{what}: not cancelled, already ended: {skipped}", severity="warning")
            else:
                self.notify(f"{what}: done")
            self.refresh_data()

        self.run_request(lambda: self.source.call(request), done, group=f"action-{what}")
