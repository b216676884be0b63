"""Users kept apart: a second Unix user (made for the test) cannot cancel root's job, and the
daemon's socket and state files have the documented permissions."""

from __future__ import annotations

import os
import secrets
import shutil
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.daemon_process import REPO_ROOT, DaemonProcess

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root to create a second Unix user"),
    pytest.mark.skipif(
        shutil.which("useradd") is None or shutil.which("runuser") is None,
        reason="needs useradd and runuser",
    ),
    pytest.mark.skipif(not os.access("/usr/bin/python3", os.X_OK), reason="needs /usr/bin/python3"),
]


@pytest.fixture()
def second_user() -> Iterator[str]:
    name = "pxsec" + secrets.token_hex(3)
    subprocess.run(["useradd", "-m", "-s", "/bin/sh", name], check=True, timeout=30)
    try:
        yield name
    finally:
        subprocess.run(["userdel", "-r", name], capture_output=True, timeout=30)


@pytest.fixture()
def daemon() -> Iterator[DaemonProcess]:
    # Under /tmp (not pytest's tmp dir under a 0700 parent) so that other users reach the socket.
    base = Path("/tmp") / ("pollux-sec-" + secrets.token_hex(3))
    base.mkdir(mode=0o755)
    proc = DaemonProcess(base / "state", "--devices", "cpu:2", "--interval", "30").start()
    try:
        yield proc
    finally:
        proc.stop()
        shutil.rmtree(base, ignore_errors=True)


# The real command-line entry point, limited to the job commands: the system Python given to
# the second user (root's Python is under /root, mode 700) has no numpy, which only the
# simulator and the terminal UI need.
CLIENT = (
    "import sys, pollux_local.cli as cli; "
    "cli.COMMAND_MODULES = ('pollux_local.cli.jobs',); sys.exit(cli.main(sys.argv[1:]))"
)


def as_user(user: str, *args: str) -> subprocess.CompletedProcess[str]:
    """``pollux-local ARGS`` run as ``user`` (via runuser, so SO_PEERCRED sees that user)."""
    return subprocess.run(
        ["runuser", "-u", user, "--", "/usr/bin/env", f"PYTHONPATH={REPO_ROOT}", "HOME=/tmp",
         "/usr/bin/python3", "-c", CLIENT, *args],
        capture_output=True, text=True, timeout=60, cwd="/tmp",
    )  # fmt: skip


def test_second_user_cannot_cancel_roots_job(second_user: str, daemon: DaemonProcess) -> None:
    reply = daemon.client.request(
        "submit", argv=["sleep", "600"], workdir="/tmp", hold=True, name="roots-job"
    )
    job_id = str(reply["id"])
    state = ["--state-dir", str(daemon.state_dir)]

    seen = as_user(second_user, "status", "--json", *state)
    assert seen.returncode == 0, seen.stderr
    assert "roots-job" in seen.stdout  # everyone sees every job

    refused = as_user(second_user, "cancel", job_id, *state)
    assert refused.returncode == 2
    lines = refused.stderr.strip().splitlines()
    assert len(lines) == 1, refused.stderr
    assert "permission denied" in lines[0] and "root" in lines[0] and job_id in lines[0]
    held = as_user(second_user, "hold", job_id, *state)
    assert held.returncode == 2 and "permission denied" in held.stderr

    # Nothing changed: the job is still there, held, owned by root.
    job = daemon.client.request("show", id=job_id)["job"]
    assert job["state"] == "held"
    # ...and its owner may cancel it.
    daemon.client.request("cancel", ids=[job_id])
    assert daemon.client.request("show", id=job_id)["job"]["state"] == "cancelled"


def test_second_users_own_job_is_theirs_to_cancel(second_user: str, daemon: DaemonProcess) -> None:
    state = ["--state-dir", str(daemon.state_dir)]
    submitted = as_user(
        second_user, "submit", "--hold", "--json", "--workdir", "/tmp", *state, "/bin/sleep", "600"
    )
    assert submitted.returncode == 0, submitted.stderr
    job_id = next(j["id"] for j in daemon.client.request("status")["jobs"])
    job = daemon.client.request("show", id=job_id)["job"]
    assert job["owner"] == second_user  # identity from SO_PEERCRED, not from the request
    cancelled = as_user(second_user, "cancel", str(job_id), *state)
    assert cancelled.returncode == 0, cancelled.stderr
    assert daemon.client.request("show", id=job_id)["job"]["state"] == "cancelled"


def test_socket_and_state_permissions(daemon: DaemonProcess) -> None:
    state_mode = stat.S_IMODE(daemon.state_dir.stat().st_mode)
    assert state_mode & 0o022 == 0, oct(state_mode)  # nobody else may write the state dir
    db_mode = stat.S_IMODE((daemon.state_dir / "state.db").stat().st_mode)
    assert db_mode == 0o600, oct(db_mode)
    sock_mode = stat.S_IMODE((daemon.state_dir / "daemon.sock").stat().st_mode)
    assert sock_mode == 0o666, oct(sock_mode)  # anyone may connect; identity is SO_PEERCRED
