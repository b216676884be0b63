"""The main screen: the device grid, the cluster's figures and plot, and the jobs table."""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

from rich.text import Text
from textual import events, on
from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.css.query import NoMatches
from textual.screen import Screen
from textual.widgets import Footer, Input, Static

from pollux_local.api.messages import UsageReply
from pollux_local.tui import plots
from pollux_local.tui.literal import literal, literal_parts
from pollux_local.tui.view import (
    SORT_KEYS,
    ClusterSample,
    JobFilter,
    JobRow,
    filter_rows,
    fmt_number,
    sort_rows,
    usage_lines,
)
from pollux_local.tui.widgets.device_grid import DeviceGrid
from pollux_local.tui.widgets.job_table import JobTable
from pollux_local.tui.widgets.plot_view import PlotView
from pollux_local.tui.widgets.status_line import StatusLine

if TYPE_CHECKING:
    from pollux_local.tui.app import PolluxApp


#: The cluster panel's text width before it is laid out (its CSS width less the border).
USAGE_WIDTH = 54


def cluster_figures(last: ClusterSample | None, usage: UsageReply | None, width: int) -> Text:
    """The cluster panel's text: the last sample's figures, then the accounting (user names
    shown literally)."""
    lines = []
    if last is not None:
        util = "-" if last.utilisation is None else f"{100 * last.utilisation:.0f}%"
        eff = "-" if last.efficiency is None else f"{last.efficiency:.2f}"
        lines += [
            f"utilisation {util} ({last.devices_busy}/{last.devices_up} devices)",
            f"efficiency {eff} · goodput {fmt_number(last.goodput)} ex/s",
            f"running {last.running} · queue {last.queued}",
        ]
    return literal_parts("".join(line + "\n" for line in lines),
                         ("\n".join(usage_lines(usage, width)), "dim"))  # fmt: skip


class MainScreen(Screen[None]):
    """What the app shows first; it draws the app's last refresh and owns sort and filter."""

    CSS_PATH = "main.tcss"

    def __init__(self) -> None:
        super().__init__()
        self.sort_key = "id"
        self.sort_reverse = False
        self.job_filter = JobFilter()

    @property
    def pollux(self) -> PolluxApp:
        return cast("PolluxApp", self.app)

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
        self.query_one("#grid-box").border_title = "devices"
        self.query_one("#cluster-panel").border_title = "cluster"
        self.table.border_title = "jobs"
        self.table.focus()
        self.pollux.start_refreshing()

    @property
    def table(self) -> JobTable:
        return self.query_one("#jobs", JobTable)

    # ---------------------------------------------------------------- drawing

    def render_all(self) -> None:
        """Redraw everything from the app's last refresh."""
        app = self.pollux
        names = {row.id: row.name for row in app.rows}
        self.query_one("#grid", DeviceGrid).update_grid(app.cells, names)
        self.update_table()
        self.update_cluster_panel()
        self.update_status_line()

    def visible_rows(self) -> list[JobRow]:
        return sort_rows(
            filter_rows(self.pollux.rows, self.job_filter), self.sort_key, self.sort_reverse
        )

    def update_table(self) -> None:
        self.table.set_rows(self.visible_rows(), self.sort_key, self.sort_reverse)

    def update_cluster_panel(self) -> None:
        samples = list(self.pollux.samples)
        box = self.query_one("#cluster-figures", Static)
        box.update(cluster_figures(samples[-1] if samples else None, self.pollux.usage,
                                   box.size.width or USAGE_WIDTH))  # fmt: skip
        self.query_one("#cluster-plot", PlotView).show(
            plots.cluster_plot(
                [s.time for s in samples],
                [s.goodput for s in samples],
                [s.efficiency for s in samples],
                [s.utilisation for s in samples],
            )
        )

    def update_status_line(self) -> None:
        app = self.pollux
        line = self.query_one("#status", StatusLine)
        line.set_class(app.connected is False, "down")
        parts = [f"pollux-local · {app.source.description}"]
        if app.connected is None:
            parts.append("connecting…")
        elif not app.connected:
            parts.append(f"DAEMON DOWN: {app.last_error} — retrying every {app.refresh_s:g} s")
        else:
            shown = len(filter_rows(app.rows, self.job_filter))
            parts.append(
                f"{len(app.rows)} jobs" + ("" if self.job_filter.empty else f" ({shown} shown)")
            )
            if not self.job_filter.empty:
                parts.append(f"filter {self.job_filter.describe()}")
            parts.append(f"sort {self.sort_key}{' ↓' if self.sort_reverse else ''}")
            if app.last_error:
                parts.append(f"error: {app.last_error}")
        line.update(literal(" · ".join(parts)))

    # ---------------------------------------------------------------- selection

    def selected_job_id(self) -> str | None:
        try:
            return self.table.selected_id
        except NoMatches:
            return None

    @on(JobTable.Selected)
    def _row_selected(self, event: JobTable.Selected) -> None:
        self.pollux.show_job(event.job_id)

    # ---------------------------------------------------------------- sorting and filtering

    def _resorted(self) -> None:
        self.update_table()
        self.update_status_line()

    @on(JobTable.HeaderClicked)
    def _header_clicked(self, event: JobTable.HeaderClicked) -> None:
        if event.key in SORT_KEYS:
            if event.key == self.sort_key:
                self.sort_reverse = not self.sort_reverse
            else:
                self.sort_key, self.sort_reverse = event.key, False
            self._resorted()

    def sort_next(self) -> None:
        index = SORT_KEYS.index(self.sort_key)
        self.sort_key = SORT_KEYS[(index + 1) % len(SORT_KEYS)]
        self._resorted()

    def sort_reversed(self) -> None:
        self.sort_reverse = not self.sort_reverse
        self._resorted()

    def open_filter(self) -> None:
        box = self.query_one("#filter", Input)
        box.value = self.job_filter.describe()
        box.add_class("visible")
        box.focus()

    @on(Input.Submitted, "#filter")
    def _filter_submitted(self, event: Input.Submitted) -> None:
        self.job_filter = JobFilter.parse(event.value)
        event.input.remove_class("visible")
        self.table.focus()
        self._resorted()

    def on_key(self, event: events.Key) -> None:
        box = self.query_one("#filter", Input)
        if event.key == "escape" and box.has_focus:
            box.remove_class("visible")
            self.table.focus()
            event.stop()
