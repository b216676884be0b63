"""The SSH launcher's node agent run as root, against a user who stops every process of theirs
(``kill(-1, SIGSTOP)`` in a loop) while the agent starts her replicas (``launch/node_agent.py``).

Once, the agent started the replicas before it read its stdin, each with ``Popen(user=...)``,
which waits for the child to reach ``exec``: a child stopped between taking the user's ids and
``exec`` held the agent there for ever, and TERM, KILL and the end of stdin were never read,
so the replicas already started outlived the job.  Now the control thread runs first, each
replica is started by a launcher that stays root (real and saved uid) until right before
``exec``, and each start is waited for a bounded time, holding no lock.
"""

from __future__ import annotations

import shutil
import subprocess
import threading
import time

import pytest

from tests.abuse.lab import Lab
from tests.labinstall import LabUser, user_pids

pytestmark = [pytest.mark.timeout(120)]

STOPPER = """\
import os, signal, sys, time
end = time.time() + float(sys.argv[1])
while time.time() < end:
    try:
        os.kill(-1, signal.SIGSTOP)
    except OSError:
        pass
"""


#: The same in C (faster: more likely to catch a child in the window an agent must not have).
STOPPER_C = """\
#include <signal.h>
#include <stdlib.h>
#include <time.h>
int main(int argc, char **argv) {
  time_t end = time(0) + atoi(argv[1]);
  while (time(0) < end) kill(-1, SIGSTOP);
  return 0;
}
"""


def stopper_command(lab: Lab) -> list[str]:
    """The stopper as a program (compiled when a C compiler is here), for 5 s."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is not None:
        source = lab.base / "stopper.c"
        source.write_text(STOPPER_C)
        binary = lab.base / "stopper"
        if subprocess.run([compiler, "-O2", "-o", str(binary), str(source)]).returncode == 0:
            binary.chmod(0o755)
            return [str(binary), "5"]
    return ["/usr/bin/python3", "-c", STOPPER, "5"]


def test_a_user_stopping_her_processes_cannot_freeze_the_agent(lab: Lab, alice: LabUser) -> None:
    stopper = alice.popen(*stopper_command(lab))
    time.sleep(0.5)
    replicas = [
        {
            "rank": rank,
            "argv": ["/bin/sh", "-c", "while :; do sleep 1; done"],
            "env": {"PATH": "/usr/bin:/bin"},
            "log": str(lab.base / "node-work" / "logs" / "5" / f"rank{rank}.start0.log"),
            "banner": "",
        }
        for rank in range(12)
    ]
    agent = lab.node_agent(alice, replicas, node_workdir=str(lab.base / "node-work"), cwd="/tmp")
    assert agent.stdin is not None and agent.stdout is not None
    try:
        stopper.wait(timeout=30)
        for command in ("TERM", "KILL"):  # what the daemon's stop sends, then it goes
            time.sleep(1)
            agent.stdin.write(command + "\n")
            agent.stdin.flush()
        time.sleep(1)
        agent.stdin.close()
        said: list[str] = []
        reader = threading.Thread(target=lambda: said.append(agent.stdout.read()), daemon=True)
        reader.start()
        try:
            code = agent.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pytest.fail("the agent is stuck: TERM, KILL and the end of its stdin were not obeyed")
        assert code == 0
        reader.join(10)
        out = said[0]
        exits = [line for line in out.splitlines() if line.startswith("EXIT ")]
        assert len(exits) == 12, out
        deadline = time.monotonic() + 10
        while user_pids(alice.uid) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert user_pids(alice.uid) == [], "replicas outlived the job"
    finally:
        agent.kill()
        agent.wait()
        alice.kill_processes()
