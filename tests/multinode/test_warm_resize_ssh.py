"""Warm resizes on SSH nodes, through a real daemon: an elastic job on one namespace host
with two CPU devices is shrunk when another job comes and grown back when it ends, in place
(its node agent starts the joiner and writes the order; the replicas that stay are never
restarted), and ends with every step taken exactly once; a job across two hosts gives one up
and grows back onto it (a new agent there starts the joiner) the same way.  That a job
resized in place ends with the weights of an uninterrupted run is shown on this machine's
nodes (``tests/daemon/test_warm_resize.py``): the job-side path is the same."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from pollux_local import api
from tests.daemon.test_warm_resize import replicas, resized_in_place, show, waiting
from tests.daemon_process import DaemonFactory, DaemonProcess, wait_for

from .conftest import PYTHON, REPO_ROOT, node_table
from .testbed import Testbed

torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

PROBE = ["-m", "pollux_local.torch.probe", "--base-batch", "32", "--max-batch", "32"]
#: paced while a file exists: 0.2 s a step on one replica, so that its 384 steps outlast a
#: shrink, another job's 4 s and the grow back on a loaded machine (a job that ends before
#: its grow back is not resized back)
PROBE += ["--no-adapt", "--samples", "2048", "--pause", "0.006", "--activation", "tanh"]
EPOCHS = 6
ENV = {
    "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
    "HOME": os.environ.get("HOME", "/root"),
    "PYTHONPATH": str(REPO_ROOT),
    "OMP_NUM_THREADS": "1",
}


def daemon_config(
    bed: Testbed, root: Path, hosts: int = 1, devices: str = "cpu:2", shared: bool = False
) -> str:
    """The test bed's first ``hosts`` hosts as the daemon's only nodes, with ``devices``
    (``shared``: all with one work directory, as nodes with a home on NFS have)."""
    lines = [
        "[scheduler]",
        "interval_s = 1",
        "restart_cost_s = 2",
        "warm_resize = true",
        "warm_timeout_s = 60",
        "[daemon]",
        f'checkpoint_root = "{root / "ckpt"}"',
        "pg_timeout_s = 30",
        "stop_grace_s = 15",
    ]
    for host in bed.hosts[:hosts]:
        table = node_table(bed, host, devices, root)
        if shared:
            table = [
                f'workdir = "{root / "work-shared"}"' if t.startswith("workdir") else t
                for t in table
            ]
        lines += table
    return "\n".join(lines) + "\n"


def submit_probe(daemon: DaemonProcess, workdir: Path, out: Path, slow: Path) -> str:
    """The elastic probe job of one or two devices at a fixed total batch of 32, paced while
    ``slow`` exists."""
    args = ["--epochs", str(EPOCHS), "--out", str(out), "--pause-while", str(slow)]
    return daemon.client.call(
        api.Submit(
            argv=[PYTHON, *PROBE, *args],
            workdir=str(workdir),
            elastic=True,
            min_gpus=1,
            max_gpus=2,
            batch_size=32,
            max_batch_size=32,
            name="resized",
            env=ENV,
        )
    ).id


def start_probe(daemon: DaemonProcess, tmp_path: Path, where: str) -> tuple[str, Path, Path]:
    """The paced probe job, once it runs on two devices (``where``: which) and has reported:
    (job, its final model's path, the file that paces it while it exists)."""
    out, slow = tmp_path / "resized.pt", tmp_path / "slow"
    slow.touch()
    job = submit_probe(daemon, tmp_path, out, slow)
    waiting(
        daemon, job,
        lambda: replicas(daemon, job) == 2 and show(daemon, job).job.report is not None,
        120, f"the job to run on {where}",
    )  # fmt: skip
    return job, out, slow


def until_done(daemon: DaemonProcess, job: str) -> Any:
    return waiting(
        daemon, job,
        lambda: (j := show(daemon, job).job).state.value in ("succeeded", "failed") and j,
        180, "the job to end",
    )  # fmt: skip


def check_resized_in_place(daemon: DaemonProcess, job: str, done: Any, out: Path) -> str:
    """Succeeded, resized in place (at least a shrink and a grow), never restarted, every
    step taken exactly once; returns rank 1's log."""
    reply = resized_in_place(daemon, job, done, at_least=2)
    assert reply.job.resizes_warm >= 2 and reply.job.resize_warm_s is not None, reply.job
    assert torch.load(out, weights_only=False)["steps"] == EPOCHS * 2048 // 32
    return daemon.client.call(api.Logs(id=job, rank=1, offset=-(1 << 20), max_bytes=1 << 20)).data


def test_an_elastic_job_on_an_ssh_node_is_shrunk_and_grown_in_place(
    testbed: Testbed, daemon_factory: DaemonFactory, tmp_path: Path
) -> None:
    daemon = daemon_factory(config=daemon_config(testbed, tmp_path), timeout_s=60)
    job, out, slow = start_probe(daemon, tmp_path, "both devices")
    other = daemon.client.call(
        api.Submit(argv=["sleep", "4"], workdir=str(tmp_path), name="other", env=ENV)
    ).id
    waiting(daemon, job, lambda: replicas(daemon, job) == 1, 60, "a shrink")
    wait_for(lambda: show(daemon, other).job.state.value == "succeeded", 120, "the other job")
    waiting(daemon, job, lambda: replicas(daemon, job) == 2, 60, "a grow")
    slow.unlink()  # the rest of its steps at full speed
    rank1 = check_resized_in_place(daemon, job, until_done(daemon, job), out)
    # rank 1 was started on the node as a joiner at the grow (its log's banner came back)
    assert "joined at resize" in rank1 and f"on {testbed.hosts[0].name}" in rank1


def on_two_hosts(
    testbed: Testbed, daemon_factory: DaemonFactory, tmp_path: Path, shared: bool = False
) -> tuple[DaemonProcess, str, Path, Path]:
    """A daemon on the test bed's two hosts (one device each; ``shared``: one work directory)
    running the paced probe job on both: (daemon, job, its final model's path, the file that
    paces it while it exists)."""
    daemon = daemon_factory(
        config=daemon_config(testbed, tmp_path, hosts=2, devices="cpu:1", shared=shared),
        timeout_s=60,
    )
    job, out, slow = start_probe(daemon, tmp_path, "both hosts")
    return daemon, job, out, slow


def test_a_job_across_two_ssh_nodes_gives_one_up_and_grows_back_onto_it_in_place(
    testbed: Testbed, daemon_factory: DaemonFactory, tmp_path: Path
) -> None:
    h1, h2 = testbed.hosts
    daemon, job, out, slow = on_two_hosts(testbed, daemon_factory, tmp_path)
    assert sorted(show(daemon, job).job.devices) == [h1.name, h2.name]
    # a job that may only run on the second host: rank 0, on the first, stays
    other = daemon.client.call(
        api.Submit(
            argv=["sleep", "4"], workdir=str(tmp_path), name="other", env=ENV,
            constraint=api.Constraint(nodes=[h2.name]),
        )
    ).id  # fmt: skip
    waiting(daemon, job, lambda: replicas(daemon, job) == 1, 60, "a shrink off the second host")
    assert list(show(daemon, job).job.devices) == [h1.name]
    wait_for(lambda: show(daemon, other).job.state.value == "succeeded", 120, "the other job")
    waiting(daemon, job, lambda: replicas(daemon, job) == 2, 60, "a grow back onto it")
    slow.unlink()
    rank1 = check_resized_in_place(daemon, job, until_done(daemon, job), out)
    # rank 1 joined on the second host, whose agent the grow started
    assert "joined at resize" in rank1 and f"on {h2.name}" in rank1


@pytest.mark.parametrize("shared", [False, True], ids=["own-workdirs", "one-shared-workdir"])
def test_a_job_that_gives_up_rank_0s_node_hands_rank_0_over_in_place(
    testbed: Testbed, daemon_factory: DaemonFactory, tmp_path: Path, shared: bool
) -> None:
    """The first host (rank 0's) is wanted by another job: rank 1, on the second host, becomes
    rank 0 and the job goes on there alone, then grows back onto the first host, never
    restarted; rank 0's log goes on with the new rank 0's output.  With one work directory
    for both hosts the joining rank 1 writes a log file of its own on the nodes, not the one
    the renamed rank 0 still writes."""
    h1, h2 = testbed.hosts
    daemon, job, out, slow = on_two_hosts(testbed, daemon_factory, tmp_path, shared)
    pids = {p.rank: p.node for p in show(daemon, job).job.pids}
    assert pids == {0: h1.name, 1: h2.name}, pids
    other = daemon.client.call(
        api.Submit(
            argv=["sleep", "4"], workdir=str(tmp_path), name="other", env=ENV,
            constraint=api.Constraint(nodes=[h1.name]),
        )
    ).id  # fmt: skip
    waiting(
        daemon, job,
        lambda: replicas(daemon, job) == 1 and list(show(daemon, job).job.devices) == [h2.name],
        60, "a shrink off rank 0's host",
    )  # fmt: skip
    assert {p.rank: p.node for p in show(daemon, job).job.pids} == {0: h2.name}
    wait_for(lambda: show(daemon, other).job.state.value == "succeeded", 120, "the other job")
    waiting(daemon, job, lambda: replicas(daemon, job) == 2, 60, "a grow back onto it")
    slow.unlink()
    done = until_done(daemon, job)
    check_resized_in_place(daemon, job, done, out)
    rank0 = daemon.client.call(api.Logs(id=job, rank=0, offset=-(1 << 20), max_bytes=1 << 20)).data
    assert "start #0: rank 0/1 on " + h1.name in rank0  # the first rank 0's output,
    assert "[pollux-local] continued from rank1.log" in rank0  # then the new rank 0's
    if shared:
        # one file per replica started (each begins with its banner, "--- ..."), the joiners'
        # named by their resize: rank1.join<G>.log
        (remote,) = (tmp_path / "work-shared" / "logs").glob(f"*/{job}")  # under its daemon's key
        banners = {
            p.name: sum(line.startswith("--- ") for line in p.read_text().splitlines())
            for p in remote.glob("rank*.log")
        }
        assert any(".join" in name for name in banners), banners
        assert all(count == 1 for count in banners.values()), banners
        # the renamed rank 0's agent follows its own file only: none of the joiner's output
        # reaches rank 0's log
        assert "joined at resize" not in rank0, rank0
