"""What the policy and the models remember between passes changes no decision: the remembered
answers are those computed afresh, and a policy that forgets everything before every decision
decides the same, round after round (a typed and an untyped cluster)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import pytest
import scipy.optimize

from pollux_local.core import goodput as goodput_module
from pollux_local.core import throughput
from pollux_local.core.fitting import fit_points
from pollux_local.core.goodput import GoodputModel
from pollux_local.core.policy import GoodputPolicy, objective
from pollux_local.core.pool import Point, Times
from pollux_local.core.types import BatchBounds, GradStats, JobView, NodeView


def forget_everything() -> None:
    goodput_module._best_goodput.cache_clear()
    goodput_module._throughput_grid.cache_clear()
    goodput_module._goodput_at.cache_clear()
    goodput_module._throughput_at.cache_clear()
    goodput_module._batch_candidates.cache_clear()
    objective._remembered_table.cache_clear()


def measured(rng: np.random.Generator, per_node: int, largest: int) -> dict[Point, Times]:
    """Step times of a made-up job on up to ``largest`` replicas, with measurement noise."""
    alpha, beta = rng.uniform(0.01, 0.05), rng.uniform(1e-4, 1e-3)
    net_intra, net_inter = rng.uniform(0.005, 0.02), rng.uniform(0.02, 0.08)
    points: dict[Point, Times] = {}
    k = 1
    while k <= largest:
        nodes = -(-k // per_node)
        for m in (16, 32, 64):
            compute = (alpha + beta * m) * rng.lognormal(0.0, 0.03)
            net = 0.0 if k == 1 else (net_inter if nodes > 1 else net_intra) * (1 + 0.05 * k)
            points[(nodes, k, m)] = (compute, (compute**2 + net**2) ** 0.5)
        k *= 2
    return points


def model_of(rng: np.random.Generator, per_node: int) -> GoodputModel:
    fitted = fit_points(measured(rng, per_node, int(rng.choice([1, 2, 4, 8, 16]))))
    bounds = BatchBounds(base_batch=64, max_batch=4096, min_local=8, max_local=256)
    stats = GradStats(sqr=float(rng.uniform(0.5, 2.0)), var=float(rng.uniform(1.0, 50.0)))
    return GoodputModel(fitted.params, stats, bounds, fitted.correction)


def brute_force(model: GoodputModel, nodes: np.ndarray, replicas: np.ndarray) -> np.ndarray:
    """The best goodput over the batch candidates, computed directly (no grid remembered)."""
    k = replicas.astype(float)
    local, steps, feasible = model.candidates(k)
    values = model.goodput(nodes.astype(float)[:, None], np.maximum(k, 1.0)[:, None], local, steps)
    best = values[np.arange(k.size), np.argmax(values, axis=1)]
    return np.asarray(np.where(feasible & (k > 0), best, 0.0), dtype=np.float64)


def test_best_goodput_remembered_is_computed_afresh() -> None:
    rng = np.random.default_rng(5)
    replicas = np.arange(0, 40)
    nodes = np.maximum(1, -(-replicas // 4))
    for _ in range(6):
        model = model_of(rng, 4)
        first = model.best_goodput(nodes, replicas)[0]
        again = model.best_goodput(nodes, replicas)[0]
        assert np.array_equal(first, brute_force(model, nodes, replicas))
        assert np.array_equal(again, first)
        # other gradient statistics: the grid is shared, the answer is not
        other = replace(model, stats=GradStats(sqr=model.stats.sqr, var=model.stats.var * 3))
        assert np.array_equal(
            other.best_goodput(nodes, replicas)[0], brute_force(other, nodes, replicas)
        )
        assert not first.flags.writeable  # a caller cannot spoil what others are given


def test_fit_points_remembered_for_the_same_points_in_the_same_order() -> None:
    points = measured(np.random.default_rng(1), 4, 8)
    assert fit_points(dict(points)) is fit_points(dict(points))
    reordered = dict(reversed(list(points.items())))
    assert fit_points(reordered) is not fit_points(points)


def test_analytic_jacobian_fits_as_finite_differences_do(monkeypatch: pytest.MonkeyPatch) -> None:
    """The default fit (the projected Levenberg-Marquardt with the analytic Jacobian) predicts
    as scipy's trust-region solver does with finite differences and no help from it."""
    rng = np.random.default_rng(2)
    real = scipy.optimize.least_squares
    quick = throughput.solve_bounded
    fallbacks = []

    def without_jacobian(*args: Any, jac: Any = None, **kwargs: Any) -> Any:
        fallbacks.append(1)
        return real(*args, **kwargs)

    def never_trusted(*args: Any, **kwargs: Any) -> Any:
        return replace(quick(*args, **kwargs), trusted=False)

    for per_node, largest in ((4, 1), (4, 4), (4, 16), (8, 8)):
        rows = np.array([(*p, *t) for p, t in measured(rng, per_node, largest).items()])
        columns = [rows[:, i] for i in range(5)]
        analytic = throughput.fit_throughput(*columns)
        with monkeypatch.context() as patch:
            patch.setattr(scipy.optimize, "least_squares", without_jacobian)
            patch.setattr(throughput, "solve_bounded", never_trusted)
            numeric = throughput.fit_throughput(*columns)
        n, k, m = columns[:3]
        ratio = throughput.predict_throughput(analytic, n, k, m) / throughput.predict_throughput(
            numeric, n, k, m
        )
        assert np.max(np.abs(ratio - 1.0)) < 1e-3
    assert len(fallbacks) == 4  # each comparison went through the trust-region solver


