"""The projected Levenberg-Marquardt solver (core/lsq.py) against known answers and scipy."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np
import pytest
import scipy.optimize

from pollux_local.core import lsq, throughput
from pollux_local.core.lsq import solve_bounded

INF = np.inf
Function = Callable[[np.ndarray], np.ndarray]


def linear(a: np.ndarray, b: np.ndarray) -> tuple[Function, Function]:
    """r(x) = A x - b and its Jacobian A."""
    return (lambda x: a @ x - b), (lambda x: a)


def test_unbounded_linear_problem_is_solved_exactly() -> None:
    rng = np.random.default_rng(0)
    a, b = rng.normal(size=(20, 5)), rng.normal(size=20)
    fun, jac = linear(a, b)
    result = solve_bounded(fun, jac, np.zeros(5), np.full(5, -INF), np.full(5, INF))
    expected = np.linalg.lstsq(a, b, rcond=None)[0]
    assert result.trusted
    assert np.allclose(result.x, expected, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("seed", range(5))
def test_bounded_linear_problem_matches_scipy(seed: int) -> None:
    rng = np.random.default_rng(seed)
    a, b = rng.normal(size=(30, 6)), rng.normal(size=30)
    lower, upper = np.zeros(6), np.full(6, 0.3)
    fun, jac = linear(a, b)
    result = solve_bounded(fun, jac, np.full(6, 0.1), lower, upper)
    expected = scipy.optimize.lsq_linear(a, b, bounds=(lower, upper), tol=1e-12)
    assert result.trusted
    assert result.cost <= expected.cost * (1 + 1e-8) + 1e-12
    assert np.allclose(result.x, expected.x, atol=1e-6)
    assert ((result.x == lower) | (result.x == upper)).any()  # some bound is active


def test_rosenbrock_in_a_box_reaches_the_constrained_minimum() -> None:
    """r = (10 (y - x^2), 1 - x) with x <= 0.5: the minimum sits on the bound x = 0.5."""

    def fun(v: np.ndarray) -> np.ndarray:
        return np.array([10.0 * (v[1] - v[0] ** 2), 1.0 - v[0]])

    def jac(v: np.ndarray) -> np.ndarray:
        return np.array([[-20.0 * v[0], 10.0], [-1.0, 0.0]])

    result = solve_bounded(
        fun, jac, np.array([-1.2, 1.0]), np.array([-2.0, -2.0]), np.array([0.5, 2.0])
    )
    assert result.trusted
    assert result.x == pytest.approx([0.5, 0.25], abs=1e-8)
    assert result.cost == pytest.approx(0.125, rel=1e-8)


def test_a_variable_on_a_flat_bound_is_not_trusted() -> None:
    """r = (x0 + 3, x0 * x1 - 1), x0 >= 0: the first residual drives x0 onto its bound, where
    the residuals no longer change with x1, so the gradient vanishes along x1 although a
    lower cost lies off the bound (x0 = e, x1 = 1/e gives (3 + e)^2 < 10)."""

    def fun(v: np.ndarray) -> np.ndarray:
        return np.array([v[0] + 3.0, v[0] * v[1] - 1.0])

    def jac(v: np.ndarray) -> np.ndarray:
        return np.array([[1.0, 0.0], [v[1], v[0]]])

    result = solve_bounded(fun, jac, np.array([0.5, 0.0]), np.array([0.0, -INF]), np.full(2, INF))
    assert result.x[0] == 0.0
    assert result.cost == pytest.approx(5.0)
    assert not result.trusted


def test_non_finite_start_is_not_trusted() -> None:
    result = solve_bounded(
        lambda x: np.array([np.inf * x[0]]),
        lambda x: np.array([[1.0]]),
        np.array([1.0]),
        np.array([0.0]),
        np.array([INF]),
    )
    assert not result.trusted


@pytest.mark.parametrize("seed", range(6))
def test_throughput_fit_is_as_good_as_the_trust_region_solver(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On noisy measurements from a known model, the default fit's loss is never above the
    trust-region solver's from the same start (compared through their predictions' log errors
    against the measured times)."""
    rng = np.random.default_rng(seed)
    truth = throughput.ThroughputParams(0.02, 4e-4, 0.03, 2e-3, 0.09, 6e-3, 1.6)
    rows = []
    for _ in range(25):
        k = int(rng.choice([1, 2, 3, 4, 6, 8, 12, 16]))
        n = int(rng.integers(1, 3)) if k > 4 else 1
        m = float(rng.choice([16, 32, 64, 128]))
        tc = float(throughput.predict_compute_time(truth, m)) * rng.lognormal(0, 0.05)
        ts = float(throughput.predict_step_time(truth, n, k, m)) * rng.lognormal(0, 0.05)
        rows.append((n, k, m, tc, max(ts, tc)))
    columns = [np.array(c, dtype=float) for c in zip(*rows, strict=True)]

    def loss(params: throughput.ThroughputParams) -> float:
        tc = throughput.predict_compute_time(params, columns[2])
        ts = throughput.predict_step_time(params, columns[0], columns[1], columns[2])
        return float(np.sum(np.log(tc / columns[3]) ** 2 + np.log(ts / columns[4]) ** 2))

    quick = throughput.fit_throughput(*columns)
    real = lsq.solve_bounded

    def untrusted(*args: Any, **kwargs: Any) -> lsq.LsqResult:
        return replace(real(*args, **kwargs), trusted=False)

    monkeypatch.setattr(throughput, "solve_bounded", untrusted)
    reference = throughput.fit_throughput(*columns)
    assert loss(quick) <= loss(reference) * (1 + 1e-4) + 1e-9


def test_a_variable_the_residuals_ignore_does_not_stop_the_others() -> None:
    """r = (x0 - 1, x1 - 2, x0 x1 - 2) does not depend on x2: x0 and x1 are still solved,
    x2 stays where it started."""

    def fun(v: np.ndarray) -> np.ndarray:
        return np.array([v[0] - 1.0, v[1] - 2.0, v[0] * v[1] - 2.0])

    def jac(v: np.ndarray) -> np.ndarray:
        return np.array([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [v[1], v[0], 0.0]])

    result = solve_bounded(fun, jac, np.array([3.0, 0.5, 7.0]), np.zeros(3), np.full(3, INF))
    assert result.trusted
    assert result.x == pytest.approx([1.0, 2.0, 7.0], abs=1e-7)
    assert result.cost == pytest.approx(0.0, abs=1e-14)
