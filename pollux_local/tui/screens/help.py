"""The help screen: every key and what the colours and figures mean."""

from __future__ import annotations

from typing import ClassVar

from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Label, Static

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
    CSS_PATH = "help.tcss"
    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape,q,question_mark", "close", "Close")]

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Static(HELP_TEXT, id="help-text")
            yield Label("[dim]escape closes[/dim]")

    def action_close(self) -> None:
        self.dismiss(None)
