"""The daemon's side of a scheduling pass: job records and fitted models -> a snapshot.

The pass itself is pure and lives in :mod:`pollux_local.core.schedule` (admission, sharing,
the policy, devices, batch sizes, reasons); this module fits each job's models from its
reports (:class:`ModelCache`) and turns the store's records into the pass's typed inputs
(:func:`job_input`, :func:`snapshot_of`); :func:`plan_round` runs the pass on them.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import msgspec
import numpy as np

from pollux_local.api.report import JobReport, ProfileRow, ReportBounds
from pollux_local.api.states import JobState
from pollux_local.core.fitting import fit_points, points_from_rows
from pollux_local.core.goodput import GoodputModel
from pollux_local.core.memory import largest_local_batch
from pollux_local.core.pool import Point, ProfilePool, Times
from pollux_local.core.schedule import (
    Action,
    ActionKind,
    Allocation,
    Constraint,
    Dependency,
    GroupLimit,
    Holding,
    JobInput,
    JobPhase,
    Limits,
    NodeInput,
    Outcome,
    Plan,
    Snapshot,
    run_pass,
    schedulable,
    views,
)
from pollux_local.core.types import BatchBounds, GradStats, Policy
from pollux_local.daemon.config import GroupConfig
from pollux_local.daemon.resizes import ResizeCosts
from pollux_local.daemon.state import GroupRecord, JobRecord

__all__ = [  # the plan's types, as the executor imports them
    "Action",
    "ActionKind",
    "Allocation",
    "Plan",
]

# --- models ------------------------------------------------------------------------------


#: The report of a job that has not reported.
_NO_REPORT = JobReport()


def _bounds_from(job: JobRecord, report: JobReport) -> BatchBounds | None:
    """The job's batch bounds: those it reported, each one it left out from its spec."""
    spec = job.spec
    raw = report.bounds
    if raw is None:
        if not spec.batch_size:
            return None
        raw = ReportBounds(base_batch=spec.batch_size)
    try:
        return BatchBounds(
            base_batch=raw.base_batch,
            max_batch=raw.max_batch or spec.max_batch_size or raw.base_batch,
            min_local=raw.min_local or spec.min_local_batch or 1,
            max_local=raw.max_local or spec.max_local_batch,
            accumulation=raw.accumulation,
        )
    except (TypeError, ValueError):
        return None


#: The spec fields that make two jobs the same kind.
_KIND_FIELDS = (
    "workdir",
    "argv",
    "batch_size",
    "max_batch_size",
    "min_local_batch",
    "max_local_batch",
)


def job_kind(job: JobRecord) -> str:
    """Jobs of one kind run the same command in the same folder with the same batch bounds;
    the jobs of one kind *and one owner* share their throughput measurements
    (:class:`ModelCache`, one :class:`~pollux_local.core.pool.ProfilePool` per owner)."""
    return json.dumps([getattr(job.spec, name) for name in _KIND_FIELDS], sort_keys=True)


def _profile_points(profile: Sequence[ProfileRow]) -> dict[Point, Times] | None:
    """A report's profile as pool points (``core.fitting.points_from_rows``), or ``None`` when
    a row is out of its range."""
    try:
        return points_from_rows(msgspec.structs.asdict(row) for row in profile)
    except ValueError:
        return None


#: Configurations pooled per kind (and device type) of one owner: more than a job measures
#: (``api.report.MAX_PROFILE_ROWS`` per report).
POOL_POINTS = 256
#: Kinds (with their device types) pooled per owner; the least recently reported is dropped.
POOL_KINDS = 64
#: Fitted models kept (one per job, and per job and device type); least recently used dropped.
FITS_KEPT = 4096


@dataclass
class _Fit:
    """One job's model inputs and fit: its profile rows as last seen (the report's list), its
    points, the version of its kind's pool the fit used, and the fit."""

    rows: Sequence[ProfileRow]
    own: dict[Point, Times]
    version: int = -1
    params: Any = None
    correction: Any = None


