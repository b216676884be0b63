"""Users kept apart: a second Unix user (made for the test) cannot cancel root's job, and the
daemon's socket and state files have the documented permissions.

As in a lab: the daemon (root) and the second user's ``pollux-local`` both run from the shared
interpreter ``scripts/lab-install`` makes (the ``lab_install`` session fixture)."""

from __future__ import annotations

import shutil
import stat
import subprocess
from collections.abc import Iterator

import pytest

from tests.labinstall import LabDaemon, LabInstall, LabUser, world_readable_tempdir

pytestmark = [pytest.mark.timeout(180)]


@pytest.fixture()
def second_user(lab_install: LabInstall) -> Iterator[LabUser]:
    user = LabUser(lab_install, "pxsec")
    try:
        yield user
    finally:
        user.remove()


@pytest.fixture()
def daemon(lab_install: LabInstall) -> Iterator[LabDaemon]:
    # Under /tmp (not pytest's tmp dir under a 0700 parent) so that other users reach the socket.
    base = world_readable_tempdir("pollux-sec-")
    proc = LabDaemon(lab_install, base / "state", "--devices", "cpu:2", "--interval", "30").start()
    try:
        yield proc
    finally:
        proc.stop()
        shutil.rmtree(base, ignore_errors=True)


def as_user(user: LabUser, *args: str) -> subprocess.CompletedProcess[str]:
    """``pollux-local ARGS`` of the lab install run as ``user`` (so SO_PEERCRED sees that
    user)."""
    return user.cli(*args)


def test_second_user_cannot_cancel_roots_job(second_user: LabUser, daemon: LabDaemon) -> None:
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


def test_second_users_own_job_is_theirs_to_cancel(second_user: LabUser, daemon: LabDaemon) -> None:
    state = ["--state-dir", str(daemon.state_dir)]
    submitted = as_user(
        second_user, "submit", "--hold", "--json", "--workdir", "/tmp", *state, "/bin/sleep", "600"
    )
    assert submitted.returncode == 0, submitted.stderr
    job_id = next(j["id"] for j in daemon.client.request("status")["jobs"])
    job = daemon.client.request("show", id=job_id)["job"]
    assert job["owner"] == second_user.name  # identity from SO_PEERCRED, not from the request
    cancelled = as_user(second_user, "cancel", str(job_id), *state)
    assert cancelled.returncode == 0, cancelled.stderr
    assert daemon.client.request("show", id=job_id)["job"]["state"] == "cancelled"


def test_socket_and_state_permissions(daemon: LabDaemon) -> None:
    state_mode = stat.S_IMODE(daemon.state_dir.stat().st_mode)
    assert state_mode & 0o022 == 0, oct(state_mode)  # nobody else may write the state dir
    db_mode = stat.S_IMODE((daemon.state_dir / "state.db").stat().st_mode)
    assert db_mode == 0o600, oct(db_mode)
    sock_mode = stat.S_IMODE((daemon.state_dir / "daemon.sock").stat().st_mode)
    assert sock_mode == 0o666, oct(sock_mode)  # anyone may connect; identity is SO_PEERCRED
