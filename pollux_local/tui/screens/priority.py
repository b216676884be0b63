"""Asks for a job's new priority."""

from __future__ import annotations

from typing import ClassVar

from rich.text import Text
from textual import on
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Input, Label

from pollux_local.tui.literal import literal


class PriorityScreen(ModalScreen[int | None]):
    """Asks for a job's new priority (an integer); dismisses with it, or ``None``.  The job's
    label is :class:`Text` (made with ``tui.literal``)."""

    CSS_PATH = "priority.tcss"
    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape", "cancel", "Cancel")]

    def __init__(self, job_label: Text, current: int | None) -> None:
        super().__init__()
        self.job_label = job_label
        self.current = current

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Label(
                Text.assemble("Priority of ", self.job_label, " (integer, higher runs first):")
            )
            yield Input(value="" if self.current is None else str(self.current), id="priority")
            yield Label("", id="error")

    @on(Input.Submitted)
    def _submitted(self, event: Input.Submitted) -> None:
        try:
            value = int(event.value.strip())
        except ValueError:
            self.query_one("#error", Label).update(literal(f"not an integer: {event.value!r}"))
            return
        self.dismiss(value)

    def action_cancel(self) -> None:
        self.dismiss(None)
