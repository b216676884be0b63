"""The submit form: a job's command, devices, batch sizes and priority."""

from __future__ import annotations

import shlex
import sys
from typing import Any, ClassVar, cast

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label

from pollux_local.api.errors import InvalidRequest
from pollux_local.api.messages import Submit
from pollux_local.client import build_request


class SubmitScreen(ModalScreen[Submit | None]):
    """The submit form; dismisses with the ``submit`` request, or ``None`` when abandoned."""

    CSS_PATH = "submit.tcss"
    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape", "cancel", "Cancel")]

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

    def collect(self) -> Submit:
        """The ``submit`` request, validated as the daemon validates it; ``ValueError`` naming
        the field that is wrong."""
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
        script, args = out.pop("script"), out.pop("args", [])
        # a Python script runs under this interpreter, as `pollux-local submit` runs it
        out["argv"] = (
            [sys.executable, "-u", script, *args] if script.endswith(".py") else [script, *args]
        )
        out.setdefault("workdir", self.workdir)
        if not out["workdir"].startswith("/"):
            raise ValueError(f"Working directory: must be an absolute path, got {out['workdir']!r}")
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
        try:
            request = cast(Submit, build_request("submit", **out))
        except InvalidRequest as exc:
            raise ValueError(str(exc)) from None
        return request

    def _try_submit(self) -> None:
        try:
            request = self.collect()
        except ValueError as exc:
            self.query_one("#error", Label).update(str(exc))
            return
        self.dismiss(request)

    @on(Input.Submitted)
    def _submitted(self) -> None:
        self._try_submit()

    @on(Button.Pressed, "#submit")
    def _submit_pressed(self) -> None:
        self._try_submit()

    @on(Button.Pressed, "#cancel")
    def action_cancel(self) -> None:
        self.dismiss(None)
