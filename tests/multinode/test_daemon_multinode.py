"""A real ``pollux-local daemon`` scheduling over two SSH hosts of the namespace test bed.

(a) a job placed across both hosts trains with torch.distributed (gloo) over the veth links and
finishes; (b) one host's link is cut mid-run: the daemon marks the node down, the job resumes
from its checkpoint on the remaining host (never from step 0) and finishes; the node is
checked again and comes back once the link is restored.  Detection and resume times are printed
(``pytest -s``) and bounded.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest

from tests.daemon_process import DaemonFactory, DaemonProcess, wait_for
from tests.paths import job_checkpoint_dir

from .conftest import GLOO_JOB, PYTHON, REPO_ROOT, node_table
from .testbed import Testbed

pytestmark = pytest.mark.timeout(150)

#: Short bounds so that a cut link costs seconds, not the defaults' minutes.
PG_TIMEOUT_S = 20
NODE_RETRY_S = 3


def daemon_config(bed: Testbed, root: Path) -> str:
    """Both namespace hosts as SSH nodes with one CPU device each (so a 2-replica job must
    span them); the checkpoint root is on the filesystem every namespace shares."""
    lines = [
        "[scheduler]",
        'policy = "fifo"',
        "interval_s = 1",
        "[daemon]",
        f'checkpoint_root = "{root / "ckpt"}"',
        f"node_retry_s = {NODE_RETRY_S}",
        f"pg_timeout_s = {PG_TIMEOUT_S}",
        "stop_grace_s = 15",
        "backoff_s = 0.5",
    ]
    for host in bed.hosts:
        lines += node_table(bed, host, "cpu:1", root)
    return "\n".join(lines) + "\n"


@pytest.fixture()
def daemon(testbed: Testbed, daemon_factory: DaemonFactory, tmp_path: Path) -> DaemonProcess:
    """A daemon on the test bed's hosts (stopped before the test bed goes)."""
    return daemon_factory(config=daemon_config(testbed, tmp_path), timeout_s=60)


def submit_gloo_job(daemon: DaemonProcess, workdir: Path, steps: int, sleep_s: float) -> str:
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": os.environ.get("HOME", "/root"),
        "PYTHONPATH": str(REPO_ROOT),
        "OMP_NUM_THREADS": "1",
    }
    argv = [PYTHON, str(GLOO_JOB), "--steps", str(steps), "--step-sleep", str(sleep_s),
            "--checkpoint-every", "5"]  # fmt: skip
    reply = daemon.client.request(
        "submit",
        argv=argv,
        workdir=str(workdir),
        env=env,
        min_gpus=1,
        max_gpus=2,
        name="gloo",
        elastic=True,
    )
    return str(reply["id"])


def submit_rigid(
    daemon: DaemonProcess, argv: list[str], workdir: Path, devices: int, name: str
) -> str:
    """Submit ``argv`` as a rigid job on ``devices`` devices; its id."""
    reply = daemon.client.request(
        "submit", argv=argv, workdir=str(workdir), env={"PATH": "/usr/bin:/bin"},
        min_gpus=devices, max_gpus=devices, name=name, elastic=False,
    )  # fmt: skip
    return str(reply["id"])


def job(daemon: DaemonProcess, job_id: str) -> dict[str, Any]:
    return dict(daemon.client.request("show", id=job_id)["job"])


def incarnations(ckpt: Path) -> list[dict[str, Any]]:
    path = ckpt / "incarnations.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def checkpoint_step(ckpt: Path) -> int:
    import torch

    try:
        return int(torch.load(ckpt / "model.pt")["step"])
    except Exception:
        return -1


def node_up(daemon: DaemonProcess, name: str) -> bool:
    rows = daemon.client.request("nodes")["nodes"]
    return bool(next(row for row in rows if row["name"] == name)["up"])


