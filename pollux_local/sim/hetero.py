"""Simulation of a cluster with several device types (``pollux-local simulate --cluster``).

The cluster is groups of identical nodes, ``type:NxK`` each (N nodes of K devices of type
``type``); a job's true step times on a type come from that type's measured profiles
(``placements-<type>.csv``, ``scalability-<type>.csv``).  The semantics follow Sia's simulator
(``docs/heterogeneous.md``), so that its published figures can be reproduced:

* decisions at t = interval, 2 interval, ...; a job is seen once submitted; a job that finished
  frees its devices at the next decision;
* a job's replicas are all of one type: a placement spanning types is cut down to the type
  holding most of its devices (the others stay idle that round);
* a change of type or of shape (devices per node), a start after waiting included, costs the
  application's restore delay (no progress, devices held) and counts as a restart except at
  the first start; the same shape on other nodes of the same type costs nothing;
* progress rate = gain(M) / T_iter / slowdown(app) with the true gradient statistics; an epoch
  ends when progress reaches its target (crossing times rounded to whole seconds);
* every chunk of training records one exact (nodes, replicas, micro-batch) -> times point in
  the job's profile of that type, and the job re-chooses its batch after each chunk.

Two job libraries choose the batch: ``goodput`` (this project's: the throughput model fitted
with the measured correction to the points of every job of the application on that type,
``GoodputModel.best_choice`` within the placement's memory) and ``sia`` (Sia's: the job's own
points, the model alone, Pollux's search of :func:`~pollux_local.core.sia.sia_batch_search`).
A heterogeneity-unaware policy (one without a ``type_aware`` attribute set) gets one model per
job across all types, as if the types were one.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from pollux_local.core.correction import TimeCorrection
from pollux_local.core.fitting import fit_points
from pollux_local.core.goodput import GoodputModel
from pollux_local.core.pool import Point, ProfilePool, Times
from pollux_local.core.sia import sia_batch_search
from pollux_local.core.throughput import ThroughputParams
from pollux_local.core.types import (
    BatchBounds,
    GradStats,
    JobView,
    NodeView,
    Placement,
    Policy,
    split_batch,
)
from pollux_local.errors import PolluxError
from pollux_local.sim.profiles import AppProfile
from pollux_local.sim.simulator import ProgressCallback, SimResult
from pollux_local.sim.workload import WorkloadJob

#: Real runs are this much slower than the profiles predict (fitted by Sia's authors to
#: physical runs); divides the true progress rate only.
SLOWDOWN = {
    "cifar10": 1.8,
    "ncf": 1.5,
    "imagenet": 1.2,
    "yolov3": 1.2,
    "bert": 1.2,
    "deepspeech2": 1.2,
}
#: Seconds a (re)start takes before training resumes (checkpoint restore), per application.
RESTORE_DELAY_S = {
    "cifar10": 50.0,
    "deepspeech2": 25.0,
    "bert": 120.0,
    "yolov3": 80.0,
    "imagenet": 250.0,
    "ncf": 15.0,
}
DEFAULT_RESTORE_DELAY_S = 30.0
#: The restart cost a scheduler is told per application (measured on a physical cluster; not
#: the simulator's delays).
RESTART_COST_S = {
    "deepspeech2": 25.0,
    "imagenet": 250.0,
    "cifar10": 30.0,
    "bert": 120.0,
    "yolov3": 45.0,
}
DEFAULT_RESTART_COST_S = 30.0
#: The largest micro-batch a scheduler may plan for an application on a type, where it is
#: below the largest measured (memory).
SCHEDULER_MAX_LOCAL = {("deepspeech2", "rtx"): 57}
#: Tie order when a placement spanning types is cut down to one (earlier wins).
TYPE_RANK = ("dgx-ext", "dgx", "azure", "quad", "rtx", "aws")

_GROUP = re.compile(r"^([A-Za-z0-9][A-Za-z0-9_.-]*):(\d+)x(\d+)$")


@dataclass(frozen=True)
class NodeGroup:
    """``nodes`` identical nodes of ``devices_per_node`` devices of type ``device_type``."""

    device_type: str
    nodes: int
    devices_per_node: int


def parse_cluster(text: str) -> tuple[NodeGroup, ...]:
    """``type:NxK[,type:NxK...]`` -> node groups, in the order given (the cluster order)."""
    groups: list[NodeGroup] = []
    seen: set[str] = set()
    for part in text.split(","):
        part = part.strip()
        match = _GROUP.match(part)
        if match is None:
            raise PolluxError(
                f"bad cluster group {part!r}: expected TYPE:NODESxDEVICES, e.g. aws:6x4"
            )
        name, nodes, per_node = match.group(1), int(match.group(2)), int(match.group(3))
        if nodes < 1 or per_node < 1:
            raise PolluxError(f"bad cluster group {part!r}: nodes and devices must be >= 1")
        if per_node > 9:
            raise PolluxError(
                f"bad cluster group {part!r}: at most 9 devices per node (profiles' placements)"
            )
        if name in seen:
            raise PolluxError(f"bad cluster: device type {name!r} given twice")
        seen.add(name)
        groups.append(NodeGroup(name, nodes, per_node))
    return tuple(groups)


def format_cluster(groups: Sequence[NodeGroup]) -> str:
    return ",".join(f"{g.device_type}:{g.nodes}x{g.devices_per_node}" for g in groups)


@dataclass
class HeteroConfig:
    """Cluster and timing of a heterogeneous simulation.

    ``job_library`` (``goodput`` or ``sia``) and ``share_profiles`` default by policy: Sia's
    jobs choose their batch as Sia's do, from their own points; every other policy's jobs use
    this project's library with the points of every job of the application pooled.
    """

    cluster: tuple[NodeGroup, ...]
    interval_s: float = 60.0
    seed: int = 0
    job_library: str | None = None
    share_profiles: bool | None = None
    correct_times: bool = True
    max_time_s: float = 30 * 24 * 3600.0

    def validate(self) -> None:
        if not self.cluster:
            raise PolluxError("impossible cluster: no node groups")
        if not self.interval_s > 0:
            raise PolluxError(f"scheduling interval must be positive, got {self.interval_s}")
        if self.job_library not in (None, "goodput", "sia"):
            raise PolluxError(f"unknown job library {self.job_library!r} (goodput or sia)")

    @property
    def total_devices(self) -> int:
        return sum(g.nodes * g.devices_per_node for g in self.cluster)


@dataclass
class _FitCache:
    params: ThroughputParams
    correction: TimeCorrection | None


@dataclass
class HeteroJob:
    """The simulator's state of one job."""

    spec: WorkloadJob
    apps: dict[str, AppProfile]
    device_type: str | None = None
    placement: Placement = ()
    shape: tuple[int, ...] = ()
    local_batch: int = 0
    accum_steps: int = 1
    restore_left_s: float = 0.0
    starts: int = 0
    progress: float = 0.0
    epoch: int = 0
    attained_gpu_s: float = 0.0
    run_time_s: float = 0.0
    completion_s: float | None = None
    profiles: dict[str, dict[Point, Times]] = field(default_factory=dict)
    grad: tuple[float, float] | None = None
    device_seconds: dict[str, float] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def app_name(self) -> str:
        return self.spec.application

    @property
    def reference(self) -> AppProfile:
        """The profile supplying type-independent facts (epochs, gradient statistics)."""
        return next(iter(self.apps.values()))

    @property
    def replicas(self) -> int:
        return int(sum(self.placement))

    @property
    def restarts(self) -> int:
        return max(self.starts - 1, 0)


