"""Users: identity from SO_PEERCRED, owner-only changes, jobs run as their submitter."""

from __future__ import annotations

import grp
import json
import os
import pwd
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pollux_local.client import Client
from pollux_local.daemon.auth import Peer, is_owner, may_act_for, may_modify
from pollux_local.errors import PolluxError
from tests.daemon_process import DaemonFactory

pytestmark = pytest.mark.timeout(120)
USER = "plxtest2"


def test_may_modify_rules() -> None:
    owner, other = Peer(1, 1000, 1000), Peer(2, 1001, 1001)
    name = owner.name  # the account uid 1000 has here (or "uid1000")
    assert may_modify(owner, 1000, name, None, daemon_uid=999)
    assert not may_modify(other, 1000, name, None, daemon_uid=999)
    assert may_modify(Peer(3, 0, 0), 1000, name, None, daemon_uid=999)  # root
    assert may_modify(Peer(4, 999, 999), 1000, name, None, daemon_uid=999)  # the daemon's user
    # nobody is in nogroup (its primary group) in the databases: an admin by that group; a
    # process that only runs with the group's gid is not a member
    nogroup = grp.getgrgid(pwd.getpwnam("nobody").pw_gid).gr_name
    nobody = pwd.getpwnam("nobody").pw_uid
    assert may_modify(Peer(5, nobody, 0), 1000, name, nogroup, daemon_uid=999)  # admin group
    assert not may_modify(Peer(6, 65533, nobody), 1000, name, nogroup, daemon_uid=999)
    assert not may_modify(other, 1000, name, "no-such-group-here", daemon_uid=999)
    # uid 1000 under another account name than the job's owner had: not the owner
    assert not is_owner(owner, 1000, name + "-before")
    assert not may_modify(owner, 1000, name + "-before", None, daemon_uid=999)


def test_only_the_owner_or_root_may_act_for_a_job() -> None:
    """The command a job runs, and its environment, are its owner's (or root's, or the
    daemon user's): the admin group manages the queue, it does not run code as others."""
    nobody = pwd.getpwnam("nobody")
    owner, other = Peer(1, 1000, 1000), Peer(2, nobody.pw_uid, nobody.pw_gid)
    name = owner.name
    assert may_act_for(owner, 1000, name, daemon_uid=999)
    assert may_act_for(Peer(3, 0, 0), 1000, name, daemon_uid=999)
    assert may_act_for(Peer(4, 999, 999), 1000, name, daemon_uid=999)
    nogroup = grp.getgrgid(nobody.pw_gid).gr_name
    assert may_modify(other, 1000, name, nogroup, daemon_uid=999)  # an admin ...
    assert not may_act_for(other, 1000, name, daemon_uid=999)  # ... but not its owner
    assert not may_act_for(owner, 1000, name + "-before", daemon_uid=999)


