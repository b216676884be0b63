"""The lab install for multi-user tests: ``scripts/lab-install`` into a world-readable prefix,
a daemon run from it (as root, or as a user for a personal daemon), and Unix users made for a
test that run the installed ``pollux-local`` as a lab member would.

Everything here needs root (useradd, setpriv, a daemon that runs jobs as their submitters).
"""

from __future__ import annotations

import contextlib
import os
import pwd
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import psutil

from pollux_local.api.errors import DaemonUnavailable, PolluxError
from pollux_local.client import Client
from tests.paths import REPO_ROOT

LAB_INSTALL = REPO_ROOT / "scripts" / "lab-install"
SYSTEM_PYTHON = "/usr/bin/python3"
#: What a freshly logged-in user's shell has on its PATH (no venv of the test runner).
USER_PATH = "/usr/local/bin:/usr/bin:/bin"

T = TypeVar("T")


def missing_tools() -> list[str]:
    """What the multi-user tests need and this machine lacks (empty: all there)."""
    needed = ["useradd", "userdel", "setpriv", "bash", "tar"]
    missing = [tool for tool in needed if shutil.which(tool) is None]
    if not os.access(SYSTEM_PYTHON, os.X_OK):
        missing.append(SYSTEM_PYTHON)
    return missing


@dataclass(frozen=True)
class LabInstall:
    """A venv made by ``scripts/lab-install``: ``python`` and the ``pollux-local`` entry point
    every user can run, and how long the install took."""

    prefix: Path
    seconds: float

    @property
    def python(self) -> Path:
        return self.prefix / "bin" / "python"

    @property
    def cli(self) -> Path:
        return self.prefix / "bin" / "pollux-local"


def run_lab_install(prefix: Path, *extra: str, timeout_s: float = 600.0) -> LabInstall:
    """Run ``scripts/lab-install --prefix PREFIX`` (quietly); its output is in the error when
    it fails."""
    started = time.monotonic()
    done = subprocess.run(
        ["bash", str(LAB_INSTALL), "--prefix", str(prefix), "--quiet", *extra],
        capture_output=True, text=True, timeout=timeout_s, cwd="/",
        env={k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")},
    )  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(
            f"scripts/lab-install failed ({done.returncode}):\n{done.stdout[-3000:]}"
            f"\n{done.stderr[-3000:]}"
        )
    return LabInstall(prefix=prefix, seconds=time.monotonic() - started)


def world_readable_tempdir(prefix: str) -> Path:
    """A new directory under /tmp that every user may enter (mkdtemp makes it 0700)."""
    path = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    path.chmod(0o755)
    return path


# --- users -----------------------------------------------------------------------------------


def user_pids(uid: int) -> list[int]:
    """The processes running with real or effective uid ``uid`` (zombies left out)."""
    found = []
    for proc in psutil.process_iter(["uids", "status"]):
        with contextlib.suppress(psutil.Error):
            uids = proc.info["uids"]
            if uids is None or proc.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            if uid in (uids.real, uids.effective):
                found.append(proc.pid)
    return found


class LabUser:
    """A Unix user made for a test (``useradd -m``); :meth:`remove` kills what it left running
    (by pid) and deletes it with its home (``userdel -r``)."""

    def __init__(self, lab: LabInstall, stem: str = "pxu") -> None:
        self.lab = lab
        self.name = stem + secrets.token_hex(3)
        subprocess.run(
            ["useradd", "-m", "-s", "/bin/sh", self.name],
            check=True, capture_output=True, timeout=30,
        )  # fmt: skip
        entry = pwd.getpwnam(self.name)
        self.uid, self.gid, self.home = entry.pw_uid, entry.pw_gid, Path(entry.pw_dir)
        self.removed = False

    def environ(self, **extra: str) -> dict[str, str]:
        """A login-like environment: nothing of the test runner's (no venv, no PYTHONPATH)."""
        return {
            "HOME": str(self.home),
            "USER": self.name,
            "LOGNAME": self.name,
            "PATH": USER_PATH,
            "LANG": "C.UTF-8",
            "OMP_NUM_THREADS": "1",
            **extra,
        }

    def argv(self, *command: str | os.PathLike[str]) -> list[str]:
        """``command`` as this user (setpriv execs it: the pid is the command's own, and the
        daemon's SO_PEERCRED sees this user's uid and gid)."""
        return [
            "setpriv", f"--reuid={self.uid}", f"--regid={self.gid}", "--init-groups", "--",
            *map(str, command),
        ]  # fmt: skip

    def run(
        self,
        *command: str | os.PathLike[str],
        cwd: str | os.PathLike[str] = "/tmp",
        input: str | None = None,  # noqa: A002 - as subprocess names it
        timeout_s: float = 60.0,
        env: dict[str, str] | None = None,
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            self.argv(*command), capture_output=True, text=True, timeout=timeout_s, cwd=cwd,
            input=input, env=self.environ(**(env or {})),
        )  # fmt: skip

    def cli(self, *args: str, **kwargs: object) -> subprocess.CompletedProcess[str]:
        """``pollux-local ARGS`` of the lab install, as this user."""
        return self.run(self.lab.cli, *args, **kwargs)  # type: ignore[arg-type]

    def python(self, code: str, *args: str, **kwargs: object) -> subprocess.CompletedProcess[str]:
        """``python -c CODE ARGS`` with the lab install's interpreter, as this user."""
        return self.run(self.lab.python, "-c", code, *args, **kwargs)  # type: ignore[arg-type]

    def popen(
        self,
        *command: str | os.PathLike[str],
        cwd: str | os.PathLike[str] = "/tmp",
        **kwargs: object,
    ) -> subprocess.Popen[str]:
        return subprocess.Popen(  # type: ignore[call-overload]
            self.argv(*command), cwd=cwd, env=self.environ(), text=True, **kwargs
        )

    def kill_processes(self) -> None:
        """SIGKILL every process still running as this user (each by its pid)."""
        for _ in range(50):
            pids = user_pids(self.uid)
            if not pids:
                return
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.1)

    def remove(self) -> None:
        if self.removed:
            return
        self.kill_processes()
        subprocess.run(["userdel", "-r", self.name], capture_output=True, timeout=30)
        self.removed = True


