"""One scheduling pass, pure: job records + device snapshot -> models -> policy -> a Plan.

Nothing here touches processes, sockets or the clock: the daemon passes ``now`` in, and the
plan it gets back lists the start / resize / stop actions for the executor to apply, the reason
each job left waiting waits (with the facts: what it needs, what is free, who holds it and when
that is expected to end) and the predicted figures of the jobs left running as they were.

A job's view is taken as the simulator takes it: attained service and run time include the
current run (stored + replicas x (now - last start)), restarts count the starts after the
first.  Rigid jobs (``spec.elastic`` false: plain scripts) run on exactly ``min_gpus``
devices or wait, get no batch choice, and are never resized or moved; unless ``preemptible``
they are never stopped either.  A record without ``elastic`` (stored before jobs said) is
elastic.
"""

from __future__ import annotations

import json
import math
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from pollux_local.api.states import PLACED_STATES, TERMINAL_STATES, JobState
from pollux_local.core.fitting import fit_points, points_from_rows
from pollux_local.core.memory import largest_local_batch
from pollux_local.core.pool import Point, ProfilePool, Times
from pollux_local.core.sharing import SharedDevice, choose_shared_device, shared_speed
from pollux_local.core.types import (
    BatchBounds,
    BatchChoice,
    Decision,
    GradStats,
    JobView,
    NodeView,
    Placement,
    Policy,
    Waiting,
)
from pollux_local.daemon.state import JobRecord
from pollux_local.sizes import format_size

Allocation = dict[str, list[str]]  # node name -> device ids


@dataclass(frozen=True)
class NodeSnapshot:
    """A node at decision time: its schedulable devices (in order), whether it is up, their
    type, which are busy outside the scheduler and which are withheld from new jobs (reserved
    or drained, and not held by a job now)."""

    name: str
    devices: tuple[str, ...]
    up: bool = True
    busy: frozenset[str] = frozenset()  # in use by processes outside the scheduler
    device_type: str = "gpu"
    withheld: frozenset[str] = frozenset()
    #: each device's memory (bytes; ``None``: unknown) and, on GPUs that report it, the
    #: memory free on each device now
    memory: int | None = None
    free_memory: Mapping[str, int] = field(default_factory=dict)
    #: CPU-backed test devices: their declared slowdown (``[nodes.NAME] slowdown``)
    slowdown: float | None = None
    #: devices still held by jobs asked to stop whose processes are not yet gone
    #: (device -> job id): no other job is placed there until they are
    stopping: Mapping[str, int] = field(default_factory=dict)

    @property
    def free_devices(self) -> tuple[str, ...]:
        if not self.up:
            return ()
        return tuple(
            d
            for d in self.devices
            if d not in self.busy and d not in self.withheld and d not in self.stopping
        )


@dataclass(frozen=True)
class Stopping:
    """A job asked to stop (cancelled, held, preempted, at its time limit) whose processes
    are not yet gone: its owner still holds its ``devices`` (node -> device ids), in every
    cap and on every node view, until the executor reports them gone."""

    job_id: int
    owner: str
    devices: Mapping[str, Sequence[str]]

    @property
    def count(self) -> int:
        return sum(len(devices) for devices in self.devices.values())


@dataclass(frozen=True)
class Limits:
    """What besides devices keeps a queued job from starting: per-user caps (``[limits]``)
    and the states of the jobs others depend on (``job id -> state``, any state)."""

    max_devices_per_user: int | None = None
    max_running_per_user: int | None = None
    states: Mapping[int, JobState] = field(default_factory=dict)
    #: the slowdown beta of jobs sharing a device (``core.sharing``)
    share_slowdown: float = 0.25
    #: jobs whose processes still hold devices though they no longer run (:class:`Stopping`):
    #: each counts as a running job of its owner, with its devices
    stopping: Sequence[Stopping] = ()


@dataclass(frozen=True)
class Action:
    """``kind`` is ``start`` (not running -> devices), ``resize`` (devices -> other devices)
    or ``stop`` (devices -> none, back to the queue)."""

    kind: str
    job_id: int
    allocation: Allocation
    batch: BatchChoice | None
    reason: str
    prediction: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Plan:
    """``actions`` for the executor; ``unchanged``: jobs left as they are; ``reasons``: the new
    reason of each job left waiting whose reason changed; ``predictions``: the new predicted
    figures of each job left running as it was whose figures changed (both to be stored)."""

    actions: tuple[Action, ...]
    decision: Decision
    unchanged: tuple[int, ...] = ()
    reasons: Mapping[int, str] = field(default_factory=dict)
    predictions: Mapping[int, dict[str, float]] = field(default_factory=dict)

    def for_job(self, job_id: int) -> Action | None:
        for action in self.actions:
            if action.job_id == job_id:
                return action
        return None


# --- models ------------------------------------------------------------------------------


