"""Trace-driven cluster simulation: any :class:`~pollux_local.core.types.Policy` against the
measured model profiles.

Every ``interval_s`` seconds the simulator shows the policy every submitted, unfinished job
(``policy.decide(jobs, nodes, now, rng)``, the very call the daemon makes) and applies the
returned placements.  Between decisions each running job advances:

* a job whose placement changed (first start included) makes no progress for
  ``restart_cost_s`` seconds (it still holds its devices);
* then, at its (m, s) on its placement, one iteration takes
  T = (s - 1) * (step - sync) + step (true times, :mod:`pollux_local.sim.profiles`) and
  advances progress by the gain r = M/M0 * EFF(M) computed from the true gradient statistics at
  its batch and epoch, i.e. progress grows at r / T per second;
* when progress reaches the end of its epoch the epoch advances (an adaptive job re-chooses
  its batch) and after the application's last epoch the job completes; an adaptive job also
  re-chooses its batch, without a restart, after a round in which its model gained a point.

Two batch modes: *adaptive* jobs (goodput policies) start at M0 and take the (m, s) that
:meth:`GoodputModel.best_choice` picks from a throughput model refitted (only when a new
(N, K, m) point was observed) from what the job has actually run, with its current true
gradient statistics; *static* jobs (baselines) keep the workload row's tuned total batch.
With ``share_profiles`` (the default) an adaptive job's model is fitted to the points every job
of its application has run (:class:`~pollux_local.core.pool.ProfilePool`), and before its first
round it uses the gradient statistics the application's first job reported in its first epoch.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from pollux_local.core.correction import TimeCorrection
from pollux_local.core.fitting import fit_points
from pollux_local.core.goodput import GoodputModel
from pollux_local.core.pool import ProfilePool
from pollux_local.core.throughput import ThroughputParams
from pollux_local.core.types import (
    BatchChoice,
    GradStats,
    JobView,
    NodeView,
    Placement,
    Policy,
    split_batch,
)
from pollux_local.errors import PolluxError
from pollux_local.sim.profiles import AppProfile, packed_counts
from pollux_local.sim.workload import WorkloadJob

ProgressCallback = Callable[[float, int, int], None]


@dataclass
class SimConfig:
    """Cluster and timing of a simulation."""

    nodes: int = 16
    gpus_per_node: int = 4
    interval_s: float = 60.0
    restart_cost_s: float = 30.0
    seed: int = 0
    #: Fit each adaptive job's model to the points all jobs of its application measured.
    share_profiles: bool = True
    #: Correct each model's times by the residuals at measured points (``fit_points``'s
    #: ``correct``, ``core.correction``).
    correct_times: bool = True
    #: Give up (and report the unfinished jobs) after this much simulated time.
    max_time_s: float = 30 * 24 * 3600.0

    def validate(self) -> None:
        if self.nodes < 1:
            raise PolluxError(f"impossible cluster size: {self.nodes} nodes (need at least 1)")
        if self.gpus_per_node < 1:
            raise PolluxError(
                f"impossible cluster size: {self.gpus_per_node} GPUs per node (need at least 1)"
            )
        if not self.interval_s > 0:
            raise PolluxError(f"scheduling interval must be positive, got {self.interval_s}")
        if not self.restart_cost_s >= 0:
            raise PolluxError(f"restart cost must be >= 0, got {self.restart_cost_s}")

    @property
    def total_gpus(self) -> int:
        return self.nodes * self.gpus_per_node


@dataclass
class SimJob:
    """The simulator's state of one job."""

    spec: WorkloadJob
    app: AppProfile
    adaptive: bool
    placement: Placement = ()
    local_batch: int = 0
    accum_steps: int = 1
    restart_left_s: float = 0.0
    starts: int = 0
    progress: float = 0.0
    epoch: int = 0
    attained_gpu_s: float = 0.0
    run_time_s: float = 0.0
    completion_s: float | None = None
    profile: dict[tuple[int, int, int], tuple[float, float]] = field(default_factory=dict)
    grad: tuple[float, float] | None = None
    params: ThroughputParams | None = None
    correction: TimeCorrection | None = None
    fitted_points: int = 0
    model: GoodputModel | None = None
    model_key: tuple[int, tuple[float, float]] | None = None
    batch_points: int = 0
    active_count_sum: float = 0.0
    active_rounds: int = 0

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def replicas(self) -> int:
        return int(sum(self.placement))

    @property
    def restarts(self) -> int:
        return max(self.starts - 1, 0)

    @property
    def batch(self) -> BatchChoice:
        """The job's current (m, s) on its K replicas."""
        return BatchChoice(
            local_batch=self.local_batch, accum_steps=self.accum_steps, replicas=self.replicas
        )

    def set_batch(self, choice: BatchChoice) -> None:
        self.local_batch, self.accum_steps = int(choice.local_batch), int(choice.accum_steps)

    @property
    def fixed_batch(self) -> int | None:
        """The total batch this job always trains at, or None when it adapts."""
        if not self.adaptive:
            return self.spec.batch_size
        return self.app.fixed_batch


