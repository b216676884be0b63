"""Text a job controls is shown literally on every screen of the TUI (``tui/literal.py``).

Over the recorded replies of a real daemon with every job-controlled field made hostile
(names that are Textual markup, a failure reason and decisions and log lines with terminal
escapes); ``tests/abuse/test_screens.py`` does the same over a real root daemon's replies to
another user.  And a structural check: no module of ``tui/`` hands a widget a string it built.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path
from typing import Any

import pytest
from rich.text import Text

from pollux_local.tui.literal import literal, literal_parts, plain, plain_lines
from pollux_local.tui.recording import recording_from_data
from pollux_local.tui.source import FixedSource
from tests.tui.conftest import FIXED_NOW, FIXTURE
from tests.tui.hostile import (
    CLOSE_TAG_NAME,
    EVIL_LINE,
    HIDDEN_NAME,
    QUIT_NAME,
    click_name,
    walk,
    witness_dir,
)

TUI = Path(__file__).resolve().parents[2] / "pollux_local" / "tui"
SIZE = (200, 50)


def hostile_recording(witness: Path) -> tuple[Any, dict[str, str]]:
    """The fixture's replies with jobs 2 (failed), 3, 4 (running) and 7 (queued) renamed to
    markup, job 2's reason, decisions and log made of escapes; (recording, id -> name)."""
    data = json.loads(FIXTURE.read_text())
    names = {"2": click_name(witness), "3": CLOSE_TAG_NAME, "4": HIDDEN_NAME, "7": QUIT_NAME}
    replies = data["replies"]
    for job in replies["status"]["jobs"]:
        job["name"] = names.get(job["id"], job["name"])
        if job["id"] == "2":
            job["reason"] = EVIL_LINE
    for job_id, shown in replies["show"].items():
        shown["job"]["name"] = names.get(job_id, shown["job"]["name"])
        if job_id in names:
            shown["job"]["reason"] = EVIL_LINE
            for decision in shown["decisions"]:
                decision["reason"] += f" ({EVIL_LINE})"
    for job_id in names:
        log = replies["logs"][job_id]
        log["data"] = f"step 1\n{EVIL_LINE}\n"
        log["offset"] = log["size"] = len(log["data"].encode())
    return recording_from_data(data), names


@pytest.mark.asyncio
@pytest.mark.timeout(120)
async def test_every_screen_shows_hostile_job_text_literally(make_app: Any) -> None:
    with witness_dir() as witness:
        recording, names = hostile_recording(witness)
        app = make_app(FixedSource(recording, now=FIXED_NOW), sync=True, refresh_s=3600)
        async with app.run_test(size=SIZE, notifications=True) as pilot:
            await walk(pilot, names, witness, EVIL_LINE, dict.fromkeys(names, EVIL_LINE))
        assert not list(witness.iterdir())


def test_literal_never_reads_markup_and_escapes_controls() -> None:
    text = literal(f"{QUIT_NAME} {EVIL_LINE}", "bold")
    assert isinstance(text, Text)
    assert text.plain.startswith(QUIT_NAME)
    assert "\x1b" not in text.plain and "\\x1b]2;PWNED-TITLE\\x1b\\" in text.plain
    assert all(span.style == "bold" for span in text.spans) or text.style == "bold"
    both = literal_parts(("[b]x[/b]", "red"), "\u202e!")
    assert both.plain == "[b]x[/b]\\u202e!"
    assert plain("a\nb\x07") == "a\\x0ab\\x07"
    assert plain_lines(["\x1b[2J", "ok"]) == ["\\x1b[2J", "ok"]
    # invisible characters that would let one name pass for another are shown too
    spoof = plain("job\u200b1\ufeff\u2028\u061c")
    assert spoof == "job\\u200b1\\ufeff\\u2028\\u061c", spoof


# --- the structural check ----------------------------------------------------------------------

#: Calls that put their first argument on screen (a str there is read as markup).
SHOWS = {"update", "Label", "Static", "StatusLine", "Button", "write", "write_line",
         "write_lines", "Segment", "ConfirmScreen", "PriorityScreen", "Text", "from_markup"}  # fmt: skip
#: Functions that build what is shown (``tui/literal.py`` and text made of its pieces).
BUILDERS = {"literal", "literal_parts", "plain", "plain_lines", "set_cell_size", "assemble",
            "decisions_text", "summary_text", "cluster_figures", "grid_text"}  # fmt: skip


def _name(func: ast.expr) -> str:
    return func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")


def _built_string(node: ast.expr) -> bool:
    """An f-string, a concatenation, ``%``, ``str()``/``repr()``/``.format()``/``.join()``."""
    if isinstance(node, ast.JoinedStr | ast.BinOp):
        return True
    return isinstance(node, ast.Call) and _name(node.func) not in BUILDERS


def unsafe_calls(source: str) -> list[str]:
    """Each call of :data:`SHOWS` in ``source`` whose first argument is a string built from
    data rather than a literal constant or a :data:`BUILDERS` call."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call) or _name(node.func) not in SHOWS or not node.args:
            continue
        if _built_string(node.args[0]):
            found.append(f"line {node.lineno}: {ast.unparse(node)[:100]}")
    return found


def test_no_module_of_the_tui_shows_a_string_built_from_data() -> None:
    offenders = {
        str(path.relative_to(TUI)): calls
        for path in sorted(TUI.rglob("*.py"))
        if path.name != "literal.py" and (calls := unsafe_calls(path.read_text()))
    }
    assert not offenders, f"shown without tui.literal: {offenders}"


def test_the_structural_check_finds_what_main_did() -> None:
    """The check catches the patterns the TUI had (a job's name in an f-string given to
    ``update`` and ``Label``)."""
    old = (
        'status.update(f"job {row.id} · {row.name}")\n'
        'yield Label(f"Priority of {self.job_label}")\n'
        "box.update(str(exc))\n"
        'ok.update(literal(f"job {row.name}"))\n'
        'ok.update("constant")\n'
    )
    assert len(unsafe_calls(old)) == 3