def _bounds_from(job: JobRecord, report: Mapping[str, Any] | None) -> BatchBounds | None:
    raw = (report or {}).get("bounds") or {}
    spec = job.spec
    base = raw.get("base_batch", spec.batch_size)
    if not base:
        return None
    max_batch = raw.get("max_batch", spec.max_batch_size or base)
    try:
        return BatchBounds(
            base_batch=int(base),
            max_batch=int(max_batch),
            min_local=int(raw.get("min_local", spec.min_local_batch or 1)),
            max_local=raw.get("max_local", spec.max_local_batch),
            accumulation=bool(raw.get("accumulation", True)),
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


def _profile_points(profile: Sequence[Any]) -> dict[Point, Times] | None:
    """A report's profile as pool points, or ``None`` when an entry is malformed."""
    try:
        return points_from_rows(profile)
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

    rows: Sequence[Any]
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
        report = job.report or {}
        rows = [row for row in report.get("profile") or [] if isinstance(row, dict)]
        models: dict[str, Any] = {}
        for device_type in types:
            mine = [row for row in rows if row.get("device_type") == device_type]
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
        rows: Sequence[Any] | None = None,
        memory_bytes: int | None = None,
    ) -> Any | None:
        """The job's ``GoodputModel``, or ``None`` while neither it nor its kind has reported a
        profile and gradient statistics.  With ``device_type``, the model of that type, fitted
        to ``rows`` (the job's rows measured there) and its kind's points on that type.  With
        ``memory_bytes`` (a device's memory) and peak-memory points in the job's report, the
        local batch is bounded by what fits (``core.memory.largest_local_batch``); ``None``
        when not even one example fits."""
        report = job.report or {}
        kind = job_kind(job) if device_type is None else f"{job_kind(job)}@{device_type}"
        pool = self.pool(job.owner_uid)
        raw = report.get("profile") or [] if rows is None else rows
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
        grad = _grad_stats(report.get("grad_stats"))
        epoch = report.get("epoch")
        pool.add(kind, {}, grad, first_epoch=isinstance(epoch, int | float) and epoch < 1)
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
    bounds: BatchBounds, report: Mapping[str, Any], memory_bytes: int
) -> BatchBounds | None:
    """``bounds`` with the local batch at most what fits a device of ``memory_bytes``, from
    the peak memory the job measured (``report["memory"]``); unchanged without such points,
    ``None`` when not even the smallest local batch fits."""
    points = []
    for point in report.get("memory") or []:
        if isinstance(point, dict):
            try:
                points.append((int(point["local_batch"]), float(point["peak_bytes"])))
            except (KeyError, TypeError, ValueError):
                continue
    limit = largest_local_batch(points, memory_bytes) if points else None
    if limit is None:
        return bounds
    if limit < bounds.min_local:
        return None
    return replace(bounds, max_local=min(bounds.largest_local, limit))


def _grad_stats(raw: Any) -> GradStats | None:
    """A report's ``grad_stats`` when both values are finite numbers, else ``None``."""
    if not isinstance(raw, dict):
        return None
    try:
        grad = GradStats(sqr=float(raw["sqr"]), var=float(raw["var"]))
    except (KeyError, TypeError, ValueError):
        return None
    if not (math.isfinite(grad.sqr) and math.isfinite(grad.var)):
        return None
    return grad


# --- views -------------------------------------------------------------------------------


def placement_of(
    allocation: Mapping[str, Sequence[str]], nodes: Sequence[NodeSnapshot]
) -> Placement:
    return tuple(len(allocation.get(node.name, ())) for node in nodes)


def is_elastic(job: JobRecord) -> bool:
    """Whether the scheduler may resize the job (it uses the job library); a record without
    the field was stored before jobs said, when every job was elastic."""
    return job.spec.elastic


def is_preemptible(job: JobRecord) -> bool:
    """Whether the scheduler may stop the job and queue it again: every elastic job, and a
    rigid one submitted as preemptible."""
    return is_elastic(job) or job.spec.preemptible


def min_gpus(job: JobRecord) -> int:
    return int(job.spec.min_gpus or 1)


def current_run_s(job: JobRecord, now: float) -> float:
    """Seconds of the run in progress (0 when the job is not running)."""
    if job.state != "running" or job.last_start is None:
        return 0.0
    return max(0.0, now - job.last_start)


def attained_gpu_s(job: JobRecord, now: float) -> float:
    """Device-seconds the job has used, the run in progress included."""
    return job.attained_gpu_s + job.replicas * current_run_s(job, now)


def run_time_s(job: JobRecord, now: float) -> float:
    """Seconds the job has run, the run in progress included."""
    return job.run_time_s + current_run_s(job, now)


def static_replicas(job: JobRecord, total_devices: int) -> int:
    """The device count a non-adaptive policy gives: the user's maximum, within the cluster
    (a rigid job: its size)."""
    low = int(job.spec.min_gpus or 1)
    if not is_elastic(job):
        return low
    high = job.spec.max_gpus
    wanted = int(high) if high else low
    return max(low, min(wanted, max(total_devices, low)))


