"""Decision time of the goodput policy, and the time of one throughput fit.

Jobs get realistic fitted models: each is an application from the artifact's profiles, its
throughput model fitted (and corrected by its residuals) on the (nodes, replicas, micro-batch)
points it would have run so far (up to its largest profiled replica count), its gradient
statistics taken at a random epoch.
Each timed decision starts from the previous decision's placements (as in a real run), with
ages and attained service advanced by one interval.  The goodput policy remembers a model's
goodput tables while the model does not change; a second row on the typed clusters gives every
job new gradient statistics before each decision (as reports do), so only the throughput grids
of its fits are remembered.

On a cluster of several device types (the Sia artifact's aws:6x4,dgx-ext:2x8,rtx:3x8 and the
same 16 times over, 1,024 GPUs) the jobs get a fitted model on one or two of the types they
have run on (the others predicted by the policy), and the goodput policy is timed next to the
Sia baseline (its configurations capped at the node counts its profiles cover).

    python benchmarks/policy_speed.py [--models DIR] [--typed-models DIR] [--rounds 30] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from pollux_local.core.fitting import fit_points
from pollux_local.core.goodput import GoodputModel
from pollux_local.core.policy import GoodputPolicy
from pollux_local.core.pool import Point, Times
from pollux_local.core.throughput import fit_throughput
from pollux_local.core.types import GoodputModelLike, GradStats, JobView, NodeView, Policy
from pollux_local.sim.profiles import AppProfile, load_profiles, packed_counts

DEFAULT_MODELS = Path(__file__).resolve().parents[2] / "shared/data/pollux-artifact/models"
DEFAULT_TYPED_MODELS = Path(__file__).resolve().parents[2] / "shared/data/sia-artifact/models"
#: Application mix of Sia's philly workloads (jobs per 160).
TYPED_MIX = {"cifar10": 126, "deepspeech2": 15, "bert": 9, "yolov3": 7, "imagenet": 3}
#: Nodes each type's profiles cover (Sia caps its configurations there).
PROFILED_NODES = {"aws": 16, "dgx-ext": 2, "rtx": 3}
#: Application mix of the published workloads (jobs per 160).
APP_MIX = {"cifar10": 66, "ncf": 68, "deepspeech2": 12, "bert": 7, "imagenet": 4, "yolov3": 3}


def profile_points(
    profile: AppProfile, max_replicas: int, devices_per_node: int, rng: np.random.Generator
) -> dict[Point, Times]:
    """(nodes, replicas, m) -> (compute_s, step_s) a job has observed up to ``max_replicas``."""
    points: dict[Point, Times] = {}
    k = 1
    while k <= max_replicas:
        counts = packed_counts(k, devices_per_node)
        for m in np.unique(np.geomspace(profile.min_local, profile.max_local, 3).astype(int)):
            step, sync = profile.step_sync_time(counts, int(m))
            noise = rng.lognormal(0.0, 0.03, size=2)
            compute = float(max(step - sync, 1e-4) * noise[0])
            points[(len(counts), k, int(m))] = (compute, float(max(step * noise[1], compute)))
        k *= 2
    return points


def make_jobs(
    profiles: dict[str, AppProfile],
    count: int,
    devices_per_node: int,
    rng: np.random.Generator,
) -> list[JobView]:
    names = list(APP_MIX)
    weights = np.array([APP_MIX[n] for n in names], dtype=float)
    weights /= weights.sum()
    jobs: list[JobView] = []
    for i in range(count):
        app = names[int(rng.choice(len(names), p=weights))]
        profile = profiles[app]
        max_profiled = int(rng.choice([1, 2, 4, 8, 16]))
        if app == "ncf":
            max_profiled = 1
        fitted = fit_points(profile_points(profile, max_profiled, devices_per_node, rng))
        epoch = int(rng.integers(0, profile.epochs))
        sqr, var = profile.grad_stats(profile.base_batch, epoch)
        bounds = profile.bounds
        if app == "ncf":
            bounds = replace(bounds, base_batch=bounds.max_batch)
        model = GoodputModel(
            params=fitted.params,
            stats=GradStats(sqr=sqr, var=var),
            bounds=bounds,
            correction=fitted.correction,
        )
        jobs.append(
            JobView(
                id=f"{app}-{i}",
                owner=f"user{i % max(1, count // 6)}",
                model=model,
                age_s=float(rng.uniform(60, 20000)),
                max_profiled_replicas=max_profiled,
                max_replicas=1 if app == "ncf" else 1 << 30,
                attained_gpu_s=float(rng.uniform(0, 50000)),
            )
        )
    return jobs


def with_new_stats(job: JobView, rng: np.random.Generator) -> JobView:
    """The job with new gradient statistics in each of its models (as a report brings)."""

    def renewed(model: GoodputModelLike | None) -> GoodputModelLike | None:
        if not isinstance(model, GoodputModel):
            return model
        stats = GradStats(sqr=model.stats.sqr, var=model.stats.var * float(rng.lognormal(0, 0.05)))
        return replace(model, stats=stats)

    by_type = job.models_by_type
    if by_type is not None:
        by_type = {t: m for t, m in ((t, renewed(m)) for t, m in by_type.items()) if m is not None}
    return replace(job, model=renewed(job.model), models_by_type=by_type)


def time_decisions(
    jobs: list[JobView],
    nodes: list[NodeView],
    rounds: int,
    seed: int,
    policy: Policy | None = None,
    new_stats: bool = False,
) -> tuple[list[float], float]:
    """Milliseconds per decision over ``rounds`` consecutive rounds; restarts per round.
    ``new_stats``: every job's models get new gradient statistics before each round (what
    the policy remembered of them no longer applies; their throughput fits still do)."""
    policy = policy or GoodputPolicy()
    rng = np.random.default_rng(seed)
    drift = np.random.default_rng(seed + 1)
    times: list[float] = []
    changes = 0
    for r in range(rounds + 1):
        if new_stats:
            jobs = [with_new_stats(j, drift) for j in jobs]
        start = time.perf_counter()
        decision = policy.decide(jobs, nodes, now=60.0 * r, rng=rng)
        elapsed = (time.perf_counter() - start) * 1e3
        if r > 0:  # the first decision places everything from scratch; time the steady state
            times.append(elapsed)
            changes += sum(
                1 for j in jobs if j.replicas > 0 and decision.placements[j.id] != j.placement
            )
        jobs = [
            replace(
                j,
                placement=decision.placements[j.id],
                age_s=j.age_s + 60.0,
                attained_gpu_s=j.attained_gpu_s + 60.0 * sum(decision.placements[j.id]),
                restarts=j.restarts
                + int(j.replicas > 0 and decision.placements[j.id] != j.placement),
            )
            for j in jobs
        ]
    return times, changes / max(rounds, 1)


def make_typed_jobs(
    profiles: dict[str, dict[str, AppProfile]],
    groups: list[tuple[str, int, int]],
    count: int,
    rng: np.random.Generator,
) -> list[JobView]:
    """Jobs with a fitted model on one or two device types (where they have run)."""
    names = list(TYPED_MIX)
    weights = np.array([TYPED_MIX[n] for n in names], dtype=float)
    weights /= weights.sum()
    types = [t for t, _, _ in groups]
    per_node = {t: k for t, _, k in groups}
    jobs: list[JobView] = []
    for i in range(count):
        app = names[int(rng.choice(len(names), p=weights))]
        ran = list(rng.choice(types, size=int(rng.integers(1, 3)), replace=False))
        max_profiled = int(rng.choice([1, 2, 4, 8, 16]))
        by_type = {}
        for device_type in ran:
            profile = profiles[app][device_type]
            points = profile_points(profile, max_profiled, per_node[device_type], rng)
            fitted = fit_points(points)
            epoch = int(rng.integers(0, profile.epochs))
            sqr, var = profile.grad_stats(profile.base_batch, epoch)
            by_type[device_type] = GoodputModel(
                params=fitted.params,
                stats=GradStats(sqr=sqr, var=var),
                bounds=profile.bounds,
                correction=fitted.correction,
            )
        jobs.append(
            JobView(
                id=f"{app}-{i}",
                owner=f"user{i % max(1, count // 6)}",
                model=None,
                age_s=float(rng.uniform(60, 20000)),
                max_profiled_replicas=max_profiled,
                attained_gpu_s=float(rng.uniform(0, 50000)),
                static_batch=profiles[app][types[0]].max_batch // 4,
                max_replicas=profiles[app][types[0]].max_batch // profiles[app][types[0]].min_local,
                models_by_type=by_type,
                type_rates={t: profiles[app][t].single_device_rate for t in types},
                progress_fraction=float(rng.uniform(0.01, 0.9)),
                run_time_s=float(rng.uniform(60, 10000)),
            )
        )
    return jobs


def typed_nodes(groups: list[tuple[str, int, int]]) -> list[NodeView]:
    return [NodeView(f"{t}-{i}", k, device_type=t) for t, n, k in groups for i in range(n)]


def time_typed(typed_models: Path, rounds: int, seed: int) -> dict[str, dict[str, float | int]]:
    """Decision times of the goodput policy and of Sia on typed clusters (64, 1,024 GPUs)."""
    from pollux_local.core.sia import SiaPolicy
    from pollux_local.sim.profiles import load_typed_profiles

    base = [("aws", 6, 4), ("dgx-ext", 2, 8), ("rtx", 3, 8)]
    profiles = load_typed_profiles(typed_models, [t for t, _, _ in base], set(TYPED_MIX))
    rng = np.random.default_rng(seed)
    out: dict[str, dict[str, float | int]] = {}
    for label, scale, n_jobs, n_rounds in (
        ("typed 64 GPUs (aws 6x4, dgx-ext 2x8, rtx 3x8), 30 jobs", 1, 30, rounds),
        ("typed 1024 GPUs (the same x16), 300 jobs", 16, 300, max(5, rounds // 3)),
    ):
        groups = [(t, n * scale, k) for t, n, k in base]
        nodes = typed_nodes(groups)
        jobs = make_typed_jobs(profiles, groups, n_jobs, rng)
        for name, policy, new_stats in (
            ("goodput", GoodputPolicy(), False),
            ("goodput, new gradient statistics every round", GoodputPolicy(), True),
            ("sia", SiaPolicy(max_nodes_by_type=PROFILED_NODES), False),
        ):
            times, changes = time_decisions(jobs, nodes, n_rounds, seed, policy, new_stats)
            out[f"{label}: {name}"] = {
                **summary(times),
                "rounds": n_rounds,
                "changes_per_round": changes,
            }
    return out


def time_fit(profile: AppProfile, repeats: int, rng: np.random.Generator) -> list[float]:
    """Milliseconds per fit of 15 observed configurations of ``profile``."""
    configs = [(1, 1), (1, 2), (1, 4), (2, 8), (4, 16)]
    rows = []
    for n, k in configs:
        counts = packed_counts(k, 4) if n > 1 else (k,)
        for m in np.geomspace(profile.min_local, profile.max_local, 3).astype(int):
            step, sync = profile.step_sync_time(counts, int(m))
            rows.append((len(counts), k, int(m), step - sync, step))
    arr = np.array(rows, dtype=float)
    assert len(arr) == 15
    times = []
    for _ in range(repeats):
        noisy = arr.copy()
        noisy[:, 3:] *= rng.lognormal(0.0, 0.02, size=(len(arr), 2))
        noisy[:, 4] = np.maximum(noisy[:, 4], noisy[:, 3])
        # The raw parametric fit on purpose: this figure is the optimiser's cost alone
        # (``fit_points`` adds building the points and the residual correction).
        start = time.perf_counter()
        fit_throughput(*(noisy[:, i] for i in range(5)))
        times.append((time.perf_counter() - start) * 1e3)
    return times


def summary(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    p95 = ordered[min(len(ordered) - 1, int(round(0.95 * (len(ordered) - 1))))]
    return {"median_ms": statistics.median(ordered), "p95_ms": p95, "max_ms": ordered[-1]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", type=Path, default=DEFAULT_MODELS)
    parser.add_argument("--typed-models", type=Path, default=DEFAULT_TYPED_MODELS)
    parser.add_argument(
        "--no-typed", dest="typed", action="store_false", help="skip the typed clusters"
    )
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    profiles = load_profiles(args.models, set(APP_MIX))
    rng = np.random.default_rng(args.seed)
    results: dict[str, object] = {}
    for label, n_nodes, n_jobs, rounds in (
        ("64 GPUs (16x4), 30 jobs", 16, 30, args.rounds),
        ("1024 GPUs (256x4), 300 jobs", 256, 300, max(5, args.rounds // 3)),
    ):
        nodes = [NodeView(f"node{i}", 4) for i in range(n_nodes)]
        jobs = make_jobs(profiles, n_jobs, 4, rng)
        times, restarts = time_decisions(jobs, nodes, rounds, args.seed)
        results[label] = {**summary(times), "rounds": rounds, "changes_per_round": restarts}
    if args.typed:
        results.update(time_typed(args.typed_models, args.rounds, args.seed))
    results["fit_throughput, 15 points (cifar10)"] = summary(time_fit(profiles["cifar10"], 30, rng))
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        for label, row in results.items():
            assert isinstance(row, dict)
            extra = (
                f"  changes/round {row['changes_per_round']:.2f}"
                if "changes_per_round" in row
                else ""
            )
            print(
                f"{label:80s} median {row['median_ms']:8.2f} ms  p95 {row['p95_ms']:8.2f} ms"
                f"  max {row['max_ms']:8.2f} ms{extra}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
