"""The same jobs, the same checks, on the SSH test bed (``tests/multinode/testbed.py``: a
daemon reaching two namespace hosts over ssh) and on the Slurm one (a daemon inside an
allocation of two nodes): where the two launchers are meant to behave alike, one test."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.daemon_process import DaemonFactory, DaemonProcess, wait_for
from tests.multinode.test_daemon_multinode import daemon_config as ssh_daemon_config
from tests.multinode.testbed import Testbed, missing_requirements
from tests.paths import job_checkpoint_dir

from .conftest import SlurmAllocation, daemon_config
from .test_slurm_daemon import checkpoint_step, ended, incarnations, job, submit

#: Neither the multinode tests' bed (10.213.0) nor the Slurm bed (10.217.0).
SSH_SUBNET = "10.219.0"

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(150)]


@dataclass(frozen=True)
class Cluster:
    kind: str
    daemon: DaemonProcess
    nodes: list[str]


@pytest.fixture(params=["ssh", "slurm"])
def cluster(
    request: pytest.FixtureRequest, daemon_factory: DaemonFactory, tmp_path: Path
) -> Iterator[Cluster]:
    """A daemon over two nodes, one device each: SSH hosts, or a Slurm allocation."""
    if request.param == "slurm":
        allocation: SlurmAllocation = request.getfixturevalue("allocation")
        daemon = daemon_factory(
            config=daemon_config(tmp_path), env=allocation.environ(), timeout_s=60, cwd=tmp_path
        )
        yield Cluster("slurm", daemon, allocation.nodes)
        return
    reason = missing_requirements()
    if reason:
        pytest.skip(reason)
    # its own subnet: the multinode tests' session bed may be up on the default one
    with Testbed(n_hosts=2, subnet=SSH_SUBNET) as bed:
        daemon = daemon_factory(config=ssh_daemon_config(bed, tmp_path), timeout_s=60)
        try:
            yield Cluster("ssh", daemon, [host.name for host in bed.hosts])
        finally:
            daemon.stop()  # before its nodes go


def test_a_two_rank_job_spans_both_nodes_and_succeeds(cluster: Cluster, tmp_path: Path) -> None:
    daemon = cluster.daemon
    job_id = submit(daemon, tmp_path, steps=40, sleep_s=0.02)
    assert ended(daemon, job_id) == "succeeded", daemon.client.request("logs", id=job_id)
    ckpt = job_checkpoint_dir(tmp_path / "ckpt", daemon.state_dir, job_id)
    assert incarnations(ckpt) == [{"start_step": 0, "world": 2, "hosts": cluster.nodes}]
    shown = job(daemon, job_id)
    assert shown["exit_code"] == 0 and shown["exit_signal"] is None
    assert [(r["rank"], r["node"], r["code"]) for r in shown["replica_exits"]] == [
        (0, cluster.nodes[0], 0),
        (1, cluster.nodes[1], 0),
    ]
    for rank in (0, 1):
        env = json.loads((ckpt / f"env-{rank}.json").read_text())
        assert env["RANK"] == str(rank) and env["WORLD_SIZE"] == "2"
        assert env["NODE_RANK"] == str(rank) and env["LOCAL_RANK"] == "0"
        assert env["POLLUX_NUM_NODES"] == "2" and env["POLLUX_JOB_ID"] == job_id
    log = (daemon.state_dir / "jobs" / job_id / "rank1.log").read_text()
    assert "rank 1 finished at step 40" in log


def test_a_cancelled_job_checkpoints_and_its_exit_is_recorded(
    cluster: Cluster, tmp_path: Path
) -> None:
    daemon = cluster.daemon
    job_id = submit(daemon, tmp_path, steps=100_000, sleep_s=0.05)
    ckpt = job_checkpoint_dir(tmp_path / "ckpt", daemon.state_dir, job_id)
    wait_for(lambda: checkpoint_step(ckpt) >= 5, 60, "the job to make progress")
    daemon.client.request("cancel", ids=[job_id])
    assert ended(daemon, job_id, 40) == "cancelled"
    shown = wait_for(lambda: (j := job(daemon, job_id))["replica_exits"] and j, 20, "its exit")
    assert shown["exit_code"] == 75, shown["replica_exits"]
    assert {r["code"] for r in shown["replica_exits"]} == {75}
    logs = daemon.client.request("logs", id=job_id, offset=-4000)["data"]
    assert "checkpointed at step" in logs