def job_view(
    job: JobRecord, model: Any | None, nodes: Sequence[NodeSnapshot], now: float
) -> JobView:
    total = sum(len(node.devices) for node in nodes)
    report = job.report or {}
    profiled = [
        int(p.get("replicas", 0)) for p in report.get("profile") or [] if isinstance(p, dict)
    ]
    max_gpus = job.spec.max_gpus
    elastic = is_elastic(job)
    low = min_gpus(job)
    return JobView(
        id=job.job_id,
        owner=job.owner_name,
        model=model,
        age_s=max(0.0, now - job.submit_time),
        # the stored count is of starts; a view counts the changes after the first
        restarts=max(job.restarts - 1, 0),
        min_replicas=low,
        max_replicas=(int(max_gpus) if max_gpus else 1 << 30) if elastic else low,
        placement=placement_of(job.placement, nodes),
        submit_time=job.submit_time,
        priority=job.priority,
        max_profiled_replicas=max(profiled, default=0),
        static_replicas=static_replicas(job, total),
        static_batch=job.spec.batch_size,
        attained_gpu_s=attained_gpu_s(job, now),
        run_time_s=run_time_s(job, now),
        progress_fraction=progress_fraction(report),
        rigid=not elastic,
        preemptible=is_preemptible(job),
        time_left_s=time_left_s(job, now),
        allowed_nodes=allowed_nodes(job, nodes),
    )


def time_left_s(job: JobRecord, now: float) -> float | None:
    """Seconds the job may still run before its time limit (``None``: no limit)."""
    limit = job.spec.time_limit_s
    return None if limit is None else max(0.0, limit - run_time_s(job, now))


def allowed_nodes(job: JobRecord, nodes: Sequence[NodeSnapshot]) -> frozenset[int] | None:
    """Indices of the nodes the job's constraint allows (``None``: no constraint)."""
    constraint = job.spec.constraint
    if constraint is None:
        return None
    return frozenset(
        i for i, node in enumerate(nodes) if constraint.allows_node(node.name, node.device_type)
    )


def dependency_verdict(job: JobRecord, states: Mapping[int, JobState]) -> tuple[str, str]:
    """Whether a job's dependencies let it start: ``("ready", "")``, ``("wait", reason)`` or
    ``("fail", reason)``.  With ``after_any`` every job named must have ended, however; else
    every one must have succeeded, and one that failed or was cancelled (or does not exist)
    fails this job."""
    for dep in job.spec.after:
        state = states.get(int(dep))
        if state is None:
            return "fail", f"dependency {dep} does not exist"
        if job.spec.after_any:
            if state not in TERMINAL_STATES:
                return "wait", f"waiting: after job {dep} ({state.value})"
            continue
        if state == JobState.FAILED:
            return "fail", f"dependency {dep} failed"
        if state == JobState.CANCELLED:
            return "fail", f"dependency {dep} was cancelled"
        if state != JobState.SUCCEEDED:
            return "wait", f"waiting: after job {dep} ({state.value})"
    return "ready", ""


def _admit(
    candidates: Sequence[JobRecord], limits: Limits
) -> tuple[list[JobRecord], dict[int, str]]:
    """The candidates the policy may see, and why each other one waits: its dependencies,
    its array's ``--max-running``, its owner's caps on running jobs and held devices (a job
    still stopping counts with its devices until its processes are gone).  Running jobs
    always stay; queued ones are admitted by priority, then submission."""
    placed = [job for job in candidates if job.state in PLACED_STATES]
    array_running: dict[str, int] = {}
    user_running: dict[str, int] = {}
    user_devices: dict[str, int] = {}
    user_stopping: dict[str, list[int]] = {}
    for stop in limits.stopping:
        user_running[stop.owner] = user_running.get(stop.owner, 0) + 1
        user_devices[stop.owner] = user_devices.get(stop.owner, 0) + stop.count
        user_stopping.setdefault(stop.owner, []).append(stop.job_id)
    for job in placed:
        if job.spec.array_id is not None:
            array_running[job.spec.array_id] = array_running.get(job.spec.array_id, 0) + 1
        user_running[job.owner_name] = user_running.get(job.owner_name, 0) + 1
        user_devices[job.owner_name] = user_devices.get(job.owner_name, 0) + max(
            job.replicas, min_gpus(job)
        )
    admitted = list(placed)
    waiting: dict[int, str] = {}
    queued = [job for job in candidates if job.state not in PLACED_STATES]
    for job in sorted(queued, key=lambda j: (-j.priority, j.id)):
        verdict, why = dependency_verdict(job, limits.states)
        if verdict != "ready":
            waiting[job.id] = why if verdict == "wait" else f"waiting: {why}"
            continue
        array, cap = job.spec.array_id, job.spec.array_max_running
        if array is not None and cap is not None and array_running.get(array, 0) >= cap:
            waiting[job.id] = (
                f"waiting: array {array} has {array_running.get(array, 0)} tasks running,"
                f" its --max-running is {cap}"
            )
            continue
        user = job.owner_name
        stopping = user_stopping.get(user)
        still = f" (job(s) {', '.join(map(str, stopping))} still stopping)" if stopping else ""
        running_cap = limits.max_running_per_user
        if running_cap is not None and user_running.get(user, 0) >= running_cap:
            waiting[job.id] = (
                f"waiting: {user} has {user_running.get(user, 0)} jobs running{still}, the most"
                f" a user may ([limits] max_running_per_user = {running_cap})"
            )
            continue
        device_cap = limits.max_devices_per_user
        needs = min_gpus(job)
        if device_cap is not None and user_devices.get(user, 0) + needs > device_cap:
            waiting[job.id] = (
                f"waiting: {user}'s jobs hold {user_devices.get(user, 0)} devices{still}, this job"
                f" needs {needs} more, a user may hold {device_cap} ([limits]"
                " max_devices_per_user)"
            )
            continue
        if array is not None:
            array_running[array] = array_running.get(array, 0) + 1
        user_running[user] = user_running.get(user, 0) + 1
        user_devices[user] = user_devices.get(user, 0) + needs
        admitted.append(job)
    admitted.sort(key=lambda j: j.id)
    return admitted, waiting


