"""Follows a job's log (rank 0), re-reading its tail while following."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, cast

from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.screen import Screen
from textual.widgets import Footer, Log

from pollux_local.api.errors import DaemonUnavailable
from pollux_local.tui.literal import literal, plain_lines
from pollux_local.tui.view import LOG_FOLLOW_LINES, log_lines, tail_request
from pollux_local.tui.widgets.status_line import StatusLine

if TYPE_CHECKING:
    from pollux_local.tui.app import PolluxApp


class LogScreen(Screen[None]):
    """Follows a job's log: re-reads the tail every refresh."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape,q", "app.pop_screen", "Back"),
        Binding("f", "toggle_follow", "Pause/follow"),
    ]

    def __init__(self, job_id: str) -> None:
        super().__init__()
        self.job_id = job_id
        self.following = True
        self.lines: list[str] = []

    @property
    def pollux(self) -> PolluxApp:
        return cast("PolluxApp", self.app)

    def compose(self) -> ComposeResult:
        yield StatusLine(literal(f"log of job {self.job_id} · following"), id="log-status")
        yield Log(id="log", auto_scroll=True)
        yield Footer()

    def on_mount(self) -> None:
        self.fetch()
        self.set_interval(max(0.5, self.pollux.refresh_s / 2), self.fetch)

    def fetch(self) -> None:
        if self.following:
            self.pollux.run_request(self._load, self._loaded, group=f"log-{self.job_id}")

    def _load(self) -> list[str]:
        reply = self.pollux.source.call(tail_request(self.job_id))
        return log_lines(reply)[-LOG_FOLLOW_LINES:]

    def _loaded(self, result: list[str] | BaseException) -> None:
        status = self.query_one("#log-status", StatusLine)
        if isinstance(result, BaseException):
            status.set_class(isinstance(result, DaemonUnavailable), "down")
            status.update(literal(f"log of job {self.job_id} · {result}"))
            return
        status.remove_class("down")
        status.update(literal(f"log of job {self.job_id} · {self.mode()}"))
        if result == self.lines:
            return
        log = self.query_one("#log", Log)
        common = len(self.lines)
        if self.lines and result[: len(self.lines)] == self.lines:
            log.write_lines(plain_lines(result[common:]))
        else:
            log.clear()
            log.write_lines(plain_lines(result))
        self.lines = result

    def mode(self) -> str:
        return "following" if self.following else "paused"

    def action_toggle_follow(self) -> None:
        self.following = not self.following
        self.query_one("#log-status", StatusLine).update(
            literal(f"log of job {self.job_id} · {self.mode()}")
        )
        self.fetch()
