"""Run a real ``pollux-local daemon`` as a separate process for end-to-end tests."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from pollux_local.client import Client
from pollux_local.errors import PolluxError
from tests.paths import REPO_ROOT


class DaemonProcess:
    """``python -m pollux_local daemon --state-dir DIR ...``; ``start``/``kill``/``stop``."""

    def __init__(self, state_dir: Path, *extra_args: str) -> None:
        self.state_dir = state_dir
        self.extra_args = extra_args
        self.proc: subprocess.Popen[bytes] | None = None
        self.client = Client(state_dir / "daemon.sock", timeout_s=20)

    def start(self, timeout_s: float = 30.0) -> DaemonProcess:
        env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), OMP_NUM_THREADS="1")
        log = open(self.state_dir.parent / f"{self.state_dir.name}.out", "ab")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pollux_local", "daemon", "--state-dir", str(self.state_dir),
             *self.extra_args],
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
            start_new_session=True,
        )  # fmt: skip
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited with {self.proc.returncode}: {self.output()}")
            try:
                self.client.request("ping")
                return self
            except PolluxError:
                time.sleep(0.1)
        raise RuntimeError(f"daemon did not answer within {timeout_s:g} s: {self.output()}")

    def output(self) -> str:
        path = self.state_dir.parent / f"{self.state_dir.name}.out"
        return path.read_text(errors="replace")[-2000:] if path.exists() else ""

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def kill(self) -> None:
        """SIGKILL, as a crash would."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()


def wait_for(predicate: Callable[[], Any], timeout_s: float, what: str) -> Any:
    """Poll ``predicate`` every 0.1 s until it returns something truthy (returned), or fail
    the test after ``timeout_s`` naming ``what`` was awaited."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")


def activated_environ(**extra: str) -> dict[str, str]:
    """This process's environment as if the interpreter running the tests were the submitter's
    activated venv (``pollux-local submit`` runs a ``.py`` job under the submitter's Python)."""
    bin_dir = str(Path(sys.executable).parent)
    return {
        **os.environ,
        "VIRTUAL_ENV": sys.prefix,
        "PATH": os.pathsep.join([bin_dir, os.environ.get("PATH", os.defpath)]),
        **extra,
    }


@contextlib.contextmanager
def quick_daemon(root: Path, devices: str, restart_cost_s: float) -> Iterator[DaemonProcess]:
    """A real daemon on ``devices`` that schedules every second (``root/state``), stopped on
    exit: what the end-to-end tests of a job's life use."""
    config = root / "config.toml"
    config.write_text(f"[scheduler]\ninterval_s = 1\nrestart_cost_s = {restart_cost_s:g}\n")
    proc = DaemonProcess(
        root / "state", "--devices", devices, "--config", str(config), "--interval", "1"
    ).start()
    try:
        yield proc
    finally:
        proc.stop()