def _within_user_caps(
    order: Sequence[JobRecord],
    targets: dict[int, Placement],
    nodes: Sequence[NodeSnapshot],
    limits: Limits,
) -> None:
    """Cut each user's targets to ``max_devices_per_user`` devices (in place): jobs that keep
    their devices first, then by priority and submission; an elastic job is trimmed to what is
    left when that is at least its minimum, any other job gets nothing (it waits, or is
    stopped when preemptible).  A job outside ``allowed_nodes`` gets nothing either."""
    for job in order:
        allowed = allowed_nodes(job, nodes)
        if allowed is not None and any(
            count > 0 and i not in allowed for i, count in enumerate(targets[job.id])
        ):
            targets[job.id] = tuple(0 for _ in nodes)
    cap = limits.max_devices_per_user
    if cap is None:
        return
    used: dict[str, int] = {}
    for stop in limits.stopping:  # devices its stopping jobs still hold
        used[stop.owner] = used.get(stop.owner, 0) + stop.count
    ranked = sorted(
        order,
        key=lambda j: (
            j.state not in PLACED_STATES,
            not (j.replicas and not is_elastic(j)),
            -j.priority,
            j.id,
        ),
    )
    for job in ranked:
        target = list(targets[job.id])
        have = used.get(job.owner_name, 0)
        count = sum(target)
        if have + count > cap:
            room = cap - have
            if is_elastic(job) and room >= min_gpus(job):
                for i in reversed(range(len(target))):
                    cut = min(target[i], count - room)
                    target[i] -= cut
                    count -= cut
            elif not (job.state in PLACED_STATES and not is_preemptible(job)):
                target = [0] * len(target)
            targets[job.id] = tuple(target)
        used[job.owner_name] = have + sum(targets[job.id])


@dataclass(frozen=True)
class _Sharing:
    """Shared jobs handled outside the policy: ``starts`` (queued ones packed onto devices
    that run shared jobs), ``kept`` (running ones, left as they are), and the nodes the policy
    sees (``policy_nodes``: those devices withheld, so that no other job is placed there)."""

    starts: tuple[Action, ...]
    kept: tuple[int, ...]
    policy_nodes: list[NodeSnapshot]

    @property
    def handled(self) -> set[int]:
        return {action.job_id for action in self.starts} | set(self.kept)


def _pack_shared(
    candidates: Sequence[JobRecord], nodes: Sequence[NodeSnapshot], slowdown: float
) -> _Sharing:
    """Pack queued shared jobs onto the devices that already run shared jobs while the memory
    they declared fits and sharing still pays (``core.sharing.choose_shared_device``); a
    shared job that fits nowhere goes to the policy as a one-device rigid job (its device then
    takes the next ones).  Devices running shared jobs are never offered to the policy: no
    elastic job ever shares a device."""
    hosts: dict[tuple[str, str], list[JobRecord]] = {}
    for job in candidates:
        if job.spec.shared and job.state in PLACED_STATES:
            for node_name, held in job.placement.items():
                for device in held:
                    hosts.setdefault((node_name, device), []).append(job)
    by_name = {node.name: node for node in nodes}
    offered: list[SharedDevice] = []
    for (node_name, device), jobs in sorted(hosts.items()):
        node = by_name.get(node_name)
        if node is None or node.memory is None or device not in node.free_devices:
            continue  # unknown memory, node down, drained or busy: nobody joins
        offered.append(
            SharedDevice(
                key=(node_name, device),
                jobs=len(jobs),
                used=sum(job.spec.gpu_memory or 0 for job in jobs),
                total=node.memory,
                free=node.free_memory.get(device),
            )
        )
    starts: list[Action] = []
    queued = [job for job in candidates if job.spec.shared and job.state not in PLACED_STATES]
    for job in sorted(queued, key=lambda j: (-j.priority, j.id)):
        memory = job.spec.gpu_memory or 0
        chosen = choose_shared_device(_allowed_devices(job, offered, nodes), memory, slowdown)
        if chosen is None:
            continue
        offered[offered.index(chosen)] = replace(
            chosen, jobs=chosen.jobs + 1, used=chosen.used + memory
        )
        node_name, device = chosen.key
        others = ", ".join(str(j.id) for j in hosts[chosen.key])
        speed = shared_speed(chosen.jobs + 1, slowdown)
        reason = (
            f"1 device(s) on {node_name}[{device}]; sharing it with job(s) {others}"
            f" ({chosen.jobs + 1} jobs, {format_size(chosen.used + memory)} of"
            f" {format_size(chosen.total)} declared); predicted speed {speed:.2f} of a device each"
        )
        starts.append(Action("start", job.id, {node_name: [device]}, None, reason))
        hosts[chosen.key].append(job)
    policy_nodes = [
        replace(
            node,
            withheld=node.withheld
            | frozenset(device for (name, device) in hosts if name == node.name),
        )
        for node in nodes
    ]
    kept = tuple(job.id for job in candidates if job.spec.shared and job.state in PLACED_STATES)
    return _Sharing(starts=tuple(starts), kept=kept, policy_nodes=policy_nodes)


