"""Quality of the goodput policy in simulation, against the artifact's Pollux figures.

Runs ``GoodputPolicy`` (its defaults: p = -1, 30 s restart cost, 60 s rounds) through workloads
1-4 at 1x and 2x load, plus held-out traces (``--held-out SEED ...`` draws them with
``benchmarks/make_trace.py``, 160 jobs for 1x and 320 for 2x; ``--extra`` takes ready-made
CSV files), two processes at most, and prints per run: average JCT, the artifact's Pollux
figure, their ratio (target <= 0.75), restarts per job (target <= 1.5), the worst finish-time
fairness, the median decision time, the p99 JCT and the warm resizes per job.  Jobs declare
their length (epochs), so the policy sees each job's share of it done.

``--warm-resize-cost S`` replays the traces with warm resizes costing S seconds (a change of
count that keeps one of a job's nodes; ``SimConfig.warm_resize_cost_s``): they are counted
apart from the restarts (checkpoint-restarts).  ``--p``, ``--payback-margin``,
``--type-payback-margin``, ``--rank-exponent`` and ``--interval`` set the goodput policy's
levers (default: its defaults); ``--workloads`` with no number runs held-out traces alone
(tuning is done on those, never on workloads 1-4).

    python benchmarks/policy_quality.py [--data DIR] [--workloads 1 2 3 4] [--loads 1x 2x]
                                        [--held-out 11 12 13] [--extra TRACE.csv ...]
                                        [--warm-resize-cost S] [--p 0] [--by-app] [--json]

Several device types (``--cluster``): every workload (``--workloads`` takes folders of
``workload-*.csv`` or CSV files; ``--held-out`` seeds draw traces with
``make_hetero_trace.py``) is simulated with the goodput policy, the Sia baseline and the
heterogeneity-unaware goodput policy, and each row shows average JCT and restarts per job; the
goodput policy's ratio to Sia (target <= 0.8, restarts <= 1.5 per job), both policies' p99
JCT and, for the philly workloads, Sia's JCT and restarts as Sia's own simulator gives them.
Sia restarts as it does in its own simulator (checkpoint-restarts at its per-model costs)
whatever ``--warm-resize-cost`` says; ``--policies goodput`` (tuning) prints the goodput
policy's summaries alone:

    python benchmarks/policy_quality.py --cluster aws:6x4,dgx-ext:2x8,rtx:3x8 \
        --workloads ../shared/data/sia-artifact/workloads/philly [--held-out 101 102] [--json]
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
TARGET_RATIO = 0.75
TARGET_RESTARTS = 1.5
#: Goals against Sia on its cluster: JCT ratio, and restarts per job.
TYPED_TARGET_RATIO = 0.8


#: (label, trace path, models dir, knobs, share profiles, correct times)
Task = tuple[str, str, str, "Knobs", bool, bool]
#: Sia's own simulator on the default heterogeneous cluster (p = -0.5, lambda_n = 1.1, 60 s
#: rounds, projection and shared max replicas, CBC): average JCT (s) and restarts per job of
#: the philly workloads 1-4.
SIA_PUBLISHED = {
    "workload-1": (1950.0, 4.26),
    "workload-2": (2691.0, 4.54),
    "workload-3": (2070.0, 4.13),
    "workload-4": (2485.0, 4.22),
}
TYPED_POLICIES = ("goodput", "sia", "goodput-unaware")
DEFAULT_TYPED_MODELS = Path(__file__).resolve().parents[2] / "shared/data/sia-artifact/models"
#: (label, policy, trace path, models dir, cluster text, knobs)
TypedTask = tuple[str, str, str, str, str, "Knobs"]
#: The tuning levers a run may set (absent: the default): ``warm_resize_cost_s`` (the
#: simulator's warm resizes), and the goodput policy's ``payback_margin``,
#: ``type_payback_margin``, ``rank_exponent``, ``p``, ``interval_s``.
Knobs = dict[str, float]
POLICY_KNOBS = ("payback_margin", "type_payback_margin", "rank_exponent", "p")


def make_goodput(name: str, knobs: Knobs) -> object:
    """The policy ``name`` with the knobs that apply to it (the goodput policies only)."""
    from pollux_local.cli.simulate import make_policy
    from pollux_local.core.policy import GoodputPolicy

    interval = knobs.get("interval_s", 60.0)
    if name not in ("goodput", "goodput-unaware"):
        return make_policy(name, interval_s=interval)
    kwargs = {k: knobs[k] for k in POLICY_KNOBS if k in knobs}
    return GoodputPolicy(
        interval_s=interval,
        type_aware=name == "goodput",
        **kwargs,  # type: ignore[arg-type]
    )


def run_typed(task: TypedTask) -> dict[str, object]:
    """Simulate one trace on a cluster of several device types with one policy."""
    from pollux_local.sim.cluster import parse_cluster
    from pollux_local.sim.engine import SimConfig, Simulator
    from pollux_local.sim.profiles import load_typed_profiles
    from pollux_local.sim.workload import read_workload

    label, policy_name, trace, models, cluster_text, knobs = task
    cluster = parse_cluster(cluster_text)
    workload = read_workload(Path(trace))
    profiles = load_typed_profiles(
        Path(models), [g.device_type for g in cluster], {job.application for job in workload}
    )
    config = SimConfig(
        cluster=cluster,
        interval_s=knobs.get("interval_s", 60.0),
        # Sia's restarts stay Sia's: checkpoint-restarts at its measured costs, as published
        warm_resize_cost_s=None if policy_name == "sia" else knobs.get("warm_resize_cost_s"),
        measured_restart_cost=bool(knobs.get("measured_restart_cost")),
    )
    policy = make_goodput(policy_name, knobs)
    simulator = Simulator(workload, profiles, policy, config)  # type: ignore[arg-type]
    result = simulator.run()
    return {
        "run": label,
        **result.summary(),
        "device_hours_by_type": simulator.device_hours_by_type(),
    }


def typed_traces(args: argparse.Namespace, scratch: Path) -> list[tuple[str, Path]]:
    """(label, path) of every trace: workload folders or files, then held-out seeds."""
    traces: list[tuple[str, Path]] = []
    for entry in args.workloads or []:
        path = Path(entry)
        if path.is_dir():
            files = sorted(path.glob("workload-*.csv"))
            if not files:
                raise SystemExit(f"no workload-*.csv in {path}")
            traces.extend((f.stem, f) for f in files)
        elif path.is_file():
            traces.append((path.stem, path))
        else:
            raise SystemExit(f"--workloads {entry}: neither a folder nor a file")
    if args.held_out:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        import csv

        from make_hetero_trace import DEFAULT_SIA, make_hetero_trace

        for seed in args.held_out:
            rows = make_hetero_trace(args.data, DEFAULT_SIA, 160, seed)
            path = scratch / f"held-out-seed{seed}.csv"
            with path.open("w", newline="") as handle:
                writer = csv.writer(handle)
                writer.writerow(["name", "time", "application", "num_replicas", "batch_size"])
                writer.writerows(rows)
            traces.append((f"held-out seed {seed}", path))
    return traces


def main_typed(args: argparse.Namespace) -> int:
    """``--cluster``: goodput, Sia and the unaware goodput policy on every trace."""
    models = str(args.models or DEFAULT_TYPED_MODELS)
    scratch = tempfile.TemporaryDirectory(prefix="pollux-typed-")
    traces = typed_traces(args, Path(scratch.name))
    tasks: list[TypedTask] = [
        (label, policy, str(path), models, args.cluster, knobs_of(args))
        for label, path in traces
        for policy in args.policies
    ]
    processes = max(1, min(args.processes, 2, len(tasks)))
    with multiprocessing.Pool(processes) as pool:
        results = pool.map(run_typed, tasks, chunksize=1)
    scratch.cleanup()
    rows: list[dict[str, object]] = []
    count = len(args.policies)
    for index, (label, _) in enumerate(traces):
        by_policy = {str(r["policy"]): r for r in results[index * count : (index + 1) * count]}
        if "goodput" not in by_policy or "sia" not in by_policy:  # a tuning run
            print(json.dumps({"workload": label, **by_policy}, default=float))
            continue
        ours, sia = by_policy["goodput"], by_policy["sia"]
        unaware = by_policy.get("goodput-unaware")
        ratio = float(ours["avg_jct_s"]) / float(sia["avg_jct_s"])  # type: ignore[arg-type]
        met = ratio <= TYPED_TARGET_RATIO and float(ours["restarts_per_job"]) <= TARGET_RESTARTS  # type: ignore[arg-type]
        row: dict[str, object] = {
            "workload": label,
            "goodput": ours,
            "sia": sia,
            "goodput-unaware": unaware,
            "ratio_to_sia": ratio,
            "target_met": met,
        }
        if label in SIA_PUBLISHED:
            jct, restarts = SIA_PUBLISHED[label]
            row["sia_published"] = {"avg_jct_s": jct, "restarts_per_job": restarts}
            row["ratio_to_published_sia"] = float(ours["avg_jct_s"]) / jct  # type: ignore[arg-type]
        rows.append(row)
    if args.json:
        print(json.dumps({"cluster": args.cluster, "rows": rows}, indent=2))
        return 0
    print(f"cluster {args.cluster}; average JCT in s, restarts per job")
    print(
        f"{'workload':22s} {'goodput':>15s} {'Sia':>15s} {'unaware':>15s} {'ours/Sia':>8s}"
        f" {'Sia (own sim)':>15s} {'decide ms':>10s} {'p99 ours/Sia':>13s} {'warm/job':>8s}"
    )

    def num(value: object) -> float:
        assert isinstance(value, int | float)
        return float(value)

    def cell(r: object) -> str:
        if r is None:
            return "-"
        assert isinstance(r, dict)
        return f"{num(r['avg_jct_s']):7.0f} / {num(r['restarts_per_job']):5.2f}"

    for row in rows:
        mine, theirs = row["goodput"], row["sia"]
        assert isinstance(mine, dict) and isinstance(theirs, dict)
        published = row.get("sia_published")
        shown = (
            f"{published['avg_jct_s']:7.0f} / {published['restarts_per_job']:5.2f}"
            if isinstance(published, dict)
            else "-"
        )
        ms = f"{num(mine['decision_ms_median']):4.1f}/{num(theirs['decision_ms_median']):4.1f}"
        p99 = f"{num(mine['p99_jct_s']):6.0f}/{num(theirs['p99_jct_s']):6.0f}"
        print(
            f"{row['workload']!s:22s} {cell(mine):>15s} {cell(theirs):>15s}"
            f" {cell(row['goodput-unaware']):>15s} {num(row['ratio_to_sia']):8.3f}"
            f" {shown:>15s} {ms:>10s} {p99:>13s} {num(mine['warm_resizes_per_job']):8.2f}"
            f"  {'met' if row['target_met'] else 'MISSED'}"
        )
    print(
        "decide ms: median decision time, goodput / Sia; p99 JCT in s, goodput / Sia;"
        " warm/job: goodput's warm resizes per job (not counted as restarts)"
    )
    return 0


def knobs_of(args: argparse.Namespace) -> Knobs:
    """The levers set on the command line."""
    given = {
        "p": args.p,
        "warm_resize_cost_s": args.warm_resize_cost,
        "payback_margin": args.payback_margin,
        "type_payback_margin": args.type_payback_margin,
        "rank_exponent": args.rank_exponent,
        "interval_s": args.interval,
        "measured_restart_cost": 1.0 if args.measured_restart_cost else None,
    }
    return {k: float(v) for k, v in given.items() if v is not None}


def run_one(task: Task) -> dict[str, object]:
    """Simulate one trace; ``task`` = (label, trace path, models dir, p or None for the
    policy's default, whether jobs of one application share their measurements, whether
    models are corrected by their measured residuals)."""
    from pollux_local.sim.engine import SimConfig, Simulator
    from pollux_local.sim.profiles import load_profiles
    from pollux_local.sim.workload import read_workload

    label, trace, models, knobs, share, correct = task
    workload = read_workload(Path(trace))
    profiles = load_profiles(Path(models), {job.application for job in workload})
    policy = make_goodput("goodput", knobs)
    config = SimConfig(
        share_profiles=share,
        correct_times=correct,
        interval_s=knobs.get("interval_s", 60.0),
        warm_resize_cost_s=knobs.get("warm_resize_cost_s"),
    )
    simulator = Simulator(workload, profiles, policy, config)  # type: ignore[arg-type]
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
    parser.add_argument(
        "--workloads",
        nargs="*",
        default=None,
        help="workload numbers (default 1 2 3 4); with --cluster: folders or CSV files",
    )
    parser.add_argument(
        "--cluster",
        default=None,
        metavar="TYPE:NxK,...",
        help="nodes of several device types: compare goodput, Sia and unaware goodput",
    )
    parser.add_argument("--models", type=Path, default=None, help="typed profiles (with --cluster)")
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
    parser.add_argument(
        "--warm-resize-cost",
        type=float,
        default=None,
        metavar="S",
        help="simulate warm resizes costing S seconds (default: every change restarts)",
    )
    parser.add_argument(
        "--measured-restart-cost",
        action="store_true",
        help="the goodput policies are told each job's true restart cost once it restarted"
        " (as the daemon measures it; with --cluster: Sia's per-model costs, not Sia's guesses)",
    )
    parser.add_argument("--payback-margin", type=float, default=None, help="tuning lever")
    parser.add_argument("--type-payback-margin", type=float, default=None, help="tuning lever")
    parser.add_argument("--rank-exponent", type=float, default=None, help="tuning lever")
    parser.add_argument("--interval", type=float, default=None, help="seconds between passes")
    parser.add_argument(
        "--policies",
        nargs="*",
        default=list(TYPED_POLICIES),
        choices=TYPED_POLICIES,
        help="with --cluster: the policies run (without goodput and sia: each one's summary as"
        " JSON, for tuning)",
    )
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.cluster is not None:
        if not args.workloads and not args.held_out:
            parser.error("--cluster needs --workloads FOLDER/FILE ... or --held-out SEED ...")
        return main_typed(args)
    try:
        # ``--workloads`` with no number: held-out traces only
        args.workloads = (
            [1, 2, 3, 4] if args.workloads is None else [int(w) for w in args.workloads]
        )
    except ValueError:
        parser.error("--workloads takes workload numbers (folders and files need --cluster)")

    tasks: list[Task] = []
    reference: dict[str, float] = {}
    models = str(args.data / "models")
    for load in args.loads:
        for number in args.workloads:
            label = f"{load} workload-{number}"
            path = args.data / LOAD_FOLDERS[load] / f"workload-{number}.csv"
            tasks.append(
                (label, str(path), models, knobs_of(args), args.share_profiles, args.correct_times)
            )
            reference[label] = POLLUX_AVG_JCT_S[load][number - 1]
    for extra in args.extra:
        tasks.append(
            (
                f"held-out {extra.name}",
                str(extra),
                models,
                knobs_of(args),
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
                        knobs_of(args),
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
        f" {'worst FTF':>9s} {'decide ms':>9s} {'wall s':>7s} {'p99 JCT s':>9s} {'warm/job':>8s}"
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
            f"{float(row['decision_ms_median']):9.2f} {float(row['wall_s']):7.1f}"  # type: ignore[arg-type]
            f" {float(row['p99_jct_s']):9.0f} {float(row['warm_resizes_per_job']):8.2f}{ok}"  # type: ignore[arg-type]
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
