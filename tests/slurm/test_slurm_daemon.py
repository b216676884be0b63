"""A real daemon inside a real Slurm allocation of the test bed (``scripts/slurm-testbed-up``):
every incarnation of a job is one ``srun`` job step.

(a) a 2-rank DDP job (gloo, CPU) runs as one step across both nodes: its ranks see Slurm's step
environment and torchrun's; (b) a cancelled job's step ends (``scancel --signal=TERM``: the job
checkpoints and exits 75), its exit recorded; (c) the daemon SIGKILLed mid-job and restarted in
the same allocation finds the step still running, waits for it, and loses nothing (no second
incarnation, a queued job still there and run).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.daemon.test_e2e import TRAIN
from tests.daemon_process import DaemonFactory, DaemonProcess, wait_for
from tests.paths import REPO_ROOT, job_checkpoint_dir

from . import bed
from .conftest import SlurmAllocation, daemon_config, make_allocation

pytestmark = pytest.mark.timeout(150)

GLOO_JOB = REPO_ROOT / "tests" / "multinode" / "gloo_job.py"


def submit(
    daemon: DaemonProcess, workdir: Path, steps: int, sleep_s: float, ranks: int = 2, **extra: Any
) -> str:
    """The gloo job on exactly ``ranks`` devices; each rank first writes its environment to
    ``$POLLUX_CHECKPOINT_DIR/env-$RANK.json``."""
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": os.environ.get("HOME", "/root"),
        "PYTHONPATH": str(REPO_ROOT),
        "OMP_NUM_THREADS": "1",
        "GLOO_SOCKET_IFNAME": "eth0",  # each node's only link in the test bed
    }
    dump = (
        f"{sys.executable} -c 'import json,os; json.dump(dict(os.environ),"
        ' open(os.path.join(os.environ["POLLUX_CHECKPOINT_DIR"],'
        ' "env-" + os.environ["RANK"] + ".json"), "w"))\''
    )
    argv = ["/bin/sh", "-c", f'{dump} && exec "$@"', "job", sys.executable, str(GLOO_JOB),
            "--steps", str(steps), "--step-sleep", str(sleep_s), "--checkpoint-every", "5"]  # fmt: skip
    fields: dict[str, Any] = {"min_gpus": ranks, "max_gpus": ranks, "name": "gloo", **extra}
    reply = daemon.client.request("submit", argv=argv, workdir=str(workdir), env=env, **fields)
    return str(reply["id"])


def job(daemon: DaemonProcess, job_id: str) -> dict[str, Any]:
    return dict(daemon.client.request("show", id=job_id)["job"])


def ended(daemon: DaemonProcess, job_id: str, timeout_s: float = 90) -> str:
    done = ("succeeded", "failed", "cancelled")
    return str(
        wait_for(lambda: (s := job(daemon, job_id)["state"]) in done and s, timeout_s, "its end")
    )


def steps_of(allocation: SlurmAllocation) -> dict[str, str]:
    """The allocation's running steps: name -> step id (``squeue -s``)."""
    out = subprocess.run(
        ["squeue", "-h", "-s", "-j", allocation.job_id, "-o", "%i %j"],
        capture_output=True, text=True, timeout=20,
    ).stdout  # fmt: skip
    return {p[1]: p[0] for line in out.splitlines() if len(p := line.split()) == 2}


def node_up(daemon: DaemonProcess, name: str) -> bool:
    rows = daemon.client.request("nodes")["nodes"]
    return bool(next(row for row in rows if row["name"] == name)["up"])


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


