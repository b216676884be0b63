"""Property and accuracy tests of the throughput, efficiency and goodput models."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pollux_local.core import (
    BatchBounds,
    GoodputModel,
    GradStats,
    ThroughputParams,
    efficiency,
    estimate_grad_stats,
    fit_throughput,
    lr_scale,
    noise_scale,
    predict_step_time,
    predict_throughput,
    progress_gain,
)
from pollux_local.core.throughput import MULTI_NODE_PRIOR_FACTOR
from pollux_local.sim.profiles import placement_rows

TRUE = ThroughputParams(
    alpha_c=0.02, beta_c=0.0007, alpha_r=0.08, beta_r=0.01, alpha_n=0.15, beta_n=0.02, gamma=2.0
)

positive = st.floats(min_value=1e-6, max_value=1e6, allow_nan=False)


@given(
    sqr=positive,
    var=positive,
    m0=st.integers(1, 4096),
    batches=st.lists(st.integers(1, 1 << 20), min_size=2, max_size=20),
)
def test_efficiency_in_unit_interval_and_non_increasing(sqr, var, m0, batches):
    stats = GradStats(sqr=sqr, var=var)
    ms = np.sort(np.asarray(batches, dtype=float))
    eff = efficiency(stats, m0, ms)
    assert np.all(eff > 0) and np.all(eff <= 1.0)
    assert np.all(np.diff(eff) <= 1e-12)
    assert efficiency(stats, m0, [m0])[0] == pytest.approx(1.0)


@given(sqr=positive, var=positive, m0=st.integers(1, 1024), scale=st.floats(1.0, 64.0))
def test_adascale_gain_equals_progress_gain_and_is_bounded(sqr, var, m0, scale):
    stats = GradStats(sqr=sqr, var=var)
    total = m0 * scale
    r = lr_scale(stats, m0, total, "adascale")
    assert 1.0 - 1e-9 <= r <= scale + 1e-9
    assert r == pytest.approx(float(progress_gain(stats, m0, total)), rel=1e-9)
    expected = (var + sqr) / (var / scale + sqr)
    assert r == pytest.approx(expected, rel=1e-6)


def test_lr_rules():
    stats = GradStats(1.0, 1.0)
    assert lr_scale(stats, 10, 40, "linear") == 4.0
    assert lr_scale(stats, 10, 40, "sqrt") == 2.0
    assert lr_scale(stats, 10, 40, "legw") == 2.0
    with pytest.raises(ValueError, match="unknown learning-rate rule"):
        lr_scale(stats, 10, 40, "bogus")  # type: ignore[arg-type]


def test_noise_scale_definition():
    assert noise_scale(GradStats(sqr=2.0, var=3.0), 128) == pytest.approx(128 * 3.0 / 2.0)


@settings(max_examples=30, deadline=None)
@given(
    sqr=st.floats(0.01, 100),
    var=st.floats(0.01, 100),
    k=st.integers(1, 16),
    m=st.integers(1, 512),
    s=st.integers(1, 8),
    n=st.integers(1, 4),
)
def test_goodput_is_throughput_times_efficiency(sqr, var, k, m, s, n):
    model = GoodputModel(TRUE, GradStats(sqr, var), BatchBounds(64, 8192, 1, 1024))
    n = min(n, k)
    tp = model.throughput(n, k, m, s)
    eff = model.efficiency(k * m * s)
    assert model.goodput(n, k, m, s) == pytest.approx(float(tp * eff), rel=1e-12)


def test_best_goodput_respects_bounds_and_beats_base_batch():
    bounds = BatchBounds(base_batch=128, max_batch=4096, min_local=32, max_local=256)
    model = GoodputModel(TRUE, GradStats(sqr=0.5, var=2.0), bounds)
    k = np.arange(1, 33)
    n = np.where(k > 4, (k + 3) // 4, 1)
    good, m, s = model.best_goodput(n, k)
    total = k * m * s
    assert np.all(m >= 32) and np.all(m <= 256) and np.all(s >= 1)
    assert np.all(total <= 4096) and np.all(total >= 128)
    base_m = np.maximum(np.ceil(128 / k), 32)
    base_s = np.ceil(base_m / 256)
    assert np.all(good >= model.goodput(n, k, np.minimum(base_m, 256), base_s) * (1 - 1e-9))


def test_best_goodput_without_accumulation_never_accumulates():
    bounds = BatchBounds(
        base_batch=128, max_batch=4096, min_local=8, max_local=64, accumulation=False
    )
    model = GoodputModel(TRUE, GradStats(sqr=0.5, var=2.0), bounds)
    good, m, s = model.best_goodput([1, 1, 1], [1, 2, 4])
    assert np.all(s == 1) and np.all(m <= 64)
    assert np.all(good > 0)


def test_infeasible_allocation_has_zero_goodput():
    bounds = BatchBounds(base_batch=16, max_batch=64, min_local=16, max_local=32)
    model = GoodputModel(TRUE, GradStats(1.0, 1.0), bounds)
    good, _, _ = model.best_goodput([1, 2, 2], [0, 4, 8])
    assert good[0] == 0.0 and good[1] > 0.0 and good[2] == 0.0


def test_batch_bounds_reject_bad_input():
    with pytest.raises(ValueError, match="base batch"):
        BatchBounds(base_batch=0, max_batch=10)
    with pytest.raises(ValueError, match="below the base"):
        BatchBounds(base_batch=32, max_batch=16)
    with pytest.raises(ValueError, match="maximum local"):
        BatchBounds(base_batch=32, max_batch=64, min_local=16, max_local=8)


def _synthetic(params: ThroughputParams, rng: np.random.Generator, noise: float):
    configs = [(1, 1), (1, 2), (1, 4), (2, 8), (4, 16), (2, 4), (1, 3), (3, 12)]
    rows = []
    for n, k in configs:
        for m in (16, 64, 256):
            tc = float(params.alpha_c + params.beta_c * m)
            ts = float(predict_step_time(params, n, k, m))
            rows.append((n, k, m, tc * rng.lognormal(0, noise), ts * rng.lognormal(0, noise)))
    return [np.array(col) for col in zip(*rows, strict=True)]


def test_fit_recovers_known_parameters():
    rng = np.random.default_rng(1)
    n, k, m, tc, ts = _synthetic(TRUE, rng, noise=0.0)
    fit = fit_throughput(n, k, m, tc, ts)
    for name in ("alpha_c", "beta_c", "alpha_r", "alpha_n"):
        assert getattr(fit, name) == pytest.approx(getattr(TRUE, name), rel=0.05), name
    grid_k = np.array([1, 2, 4, 8, 16, 32])
    grid_n = np.array([1, 1, 1, 2, 4, 8])
    pred = predict_throughput(fit, grid_n, grid_k, 128)
    true = predict_throughput(TRUE, grid_n, grid_k, 128)
    np.testing.assert_allclose(pred, true, rtol=0.02)


def test_fit_with_noise_stays_close():
    rng = np.random.default_rng(7)
    n, k, m, tc, ts = _synthetic(TRUE, rng, noise=0.05)
    fit = fit_throughput(n, k, m, tc, ts)
    pred = predict_throughput(fit, n, k, m)
    true = predict_throughput(TRUE, n, k, m)
    assert np.median(np.abs(pred / true - 1)) < 0.05


def test_sparse_priors_single_observation():
    fit = fit_throughput([1], [1], [64], [0.1], [0.1])
    # no multi-replica data: the optimistic prior scales linearly
    tp = predict_throughput(fit, [1, 1, 2], [1, 4, 8], 64)
    np.testing.assert_allclose(tp / tp[0], [1, 4, 8], rtol=1e-9)
    assert fit.alpha_c > 0 and fit.beta_c > 0
    assert float(fit.alpha_c + fit.beta_c * 64) == pytest.approx(0.1)


def test_sparse_priors_no_multi_node_data():
    n, k, m, tc, ts = _synthetic(TRUE, np.random.default_rng(0), noise=0.0)
    single = n == 1
    fit = fit_throughput(n[single], k[single], m[single], tc[single], ts[single])
    assert fit.alpha_n == pytest.approx(MULTI_NODE_PRIOR_FACTOR * fit.alpha_r)
    assert fit.beta_n == pytest.approx(MULTI_NODE_PRIOR_FACTOR * fit.beta_r)
    # multi-node is predicted no faster than single-node at the same K
    assert predict_step_time(fit, 2, 4, 64) >= predict_step_time(fit, 1, 4, 64)


def test_fit_rejects_bad_observations():
    with pytest.raises(ValueError, match="without observations"):
        fit_throughput([], [], [], [], [])
    with pytest.raises(ValueError, match="positive"):
        fit_throughput([1], [1], [64], [-0.1], [0.1])


def test_grad_stats_estimator_is_unbiased_on_gaussian_gradients():
    rng = np.random.default_rng(3)
    dim, b, c, m0 = 200, 16, 4, 32
    true_grad = rng.normal(size=dim) * 0.1
    per_example_sd = 0.5
    sqr_true = float(true_grad @ true_grad)
    var_true = dim * per_example_sd**2 / m0
    sqrs, vars_ = [], []
    for _ in range(400):
        g = true_grad + rng.normal(scale=per_example_sd / np.sqrt(b), size=(c, dim))
        gbar = g.mean(axis=0)
        stats = estimate_grad_stats(float((g * g).sum(axis=1).mean()), float(gbar @ gbar), c, b, m0)
        sqrs.append(stats.sqr)
        vars_.append(stats.var)
    assert np.mean(sqrs) == pytest.approx(sqr_true, rel=0.1)
    assert np.mean(vars_) == pytest.approx(var_true, rel=0.1)


def test_cifar10_fit_on_15_configurations_predicts_all_placements(artifact_dir):
    """Fitted on 15 measured configurations, the median throughput error over every
    placement row of cifar10 stays within 10%."""
    nodes, reps, local, compute, step = placement_rows(artifact_dir / "models" / "cifar10")
    rng = np.random.default_rng(0)
    medians = []
    for _ in range(5):
        idx = rng.choice(len(nodes), 15, replace=False)
        fit = fit_throughput(nodes[idx], reps[idx], local[idx], compute[idx], step[idx])
        pred = predict_throughput(fit, nodes, reps, local)
        true = reps * local / step
        medians.append(float(np.median(np.abs(pred / true - 1))))
    assert np.median(medians) <= 0.10, medians


def test_candidates_reach_the_largest_micro_batch_and_never_exceed_max_batch():
    """With a per-example cost that favours full micro-batches, the best choice uses m = m_max."""
    params = ThroughputParams(0.3, 0.001, 0.5, 0.0, 0.9, 0.0, 1.0)
    bounds = BatchBounds(base_batch=8, max_batch=512, min_local=4, max_local=8)
    model = GoodputModel(params, GradStats(sqr=0.01, var=10.0), bounds)
    k = np.array([1, 4, 8, 16])
    local, steps, _ = model.candidates(k)
    assert np.all(k[:, None] * local * steps <= 512)
    assert np.all((local == 8).any(axis=1))
    _, m, _ = model.best_goodput(np.array([1, 1, 2, 4]), k)
    assert np.all(m == 8)


def test_profile_pool_own_points_win_and_start_stats_come_first() -> None:
    from pollux_local.core.pool import ProfilePool

    pool = ProfilePool()
    pool.add("k", {(1, 1, 32): (0.05, 0.05), (1, 2, 32): (0.05, 0.08)})
    pool.add("k", {}, GradStats(sqr=1.0, var=2.0), first_epoch=False)  # not a first epoch
    assert pool.start_stats("k") is None
    pool.add("k", {}, GradStats(sqr=1.0, var=4.0), first_epoch=True)
    pool.add("k", {}, GradStats(sqr=9.0, var=9.0), first_epoch=True)  # the first one stays
    assert pool.start_stats("k") == GradStats(sqr=1.0, var=4.0)
    merged = pool.points_for("k", {(1, 2, 32): (0.05, 0.20), (1, 4, 32): (0.05, 0.3)})
    assert merged == {
        (1, 1, 32): (0.05, 0.05),
        (1, 2, 32): (0.05, 0.20),
        (1, 4, 32): (0.05, 0.3),
    }
    assert pool.points_for("other", {}) == {} and pool.start_stats("other") is None
    assert pool.kinds() == ["k"]
