"""Trace-driven simulation: any :class:`~pollux_local.core.types.Policy` on a simulated
cluster (untyped, or of several device types), against the measured model profiles.

Every ``interval_s`` seconds the simulator builds a :class:`~pollux_local.core.schedule.Snapshot`
of every submitted, unfinished job (a ``JobInput`` with its devices, service so far and fitted
models) and of the nodes, runs the one scheduling pass the daemon runs
(:func:`~pollux_local.core.schedule.run_pass`: admission, sharing, the policy, caps,
constraints, device assignment) and applies the plan's actions; between passes each job
progresses as :mod:`pollux_local.sim.jobs` describes, choosing its batch as
:mod:`pollux_local.sim.models` does.  What only a simulation knows of its jobs (the size the
trace asked for, the oracle of their remaining work, what a restart costs them and whether they
are restoring) completes the pass's views before the policy sees them.  A job's replicas are
all of one type: a placement spanning types is cut down to the type holding most of its
devices (the others stay idle that round).  An untyped cluster follows Pollux's artifact
(:data:`~pollux_local.sim.jobs.POLLUX_RULES`), a typed one Sia's simulator
(:data:`~pollux_local.sim.jobs.SIA_RULES`, ``docs/heterogeneous.md``), so that each one's
published figures can be reproduced.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, fields

import numpy as np

from pollux_local.core.goodput import GoodputModel
from pollux_local.core.pool import ProfilePool
from pollux_local.core.schedule import (
    Allocation,
    JobInput,
    JobPhase,
    NodeInput,
    Snapshot,
    run_pass,
)
from pollux_local.core.schedule.inplace import plan_in_place
from pollux_local.core.types import Decision, JobView, NodeView, Placement, Policy, split_batch
from pollux_local.errors import PolluxError
from pollux_local.sim.cluster import Cluster, NodeGroup
from pollux_local.sim.jobs import POLLUX_RULES, SIA_RULES, JobRules, SimJob, advance
from pollux_local.sim.models import JobModels
from pollux_local.sim.profiles import AppProfile, packed_counts
from pollux_local.sim.workload import WorkloadJob

ProgressCallback = Callable[[float, int, int], None]
#: Policy names whose jobs keep the workload's tuned static batch.
STATIC_POLICIES = frozenset({"fifo", "tiresias", "optimus"})
Profiles = Mapping[str, AppProfile] | Mapping[str, Mapping[str, AppProfile]]


@dataclass
class SimConfig:
    """Cluster and timing of a simulation.

    ``cluster`` (groups of typed nodes) replaces ``nodes`` x ``gpus_per_node``.  ``rules``
    default to Pollux's on an untyped cluster and Sia's on a typed one; ``job_library``
    (``goodput`` or ``sia``) and ``share_profiles`` default to this project's library with
    every job of an application pooling its points, except under Sia's rules with the Sia
    policy: its jobs then choose their batch as Sia's do, from their own points.
    """

    nodes: int = 16
    gpus_per_node: int = 4
    cluster: tuple[NodeGroup, ...] | None = None
    interval_s: float = 60.0
    #: seconds a (re)start costs under Pollux's rules (Sia's: per application)
    restart_cost_s: float = 30.0
    #: seconds a warm resize costs (``None``: every change is a checkpoint-restart): a change
    #: of an elastic job's devices within its device type that keeps some of its nodes
    warm_resize_cost_s: float | None = None
    #: a policy other than Sia's is told each job's true restart cost once it has restarted
    #: (as the daemon measures it), instead of the rules' told cost or its own default
    measured_restart_cost: bool = False
    seed: int = 0
    job_library: str | None = None
    #: fit each adaptive job's model to the points all jobs of its application measured
    share_profiles: bool | None = None
    #: correct each model's times by the residuals at measured points (``fit_points``)
    correct_times: bool = True
    #: give up (and report the unfinished jobs) after this much simulated time
    max_time_s: float = 30 * 24 * 3600.0
    rules: JobRules | None = None

    def validate(self) -> None:
        self.make_cluster()
        if not self.interval_s > 0:
            raise PolluxError(f"scheduling interval must be positive, got {self.interval_s}")
        if not self.restart_cost_s >= 0:
            raise PolluxError(f"restart cost must be >= 0, got {self.restart_cost_s}")
        warm = self.warm_resize_cost_s
        if warm is not None and not warm >= 0:
            raise PolluxError(f"warm resize cost must be >= 0, got {warm}")
        if self.job_library not in (None, "goodput", "sia"):
            raise PolluxError(f"unknown job library {self.job_library!r} (goodput or sia)")

    def make_cluster(self) -> Cluster:
        if self.cluster is not None:
            return Cluster(tuple(self.cluster))
        return Cluster.untyped(self.nodes, self.gpus_per_node)

    @property
    def total_gpus(self) -> int:
        return self.make_cluster().total_devices


@dataclass
class SimResult:
    """Outcome of a simulation."""

    policy: str
    jobs: int
    completed: int
    jct_s: dict[str, float]
    restarts: dict[str, int]
    #: resizes made in place per job (only with a warm resize cost)
    warm_resizes: dict[str, int]
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
            "warm_resizes_per_job": float(np.mean(list(self.warm_resizes.values())))
            if self.warm_resizes
            else 0.0,
            "max_finish_time_fairness": float(ftf.max()) if ftf.size else None,
            "decision_ms_median": float(np.median(dms)) if dms.size else 0.0,
            "decision_ms_p95": float(np.percentile(dms, 95)) if dms.size else 0.0,
            "rounds": self.rounds,
            "wall_s": self.wall_s,
        }


class Simulator:
    """Drives one policy through one workload.

    ``profiles`` maps each application to its profile (untyped cluster) or to its profile per
    device type (typed cluster).  ``adaptive`` (default: by policy) says whether jobs choose
    their batch or keep the workload's.
    """

    def __init__(
        self,
        workload: Sequence[WorkloadJob],
        profiles: Profiles,
        policy: Policy,
        config: SimConfig | None = None,
        adaptive: bool | None = None,
    ) -> None:
        self.config = config or SimConfig()
        self.config.validate()
        self.cluster = self.config.make_cluster()
        typed = self.cluster.typed
        self.rules = self.config.rules or (SIA_RULES if typed else POLLUX_RULES)
        self.policy = policy
        if adaptive is None:
            adaptive = not getattr(policy, "static_batch", policy.name in STATIC_POLICIES)
        if typed and not adaptive:
            raise PolluxError(f"policy {policy.name} does not run on typed devices")
        sia_jobs = self.rules.library_by_policy and policy.name == "sia"
        share = self.config.share_profiles
        self.models = JobModels(
            self.rules,
            self.cluster.types,
            job_library=self.config.job_library or ("sia" if sia_jobs else "goodput"),
            share_profiles=(not sia_jobs) if share is None else share,
            correct_times=self.config.correct_times,
            type_aware=typed and (bool(getattr(policy, "type_aware", False)) or sia_jobs),
        )
        self.nodes = self.cluster.nodes
        self._node_inputs = tuple(
            NodeInput(
                node.name,
                tuple(str(d) for d in range(node.devices)),
                device_type=node.device_type,
            )
            for node in self.nodes
        )
        total = self.cluster.total_devices
        self.jobs: list[SimJob] = []
        for spec in workload:
            found = profiles.get(spec.application)
            if found is None:
                raise PolluxError(
                    f"job {spec.name}: unknown application {spec.application!r}"
                    f" (known: {', '.join(sorted(profiles))})"
                )
            apps = self._apps(spec, found)
            if not adaptive and spec.num_replicas > total:
                group = self.cluster.groups[0]
                raise PolluxError(
                    f"impossible cluster size: job {spec.name} needs {spec.num_replicas} GPUs"
                    f" but {group.nodes} x {group.devices_per_node} = {total}"
                )
            self.jobs.append(SimJob(spec=spec, apps=apps, adaptive=adaptive, id=len(self.jobs)))
        self.rng = np.random.default_rng(self.config.seed)
        self.now = 0.0
        self._iter_time_cache: dict[tuple[str, int], tuple[float, ...]] = {}

    def _apps(
        self, spec: WorkloadJob, found: AppProfile | Mapping[str, AppProfile]
    ) -> dict[str, AppProfile]:
        """The job's profile per device type of the cluster."""
        if isinstance(found, AppProfile):
            if self.cluster.typed:
                raise PolluxError(f"job {spec.name}: typed cluster but untyped profiles")
            return {"": found}
        missing = [t for t in self.cluster.types if t not in found]
        if missing:
            raise PolluxError(
                f"job {spec.name}: no profile of {spec.application} on {', '.join(missing)}"
            )
        return {t: found[t] for t in self.cluster.types}

    @property
    def pool(self) -> ProfilePool:
        """The application-wide points the jobs share (:class:`ProfilePool`)."""
        return self.models.pool

    # ----------------------------------------------------------------- views
    def _max_replicas(self, job: SimJob) -> int:
        total = self.cluster.total_devices
        smallest = min(app.min_local for app in job.apps.values())
        fixed = job.fixed_batch
        if fixed is not None:
            if job.adaptive:  # a fixed-batch application held on one device
                return 1
            return max(1, min(total, fixed // smallest))
        return max(1, min(total, job.app.max_batch // smallest))

    def _static_iter_times(self, job: SimJob) -> tuple[float, ...]:
        """Oracle seconds per iteration at the job's static batch on 1..max replicas."""
        batch = job.spec.batch_size
        key = (job.app.name, batch)
        hit = self._iter_time_cache.get(key)
        if hit is None:
            per_node = self.cluster.groups[0].devices_per_node
            times = []
            for k in range(1, self._max_replicas(job) + 1):
                choice = split_batch(batch, k, job.app.bounds)
                counts = packed_counts(k, per_node)
                times.append(job.app.iteration_time(counts, choice.local_batch, choice.accum_steps))
            hit = tuple(times)
            self._iter_time_cache[key] = hit
        return hit

    def _job_input(self, job: SimJob) -> JobInput:
        """The job as the scheduling pass takes it: its devices, service so far (its run in
        progress counted up to now) and models."""
        typed = self.cluster.typed
        aware = typed and self.models.type_aware
        by_type = self.models.models_by_type(job) if aware else {}
        return JobInput(
            id=job.id,
            phase=JobPhase.RUNNING if job.placement else JobPhase.QUEUED,
            submit_time=job.spec.time,
            # every change of allocation, warm ones included (the policy's horizon)
            restarts=job.starts + job.warm_resizes,
            allocation=job.allocation,
            last_start=self.now,
            attained_gpu_s=job.attained_gpu_s,
            run_time_s=job.run_time_s,
            max_devices=self._max_replicas(job),
            batch_size=job.spec.batch_size,
            # of the type it runs on (the pass picks it again where types differ)
            model=by_type.get(job.device_type or "") if aware else self.models.model(job),
            models_by_type=by_type,
            type_rates={t: job.apps[t].single_device_rate for t in job.apps} if typed else {},
            max_profiled_replicas=job.max_profiled_replicas,
            progress_fraction=job.progress_fraction,
        )

    def _with_facts(self, view: JobView) -> JobView:
        """A pass's view of a job with what only the simulation knows of it: the size the
        trace asked for, the oracle of its remaining work (Optimus), what a restart costs it
        and whether it is restoring (its rules), and, for a policy that does not tell types
        apart, its one model across types."""
        job = self.jobs[int(view.id)]
        remaining = None
        iter_times: tuple[float, ...] = ()
        if not job.adaptive:
            app, batch = job.app, job.spec.batch_size
            done = app.iterations_after(batch, job.epoch)
            remaining = max(app.iterations_after(batch, app.epochs) - done, 1.0)
            iter_times = self._static_iter_times(job)
        told = self.rules.told_restart_cost_s
        cost = (
            None if told is None else told.get(job.app.name, self.rules.default_told_restart_cost_s)
        )
        if self.config.measured_restart_cost and self.policy.name != "sia" and job.restarts > 0:
            # as the daemon measures it: the job's own restart cost once it has restarted
            cost = self.rules.restore_delay(job.app.name, self.config.restart_cost_s)
        facts = _with_changes(
            view,
            static_replicas=job.spec.num_replicas,
            remaining_iters=remaining,
            static_iter_time_s=iter_times,
            restart_cost_s=cost,
            warm_resize_cost_s=self.config.warm_resize_cost_s if job.adaptive else None,
            restoring=told is not None and job.restart_left_s > 0,
        )
        if self.cluster.typed and not self.models.type_aware:
            facts = _with_changes(facts, model=self.models.model(job), models_by_type=None)
        return facts

    def _model(self, job: SimJob) -> GoodputModel | None:
        """The job's model as the policy sees it on an untyped cluster."""
        return self.models.model(job)

    # ----------------------------------------------------------------- applying a decision
    def allocation_for(self, placement: Placement) -> Allocation:
        """The lowest devices of each node for per-node counts."""
        return {
            node.name: [str(d) for d in range(c)]
            for node, c in zip(self.nodes, placement, strict=True)
            if c > 0
        }

    def _apply(
        self,
        job: SimJob,
        allocation: Mapping[str, Sequence[str]],
        claimed: Collection[tuple[str, str]] = (),
    ) -> None:
        """Move the job to ``allocation`` (node -> devices), cut to one device type; a
        change of configuration (the job's rules) restarts it, or resizes it in place
        (:meth:`_in_place`; ``claimed``: the devices other jobs of the plan go to)."""
        new = tuple(len(allocation.get(node.name, ())) for node in self.nodes)
        if sum(new) > 0:
            new = self.cluster.one_type(new, self.rules.type_rank)
        job.allocation = {
            node.name: list(allocation[node.name])
            for node, c in zip(self.nodes, new, strict=True)
            if c > 0
        }
        if sum(new) == 0:
            job.ranks = []
            if job.placement:
                job.placement, job.shape, job.device_type = (), (), None
                job.restart_left_s = 0.0
            return
        types = self.cluster.node_types
        device_type = next(types[i] for i, c in enumerate(new) if c > 0)
        shape = tuple(sorted((c for c in new if c > 0), reverse=True))
        in_order = [
            (node.name, device)
            for node in self.nodes
            for device in job.allocation.get(node.name, ())
        ]
        if job.placement and device_type == job.device_type:
            moved = new != job.placement
            if not moved or (self.rules.by_shape and shape == job.shape):
                job.placement = new  # other nodes of the same shape: no restart
                job.ranks = in_order if moved else _relabelled(job.ranks, job.allocation)
                return
        ranks = self._in_place(job, device_type, claimed)
        if ranks is not None:
            job.warm_resizes += 1
            job.restart_left_s = float(self.config.warm_resize_cost_s or 0.0)
            job.ranks = ranks
            job.allocation = {}
            for node, device in ranks:  # the devices that stay are kept
                job.allocation.setdefault(node, []).append(device)
        else:
            job.starts += 1
            job.restart_left_s = self.rules.restore_delay(job.app.name, self.config.restart_cost_s)
            job.ranks = in_order
        job.placement, job.shape, job.device_type = new, shape, device_type
        self.models.choose_batch(job)

    def _in_place(
        self, job: SimJob, device_type: str, claimed: Collection[tuple[str, str]]
    ) -> list[tuple[str, str]] | None:
        """The job's ranks after a warm resize to its (new) allocation, or ``None`` when the
        change restarts it.  A warm resize is modelled (``warm_resize_cost_s``) for an
        elastic job that stays on its device type, where the daemon does one
        (``core.schedule.inplace.plan_in_place``: the first ranks on each node it keeps stay,
        renumbered, on their devices; no joiner waits for a leaver's device)."""
        if (
            self.config.warm_resize_cost_s is None
            or not job.adaptive
            or not job.placement
            or device_type != job.device_type
        ):
            return None
        planned = plan_in_place(job.ranks, job.allocation, claimed)
        return planned[0] if planned is not None else None

    def _round(self, active: list[SimJob], decision_ms: list[float]) -> None:
        """One scheduling pass over the active jobs, its plan applied."""
        snapshot = Snapshot(
            jobs=[self._job_input(job) for job in active],
            nodes=self._node_inputs,
            now=self.now,
            explain=False,
        )
        plan = run_pass(snapshot, _SimulatedPolicy(self, decision_ms), self.rng)
        claimed = [
            (action.job_id, (node, device))
            for action in plan.actions
            for node, devices in action.allocation.items()
            for device in devices
        ]
        for action in plan.actions:
            others = {device for job_id, device in claimed if job_id != action.job_id}
            self._apply(self.jobs[action.job_id], action.allocation, others)

    def _advance(self, job: SimJob, seconds: float) -> None:
        advance(job, self.now, seconds, self.rules, self.models)

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
        self.now = interval if self.rules.first_decision_at_interval else 0.0
        while (pending or active) and self.now <= self.config.max_time_s:
            while pending and pending[0].spec.time <= self.now:
                active.append(pending.pop(0))
            if active:
                for job in active:
                    job.active_count_sum += len(active)
                    job.active_rounds += 1
                self._round(active, decision_ms)
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
        fairness = {}
        if self.rules.fairness and not self.cluster.typed:
            fairness = {j.name: jct[j.name] / self.isolated_jct(j) for j in complete}
        first_submit = min(j.spec.time for j in self.jobs)
        makespan = max((j.completion_s or 0.0 for j in complete), default=first_submit)
        return SimResult(
            policy=self.policy.name,
            jobs=len(self.jobs),
            completed=len(complete),
            jct_s=jct,
            restarts={j.name: j.restarts for j in self.jobs},
            warm_resizes={j.name: j.warm_resizes for j in self.jobs},
            finish_time_fairness=fairness,
            makespan_s=float(makespan - first_submit),
            decision_ms=decision_ms,
            wall_s=wall_s,
            rounds=rounds,
        )

    # ----------------------------------------------------------------- figures
    def device_hours_by_type(self) -> dict[str, float]:
        """Device-hours held per type over the run (restores included)."""
        totals = {t: 0.0 for t in self.cluster.types}
        for job in self.jobs:
            for t, seconds in job.device_seconds.items():
                totals[t] += seconds / 3600.0
        return totals

    def isolated_jct(self, job: SimJob) -> float:
        """JCT of ``job`` alone on an equal share of the cluster (finish-time fairness' base).

        The share is G/n devices, n the mean number of active jobs over the job's life (at
        least 1).  On that share (packed, at most the job's device limit) the job trains at the
        best validated batch for each epoch (or its fixed batch) with no queueing and one
        restart; a share below one device time-slices one device.
        """
        n = job.active_count_sum / job.active_rounds if job.active_rounds else 1.0
        share = self.cluster.total_devices / max(n, 1.0)
        k = max(1, min(int(share), self._max_replicas(job)))
        slow = 1.0 / share if share < 1.0 else 1.0
        counts = packed_counts(k, self.cluster.groups[0].devices_per_node)
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
            rates.append(app.gains(total) / iter_time)
        best = np.max(np.asarray(rates), axis=0)
        work = np.diff(app.epoch_target)
        delay = self.rules.restore_delay(app.name, self.config.restart_cost_s)
        return float(np.sum(work / best)) * slow + delay


class _SimulatedPolicy:
    """The simulation's policy as the pass calls it: each view completed with what only the
    simulation knows (:meth:`Simulator._with_facts`), the decision timed and checked."""

    def __init__(self, sim: Simulator, decision_ms: list[float]) -> None:
        self.sim = sim
        self.name = sim.policy.name
        self.decision_ms = decision_ms

    def decide(
        self,
        jobs: Sequence[JobView],
        nodes: Sequence[NodeView],
        now: float,
        rng: np.random.Generator,
    ) -> Decision:
        views = [self.sim._with_facts(view) for view in jobs]
        tick = time.perf_counter()
        decision = self.sim.policy.decide(views, nodes, now, rng)
        self.decision_ms.append((time.perf_counter() - tick) * 1000.0)
        placements = {k: tuple(v) for k, v in decision.placements.items()}
        self.sim.cluster.check(self.name, placements, {view.id for view in views})
        return decision


_VIEW_FIELDS = frozenset(f.name for f in fields(JobView))


def _with_changes(view: JobView, **changes: object) -> JobView:
    """``dataclasses.replace(view, **changes)`` for the many views a simulation makes: the
    same fields, without building the view again through its ``__init__`` (``JobView`` has
    no ``__post_init__`` to skip)."""
    unknown = changes.keys() - _VIEW_FIELDS
    if unknown:
        raise TypeError(f"JobView has no field {sorted(unknown)[0]!r}")
    new = object.__new__(JobView)
    new.__dict__.update(view.__dict__)
    new.__dict__.update(changes)
    return new


def _relabelled(
    ranks: Sequence[tuple[str, str]], allocation: Mapping[str, Sequence[str]]
) -> list[tuple[str, str]]:
    """``ranks`` on the same nodes with ``allocation``'s devices (as many per node), each
    node's devices taken in rank order."""
    left = {node: list(devices) for node, devices in allocation.items()}
    return [(node, left[node].pop(0)) for node, _ in ranks]
