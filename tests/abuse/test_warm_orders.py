"""Warm resize orders on an SSH node, with a real second user (``launch/node_agent.py``): the
node agent runs as root and starts the job's replicas as its user; the order file it writes
is in a directory of its own that the user can read but not write, whatever the job puts in
its environment or its job directory.

* A job's own ``POLLUX_RESIZE_FILE`` (a path of the user's) is dropped: root never writes
  there, and the replicas read the agent's file.
* The user cannot create anything in the agent's order directory.
* A ready file the user planted as a symlink to a root-only file is only looked at
  (``lexists``): the root-only file is unchanged, and the order is given (it says only that
  the user's own joiner is ready).
"""

from __future__ import annotations

import base64
import json
import subprocess

import pytest

from tests.abuse.lab import Lab
from tests.labinstall import LabUser

pytestmark = [pytest.mark.timeout(60)]

#: A replica: who it runs as, where its orders come, whether it may write beside them; then it
#: waits for the order and prints it.  (The joiner's ready file is the one planted.)
REPLICA = """
echo "uid=$(id -u)"
echo "file=$POLLUX_RESIZE_FILE"
if touch "$(dirname "$POLLUX_RESIZE_FILE")/mine" 2>/dev/null; then echo wrote; else echo refused; fi
while [ ! -e "$POLLUX_RESIZE_FILE" ]; do sleep 0.05; done
echo "order=$(cat "$POLLUX_RESIZE_FILE")"
"""


def test_the_order_file_is_the_agents_and_read_only_to_the_jobs_user(
    lab: Lab, alice: LabUser
) -> None:
    job_dir = lab.work / "job"
    job_dir.mkdir()
    subprocess.run(["chown", f"{alice.uid}:{alice.gid}", str(job_dir)], check=True)
    secret = lab.vault / "root-only"
    secret.write_text("ROOT ONLY\n")
    secret.chmod(0o600)
    # alice plants the joiner's ready file as a link to root's file, and names her own file
    planted = job_dir / "resize-ready-5-9"
    assert alice.run("ln", "-s", str(secret), str(planted)).returncode == 0
    theirs = job_dir / "theirs.json"
    logs = lab.base / "agent-logs"

    def replica(rank: int) -> dict[str, object]:
        env = {"PATH": "/usr/bin:/bin", "RANK": str(rank), "POLLUX_RESIZE_FILE": str(theirs)}
        return {
            "rank": rank,
            "argv": ["/bin/sh", "-c", REPLICA],
            "env": env,
            "log": str(logs / f"rank{rank}.log"),
        }

    node_work = str(lab.base / "node-work")  # root's alone (lab.work is 1777: refused)
    agent = lab.node_agent(alice, [replica(0)], resize=True, node_workdir=node_work)
    assert agent.stdin is not None and agent.stdout is not None
    order = {"generation": 5, "world_size": 10}
    request = {
        "generation": 5, "kept": 1, "order": json.dumps(order), "hold": False,
        "joiners": [replica(9)], "ready_timeout_s": 20, "job_dir": str(job_dir),
    }  # fmt: skip
    agent.stdin.write("RESIZE " + json.dumps(request) + "\n")
    agent.stdin.flush()
    out: dict[int, str] = {0: "", 9: ""}
    lines: list[str] = []
    while sum(line.startswith("EXIT") for line in lines) < 2:
        line = agent.stdout.readline()
        assert line, f"the agent ended after {lines}"
        lines.append(line.rstrip("\n"))
        kind, _, rest = line.partition(" ")
        if kind == "LOG":
            rank, _, data = rest.partition(" ")
            out[int(rank)] += base64.b64decode(data).decode()
    agent.stdin.close()
    assert agent.wait(timeout=30) == 0
    assert "ORDERED 5" in lines
    for rank in (0, 9):  # the agent sends a log's last bytes before its EXIT
        assert f"uid={alice.uid}\n" in out[rank], out[rank]
        assert "refused\n" in out[rank], out[rank]  # she cannot write beside the order
        assert f"order={json.dumps(order)}" in out[rank], out[rank]
        file = out[rank].split("file=")[1].split()[0]
        assert file != str(theirs) and not file.startswith(str(job_dir))
    assert not theirs.exists()  # root wrote nothing where the job said
    assert secret.read_text() == "ROOT ONLY\n" and secret.stat().st_uid == 0
    assert planted.is_symlink()
