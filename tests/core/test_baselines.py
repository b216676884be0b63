"""FIFO, Tiresias and Optimus: invariants (capacity, bounds, determinism) and behaviour."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pollux_local.core.baselines import (
    TIRESIAS_THRESHOLD_GPU_S,
    FifoPolicy,
    OptimusPolicy,
    TiresiasPolicy,
    pack,
)
from pollux_local.core.types import Decision, JobView, NodeView

RNG = np.random.default_rng(0)


def nodes_of(*sizes: int) -> list[NodeView]:
    return [NodeView(name=f"n{i}", devices=s) for i, s in enumerate(sizes)]


def job(
    name: str,
    submit: float = 0.0,
    static: int = 1,
    placement: tuple[int, ...] = (),
    attained: float = 0.0,
    max_replicas: int = 64,
    remaining: float | None = None,
    iter_times: tuple[float, ...] = (),
) -> JobView:
    return JobView(
        id=name,
        submit_time=submit,
        static_replicas=static,
        placement=placement,
        attained_gpu_s=attained,
        max_replicas=max_replicas,
        remaining_iters=remaining,
        static_iter_time_s=iter_times,
    )


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[list[JobView], list[NodeView]]:
    sizes = draw(st.lists(st.integers(0, 8), min_size=1, max_size=6))
    nodes = nodes_of(*sizes)
    count = draw(st.integers(0, 12))
    jobs = []
    free = list(sizes)
    for i in range(count):
        static = draw(st.integers(1, 10))
        max_rep = draw(st.integers(1, 12))
        # some jobs already run on a placement that fit when it was made
        placement: tuple[int, ...] = ()
        if draw(st.booleans()):
            spot = pack(min(static, max_rep), free)
            if spot is not None:
                placement = spot
                free = [f - u for f, u in zip(free, spot, strict=True)]
        k = max(1, max_rep)
        times = tuple(
            sorted(draw(st.lists(st.floats(0.1, 5.0), min_size=k, max_size=k)), reverse=True)
        )
        jobs.append(
            job(
                f"j{i}",
                submit=float(draw(st.integers(0, 5))),
                static=static,
                placement=placement,
                attained=draw(st.floats(0, 2 * TIRESIAS_THRESHOLD_GPU_S)),
                max_replicas=max_rep,
                remaining=draw(st.floats(1, 1e5)),
                iter_times=times,
            )
        )
    return jobs, nodes


def check_invariants(
    decision: Decision, jobs: Sequence[JobView], nodes: Sequence[NodeView]
) -> None:
    assert set(decision.placements) == {j.id for j in jobs}
    used = np.zeros(len(nodes), dtype=int)
    for j in jobs:
        placement = decision.placements[j.id]
        assert len(placement) == len(nodes)
        assert min(placement, default=0) >= 0
        used += np.asarray(placement, dtype=int)
        k = sum(placement)
        if k:
            assert j.min_replicas <= k <= j.max_replicas
    assert (used <= np.array([n.devices for n in nodes])).all()


POLICIES = [FifoPolicy, TiresiasPolicy, OptimusPolicy]


@pytest.mark.parametrize("policy_cls", POLICIES)
@settings(max_examples=80, deadline=None)
@given(scenario=scenarios())
def test_capacity_bounds_and_determinism(policy_cls: type, scenario: tuple) -> None:
    jobs, nodes = scenario
    first = policy_cls().decide(jobs, nodes, 0.0, np.random.default_rng(1))
    check_invariants(first, jobs, nodes)
    second = policy_cls().decide(list(reversed(jobs)), nodes, 0.0, np.random.default_rng(2))
    assert dict(first.placements) == dict(second.placements)


@pytest.mark.parametrize("policy_cls", [FifoPolicy, TiresiasPolicy])
@settings(max_examples=50, deadline=None)
@given(scenario=scenarios())
def test_static_policies_run_jobs_on_their_own_count(policy_cls: type, scenario: tuple) -> None:
    jobs, nodes = scenario
    total = sum(n.devices for n in nodes)
    decision = policy_cls().decide(jobs, nodes, 0.0, RNG)
    for j in jobs:
        k = sum(decision.placements[j.id])
        assert k in (0, min(j.static_replicas, j.max_replicas, total))


def test_pack_prefers_one_node_then_fewest_nodes() -> None:
    assert pack(3, [4, 3, 2]) == (0, 3, 0)  # the tightest node that fits
    assert pack(6, [4, 3, 2]) == (4, 2, 0)  # largest nodes first
    assert pack(10, [4, 3, 2]) is None


def test_fifo_blocks_behind_the_head_and_never_preempts() -> None:
    nodes = nodes_of(4, 4)
    running = job("old", submit=5.0, static=4, placement=(4, 0))
    head = job("head", submit=1.0, static=8)
    small = job("small", submit=2.0, static=1)
    decision = FifoPolicy().decide([running, head, small], nodes, 0.0, RNG)
    assert decision.placements["old"] == (4, 0)  # running: kept, although submitted later
    assert sum(decision.placements["head"]) == 0  # does not fit
    assert sum(decision.placements["small"]) == 0  # strict FIFO: waits behind the head


def test_tiresias_prefers_least_attained_service_and_preempts() -> None:
    nodes = nodes_of(4)
    veteran = job(
        "veteran", submit=0.0, static=4, placement=(4,), attained=TIRESIAS_THRESHOLD_GPU_S
    )
    newcomer = job("newcomer", submit=100.0, static=4)
    decision = TiresiasPolicy().decide([veteran, newcomer], nodes, 0.0, RNG)
    assert decision.placements["newcomer"] == (4,)
    assert decision.placements["veteran"] == (0,)
    # below the threshold both are in the high queue: first come first served, no preemption
    veteran = job("veteran", submit=0.0, static=4, placement=(4,), attained=10.0)
    decision = TiresiasPolicy().decide([veteran, newcomer], nodes, 0.0, RNG)
    assert decision.placements == {"veteran": (4,), "newcomer": (0,)}


def test_tiresias_skips_a_job_that_does_not_fit() -> None:
    nodes = nodes_of(4, 4)
    first = job("first", submit=0.0, static=6)
    big = job("big", submit=1.0, static=4)
    small = job("small", submit=2.0, static=2)
    decision = TiresiasPolicy().decide([first, big, small], nodes, 0.0, RNG)
    assert sum(decision.placements["first"]) == 6
    assert sum(decision.placements["big"]) == 0  # 2 devices left: it waits
    assert sum(decision.placements["small"]) == 2  # and a smaller job behind it runs


def test_a_job_larger_than_the_cluster_runs_on_all_of_it() -> None:
    decision = TiresiasPolicy().decide([job("huge", static=16)], nodes_of(4, 4), 0.0, RNG)
    assert decision.placements["huge"] == (4, 4)


def test_tiresias_low_queue_is_ordered_by_demotion() -> None:
    policy = TiresiasPolicy(threshold_gpu_s=100.0)
    nodes = nodes_of(4)
    early = job("early", submit=0.0, static=4, attained=50.0)
    late = job("late", submit=1.0, static=4, attained=150.0)
    policy.decide([early, late], nodes, 0.0, RNG)  # "late" is demoted first
    early = job("early", submit=0.0, static=4, attained=150.0)
    decision = policy.decide([early, late], nodes, 60.0, RNG)
    assert decision.placements["late"] == (4,)
    assert decision.placements["early"] == (0,)


def test_optimus_gives_devices_where_they_save_most_time() -> None:
    nodes = nodes_of(4, 4)
    linear = tuple(1.0 / k for k in range(1, 9))
    flat = tuple(1.0 - 0.01 * (k - 1) for k in range(1, 9))
    scales = job("scales", submit=0.0, remaining=1000.0, iter_times=linear, max_replicas=8)
    stuck = job("stuck", submit=1.0, remaining=1000.0, iter_times=flat, max_replicas=8)
    decision = OptimusPolicy().decide([scales, stuck], nodes, 0.0, RNG)
    assert sum(decision.placements["scales"]) == 7
    assert sum(decision.placements["stuck"]) == 1


def test_optimus_starts_everyone_with_one_device_in_arrival_order() -> None:
    nodes = nodes_of(2)
    jobs = [job(f"j{i}", submit=float(i), remaining=10.0, iter_times=(1.0, 0.5)) for i in range(3)]
    decision = OptimusPolicy().decide(jobs, nodes, 0.0, RNG)
    assert [sum(decision.placements[f"j{i}"]) for i in range(3)] == [1, 1, 0]


def test_down_nodes_get_nothing() -> None:
    nodes = [NodeView("a", 4, up=False), NodeView("b", 4)]
    jobs = [job("x", static=2), job("y", static=2, submit=1.0)]
    for policy in (FifoPolicy(), TiresiasPolicy(), OptimusPolicy()):
        decision = policy.decide(jobs, nodes, 0.0, RNG)
        assert all(p[0] == 0 for p in decision.placements.values())
