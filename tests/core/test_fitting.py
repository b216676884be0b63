"""The one fitting path: ``core.fitting.fit_points`` and ``points_from_rows``, and the daemon
model cache's reading of a report's profile through it."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pollux_local.core import FittedTimes, fit_points, points_from_rows
from pollux_local.core.correction import fit_corrected
from pollux_local.core.throughput import fit_throughput

POINTS = {
    (1, 1, 32): (0.050, 0.050),
    (1, 1, 64): (0.090, 0.090),
    (1, 2, 32): (0.050, 0.071),
    (2, 4, 32): (0.052, 0.110),
    (1, 4, 128): (0.170, 0.200),
}


def _columns(points):
    keys = np.array(list(points), dtype=float)
    values = np.array(list(points.values()), dtype=float)
    return keys[:, 0], keys[:, 1], keys[:, 2], values[:, 0], values[:, 1]


def test_fit_points_is_the_corrected_fit_of_its_points_in_order() -> None:
    fitted = fit_points(POINTS)
    assert isinstance(fitted, FittedTimes) and fitted.points == len(POINTS)
    params, correction = fit_corrected(*_columns(POINTS))
    assert fitted.params == params
    assert fitted.correction is not None
    np.testing.assert_array_equal(fitted.correction.residual_step, correction.residual_step)
    np.testing.assert_array_equal(fitted.correction.log_batch, correction.log_batch)


def test_fit_points_without_correction_is_the_plain_fit() -> None:
    fitted = fit_points(POINTS, correct=False)
    assert fitted.correction is None
    assert fitted.params == fit_throughput(*_columns(POINTS))


def test_fit_points_rejects_what_cannot_be_fitted() -> None:
    with pytest.raises(ValueError):
        fit_points({})
    with pytest.raises(ValueError):
        fit_points({(1, 1, 32): (-0.1, 0.1)})


def test_points_from_rows_later_row_wins_and_extra_keys_are_ignored() -> None:
    rows = [
        {"nodes": 1, "replicas": 2, "local_batch": 32, "compute_s": 0.1, "step_s": 0.2},
        {"nodes": 1, "replicas": 1, "local_batch": 32, "compute_s": 0.1, "step_s": 0.1},
        {"nodes": 1, "replicas": 2, "local_batch": 32, "compute_s": 0.1, "step_s": 0.3, "count": 5},
    ]
    assert points_from_rows(rows) == {(1, 2, 32): (0.1, 0.3), (1, 1, 32): (0.1, 0.1)}
    assert points_from_rows([]) == {}


GOOD = {"nodes": 1, "replicas": 1, "local_batch": 32, "compute_s": 0.1, "step_s": 0.1}


@pytest.mark.parametrize(
    "rows",
    [
        [{k: v for k, v in GOOD.items() if k != "step_s"}],
        [{**GOOD, "replicas": "two"}],
        [{**GOOD, "replicas": None}],
        [{**GOOD, "local_batch": 0}],
        [{**GOOD, "compute_s": -0.1}],
        [{**GOOD, "step_s": math.nan}],
        [{**GOOD, "step_s": math.inf}],
        [GOOD, "not a row"],
        [GOOD, 5],
        5,
    ],
)
def test_points_from_rows_rejects_malformed_rows(rows) -> None:
    with pytest.raises(ValueError):
        points_from_rows(rows)
