"""Wall time of one simulation, this tree against another, in alternating runs.

Each run is a fresh process (``python -m pollux_local simulate WORKLOAD --json``, one thread)
started outside both trees with ``PYTHONPATH`` at the tree it times, so that imports do not
mix; the simulator's own ``wall_s`` (the simulation, not the imports) and the process's CPU
time are read back.  Runs alternate (base, this, base, this, ...) so that the machine's load
falls on both alike; the figure to read is the median of the pairs' ratios, with the best
against the best beside it.  The results (average and p99 JCT, restarts) must be the same
in every run of one tree; with ``--same`` also between the trees (a change meant to keep
every decision).

    python benchmarks/simulation_speed.py --base /path/to/other/checkout [--pairs 6]
        [--workload ../shared/data/pollux-artifact/workloads/workload-1.csv] [--same] [--json]
        [-- extra simulate arguments]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_WORKLOAD = REPO.parent / "shared/data/pollux-artifact/workloads/workload-1.csv"


def run_once(tree: Path, workload: Path, extra: list[str], cwd: str) -> dict[str, float]:
    """One simulation of ``tree``'s code: its ``wall_s``, CPU seconds and results."""
    env = dict(os.environ, PYTHONPATH=str(tree), OMP_NUM_THREADS="1")
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    out = subprocess.run(
        [sys.executable, "-m", "pollux_local", "simulate", str(workload), *extra, "--json"],
        cwd=cwd, env=env, capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    result = json.loads(out)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {
        "wall_s": float(result["wall_s"]),
        "cpu_s": cpu,
        "avg_jct_s": float(result["avg_jct_s"]),
        "p99_jct_s": float(result["p99_jct_s"]),
        "restarts_per_job": float(result["restarts_per_job"]),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", type=Path, required=True, help="another checkout to compare")
    parser.add_argument("--pairs", type=int, default=6)
    parser.add_argument("--workload", type=Path, default=DEFAULT_WORKLOAD)
    parser.add_argument("--same", action="store_true", help="the trees must decide alike")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("extra", nargs="*", help="more simulate arguments (after --)")
    args = parser.parse_args(argv)
    trees = {"base": args.base.resolve(), "this": REPO}
    runs: dict[str, list[dict[str, float]]] = {"base": [], "this": []}
    with tempfile.TemporaryDirectory() as outside:
        for _ in range(args.pairs):
            for name, tree in trees.items():
                runs[name].append(run_once(tree, args.workload.resolve(), args.extra, outside))
    results = {
        name: {(r["avg_jct_s"], r["p99_jct_s"], r["restarts_per_job"]) for r in rows}
        for name, rows in runs.items()
    }
    steady = all(len(found) == 1 for found in results.values())
    same = results["base"] == results["this"]
    summary: dict[str, object] = {"steady": steady, "same_results": same}
    for key in ("wall_s", "cpu_s"):
        base = [r[key] for r in runs["base"]]
        this = [r[key] for r in runs["this"]]
        summary[key] = {
            "base": base,
            "this": this,
            "median_pair_ratio": statistics.median(t / b for b, t in zip(base, this, strict=True)),
            "best_ratio": min(this) / min(base),
        }
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        for key in ("wall_s", "cpu_s"):
            part = summary[key]
            assert isinstance(part, dict)
            print(f"{key}: base {' '.join(f'{v:.2f}' for v in part['base'])}")
            print(f"{key}: this {' '.join(f'{v:.2f}' for v in part['this'])}")
            print(
                f"{key}: median of the pairs' ratios {part['median_pair_ratio']:.3f}, "
                f"best against best {part['best_ratio']:.3f}"
            )
        print(f"results steady within each tree: {steady}; the same in both: {same}")
    if not steady or (args.same and not same):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