def _allowed_devices(
    job: JobRecord, devices: Sequence[SharedDevice], nodes: Sequence[NodeSnapshot]
) -> list[SharedDevice]:
    """The shared devices on nodes the job's constraint allows."""
    allowed = allowed_nodes(job, nodes)
    if allowed is None:
        return list(devices)
    names = {nodes[i].name for i in allowed}
    return [device for device in devices if device.key[0] in names]


def _pack_onto_new_hosts(
    candidates: Sequence[JobRecord],
    allocations: dict[int, Allocation],
    nodes: Sequence[NodeSnapshot],
    slowdown: float,
) -> None:
    """Shared jobs the policy started (or left waiting) in this pass, packed together (in
    place): in priority then submission order, each joins a device another one just started
    on when it fits there (``choose_shared_device``), else keeps what the policy gave it (its
    device then takes the next ones).  Devices the policy gave but nobody uses stay free for
    the next pass."""
    memory = {node.name: node.memory for node in nodes}
    hosts: list[SharedDevice] = []
    queued = [job for job in candidates if job.spec.shared and job.state not in PLACED_STATES]
    for job in sorted(queued, key=lambda j: (-j.priority, j.id)):
        need = job.spec.gpu_memory or 0
        chosen = choose_shared_device(_allowed_devices(job, hosts, nodes), need, slowdown)
        if chosen is not None:
            hosts[hosts.index(chosen)] = replace(
                chosen, jobs=chosen.jobs + 1, used=chosen.used + need
            )
            allocations[job.id] = {chosen.key[0]: [chosen.key[1]]}
            continue
        allocation = allocations.get(job.id) or {}
        for node_name, devices in allocation.items():
            total = memory.get(node_name)
            if total is not None and devices:
                hosts.append(SharedDevice((node_name, devices[0]), jobs=1, used=need, total=total))


def _capped_view(
    job: JobRecord, model: Any | None, nodes: Sequence[NodeSnapshot], now: float, limits: Limits
) -> JobView:
    """The job's view with its upper bound cut to what it may ever hold: the devices its
    constraint allows, and its owner's device cap."""
    view = job_view(job, model, nodes, now)
    high = view.max_replicas
    if view.allowed_nodes is not None:
        high = min(high, sum(len(nodes[i].free_devices) for i in view.allowed_nodes))
    if limits.max_devices_per_user is not None:
        high = min(high, limits.max_devices_per_user)
    if high == view.max_replicas or view.rigid:
        return view
    return replace(view, max_replicas=max(high, view.min_replicas))


def progress_fraction(report: dict[str, Any]) -> float | None:
    """Share of its declared length a job has done: epoch / epochs from its report, or None
    when it declared no length."""
    epoch, epochs = report.get("epoch"), report.get("epochs")
    if not isinstance(epoch, int | float) or not isinstance(epochs, int | float) or epochs <= 0:
        return None
    return min(max(float(epoch) / float(epochs), 0.0), 1.0)


# --- expected time to the end ------------------------------------------------------------

#: The longest ETA given: an estimate beyond it says only that the job has very long to go.
MAX_ETA_S = 30 * 24 * 3600.0


