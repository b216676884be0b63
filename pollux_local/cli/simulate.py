"""``pollux-local simulate``: run a policy through a workload trace with measured profiles."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from pollux_local.core import names
from pollux_local.core.names import canonical_policy
from pollux_local.core.types import Policy
from pollux_local.errors import PolluxError

if TYPE_CHECKING:
    from pollux_local.sim.cluster import NodeGroup

POLICIES = names.policy_names()
#: Policies that run on a cluster of several device types (``--cluster``).
TYPED_POLICIES = names.policy_names(typed=True)
#: Other names accepted for a policy: the goodput policy is Pollux's.
DEFAULT_MODELS = Path("..") / "shared" / "data" / "pollux-artifact" / "models"
#: Profiles per device type (``placements-<type>.csv``), the default with ``--cluster``.
DEFAULT_TYPED_MODELS = Path("..") / "shared" / "data" / "sia-artifact" / "models"
REPO_ROOT = Path(__file__).resolve().parents[2]


def default_models_dir(relative: Path = DEFAULT_MODELS) -> Path | None:
    """``../shared/data/pollux-artifact/models`` (or ``relative``) from the current directory
    or, failing that, from the repository root; ``None`` when neither exists."""
    for base in (Path.cwd(), REPO_ROOT):
        candidate = (base / relative).resolve()
        if candidate.is_dir():
            return candidate
    return None


def make_policy(name: str, interval_s: float = 60.0, restart_cost_s: float = 30.0) -> Policy:
    """A fresh policy object by name (or alias), from the registry (``core.names``)."""
    try:
        return names.make_policy(name, interval_s=interval_s, restart_cost_s=restart_cost_s)
    except ValueError as exc:
        raise PolluxError(str(exc)) from None


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def _cluster(text: str) -> tuple[NodeGroup, ...]:
    from pollux_local.sim.cluster import parse_cluster

    try:
        return parse_cluster(text)
    except PolluxError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "simulate",
        help="simulate a scheduling policy on a workload trace",
        description="Drive a scheduling policy through a workload CSV "
        "(name,time,application,num_replicas,batch_size) using measured model profiles.",
    )
    parser.add_argument("workload", metavar="WORKLOAD.csv", type=Path)
    parser.add_argument(
        "--models",
        type=Path,
        default=None,
        help=f"profiles folder (default: {DEFAULT_MODELS} when it exists; with --cluster"
        f" {DEFAULT_TYPED_MODELS})",
    )
    parser.add_argument(
        "--policy",
        type=canonical_policy,
        choices=POLICIES,
        default="goodput",
        help="allocation policy (pollux: another name for goodput)",
    )
    parser.add_argument("--nodes", type=int, default=16)
    parser.add_argument("--gpus-per-node", type=int, default=4)
    parser.add_argument(
        "--cluster",
        type=_cluster,
        default=None,
        metavar="TYPE:NxK,...",
        help="nodes of several device types, e.g. aws:6x4,dgx-ext:2x8,rtx:3x8 (N nodes of K"
        " devices each; profiles from placements-TYPE.csv; replaces --nodes/--gpus-per-node)",
    )
    parser.add_argument("--interval", type=_non_negative_float, default=60.0, help="seconds")
    parser.add_argument(
        "--restart-cost",
        type=_non_negative_float,
        default=30.0,
        help="seconds a checkpoint-restart costs (with --cluster: Sia's measured cost per model)",
    )
    parser.add_argument(
        "--warm-resize-cost",
        type=_non_negative_float,
        default=None,
        metavar="S",
        help="model warm resizes: a change of an elastic job's devices within its device type"
        " that keeps some of its nodes costs S seconds instead of a restart (default: every"
        " change restarts)",
    )
    parser.add_argument(
        "--measured-restart-cost",
        action="store_true",
        help="tell the policy (not Sia's) each job's true restart cost once it has restarted, as"
        " the daemon measures it (with --cluster: Sia's per-model costs instead of Sia's guesses)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--no-share-profiles",
        dest="share_profiles",
        action="store_false",
        help="fit each job's model to its own measurements only (as the reference simulated)",
    )
    parser.add_argument(
        "--no-correct-times",
        dest="correct_times",
        action="store_false",
        help="predict from the fitted model alone, without the measured-residual correction",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(func=run_simulate)


class _ProgressBar:
    """A one-line progress bar on a terminal stream."""

    def __init__(self, stream: TextIO, width: int = 30) -> None:
        self.stream = stream
        self.width = width
        self._last = -1

    def __call__(self, now: float, done: int, total: int) -> None:
        if done == self._last and int(now) % 3600:
            return
        self._last = done
        filled = self.width * done // max(total, 1)
        bar = "#" * filled + "-" * (self.width - filled)
        self.stream.write(f"\r[{bar}] {done}/{total} jobs done  t={now / 3600:6.1f} h")
        self.stream.flush()

    def close(self) -> None:
        self.stream.write("\n")
        self.stream.flush()


def _format_summary(summary: dict[str, float | int | str | None], workload: Path) -> str:
    def hours(key: str) -> str:
        if summary[key] is None:
            return "         -"
        value = float(summary[key])  # type: ignore[arg-type]
        return f"{value:10.0f} s  ({value / 3600:.2f} h)"

    lines = [
        f"workload            {workload}",
        f"policy              {summary['policy']}",
        f"jobs                {summary['completed']}/{summary['jobs']} completed",
        f"average JCT       {hours('avg_jct_s')}",
        f"p99 JCT           {hours('p99_jct_s')}",
        f"makespan          {hours('makespan_s')}",
        f"restarts per job    {float(summary['restarts_per_job'] or 0):.2f}"
        f"  (warm resizes per job {float(summary['warm_resizes_per_job'] or 0):.2f})",
        f"worst finish-time fairness  {summary['max_finish_time_fairness'] or math.nan:.2f}"
        "  (JCT / JCT alone on an equal share)",
        f"decision time       median {float(summary['decision_ms_median'] or 0):.2f} ms,"
        f" p95 {float(summary['decision_ms_p95'] or 0):.2f} ms over {summary['rounds']} rounds",
        f"wall time           {float(summary['wall_s'] or 0):.1f} s",
    ]
    return "\n".join(lines)


def run_simulate(args: argparse.Namespace) -> int:
    from pollux_local.sim.cluster import format_cluster
    from pollux_local.sim.engine import SimConfig, Simulator
    from pollux_local.sim.profiles import load_profiles, load_typed_profiles
    from pollux_local.sim.workload import read_workload

    typed = args.cluster is not None
    if typed and args.policy not in TYPED_POLICIES:
        raise PolluxError(
            f"policy {args.policy} does not run on typed devices (--cluster):"
            f" choose from {', '.join(TYPED_POLICIES)}"
        )
    config = SimConfig(
        nodes=args.nodes,
        gpus_per_node=args.gpus_per_node,
        cluster=args.cluster,
        interval_s=args.interval,
        restart_cost_s=args.restart_cost,
        warm_resize_cost_s=args.warm_resize_cost,
        measured_restart_cost=args.measured_restart_cost,
        seed=args.seed,
        share_profiles=None if args.share_profiles else False,
        correct_times=args.correct_times,
    )
    config.validate()
    default = DEFAULT_TYPED_MODELS if typed else DEFAULT_MODELS
    models = args.models or default_models_dir(default)
    if models is None:
        raise PolluxError(f"models folder not found: {default} (give --models DIR)")
    workload = read_workload(args.workload)
    apps = {job.application for job in workload}
    profiles = (
        load_typed_profiles(models, [g.device_type for g in args.cluster], apps)
        if typed
        else load_profiles(models, apps)
    )
    policy = make_policy(args.policy, interval_s=args.interval, restart_cost_s=args.restart_cost)
    simulator = Simulator(workload, profiles, policy, config)
    bar = None if args.json or not sys.stderr.isatty() else _ProgressBar(sys.stderr)
    try:
        result = simulator.run(on_round=bar)
    finally:
        if bar is not None:
            bar.close()
    summary: dict[str, object] = dict(result.summary())
    if typed:
        summary["cluster"] = format_cluster(args.cluster)
        summary["device_hours_by_type"] = simulator.device_hours_by_type()
    if args.json:
        print(json.dumps(summary, sort_keys=False))
        return 0
    print(_format_summary(result.summary(), args.workload))
    if typed:
        hours = simulator.device_hours_by_type()
        print(f"cluster             {summary['cluster']}")
        print(f"device-hours        {', '.join(f'{t} {h:.1f}' for t, h in hours.items())}")
    return 0