@dataclass
class SimResult:
    """Outcome of a simulation."""

    policy: str
    jobs: int
    completed: int
    jct_s: dict[str, float]
    restarts: dict[str, int]
    finish_time_fairness: dict[str, float]
    makespan_s: float
    decision_ms: list[float]
    wall_s: float
    rounds: int

    def summary(self) -> dict[str, float | int | str | None]:
        """The headline metrics (the ``--json`` object); ``None`` where no job completed."""
        jcts = np.array(list(self.jct_s.values()), dtype=float)
        ftf = np.array(list(self.finish_time_fairness.values()), dtype=float)
        dms = np.array(self.decision_ms, dtype=float)
        return {
            "policy": self.policy,
            "jobs": self.jobs,
            "completed": self.completed,
            "avg_jct_s": float(jcts.mean()) if jcts.size else None,
            "p99_jct_s": float(np.percentile(jcts, 99)) if jcts.size else None,
            "makespan_s": self.makespan_s,
            "restarts_per_job": float(np.mean(list(self.restarts.values())))
            if self.restarts
            else 0.0,
            "max_finish_time_fairness": float(ftf.max()) if ftf.size else None,
            "decision_ms_median": float(np.median(dms)) if dms.size else 0.0,
            "decision_ms_p95": float(np.percentile(dms, 95)) if dms.size else 0.0,
            "rounds": self.rounds,
            "wall_s": self.wall_s,
        }


def _nonzero(placement: Placement) -> tuple[int, ...]:
    return tuple(c for c in placement if c > 0)


