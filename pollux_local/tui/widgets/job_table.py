"""The jobs table: a header line and one line per job, drawn straight into segments; a waiting
job's line shows its reason across the figures it does not have yet."""

from __future__ import annotations

from typing import Any, ClassVar

from rich.cells import set_cell_size
from rich.segment import Segment
from rich.style import Style
from textual import events
from textual.binding import Binding, BindingType
from textual.geometry import Size
from textual.message import Message
from textual.scroll_view import ScrollView
from textual.strip import Strip

from pollux_local.tui.literal import plain
from pollux_local.tui.view import COLUMNS, SPAN_FROM, SPAN_TO, JobRow, job_colour

#: Width of each jobs-table column (the name column takes what is left).
COLUMN_WIDTHS: dict[str, int] = {
    "id": 6,
    "name": 14,
    "owner": 8,
    "state": 10,
    "gpus": 11,
    "batch": 12,
    "goodput": 7,
    "efficiency": 5,
    "speedup": 7,
    "progress": 9,
    "eta": 7,
    "start": 6,
    "restarts": 3,
}
#: The column that takes the width left over (at least 8).
FLEXIBLE = "name"
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
    Segments are never read as markup; each cell goes through :func:`~pollux_local.tui.literal.
    plain` (control characters escaped).
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
        fixed = sum(w + 1 for k, w in COLUMN_WIDTHS.items() if k != FLEXIBLE) + 1
        rest = max(8, width - fixed - 1)
        return [(key, rest if key == FLEXIBLE else COLUMN_WIDTHS[key]) for key, _ in COLUMNS]

    def _header_strip(self, width: int) -> Strip:
        key = ("header", self.sort_key, self.sort_reverse, width)
        strip = self._cache.get(key)
        if strip is None:
            segments = [Segment(" ", _HEADER_STYLE)]
            for (col, w), (_, title) in zip(self._widths(width), COLUMNS, strict=True):
                mark = ("▼" if self.sort_reverse else "▲") if col == self.sort_key else ""
                segments.append(Segment(set_cell_size(title + mark, w), _HEADER_STYLE))
                segments.append(Segment(" ", _HEADER_STYLE))
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
            span = row.waiting_text
            spanning = False
            for (col, w), text in zip(self._widths(width), row.cells(), strict=True):
                if span is not None and col == SPAN_FROM:
                    spanning, text, w = True, span, self._span_width(width)
                elif spanning:
                    spanning = col != SPAN_TO
                    continue
                style = base
                if col == "id" and not cursor:
                    style = base + Style(color=job_colour(row.id), bold=True)
                elif col == "state" and not cursor and row.state in _STATE_COLOURS:
                    style = base + Style(color=_STATE_COLOURS[row.state])
                elif spanning and not cursor:
                    style = base + Style(italic=True, color="#a8a8a8")
                segments.append(Segment(set_cell_size(plain(text), w), style))
                segments.append(Segment(" ", base))
            strip = Strip(segments).adjust_cell_length(width, base)
            self._cache[key] = strip
        return strip

    def _span_width(self, width: int) -> int:
        """The cells from :data:`SPAN_FROM` to :data:`SPAN_TO` as one (a waiting job's
        reason)."""
        keys = [key for key, _ in COLUMNS]
        inside = keys[keys.index(SPAN_FROM) : keys.index(SPAN_TO) + 1]
        widths = dict(self._widths(width))
        return sum(widths[key] + 1 for key in inside) - 1

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