def as_user(
    uid: int, gid: int, socket_path: Path, requests: list[tuple[str, dict[str, Any]]]
) -> list[Any]:
    """Run requests from a forked child that has dropped to ``uid``: the daemon sees that
    user through SO_PEERCRED, whatever the request says."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        try:
            os.close(read_fd)
            os.setgroups([])
            os.setgid(gid)
            os.setuid(uid)
            results: list[Any] = []
            for kind, fields in requests:
                try:
                    results.append(Client(socket_path, timeout_s=20).request(kind, **fields))
                except PolluxError as exc:
                    results.append({"error": str(exc)})
            os.write(write_fd, json.dumps(results).encode())
        finally:
            os._exit(0)
    os.close(write_fd)
    chunks = []
    while chunk := os.read(read_fd, 65536):
        chunks.append(chunk)
    os.close(read_fd)
    os.waitpid(pid, 0)
    return json.loads(b"".join(chunks))


@pytest.fixture(scope="module")
def second_user() -> Iterator[pwd.struct_passwd]:
    if os.geteuid() != 0 or shutil.which("useradd") is None:
        pytest.skip("needs root and useradd to create a second Unix user")
    created = False
    try:
        entry = pwd.getpwnam(USER)
    except KeyError:
        subprocess.run(["useradd", "-M", "-s", "/bin/sh", USER], check=True, timeout=30)
        created = True
        entry = pwd.getpwnam(USER)
    yield entry
    if created:
        subprocess.run(["userdel", USER], check=False, timeout=30)


@pytest.fixture
def root_daemon() -> Iterator[Path]:
    root = Path(tempfile.mkdtemp(prefix="plx-auth-"))
    root.chmod(0o755)  # other users must reach the socket and the job's files
    try:
        with DaemonFactory(root) as daemons:
            daemons(
                devices="cpu:2",
                config='[scheduler]\npolicy = "fifo"\ninterval_s = 0.5\n',
                state_dir=root / "s",
            )
            yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_other_users_may_read_but_not_change_jobs(
    second_user: pwd.struct_passwd, root_daemon: Path
) -> None:
    state = root_daemon / "s"
    assert oct(state.stat().st_mode & 0o777) == "0o755"
    assert oct((state / "state.db").stat().st_mode & 0o777) == "0o600"
    script = root_daemon / "whoami.sh"
    script.write_text('#!/bin/sh\necho "uid=$(id -u) cwd=$(pwd) FROM_USER=$FROM_USER"\n')
    script.chmod(0o755)
    mine = Client(state / "daemon.sock").request(
        "submit", argv=[str(script)], workdir=str(root_daemon), hold=True
    )["id"]
    uid, gid = second_user.pw_uid, second_user.pw_gid
    submit = {"argv": [str(script)], "workdir": str(root_daemon), "env": {"FROM_USER": "yes"}}
    results = as_user(uid, gid, state / "daemon.sock", [
        ("submit", submit),
        ("status", {}),
        ("cancel", {"ids": [mine]}),
        ("hold", {"id": mine}),
        ("set_priority", {"id": mine, "priority": 9}),
        ("ping", {}),
    ])  # fmt: skip
    theirs = results[0]["id"]
    owners = {job["id"]: job["owner"] for job in results[1]["jobs"]}
    assert owners == {mine: "root", theirs: USER}  # everyone sees every job
    for refused in results[2:5]:
        assert refused["error"].startswith(f"permission denied: job {mine} belongs to root")
    assert results[5]["you"] == {"uid": uid, "name": USER}
    # the daemon runs as root: the job runs as its submitter, in its directory and environment
    deadline = time.monotonic() + 30
    while Client(state / "daemon.sock").request("show", id=theirs)["job"]["state"] != "succeeded":
        assert time.monotonic() < deadline
        time.sleep(0.2)
    log = Client(state / "daemon.sock").request("logs", id=theirs)["data"]
    assert f"uid={uid} cwd={root_daemon} FROM_USER=yes" in log
    assert Client(state / "daemon.sock").request("show", id=mine)["job"]["state"] == "held"
    # the owner may
    assert as_user(uid, gid, state / "daemon.sock", [("cancel", {"ids": [theirs]})])[0] == {
        "cancelled": [],
        "skipped": [{"id": theirs, "state": "succeeded"}],
    }


def test_an_admin_manages_roots_job_but_cannot_run_code_as_root(
    second_user: pwd.struct_passwd,
) -> None:
    """Review s54: a member of the admin group edited a held root job's command and it ran as
    root.  Through the socket, as that member: the command and the environment stay root's;
    the time limit is the admin's to change."""
    group = grp.getgrgid(second_user.pw_gid).gr_name
    root = Path(tempfile.mkdtemp(prefix="plx-auth-"))
    root.chmod(0o755)
    try:
        with DaemonFactory(root) as daemons:
            daemons(
                devices="cpu:2",
                config=f'[daemon]\nadmin_group = "{group}"\n[scheduler]\ninterval_s = 0.5\n',
                state_dir=root / "s",
            )
            sock = root / "s" / "daemon.sock"
            held = Client(sock).request(
                "submit", argv=["/bin/true"], workdir=str(root), hold=True, env={"TOKEN": "t0"}
            )["id"]
            results = as_user(second_user.pw_uid, second_user.pw_gid, sock, [
                ("edit", {"id": held, "argv": ["/bin/sh", "-c", "id"]}),
                ("edit", {"id": held, "time_limit_s": 300}),
                ("show", {"id": held}),
            ])  # fmt: skip
            assert results[0]["error"].startswith(f"permission denied: job {held} runs as root")
            assert "error" not in results[1], results[1]
            assert results[2]["job"]["env"] is None
            shown = Client(sock).request("show", id=held)["job"]
            assert shown["argv"] == ["/bin/true"] and shown["env"] == {"TOKEN": "t0"}
            assert shown["time_limit_s"] == 300
    finally:
        shutil.rmtree(root, ignore_errors=True)