class HeteroSimulator:
    """Drives one policy through one workload on a cluster of several device types."""

    def __init__(
        self,
        workload: Sequence[WorkloadJob],
        profiles: dict[str, dict[str, AppProfile]],
        policy: Policy,
        config: HeteroConfig,
    ) -> None:
        config.validate()
        self.config = config
        self.policy = policy
        sia_style = policy.name == "sia"
        self.job_library = config.job_library or ("sia" if sia_style else "goodput")
        self.share_profiles = (
            (not sia_style) if config.share_profiles is None else config.share_profiles
        )
        self.type_aware = bool(getattr(policy, "type_aware", False)) or sia_style
        self.types = [g.device_type for g in config.cluster]
        self.nodes: list[NodeView] = []
        self.node_type: list[str] = []
        for group in config.cluster:
            for i in range(group.nodes):
                self.nodes.append(
                    NodeView(
                        name=f"{group.device_type}-{i}",
                        devices=group.devices_per_node,
                        device_type=group.device_type,
                    )
                )
                self.node_type.append(group.device_type)
        self.jobs: list[HeteroJob] = []
        for spec in workload:
            per_type = profiles.get(spec.application)
            if per_type is None:
                raise PolluxError(
                    f"job {spec.name}: unknown application {spec.application!r}"
                    f" (known: {', '.join(sorted(profiles))})"
                )
            missing = [t for t in self.types if t not in per_type]
            if missing:
                raise PolluxError(
                    f"job {spec.name}: no profile of {spec.application} on {', '.join(missing)}"
                )
            self.jobs.append(HeteroJob(spec=spec, apps={t: per_type[t] for t in self.types}))
        self.rng = np.random.default_rng(config.seed)
        self.pool = ProfilePool()
        self.now = 0.0
        self._fits: dict[tuple[object, ...], _FitCache] = {}

    # ----------------------------------------------------------------- models
    def _profile_key(self, device_type: str) -> str:
        """The key a job's points on ``device_type`` are kept under ('' when unaware)."""
        return device_type if self.type_aware else ""

    def _kind(self, job: HeteroJob, key: str) -> str:
        return f"{job.app_name}@{key}"

    def _bounds(self, job: HeteroJob, device_type: str | None) -> BatchBounds:
        """Batch bounds a scheduler plans with on a type (unaware: the smallest memory)."""
        types = [device_type] if device_type else self.types
        largest = min(
            SCHEDULER_MAX_LOCAL.get((job.app_name, t), job.apps[t].max_local) for t in types
        )
        ref = job.reference
        return BatchBounds(
            base_batch=ref.base_batch,
            max_batch=ref.max_batch,
            min_local=min(job.apps[t].min_local for t in types),
            max_local=max(largest, min(job.apps[t].min_local for t in types)),
            accumulation=True,
        )

    def _grad(self, job: HeteroJob) -> tuple[float, float] | None:
        if job.grad is not None or not self.share_profiles:
            return job.grad
        start = self.pool.start_stats(job.app_name)
        return None if start is None else (start.sqr, start.var)

    def _points(self, job: HeteroJob, key: str) -> dict[Point, Times]:
        own = job.profiles.get(key, {})
        if self.share_profiles:
            return self.pool.points_for(self._kind(job, key), own)
        return dict(own)

    def _fit(self, job: HeteroJob, key: str) -> _FitCache | None:
        """The throughput fit of the job's points on a type (cached by content)."""
        points = self._points(job, key)
        if not points:
            return None
        correct = self.config.correct_times and self.job_library == "goodput"
        owner: object = self._kind(job, key) if self.share_profiles else job.name
        cache_key = (owner, key, correct, frozenset(points))
        hit = self._fits.get(cache_key)
        if hit is None:
            ordered = dict(sorted(points.items()))
            fitted = fit_points(ordered, correct=correct)
            hit = _FitCache(fitted.params, fitted.correction)
            self._fits[cache_key] = hit
        return hit

    def _model(self, job: HeteroJob, key: str) -> GoodputModel | None:
        grad = self._grad(job)
        fit = self._fit(job, key)
        if grad is None or fit is None:
            return None
        sqr, var = grad
        return GoodputModel(
            fit.params, GradStats(sqr=sqr, var=var), self._bounds(job, key or None), fit.correction
        )

    def _models_by_type(self, job: HeteroJob) -> dict[str, GoodputModel]:
        models: dict[str, GoodputModel] = {}
        for device_type in self.types:
            model = self._model(job, device_type)
            if model is not None:
                models[device_type] = model
        return models

    # ----------------------------------------------------------------- batch choice
    def _choose_batch(self, job: HeteroJob) -> None:
        """Set (m, s) for the job's current placement, as its job library would."""
        device_type = job.device_type
        assert device_type is not None
        app = job.apps[device_type]
        counts = job.shape
        n, k = len(counts), job.replicas
        ref = job.reference
        memory = app.max_local_for(counts)
        fixed = app.fixed_batch
        if self.job_library == "sia":
            grad = job.grad
            fit = self._fit(job, self._profile_key(device_type))
            if fixed is not None:
                local, accum = self._split_sia(fixed, k, memory, ref.base_batch)
            elif fit is None or grad is None:
                total = max(ref.base_batch, app.min_local * k)
                local, accum = self._split_sia(total, k, memory, ref.base_batch)
            else:
                _, m, a = sia_batch_search(
                    fit.params,
                    GradStats(sqr=grad[0], var=grad[1]),
                    ref.base_batch,
                    [n],
                    [k],
                    ref.max_batch,
                    (app.min_local, memory),
                )
                local, accum = int(m[0]), int(a[0])
            per_size = app.max_local_for_replicas(k)
            if per_size is not None:
                local = min(local, per_size)
            local = max(1, min(local, int(ref.max_batch / (k * (accum + 1)))))
            job.local_batch, job.accum_steps = local, accum + 1
            return
        bounds = replace(
            self._bounds(job, device_type),
            max_local=max(
                min(memory, SCHEDULER_MAX_LOCAL.get((job.app_name, device_type), memory)),
                app.min_local,
            ),
            min_local=app.min_local,
        )
        if fixed is not None:
            choice = split_batch(fixed, k, bounds)
        else:
            model = self._model(job, self._profile_key(device_type))
            if model is None:
                choice = split_batch(max(bounds.base_batch, bounds.min_local * k), k, bounds)
            else:
                choice = replace(model, bounds=bounds).best_choice(n, k)
        per_size = app.max_local_for_replicas(k)
        local = choice.local_batch if per_size is None else min(choice.local_batch, per_size)
        job.local_batch, job.accum_steps = int(local), int(choice.accum_steps)

    @staticmethod
    def _split_sia(total: float, k: int, memory: int, base_batch: int) -> tuple[int, int]:
        """A user-given total batch on k replicas, Sia's way: (micro-batch, extra steps)."""
        per_replica = math.ceil(total / k - 1e-8)
        accum = math.ceil(per_replica / memory - 1e-8) - 1
        if k == 1 and total > base_batch:
            accum = max(1, accum)
        return math.ceil(per_replica / (accum + 1) - 1e-8), accum

    # ----------------------------------------------------------------- progress
    def _advance(self, job: HeteroJob, seconds: float) -> None:
        """Run ``job`` for ``seconds`` of simulated time from ``self.now``."""
        k = job.replicas
        if k == 0 or job.completion_s is not None or job.device_type is None:
            return
        device_type = job.device_type
        job.device_seconds[device_type] = job.device_seconds.get(device_type, 0.0) + seconds * k
        clock = self.now
        delay = min(job.restore_left_s, seconds)
        job.restore_left_s -= delay
        job.attained_gpu_s += delay * k
        clock += delay
        left = seconds - delay
        app = job.apps[device_type]
        ref = job.reference
        counts = job.shape
        key = self._profile_key(device_type)
        slowdown = SLOWDOWN.get(job.app_name, 1.0)
        while left > 1e-9:
            m, s = job.local_batch, job.accum_steps
            batch = k * m * s
            step, sync = app.step_sync_time(counts, m)
            iter_time = (s - 1) * (step - sync) + step
            sqr, var = ref.grad_stats(batch, job.epoch)
            scale = batch / ref.base_batch
            gain = (var + sqr) / (var / scale + sqr)
            point = (len(counts), k, m)
            profile = job.profiles.setdefault(key, {})
            if point not in profile:
                profile[point] = (max(step - sync, 1e-9), step)
            job.grad = (sqr, var)
            if job.epoch == 0 and self.share_profiles:
                self.pool.add(job.app_name, {}, GradStats(sqr=sqr, var=var), first_epoch=True)
            rate = gain / iter_time / slowdown
            target = ref.epoch_target[job.epoch + 1]
            if job.progress + rate * left < target:
                job.progress += rate * left
                used = left
            else:
                used = min(float(round((target - job.progress) / rate)), left)
                job.progress = float(target)
                job.epoch += 1
            job.attained_gpu_s += used * k
            job.run_time_s += used
            clock += used
            left -= used
            if job.epoch >= ref.epochs:
                job.completion_s = clock
                break
            if self.share_profiles:
                self.pool.add(self._kind(job, key), {point: profile[point]})
            self._choose_batch(job)
        if self.share_profiles and job.profiles.get(key):
            self.pool.add(self._kind(job, key), job.profiles[key])

    # ----------------------------------------------------------------- decisions
    def _max_replicas(self, job: HeteroJob) -> int:
        ref = job.reference
        if ref.fixed_batch is not None:
            return 1
        smallest = min(job.apps[t].min_local for t in self.types)
        return max(1, min(self.config.total_devices, ref.max_batch // smallest))

    def _view(self, job: HeteroJob) -> JobView:
        ref = job.reference
        if self.type_aware:
            models = self._models_by_type(job)
            model = models.get(job.device_type) if job.device_type else None
            by_type: dict[str, GoodputModel] | None = models
        else:
            model = self._model(job, "")
            by_type = None
        own = [p[1] for points in job.profiles.values() for p in points]
        return JobView(
            id=job.name,
            model=model,
            age_s=self.now - job.spec.time,
            restarts=job.restarts,
            min_replicas=1,
            max_replicas=self._max_replicas(job),
            placement=job.placement or (0,) * len(self.nodes),
            submit_time=job.spec.time,
            max_profiled_replicas=max(own, default=0),
            static_replicas=job.spec.num_replicas,
            static_batch=job.spec.batch_size,
            attained_gpu_s=job.attained_gpu_s,
            run_time_s=job.run_time_s,
            progress_fraction=min(job.progress / float(ref.epoch_target[-1]), 1.0),
            models_by_type=by_type,
            type_rates={t: job.apps[t].single_device_rate for t in self.types},
            restart_cost_s=RESTART_COST_S.get(job.app_name, DEFAULT_RESTART_COST_S),
            restoring=job.restore_left_s > 0,
        )

    def _one_type(self, job: HeteroJob, placement: Placement) -> Placement:
        """The placement cut down to the type holding most of its devices."""
        held: dict[str, int] = {}
        for i, c in enumerate(placement):
            if c > 0:
                held[self.node_type[i]] = held.get(self.node_type[i], 0) + c
        if len(held) <= 1:
            return placement

        def rank(t: str) -> tuple[int, int]:
            order = TYPE_RANK.index(t) if t in TYPE_RANK else len(TYPE_RANK)
            return (-held[t], order)

        keep = min(held, key=rank)
        return tuple(c if self.node_type[i] == keep else 0 for i, c in enumerate(placement))

    def _apply(self, job: HeteroJob, placement: Placement) -> None:
        new = tuple(int(c) for c in placement) if sum(placement) > 0 else ()
        if new:
            new = self._one_type(job, new)
        if not new:
            if job.placement:
                job.placement, job.shape, job.device_type = (), (), None
                job.restore_left_s = 0.0
            return
        device_type = next(self.node_type[i] for i, c in enumerate(new) if c > 0)
        shape = tuple(sorted((c for c in new if c > 0), reverse=True))
        if job.placement and device_type == job.device_type and shape == job.shape:
            job.placement = new  # other nodes of the same shape: no restart
            return
        job.placement, job.shape, job.device_type = new, shape, device_type
        job.starts += 1
        job.restore_left_s = RESTORE_DELAY_S.get(job.app_name, DEFAULT_RESTORE_DELAY_S)
        self._choose_batch(job)

    def _check(self, placements: dict[str, Placement], names: set[str]) -> None:
        unknown = set(placements) - names
        if unknown:
            raise RuntimeError(f"policy {self.policy.name} placed unknown jobs {sorted(unknown)}")
        used = np.zeros(len(self.nodes), dtype=int)
        for name, placement in placements.items():
            if sum(placement) == 0:
                continue
            if len(placement) != len(self.nodes) or min(placement) < 0:
                raise RuntimeError(
                    f"policy {self.policy.name}: bad placement {placement} for {name}"
                )
            used += np.asarray(placement, dtype=int)
        capacity = np.array([n.devices for n in self.nodes])
        if (used > capacity).any():
            raise RuntimeError(f"policy {self.policy.name} over-committed nodes: {used.tolist()}")

    # ----------------------------------------------------------------- main loop
    def run(self, on_round: ProgressCallback | None = None) -> SimResult:
        """Simulate until every job completes (or ``max_time_s``)."""
        start = time.perf_counter()
        decision_ms: list[float] = []
        pending = sorted(self.jobs, key=lambda j: j.spec.time)
        active: list[HeteroJob] = []
        done = 0
        rounds = 0
        interval = self.config.interval_s
        self.now = interval
        while (pending or active) and self.now <= self.config.max_time_s:
            while pending and pending[0].spec.time <= self.now:
                active.append(pending.pop(0))
            if active:
                views = [self._view(job) for job in active]
                tick = time.perf_counter()
                decision = self.policy.decide(views, self.nodes, self.now, self.rng)
                decision_ms.append((time.perf_counter() - tick) * 1000.0)
                placements = {k: tuple(v) for k, v in decision.placements.items()}
                self._check(placements, {j.name for j in active})
                for job in active:
                    self._apply(job, placements.get(job.name, ()))
                for job in active:
                    self._advance(job, interval)
            self.now += interval
            rounds += 1
            finished = [j for j in active if j.completion_s is not None]
            if finished:
                done += len(finished)
                active = [j for j in active if j.completion_s is None]
            if on_round is not None:
                on_round(self.now, done, len(self.jobs))
        return self._result(decision_ms, time.perf_counter() - start, rounds)

    def _result(self, decision_ms: list[float], wall_s: float, rounds: int) -> SimResult:
        complete = [j for j in self.jobs if j.completion_s is not None]
        jct = {j.name: float(j.completion_s - j.spec.time) for j in complete}  # type: ignore[operator]
        first_submit = min(j.spec.time for j in self.jobs)
        makespan = max((j.completion_s or 0.0 for j in complete), default=first_submit)
        return SimResult(
            policy=self.policy.name,
            jobs=len(self.jobs),
            completed=len(complete),
            jct_s=jct,
            restarts={j.name: j.restarts for j in self.jobs},
            finish_time_fairness={},
            makespan_s=float(makespan - first_submit),
            decision_ms=decision_ms,
            wall_s=wall_s,
            rounds=rounds,
        )

    def device_hours_by_type(self) -> dict[str, float]:
        """Device-hours held per type over the run (restores included)."""
        totals = {t: 0.0 for t in self.types}
        for job in self.jobs:
            for t, seconds in job.device_seconds.items():
                totals[t] += seconds / 3600.0
        return totals
