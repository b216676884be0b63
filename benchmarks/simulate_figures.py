"""Simulated average JCT of each policy on the published workloads, against the artifact.

Runs the chosen policies over workloads 1-4 at 1x (``workloads/``) and 2x (``workloads-2.0/``)
load and prints, per run, the average JCT, the artifact's figure for that policy and workload
(section 8 of the reference notes), their ratio, restarts per job, the worst finish-time
fairness and the simulation's wall time.  Two processes at most.

    python benchmarks/simulate_figures.py [--data DIR] [--policy tiresias optimus ...]
                                          [--workloads 1 2 3 4] [--loads 1x 2x] [--json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

#: Average JCT (s) recorded by the published artifact: {load: {policy: [w1, w2, w3, w4]}};
#: the goodput policy's reference is the artifact's Pollux.
ARTIFACT_AVG_JCT_S: dict[str, dict[str, list[float]]] = {
    "1x": {
        "goodput": [2089, 3323, 2188, 2721],
        "tiresias": [2474, 5145, 3876, 3280],
        "optimus": [4087, 6914, 3944, 5968],
    },
    "2x": {
        "goodput": [6186, 4191, 5132, 5262],
        "tiresias": [10138, 8656, 10728, 9665],
        "optimus": [10807, 8515, 8363, 10313],
    },
}
LOAD_FOLDERS = {"1x": "workloads", "2x": "workloads-2.0"}


def _run(task: tuple[str, str, int, str]) -> dict[str, object]:
    from pollux_local.cli.simulate import canonical_policy, make_policy
    from pollux_local.sim.engine import Simulator
    from pollux_local.sim.profiles import load_profiles
    from pollux_local.sim.workload import read_workload

    data, load, number, policy_name = task
    policy_name = canonical_policy(policy_name)
    path = Path(data) / LOAD_FOLDERS[load] / f"workload-{number}.csv"
    workload = read_workload(path)
    profiles = load_profiles(Path(data) / "models", {job.application for job in workload})
    result = Simulator(workload, profiles, make_policy(policy_name)).run()
    row: dict[str, object] = dict(result.summary())
    row.update(load=load, workload=number)
    reference = ARTIFACT_AVG_JCT_S[load].get(policy_name)
    if reference is not None and row["avg_jct_s"] is not None:
        row["artifact_avg_jct_s"] = reference[number - 1]
        row["ratio"] = float(row["avg_jct_s"]) / reference[number - 1]  # type: ignore[arg-type]
    return row


def main() -> int:
    from pollux_local.cli.simulate import POLICIES, canonical_policy

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default=str(REPO.parent / "shared" / "data" / "pollux-artifact"))
    parser.add_argument(
        "--policy",
        nargs="+",
        type=canonical_policy,
        default=["tiresias", "optimus", "goodput"],
        choices=POLICIES,
        help="policies to run (pollux: another name for goodput)",
    )
    parser.add_argument("--workloads", nargs="+", type=int, default=[1, 2, 3, 4])
    parser.add_argument("--loads", nargs="+", default=["1x", "2x"], choices=["1x", "2x"])
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--json", action="store_true", help="print one JSON list of rows")
    args = parser.parse_args()

    tasks = [
        (args.data, load, number, policy)
        for policy in args.policy
        for load in args.loads
        for number in args.workloads
    ]
    processes = max(1, min(2, args.processes, len(tasks)))
    with multiprocessing.get_context("spawn").Pool(processes) as pool:
        rows = pool.map(_run, tasks, chunksize=1)
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    header = (
        f"{'policy':9} {'load':4} {'wl':>2} {'avg JCT s':>10} {'artifact':>9} {'ratio':>6}"
        f" {'p99 JCT s':>10} {'restarts':>8} {'worst FTF':>9} {'dec ms':>7} {'wall s':>7}"
    )
    print(header)
    print("-" * len(header))
    for row in rows:
        artifact = row.get("artifact_avg_jct_s")
        ratio = row.get("ratio")
        print(
            f"{row['policy']:9} {row['load']:4} {row['workload']:>2}"
            f" {row['avg_jct_s'] or float('nan'):10.0f}"
            f" {artifact if artifact is not None else '-':>9}"
            f" {f'{ratio:.3f}' if ratio is not None else '-':>6}"
            f" {row['p99_jct_s'] or float('nan'):10.0f}"
            f" {row['restarts_per_job']:8.2f}"
            f" {row['max_finish_time_fairness'] or float('nan'):9.2f}"
            f" {row['decision_ms_median']:7.2f}"
            f" {row['wall_s']:7.1f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