def sane_eta(value: Any) -> float | None:
    """An ETA as shown: ``None`` for anything but a finite number >= 0, at most
    :data:`MAX_ETA_S`."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    if not math.isfinite(value) or value < 0:
        return None
    return min(float(value), MAX_ETA_S)


def progress_eta(job: JobRecord, now: float) -> float | None:
    """Seconds to the end of the job's declared length at its pace so far: with f = epoch /
    epochs done in t seconds of running, t * (1 - f) / f; ``None`` while unknown (no declared
    length, nothing done yet, or not run)."""
    fraction = progress_fraction(job.report or {})
    elapsed = run_time_s(job, now)
    if fraction is None or fraction <= 0 or elapsed <= 0:
        return None
    return sane_eta(elapsed * (1.0 - fraction) / fraction)


def fmt_duration(seconds: float) -> str:
    """A duration for a reason line: ``45 s``, ``12 min``, ``3h05m``, ``4d07h``."""
    whole = max(0, int(math.ceil(seconds)))
    if whole < 60:
        return f"{whole} s"
    minutes = whole // 60
    if minutes < 60:
        return f"{minutes} min"
    hours, minutes = divmod(minutes, 60)
    if hours < 48:
        return f"{hours}h{minutes:02d}m"
    days, hours = divmod(hours, 24)
    return f"{days}d{hours:02d}h"


# --- batch choice and predictions --------------------------------------------------------


def static_batch(job: JobRecord, replicas: int) -> BatchChoice | None:
    """m = ceil(M0 / K) within the local bounds, s = 1 (jobs without a model)."""
    base = job.spec.batch_size
    if not base or replicas <= 0:
        return None
    local = math.ceil(int(base) / replicas)
    low = int(job.spec.min_local_batch or 1)
    high = job.spec.max_local_batch
    local = max(low, local if high is None else min(local, int(high)))
    return BatchChoice(local_batch=local, accum_steps=1, replicas=replicas)


def choose_batch(
    job: JobRecord, model: Any | None, num_nodes: int, replicas: int
) -> BatchChoice | None:
    if replicas <= 0:
        return None
    if model is not None:
        try:
            return model.best_choice(num_nodes, replicas)
        except (ValueError, ArithmeticError):
            pass
    return static_batch(job, replicas)


def predict(model: Any | None, num_nodes: int, choice: BatchChoice | None) -> dict[str, float]:
    """Goodput, efficiency and speed-up over one device (best batch) for a choice."""
    if model is None or choice is None:
        return {}
    k, m, s = choice.replicas, choice.local_batch, choice.accum_steps
    goodput = float(np.asarray(model.goodput(num_nodes, k, m, s)).reshape(-1)[0])
    eff = float(np.asarray(model.efficiency(choice.total_batch)).reshape(-1)[0])
    single, _, _ = model.best_goodput(np.array([1]), np.array([1]))
    base = float(single[0])
    speedup = goodput / base if base > 0 else 0.0
    return {"goodput": goodput, "efficiency": eff, "speedup": speedup}


# --- placement -> concrete devices ----------------------------------------------------------


def assign_devices(
    targets: Mapping[int, Placement],
    current: Mapping[int, Allocation],
    nodes: Sequence[NodeSnapshot],
) -> dict[int, Allocation]:
    """Concrete devices for per-node counts.  A job whose count on a node is unchanged keeps
    its devices there; the others take the lowest free devices.  A count that cannot be met
    (devices busy outside the scheduler) is cut to what is free."""
    pool = {node.name: list(node.free_devices) for node in nodes}
    result: dict[int, Allocation] = {job_id: {} for job_id in targets}
    pending: list[tuple[int, str, int]] = []
    for job_id, placement in targets.items():
        for node, count in zip(nodes, placement, strict=False):
            if count <= 0:
                continue
            mine = list(current.get(job_id, {}).get(node.name, ()))
            if len(mine) == count and all(d in pool[node.name] for d in mine):
                result[job_id][node.name] = mine
                for device in mine:
                    pool[node.name].remove(device)
            else:
                pending.append((job_id, node.name, count))
    for job_id, node_name, count in pending:
        take, pool[node_name] = pool[node_name][:count], pool[node_name][count:]
        if take:
            result[job_id][node_name] = take
    return result


def same_allocation(a: Mapping[str, Sequence[str]], b: Mapping[str, Sequence[str]]) -> bool:
    keys = {k for k, v in a.items() if v} | {k for k, v in b.items() if v}
    return all(sorted(a.get(k, ())) == sorted(b.get(k, ())) for k in keys)


# --- the pass ----------------------------------------------------------------------------


def schedulable(job: JobRecord, now: float) -> bool:
    """Jobs the policy sees: queued (past any retry back-off) and running."""
    if job.state == "running":
        return True
    return job.state == "queued" and job.retry_after <= now


def plan_round(
    policy: Policy,
    jobs: Sequence[JobRecord],
    nodes: Sequence[NodeSnapshot],
    models: ModelCache,
    now: float,
    rng: np.random.Generator,
    limits: Limits | None = None,
) -> Plan:
    """Snapshot -> admission -> models -> ``policy.decide`` -> concrete devices and batch
    sizes -> Plan.

    Admission (:func:`_admit`) leaves waiting the queued jobs whose dependencies have not
    succeeded, whose array runs its ``--max-running`` already, or whose owner is at a cap.
    Whatever the policy answers, a rigid job starts only on exactly ``min_gpus`` devices,
    running keeps its devices unless it is preemptible (then it may only be stopped), no job
    runs outside its constraint and no user holds more than ``max_devices_per_user``."""
    limits = limits or Limits()
    candidates, held_back = _admit([job for job in jobs if schedulable(job, now)], limits)
    sharing = _pack_shared(candidates, nodes, limits.share_slowdown)
    nodes = sharing.policy_nodes
    candidates = [job for job in candidates if job.id not in sharing.handled]
    types = sorted({node.device_type for node in nodes})
    typed = len(types) > 1
    type_of = {node.name: node.device_type for node in nodes}
    memory_of: dict[str, int] = {}
    for node in nodes:
        if node.memory is not None:
            memory_of[node.device_type] = min(
                node.memory, memory_of.get(node.device_type, node.memory)
            )
    smallest = min(memory_of.values(), default=None)
    job_models = {job.id: models.model_for(job, memory_bytes=smallest) for job in candidates}
    by_type: dict[int, dict[str, Any]] = {}
    if typed:
        # CPU-backed devices are as fast as the CPU unless declared slower
        slowdowns = {
            n.device_type: n.slowdown or 1.0
            for n in nodes
            if n.devices and all(d.startswith("cpu") for d in n.devices)
        }
        for job in candidates:
            by_type[job.id] = models.models_by_type(job, types, memory_of)
            where = {type_of.get(name, "") for name in job.placement}
            job_models[job.id] = by_type[job.id].get(where.pop()) if len(where) == 1 else None
    views = [_capped_view(job, job_models[job.id], nodes, now, limits) for job in candidates]
    if typed:
        views = [
            replace(
                view,
                models_by_type=by_type[job.id],
                type_rates=models.type_rates(job, types, slowdowns) or None,
            )
            for job, view in zip(candidates, views, strict=True)
        ]
    node_views = [
        NodeView(
            name=n.name,
            devices=len(n.free_devices),
            up=n.up,
            device_type=n.device_type if typed else "",
        )
        for n in nodes
    ]
    decision = policy.decide(views, node_views, now, rng)
    empty: Placement = tuple(0 for _ in nodes)
    targets = {job.id: tuple(decision.placements.get(job.job_id, empty)) for job in candidates}
    for job in candidates:
        if is_elastic(job):
            continue
        target = targets[job.id]
        if job.state == "running" and job.replicas > 0:
            if sum(target) > 0 or not is_preemptible(job):
                targets[job.id] = placement_of(job.placement, nodes)
        elif sum(target) not in (0, min_gpus(job)):
            targets[job.id] = empty
    _within_user_caps(candidates, targets, nodes, limits)
    # rigid jobs first: the devices they keep are theirs before any other job's
    order = sorted(candidates, key=is_elastic)
    assigned = assign_devices(
        {job.id: targets[job.id] for job in order},
        {job.id: job.placement for job in candidates},
        nodes,
    )
    allocations: dict[int, Allocation] = {}
    for job in candidates:
        allocation = {k: v for k, v in assigned[job.id].items() if v}
        if 0 < sum(len(v) for v in allocation.values()) < min_gpus(job):
            allocation = {}
        allocations[job.id] = allocation
    _pack_onto_new_hosts(candidates, allocations, nodes, limits.share_slowdown)
    waits = _WaitingWords(decision, candidates, views, allocations, nodes, now)
    actions: list[Action] = []
    unchanged: list[int] = []
    reasons: dict[int, str] = {}
    predictions: dict[int, dict[str, float]] = {}
    for job in candidates:
        allocation = allocations[job.id]
        replicas = sum(len(v) for v in allocation.values())
        running = job.state == "running" and job.replicas > 0
        policy_reason = decision.reasons.get(job.job_id, "")
        if replicas == 0:
            reason = waits.reason(job)
            if running:
                actions.append(Action("stop", job.id, {}, None, f"preempted, {reason}"))
            else:
                unchanged.append(job.id)
                if reason != job.reason:
                    reasons[job.id] = reason
            continue
        num_nodes = len(allocation)
        model = job_models[job.id]
        if typed:  # the model of the type it is placed on
            placed_types = {type_of.get(name, "") for name in allocation}
            model = by_type[job.id].get(placed_types.pop()) if len(placed_types) == 1 else None
        choice = choose_batch(job, model, num_nodes, replicas) if is_elastic(job) else None
        try:
            prediction = predict(model, num_nodes, choice)
        except (ValueError, ArithmeticError):
            prediction = {}
        if running and same_allocation(allocation, job.placement):
            unchanged.append(job.id)
            if prediction != job.prediction:
                predictions[job.id] = prediction
            continue
        actions.append(
            Action(
                "resize" if running else "start",
                job.id,
                allocation,
                choice,
                describe(policy_reason, allocation, choice, prediction),
                prediction,
            )
        )
    for job in jobs:  # queued jobs waiting out a back-off
        if job.state == "queued" and job.retry_after > now:
            reason = backoff_reason(job, now)
            if reason != job.reason:
                reasons[job.id] = reason
    for job in jobs:  # held back by admission
        why = held_back.get(job.id)
        if why is not None and why != job.reason:
            reasons[job.id] = why
    actions.extend(sharing.starts)
    unchanged.extend(sharing.kept)
    return Plan(
        actions=tuple(actions),
        decision=decision,
        unchanged=tuple(unchanged),
        reasons=reasons,
        predictions=predictions,
    )


def backoff_reason(job: JobRecord, now: float) -> str:
    return f"waiting: retry in {fmt_duration(job.retry_after - now)} (back-off after a crash)"


def device_hours(seconds: float, digits: int | None = None) -> str:
    """Device-seconds as device-hours for a reason line (``digits``: decimals, else by size)."""
    hours = max(seconds, 0.0) / 3600.0
    if digits is None:
        digits = 0 if hours >= 10 else 1 if hours >= 0.1 else 2
    return f"{hours:.{digits}f}"


def _service_words(theirs: float, mine: float) -> str:
    """``it has used 0.4 device-hours, this job 3.2``, with the decimals that tell apart two
    different amounts."""
    it, this = device_hours(theirs), device_hours(mine)
    for digits in range(2, 5):
        if it != this or theirs == mine:
            break
        it, this = device_hours(theirs, digits), device_hours(mine, digits)
    return f"it has used {it} device-hours, this job {this}"


class _WaitingWords:
    """The reason line of each job left waiting in one pass, from the policy's facts
    (``Decision.waiting``) and what this pass knows: who holds which devices (their owners,
    device-hours used and expected ends), how many are free."""

    #: holders named in one line; the rest are counted
    SHOWN = 3

    def __init__(
        self,
        decision: Decision,
        candidates: Sequence[JobRecord],
        views: Sequence[JobView],
        allocations: Mapping[int, Allocation],
        nodes: Sequence[NodeSnapshot],
        now: float,
    ) -> None:
        self.decision = decision
        self.records = {job.job_id: job for job in candidates}
        self.views = {view.id: view for view in views}
        self.held = {
            job.job_id: sum(len(v) for v in allocations[job.id].values()) for job in candidates
        }
        # the jobs holding devices, most devices first
        self.holding = sorted(
            (job_id for job_id, count in self.held.items() if count > 0),
            key=lambda job_id: (-self.held[job_id], int(job_id) if job_id.isdigit() else 0),
        )
        self.offered = sum(len(node.free_devices) for node in nodes)
        self.free = self.offered - sum(self.held.values())
        self.now = now

    def reason(self, job: JobRecord) -> str:
        facts = self.decision.waiting.get(job.job_id)
        policy_reason = self.decision.reasons.get(job.job_id, "")
        needs = min_gpus(job)
        devices = f"{needs} device{'s' if needs > 1 else ''}"
        if facts is not None and facts.rule == "size":
            return f"waiting: needs {devices}, the nodes offer {self.offered} now"
        if facts is not None and facts.rule == "bounds":
            return policy_reason or "cannot run: no feasible replica count within its bounds"
        head = f"waiting: needs {devices}, {self.free} free"
        if facts is not None and facts.rule == "placement":
            return f"{head}, but no placement of them fits without sharing nodes"
        placed = sum(self.decision.placements.get(job.job_id, ())) > 0
        if facts is None and not placed and policy_reason not in ("", "waiting", "running"):
            said = policy_reason.removeprefix("waiting: ")
            head = f"waiting: {said}; needs {devices}, {self.free} free"
        return head + self._holders(job, facts)

    def _holders(self, job: JobRecord, facts: Waiting | None) -> str:
        """``; job 6 (alice) holds 2 (rigid, not preemptible; expected to finish in 20 min)``"""
        rules = {h.id: h.rule for h in facts.holders} if facts is not None else None
        holders = [
            job_id
            for job_id in self.holding
            if job_id != job.job_id and (rules is None or job_id in rules)
        ]
        if not holders:
            return ""
        parts = [
            self._holder(job, job_id, rules.get(job_id, "") if rules else "")
            for job_id in holders[: self.SHOWN]
        ]
        rest = holders[self.SHOWN :]
        if rest:
            count = sum(self.held[job_id] for job_id in rest)
            many = len(rest) > 1
            parts.append(f"{len(rest)} more job{'s hold' if many else ' holds'} {count}")
        return "; " + "; ".join(parts)

    def _holder(self, job: JobRecord, holder_id: str, rule: str) -> str:
        holder = self.records[holder_id]
        me, them = self.views[job.job_id], self.views[holder_id]
        notes = []
        if rule == "rigid":
            notes.append("rigid, not preemptible")
        elif rule == "priority":
            notes.append(f"priority {them.priority}, this job {me.priority}")
        elif rule == "service" and them.attained_gpu_s == me.attained_gpu_s:
            first = "was running" if them.replicas else "was submitted first"
            hours = device_hours(me.attained_gpu_s)
            notes.append(f"fair share: both have used {hours} device-hours, it {first}")
        elif rule in ("service", "kept"):
            used = _service_words(them.attained_gpu_s, me.attained_gpu_s)
            if rule == "service":
                notes.append(f"fair share: {used}")
            else:
                notes.append(f"running jobs are preempted only for much less served ones: {used}")
        eta = progress_eta(holder, self.now)
        if eta is not None:
            notes.append(f"expected to finish in {fmt_duration(eta)}")
        text = f"job {holder_id} ({holder.owner_name}) holds {self.held[holder_id]}"
        return text + (f" ({'; '.join(notes)})" if notes else "")


def describe(
    policy_reason: str,
    allocation: Mapping[str, Sequence[str]],
    choice: BatchChoice | None,
    prediction: Mapping[str, float],
) -> str:
    """One line for ``show`` and the TUI: why, where, which batch, predicted figures."""
    replicas = sum(len(v) for v in allocation.values())
    where = ", ".join(f"{node}[{','.join(devs)}]" for node, devs in allocation.items())
    parts = [f"{replicas} device(s) on {where}"]
    if choice is not None:
        parts.append(
            f"batch {choice.local_batch}x{choice.accum_steps}x{choice.replicas}={choice.total_batch}"
        )
    if prediction:
        parts.append(
            f"predicted speedup x{prediction['speedup']:.2f} vs 1 device, "
            f"efficiency {prediction['efficiency']:.2f}, goodput {prediction['goodput']:.1f}/s"
        )
    if policy_reason:
        parts.append(policy_reason)
    return "; ".join(parts)