def test_two_rank_job_runs_as_one_step_across_both_nodes(
    allocation: SlurmAllocation, slurm_daemon: DaemonProcess, tmp_path: Path
) -> None:
    h1, h2 = allocation.nodes
    nodes = {row["name"]: row for row in slurm_daemon.client.request("nodes")["nodes"]}
    assert set(nodes) == {h1, h2} and all(row["up"] for row in nodes.values()), nodes
    job_id = submit(slurm_daemon, tmp_path, steps=40, sleep_s=0.02)
    state = ended(slurm_daemon, job_id)
    logs = slurm_daemon.client.request("logs", id=job_id, offset=-4000)["data"]
    assert state == "succeeded", logs
    shown = job(slurm_daemon, job_id)
    assert shown["exit_code"] == 0 and shown["exit_signal"] is None, shown
    ckpt = job_checkpoint_dir(tmp_path / "ckpt", slurm_daemon.state_dir, job_id)
    assert incarnations(ckpt) == [{"start_step": 0, "world": 2, "hosts": [h1, h2]}]
    assert json.loads((ckpt / "done.json").read_text())["step"] == 40
    envs = [json.loads((ckpt / f"env-{rank}.json").read_text()) for rank in (0, 1)]
    for rank, env in enumerate(envs):
        # Slurm's step: one step of the allocation, this rank its task, the GPU Slurm bound
        assert env["SLURM_JOB_ID"] == allocation.job_id
        assert env["SLURM_STEP_NUM_TASKS"] == "2" and env["SLURM_STEP_NUM_NODES"] == "2"
        assert env["SLURM_PROCID"] == str(rank) and env["SLURMD_NODENAME"] == (h1, h2)[rank]
        assert env["CUDA_VISIBLE_DEVICES"] in ("0", "1")  # the one GPU of its node Slurm bound
        # torchrun's contract, the ranks taken from Slurm's
        assert env["RANK"] == str(rank) and env["WORLD_SIZE"] == "2"
        assert env["LOCAL_RANK"] == "0" and env["LOCAL_WORLD_SIZE"] == "1"
        assert env["NODE_RANK"] == env["GROUP_RANK"] == str(rank)
        assert env["MASTER_ADDR"] == "10.217.0.11" and env["MASTER_PORT"].isdigit()
        assert env["TORCHELASTIC_RUN_ID"] == f"pollux-{job_id}"
        assert env["POLLUX_JOB_ID"] == job_id and env["POLLUX_NUM_NODES"] == "2"
        assert env["POLLUX_DEVICE_TYPE"] == "testgpu"
    assert envs[0]["SLURM_STEP_ID"] == envs[1]["SLURM_STEP_ID"]
    # each rank's output went to its log through Slurm (--output), in the job's directory
    rank1 = (slurm_daemon.state_dir / "jobs" / job_id / "rank1.log").read_text()
    assert f"rank 1/2 on {h2} starts at step 0" in rank1 and "rank 1 finished at step 40" in rank1
    assert f"pollux-{job_id}.0" not in steps_of(allocation)


def test_cancelled_job_ends_its_step(
    allocation: SlurmAllocation, slurm_daemon: DaemonProcess, tmp_path: Path
) -> None:
    job_id = submit(slurm_daemon, tmp_path, steps=100_000, sleep_s=0.05)
    ckpt = job_checkpoint_dir(tmp_path / "ckpt", slurm_daemon.state_dir, job_id)
    wait_for(lambda: checkpoint_step(ckpt) >= 5, 60, "the job to make progress")
    assert f"pollux-{job_id}.0" in steps_of(allocation)
    slurm_daemon.client.request("cancel", ids=[job_id])
    assert ended(slurm_daemon, job_id, 40) == "cancelled"
    wait_for(lambda: f"pollux-{job_id}.0" not in steps_of(allocation), 20, "the step to end")
    logs = slurm_daemon.client.request("logs", id=job_id, offset=-4000)["data"]
    # SIGTERM came through scancel --signal=TERM: the job checkpointed and exited 75
    assert "checkpointed at step" in logs, logs
    # the job is cancelled at once; its exit is recorded when the step's end comes in
    shown = wait_for(
        lambda: (j := job(slurm_daemon, job_id))["replica_exits"] and j, 20, "the step's exit"
    )
    exits = (shown["exit_code"], shown["exit_signal"], shown["replica_exits"])
    assert shown["exit_code"] == 75 and shown["exit_signal"] is None, (exits, logs)


