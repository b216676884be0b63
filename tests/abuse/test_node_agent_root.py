"""The SSH launcher's node agent run as root (a root login), with a real second user
(``launch/node_agent.py``): it opens each replica's log, then starts the replica as the job's
user.

* Logs.  Each incarnation's replicas write files of their own (``rank<N>.start<I>.log``), so
  a user who could write in the log directory could plant one in advance as a link to a
  root-only file, for root to append to and hand over.  The agent opens a log only in a
  directory (and its parent) that are root's alone, never through a link, and gives the file
  to the user by its descriptor.
* The working directory is entered as the user, after the privileges are dropped: a
  directory the user may enter but one of whose parents shuts them out (another user's 0700
  home) is refused, as on this machine (``test_adversarial.py``, attack d).
"""

from __future__ import annotations

import base64
import subprocess
import time
from pathlib import Path

import pytest

from tests.abuse.lab import Lab
from tests.labinstall import LabUser, user_pids
from tests.launch.hopper import (
    assert_hopper_gone,
    hopper_beats,
    hopper_for_users,
    needs_fences,
    stop_hopper,
)

pytestmark = [pytest.mark.timeout(60)]


def run_agent(
    lab: Lab, alice: LabUser, log: Path, script: str = 'echo "uid=$(id -u)"', **extra: str
) -> tuple[list[str], str]:
    """One replica of alice's running ``script``, logging to ``log``: the agent's lines and
    what its LOG lines carried."""
    replica = {
        "rank": 0,
        "argv": ["/bin/sh", "-c", script],
        "env": {"PATH": "/usr/bin:/bin"},
        "log": str(log),
        "banner": "--- start\n",
    }
    extra.setdefault("node_workdir", str(lab.base / "node-work"))  # root's (work is 1777)
    agent = lab.node_agent(alice, [replica], **extra)
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


def test_the_working_directory_is_entered_as_the_user(
    lab: Lab, alice: LabUser, bob: LabUser
) -> None:
    """bob's home is 0700; inside it a directory of his is open to all, with a file. Root
    could enter it for alice and leave her there, reading what bob's home shuts away; the
    agent enters it as alice, who cannot."""
    home = lab.base / "bob-home"
    shared = home / "projects"
    shared.mkdir(parents=True)
    (shared / "plan.txt").write_text("BOB'S PLAN\n")
    (shared / "plan.txt").chmod(0o644)
    shared.chmod(0o755)
    home.chmod(0o700)
    subprocess.run(["chown", "-R", f"{bob.uid}:{bob.gid}", str(home)], check=True)
    assert alice.run("cat", str(shared / "plan.txt")).returncode != 0  # shut out by path
    logs = lab.base / "node-logs" / "8"
    lines, said = run_agent(
        lab, alice, logs / "rank0.start0.log", "pwd; cat plan.txt", cwd=str(shared)
    )
    assert "EXIT 0 252" in lines, lines
    assert f"cannot enter working directory {shared}: Permission denied" in said
    assert "BOB'S PLAN" not in said and "BOB'S PLAN" not in (logs / "rank0.start0.log").read_text()
    # a path that does not exist in there gets the same answer: nothing tells her what is
    lines, said = run_agent(lab, alice, logs / "rank0.start2.log", "pwd", cwd=str(home / "nope"))
    assert "EXIT 0 252" in lines, lines
    assert f"cannot enter working directory {home / 'nope'}: Permission denied" in said
    # her own directory is entered as usual, and the replica's environment is as given
    mine = lab.base / "alice-work"
    mine.mkdir()
    subprocess.run(["chown", f"{alice.uid}:{alice.gid}", str(mine)], check=True)
    lines, said = run_agent(lab, alice, logs / "rank0.start1.log", "pwd; env", cwd=str(mine))
    assert "EXIT 0 0" in lines, lines
    shown = said.split("--- start\n", 1)[1].splitlines()
    assert shown[0] == str(mine)
    assert sorted(shown[1:]) == ["PATH=/usr/bin:/bin", f"PWD={mine}"]  # sh's own PWD only


@pytest.mark.parametrize("how", ["KILL", "daemon gone"])
def test_a_users_process_that_keeps_changing_its_pid_ends_with_the_incarnation(
    lab: Lab, alice: LabUser, how: str
) -> None:
    """A replica of alice's leaves a helper that forks and exits in a loop, a new session at
    every hop; the root agent's fence (``node_agent.Fence``: root's cgroup, which she cannot
    leave) ends it at a ``KILL`` and when the daemon is gone."""
    needs_fences()
    hops = lab.work / f"hops-{how.replace(' ', '-')}"
    hopper = hopper_for_users(lab.base, hops)
    replica = {
        "rank": 0,
        "argv": ["/bin/sh", "-c", f"{hopper} {hops} </dev/null >/dev/null 2>&1 & exec sleep 300"],
        "env": {"PATH": "/usr/bin:/bin"},
        "log": str(lab.base / "node-work" / "logs" / f"hop-{how.replace(' ', '-')}.log"),
        "banner": "",
    }
    agent = lab.node_agent(alice, [replica], node_workdir=str(lab.base / "node-work"))
    assert agent.stdin is not None
    try:
        deadline = time.monotonic() + 30
        while hopper_beats(hops, 0.3) < 2:
            assert agent.poll() is None and time.monotonic() < deadline, "no hop"
        if how == "KILL":
            agent.stdin.write("KILL\n")
            agent.stdin.flush()
        agent.stdin.close()
        assert agent.stdout is not None
        agent.stdout.read()
        agent.wait(timeout=60)
        assert_hopper_gone(hops, "its incarnation")
        deadline = time.monotonic() + 10
        while user_pids(alice.uid) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert user_pids(alice.uid) == [], "processes of alice's outlived the incarnation"
    finally:
        stop_hopper(hops)
        if agent.poll() is None:
            agent.kill()
        alice.kill_processes()
