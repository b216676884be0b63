"""Text a hostile lab member puts in what the TUI shows, and a walk through every screen that
checks it is shown literally (used by ``test_literal.py`` over recorded replies and by
``tests/abuse/test_screens.py`` over a real root daemon's replies to another user).

The walk opens, for each hostile job, the jobs table, the priority and cancel dialogs, the
job's detail (decisions, log tail) and its log view; on each screen it asserts that the
literal text is there, that no control character is (what the terminal gets is these cells),
and that clicking where a ``[@click=…]`` name is runs nothing.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from textual.pilot import Pilot
from textual.widgets import Static

from pollux_local.untrusted import printable

#: Control characters no cell of the TUI may hold.
CONTROL = {chr(c) for c in (*range(0x00, 0x20), *range(0x7F, 0xA0))}
#: What a job's log lines carry: an OSC window title and a CSI clear screen.
OSC_TITLE = "\x1b]2;PWNED-TITLE\x1b\\"
CSI_CLEAR = "\x1b[2J"


@contextlib.contextmanager
def witness_dir() -> Iterator[Path]:
    """An empty directory with a short path (the name quoting it must fit the table), removed
    after."""
    path = Path(tempfile.mkdtemp(prefix="pxw", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def click_name(directory: Path) -> str:
    """A name that, read as markup, is a link writing a screenshot into ``directory``."""
    return f"[@click=app.screenshot('x.svg','{directory}')]clickme[/]"


QUIT_NAME = "[@click=app.quit]quitme[/]"
CLOSE_TAG_NAME = "[/bold]oops"
HIDDEN_NAME = "[red on red]hidden[/]"
#: A job's last log line (its failure reason): escapes around a word to find.
EVIL_LINE = f"{OSC_TITLE}{CSI_CLEAR}boom [/bold] [@click=app.quit]x[/]"


def screen_lines(app: Any) -> list[str]:
    """The cells of the app's current screen (notifications included), one string a line:
    exactly the text the terminal is sent."""
    strips = app.screen._compositor.render_strips()
    return ["".join(segment.text for segment in strip) for strip in strips]


def screen_text(app: Any) -> str:
    return "\n".join(screen_lines(app))


def shown_text(app: Any) -> str:
    """The screen's cells, then the whole text of each ``Static`` (labels, dialogs' questions,
    toasts) on it: a dialog wraps a long name, its widget holds it whole."""
    parts = [screen_text(app)]
    for widget in app.screen.query("*"):  # a toast is a Static outside its CSS type
        if not isinstance(widget, Static):
            continue
        visual = widget.render()
        parts.append(str(getattr(visual, "plain", visual)))
    return "\n".join(parts)


def assert_clean(app: Any, where: str) -> None:
    """No control character in any cell of the screen."""
    text = screen_text(app)
    found = sorted({repr(ch) for ch in text if ch in CONTROL and ch != "\n"})
    assert not found, f"{where}: control characters on screen: {found}\n{text}"


async def wait_for(pilot: Pilot[Any], what: str, where: str, timeout_s: float = 20.0) -> str:
    """Pause until ``what`` is on screen (``printable`` of it, as the TUI shows it)."""
    shown = printable(what, newline=False)
    for _ in range(int(timeout_s / 0.05)):
        text = shown_text(pilot.app)
        if shown in text:
            return text
        await pilot.pause(0.05)
    raise AssertionError(
        f"{where}: {shown!r} is not on {pilot.app.screen_stack}:\n{shown_text(pilot.app)}"
    )


async def click_on(pilot: Pilot[Any], word: str) -> bool:
    """Click the first cell where ``word`` is on screen; whether it was there."""
    for y, line in enumerate(screen_lines(pilot.app)):
        x = line.find(word)
        if x >= 0:
            await pilot.click(offset=(x + 1, y))
            await pilot.pause()
            return True
    return False


async def assert_click_runs_nothing(pilot: Pilot[Any], witness: Path, where: str) -> None:
    """Clicking ``clickme``/``quitme`` wrote no file and left the app running."""
    for word in ("clickme", "quitme"):
        await click_on(pilot, word)
        assert pilot.app.is_running and pilot.app.return_code is None, f"{where}: {word} quit"
        assert not list(witness.iterdir()), f"{where}: {word} ran an action"


async def walk(
    pilot: Pilot[Any],
    jobs: dict[str, str],
    witness: Path,
    log_word: str | None = None,
    reasons: Mapping[str, str] | None = None,
) -> None:
    """Walk every screen for each of ``jobs`` (id -> its hostile name): main screen, priority
    and cancel dialogs, detail (decisions, log tail), log view, notifications.

    ``log_word`` is what the log tail and the log view must show (literally: escaped);
    ``reasons`` what the decisions of some jobs must (id -> text).  ``witness`` is the directory a ``[@click]`` name
    would write to."""
    app = pilot.app
    for name in jobs.values():
        await wait_for(pilot, name, "jobs table")
    assert_clean(app, "main screen")
    await assert_click_runs_nothing(pilot, witness, "main screen")
    for job_id, name in jobs.items():
        app.main.table.move_cursor(app.main.table.row_ids().index(job_id))
        await pilot.pause()
        await pilot.press("p")
        await wait_for(pilot, f"Priority of {job_id} ({name})", "priority dialog")
        assert_clean(app, "priority dialog")
        await assert_click_runs_nothing(pilot, witness, "priority dialog")
        await pilot.press("escape")
        await pilot.press("c")
        await wait_for(pilot, f"Cancel job {job_id} ({name})?", "cancel dialog")
        assert_clean(app, "cancel dialog")
        await assert_click_runs_nothing(pilot, witness, "cancel dialog")
        await pilot.press("n")
        await pilot.pause()
        await pilot.press("enter")
        await wait_for(pilot, f"job {job_id} · {name}", "detail: status line")
        await wait_for(pilot, name, "detail: summary")
        if reasons and job_id in reasons:
            await wait_for(pilot, reasons[job_id], "detail: decisions")
        if log_word is not None:
            await wait_for(pilot, log_word, "detail: log tail")
        assert_clean(app, "detail screen")
        await assert_click_runs_nothing(pilot, witness, "detail screen")
        await pilot.press("p")
        await wait_for(pilot, f"Priority of {job_id} ({name})", "detail: priority dialog")
        await pilot.press("escape")
        await pilot.press("c")
        await wait_for(pilot, f"Cancel job {job_id} ({name})?", "detail: cancel dialog")
        assert_clean(app, "detail: cancel dialog")
        await pilot.press("n")
        await pilot.pause()
        await pilot.press("l")
        await wait_for(pilot, f"log of job {job_id}", "log view")
        if log_word is not None:
            await wait_for(pilot, log_word, "log view")
        assert_clean(app, "log view")
        await pilot.press("escape")
        await pilot.press("escape")
        await pilot.pause()
        app.notify(f"job {job_id} ({name}) said {EVIL_LINE}", severity="warning")
        await wait_for(pilot, f"job {job_id} ({name}) said", "notification")
        assert_clean(app, "notification")
        await assert_click_runs_nothing(pilot, witness, "notification")
        app.clear_notifications()
        await pilot.pause()