class ModelCache:
    """Fitted goodput models per job.  A job's throughput model is fitted to the points its
    owner's jobs of its kind reported (its own win where both have one): one user's reports
    never reach another user's model.  Its points are taken in when its report's profile
    changed and it is refitted only when they or its kind's pooled points changed (the pool's
    version), so a pass costs O(jobs) whatever the jobs reported: a report holds at most
    ``api.report.MAX_PROFILE_ROWS`` rows, a pool ``POOL_POINTS`` per kind and ``POOL_KINDS``
    kinds per owner.  Before a job has reported gradient statistics it uses the first ones its
    owner's jobs of its kind reported in a first epoch."""

    def __init__(self) -> None:
        self._fits: OrderedDict[int | tuple[int, str], _Fit] = OrderedDict()
        self._pools: dict[int, ProfilePool] = {}
        self.fit_count = 0

    def pool(self, owner_uid: int) -> ProfilePool:
        """The pool of one owner's jobs (made on first use)."""
        pool = self._pools.get(owner_uid)
        if pool is None:
            pool = self._pools[owner_uid] = ProfilePool(POOL_POINTS, POOL_KINDS)
        return pool

    def forget(self, job_id: int) -> None:
        self._fits.pop(job_id, None)
        for key in [key for key in self._fits if isinstance(key, tuple) and key[0] == job_id]:
            del self._fits[key]

    def fitted_points(self, job: JobRecord) -> int:
        """How many points the job's (untyped) model is fitted to: its own and its kind's."""
        slot = self._fits.get(job.id)
        own = slot.own if slot is not None else {}
        return len(self.pool(job.owner_uid).points_for(job_kind(job), own))

    def models_by_type(
        self,
        job: JobRecord,
        types: Sequence[str],
        memory: Mapping[str, int] | None = None,
    ) -> dict[str, Any]:
        """On a cluster of several device ``types``: the job's model per type, each fitted to
        the points its kind measured on that type (profile rows tagged ``device_type``) and
        with its local batch bounded by the type's ``memory``; a type nothing was measured on,
        or on which not even one example fits, has none."""
        rows = (job.report or _NO_REPORT).profile
        models: dict[str, Any] = {}
        for device_type in types:
            mine = [row for row in rows if row.device_type == device_type]
            model = self.model_for(job, device_type, mine, (memory or {}).get(device_type))
            if model is not None:
                models[device_type] = model
        return models

    def type_rates(
        self, job: JobRecord, types: Sequence[str], slowdowns: Mapping[str, float]
    ) -> dict[str, float]:
        """Examples/s of the job's kind on one device of each type: measured (the best
        single-device point of the kind on that type, local batch / step time); for a type not
        measured, from a measured one by the median ratio between the two types over every
        kind of the same owner that measured both, else by the types' declared slowdowns
        (CPU-backed devices)."""
        pool = self.pool(job.owner_uid)
        kind = job_kind(job)
        measured = {t: r for t in types if (r := _single_rate(pool, f"{kind}@{t}")) is not None}
        rates = dict(measured)
        for device_type in types:
            if device_type in rates or not measured:
                continue
            known, rate = next(iter(sorted(measured.items())))
            ratio = _learned_ratio(pool, device_type, known)
            if ratio is None and device_type in slowdowns and known in slowdowns:
                ratio = slowdowns[known] / slowdowns[device_type]
            if ratio is not None:
                rates[device_type] = rate * ratio
        return rates

    def model_for(
        self,
        job: JobRecord,
        device_type: str | None = None,
        rows: Sequence[ProfileRow] | None = None,
        memory_bytes: int | None = None,
    ) -> Any | None:
        """The job's ``GoodputModel``, or ``None`` while neither it nor its kind has reported a
        profile and gradient statistics.  With ``device_type``, the model of that type, fitted
        to ``rows`` (the job's rows measured there) and its kind's points on that type.  With
        ``memory_bytes`` (a device's memory) and peak-memory points in the job's report, the
        local batch is bounded by what fits (``core.memory.largest_local_batch``); ``None``
        when not even one example fits."""
        report = job.report or _NO_REPORT
        kind = job_kind(job) if device_type is None else f"{job_kind(job)}@{device_type}"
        pool = self.pool(job.owner_uid)
        raw = report.profile if rows is None else rows
        slot_key: int | tuple[int, str] = job.id if device_type is None else (job.id, device_type)
        slot = self._fits.get(slot_key)
        if slot is not None and slot.rows == raw:
            self._fits.move_to_end(slot_key)
        else:
            own = _profile_points(raw)
            if own is None:
                return None
            pool.add(kind, own)
            slot = _Fit(rows=list(raw), own=own)
            self._fits[slot_key] = slot
            while len(self._fits) > FITS_KEPT:
                self._fits.popitem(last=False)
        stats = report.grad_stats
        grad = None if stats is None else GradStats(sqr=stats.sqr, var=stats.var)
        pool.add(kind, {}, grad, first_epoch=report.epoch is not None and report.epoch < 1)
        if grad is None:
            grad = pool.start_stats(kind)
        bounds = _bounds_from(job, report)
        if bounds is not None and memory_bytes is not None:
            bounds = _fitting_bounds(bounds, report, memory_bytes)
            if bounds is None:
                return None
        if bounds is None or grad is None:
            return None
        version = pool.version(kind)
        if slot.version != version:  # first use, or the kind's points changed: (re)fit
            slot.version, slot.params, slot.correction = version, None, None
            points = pool.points_for(kind, slot.own)
            try:
                fitted = fit_points(dict(sorted(points.items())))
            except ValueError:  # none, or hopeless: tried again when the points change
                return None
            slot.params, slot.correction = fitted.params, fitted.correction
            self.fit_count += 1
        if slot.params is None:
            return None
        from pollux_local.core.goodput import GoodputModel

        return GoodputModel(
            params=slot.params, stats=grad, bounds=bounds, correction=slot.correction
        )


