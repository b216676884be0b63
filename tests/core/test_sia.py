"""The Sia baseline on small synthetic cases: its menu, its batch search, its restart factor,
projection across types and the pins of restoring jobs."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from pollux_local.core.goodput import GoodputModel
from pollux_local.core.sia import SiaPolicy, restart_factor, sia_batch_search
from pollux_local.core.throughput import ThroughputParams
from pollux_local.core.types import BatchBounds, GradStats, JobView, NodeView, Placement

pytestmark = pytest.mark.timeout(120)

BOUNDS = BatchBounds(base_batch=32, max_batch=1024, min_local=8, max_local=128)
PARAMS = ThroughputParams(
    alpha_c=0.005, beta_c=1e-3, alpha_r=0.01, beta_r=5e-4, alpha_n=0.02, beta_n=1e-3, gamma=1.5
)
STATS = GradStats(sqr=1.0, var=4.0)


def nodes() -> list[NodeView]:
    return [NodeView(f"slow-{i}", 4, device_type="slow") for i in range(2)] + [
        NodeView("fast-0", 8, device_type="fast")
    ]


def kinds(placement: Placement, cluster: list[NodeView]) -> set[str]:
    return {cluster[i].device_type for i, c in enumerate(placement) if c > 0}


def test_restart_factor() -> None:
    assert restart_factor(10.0, 0, 30.0) == 1.0  # younger than one restart: no penalty
    assert restart_factor(300.0, 0, 30.0) == pytest.approx(300 / 330)
    assert restart_factor(300.0, 4, 30.0) == pytest.approx(180 / 330)
    assert restart_factor(300.0, 20, 30.0) == 0.0


def test_batch_search_accumulates_on_one_replica_and_respects_memory() -> None:
    goodput, micro, accum = sia_batch_search(
        PARAMS, STATS, 32, [1, 1, 2], [1, 4, 16], 1024, (8, 64)
    )
    assert (goodput > 0).all()
    assert (micro >= 8).all() and (micro <= 64).all()
    total = np.array([1, 4, 16]) * micro * (accum + 1)
    assert (total >= 32).all() and (total <= 1024 * 1.001).all()
    if micro[0] * (accum[0] + 1) > 32:  # one replica above M0 always accumulates
        assert accum[0] >= 1
    none, _, _ = sia_batch_search(PARAMS, STATS, 32, [1], [1], 1024, (2000, 3000))
    assert none[0] == 0.0  # no candidate micro-batch fits the range


def test_jobs_never_run_get_one_device_each() -> None:
    cluster = nodes()
    jobs = [JobView(id=f"j{i}", max_replicas=64) for i in range(5)]
    decision = SiaPolicy().decide(jobs, cluster, 60.0, np.random.default_rng(0))
    for job in jobs:
        assert sum(decision.placements[job.id]) == 1


def test_a_job_measured_on_a_slow_type_is_moved_to_the_projected_faster_one() -> None:
    cluster = nodes()
    job = JobView(
        id="a",
        models_by_type={"slow": GoodputModel(PARAMS, STATS, BOUNDS)},
        type_rates={"slow": 1.0, "fast": 6.0},
        max_profiled_replicas=1,
        max_replicas=64,
        placement=(1, 0, 0),
        age_s=600.0,
        static_batch=512,
        restart_cost_s=30.0,
    )
    decision = SiaPolicy().decide([job], cluster, 600.0, np.random.default_rng(0))
    placement = decision.placements["a"]
    assert kinds(placement, cluster) == {"fast"}
    assert sum(placement) == 2  # at most twice the largest count profiled


def test_configurations_come_from_the_menu_and_fit_each_type() -> None:
    cluster = nodes()
    rng = np.random.default_rng(1)
    jobs = []
    for i in range(7):
        profiled = int(rng.choice([1, 2, 4, 8]))
        speed = float(rng.uniform(1, 4))
        model = GoodputModel(
            ThroughputParams(0.005, 1e-3 / speed, 0.01, 5e-4, 0.02, 1e-3, 1.5), STATS, BOUNDS
        )
        jobs.append(
            JobView(
                id=f"j{i}",
                models_by_type={"slow": model},
                type_rates={"slow": 1.0, "fast": 3.0},
                max_profiled_replicas=profiled,
                max_replicas=64,
                age_s=1000.0,
                static_batch=1024,
            )
        )
    decision = SiaPolicy().decide(jobs, cluster, 60.0, rng)
    used = np.zeros(len(cluster), dtype=int)
    for job in jobs:
        placement = decision.placements[job.id]
        count = sum(placement)
        used += np.asarray(placement, dtype=int) if count else 0
        if count:
            (kind,) = kinds(placement, cluster)
            # slow: 1, 2, 4 on one node, 8 on both; fast: 1, 2, 4, 8 on its one node
            assert count in ({1, 2, 4, 8} if kind == "slow" else {1, 2, 4, 8})
            if kind == "slow" and count == 8:
                assert placement[:2] == (4, 4)
            assert count <= 2 * job.max_profiled_replicas
    assert (used <= [n.devices for n in cluster]).all()


def test_a_restoring_job_keeps_its_configuration() -> None:
    cluster = nodes()
    fast_model = GoodputModel(
        ThroughputParams(0.005, 1e-4, 0.01, 5e-4, 0.02, 1e-3, 1.5), STATS, BOUNDS
    )
    job = JobView(
        id="a",
        models_by_type={"slow": GoodputModel(PARAMS, STATS, BOUNDS), "fast": fast_model},
        type_rates={"slow": 1.0, "fast": 10.0},
        max_profiled_replicas=4,
        max_replicas=64,
        placement=(2, 0, 0),
        age_s=5000.0,
        static_batch=1024,
        restoring=True,
    )
    policy = SiaPolicy()
    pinned = policy.decide([job], cluster, 60.0, np.random.default_rng(0)).placements["a"]
    assert kinds(pinned, cluster) == {"slow"} and sum(pinned) == 2
    free = policy.decide(
        [replace(job, restoring=False)], cluster, 60.0, np.random.default_rng(0)
    ).placements["a"]
    assert kinds(free, cluster) == {"fast"}