@contextlib.contextmanager
def two_users(lab: LabInstall, first: str, second: str) -> Iterator[tuple[LabUser, LabUser]]:
    """Two users made for a test module (``first``/``second``: name stems), both removed at
    the end, even when making the second one failed."""
    made: list[LabUser] = []
    try:
        made.append(LabUser(lab, first))
        made.append(LabUser(lab, second))
        yield made[0], made[1]
    finally:
        for user in made:
            user.remove()


# --- the daemon ------------------------------------------------------------------------------


class LabDaemon:
    """``pollux-local daemon --state-dir DIR ARGS`` of the lab install (or exactly ``argv``),
    as root (a lab's daemon) or as ``user`` (a personal daemon).  Root's client (the test
    runner's) talks to it as ``client``."""

    def __init__(
        self,
        lab: LabInstall,
        state_dir: Path,
        *args: str,
        user: LabUser | None = None,
        argv: list[str] | None = None,
    ) -> None:
        self.lab = lab
        self.argv = argv
        self.state_dir = state_dir
        self.args = args
        self.user = user
        self.log_path = state_dir.parent / f"{state_dir.name}.out"
        self.proc: subprocess.Popen[bytes] | None = None
        self.client = Client(state_dir / "daemon.sock", timeout_s=20)

    def start(self, timeout_s: float = 30.0) -> LabDaemon:
        command: list[str] = self.argv or [
            str(self.lab.cli), "daemon", "--state-dir", str(self.state_dir), *self.args
        ]  # fmt: skip
        env = {"PATH": USER_PATH, "LANG": "C.UTF-8", "OMP_NUM_THREADS": "1", "HOME": "/root"}
        if self.user is not None:
            command = self.user.argv(*command)
            env = self.user.environ()
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                env=env, cwd="/", start_new_session=True,
            )  # fmt: skip
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited with {self.proc.returncode}: {self.output()}")
            try:
                self.client.request("ping")
                return self
            except DaemonUnavailable:
                time.sleep(0.1)
            except PolluxError:
                return self  # it answered (a personal daemon may refuse root's ping)
        raise RuntimeError(f"daemon did not answer within {timeout_s:g} s: {self.output()}")

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:] if self.log_path.exists() else ""

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def rss_bytes(self) -> int:
        return int(psutil.Process(self.pid).memory_info().rss)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


def wait_until(predicate: Callable[[], T], timeout_s: float, what: str, every_s: float = 0.1) -> T:
    """Poll ``predicate`` until it returns something truthy (returned), or fail naming
    ``what``."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(every_s)


def one_line(stderr: str) -> str:
    """The single line of ``stderr`` (the assertion names what was there instead)."""
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, f"expected one line on stderr, got {len(lines)}:\n{stderr}"
    return lines[0]


def frame(body: bytes) -> bytes:
    """One protocol frame: 4-byte big-endian length, then the body (for raw-socket tests)."""
    return len(body).to_bytes(4, "big") + body