def _single_rate(pool: ProfilePool, key: str) -> float | None:
    points = pool.points_for(key, {})
    rates = [m / times[1] for (n, k, m), times in points.items() if n == 1 and k == 1]
    return max(rates) if rates else None


def _learned_ratio(pool: ProfilePool, wanted: str, known: str) -> float | None:
    """Median over the kinds of one owner's pool of rate(wanted) / rate(known)."""
    ratios = []
    for key in pool.kinds():
        kind, sep, device_type = key.rpartition("@")
        if not sep or device_type != known:
            continue
        base = _single_rate(pool, key)
        other = _single_rate(pool, f"{kind}@{wanted}")
        if base and other:
            ratios.append(other / base)
    return float(np.median(ratios)) if ratios else None


def _fitting_bounds(
    bounds: BatchBounds, report: JobReport, memory_bytes: int
) -> BatchBounds | None:
    """``bounds`` with the local batch at most what fits a device of ``memory_bytes``, from
    the peak memory the job measured (``report.memory``); unchanged without such points,
    ``None`` when not even the smallest local batch fits."""
    points = [(point.local_batch, float(point.peak_bytes)) for point in report.memory or ()]
    limit = largest_local_batch(points, memory_bytes) if points else None
    if limit is None:
        return bounds
    if limit < bounds.min_local:
        return None
    return replace(bounds, max_local=min(bounds.largest_local, limit))


# --- records -> the pass's inputs --------------------------------------------------------

_PHASES = {
    JobState.QUEUED: JobPhase.QUEUED,
    JobState.RUNNING: JobPhase.RUNNING,
    JobState.RESCALING: JobPhase.RESCALING,
}
_OUTCOMES = {
    JobState.SUCCEEDED: Outcome.SUCCEEDED,
    JobState.FAILED: Outcome.FAILED,
    JobState.CANCELLED: Outcome.CANCELLED,
}


def dependencies_of(job: JobRecord, states: Mapping[int, JobState]) -> tuple[Dependency, ...]:
    """The jobs ``job`` runs after, each with its outcome from ``states`` (job id -> state;
    a job absent there does not exist)."""
    found = []
    for dep in job.spec.after:
        state = states.get(int(dep))
        outcome = None if state is None else _OUTCOMES.get(state, Outcome.PENDING)
        found.append(Dependency(int(dep), outcome, "" if state is None else state.value))
    return tuple(found)


def progress_fraction(report: JobReport | None) -> float | None:
    """Share of its declared length a job has done: epoch / epochs from its report, or None
    when it declared no length."""
    if report is None or report.epoch is None or report.epochs is None:
        return None
    return min(max(report.epoch / report.epochs, 0.0), 1.0)


def job_input(
    job: JobRecord,
    states: Mapping[int, JobState] | None = None,
    model: GoodputModel | None = None,
    models_by_type: Mapping[str, GoodputModel] | None = None,
    type_rates: Mapping[str, float] | None = None,
    resize_costs: ResizeCosts | None = None,
) -> JobInput:
    """A stored job as the pass takes it (``states``: of the jobs it depends on;
    ``resize_costs``: what its resizes were measured to cost)."""
    costs = resize_costs or ResizeCosts()
    report = job.report or _NO_REPORT
    profiled = [row.replicas for row in report.profile]
    spec = job.spec
    constraint = spec.constraint
    return JobInput(
        id=job.id,
        owner=job.owner_name,
        phase=_PHASES.get(job.state, JobPhase.QUEUED),
        submit_time=job.submit_time,
        priority=job.priority,
        restarts=job.restarts,
        allocation=job.placement,
        last_start=job.last_start,
        attained_gpu_s=job.attained_gpu_s,
        run_time_s=job.run_time_s,
        retry_after=job.retry_after,
        min_devices=int(spec.min_gpus or 1),
        max_devices=spec.max_gpus,
        elastic=spec.elastic,
        preemptible=spec.preemptible,
        batch_size=spec.batch_size,
        min_local_batch=spec.min_local_batch,
        max_local_batch=spec.max_local_batch,
        time_limit_s=spec.time_limit_s,
        constraint=(
            None
            if constraint is None
            else Constraint(frozenset(constraint.nodes), constraint.device_type)
        ),
        after=dependencies_of(job, states or {}),
        after_any=spec.after_any,
        array_id=spec.array_id,
        array_max_running=spec.array_max_running,
        shared=spec.shared,
        begin_at=spec.begin_at,
        group=spec.group,
        gpu_memory=spec.gpu_memory,
        model=model,
        models_by_type=models_by_type or {},
        type_rates=type_rates or {},
        max_profiled_replicas=max(profiled, default=0),
        progress_fraction=progress_fraction(report),
        reason=job.reason,
        prediction=job.prediction,
        restart_cost_s=costs.cold_s,
        warm_resize_cost_s=costs.warm_s,
    )