class Simulator:
    """Drives one policy through one workload."""

    def __init__(
        self,
        workload: Sequence[WorkloadJob],
        profiles: dict[str, AppProfile],
        policy: Policy,
        config: SimConfig | None = None,
        adaptive: bool | None = None,
    ) -> None:
        self.config = config or SimConfig()
        self.config.validate()
        self.policy = policy
        if adaptive is None:
            adaptive = not getattr(policy, "static_batch", policy.name in STATIC_POLICIES)
        self.adaptive = adaptive
        self.nodes = [
            NodeView(name=f"node{i}", devices=self.config.gpus_per_node)
            for i in range(self.config.nodes)
        ]
        total = self.config.total_gpus
        self.jobs: list[SimJob] = []
        for spec in workload:
            app = profiles.get(spec.application)
            if app is None:
                raise PolluxError(
                    f"job {spec.name}: unknown application {spec.application!r}"
                    f" (known: {', '.join(sorted(profiles))})"
                )
            if not adaptive and spec.num_replicas > total:
                raise PolluxError(
                    f"impossible cluster size: job {spec.name} needs {spec.num_replicas} GPUs"
                    f" but {self.config.nodes} x {self.config.gpus_per_node} = {total}"
                )
            self.jobs.append(SimJob(spec=spec, app=app, adaptive=adaptive))
        self.rng = np.random.default_rng(self.config.seed)
        self.pool = ProfilePool()
        self.now = 0.0
        self._iter_time_cache: dict[tuple[str, int], tuple[float, ...]] = {}

    # ----------------------------------------------------------------- batch configuration
    def _max_replicas(self, job: SimJob) -> int:
        total = self.config.total_gpus
        bounds = job.app.bounds
        if job.fixed_batch is not None:
            if job.adaptive:  # a fixed-batch application held on one device
                return 1
            return max(1, min(total, job.fixed_batch // bounds.min_local))
        return max(1, min(total, bounds.max_batch // bounds.min_local))

    def _choose_batch(self, job: SimJob) -> None:
        """Set (m, s) for the job's current placement."""
        k = job.replicas
        bounds = job.app.bounds
        fixed = job.fixed_batch
        job.batch_points = len(job.profile)
        if fixed is not None:
            job.set_batch(split_batch(fixed, k, bounds))
            return
        model = self._model(job)
        if model is None:
            job.set_batch(split_batch(max(bounds.base_batch, bounds.min_local * k), k, bounds))
            return
        job.set_batch(model.best_choice(len(_nonzero(job.placement)), k))

    def _model(self, job: SimJob) -> GoodputModel | None:
        """The job's goodput model, refitted only when its points (its own, and with
        ``share_profiles`` its application's) gained one."""
        points = job.profile
        grad = job.grad
        if self.config.share_profiles:
            kind = job.app.name
            points = self.pool.points_for(kind, job.profile)
            if grad is None:
                start = self.pool.start_stats(kind)
                grad = None if start is None else (start.sqr, start.var)
        if not points or grad is None:
            return None
        if job.params is None or job.fitted_points != len(points):
            fitted = fit_points(points, correct=self.config.correct_times)
            job.params, job.correction = fitted.params, fitted.correction
            job.fitted_points = fitted.points
            job.model_key = None
        key = (job.fitted_points, grad)
        if job.model_key != key:
            sqr, var = grad
            job.model = GoodputModel(
                job.params, GradStats(sqr=sqr, var=var), job.app.bounds, job.correction
            )
            job.model_key = key
        return job.model

    def _static_iter_times(self, job: SimJob) -> tuple[float, ...]:
        """Oracle seconds per iteration at the job's static batch on 1..max replicas."""
        batch = job.spec.batch_size
        key = (job.app.name, batch)
        hit = self._iter_time_cache.get(key)
        if hit is None:
            times = []
            for k in range(1, self._max_replicas(job) + 1):
                choice = split_batch(batch, k, job.app.bounds)
                counts = packed_counts(k, self.config.gpus_per_node)
                times.append(job.app.iteration_time(counts, choice.local_batch, choice.accum_steps))
            hit = tuple(times)
            self._iter_time_cache[key] = hit
        return hit

    # ----------------------------------------------------------------- progress
    def _advance(self, job: SimJob, seconds: float) -> None:
        """Run ``job`` for ``seconds`` of simulated time from ``self.now``."""
        k = job.replicas
        if k == 0 or job.completion_s is not None:
            return
        clock = self.now
        delay = min(job.restart_left_s, seconds)
        job.restart_left_s -= delay
        job.attained_gpu_s += delay * k
        clock += delay
        left = seconds - delay
        counts = _nonzero(job.placement)
        app = job.app
        while left > 1e-9:
            m, s, batch = job.local_batch, job.accum_steps, job.batch.total_batch
            step, sync = app.step_sync_time(counts, m)
            iter_time = (s - 1) * (step - sync) + step
            sqr, var = app.grad_stats(batch, job.epoch)
            gain = (var + sqr) / (var * app.base_batch / batch + sqr)
            point = (len(counts), k, m)
            if point not in job.profile:
                job.profile[point] = (max(step - sync, 1e-9), step)
            job.grad = (sqr, var)
            if job.epoch == 0 and job.adaptive and self.config.share_profiles:
                self.pool.add(app.name, {}, GradStats(sqr=sqr, var=var), first_epoch=True)
            rate = gain / iter_time
            target = app.epoch_target[job.epoch + 1]
            crossed = job.progress + rate * left >= target
            if crossed:
                used = (target - job.progress) / rate
                job.progress = float(target)
                job.epoch += 1
            else:
                job.progress += rate * left
                used = left
            job.attained_gpu_s += used * k
            job.run_time_s += used
            clock += used
            left -= used
            if job.epoch >= app.epochs:
                job.completion_s = clock
                break
            if crossed and job.adaptive:
                self._choose_batch(job)  # re-decide the batch at each epoch boundary
        if job.adaptive and self.config.share_profiles:
            self.pool.add(job.app.name, job.profile)
        if job.adaptive and job.completion_s is None and job.batch_points != len(job.profile):
            self._choose_batch(job)  # the model gained a point: re-decide without a restart

    # ----------------------------------------------------------------- decisions
    def _view(self, job: SimJob) -> JobView:
        adaptive = job.adaptive
        remaining = None
        iter_times: tuple[float, ...] = ()
        if not adaptive:
            batch = job.spec.batch_size
            remaining = max(
                job.app.iterations_after(batch, job.app.epochs)
                - job.app.iterations_after(batch, job.epoch),
                1.0,
            )
            iter_times = self._static_iter_times(job)
        return JobView(
            id=job.name,
            model=self._model(job) if adaptive else None,
            age_s=self.now - job.spec.time,
            restarts=job.restarts,
            min_replicas=1,
            max_replicas=self._max_replicas(job),
            placement=job.placement or (0,) * len(self.nodes),
            submit_time=job.spec.time,
            max_profiled_replicas=max((p[1] for p in job.profile), default=0),
            static_replicas=job.spec.num_replicas,
            static_batch=job.spec.batch_size,
            attained_gpu_s=job.attained_gpu_s,
            remaining_iters=remaining,
            run_time_s=job.run_time_s,
            static_iter_time_s=iter_times,
            progress_fraction=min(job.progress / float(job.app.epoch_target[-1]), 1.0),
        )

    def _apply(self, job: SimJob, placement: Placement) -> None:
        new = tuple(int(c) for c in placement) if sum(placement) > 0 else ()
        if new == job.placement:
            return
        job.placement = new
        if not new:
            job.restart_left_s = 0.0
            return
        job.starts += 1
        job.restart_left_s = self.config.restart_cost_s
        self._choose_batch(job)

    def _check(self, placements: dict[str, Placement], active: list[SimJob]) -> None:
        names = {j.name for j in active}
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
        if (used > self.config.gpus_per_node).any():
            raise RuntimeError(f"policy {self.policy.name} over-committed nodes: {used.tolist()}")

    # ----------------------------------------------------------------- main loop
    def run(self, on_round: ProgressCallback | None = None) -> SimResult:
        """Simulate until every job completes (or ``max_time_s``)."""
        start = time.perf_counter()
        decision_ms: list[float] = []
        pending = sorted(self.jobs, key=lambda j: j.spec.time)
        active: list[SimJob] = []
        done = 0
        rounds = 0
        interval = self.config.interval_s
        while (pending or active) and self.now <= self.config.max_time_s:
            while pending and pending[0].spec.time <= self.now:
                active.append(pending.pop(0))
            if active:
                for job in active:
                    job.active_count_sum += len(active)
                    job.active_rounds += 1
                views = [self._view(job) for job in active]
                tick = time.perf_counter()
                decision = self.policy.decide(views, self.nodes, self.now, self.rng)
                decision_ms.append((time.perf_counter() - tick) * 1000.0)
                placements = {k: tuple(v) for k, v in decision.placements.items()}
                self._check(placements, active)
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
        fairness = {j.name: jct[j.name] / self.isolated_jct(j) for j in complete}
        first_submit = min(j.spec.time for j in self.jobs)
        makespan = max((j.completion_s or 0.0 for j in complete), default=first_submit)
        return SimResult(
            policy=self.policy.name,
            jobs=len(self.jobs),
            completed=len(complete),
            jct_s=jct,
            restarts={j.name: j.restarts for j in self.jobs},
            finish_time_fairness=fairness,
            makespan_s=float(makespan - first_submit),
            decision_ms=decision_ms,
            wall_s=wall_s,
            rounds=rounds,
        )

    # ----------------------------------------------------------------- fairness
    def isolated_jct(self, job: SimJob) -> float:
        """JCT of ``job`` alone on an equal share of the cluster (finish-time fairness' base).

        The share is G/n devices, n the mean number of active jobs over the job's life (at
        least 1).  On that share (packed, at most the job's device limit) the job trains at the
        best validated batch for each epoch (or its fixed batch) with no queueing and one
        restart; a share below one device time-slices one device.
        """
        n = job.active_count_sum / job.active_rounds if job.active_rounds else 1.0
        share = self.config.total_gpus / max(n, 1.0)
        k = max(1, min(int(share), self._max_replicas(job)))
        slow = 1.0 / share if share < 1.0 else 1.0
        counts = packed_counts(k, self.config.gpus_per_node)
        app = job.app
        bounds = app.bounds
        if job.fixed_batch is not None:
            batches = [job.fixed_batch]
        else:
            batches = [
                int(b)
                for b in app.validated_batches
                if bounds.base_batch <= b <= bounds.max_batch and b >= k * bounds.min_local
            ] or [max(bounds.base_batch, k * bounds.min_local)]
        rates = []
        for batch in batches:
            choice = split_batch(batch, k, bounds)
            total = choice.total_batch
            iter_time = app.iteration_time(counts, choice.local_batch, choice.accum_steps)
            rates.append([app.gain(total, e) / iter_time for e in range(app.epochs)])
        best = np.max(np.asarray(rates), axis=0)
        work = np.diff(app.epoch_target)
        return float(np.sum(work / best)) * slow + self.config.restart_cost_s


#: Policy names whose jobs keep the workload's tuned static batch.
STATIC_POLICIES = frozenset({"fifo", "tiresias", "optimus"})
