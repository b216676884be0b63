"""The device grid: every node and device, coloured by the job that holds it."""

from __future__ import annotations

from collections.abc import Sequence

from rich.text import Text
from textual.widget import Widget

from pollux_local.tui.literal import plain
from pollux_local.tui.view import (
    DOWN_COLOUR,
    EXTERNAL_COLOUR,
    FREE_COLOUR,
    DeviceCell,
    NodeCells,
    job_colour,
)

_CELL_WIDTH = 12


def _cell_text(cell: DeviceCell, names: dict[str, str]) -> tuple[str, str]:
    """(label, style) of one device cell; the job's name as :func:`plain` makes it."""
    short = plain(cell.device.split(":")[-1])
    if cell.status == "job" and cell.job is not None:
        label = plain(names.get(cell.job, cell.job))
        return f"{short}:{label}", f"bold white on {job_colour(cell.job)}"
    if cell.status == "external":
        return f"{short}:external", f"white on {EXTERNAL_COLOUR}"
    if cell.status == "down":
        return f"{short}:down", f"white on {DOWN_COLOUR}"
    return f"{short}:free", f"#c0c0c0 on {FREE_COLOUR}"


def grid_text(nodes: Sequence[NodeCells], names: dict[str, str], width: int) -> Text:
    """The device grid as rich text: one block of cells per node (its name and its devices'
    type), wrapped to ``width``."""
    text = Text(no_wrap=True, overflow="ellipsis")
    if not nodes:
        text.append("no nodes reported", style="italic")
        return text
    labels = [plain(f"{n.name} {n.device_type}".strip()) for n in nodes]
    label_width = max(len(label) for label in labels) + 1
    per_line = max(1, (width - label_width - 1) // (_CELL_WIDTH + 1))
    for index, node in enumerate(nodes):
        if index:
            text.append("\n")
        style = "bold" if node.up else "bold red"
        name = plain(node.name)
        text.append(name, style=style)
        text.append(plain(f" {node.device_type}").ljust(label_width - len(name)), style="dim")
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
