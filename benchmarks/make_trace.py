"""Generate a held-out workload trace the way the published ones were drawn.

Submission times: a random 8-hour window of the Philly trace (``philly.csv``), jobs drawn from
it uniformly without replacement (160 per 8 h at 1x load, 320 at 2x), times relative to the
window's start.  Applications: each drawn job's GPU time ranks it; ranks are cut into bands whose
sizes follow the application mix of the published workloads, cheapest applications for the
smallest jobs (ncf, cifar10, bert, deepspeech2, yolov3, imagenet).  The static configuration
(``num_replicas``, ``batch_size``) given to the baselines is drawn from the published rows of
the same application.

    python benchmarks/make_trace.py OUT.csv [--jobs 160] [--seed 7] [--data DIR]
"""

from __future__ import annotations

import argparse
import csv
import sys
from datetime import datetime
from pathlib import Path

import numpy as np

DEFAULT_DATA = Path(__file__).resolve().parents[2] / "shared/data/pollux-artifact"
#: Applications from the cheapest to the most expensive to train.
COST_ORDER = ("ncf", "cifar10", "bert", "deepspeech2", "yolov3", "imagenet")
WINDOW_S = 8 * 3600.0


def published_rows(data: Path) -> list[dict[str, str]]:
    rows: list[dict[str, str]] = []
    for path in sorted((data / "workloads").glob("workload-*.csv")):
        with path.open(newline="") as handle:
            rows.extend(csv.DictReader(handle))
    if not rows:
        raise SystemExit(f"no published workloads under {data / 'workloads'}")
    return rows


def philly_jobs(data: Path) -> tuple[np.ndarray, np.ndarray]:
    """Submission times (s since the first job) and GPU times (GPU-s) of the Philly trace."""
    times: list[float] = []
    gpu_time: list[float] = []
    with (data / "philly.csv").open(newline="") as handle:
        for row in csv.DictReader(handle):
            try:
                stamp = datetime.strptime(row["timestamp"], "%Y-%m-%d %H:%M:%S").timestamp()
                cost = float(row["gpu_time"])
            except (KeyError, ValueError):
                continue
            if cost > 0:
                times.append(stamp)
                gpu_time.append(cost)
    t = np.asarray(times)
    return t - t.min(), np.asarray(gpu_time)


def make_trace(data: Path, jobs: int, seed: int) -> list[tuple[str, int, str, int, int]]:
    """Rows (name, time, application, num_replicas, batch_size), sorted by time."""
    rng = np.random.default_rng(seed)
    rows = published_rows(data)
    mix = {app: sum(1 for r in rows if r["application"] == app) for app in COST_ORDER}
    times, gpu_time = philly_jobs(data)
    for _ in range(1000):
        start = float(rng.uniform(0.0, times.max() - WINDOW_S))
        inside = np.flatnonzero((times >= start) & (times < start + WINDOW_S))
        if inside.size >= jobs:
            break
    else:
        raise SystemExit(f"no 8-hour window of the Philly trace holds {jobs} jobs")
    chosen = rng.choice(inside, size=jobs, replace=False)
    chosen = chosen[np.argsort(times[chosen], kind="stable")]
    submit = np.round(times[chosen] - start).astype(int)
    rank = np.argsort(np.argsort(gpu_time[chosen], kind="stable"), kind="stable")
    bands = np.cumsum([mix[app] for app in COST_ORDER]) / sum(mix.values()) * jobs
    by_app: dict[str, list[dict[str, str]]] = {app: [] for app in COST_ORDER}
    for r in rows:
        by_app[r["application"]].append(r)
    out = []
    for i, (t, r) in enumerate(zip(submit, rank, strict=True)):
        app = COST_ORDER[int(np.searchsorted(bands, r, side="right"))]
        static = by_app[app][int(rng.integers(len(by_app[app])))]
        out.append(
            (f"{app}-{i}", int(t), app, int(static["num_replicas"]), int(static["batch_size"]))
        )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--jobs", type=int, default=160)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA)
    args = parser.parse_args(argv)
    rows = make_trace(args.data, args.jobs, args.seed)
    with args.out.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["name", "time", "application", "num_replicas", "batch_size"])
        writer.writerows(rows)
    apps = {app: sum(1 for r in rows if r[2] == app) for app in COST_ORDER}
    print(f"wrote {len(rows)} jobs to {args.out}: {apps}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