def rounds(jobs: list[JobView], nodes: list[NodeView], count: int, forget: bool) -> list[Any]:
    """Placements and reasons of ``count`` consecutive decisions, each from the last."""
    policy = GoodputPolicy()
    rng = np.random.default_rng(0)
    seen: list[Any] = []
    for r in range(count):
        if forget:
            forget_everything()
        decision = policy.decide(jobs, nodes, now=60.0 * r, rng=rng)
        seen.append((decision.placements, decision.reasons))
        jobs = [
            replace(
                j,
                placement=decision.placements[j.id],
                age_s=j.age_s + 60.0,
                attained_gpu_s=j.attained_gpu_s + 60.0 * sum(decision.placements[j.id]),
                restarts=j.restarts
                + int(j.replicas > 0 and decision.placements[j.id] != j.placement),
            )
            for j in jobs
        ]
    return seen


@pytest.mark.parametrize("typed", [False, True])
def test_decisions_with_and_without_what_was_remembered_are_the_same(typed: bool) -> None:
    rng = np.random.default_rng(11 if typed else 12)
    if typed:
        nodes = [NodeView(f"a{i}", 4, device_type="a") for i in range(4)] + [
            NodeView(f"b{i}", 8, device_type="b") for i in range(2)
        ]
    else:
        nodes = [NodeView(f"n{i}", 4) for i in range(8)]
    jobs = []
    for i in range(14):
        common = {
            "id": f"j{i}",
            "owner": f"u{i % 4}",
            "age_s": float(rng.uniform(60, 5000)),
            "attained_gpu_s": float(rng.uniform(0, 20000)),
            "max_profiled_replicas": int(rng.choice([1, 2, 4, 8])),
            "progress_fraction": float(rng.uniform(0.05, 0.9)),
            "run_time_s": float(rng.uniform(60, 4000)),
        }
        if typed:
            by_type = {"a": model_of(rng, 4)}
            if rng.random() < 0.5:
                by_type["b"] = model_of(rng, 8)
            jobs.append(
                JobView(**common, models_by_type=by_type, type_rates={"a": 1.0, "b": 1.7})  # type: ignore[arg-type]
            )
        else:
            jobs.append(JobView(**common, model=model_of(rng, 4)))  # type: ignore[arg-type]
    remembered = rounds(jobs, nodes, 8, forget=False)
    forgotten = rounds(jobs, nodes, 8, forget=True)
    assert remembered == forgotten
    assert any(any(sum(p) for p in placements.values()) for placements, _ in remembered)
