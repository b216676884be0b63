"""The submit form: a job's command, devices, batch sizes, priority, retries and earliest
start."""

from __future__ import annotations

import os
import shlex
import time
from pathlib import Path
from typing import Any, ClassVar

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label

from pollux_local.api.errors import PolluxError
from pollux_local.api.messages import Submit
from pollux_local.parsing import parse_begin
from pollux_local.submission import SubmitOptions, build_submit, uses_job_library
from pollux_local.tui.literal import literal


class SubmitScreen(ModalScreen[Submit | None]):
    """The submit form; dismisses with the ``submit`` request, or ``None`` when abandoned."""

    CSS_PATH = "submit.tcss"
    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape", "cancel", "Cancel")]

    #: (field id, label, placeholder, kind) — kind: "text", "int", "args" or "begin" (a time
    #: as ``--begin`` takes it).
    FIELDS: ClassVar[tuple[tuple[str, str, str, str], ...]] = (
        ("script", "Script *", "train.py", "text"),
        ("args", "Arguments", "--epochs 10", "args"),
        ("name", "Name", "(the script's name)", "text"),
        ("min_gpus", "Min devices", "1", "int"),
        ("max_gpus", "Max devices", "(all)", "int"),
        ("batch_size", "Base batch size M0", "(the script's)", "int"),
        ("max_batch_size", "Max batch size", "(the script's)", "int"),
        ("priority", "Priority", "0", "int"),
        ("retries", "Retries", "(rigid 0)", "int"),
        ("begin", "Start at", "now, 14:00, +2h", "begin"),
        ("workdir", "Working directory", "(current directory)", "text"),
    )

    #: Fields shown beside the one before them, on its row (the form fits 40 lines).
    BESIDE: ClassVar[frozenset[str]] = frozenset({"begin"})

    def _rows(self) -> list[list[tuple[str, str, str, str]]]:
        rows: list[list[tuple[str, str, str, str]]] = []
        for field in self.FIELDS:
            if field[0] in self.BESIDE and rows:
                rows[-1].append(field)
            else:
                rows.append([field])
        return rows

    def __init__(self, workdir: str) -> None:
        super().__init__()
        self.workdir = workdir

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Label("[b]Submit a job[/b]  (Enter or the button submits, Escape abandons)")
            for row in self._rows():
                with Horizontal(classes="field"):
                    for field_id, label, placeholder, _ in row:
                        yield Label(label, classes="second" if field_id in self.BESIDE else "")
                        value = self.workdir if field_id == "workdir" else ""
                        yield Input(value=value, placeholder=placeholder, id=f"f-{field_id}")
            yield Label("", id="error")
            with Horizontal(id="buttons"):
                yield Button("Submit", variant="primary", id="submit")
                yield Button("Cancel", id="cancel")

    def collect(self) -> Submit:
        """The ``submit`` request exactly as ``pollux-local submit`` builds it from the same
        values, in this user's environment (``submission.build_submit``: the user's
        Python for a ``.py`` script, rigid or elastic by what the script imports, paths made
        absolute); ``ValueError`` naming the field that is wrong.  Nothing is sent here."""
        values: dict[str, Any] = {}
        for field_id, label, _, kind in self.FIELDS:
            raw = self.query_one(f"#f-{field_id}", Input).value.strip()
            if not raw:
                continue
            if kind == "int":
                try:
                    values[field_id] = int(raw)
                except ValueError:
                    raise ValueError(f"{label.rstrip(' *')}: not an integer: {raw!r}") from None
            elif kind == "begin":
                try:
                    values[field_id] = parse_begin(raw, time.time(), label)
                except PolluxError as exc:
                    raise ValueError(str(exc)) from None
            elif kind == "args":
                try:
                    values[field_id] = shlex.split(raw)
                except ValueError as exc:
                    raise ValueError(f"{label}: {exc}") from None
            else:
                values[field_id] = raw
        if "script" not in values:
            raise ValueError("Script: required")
        workdir = values.get("workdir", self.workdir)
        if not os.path.isabs(workdir):
            raise ValueError(f"Working directory: must be an absolute path, got {workdir!r}")
        script = values["script"]
        if (
            os.sep in script
            and not os.path.isabs(script)
            or script.endswith(".py")
            and not os.path.isabs(script)
        ):
            script = os.path.join(workdir, script)
        low, high = values.get("min_gpus"), values.get("max_gpus")
        if low is not None and high is not None and low > high:
            raise ValueError(f"min devices {low} > max devices {high}")
        elastic = uses_job_library(Path(script)) if script.endswith(".py") else False
        # a rigid job runs at one size: the form's min devices (or max) is that size
        fixed = None if elastic else (low if low is not None else high)
        options = SubmitOptions(
            command=[script, *values.get("args", [])],
            name=values.get("name"),
            gpus=fixed,
            min_gpus=low if elastic else None,
            max_gpus=high if elastic else None,
            elastic=elastic,
            batch_size=values.get("batch_size"),
            max_batch_size=values.get("max_batch_size"),
            priority=values.get("priority"),
            retries=values.get("retries"),
            begin_at=values.get("begin"),
            workdir=workdir,
        )
        try:
            return build_submit(options)
        except PolluxError as exc:
            raise ValueError(str(exc)) from None

    def _try_submit(self) -> None:
        try:
            request = self.collect()
        except ValueError as exc:
            self.query_one("#error", Label).update(literal(str(exc)))
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
