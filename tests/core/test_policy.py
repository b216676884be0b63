"""The goodput allocation policy: invariants (property tests) and behaviour."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pollux_local.core.policy import EXPLORATION_FACTOR, GoodputPolicy
from pollux_local.core.types import Decision, JobView, NodeView


class PowerModel:
    """Goodput = rate * K^exponent, times ``multi_node`` when the job spans several nodes."""

    def __init__(self, rate: float = 100.0, exponent: float = 0.9, multi_node: float = 0.8):
        self.rate = rate
        self.exponent = exponent
        self.multi_node = multi_node

    def best_goodput(
        self, nodes: np.ndarray, replicas: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        k = np.asarray(replicas, dtype=float)
        n = np.asarray(nodes, dtype=float)
        good = self.rate * k**self.exponent * np.where(n > 1, self.multi_node, 1.0)
        good = np.where(k > 0, good, 0.0)
        return good, np.full(k.shape, 32, dtype=np.int64), np.ones(k.shape, dtype=np.int64)


def cluster(n: int, devices: int = 4) -> list[NodeView]:
    return [NodeView(f"n{i}", devices) for i in range(n)]


def job(name: str, **kwargs: object) -> JobView:
    defaults: dict[str, object] = {"model": PowerModel(), "max_profiled_replicas": 64}
    defaults.update(kwargs)
    return JobView(id=name, **defaults)  # type: ignore[arg-type]


def check_invariants(decision: Decision, jobs: list[JobView], nodes: list[NodeView]) -> None:
    assert set(decision.placements) == {j.id for j in jobs}
    assert set(decision.reasons) == {j.id for j in jobs}
    used = np.zeros(len(nodes), dtype=int)
    multi_node_users = np.zeros(len(nodes), dtype=int)
    for j in jobs:
        placement = decision.placements[j.id]
        assert len(placement) == len(nodes)
        assert all(c >= 0 for c in placement)
        k = sum(placement)
        if k:
            assert j.min_replicas <= k <= j.max_replicas, (j, placement)
        used += np.array(placement)
        if sum(1 for c in placement if c > 0) > 1:
            multi_node_users += np.array([c > 0 for c in placement])
    capacity = np.array([n.devices if n.up else 0 for n in nodes])
    assert (used <= capacity).all(), (used, capacity)
    assert (multi_node_users <= 1).all(), multi_node_users


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[list[JobView], list[NodeView]]:
    n_nodes = draw(st.integers(1, 6))
    nodes = [
        NodeView(f"n{i}", draw(st.integers(0, 8)), up=draw(st.booleans()) or i == 0)
        for i in range(n_nodes)
    ]
    jobs = []
    for i in range(draw(st.integers(0, 12))):
        has_model = draw(st.booleans())
        min_k = draw(st.integers(1, 4))
        max_k = draw(st.integers(min_k, 16))
        model = (
            PowerModel(
                rate=draw(st.floats(1.0, 1000.0)),
                exponent=draw(st.floats(0.0, 1.0)),
                multi_node=draw(st.floats(0.3, 1.0)),
            )
            if has_model
            else None
        )
        placement = tuple(draw(st.integers(0, 3)) for _ in nodes) if draw(st.booleans()) else ()
        jobs.append(
            JobView(
                id=f"j{i}",
                owner=f"u{draw(st.integers(0, 2))}",
                model=model,
                age_s=draw(st.floats(0.0, 1e5)),
                restarts=draw(st.integers(0, 5)),
                min_replicas=min_k,
                max_replicas=max_k,
                placement=placement,
                max_profiled_replicas=draw(st.integers(0, 16)) if has_model else 0,
                attained_gpu_s=draw(st.floats(0.0, 1e5)),
                run_time_s=draw(st.floats(0.0, 1e5)),
                priority=draw(st.integers(0, 1)),
                progress_fraction=draw(st.none() | st.floats(0.0, 1.0)),
            )
        )
    return jobs, nodes


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios(), st.sampled_from([-2.0, -1.0, 0.0, 0.5, 1.0]))
def test_invariants_hold_for_any_input(
    scenario: tuple[list[JobView], list[NodeView]], p: float
) -> None:
    jobs, nodes = scenario
    policy = GoodputPolicy(p=p)
    decision = policy.decide(jobs, nodes, 0.0, np.random.default_rng(0))
    check_invariants(decision, jobs, nodes)
    again = policy.decide(jobs, nodes, 0.0, np.random.default_rng(12345))
    assert dict(again.placements) == dict(decision.placements)
    assert dict(again.reasons) == dict(decision.reasons)


@settings(max_examples=40, deadline=None)
@given(scenarios())
def test_invariants_hold_over_consecutive_rounds(
    scenario: tuple[list[JobView], list[NodeView]],
) -> None:
    jobs, nodes = scenario
    jobs = [replace(j, placement=()) for j in jobs]
    policy = GoodputPolicy()
    for r in range(4):
        decision = policy.decide(jobs, nodes, 60.0 * r, np.random.default_rng(r))
        check_invariants(decision, jobs, nodes)
        jobs = [replace(j, placement=decision.placements[j.id], age_s=j.age_s + 60.0) for j in jobs]


def test_devices_are_all_used_when_jobs_can_use_them() -> None:
    nodes = cluster(4)
    jobs = [job(f"j{i}") for i in range(5)]
    decision = GoodputPolicy().decide(jobs, nodes, 0.0, np.random.default_rng(0))
    assert sum(sum(p) for p in decision.placements.values()) == 16


def test_better_scaling_job_gets_more_devices() -> None:
    nodes = cluster(1, devices=8)
    jobs = [
        job("scales", model=PowerModel(exponent=0.95)),
        job("flat", model=PowerModel(exponent=0.2)),
    ]
    decision = GoodputPolicy().decide(jobs, nodes, 0.0, np.random.default_rng(0))
    assert sum(decision.placements["scales"]) > sum(decision.placements["flat"]) >= 1


def test_higher_p_favours_throughput_over_fairness() -> None:
    nodes = cluster(4)
    jobs = [
        job("fast", model=PowerModel(exponent=0.9, multi_node=1.0)),
        job("slow", model=PowerModel(exponent=0.3, multi_node=1.0)),
    ]
    rng = np.random.default_rng(0)
    fair = GoodputPolicy(p=-4.0).decide(jobs, nodes, 0.0, rng)
    total = GoodputPolicy(p=1.0).decide(jobs, nodes, 0.0, rng)
    assert sum(total.placements["fast"]) > sum(fair.placements["fast"])


def test_users_share_rather_than_jobs() -> None:
    nodes = cluster(2)
    linear = PowerModel(exponent=1.0)
    jobs = [job("alone", owner="a", model=linear)] + [
        job(f"many{i}", owner="b", model=linear) for i in range(4)
    ]
    decision = GoodputPolicy().decide(jobs, nodes, 0.0, np.random.default_rng(0))
    assert sum(decision.placements["alone"]) == 4
    assert sum(sum(decision.placements[f"many{i}"]) for i in range(4)) == 4


def test_min_and_max_replicas_are_respected() -> None:
    nodes = cluster(4)
    jobs = [
        job("capped", max_replicas=2, model=PowerModel(exponent=1.0)),
        job("needs_six", min_replicas=6, model=PowerModel(exponent=0.1)),
    ]
    decision = GoodputPolicy().decide(jobs, nodes, 0.0, np.random.default_rng(0))
    assert sum(decision.placements["capped"]) == 2
    assert sum(decision.placements["needs_six"]) >= 6


def test_exploration_is_capped_at_a_multiple_of_the_profiled_replicas() -> None:
    nodes = cluster(4)
    jobs = [job("new", max_profiled_replicas=2, model=PowerModel(exponent=1.0))]
    decision = GoodputPolicy().decide(jobs, nodes, 0.0, np.random.default_rng(0))
    assert sum(decision.placements["new"]) == 2 * EXPLORATION_FACTOR < 16


def test_job_without_a_model_starts_on_one_node_within_its_fair_share() -> None:
    nodes = cluster(3)  # 12 devices, 2 jobs: fair share 6, but no data for two nodes
    jobs = [job("unknown", model=None, max_profiled_replicas=0), job("known")]
    decision = GoodputPolicy().decide(jobs, nodes, 0.0, np.random.default_rng(0))
    assert sorted(decision.placements["unknown"]) == [0, 0, 4]
    assert "linear" in decision.reasons["unknown"]
    assert sum(decision.placements["known"]) == 8
    crowded = [job("unknown", model=None, max_profiled_replicas=0)] + [
        job(f"k{i}") for i in range(5)
    ]
    decision = GoodputPolicy().decide(crowded, nodes, 0.0, np.random.default_rng(0))
    assert sum(decision.placements["unknown"]) == 2  # fair share 12 / 6
    unprofiled = [job("fresh", max_profiled_replicas=0, model=PowerModel(exponent=1.0))]
    decision = GoodputPolicy().decide(unprofiled, nodes, 0.0, np.random.default_rng(0))
    assert sorted(decision.placements["fresh"]) == [0, 0, 4]


def test_multi_node_job_is_packed_onto_whole_nodes() -> None:
    nodes = cluster(4)
    jobs = [job("big", min_replicas=8, max_replicas=8), job("small", max_replicas=2)]
    decision = GoodputPolicy().decide(jobs, nodes, 0.0, np.random.default_rng(0))
    big = decision.placements["big"]
    assert sorted(big, reverse=True)[:2] == [4, 4] and sum(big) == 8


def test_two_multi_node_jobs_never_share_a_node() -> None:
    nodes = cluster(3)
    jobs = [job("a", min_replicas=6, max_replicas=6), job("b", min_replicas=5, max_replicas=6)]
    decision = GoodputPolicy().decide(jobs, nodes, 0.0, np.random.default_rng(0))
    check_invariants(decision, jobs, nodes)
    # 6 + 5 devices would fit in 12, but only by sharing a node: one of them must wait
    running = [name for name in ("a", "b") if sum(decision.placements[name])]
    assert len(running) == 1


def young_and_old(age_s: float) -> tuple[list[JobView], list[NodeView]]:
    """One job on 2 of 4 devices; a second job just finished, so 4 are free to grow into."""
    nodes = cluster(1)
    model = PowerModel(exponent=0.15)  # 3 devices are only ~6% better than 2
    jobs = [job("j", model=model, age_s=age_s, placement=(2,), max_replicas=3)]
    return jobs, nodes


def test_young_job_is_not_restarted_for_a_small_gain() -> None:
    jobs, nodes = young_and_old(age_s=120.0)
    decision = GoodputPolicy().decide(jobs, nodes, 0.0, np.random.default_rng(0))
    assert decision.placements["j"] == (2,)
    assert "kept" in decision.reasons["j"]


def test_old_job_is_restarted_when_the_gain_pays_back() -> None:
    jobs, nodes = young_and_old(age_s=20000.0)
    decision = GoodputPolicy().decide(jobs, nodes, 0.0, np.random.default_rng(0))
    assert decision.placements["j"] == (3,)
    assert "grown from 2" in decision.reasons["j"]


def test_a_change_must_earn_back_its_restart_cost_with_a_margin() -> None:
    # 3 devices are 6.3% better than 2: with a 30 s restart, the gain pays back once the
    # expected lifetime H exceeds m * 30 s / 0.063, i.e. about 480 s (m = 1) or 1430 s (m = 3)
    jobs, nodes = young_and_old(age_s=1000.0)
    rng = np.random.default_rng(0)
    eager = GoodputPolicy(payback_margin=1.0).decide(jobs, nodes, 0.0, rng)
    careful = GoodputPolicy(payback_margin=3.0).decide(jobs, nodes, 0.0, rng)
    assert eager.placements["j"] == (3,)
    assert careful.placements["j"] == (2,)
    assert "kept" in careful.reasons["j"]


def test_jobs_that_ran_less_get_more_devices() -> None:
    nodes = cluster(1, devices=8)
    model = PowerModel(exponent=0.9, multi_node=1.0)
    jobs = [
        job("fresh", model=model, run_time_s=0.0, age_s=600.0),
        job("long", model=model, run_time_s=20_000.0, age_s=600.0),
    ]
    rng = np.random.default_rng(0)
    favoured = GoodputPolicy().decide(jobs, nodes, 0.0, rng)
    assert sum(favoured.placements["fresh"]) > sum(favoured.placements["long"]) >= 1
    plain = GoodputPolicy(rank_exponent=0.0).decide(jobs, nodes, 0.0, rng)
    assert sum(plain.placements["fresh"]) == sum(plain.placements["long"]) == 4


def test_jobs_expected_to_finish_sooner_get_more_devices() -> None:
    # same run time so far; one has done 90% of its declared length, the other 10%
    nodes = cluster(1, devices=8)
    model = PowerModel(exponent=0.9, multi_node=1.0)
    jobs = [
        job("nearly_done", model=model, run_time_s=3000.0, age_s=600.0, progress_fraction=0.9),
        job("far_off", model=model, run_time_s=3000.0, age_s=600.0, progress_fraction=0.1),
    ]
    rng = np.random.default_rng(0)
    decision = GoodputPolicy().decide(jobs, nodes, 0.0, rng)
    assert sum(decision.placements["nearly_done"]) > sum(decision.placements["far_off"]) >= 1
    # without declared lengths the two are alike and share equally
    alike = [replace(j, progress_fraction=None) for j in jobs]
    plain = GoodputPolicy().decide(alike, nodes, 0.0, rng)
    assert sum(plain.placements["nearly_done"]) == sum(plain.placements["far_off"]) == 4


def test_job_about_to_finish_is_not_restarted_for_a_small_gain() -> None:
    # an old job would grow (see above), but with 1% of its declared length left
    # (about 200 s) the restart cannot pay back before it ends
    jobs, nodes = young_and_old(age_s=20000.0)
    ending = [replace(j, run_time_s=20000.0, progress_fraction=0.99) for j in jobs]
    decision = GoodputPolicy().decide(ending, nodes, 0.0, np.random.default_rng(0))
    assert decision.placements["j"] == (2,)
    assert "kept" in decision.reasons["j"]
    halfway = [replace(j, progress_fraction=0.5) for j in ending]
    decision = GoodputPolicy().decide(halfway, nodes, 0.0, np.random.default_rng(0))
    assert decision.placements["j"] == (3,)


def test_a_job_whose_growth_does_not_fit_stays_where_it_is() -> None:
    # a multi-node job holds half of the big node and all of "b": "local" would like all the
    # free devices but cannot span nodes the multi-node job uses, so it keeps its own node
    # rather than moving to the equally large free space on "big" (a needless restart)
    nodes = [NodeView("big", 8), NodeView("a", 4), NodeView("b", 4)]
    jobs = [
        job(
            "spread",
            min_replicas=8,
            max_replicas=8,
            placement=(4, 0, 4),
            age_s=1e5,
            model=PowerModel(multi_node=1.0),  # nothing to gain from one node
        ),
        job(
            "local",
            placement=(0, 4, 0),
            age_s=1e5,
            model=PowerModel(exponent=1.0, multi_node=1.0),
        ),
    ]
    decision = GoodputPolicy().decide(jobs, nodes, 0.0, np.random.default_rng(0))
    check_invariants(decision, jobs, nodes)
    assert decision.placements["spread"] == (4, 0, 4)
    assert decision.placements["local"] == (0, 4, 0)
    assert "kept" in decision.reasons["local"]


def test_a_resize_in_place_keeps_a_node_the_job_runs_on() -> None:
    # "grow" (it resizes in place) runs on 2 devices of n2 and grows to 4: n0, n1 and n2
    # could each hold 4, and a best fit by index alone would pick n0 (a restart elsewhere);
    # it grows on n2, in place
    nodes = cluster(3)
    grow = job("grow", placement=(0, 0, 2), age_s=1e5, max_replicas=4, warm_resize_cost_s=5.0)
    decision = GoodputPolicy().decide([grow], nodes, 0.0, np.random.default_rng(0))
    assert decision.placements["grow"] == (0, 0, 4)
    # growing onto two nodes keeps the one it runs on (n0 and n1 come first by index)
    wide = job("wide", placement=(0, 0, 4), age_s=1e5, max_replicas=8, warm_resize_cost_s=5.0)
    decision = GoodputPolicy().decide([wide], nodes, 0.0, np.random.default_rng(0))
    check_invariants(decision, [wide], nodes)
    placed = decision.placements["wide"]
    assert sum(placed) == 8 and placed[2] == 4, placed
    # a job that is only ever restarted has nothing to keep: the best fit, as before
    cold = replace(grow, warm_resize_cost_s=None)
    decision = GoodputPolicy().decide([cold], nodes, 0.0, np.random.default_rng(0))
    assert decision.placements["grow"] == (4, 0, 0)


def test_unchanged_jobs_keep_their_devices() -> None:
    nodes = cluster(4)
    jobs = [job(f"j{i}", age_s=5000.0) for i in range(6)]
    policy = GoodputPolicy()
    first = policy.decide(jobs, nodes, 0.0, np.random.default_rng(0))
    jobs = [replace(j, placement=first.placements[j.id]) for j in jobs]
    second = policy.decide(jobs, nodes, 60.0, np.random.default_rng(1))
    assert dict(second.placements) == dict(first.placements)


def test_least_attained_service_runs_first_when_short_of_devices() -> None:
    nodes = cluster(1, devices=2)
    jobs = [
        job("old", attained_gpu_s=10_000.0, max_replicas=1),
        job("new", attained_gpu_s=0.0, max_replicas=1),
        job("mid", attained_gpu_s=500.0, max_replicas=1),
    ]
    decision = GoodputPolicy().decide(jobs, nodes, 0.0, np.random.default_rng(0))
    assert sum(decision.placements["new"]) == 1
    assert sum(decision.placements["mid"]) == 1
    assert sum(decision.placements["old"]) == 0
    assert "waiting" in decision.reasons["old"]


def test_running_job_is_not_preempted_by_a_slightly_less_served_one() -> None:
    nodes = cluster(1, devices=1)
    jobs = [
        job("running", attained_gpu_s=1000.0, placement=(1,), max_replicas=1),
        job("waiting", attained_gpu_s=700.0, max_replicas=1),
    ]
    decision = GoodputPolicy().decide(jobs, nodes, 0.0, np.random.default_rng(0))
    assert decision.placements["running"] == (1,)
    jobs[1] = replace(jobs[1], attained_gpu_s=300.0)
    decision = GoodputPolicy().decide(jobs, nodes, 0.0, np.random.default_rng(0))
    assert decision.placements["waiting"] == (1,)


def test_priority_comes_before_attained_service() -> None:
    nodes = cluster(1, devices=1)
    jobs = [
        job("urgent", attained_gpu_s=1e6, priority=1, max_replicas=1),
        job("fresh", attained_gpu_s=0.0, max_replicas=1),
    ]
    decision = GoodputPolicy().decide(jobs, nodes, 0.0, np.random.default_rng(0))
    assert decision.placements["urgent"] == (1,)


def test_down_nodes_and_empty_inputs() -> None:
    rng = np.random.default_rng(0)
    assert GoodputPolicy().decide([], cluster(2), 0.0, rng).placements == {}
    nodes = [NodeView("a", 4, up=False), NodeView("b", 2)]
    jobs = [job("x", placement=(4, 0))]
    decision = GoodputPolicy().decide(jobs, nodes, 0.0, rng)
    assert decision.placements["x"] == (0, 2)
    nothing = GoodputPolicy().decide(jobs, [NodeView("a", 4, up=False)], 0.0, rng)
    assert nothing.placements["x"] == (0,)
    assert "no devices" in nothing.reasons["x"]


def test_job_too_big_for_the_cluster_says_so() -> None:
    decision = GoodputPolicy().decide(
        [job("huge", min_replicas=9)], cluster(2), 0.0, np.random.default_rng(0)
    )
    assert decision.placements["huge"] == (0, 0)
    assert "needs 9 devices" in decision.reasons["huge"]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"p": float("nan")},
        {"restart_cost_s": -1.0},
        {"interval_s": 0.0},
        {"preempt_ratio": 0.5},
        {"rank_exponent": -0.5},
        {"payback_margin": 0.5},
    ],
)
def test_bad_settings_are_rejected(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        GoodputPolicy(**kwargs)


def test_drives_the_simulator_on_a_small_trace(artifact_dir: Path) -> None:
    from pollux_local.sim.engine import SimConfig, Simulator
    from pollux_local.sim.profiles import load_profiles
    from pollux_local.sim.workload import read_workload

    workload = [
        j
        for j in read_workload(artifact_dir / "workloads" / "workload-1.csv")
        if j.application in {"cifar10", "ncf"}
    ][:12]
    profiles = load_profiles(artifact_dir / "models", {j.application for j in workload})
    config = SimConfig(nodes=2, gpus_per_node=4, seed=3)
    result = Simulator(workload, profiles, GoodputPolicy(), config).run()
    summary = result.summary()
    assert summary["completed"] == len(workload)
    assert 0 < float(summary["avg_jct_s"]) < 6 * 3600
    assert float(summary["restarts_per_job"]) <= 6


def test_jobs_arriving_together_do_not_preempt_a_job_in_its_first_round() -> None:
    """A running job that has had less than one round of service keeps its device against a
    newcomer with none; after more than twice the newcomer's service it yields."""
    policy = GoodputPolicy(interval_s=60.0)
    nodes = [NodeView("n", 1)]
    rng = np.random.default_rng(0)
    fresh = JobView(id="a", placement=(1,), attained_gpu_s=2.0, age_s=2.0, restarts=0)
    newcomer = JobView(id="b", placement=(0,), age_s=1.0)
    kept = policy.decide([fresh, newcomer], nodes, 0.0, rng).placements
    assert kept["a"] == (1,) and sum(kept["b"]) == 0
    old = JobView(id="a", placement=(1,), attained_gpu_s=600.0, age_s=600.0, restarts=0)
    moved = policy.decide([old, newcomer], nodes, 0.0, rng).placements
    assert moved["b"] == (1,) and sum(moved["a"]) == 0


