"""``simulate --cluster``: parsing, the typed simulator's restart and type rules, a small run."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest

from pollux_local.cli import main
from pollux_local.core.types import Decision, JobView, NodeView, Placement
from pollux_local.errors import PolluxError
from pollux_local.sim.cluster import NodeGroup, parse_cluster
from pollux_local.sim.engine import SimConfig, Simulator
from pollux_local.sim.jobs import SIA_RULES
from pollux_local.sim.profiles import load_typed_profiles
from pollux_local.sim.workload import WorkloadJob

pytestmark = pytest.mark.timeout(300)

SIA_MODELS = Path(__file__).resolve().parents[3] / "shared" / "data" / "sia-artifact" / "models"
CLUSTER = "aws:2x4,dgx-ext:1x8"


@pytest.fixture(scope="module")
def sia_models() -> Path:
    if not SIA_MODELS.is_dir():
        pytest.skip(f"Sia artifact profiles not found at {SIA_MODELS}")
    return SIA_MODELS


def test_parse_cluster_keeps_the_order_given() -> None:
    groups = parse_cluster("aws:6x4,dgx-ext:2x8, rtx:3x8")
    assert groups == (
        NodeGroup("aws", 6, 4),
        NodeGroup("dgx-ext", 2, 8),
        NodeGroup("rtx", 3, 8),
    )


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("aws", "TYPE:NODESxDEVICES"),
        ("aws:6*4", "TYPE:NODESxDEVICES"),
        ("aws:0x4", "must be >= 1"),
        ("aws:2x12", "at most 9 devices"),
        ("aws:1x4,aws:2x4", "given twice"),
    ],
)
def test_parse_cluster_rejects_bad_groups(text: str, words: str) -> None:
    with pytest.raises(PolluxError, match=words) as info:
        parse_cluster(text)
    assert "\n" not in str(info.value)


def test_cli_rejects_a_bad_cluster_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "t.csv"
    trace.write_text("name,time,application,num_replicas,batch_size\ncifar10-0,0,cifar10,1,128\n")
    with pytest.raises(SystemExit) as info:
        main(["simulate", str(trace), "--cluster", "aws:6by4"])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--cluster" in err and "aws:6by4" in err


def test_cli_refuses_untyped_policies_on_a_typed_cluster(
    tmp_path: Path, sia_models: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "t.csv"
    trace.write_text("name,time,application,num_replicas,batch_size\ncifar10-0,0,cifar10,1,128\n")
    code = main(
        ["simulate", str(trace), "--models", str(sia_models), "--cluster", CLUSTER]
        + ["--policy", "fifo"]
    )
    assert code != 0
    assert "fifo" in capsys.readouterr().err


@pytest.mark.parametrize("policy", ["goodput", "sia", "goodput-unaware"])
def test_cli_runs_a_small_typed_trace(
    tmp_path: Path, sia_models: Path, policy: str, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "t.csv"
    trace.write_text(
        "name,time,application,num_replicas,batch_size\n"
        "cifar10-0,0,cifar10,2,512\n"
        "cifar10-1,90,cifar10,4,1024\n"
        "deepspeech2-2,200,deepspeech2,2,40\n"
    )
    code = main(
        ["simulate", str(trace), "--models", str(sia_models), "--cluster", CLUSTER]
        + ["--policy", policy, "--json"]
    )
    assert code == 0
    data = json.loads(capsys.readouterr().out)
    assert data["policy"] == policy and data["cluster"] == CLUSTER
    assert data["completed"] == data["jobs"] == 3
    hours = data["device_hours_by_type"]
    assert set(hours) == {"aws", "dgx-ext"} and sum(hours.values()) > 0


class Scripted:
    """A policy that returns placements from a script, one per round (last one repeats),
    keyed by the pass's job ids (a job's index in the trace), and records what it saw."""

    name = "scripted"
    type_aware = True

    def __init__(self, rounds: list[dict[str, Placement]]) -> None:
        self.rounds = rounds
        self.calls = 0
        self.seen: list[list[JobView]] = []

    def decide(
        self,
        jobs: Sequence[JobView],
        nodes: Sequence[NodeView],
        now: float,
        rng: np.random.Generator,
    ) -> Decision:
        self.seen.append(list(jobs))
        placements = self.rounds[min(self.calls, len(self.rounds) - 1)]
        self.calls += 1
        return Decision(placements={j.id: placements.get(j.id, ()) for j in jobs})


def _simulator(sia_models: Path, policy: Scripted, jobs: int = 1) -> Simulator:
    groups = parse_cluster(CLUSTER)  # nodes: aws-0, aws-1 (4 each), dgx-ext-0 (8)
    profiles = load_typed_profiles(sia_models, [g.device_type for g in groups], {"cifar10"})
    trace = [WorkloadJob(f"cifar10-{i}", 0.0, "cifar10", 1, 128) for i in range(jobs)]
    return Simulator(trace, profiles, policy, SimConfig(cluster=groups))


def test_restarts_follow_type_and_shape_not_node_ids(sia_models: Path) -> None:
    script = [
        (2, 0, 0),  # start on aws-0
        (0, 2, 0),  # same shape on aws-1: no restart
        (0, 0, 2),  # to dgx-ext: a restart
        (0, 0, 4),  # a new shape: a restart
    ]
    sim = _simulator(sia_models, Scripted([{}]))
    job = sim.jobs[0]
    delay = SIA_RULES.restore_delay("cifar10", 30.0)
    expected = [(1, "aws", 0.0), (1, "aws", 0.0), (2, "dgx-ext", 0.0), (3, "dgx-ext", 0.0)]
    for placement, (starts, device_type, restore_left) in zip(script, expected, strict=True):
        sim.now += 60
        started_before = job.starts
        sim._apply(job, sim.allocation_for(placement))
        before = job.run_time_s
        sim._advance(job, 60)
        assert (job.starts, job.device_type) == (starts, device_type)
        assert job.restart_left_s == pytest.approx(restore_left)
        # a (re)start trains only after the application's restore delay
        restarted = job.starts > started_before
        assert job.run_time_s - before == pytest.approx(60 - delay if restarted else 60)
    assert job.restarts == 2
    points = job.profiles["aws"]
    assert points and all(key[1] == 2 for key in points)  # measured on aws, 2 replicas


def test_a_placement_spanning_types_is_cut_to_one_type(sia_models: Path) -> None:
    sim = _simulator(sia_models, Scripted([{}]))
    job = sim.jobs[0]
    sim._apply(job, sim.allocation_for((4, 0, 2)))
    assert job.device_type == "aws" and job.placement == (4, 0, 0)
    assert job.allocation == {"aws-0": ["0", "1", "2", "3"]}
    sim2 = _simulator(sia_models, Scripted([{}]))
    job2 = sim2.jobs[0]
    sim2._apply(job2, sim2.allocation_for((1, 0, 1)))  # a tie: the faster type wins
    assert job2.device_type == "dgx-ext" and job2.placement == (0, 0, 1)


def test_views_carry_per_type_models_and_rates(sia_models: Path) -> None:
    policy = Scripted([{"0": (0, 0, 2)}])
    sim = _simulator(sia_models, policy)
    sim.run()
    job = sim.jobs[0]
    assert job.completion_s is not None
    view = policy.seen[-1][0]
    assert view.models_by_type is not None and set(view.models_by_type) == {"dgx-ext"}
    assert view.model is view.models_by_type["dgx-ext"]  # the model of the type it runs on
    assert view.type_rates is not None
    assert view.type_rates["dgx-ext"] > view.type_rates["aws"] > 0
    assert view.restart_cost_s == 30.0


def test_the_scheduling_pass_assigns_the_devices(sia_models: Path) -> None:
    """Two jobs on one node get distinct devices from the pass, and keep them while their
    counts stay (the simulator applies the pass's plan, not the policy's counts alone)."""
    policy = Scripted(
        [
            {"0": (0, 0, 2), "1": (0, 0, 3)},
            {"0": (0, 0, 2), "1": (0, 0, 3)},
            {"0": (0, 0, 0), "1": (0, 0, 3)},
        ]
    )
    sim = _simulator(sia_models, policy, jobs=2)
    first, second = sim.jobs
    decision_ms: list[float] = []
    held = []
    for _ in range(3):
        sim.now += 60
        sim._round([first, second], decision_ms)
        held.append((dict(first.allocation), dict(second.allocation)))
    assert held[0] == ({"dgx-ext-0": ["0", "1"]}, {"dgx-ext-0": ["2", "3", "4"]})
    assert held[1] == held[0]
    assert held[2] == ({}, {"dgx-ext-0": ["2", "3", "4"]})
    assert (first.starts, second.starts) == (1, 1) and len(decision_ms) == 3