def group_limits(
    configured: Sequence[GroupConfig], stored: Sequence[GroupRecord]
) -> dict[str, GroupLimit]:
    """Each group's caps and pause as the pass takes them (``Limits.groups``): the admin's
    groups with the config's caps, the users' groups with their own (a name the config gives
    a group is the admin's), each paused as the store says."""
    paused = {row.name: row.paused for row in stored}
    limits = {
        row.name: GroupLimit(row.max_devices, row.max_running, row.paused)
        for row in stored
        if row.owner_uid is not None
    }
    for group in configured:
        limits[group.name] = GroupLimit(
            group.max_devices, group.max_running, paused.get(group.name, False)
        )
    return limits


def snapshot_of(
    jobs: Sequence[JobRecord],
    nodes: Sequence[NodeInput],
    models: ModelCache,
    now: float,
    limits: Limits | None = None,
    *,
    states: Mapping[int, JobState] | None = None,
    stopping: Sequence[Holding] = (),
    resize_costs: Mapping[int, ResizeCosts] | None = None,
) -> Snapshot:
    """The pass's snapshot: the queued, running and rescaling ``jobs``, each with its fitted
    models (the jobs the pass may schedule: queued past any back-off, and running), on the
    smallest device memory of the cluster and, on a cluster of several device types, per
    type, with its kind's speed per type; under ``limits``, with ``states`` (job id -> state,
    any state) of the jobs others depend on and the jobs still ``stopping``, each counted as a
    running job of its owner, with its devices; ``resize_costs`` by job id (measured,
    ``daemon.resizes``)."""
    types = sorted({node.device_type for node in nodes})
    typed = len(types) > 1
    memory_of: dict[str, int] = {}
    for node in nodes:
        if node.memory is not None:
            memory_of[node.device_type] = min(
                node.memory, memory_of.get(node.device_type, node.memory)
            )
    smallest = min(memory_of.values(), default=None)
    # CPU-backed devices are as fast as the CPU unless declared slower
    slowdowns = {
        n.device_type: n.slowdown or 1.0
        for n in nodes
        if n.devices and all(d.startswith("cpu") for d in n.devices)
    }
    inputs = []
    for job in jobs:
        if job.state not in _PHASES:  # held or ended: no part in a pass
            continue
        bare = job_input(job, states, resize_costs=(resize_costs or {}).get(job.id))
        if not schedulable(bare, now):
            inputs.append(bare)
            continue
        model = models.model_for(job, memory_bytes=smallest)
        if typed:
            inputs.append(
                replace(
                    bare,
                    model=model,
                    models_by_type=models.models_by_type(job, types, memory_of),
                    type_rates=models.type_rates(job, types, slowdowns),
                )
            )
        else:
            inputs.append(replace(bare, model=model))
    return Snapshot(jobs=inputs, nodes=nodes, now=now, limits=limits or Limits(), holdings=stopping)


def plan_round(
    policy: Policy,
    jobs: Sequence[JobRecord],
    nodes: Sequence[NodeInput],
    models: ModelCache,
    now: float,
    rng: np.random.Generator,
    limits: Limits | None = None,
    *,
    states: Mapping[int, JobState] | None = None,
    stopping: Sequence[Holding] = (),
    resize_costs: Mapping[int, ResizeCosts] | None = None,
) -> Plan:
    """The pass (``core.schedule.run_pass``) on the stored jobs (arguments as
    :func:`snapshot_of`)."""
    snapshot = snapshot_of(
        jobs, nodes, models, now, limits, states=states, stopping=stopping,
        resize_costs=resize_costs,
    )  # fmt: skip
    return run_pass(snapshot, policy, rng)


def run_time_s(job: JobRecord, now: float) -> float:
    """Seconds the job has run, the run in progress included."""
    return views.run_time_s(job_input(job), now)


def time_left_s(job: JobRecord, now: float) -> float | None:
    """Seconds the job may still run before its time limit (``None``: no limit)."""
    return views.time_left_s(job_input(job), now)


def progress_eta(job: JobRecord, now: float) -> float | None:
    """Seconds to the end of the job's declared length at its pace so far
    (``core.schedule.views.progress_eta``)."""
    return views.progress_eta(job_input(job), now)
