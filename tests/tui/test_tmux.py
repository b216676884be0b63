"""Real terminal: tmux runs ``pollux-local tui`` against a real daemon with jobs running."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.daemon_process import DaemonFactory
from tests.paths import REPO_ROOT

SESSION = f"pollux-tui-test-{os.getpid()}"
#: A private tmux server (its own socket, no user config), so that other tmux users on this
#: machine cannot change the window size.
TMUX = ["tmux", "-L", SESSION, "-f", "/dev/null"]

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed"),
]

JOB_SCRIPT = """\
import os, time
for step in range(2000):
    print(f"step {step} rank {os.environ.get('RANK', '0')}", flush=True)
    time.sleep(0.2)
"""


def _env() -> dict[str, str]:
    """The environment for the daemon, the CLI and tmux: without COLUMNS/LINES (set under
    pytest), which Textual would take over the real terminal's size."""
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    return dict(env, PYTHONPATH=str(REPO_ROOT), OMP_NUM_THREADS="1")


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pollux_local", *args],
        cwd=REPO_ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=30,
    )


def _wait(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.3)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture
def daemon(daemon_factory: DaemonFactory) -> Path:
    """A daemon on cpu:2 that schedules every second, in the environment of :func:`_env`."""
    process = daemon_factory(
        devices="cpu:2", interval=1, env={"COLUMNS": None, "LINES": None}, cwd=REPO_ROOT
    )
    return process.state_dir


def _capture() -> str:
    out = subprocess.run(
        [*TMUX, "capture-pane", "-p", "-t", SESSION], capture_output=True, text=True, timeout=10
    )
    return out.stdout


def _keys(*keys: str) -> None:
    subprocess.run([*TMUX, "send-keys", "-t", SESSION, *keys], check=True, timeout=10)


def _run_two_jobs_and_the_tui(
    daemon: Path, script: Path, names: tuple[str, str], width: int
) -> None:
    """Submit ``script`` twice (``names``), wait until both run, then start the TUI against
    ``daemon`` in a detached tmux session ``width`` columns wide."""
    for name in names:
        done = _cli("submit", "--state-dir", str(daemon), "--name", name, str(script))
        assert done.returncode == 0, done.stderr
    _wait(
        lambda: _cli("status", "--state-dir", str(daemon)).stdout.count("running") >= 2,
        30,
        "both jobs running",
    )
    command = (
        f"cd {REPO_ROOT} && PYTHONPATH={REPO_ROOT} {sys.executable} -m pollux_local tui "
        f"--state-dir {daemon} --refresh 0.5"
    )
    subprocess.run(
        [*TMUX, "new-session", "-d", "-s", SESSION, "-x", str(width), "-y", "40", command],
        env=_env(),
        check=True,
        timeout=10,
    )


def test_tui_in_a_real_terminal(daemon: Path, tmp_path: Path) -> None:
    script = tmp_path / "tiny_train.py"
    script.write_text(JOB_SCRIPT)
    _run_two_jobs_and_the_tui(daemon, script, ("tmux-alpha", "tmux-beta"), width=120)
    try:
        _wait(lambda: "tmux-beta" in _capture(), 30, "the jobs table")
        screen = _capture()
        assert "tmux-alpha" in screen and "tmux-beta" in screen
        # the device grid: node line with both CPU devices held by the two jobs
        grid_line = next(line for line in screen.splitlines() if "0:tmux-" in line)
        assert "1:tmux-" in grid_line
        # a plot: the cluster plot's title and its y-axis ticks
        _wait(lambda: "┤" in _capture(), 20, "the cluster plot's axes")
        assert "cluster over time" in _capture()
        # navigate: second job, open its detail, see its decisions and log, come back
        _keys("Down")
        _keys("Enter")
        _wait(lambda: "scheduler decisions" in _capture(), 20, "the job detail screen")
        _wait(lambda: "step " in _capture(), 20, "the log tail")
        detail = _capture()
        assert "tmux-beta" in detail.splitlines()[0]
        assert "throughput vs devices" in detail and "efficiency vs batch size" in detail
        _keys("Escape")
        _wait(lambda: "devices" in _capture() and "Goodput" in _capture(), 10, "the main screen")
        _keys("?")
        _wait(lambda: "this help" in _capture(), 10, "the help screen")
        _keys("Escape")
        _keys("q")
        _wait(lambda: "tmux-alpha" not in _capture(), 10, "the app to quit")
    finally:
        subprocess.run([*TMUX, "kill-server"], capture_output=True, timeout=10)


HOSTILE_SCRIPT = """\
import time
print("step 1", flush=True)
print("\\x1b]2;PWNED-TITLE\\x1b\\\\\\x1b[2Jboom [/bold] [@click=app.quit]x[/]", flush=True)
time.sleep(600)
"""


def _pane_title() -> str:
    out = subprocess.run(
        [*TMUX, "display", "-p", "-t", SESSION, "#{pane_title}"],
        capture_output=True, text=True, timeout=10,
    )  # fmt: skip
    return out.stdout.strip()


def test_a_hostile_job_in_a_real_terminal(daemon: Path, tmp_path: Path) -> None:
    """Jobs named with markup whose log sets the window title and clears the screen: the TUI
    shows their names and log lines as text (escapes as ``\\x1b``), the cancel question with
    ``[/bold]`` in it does not crash it, and the pane's title stays tmux's own."""
    script = tmp_path / "hostile.py"
    script.write_text(HOSTILE_SCRIPT)
    names = ("[/bold]oops", "[@click=app.quit]quitme[/]")
    _run_two_jobs_and_the_tui(daemon, script, names, width=160)
    try:
        before = _pane_title()
        _wait(lambda: "[@click=app.quit]quitme[/]" in _capture(), 30, "the jobs table")
        assert "[/bold]oops" in _capture()
        _keys("c")  # the first job: [/bold]oops
        _wait(lambda: "Cancel job 1 ([/bold]oops)?" in _capture(), 20, "the cancel question")
        _keys("n")
        _wait(lambda: "Cancel job" not in _capture(), 10, "the question to close")
        _keys("Enter")
        _wait(lambda: "scheduler decisions" in _capture(), 20, "the job detail screen")
        _wait(lambda: "\\x1b]2;PWNED-TITLE" in _capture(), 20, "the log tail, escaped")
        screen = _capture()
        assert "boom [/bold] [@click=app.quit]x[/]" in screen
        assert "job 1 · [/bold]oops" in screen
        time.sleep(1.0)  # a few refreshes: the title would have been set by now
        assert "PWNED" not in _pane_title(), f"pane title set by a job: {_pane_title()!r}"
        assert _pane_title() == before
        _keys("Escape")
        _keys("q")
        _wait(lambda: "quitme" not in _capture(), 10, "the app to quit")
    finally:
        subprocess.run([*TMUX, "kill-server"], capture_output=True, timeout=10)
