"""Warm resizes in the simulator (``SimConfig.warm_resize_cost_s``, ``simulate
--warm-resize-cost``) and the policy's discount taking each job's own resize cost."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from pollux_local.core.policy import GoodputPolicy
from pollux_local.core.types import Decision, JobView, NodeView, Placement
from pollux_local.errors import PolluxError
from pollux_local.sim.engine import SimConfig, Simulator
from pollux_local.sim.profiles import AppProfile, load_profiles
from pollux_local.sim.workload import WorkloadJob
from tests.core.test_policy import young_and_old

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def profiles(artifact_dir: Path) -> dict[str, AppProfile]:
    return load_profiles(artifact_dir / "models", {"bert"})


class _Script:
    """A policy that places the one job as scripted, one placement per round, and records
    the costs the views told it."""

    name = "script"

    def __init__(self, placements: Sequence[Placement]) -> None:
        self.placements = list(placements)
        self.seen: list[tuple[float | None, float | None]] = []

    def decide(
        self, jobs: Sequence[JobView], nodes: Sequence[NodeView], now: float,
        rng: np.random.Generator,
    ) -> Decision:  # fmt: skip
        self.seen.append((jobs[0].restart_cost_s, jobs[0].warm_resize_cost_s))
        index = min(len(self.seen) - 1, len(self.placements) - 1)
        return Decision({jobs[0].id: self.placements[index]})


#: 2 devices on node 0; 4 on node 0 (grows in place); 4 on node 1 (moves off its node: a
#: restart); 4 on node 0 and 4 on node 1 (grows onto node 0, keeping node 1).
SCRIPT = [(2, 0), (4, 0), (0, 4), (4, 4)]


def run(profiles: dict[str, AppProfile], warm: float | None) -> tuple[Simulator, _Script]:
    policy = _Script(SCRIPT)
    config = SimConfig(nodes=2, gpus_per_node=4, warm_resize_cost_s=warm, restart_cost_s=30.0)
    trace = [WorkloadJob("j", 0.0, "bert", 1, 12)]
    sim = Simulator(trace, profiles, policy, config, adaptive=True)
    return sim, policy


def test_a_resize_that_keeps_a_node_is_warm_and_a_move_is_cold(
    profiles: dict[str, AppProfile],
) -> None:
    warm_sim, warm_policy = run(profiles, 2.0)
    warm = warm_sim.run()
    cold = run(profiles, None)[0].run()
    assert cold.restarts["j"] == 3 and cold.warm_resizes["j"] == 0
    # 2 -> 4 on its node and 4 -> 8 keeping node 1 are warm; the move to node 1 restarts it
    assert warm.restarts["j"] == 1 and warm.warm_resizes["j"] == 2
    assert warm.summary()["warm_resizes_per_job"] == 2.0
    # two warm resizes save 2 x (30 - 2) s of no progress, less what the faster rounds
    # in between change: the warm run finishes sooner
    assert warm.jct_s["j"] < cold.jct_s["j"]
    # the policy is told the declared warm cost (the cold one is its own default here)
    assert warm_policy.seen[0] == (None, 2.0)


def test_the_policy_learns_a_jobs_restart_cost_once_it_restarted(
    profiles: dict[str, AppProfile],
) -> None:
    """``measured_restart_cost``: as the daemon measures it, the job's own cost (here the
    simulated 90 s) is told once it has restarted; before, the policy's default stands."""
    policy = _Script([(2, 0), (0, 2)])
    config = SimConfig(nodes=2, gpus_per_node=4, restart_cost_s=90.0, measured_restart_cost=True)
    trace = [WorkloadJob("j", 0.0, "bert", 1, 12)]
    Simulator(trace, profiles, policy, config, adaptive=True).run()
    assert policy.seen[:2] == [(None, None), (None, None)]  # first start, then the move
    assert set(policy.seen[2:]) == {(90.0, None)}


def test_warm_resize_cost_is_checked() -> None:
    with pytest.raises(PolluxError, match="warm resize cost"):
        SimConfig(warm_resize_cost_s=-1.0).validate()


def test_the_discount_takes_the_jobs_own_costs() -> None:
    policy = GoodputPolicy(restart_cost_s=30.0)
    job = JobView(id="a", age_s=600.0, placement=(2,))
    assert policy.resize_cost(job) == 30.0
    measured = JobView(id="a", age_s=600.0, placement=(2,), restart_cost_s=4.0)
    assert policy.resize_cost(measured) == 4.0
    both = JobView(id="a", age_s=600.0, placement=(2,), restart_cost_s=4.0, warm_resize_cost_s=0.5)
    assert policy.resize_cost(both) == 0.5
    assert policy.resize_cost(both, warm=False) == 4.0  # a move to another device type
    # a cheaper resize discounts a change less: H / (H + m d)
    assert policy._discount(both) > policy._discount(measured) > policy._discount(job)


def test_a_cheaper_measured_cost_lets_the_policy_resize_a_young_job() -> None:
    """The young job the policy keeps for a small gain at the configured 30 s (the policy
    tests' case) is grown once its own resizes were measured cheap, cold or warm."""
    jobs, nodes = young_and_old(age_s=120.0)

    def placed(**costs: float) -> Placement:
        view = replace(jobs[0], **costs)  # type: ignore[arg-type]
        decision = GoodputPolicy().decide([view], nodes, 0.0, np.random.default_rng(0))
        return decision.placements["j"]

    assert placed() == (2,)
    assert placed(restart_cost_s=0.5) == (3,)
    assert placed(warm_resize_cost_s=0.5) == (3,)
    assert placed(restart_cost_s=300.0) == (2,)


def test_simulate_cli_takes_a_warm_resize_cost(artifact_dir: Path, tmp_path: Path) -> None:
    trace = tmp_path / "t.csv"
    trace.write_text(
        "name,time,application,num_replicas,batch_size\n"
        + "".join(f"j{i},{i * 60},bert,1,12\n" for i in range(4))
    )
    out = subprocess.run(
        [sys.executable, "-m", "pollux_local", "simulate", str(trace), "--nodes", "2",
         "--models", str(artifact_dir / "models"), "--warm-resize-cost", "3", "--json"],
        capture_output=True, text=True, timeout=240, check=True,
    )  # fmt: skip
    summary = json.loads(out.stdout)
    assert summary["completed"] == 4
    assert "warm_resizes_per_job" in summary
    bad = subprocess.run(
        [sys.executable, "-m", "pollux_local", "simulate", str(trace),
         "--warm-resize-cost", "-2"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert bad.returncode != 0 and "--warm-resize-cost" in bad.stderr
