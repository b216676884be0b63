"""What an SSH node's agent is told to start: every replica of an incarnation writes a log
file of its own on the node, even when a joiner takes the rank of a replica still running."""

from __future__ import annotations

import tempfile
from pathlib import Path

from pollux_local.launch.base import LaunchSpec, ReplicaSlot
from pollux_local.launch.ssh import SshLauncher, SshNodeConfig


def test_a_joiner_writes_its_own_log_file_on_the_node(tmp_path: Path) -> None:
    node = SshNodeConfig(name="b", host="b", devices=("cpu:0", "cpu:1"), workdir="/nfs/u/.pl")
    with tempfile.TemporaryDirectory(prefix="pl", dir="/tmp") as short:  # a socket path's room
        launcher = SshLauncher([node], control_dir=Path(short))
    slots = [
        ReplicaSlot(rank=r, node="b", device=f"cpu:{r}", local_rank=r, node_rank=0) for r in (0, 1)
    ]
    spec = LaunchSpec(
        job_id="7", argv=["train.py"], workdir=tmp_path, env={}, slots=slots, log_dir=tmp_path
    )
    started = launcher.replica_payload(spec, slots[1], node, None, "start #0")
    joined = launcher.replica_payload(spec, slots[1], node, None, "joined", joining=3)
    again = launcher.replica_payload(spec, slots[1], node, None, "joined", joining=4)
    assert started["log"] == "/nfs/u/.pl/logs/7/rank1.log"
    assert joined["log"] == "/nfs/u/.pl/logs/7/rank1.join3.log"
    assert len({started["log"], joined["log"], again["log"]}) == 3
    assert started["rank"] == joined["rank"] == 1
