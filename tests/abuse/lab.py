"""The scratch area of an abuse test and what a test does as a lab member: run the CLI, send
raw frames, wait for a job's state.  Daemons run as root from the lab install (as a lab runs
them); users are ordinary Unix users (``tests.labinstall``)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import psutil

from tests.labinstall import (
    LabDaemon,
    LabInstall,
    LabUser,
    wait_until,
    world_readable_tempdir,
)

TERMINAL = ("succeeded", "failed", "cancelled")
#: Control characters no terminal output of pollux-local may carry raw (newline and tab aside).
CONTROL = {chr(c) for c in (*range(0x00, 0x20), *range(0x7F, 0xA0))} - {"\n", "\t"}

#: A raw client (for the lab's Python, run as a user): one request frame, one reply printed.
RAW_REQUEST = r"""
import socket, sys
sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
sock.settimeout(20)
sock.connect(sys.argv[1])
body = sys.argv[2].encode()
sock.sendall(len(body).to_bytes(4, "big") + body)
def recv(n):
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise SystemExit("the daemon closed the connection")
        data += chunk
    return data
sys.stdout.write(recv(int.from_bytes(recv(4), "big")).decode())
"""


# --- the lab: users, a scratch area, daemons -----------------------------------------------------


class Lab:
    """One test's scratch area under /tmp (world-readable): ``work`` (mode 1777, where jobs
    run and leave their marks), ``vault`` (root's, 0700) and the daemons it started."""

    def __init__(self, install: LabInstall, users: tuple[LabUser, LabUser]) -> None:
        self.install = install
        self.users = users
        self.base = world_readable_tempdir("pollux-adv-")
        self.work = self.base / "work"
        self.work.mkdir()
        self.work.chmod(0o1777)
        self.vault = self.base / "vault"
        self.vault.mkdir(mode=0o700)
        self.daemons: list[LabDaemon] = []

    def daemon(
        self,
        devices: str = "cpu:1",
        user: LabUser | None = None,
        name: str = "state",
        extra_toml: str = "",
        **daemon_keys: float,
    ) -> LabDaemon:
        """A daemon on ``devices`` with a FIFO policy, 0.5 s passes, quick retries and a 2 s
        stop grace (root's, or ``user``'s personal one); ``extra_toml`` (whole sections, such as
        ``[limits]``) is added to its config."""
        keys = {"backoff_s": 0.2, "stop_grace_s": 2, "max_retries": 2, **daemon_keys}
        config = self.base / f"{name}.toml"
        config.write_text(
            '[scheduler]\npolicy = "fifo"\ninterval_s = 0.5\n\n[daemon]\n'
            + "".join(f"{key} = {value}\n" for key, value in keys.items())
            + ("\n" + extra_toml if extra_toml else "")
        )
        config.chmod(0o644)
        parent = self.base
        if user is not None:  # a personal daemon's state dir lies in a directory of its user
            parent = self.base / f"{name}-{user.name}"
            parent.mkdir(mode=0o755)
            os.chown(parent, user.uid, user.gid)
        daemon = LabDaemon(
            self.install, parent / name, "--config", str(config), "--devices", devices, user=user
        )
        self.daemons.append(daemon)
        return daemon.start()

    def secret_file(self, name: str, content: str) -> Path:
        """A root-only file (0600 in the 0700 vault)."""
        path = self.vault / name
        path.write_text(content)
        path.chmod(0o600)
        return path

    def script(self, name: str, body: str) -> Path:
        """An executable shell script (a rigid job) every user may run."""
        path = self.base / name
        path.write_text("#!/bin/sh\n" + body)
        path.chmod(0o755)
        return path

    def node_agent(
        self, user: LabUser, replicas: list[dict[str, Any]], **extra: Any
    ) -> subprocess.Popen[str]:
        """The SSH launcher's node agent, run here as root (as a root login runs it on a
        node), told to start ``replicas`` as ``user`` in the work directory; its stdin is left
        open (closing it tells the agent that the daemon is gone)."""
        import sys

        from pollux_local.launch.ssh import node_agent_source

        spec = {
            "node": "n1",
            "cwd": str(self.work),
            "node_workdir": str(self.work),
            "cwd_required": True,
            "user": user.name,
            "orphan_grace_s": 1,
            "replicas": replicas,
            **extra,
        }
        agent = subprocess.Popen(
            [sys.executable, "-u", "-c", node_agent_source()],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert agent.stdin is not None and agent.stdout is not None
        agent.stdin.write(json.dumps(spec) + "\n")
        agent.stdin.flush()
        return agent

    def close(self) -> None:
        for daemon in self.daemons:
            daemon.stop()
        for user in self.users:
            user.kill_processes()
        shutil.rmtree(self.base, ignore_errors=True)


# --- helpers ---------------------------------------------------------------------------------------


def cli(
    user: LabUser, daemon: LabDaemon, command: str, *args: str, timeout_s: float = 60.0
) -> subprocess.CompletedProcess[str]:
    """``pollux-local COMMAND --state-dir DIR ARGS`` as ``user``."""
    return user.cli(command, "--state-dir", str(daemon.state_dir), *args, timeout_s=timeout_s)


def submit(user: LabUser, daemon: LabDaemon, lab: Lab, *args: str) -> str:
    """Submit as ``user`` through the CLI (in ``lab.work``); the new job's id."""
    done = cli(user, daemon, "submit", "--json", "--workdir", str(lab.work), *args)
    assert done.returncode == 0, done.stderr
    return str(json.loads(done.stdout)["id"])


def raw_request(user: LabUser, daemon: LabDaemon, request: dict[str, Any]) -> dict[str, Any]:
    """One request sent by ``user`` over the socket without the CLI; the reply."""
    body = json.dumps({"v": 1, **request})
    done = user.python(RAW_REQUEST, str(daemon.state_dir / "daemon.sock"), body)
    assert done.returncode == 0, done.stderr
    return dict(json.loads(done.stdout))


def job(daemon: LabDaemon, job_id: str) -> dict[str, Any]:
    return dict(daemon.client.request("show", id=job_id)["job"])


def wait_state(
    daemon: LabDaemon, job_id: str, states: tuple[str, ...], timeout_s: float
) -> dict[str, Any]:
    def reached() -> dict[str, Any] | None:
        current = job(daemon, job_id)
        return current if current["state"] in states else None

    try:
        found = wait_until(reached, timeout_s, f"job {job_id} to be {'/'.join(states)}")
    except AssertionError as exc:
        now = job(daemon, job_id)
        raise AssertionError(
            f"{exc}; it is {now['state']} ({now['reason']})\n{daemon.output()[-1500:]}"
        ) from None
    assert found is not None
    return found


def decisions(daemon: LabDaemon, job_id: str) -> list[str]:
    return [d["kind"] for d in daemon.client.request("show", id=job_id)["decisions"]]


def file_facts(path: Path) -> tuple[bytes, int, int, int, int]:
    """What must not change about a file: content, owner, group, mode, modification time."""
    info = path.lstat()
    return path.read_bytes(), info.st_uid, info.st_gid, info.st_mode, info.st_mtime_ns


def everything_shown(daemon: LabDaemon, job_id: str, *users: LabUser) -> str:
    """All a user can learn of a job: ``logs``, ``show``, ``status`` (text and JSON) of each
    of ``users``, and root's ``logs`` request."""
    parts = []
    for user in users:
        for args in (("logs", job_id), ("show", job_id), ("show", job_id, "--json"),
                     ("status",), ("status", "--json")):  # fmt: skip
            done = cli(user, daemon, *args)
            parts += [done.stdout, done.stderr]
    try:
        parts.append(str(daemon.client.request("logs", id=job_id)))
    except Exception as exc:  # a refusal is fine; its text is checked too
        parts.append(str(exc))
    return "\n".join(parts)


def is_alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False