def test_daemon_killed_and_restarted_in_the_allocation_loses_nothing(
    allocation: SlurmAllocation, daemon_factory: DaemonFactory, tmp_path: Path
) -> None:
    daemon = daemon_factory(
        config=daemon_config(tmp_path), env=allocation.environ(), timeout_s=60, cwd=tmp_path
    )
    total = 150
    first = submit(daemon, tmp_path, steps=total, sleep_s=0.05)
    ckpt = job_checkpoint_dir(tmp_path / "ckpt", daemon.state_dir, first)
    wait_for(lambda: checkpoint_step(ckpt) >= 10, 60, "the job to make progress")
    second = submit(daemon, tmp_path, steps=20, sleep_s=0.02)  # queued: the devices are taken
    assert job(daemon, second)["state"] == "queued"
    step = steps_of(allocation)[f"pollux-{first}.0"]

    daemon.kill()
    time.sleep(1.0)
    assert steps_of(allocation).get(f"pollux-{first}.0") == step  # the step runs on
    daemon.start(timeout_s=60)

    assert ended(daemon, first, 90) == "succeeded", daemon.output()
    runs = incarnations(ckpt)
    assert runs == [{"start_step": 0, "world": 2, "hosts": allocation.nodes}], runs
    assert json.loads((ckpt / "done.json").read_text())["step"] == total
    decisions = daemon.client.request("show", id=first)["decisions"]
    assert any(d["kind"] == "recovered" for d in decisions), decisions
    assert ended(daemon, second, 90) == "succeeded"
    assert (
        incarnations(job_checkpoint_dir(tmp_path / "ckpt", daemon.state_dir, second))[0][
            "start_step"
        ]
        == 0
    )


def test_timed_out_job_ends_its_step(
    allocation: SlurmAllocation, slurm_daemon: DaemonProcess, tmp_path: Path
) -> None:
    job_id = submit(slurm_daemon, tmp_path, steps=100_000, sleep_s=0.05, time_limit_s=6)
    wait_for(lambda: f"pollux-{job_id}.0" in steps_of(allocation), 30, "its step")
    assert ended(slurm_daemon, job_id, 60) == "failed"
    shown = job(slurm_daemon, job_id)
    assert "time limit" in shown["reason"], shown
    wait_for(lambda: f"pollux-{job_id}.0" not in steps_of(allocation), 20, "the step to end")


def test_node_lost_mid_job_resumes_on_the_other_node_from_its_checkpoint(
    allocation: SlurmAllocation, slurm_daemon: DaemonProcess, tmp_path: Path
) -> None:
    """Everything of node 2 killed (its slurmd, the step's slurmstepd, the rank): Slurm marks
    it down, the step ends, the daemon drops the node and the job resumes on node 1 from its
    checkpoint."""
    info = bed.info()
    assert info is not None
    h1, h2 = allocation.nodes
    netns = dict(info["netns"])  # type: ignore[call-overload]
    job_id = submit(
        slurm_daemon, tmp_path, steps=400, sleep_s=0.03, ranks=1, elastic=True, max_gpus=2
    )
    ckpt = job_checkpoint_dir(tmp_path / "ckpt", slurm_daemon.state_dir, job_id)
    wait_for(lambda: len(job(slurm_daemon, job_id)["nodes"]) == 2, 30, "the job on both nodes")
    wait_for(lambda: checkpoint_step(ckpt) >= 20, 60, "the two-node job to make progress")
    killed = time.monotonic()
    try:
        pids = subprocess.run(
            ["ip", "netns", "pids", netns[h2]], capture_output=True, text=True, timeout=10
        ).stdout.split()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
        wait_for(lambda: not node_up(slurm_daemon, h2), 60, "the daemon to mark the node down")
        detected_s = time.monotonic() - killed
        try:
            wait_for(lambda: len(incarnations(ckpt)) >= 2, 60, "the job to resume")
        except AssertionError as exc:
            shown = slurm_daemon.client.request("show", id=job_id)
            raise AssertionError(f"{exc}: {shown['job']} {shown['decisions']}") from None
        resumed_s = time.monotonic() - killed
        assert ended(slurm_daemon, job_id, 90) == "succeeded"
    finally:
        bed.start_slurmd(h2, netns[h2])
        subprocess.run(["scontrol", "update", f"nodename={h2}", "state=resume"],
                       capture_output=True, timeout=20)  # fmt: skip
    print(f"\nnode lost: marked down after {detected_s:.1f} s, resumed after {resumed_s:.1f} s")
    runs = incarnations(ckpt)
    assert runs[0]["hosts"] == [h1, h2] and runs[1]["hosts"] == [h1], runs
    assert runs[1]["start_step"] >= 20  # from its checkpoint, never step 0
    assert json.loads((ckpt / "done.json").read_text())["step"] == 400


