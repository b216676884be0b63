"""Throughput-model accuracy: fit on N measured configurations, predict every placement row.

    python benchmarks/model_accuracy.py [--artifact DIR] [--points 15] [--trials 20] [--json]

For each application of the artifact, repeatedly draws ``--points`` random rows of
placements.csv, fits them as a job's model is fitted (``core.fitting.fit_points``: one point per
(nodes, replicas, micro-batch), a later row for the same configuration winning, so a draw may
give fewer points) and reports the median and mean relative throughput error of the model alone
over all rows, and the fit time (the fit and its correction); then the same model corrected by
its residuals at the fitted points (``core.correction``): its median error over all rows, and
both models' median error over the rows the fit did not see.  ``same-config spread`` is the
median error that even an exact model of (N, K, m) would make: rows measured at the same
(N, K, m) (other placements, other runs) differ from their group's mean, debiased for the group
size, |exp(x - mean) - 1| with x - mean scaled by sqrt(n / (n - 1)).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from pollux_local.core import predict_throughput
from pollux_local.core.correction import corrected_times
from pollux_local.core.fitting import fit_points
from pollux_local.sim.profiles import placement_rows

DEFAULT_ARTIFACT = Path(__file__).resolve().parents[1].parent / "shared/data/pollux-artifact"


def same_config_spread(
    nodes: np.ndarray, replicas: np.ndarray, local: np.ndarray, throughput: np.ndarray
) -> float:
    """Median |T_row / T_group - 1| over rows sharing their (N, K, m) with others, T_group the
    geometric mean of the group's throughputs, the log deviation scaled by sqrt(n / (n - 1))
    (the spread about the true mean, not about a mean that includes the row)."""
    groups: dict[tuple[float, float, float], list[float]] = {}
    for key, value in zip(
        zip(nodes, replicas, local, strict=True), np.log(throughput), strict=True
    ):
        groups.setdefault(key, []).append(float(value))
    deviations = [
        (np.asarray(values) - np.mean(values)) * np.sqrt(len(values) / (len(values) - 1))
        for values in groups.values()
        if len(values) > 1
    ]
    if not deviations:
        return float("nan")
    return float(np.median(np.abs(np.expm1(np.concatenate(deviations)))))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--artifact", type=Path, default=DEFAULT_ARTIFACT)
    parser.add_argument("--points", type=int, default=15)
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rng = np.random.default_rng(args.seed)
    results = {}
    for app_dir in sorted((args.artifact / "models").iterdir()):
        nodes, reps, local, compute, step = placement_rows(app_dir)
        true = reps * local / step
        medians, means, fit_ms = [], [], []
        fitted_points: list[int] = []
        corrected_medians, unseen_plain, unseen_corrected = [], [], []
        for _ in range(args.trials):
            idx = rng.choice(len(nodes), args.points, replace=False)
            points = {
                (int(nodes[i]), int(reps[i]), int(local[i])): (float(compute[i]), float(step[i]))
                for i in idx
            }
            t0 = time.perf_counter()
            fitted = fit_points(points)
            fit_ms.append((time.perf_counter() - t0) * 1e3)
            fitted_points.append(fitted.points)
            err = np.abs(predict_throughput(fitted.params, nodes, reps, local) / true - 1)
            medians.append(float(np.median(err)))
            means.append(float(np.mean(err)))
            _, step_pred = corrected_times(fitted.params, fitted.correction, nodes, reps, local)
            corrected_err = np.abs(reps * local / step_pred / true - 1)
            unseen = np.ones(len(nodes), dtype=bool)
            unseen[idx] = False
            corrected_medians.append(float(np.median(corrected_err)))
            unseen_plain.append(float(np.median(err[unseen])))
            unseen_corrected.append(float(np.median(corrected_err[unseen])))
        results[app_dir.name] = {
            "rows": int(len(nodes)),
            "points_fitted_mean": float(np.mean(fitted_points)),
            "median_error_pct": 100 * float(np.median(medians)),
            "mean_error_pct": 100 * float(np.median(means)),
            "fit_ms_median": float(np.median(fit_ms)),
            "corrected_median_error_pct": 100 * float(np.median(corrected_medians)),
            "unseen_median_error_pct": 100 * float(np.median(unseen_plain)),
            "unseen_corrected_median_error_pct": 100 * float(np.median(unseen_corrected)),
            "same_config_spread_pct": 100 * same_config_spread(nodes, reps, local, true),
        }
    if args.json:
        print(json.dumps(results, indent=2))
        return
    print(f"fit on {args.points} random rows, {args.trials} trials per application")
    print(
        f"{'app':<12} {'rows':>5} {'points':>6} {'median err':>11} {'mean err':>9} {'fit ms':>7}"
        f" {'corrected':>10} {'unseen':>7} {'unseen corr.':>12} {'same-config spread':>18}"
    )
    for app, r in results.items():
        print(
            f"{app:<12} {r['rows']:>5} {r['points_fitted_mean']:>6.1f}"
            f" {r['median_error_pct']:>10.1f}% "
            f"{r['mean_error_pct']:>8.1f}% {r['fit_ms_median']:>7.1f}"
            f" {r['corrected_median_error_pct']:>9.1f}% {r['unseen_median_error_pct']:>6.1f}%"
            f" {r['unseen_corrected_median_error_pct']:>11.1f}%"
            f" {r['same_config_spread_pct']:>17.1f}%"
        )


if __name__ == "__main__":
    main()
