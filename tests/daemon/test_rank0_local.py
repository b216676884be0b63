"""``show``'s ``rank0_local``: whether a running job's rank 0 runs on the daemon's machine (where
``pollux-local send`` can reach a ``--stdin`` job's input): ranks go in the config's node
order, so it is the first of the config's nodes the job holds devices on, until the stored
processes say where rank 0 runs."""

from __future__ import annotations

import pytest

from pollux_local.api.states import JobState
from pollux_local.daemon.config import DaemonConfig, NodeConfig
from pollux_local.daemon.readmodel import rank0_local
from pollux_local.daemon.state import JobRecord
from pollux_local.launch.slurm.allocation import SlurmNode

CONFIG = DaemonConfig(
    nodes=(
        NodeConfig("here", ("cpu:0", "cpu:1")),
        NodeConfig("box2", ("cpu:0",), host="box2"),
        NodeConfig("sl1", ("cpu:0",), slurm=SlurmNode("sl1", "10.0.0.9", 0, 1)),
    )
)


def job(state: JobState, placement: dict[str, list[str]]) -> JobRecord:
    return JobRecord(
        id=7, name="j", owner_uid=1000, owner_gid=1000, owner_name="ada", state=state,
        spec={"argv": ["sh"], "workdir": "/tmp", "stdin": True}, submit_time=0.0,
        placement=placement,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("placement", "expected"),
    [
        ({"here": ["cpu:0"]}, True),
        ({"box2": ["cpu:0"], "here": ["cpu:1"]}, True),  # config order, not the placement's
        ({"box2": ["cpu:0"]}, False),
        ({"sl1": ["cpu:0"]}, False),
        ({"gone": ["cpu:0"]}, None),
    ],
)
def test_rank_0_is_on_the_first_of_the_configs_nodes_the_job_holds(
    placement: dict[str, list[str]], expected: bool | None
) -> None:
    assert rank0_local(job(JobState.RUNNING, placement), CONFIG) is expected
    assert rank0_local(job(JobState.RESCALING, placement), CONFIG) is expected


@pytest.mark.parametrize("state", [JobState.QUEUED, JobState.HELD, JobState.SUCCEEDED])
def test_a_job_not_running_has_no_rank_0(state: JobState) -> None:
    assert rank0_local(job(state, {"here": ["cpu:0"]}), CONFIG) is None


def test_rank_0_is_where_its_process_runs_once_known() -> None:
    """After a warm resize that gave up rank 0's node the ranks are renumbered: the stored
    processes say where rank 0 runs, not the config's order."""
    placed = job(JobState.RUNNING, {"here": ["cpu:1"], "box2": ["cpu:0"]})
    placed.pids = [
        {"rank": 0, "pid": 400, "node": "box2"},
        {"rank": 1, "pid": 401, "node": "here"},
    ]
    assert rank0_local(placed, CONFIG) is False
    placed.pids = [{"rank": 0, "pid": 402, "node": "here"}]
    assert rank0_local(placed, CONFIG) is True
