"""The measured-residual correction on top of the throughput model."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pollux_local.core import BatchBounds, GoodputModel, GradStats, ThroughputParams
from pollux_local.core.correction import PRIOR_WEIGHT, TimeCorrection, fit_corrected
from pollux_local.core.throughput import (
    fit_throughput,
    predict_compute_time,
    predict_step_time,
    predict_throughput,
)
from pollux_local.sim.profiles import placement_rows

PARAMS = ThroughputParams(
    alpha_c=0.02, beta_c=0.0007, alpha_r=0.08, beta_r=0.01, alpha_n=0.15, beta_n=0.02, gamma=2.0
)
BOUNDS = BatchBounds(base_batch=64, max_batch=4096, min_local=8, max_local=256)
STATS = GradStats(sqr=0.5, var=2.0)


def _times(nodes, replicas, local, slow_compute=1.0, slow_step=1.0):
    compute = predict_compute_time(PARAMS, local) * slow_compute
    step = np.maximum(predict_step_time(PARAMS, nodes, replicas, local) * slow_step, compute)
    return compute, step


@settings(max_examples=50, deadline=None)
@given(
    nodes=st.integers(1, 8),
    per_node=st.integers(1, 8),
    local=st.integers(1, 512),
    accum=st.integers(1, 8),
)
def test_exact_model_needs_no_correction(nodes, per_node, local, accum):
    """Measurements the model predicts exactly leave every prediction unchanged."""
    n = np.array([1, 1, 2, 4])
    k = np.array([1, 4, 8, 16])
    m = np.array([32, 64, 32, 128])
    correction = TimeCorrection.from_points(PARAMS, n, k, m, *_times(n, k, m))
    factor_c, factor_s = correction.factors(nodes, nodes * per_node, local)
    assert factor_c == pytest.approx(1.0) and factor_s == pytest.approx(1.0)
    plain = GoodputModel(PARAMS, STATS, BOUNDS)
    corrected = GoodputModel(PARAMS, STATS, BOUNDS, correction)
    args = (nodes, nodes * per_node, local, accum)
    assert float(corrected.throughput(*args)) == pytest.approx(float(plain.throughput(*args)))


def test_measured_point_predicted_as_measured_and_far_points_as_the_model():
    """A point measured 30% slower than the model is predicted (nearly) as measured; a
    configuration far from every measurement keeps the model's prediction."""
    n, k, m = np.array([1]), np.array([4]), np.array([64])
    compute, step = _times(n, k, m, slow_compute=1.3, slow_step=1.3)
    correction = TimeCorrection.from_points(PARAMS, n, k, m, compute, step)
    model = GoodputModel(PARAMS, STATS, BOUNDS, correction)
    measured = float(model.throughput(1, 4, 64, 1))
    expected = 4 * 64 / float(step[0])
    # log c = r / (1 + w0) at the point itself
    shrink = 1.3 ** (1.0 / (1.0 + PRIOR_WEIGHT))
    assert measured == pytest.approx(4 * 64 / (float(step[0]) / 1.3 * shrink), rel=1e-6)
    assert abs(measured / expected - 1) < 0.03
    far = float(model.throughput(8, 64, 8, 1))
    assert far == pytest.approx(float(predict_throughput(PARAMS, 8, 64, 8)), rel=1e-3)
    # half-way in log m the correction is partial, in between the two
    mid = float(model.throughput(1, 4, 90, 1)) / float(predict_throughput(PARAMS, 1, 4, 90))
    assert 1 / 1.3 < mid < 0.999


def test_factors_broadcast_like_their_inputs():
    n, k, m = np.array([1, 2]), np.array([2, 8]), np.array([16, 32])
    correction = TimeCorrection.from_points(PARAMS, n, k, m, *_times(n, k, m, 1.2, 1.1))
    factor_c, factor_s = correction.factors(
        np.array([[1], [2]]), np.array([[2], [8]]), np.array([[16, 24, 32], [16, 24, 32]])
    )
    assert factor_c.shape == factor_s.shape == (2, 3)
    assert factor_c[0, 0] > factor_c[0, 2] > 1.0  # nearest to the (1, 2, 16) point
    scalar_c, _ = correction.factors(2, 8, 24)
    assert float(scalar_c) == pytest.approx(float(factor_c[1, 1]))


def test_fit_corrected_is_the_plain_fit_plus_its_residuals():
    rng = np.random.default_rng(3)
    n = rng.integers(1, 4, 12)
    k = n * rng.integers(1, 5, 12)
    m = rng.integers(8, 256, 12)
    compute, step = _times(n, k, m, rng.uniform(0.8, 1.2, 12), rng.uniform(0.8, 1.2, 12))
    params, correction = fit_corrected(n, k, m, compute, step)
    assert params == fit_throughput(n, k, m, compute, step)
    plain_c = predict_compute_time(params, m)
    assert np.allclose(np.exp(correction.residual_compute) * plain_c, compute)


def test_correction_improves_predictions_of_measured_configurations(artifact_dir):
    """deepspeech2: the model fitted to 15 measured configurations predicts those same
    configurations better, and all rows no worse in median, once corrected."""
    nodes, reps, local, compute, step = placement_rows(artifact_dir / "models" / "deepspeech2")
    rng = np.random.default_rng(0)
    idx = rng.choice(len(nodes), 15, replace=False)
    params, correction = fit_corrected(nodes[idx], reps[idx], local[idx], compute[idx], step[idx])
    plain = GoodputModel(params, STATS, BOUNDS)
    corrected = GoodputModel(params, STATS, BOUNDS, correction)
    true = reps * local / step

    def errors(model: GoodputModel) -> np.ndarray:
        return np.abs(model.throughput(nodes, reps, local, 1) / true - 1)

    plain_err, corrected_err = errors(plain), errors(corrected)
    assert np.median(corrected_err[idx]) < 0.5 * np.median(plain_err[idx])
    assert np.median(corrected_err) <= np.median(plain_err) + 1e-9