def test_rank_weights_order_jobs_by_expected_remaining_time() -> None:
    from pollux_local.core.policy import rank_weights

    weights = rank_weights(np.array([100.0, 5_000.0, 100.0, 10.0]), 2.0)
    # ranks from the longest: 5000 -> 1, the two 100s share (2 + 3) / 2, 10 -> 4
    assert np.allclose(weights, [(2.5 / 4) ** 2, (1 / 4) ** 2, (2.5 / 4) ** 2, 1.0])
    assert np.allclose(rank_weights(np.array([7.0, 7.0]), 2.0), [0.75**2, 0.75**2])
    assert np.allclose(rank_weights(np.array([1.0, 9.0]), 0.0), [1.0, 1.0])
    assert rank_weights(np.array([]), 2.0).size == 0


def test_a_small_job_does_not_span_nodes_when_one_node_holds_fewer_devices() -> None:
    # two nodes with 2 free devices each: 3 devices would span both (slow inter-node sync),
    # 2 devices fit on one node and, for this model, are worth more
    nodes = cluster(2)
    blockers = [
        job("b0", placement=(2, 0), max_replicas=2, age_s=1e5),
        job("b1", placement=(0, 2), max_replicas=2, age_s=1e5),
    ]
    newcomer = job("n", max_replicas=3, model=PowerModel(exponent=0.9, multi_node=0.3))
    decision = GoodputPolicy().decide([*blockers, newcomer], nodes, 0.0, np.random.default_rng(0))
    check_invariants(decision, [*blockers, newcomer], nodes)
    placed = decision.placements["n"]
    assert sum(1 for c in placed if c > 0) == 1 and sum(placed) == 2


