"""Generate a held-out trace for the heterogeneous benchmark, the way Sia's were derived.

Jobs and submission times as ``make_trace.py`` draws them (a random 8-hour window of the
Philly trace, applications by GPU-time bands); then, as Sia's workloads were made from
Pollux's, every ncf job becomes a cifar10 job, and every job's static configuration
(``num_replicas``, ``batch_size``: the batch Sia's estimates are capped at) is drawn from the
rows of the same application in Sia's published philly workloads.  Seeds used for tuning must
differ from nothing in particular: the published workloads are not generated from a seed.

    python benchmarks/make_hetero_trace.py OUT.csv [--jobs 160] [--seed 101]
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from make_trace import DEFAULT_DATA, make_trace  # noqa: E402

DEFAULT_SIA = Path(__file__).resolve().parents[2] / "shared/data/sia-artifact/workloads/philly"


def make_hetero_trace(
    pollux_data: Path, sia_workloads: Path, jobs: int, seed: int
) -> list[tuple[str, int, str, int, int]]:
    """Rows (name, time, application, num_replicas, batch_size), sorted by time."""
    rows = make_trace(pollux_data, jobs, seed)
    published: dict[str, list[tuple[int, int]]] = {}
    for path in sorted(sia_workloads.glob("workload-*.csv")):
        with path.open(newline="") as handle:
            for r in csv.DictReader(handle):
                published.setdefault(r["application"], []).append(
                    (int(r["num_replicas"]), int(r["batch_size"]))
                )
    if not published:
        raise SystemExit(f"no published workloads under {sia_workloads}")
    rng = np.random.default_rng(seed + 7919)
    out = []
    for i, (_, time, app, _, _) in enumerate(rows):
        app = "cifar10" if app == "ncf" else app
        replicas, batch = published[app][int(rng.integers(len(published[app])))]
        out.append((f"{app}-{i}", time, app, replicas, batch))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--jobs", type=int, default=160)
    parser.add_argument("--seed", type=int, default=101)
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--sia-workloads", type=Path, default=DEFAULT_SIA)
    args = parser.parse_args(argv)
    rows = make_hetero_trace(args.data, args.sia_workloads, args.jobs, args.seed)
    with args.out.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["name", "time", "application", "num_replicas", "batch_size"])
        writer.writerows(rows)
    apps: dict[str, int] = {}
    for r in rows:
        apps[r[2]] = apps.get(r[2], 0) + 1
    print(f"wrote {len(rows)} jobs to {args.out}: {apps}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