def test_daemon_runs_a_job_across_two_ssh_hosts(
    testbed: Testbed, daemon: DaemonProcess, tmp_path: Path
) -> None:
    h1, h2 = testbed.hosts
    assert node_up(daemon, h1.name) and node_up(daemon, h2.name)
    job_id = submit_gloo_job(daemon, tmp_path, steps=60, sleep_s=0.02)
    ckpt = job_checkpoint_dir(tmp_path / "ckpt", daemon.state_dir, job_id)
    state = wait_for(
        lambda: (s := job(daemon, job_id)["state"]) in ("succeeded", "failed") and s, 90, "the end"
    )
    logs = daemon.client.request("logs", id=job_id, offset=-4000)["data"]
    assert state == "succeeded", logs
    shown = job(daemon, job_id)
    assert shown["reason"] == "finished"
    assert incarnations(ckpt) == [{"start_step": 0, "world": 2, "hosts": [h1.name, h2.name]}]
    done = json.loads((ckpt / "done.json").read_text())
    assert done["step"] == 60 and done["hosts"] == [h1.name, h2.name]
    # The remote ranks' output came back into the daemon's job directory.
    rank1 = (daemon.state_dir / "jobs" / job_id / "rank1.log").read_text()
    assert f"rank 1/2 on {h2.name} starts at step 0" in rank1
    assert "rank 1 finished at step 60" in rank1


def test_cut_link_daemon_marks_node_down_and_job_resumes_on_the_other_host(
    testbed: Testbed, daemon: DaemonProcess, tmp_path: Path
) -> None:
    h1, h2 = testbed.hosts
    total = 400
    job_id = submit_gloo_job(daemon, tmp_path, steps=total, sleep_s=0.03)
    ckpt = job_checkpoint_dir(tmp_path / "ckpt", daemon.state_dir, job_id)
    wait_for(lambda: checkpoint_step(ckpt) >= 20, 60, "the two-host job to make progress")
    assert job(daemon, job_id)["nodes"] == [h1.name, h2.name]

    testbed.cut_link(h2)
    cut = time.monotonic()
    try:
        wait_for(lambda: not node_up(daemon, h2.name), 40, "the daemon to mark the node down")
        detected_s = time.monotonic() - cut
        saved = checkpoint_step(ckpt)
        wait_for(lambda: len(incarnations(ckpt)) >= 2, 40, "the job to resume")
        resumed_s = time.monotonic() - cut
        shown = job(daemon, job_id)
        assert shown["state"] == "running" and shown["nodes"] == [h1.name]
    finally:
        testbed.restore_link(h2)
    print(f"\ncut link: node marked down after {detected_s:.1f} s, job resumed on the other "
          f"host after {resumed_s:.1f} s (checkpoint at step {saved})")  # fmt: skip

    state = wait_for(
        lambda: (s := job(daemon, job_id)["state"]) in ("succeeded", "failed") and s, 90, "the end"
    )
    logs = daemon.client.request("logs", id=job_id, offset=-4000)["data"]
    assert state == "succeeded", logs
    runs = incarnations(ckpt)
    assert runs[0] == {"start_step": 0, "world": 2, "hosts": [h1.name, h2.name]}
    assert runs[1] == {"start_step": saved, "world": 1, "hosts": [h1.name]}
    assert saved >= 20 and len(runs) == 2  # progress preserved; never back to step 0
    assert json.loads((ckpt / "done.json").read_text())["step"] == total
    decisions = daemon.client.request("show", id=job_id)["decisions"]
    down = [d for d in decisions if d["kind"] == "node-down"]
    assert down and h2.name in down[0]["reason"], decisions
    assert not any(d["kind"] == "crashed" for d in decisions), decisions
    # Bounds: keepalive (2 s x 4) + the daemon's check of the node (connect timeout 5 s, twice)
    # + the surviving rank's stop grace (5 s); the restart adds a launch and `import torch`
    # (15.5 s in all once, in a full run on three workers: 25 s leaves room for a loaded box)
    assert detected_s < 30, detected_s
    assert resumed_s < detected_s + 25, (detected_s, resumed_s)

    # The node is retried and comes back.
    wait_for(lambda: node_up(daemon, h2.name), NODE_RETRY_S + 25, "the node to be marked up")


