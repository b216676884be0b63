"""The policy's faster paths give, bit for bit, what the plain computations give: the greedy
step read from a list, the utility of all-positive speed-ups without masks, a configuration's
goodput from its remembered throughput, and a batch choice asked with its query's bytes."""

from __future__ import annotations

import numpy as np
import pytest

from pollux_local.core.goodput import GoodputModel
from pollux_local.core.policy.objective import NEG, JobPlan, utility_of
from pollux_local.core.policy.search import Search
from pollux_local.core.throughput import ThroughputParams
from pollux_local.core.types import BatchBounds, GradStats, JobView


def reference_step(utility: np.ndarray, k: int, cap: int, free: int) -> tuple[float, int]:
    """The greedy step as one array operation: max over k' of (U(k') - U(k)) / (k' - k)."""
    top = min(cap, k + free)
    if top <= k:
        return NEG, k
    with np.errstate(invalid="ignore"):
        gains = (utility[k + 1 : top + 1] - utility[k]) / np.arange(1, top - k + 1)
    gains = np.where(np.isnan(gains), NEG, gains)
    best = int(np.argmax(gains))
    return float(gains[best]), k + 1 + best


def plan_with(utility: np.ndarray, k: int) -> JobPlan:
    cap = len(utility) - 1
    return JobPlan(
        index=0,
        job=JobView(id="j", model=None, age_s=1.0),
        cap=cap,
        min_k=1,
        current_k=0,
        goodput=np.zeros(cap + 1),
        fair_share=1.0,
        fair_goodput=1.0,
        weight=1.0,
        discount=1.0,
        utility=utility,
        k=k,
    )


def test_greedy_step_equals_the_array_step() -> None:
    rng = np.random.default_rng(3)
    checked = 0
    for _ in range(3000):
        size = int(rng.integers(2, 200))
        utility = -np.cumsum(rng.exponential(1.0, size)) * rng.choice([1.0, 1e-3])
        utility[rng.random(size) < 0.2] = NEG  # infeasible counts
        if rng.random() < 0.3:
            utility[: int(rng.integers(1, size))] = NEG  # -inf to -inf: NaN gains
        if rng.random() < 0.2:
            utility[int(rng.integers(0, size))] = utility[int(rng.integers(0, size))]  # ties
        k = int(rng.integers(0, size))
        free = int(rng.integers(0, 220))
        plan = plan_with(utility, k)
        expected = reference_step(utility, k, plan.cap, free)
        for values in (None, utility.tolist()):
            gain, target = Search._best_step(plan, free, values)
            assert target == expected[1]
            assert gain == expected[0] or (np.isnan(gain) and np.isnan(expected[0]))
        checked += 1
    assert checked == 3000


@pytest.mark.parametrize("p", [-1.0, -0.5, 0.5, 1.0, 2.0])
def test_utility_without_masks_equals_masked(p: float) -> None:
    rng = np.random.default_rng(5)
    for _ in range(200):
        x = rng.lognormal(0.0, 2.0, size=int(rng.integers(1, 80)))
        masked = np.full_like(x, NEG)
        positive = x > 0
        masked[positive] = np.power(x[positive], p) / p
        assert np.array_equal(utility_of(x, p), masked)
        assert utility_of(x, p).tobytes() == masked.tobytes()
    with_zero = np.array([0.0, 1.5, 2.0])
    expected = np.array([0.0 if p > 0 else NEG, 1.5**p / p, 2.0**p / p])
    assert np.allclose(utility_of(with_zero, p), expected, rtol=1e-15)


def model(rng: np.random.Generator) -> GoodputModel:
    params = ThroughputParams(
        alpha_c=float(rng.uniform(0.01, 0.05)),
        beta_c=float(rng.uniform(1e-4, 1e-3)),
        alpha_r=float(rng.uniform(0.005, 0.02)),
        beta_r=float(rng.uniform(1e-4, 1e-3)),
        alpha_n=float(rng.uniform(0.02, 0.08)),
        beta_n=float(rng.uniform(1e-4, 1e-3)),
        gamma=float(rng.uniform(1.0, 3.0)),
    )
    bounds = BatchBounds(base_batch=64, max_batch=4096, min_local=8, max_local=256)
    stats = GradStats(sqr=float(rng.uniform(0.5, 2.0)), var=float(rng.uniform(1.0, 50.0)))
    return GoodputModel(params, stats, bounds)


def test_goodput_at_equals_goodput() -> None:
    rng = np.random.default_rng(11)
    for _ in range(100):
        m = model(rng)
        n, k = int(rng.integers(1, 4)), int(rng.integers(1, 17))
        local, steps = int(rng.integers(8, 257)), int(rng.integers(1, 4))
        direct = float(np.asarray(m.goodput(n, k, local, steps)).reshape(-1)[0])
        assert m.goodput_at(n, k, local, steps) == direct
        # a model that differs only in its gradient statistics shares the throughput
        other = GoodputModel(m.params, GradStats(sqr=1.0, var=5.0), m.bounds)
        again = float(np.asarray(other.goodput(n, k, local, steps)).reshape(-1)[0])
        assert other.goodput_at(n, k, local, steps) == again


def test_best_choice_equals_best_goodput() -> None:
    rng = np.random.default_rng(13)
    for _ in range(100):
        m = model(rng)
        n, k = int(rng.integers(1, 4)), int(rng.integers(1, 33))
        _, local, steps = m.best_goodput(np.array([n]), np.array([k]))
        choice = m.best_choice(n, k)
        assert (choice.local_batch, choice.accum_steps) == (int(local[0]), int(steps[0]))
