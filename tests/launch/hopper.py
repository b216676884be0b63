"""A job's helper that changes its pid all the time (``hopper.c``), for the tests of the fence
that ends what a job leaves behind (``node_agent.Fence``)."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from pollux_local.launch.node_agent import Fence, FenceError
from tests.paths import REPO_ROOT


def needs_fences() -> None:
    """Skip, saying why, where no fence can be made (not root, no writable cgroup v2
    hierarchy nor v1 freezer): there nothing ends a process that keeps changing its pid."""
    if os.geteuid() != 0:
        pytest.skip("fences (cgroups) need root")
    try:
        Fence.make(f"probe-{os.getpid()}").remove()
    except FenceError as exc:
        pytest.skip(f"no fence can be made here: {exc}")


def build_hopper(directory: Path) -> Path:
    """``tests/launch/hopper.c`` compiled into ``directory``: a process that forks and exits
    some 9,000 times a second, a new session at every hop (a Python one hops ten times
    slower, slow enough for a listing of pids to catch it now and then)."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    assert compiler, "a C compiler is needed to build the hopper"
    binary = directory / "hopper"
    source = REPO_ROOT / "tests" / "launch" / "hopper.c"
    subprocess.run([compiler, "-O2", "-o", str(binary), str(source)], check=True, timeout=60)
    return binary


def hopper_for_users(base: Path, hops: Path) -> Path:
    """The hopper built into ``base`` for every user to run (0755), and ``hops``, its beat
    directory, made for every user to write (0777): a hopper of another user's job."""
    hops.mkdir()
    hops.chmod(0o777)
    hopper = build_hopper(base)
    hopper.chmod(0o755)
    return hopper


def hopper_beats(directory: Path, seconds: float) -> int:
    """How many different beats (``PID HOPS``) the hopper (:func:`build_hopper`) writes in
    ``directory`` in the next ``seconds``: 1 (the last one seen again) once it is gone."""
    beat = directory / "beat"
    seen: set[str] = set()
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError):
            seen.add(beat.read_text())
        time.sleep(0.01)
    return len(seen)


def stop_hopper(directory: Path) -> None:
    """Ask the hopper to stop (it looks every 50 ms): a failed test leaves nothing running."""
    (directory / "stop").touch()


def wait_hopping(directory: Path, timeout_s: float = 20.0) -> None:
    """Until the hopper in ``directory`` hops (its beat changes)."""
    deadline = time.monotonic() + timeout_s
    while hopper_beats(directory, 0.3) < 2:
        assert time.monotonic() < deadline, "the hopper did not hop"


def assert_hopper_gone(directory: Path, outlived: str) -> None:
    """The hopper in ``directory`` is gone half a second from now (its beat no longer
    changes); else fail, saying what it ``outlived``."""
    time.sleep(0.5)
    assert hopper_beats(directory, 1.0) == 1, f"the hopper outlived {outlived}"