def test_a_job_exiting_255_is_a_crash_and_its_node_stays_up(
    testbed: Testbed, daemon: DaemonProcess, tmp_path: Path
) -> None:
    """A replica's exit code 255 is the job's (ssh's own 255 is a lost node): the job
    crashes, a failure is counted and it is not re-queued as if its node were lost; the
    node stays up for everyone else's jobs."""
    h1, h2 = testbed.hosts
    job_id = submit_rigid(daemon, ["/bin/sh", "-c", "sleep 1; exit 255"], tmp_path, 2, "exit255")
    state = wait_for(
        lambda: (s := job(daemon, job_id)["state"]) in ("succeeded", "failed") and s, 60, "the end"
    )
    shown = job(daemon, job_id)
    assert state == "failed" and "exited with code 255" in shown["reason"], shown
    decisions = daemon.client.request("show", id=job_id)["decisions"]
    assert not any(d["kind"] == "node-down" for d in decisions), decisions
    assert node_up(daemon, h1.name) and node_up(daemon, h2.name)


def test_a_job_whose_agent_is_killed_is_requeued_and_its_node_stays_up(
    testbed: Testbed, daemon: DaemonProcess, tmp_path: Path
) -> None:
    """ssh's own 255 after the node's agent was killed (by the OOM killer, for a job that
    filled the node's memory) is checked, not taken as a lost node: the node answers and stays
    up for everyone; the replica the agent left is killed through its exit record; and the job
    is queued again without a retry spent (nothing says it caused the drop: a stall of the node
    ends every session there, other users' too)."""
    import signal

    marker = f"{os.getpid() % 1000 + 1000}.5"
    job_id = submit_rigid(daemon, ["/bin/sleep", marker], tmp_path, 1, "oomed")
    wait_for(lambda: job(daemon, job_id)["state"] == "running", 60, "the job to run")
    replica = wait_for(lambda: _pid_running(["/bin/sleep", marker]), 30, "its replica")
    time.sleep(0.5)  # its agent has written the exit record that names it
    stat = Path(f"/proc/{replica}/stat").read_bytes()
    agent = int(stat[stat.rindex(b")") + 2 :].split()[1])
    try:
        os.kill(agent, signal.SIGKILL)
        decisions = wait_for(
            lambda: [
                d for d in daemon.client.request("show", id=job_id)["decisions"]
                if d["kind"] == "requeued" and "answer a check" in d["reason"]
            ],
            60, "the job to be queued again",
        )  # fmt: skip
        assert "ssh exit 255" in decisions[0]["reason"], decisions
        wait_for(lambda: not Path(f"/proc/{replica}").exists(), 15, "the orphan to be killed")
        shown = daemon.client.request("show", id=job_id)
        assert shown["job"]["failures"] == 0, shown["job"]
        assert not any(d["kind"] == "node-down" for d in shown["decisions"]), shown
        assert all(node_up(daemon, host.name) for host in testbed.hosts)
        # and it runs again
        wait_for(lambda: job(daemon, job_id)["state"] == "running", 60, "the job to run again")
    finally:
        daemon.client.request("cancel", ids=[job_id])
        if Path(f"/proc/{replica}").exists():
            os.kill(replica, signal.SIGKILL)


def _pid_running(argv: list[str]) -> int | None:
    """The pid of a process of this machine running exactly ``argv``, if any."""
    wanted = "\0".join(argv).encode() + b"\0"
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                if Path(f"/proc/{name}/cmdline").read_bytes() == wanted:
                    return int(name)
            except OSError:
                continue
    return None
