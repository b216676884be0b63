"""Quality of the goodput policy in simulation, against the artifact's Pollux figures.

Runs ``GoodputPolicy`` (its defaults: p = -1, 30 s restart cost, 60 s rounds) through workloads
1-4 at 1x and 2x load, plus held-out traces (``--held-out SEED ...`` draws them with
``benchmarks/make_trace.py``, 160 jobs for 1x and 320 for 2x; ``--extra`` takes ready-made
CSV files), two processes at most, and prints per run: average JCT, the artifact's Pollux
figure, their ratio (target <= 0.9), restarts per job (target <= 3), the worst finish-time
fairness and the median decision time.  ``--p`` reports another p (the headline is the default).  Jobs declare their length (epochs),
so the policy sees each job's share of it done.

    python benchmarks/policy_quality.py [--data DIR] [--workloads 1 2 3 4] [--loads 1x 2x]
                                        [--held-out 11 12 13] [--extra TRACE.csv ...]
                                        [--p 0] [--by-app] [--json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

DEFAULT_DATA = Path(__file__).resolve().parents[2] / "shared/data/pollux-artifact"
#: Pollux's average JCT (s) as the artifact recorded it, workloads 1-4.
POLLUX_AVG_JCT_S = {"1x": [2089, 3323, 2188, 2721], "2x": [6186, 4191, 5132, 5262]}
LOAD_FOLDERS = {"1x": "workloads", "2x": "workloads-2.0"}
TARGET_RATIO = 0.9
TARGET_RESTARTS = 3.0


Task = tuple[str, str, str, float | None, bool, bool]


def run_one(task: Task) -> dict[str, object]:
    """Simulate one trace; ``task`` = (label, trace path, models dir, p or None for the
    policy's default, whether jobs of one application share their measurements, whether
    models are corrected by their measured residuals)."""
    from pollux_local.core.policy import GoodputPolicy
    from pollux_local.sim.profiles import load_profiles
    from pollux_local.sim.simulator import SimConfig, Simulator
    from pollux_local.sim.workload import read_workload

    label, trace, models, p, share, correct = task
    workload = read_workload(Path(trace))
    profiles = load_profiles(Path(models), {job.application for job in workload})
    policy = GoodputPolicy() if p is None else GoodputPolicy(p=p)
    simulator = Simulator(
        workload, profiles, policy, SimConfig(share_profiles=share, correct_times=correct)
    )
    result = simulator.run()
    row: dict[str, object] = {"run": label, **result.summary()}
    by_app: dict[str, dict[str, float]] = {}
    for job in simulator.jobs:
        entry = by_app.setdefault(job.app.name, {"jobs": 0, "jct_sum_s": 0.0, "restarts": 0.0})
        entry["jobs"] += 1
        entry["jct_sum_s"] += result.jct_s.get(job.name, float("nan"))
        entry["restarts"] += job.restarts
    row["by_application"] = {
        app: {
            "jobs": int(e["jobs"]),
            "avg_jct_s": e["jct_sum_s"] / e["jobs"],
            "share_of_avg_jct_s": e["jct_sum_s"] / len(simulator.jobs),
            "restarts_per_job": e["restarts"] / e["jobs"],
        }
        for app, e in sorted(by_app.items())
    }
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--workloads", type=int, nargs="*", default=[1, 2, 3, 4])
    parser.add_argument("--loads", nargs="*", default=["1x", "2x"], choices=["1x", "2x"])
    parser.add_argument("--extra", type=Path, nargs="*", default=[])
    parser.add_argument("--held-out", type=int, nargs="*", default=[], metavar="SEED")
    parser.add_argument(
        "--by-app", action="store_true", help="also print each application's share of the average"
    )
    parser.add_argument(
        "--p", type=float, default=None, help="p-mean exponent (default: the policy's, -1)"
    )
    parser.add_argument(
        "--no-share-profiles",
        dest="share_profiles",
        action="store_false",
        help="each job's model from its own measurements only (as the reference simulated)",
    )
    parser.add_argument(
        "--no-correct-times",
        dest="correct_times",
        action="store_false",
        help="predict from the fitted model alone, without the measured-residual correction",
    )
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)

    tasks: list[Task] = []
    reference: dict[str, float] = {}
    models = str(args.data / "models")
    for load in args.loads:
        for number in args.workloads:
            label = f"{load} workload-{number}"
            path = args.data / LOAD_FOLDERS[load] / f"workload-{number}.csv"
            tasks.append(
                (label, str(path), models, args.p, args.share_profiles, args.correct_times)
            )
            reference[label] = POLLUX_AVG_JCT_S[load][number - 1]
    for extra in args.extra:
        tasks.append(
            (
                f"held-out {extra.name}",
                str(extra),
                models,
                args.p,
                args.share_profiles,
                args.correct_times,
            )
        )
    scratch = tempfile.TemporaryDirectory(prefix="pollux-held-out-")
    if args.held_out:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import csv

        from make_trace import make_trace

        for load in args.loads:
            for seed in args.held_out:
                trace_rows = make_trace(args.data, 160 if load == "1x" else 320, seed)
                path = Path(scratch.name) / f"held-out-{load}-seed{seed}.csv"
                with path.open("w", newline="") as handle:
                    writer = csv.writer(handle)
                    writer.writerow(["name", "time", "application", "num_replicas", "batch_size"])
                    writer.writerows(trace_rows)
                tasks.append(
                    (
                        f"{load} held-out seed {seed}",
                        str(path),
                        models,
                        args.p,
                        args.share_profiles,
                        args.correct_times,
                    )
                )
    processes = max(1, min(args.processes, 2, len(tasks)))
    with multiprocessing.Pool(processes) as pool:
        rows = pool.map(run_one, tasks, chunksize=1)
    scratch.cleanup()
    for row in rows:
        ref = reference.get(str(row["run"]))
        if ref is not None:
            row["pollux_artifact_avg_jct_s"] = ref
            row["ratio"] = float(row["avg_jct_s"]) / ref  # type: ignore[arg-type]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(
        f"{'run':28s} {'avg JCT s':>10s} {'Pollux s':>9s} {'ratio':>6s} {'restarts/job':>12s}"
        f" {'worst FTF':>9s} {'decide ms':>9s} {'wall s':>7s}"
    )
    for row in rows:
        pollux_ref = row.get("pollux_artifact_avg_jct_s")
        ratio = row.get("ratio")
        ok = ""
        if isinstance(ratio, float):
            met = ratio <= TARGET_RATIO and float(row["restarts_per_job"]) <= TARGET_RESTARTS  # type: ignore[arg-type]
            ok = "  met" if met else "  MISSED"
        print(
            f"{row['run']!s:28s} {float(row['avg_jct_s']):10.0f} "  # type: ignore[arg-type]
            f"{(f'{pollux_ref:.0f}' if isinstance(pollux_ref, int | float) else '-'):>9s} "
            f"{(f'{ratio:.2f}' if isinstance(ratio, float) else '-'):>6s} "
            f"{float(row['restarts_per_job']):12.2f} "  # type: ignore[arg-type]
            f"{float(row['max_finish_time_fairness']):9.2f} "  # type: ignore[arg-type]
            f"{float(row['decision_ms_median']):9.2f} {float(row['wall_s']):7.1f}{ok}"  # type: ignore[arg-type]
        )
        if args.by_app:
            apps = row["by_application"]
            assert isinstance(apps, dict)
            for app, e in apps.items():
                print(
                    f"    {app:12s} jobs {e['jobs']:4d}  avg JCT {e['avg_jct_s']:8.0f} s"
                    f"  share of the average {e['share_of_avg_jct_s']:7.0f} s"
                    f"  restarts/job {e['restarts_per_job']:5.2f}"
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
