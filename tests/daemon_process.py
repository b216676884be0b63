"""Run a real ``pollux-local daemon`` as a separate process for end-to-end tests.

:class:`DaemonProcess` is one daemon; :class:`DaemonFactory` (the ``daemon_factory`` fixture of
``tests/conftest.py``) starts as many as a test needs and stops every one at the end.  The
daemons of the lab install (root, real users, the lab's interpreter) are ``tests/labinstall.py``'s.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

import psutil

from pollux_local.client import Client
from pollux_local.errors import PolluxError
from pollux_local.launch import cgroups
from tests.paths import REPO_ROOT


def daemon_environ(env: Mapping[str, str | None] | None = None) -> dict[str, str]:
    """This process's environment with this checkout first on ``PYTHONPATH`` and one OpenMP
    thread, then ``env`` over it (a ``None`` value removes the variable)."""
    environ = dict(os.environ, PYTHONPATH=str(REPO_ROOT), OMP_NUM_THREADS="1")
    for key, value in (env or {}).items():
        if value is None:
            environ.pop(key, None)
        else:
            environ[key] = value
    return environ


class DaemonProcess:
    """``python -m pollux_local daemon --state-dir DIR ...``; ``start``/``kill``/``stop``.

    ``env`` goes over :func:`daemon_environ`'s environment; ``cwd`` is the daemon's working
    directory.  Its output goes to ``DIR.out`` beside the state directory (:meth:`output`).
    ``start`` may be called again after ``stop`` or ``kill``: a restart on the same state."""

    def __init__(
        self,
        state_dir: Path,
        *extra_args: str,
        env: Mapping[str, str | None] | None = None,
        cwd: Path | None = None,
    ) -> None:
        self.state_dir = state_dir
        self.extra_args = extra_args
        self.env = daemon_environ(env)
        self.cwd = cwd
        self.proc: subprocess.Popen[bytes] | None = None
        self.client = Client(state_dir / "daemon.sock", timeout_s=20)

    @property
    def log_path(self) -> Path:
        return self.state_dir.parent / f"{self.state_dir.name}.out"

    def start(self, timeout_s: float = 30.0) -> DaemonProcess:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "pollux_local", "daemon", "--state-dir",
                 str(self.state_dir), *self.extra_args],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                cwd=self.cwd, start_new_session=True,
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

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def output(self) -> str:
        path = self.log_path
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
                # where it is stuck goes to its log (faulthandler, SIGUSR2), then SIGKILL
                os.kill(self.proc.pid, signal.SIGUSR2)
                time.sleep(1.0)
                self.kill()


def wait_for(
    predicate: Callable[[], Any],
    timeout_s: float,
    what: str,
    explain: Callable[[], str] | None = None,
) -> Any:
    """Poll ``predicate`` every 0.1 s until it returns something truthy (returned), or fail
    the test after ``timeout_s`` naming ``what`` was awaited, with what ``explain`` then
    says (the states seen, a log's end: a failure in a full run is read from its output)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    detail = ""
    if explain is not None:
        try:
            detail = "\n" + explain()
        except Exception as exc:  # the explanation must not hide the timeout
            detail = f"\n(explaining failed: {exc!r})"
    raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}{detail}")


def log_tail(path: Path, lines: int = 30) -> str:
    """The last ``lines`` lines of the text file at ``path`` (a daemon's log)."""
    try:
        text = path.read_text(errors="replace")
    except OSError as exc:
        return f"({path}: {exc.strerror})"
    return "\n".join(text.splitlines()[-lines:])


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


class DaemonFactory:
    """Starts real daemons under ``root`` and stops every one it started when closed (the
    ``daemon_factory`` fixture closes it at teardown, whatever the test did)::

        daemon = daemon_factory(devices="cpu:2", config="[scheduler]\\ninterval_s = 1\\n")

    ``devices`` and ``interval`` become ``--devices`` and ``--interval``; ``config`` is the
    config file's text (written beside the state directory) or a path to one; ``args`` are
    passed on as they are.  The state directory is ``root/state``, then ``root/state-2``, …
    unless ``state_dir`` names one (a restart on the same state: call again with it)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.started: list[DaemonProcess] = []

    def __call__(
        self,
        *args: str,
        devices: str | None = None,
        config: str | Path | None = None,
        interval: float | None = None,
        state_dir: Path | None = None,
        env: Mapping[str, str | None] | None = None,
        cwd: Path | None = None,
        start: bool = True,
        timeout_s: float = 30.0,
    ) -> DaemonProcess:
        if state_dir is None:
            state_dir = self.root / (
                "state" if not self.started else f"state-{len(self.started) + 1}"
            )
        argv = list(args)
        if devices is not None:
            argv += ["--devices", devices]
        if interval is not None:
            argv += ["--interval", f"{interval:g}"]
        if isinstance(config, str):
            path = state_dir.parent / f"{state_dir.name}.toml"
            path.write_text(config)
            config = path
        if config is not None:
            argv += ["--config", str(config)]
        daemon = DaemonProcess(state_dir, *argv, env=env, cwd=cwd)
        self.started.append(daemon)
        return daemon.start(timeout_s) if start else daemon

    def stop_all(self) -> None:
        """SIGTERM every daemon still running, the last started first."""
        for daemon in reversed(self.started):
            daemon.stop()

    def __enter__(self) -> DaemonFactory:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self.stop_all()
        self.end_leftovers()

    def end_leftovers(self) -> None:
        """Kill the supervisors the daemons left running, with their jobs, and remove their
        incarnations' cgroups: a daemon that stops leaves a rigid job running for the next one
        to adopt, and at teardown there is no next one.  A supervisor is this factory's when
        its output goes to a run file under ``root``."""
        root = str(self.root.resolve())
        for proc in psutil.process_iter(["cmdline"]):
            with contextlib.suppress(psutil.Error, OSError):
                if "pollux_local.launch.supervisor" not in (proc.info["cmdline"] or []):
                    continue
                stderr = os.readlink(f"/proc/{proc.pid}/fd/2")
                if not stderr.startswith(root + os.sep):
                    continue
                for child in proc.children(recursive=True):
                    with contextlib.suppress(psutil.Error):
                        child.kill()
                proc.kill()
        # the cgroups (fences, limits) of every incarnation of theirs, those of supervisors a
        # test killed too: the next daemon would sweep them, and there is none
        for run_file in self.root.rglob("run/*.json"):
            with contextlib.suppress(OSError, ValueError):
                for path in json.loads(run_file.read_text()).get("cgroups") or ():
                    deadline = time.monotonic() + 5
                    while not cgroups.sweep(str(path)) and time.monotonic() < deadline:
                        time.sleep(0.05)


def quick_config(restart_cost_s: float) -> str:
    """The config of a daemon that schedules every second: what the end-to-end tests of a job's
    life use (with ``interval=1``)."""
    return f"[scheduler]\ninterval_s = 1\nrestart_cost_s = {restart_cost_s:g}\n"


@contextlib.contextmanager
def quick_daemon(root: Path, devices: str, restart_cost_s: float) -> Iterator[DaemonProcess]:
    """A real daemon on ``devices`` that schedules every second (``root/state``), stopped on
    exit."""
    with DaemonFactory(root) as daemons:
        yield daemons(devices=devices, config=quick_config(restart_cost_s), interval=1)