def test_a_spread_out_job_moves_onto_one_node_when_that_pays() -> None:
    # "s" runs 4 devices over two nodes (it was placed while the cluster was fragmented); its
    # model says spanning nodes halves its goodput.  A whole node is free now: the tables would
    # value its 4 devices as if on one node, so only its real (spread) goodput shows the gain.
    nodes = cluster(3)
    model = PowerModel(exponent=1.0, multi_node=0.5)
    jobs = [
        job("s", placement=(2, 2, 0), max_replicas=4, age_s=1e5, model=model),
        job("a", placement=(2, 0, 0), max_replicas=2, age_s=1e5),
        job("b", placement=(0, 2, 0), max_replicas=2, age_s=1e5),
    ]
    decision = GoodputPolicy().decide(jobs, nodes, 0.0, np.random.default_rng(0))
    check_invariants(decision, jobs, nodes)
    assert decision.placements["s"] == (0, 0, 4)
    assert "moved from 4 (own goodput +100%)" in decision.reasons["s"]
    assert decision.placements["a"] == (2, 0, 0) and decision.placements["b"] == (0, 2, 0)


def test_a_spread_out_job_stays_when_no_tighter_room_or_no_payback() -> None:
    nodes = cluster(2)
    model = PowerModel(exponent=1.0, multi_node=0.5)
    blockers = [
        job("a", placement=(2, 0), max_replicas=2, age_s=1e5),
        job("b", placement=(0, 2), max_replicas=2, age_s=1e5),
    ]
    # no node has 4 free devices: moving elsewhere would spread it just the same
    spread = job("s", placement=(2, 2), max_replicas=4, age_s=1e5, model=model)
    decision = GoodputPolicy().decide([spread, *blockers], nodes, 0.0, np.random.default_rng(0))
    check_invariants(decision, [spread, *blockers], nodes)
    assert decision.placements["s"] == (2, 2)
    # its reason line shows the goodput where it really runs: 4 * 0.5 over one device's and
    # over the fair share's 8 / 3 devices, not 4 / (8 / 3) as if on one node
    reason = decision.reasons["s"]
    assert "speed-up 2.00x over 1 device" in reason and "0.75x its fair share" in reason
    assert "kept" in reason
    # a young job: a restart does not pay back the gain of a tighter placement
    nodes = cluster(3)
    young = job("s", placement=(2, 2, 0), max_replicas=4, age_s=60.0, model=model)
    jobs = [young, *(replace(b, placement=(*b.placement, 0)) for b in blockers)]
    decision = GoodputPolicy().decide(jobs, nodes, 0.0, np.random.default_rng(0))
    check_invariants(decision, jobs, nodes)
    assert decision.placements["s"] == (2, 2, 0)


def test_a_job_that_may_use_one_node_gets_it_before_a_job_free_to_go_anywhere() -> None:
    """Two nodes of one device: a job running on both, resizing in place, and a newcomer that
    may only use the first.  Both get one device, and the newcomer's is the first node's."""
    nodes = cluster(2, devices=1)
    spread = job("spread", placement=(1, 1), warm_resize_cost_s=5.0)
    pinned = job("pinned", allowed_nodes=frozenset({0}), max_replicas=1)
    decision = GoodputPolicy().decide([spread, pinned], nodes, 0.0, np.random.default_rng(0))
    assert decision.placements["pinned"] == (1, 0)
    assert decision.placements["spread"] == (0, 1)
