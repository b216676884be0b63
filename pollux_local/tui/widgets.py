"""Widgets of the TUI: the device grid and a plot view."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

from rich.cells import set_cell_size
from rich.segment import Segment
from rich.style import Style
from rich.text import Text
from textual import events
from textual.binding import Binding, BindingType
from textual.geometry import Size
from textual.message import Message
from textual.scroll_view import ScrollView
from textual.strip import Strip
from textual.widget import Widget

from pollux_local.tui.plots import PlotSpec, render
from pollux_local.tui.view import (
    COLUMNS,
    DOWN_COLOUR,
    EXTERNAL_COLOUR,
    FREE_COLOUR,
    DeviceCell,
    JobRow,
    NodeCells,
    job_colour,
)

_CELL_WIDTH = 12


def _cell_text(cell: DeviceCell, names: dict[str, str]) -> tuple[str, str]:
    """(label, style) of one device cell."""
    short = cell.device.split(":")[-1]
    if cell.status == "job" and cell.job is not None:
        label = names.get(cell.job, cell.job)
        return f"{short}:{label}", f"bold white on {job_colour(cell.job)}"
    if cell.status == "external":
        return f"{short}:external", f"white on {EXTERNAL_COLOUR}"
    if cell.status == "down":
        return f"{short}:down", f"white on {DOWN_COLOUR}"
    return f"{short}:free", f"#c0c0c0 on {FREE_COLOUR}"


def grid_text(nodes: Sequence[NodeCells], names: dict[str, str], width: int) -> Text:
    """The device grid as rich text: one block of cells per node, wrapped to ``width``."""
    text = Text(no_wrap=True, overflow="ellipsis")
    if not nodes:
        text.append("no nodes reported", style="italic")
        return text
    label_width = max(len(n.name) for n in nodes) + 1
    per_line = max(1, (width - label_width - 1) // (_CELL_WIDTH + 1))
    for index, node in enumerate(nodes):
        if index:
            text.append("\n")
        style = "bold" if node.up else "bold red"
        text.append(node.name.ljust(label_width), style=style)
        if not node.devices:
            text.append(" (no devices)" if node.up else " down", style="italic")
        for i, cell in enumerate(node.devices):
            if i and i % per_line == 0:
                text.append("\n" + " " * label_width)
            label, cell_style = _cell_text(cell, names)
            text.append(" ")
            text.append(
                label[: _CELL_WIDTH - 1].ljust(_CELL_WIDTH - 1)[:_CELL_WIDTH], style=cell_style
            )
            text.append(" ", style=cell_style)
    text.append("\n")
    text.append("\n")
    for label, colour in (
        ("free", FREE_COLOUR),
        ("external", EXTERNAL_COLOUR),
        ("down", DOWN_COLOUR),
    ):
        text.append("  ", style=f"on {colour}")
        text.append(f" {label}  ")
    text.append("  job = its colour")
    return text


class DeviceGrid(Widget):
    """Every node and device, each coloured by the job that holds it (or free/external/down)."""

    DEFAULT_CSS = """
    DeviceGrid { height: auto; }
    """

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.nodes: Sequence[NodeCells] = ()
        self.names: dict[str, str] = {}

    def update_grid(self, nodes: Sequence[NodeCells], names: dict[str, str]) -> None:
        self.nodes = nodes
        self.names = names
        self.refresh(layout=True)

    def render(self) -> Text:
        return grid_text(self.nodes, self.names, self.size.width or 80)

    def get_content_height(self, container: object, viewport: object, width: int) -> int:
        return len(grid_text(self.nodes, self.names, width).plain.splitlines()) or 1


class PlotView(Widget):
    """Shows one :class:`PlotSpec`, redrawn to the widget's size."""

    DEFAULT_CSS = """
    PlotView { height: 1fr; width: 1fr; }
    """

    def __init__(self, spec: PlotSpec | None = None, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.spec = spec or PlotSpec("", note="loading…")
        self._cache: tuple[int, tuple[int, int], Text] | None = None

    def show(self, spec: PlotSpec) -> None:
        self.spec = spec
        self._cache = None
        self.refresh()

    def render(self) -> Text:
        size = (self.size.width, self.size.height)
        if self._cache is not None and self._cache[0] == id(self.spec) and self._cache[1] == size:
            return self._cache[2]
        text = Text.from_ansi(render(self.spec, *size))
        text.no_wrap = True
        self._cache = (id(self.spec), size, text)
        return text


#: Width of each jobs-table column (the name column takes what is left).
COLUMN_WIDTHS: dict[str, int] = {
    "id": 6,
    "name": 14,
    "owner": 8,
    "state": 10,
    "gpus": 16,
    "batch": 14,
    "goodput": 8,
    "efficiency": 5,
    "speedup": 8,
    "progress": 9,
    "eta": 7,
    "restarts": 4,
}
_HEADER_STYLE = Style(bold=True, color="#e0e0e0", bgcolor="#24344d")
_ROW_STYLES = (Style(color="#d0d0d0", bgcolor="#1e1e1e"), Style(color="#d0d0d0", bgcolor="#262626"))
_CURSOR_STYLE = Style(color="#ffffff", bgcolor="#005f87", bold=True)
_STATE_COLOURS = {
    "running": "#5fd75f",
    "rescaling": "#ffd75f",
    "queued": "#87afd7",
    "held": "#af87ff",
    "failed": "#ff5f5f",
    "succeeded": "#8a8a8a",
    "cancelled": "#8a8a8a",
}


class JobTable(ScrollView, can_focus=True):
    """The jobs table: a header line and one line per job, drawn straight into segments so that
    a refresh of hundreds of jobs costs only the lines on screen (each cached until it changes).
    """

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("up", "move(-1)", "Up", show=False),
        Binding("down", "move(1)", "Down", show=False),
        Binding("pageup", "page(-1)", "Page up", show=False),
        Binding("pagedown", "page(1)", "Page down", show=False),
        Binding("home", "move_to(0)", "First", show=False),
        Binding("end", "move_to(-1)", "Last", show=False),
        Binding("enter", "select", "Detail"),
    ]
    DEFAULT_CSS = """
    JobTable { height: 1fr; }
    """

    class Selected(Message):
        """The user opened a job (enter or double click)."""

        def __init__(self, job_id: str) -> None:
            super().__init__()
            self.job_id = job_id

    class HeaderClicked(Message):
        """The user clicked a column header (to sort by it)."""

        def __init__(self, key: str) -> None:
            super().__init__()
            self.key = key

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.rows: list[JobRow] = []
        self.cursor_row = 0
        self.sort_key = "id"
        self.sort_reverse = False
        self._cache: dict[tuple[Any, ...], Strip] = {}

    # -- data

    @property
    def row_count(self) -> int:
        return len(self.rows)

    def row_ids(self) -> list[str]:
        return [row.id for row in self.rows]

    @property
    def selected_id(self) -> str | None:
        if not self.rows:
            return None
        return self.rows[min(self.cursor_row, len(self.rows) - 1)].id

    def set_rows(self, rows: list[JobRow], sort_key: str, reverse: bool) -> None:
        """Show ``rows`` (already sorted/filtered), keeping the selected job under the cursor."""
        selected = self.selected_id
        self.rows = rows
        self.sort_key, self.sort_reverse = sort_key, reverse
        ids = self.row_ids()
        if selected in ids:
            self.cursor_row = ids.index(selected)
        self.cursor_row = max(0, min(self.cursor_row, len(rows) - 1))
        if len(self._cache) > 4096:
            self._cache.clear()
        self.virtual_size = Size(self.size.width, len(rows) + 1)
        self._scroll_cursor_visible()
        self.refresh()

    # -- drawing

    def _widths(self, width: int) -> list[tuple[str, int]]:
        fixed = sum(w + 1 for k, w in COLUMN_WIDTHS.items() if k != "name") + 1
        name = max(8, width - fixed - 1)
        return [(key, name if key == "name" else COLUMN_WIDTHS[key]) for key, _ in COLUMNS]

    def _header_strip(self, width: int) -> Strip:
        key = ("header", self.sort_key, self.sort_reverse, width)
        strip = self._cache.get(key)
        if strip is None:
            segments = [Segment(" ", _HEADER_STYLE)]
            for (col, w), (_, title) in zip(self._widths(width), COLUMNS, strict=True):
                mark = ("▼" if self.sort_reverse else "▲") if col == self.sort_key else ""
                segments.append(Segment(set_cell_size(title + mark, w) + " ", _HEADER_STYLE))
            strip = Strip(segments).adjust_cell_length(width, _HEADER_STYLE)
            self._cache[key] = strip
        return strip

    def _row_strip(self, index: int, width: int) -> Strip:
        row = self.rows[index]
        cursor = index == self.cursor_row
        key = (row, cursor, index % 2, width)
        strip = self._cache.get(key)
        if strip is None:
            base = _CURSOR_STYLE if cursor else _ROW_STYLES[index % 2]
            segments = [Segment(" ", base)]
            for (col, w), text in zip(self._widths(width), row.cells(), strict=True):
                style = base
                if col == "id" and not cursor:
                    style = base + Style(color=job_colour(row.id), bold=True)
                elif col == "state" and not cursor and row.state in _STATE_COLOURS:
                    style = base + Style(color=_STATE_COLOURS[row.state])
                segments.append(Segment(set_cell_size(text, w), style))
                segments.append(Segment(" ", base))
            strip = Strip(segments).adjust_cell_length(width, base)
            self._cache[key] = strip
        return strip

    def render_line(self, y: int) -> Strip:
        width = self.size.width
        if y == 0:
            return self._header_strip(width)
        index = int(self.scroll_offset.y) + y - 1
        if 0 <= index < len(self.rows):
            return self._row_strip(index, width)
        if not self.rows and y == 2:
            return Strip([Segment("  no jobs to show", Style(italic=True))]).adjust_cell_length(
                width
            )
        return Strip.blank(width)

    # -- movement

    def _visible_rows(self) -> int:
        return max(1, self.size.height - 1)

    def _scroll_cursor_visible(self) -> None:
        top = int(self.scroll_offset.y)
        if self.cursor_row < top:
            self.scroll_to(y=self.cursor_row, animate=False, immediate=True)
        elif self.cursor_row >= top + self._visible_rows():
            self.scroll_to(
                y=self.cursor_row - self._visible_rows() + 1, animate=False, immediate=True
            )

    def move_cursor(self, row: int) -> None:
        if not self.rows:
            return
        self.cursor_row = max(0, min(len(self.rows) - 1, row))
        self._scroll_cursor_visible()
        self.refresh()

    def action_move(self, delta: int) -> None:
        self.move_cursor(self.cursor_row + delta)

    def action_page(self, direction: int) -> None:
        self.move_cursor(self.cursor_row + direction * self._visible_rows())

    def action_move_to(self, row: int) -> None:
        self.move_cursor(row if row >= 0 else len(self.rows) - 1)

    def action_select(self) -> None:
        if self.selected_id is not None:
            self.post_message(self.Selected(self.selected_id))

    def on_click(self, event: events.Click) -> None:
        if event.y == 0:
            x = 1
            for key, w in self._widths(self.size.width):
                if x <= event.x < x + w + 1:
                    self.post_message(self.HeaderClicked(key))
                    return
                x += w + 1
            return
        index = int(self.scroll_offset.y) + event.y - 1
        if 0 <= index < len(self.rows):
            self.move_cursor(index)
            if event.chain >= 2:
                self.action_select()

    def on_resize(self) -> None:
        self.virtual_size = Size(self.size.width, len(self.rows) + 1)
