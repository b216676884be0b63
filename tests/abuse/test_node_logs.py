"""Replica logs on an SSH node, with a real second user (``launch/node_agent.py``): the node
agent runs as root and opens each replica's log before starting it as the job's user.  Each
incarnation's replicas write files of their own (``rank<N>.start<I>.log``), so a user who
could write in the log directory could plant one in advance as a link to a root-only file,
for root to append to and hand over.  The agent opens a log only in a directory (and its
parent) that are root's alone, never through a link, and gives the file to the user by its
descriptor."""

from __future__ import annotations

import base64
import subprocess
from pathlib import Path

import pytest

from tests.abuse.lab import Lab
from tests.labinstall import LabUser

pytestmark = [pytest.mark.timeout(60)]


def run_agent(lab: Lab, alice: LabUser, log: Path) -> tuple[list[str], str]:
    """One replica of alice's, logging to ``log``: the agent's lines and what its LOG lines
    carried."""
    replica = {
        "rank": 0,
        "argv": ["/bin/sh", "-c", 'echo "uid=$(id -u)"'],
        "env": {"PATH": "/usr/bin:/bin"},
        "log": str(log),
        "banner": "--- start\n",
    }
    agent = lab.node_agent(alice, [replica])
    assert agent.stdin is not None and agent.stdout is not None
    lines: list[str] = []
    while not any(line.startswith("EXIT") for line in lines):
        line = agent.stdout.readline()
        assert line, f"the agent ended after {lines}"
        lines.append(line.rstrip("\n"))
    agent.stdin.close()
    lines += agent.stdout.read().splitlines()
    assert agent.wait(timeout=30) == 0
    said = "".join(
        base64.b64decode(line.split(" ", 2)[2]).decode()
        for line in lines
        if line.startswith("LOG 0 ")
    )
    return lines, said


def test_a_log_directory_the_user_can_write_is_refused(lab: Lab, alice: LabUser) -> None:
    secret = lab.secret_file("node-secret", "ROOT ONLY\n")
    logs = lab.base / "alices-logs"
    logs.mkdir()
    subprocess.run(["chown", f"{alice.uid}:{alice.gid}", str(logs)], check=True)
    planted = logs / "rank0.start3.log"  # a later incarnation's log, planted in advance
    assert alice.run("ln", "-s", str(secret), str(planted)).returncode == 0
    lines, said = run_agent(lab, alice, planted)
    assert "EXIT 0 127" in lines and not any(line.startswith("PID 0") for line in lines)
    assert "cannot open its log" in said and "not a directory of the agent's user alone" in said
    assert secret.read_text() == "ROOT ONLY\n" and secret.stat().st_uid == 0
    # a file of her own there is not taken either (she could swap it for a link at any time)
    mine = logs / "rank0.start4.log"
    assert alice.run("touch", str(mine)).returncode == 0
    lines, said = run_agent(lab, alice, mine)
    assert "EXIT 0 127" in lines and mine.read_text() == ""


def test_a_log_in_roots_directory_is_the_users_and_never_a_link(lab: Lab, alice: LabUser) -> None:
    """The usual case: the agent makes the directory (root's) and the file is alice's, written
    by her replica; a link planted there by root itself is still not followed."""
    logs = lab.base / "node-logs" / "7"
    lines, said = run_agent(lab, alice, logs / "rank0.start0.log")
    assert "EXIT 0 0" in lines, lines
    log = logs / "rank0.start0.log"
    assert log.stat().st_uid == alice.uid and logs.stat().st_uid == 0
    assert log.read_text() == f"--- start\nuid={alice.uid}\n" == said
    secret = lab.secret_file("other-secret", "ROOT ONLY\n")
    (logs / "rank0.start1.log").symlink_to(secret)
    lines, said = run_agent(lab, alice, logs / "rank0.start1.log")
    assert "EXIT 0 127" in lines and "cannot open its log" in said
    assert secret.read_text() == "ROOT ONLY\n" and secret.stat().st_uid == 0