def test_elastic_job_is_resized_across_nodes_by_checkpoint_restart(
    allocation: SlurmAllocation, daemon_factory: DaemonFactory, tmp_path: Path
) -> None:
    """The end-to-end tests' elastic job (``test_e2e.TRAIN``: it reports a profile, stops on
    SIGTERM with a checkpoint) under the goodput policy: alone it spans both nodes; a second
    job arrives and the first is shrunk to one node in the same pass (its step ends with a
    checkpoint, a one-node step resumes from it)."""
    daemon = daemon_factory(
        config=daemon_config(tmp_path, policy="goodput"), env=allocation.environ(),
        timeout_s=60, cwd=tmp_path,
    )  # fmt: skip
    (tmp_path / "train.py").write_text(TRAIN)
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": str(REPO_ROOT),
           "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "eth0"}  # fmt: skip

    def submit_train(steps: int) -> str:
        reply = daemon.client.request(
            "submit", argv=[sys.executable, "train.py", str(steps), "0.05"],
            workdir=str(tmp_path), env=env, elastic=True, max_gpus=2, batch_size=64,
        )  # fmt: skip
        return str(reply["id"])

    first = submit_train(400)

    def training_on_both_nodes() -> bool:
        # placed on both nodes, and that step has begun to train (a step placed but stopped
        # before its first line would leave no 2-replica run in the log)
        log = daemon.client.request("logs", id=first, offset=-20000)["data"]
        return len(job(daemon, first)["nodes"]) == 2 and "world=2" in log

    try:
        wait_for(training_on_both_nodes, 60, "the first job training on both nodes")
    except AssertionError as exc:
        shown = daemon.client.request("show", id=first)
        raise AssertionError(f"{exc}: {shown['job']['reason']} {shown['decisions'][-3:]}") from None
    second = submit_train(30)
    assert ended(daemon, second, 90) == "succeeded"
    assert ended(daemon, first, 120) == "succeeded"
    log = daemon.client.request("logs", id=first, offset=-20000)["data"]
    runs = [(int(s), int(w)) for s, w in re.findall(r"resume step=(\d+) world=(\d+)", log)]
    saved = [int(s) for s in re.findall(r"checkpoint step=(\d+)", log)]
    assert {world for _, world in runs} == {1, 2}, log
    # every incarnation resumed exactly where the previous one checkpointed
    assert [step for step, _ in runs[1:]] == saved[: len(runs) - 1], log
    assert "finished step=400" in log
    decisions = daemon.client.request("show", id=first)["decisions"]
    shrinks = [d for d in decisions if d["kind"] == "resize" and d["batch"]["replicas"] == 1]
    assert shrinks and len(shrinks[0]["placement"]) == 1, decisions


def test_daemon_restarted_in_a_new_allocation_recovers_its_queue(
    allocation: SlurmAllocation, daemon_factory: DaemonFactory, tmp_path: Path
) -> None:
    """The allocation ends under a running job (its walltime, a scancel) and the daemon with
    it; a daemon on the same state in a new allocation has the same queue: the running job
    resumes from its checkpoint, the held one is still held and runs once released."""
    state = tmp_path / "state"
    config = daemon_config(tmp_path)
    daemon = daemon_factory(
        config=config, env=allocation.environ(), state_dir=state, timeout_s=60, cwd=tmp_path
    )
    running = submit(daemon, tmp_path, steps=150, sleep_s=0.05)
    held = submit(daemon, tmp_path, steps=10, sleep_s=0.02, hold=True)
    ckpt = job_checkpoint_dir(tmp_path / "ckpt", daemon.state_dir, running)
    wait_for(lambda: checkpoint_step(ckpt) >= 10, 60, "the job to make progress")
    daemon.kill()
    allocation.cancel()  # Slurm ends its steps
    wait_for(lambda: not steps_of(allocation), 30, "the old allocation's steps to end")

    later = make_allocation()
    try:
        daemon = daemon_factory(
            config=config, env=later.environ(), state_dir=state, timeout_s=60, cwd=tmp_path
        )
        assert job(daemon, held)["state"] == "held"
        assert ended(daemon, running, 90) == "succeeded", daemon.output()
        runs = incarnations(ckpt)
        assert len(runs) == 2 and runs[1]["start_step"] >= 10, runs  # from its checkpoint
        assert json.loads((ckpt / "done.json").read_text())["step"] == 150
        shown = daemon.client.request("show", id=running)
        assert shown["job"]["failures"] == 0, shown["decisions"]  # not counted as a crash
        daemon.client.request("release", id=held)
        assert ended(daemon, held, 60) == "succeeded"
    finally:
        daemon.stop()
        later.cancel()
