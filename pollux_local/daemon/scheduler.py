"""The daemon's side of a scheduling pass: job records and fitted models -> a snapshot.

The pass itself is pure and lives in :mod:`pollux_local.core.schedule` (admission, sharing,
the policy, devices, batch sizes, reasons); this module fits each job's models from its
reports (:class:`ModelCache`) and turns the store's records into the pass's typed inputs
(:func:`job_input`, :func:`snapshot_of`); :func:`plan_round` runs the pass on them.
"""

from __future__ import annotations

import hashlib
import itertools
import json
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import msgspec
import numpy as np

from pollux_local.api.report import JobReport, ProfileRow, ReportBounds
from pollux_local.api.spec import JobSpec
from pollux_local.api.states import TERMINAL_STATES, JobState
from pollux_local.core.fitting import fit_points, points_from_rows
from pollux_local.core.goodput import GoodputModel
from pollux_local.core.memory import largest_local_batch
from pollux_local.core.pool import Point, ProfilePool, Times
from pollux_local.core.schedule import (
    Action,
    ActionKind,
    AfterMode,
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
    Verdict,
    dependency_verdict,
    run_pass,
    schedulable,
    views,
)
from pollux_local.core.types import BatchBounds, GradStats, Policy
from pollux_local.daemon.commands import command_digest
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
    (:class:`ModelCache`, one :class:`~pollux_local.core.pool.ProfilePool` per owner).  The
    kind is the SHA-256 (hex) of those fields as JSON, the command by its own digest
    (:func:`~pollux_local.daemon.commands.command_digest`, made once per command, not per
    job and pass): 64 characters however long the command, since it is a key in every pool
    and in ``forecasting.Durations`` (a megabytes-long command as the key itself made each
    of them hold megabytes).  Every pass asks the kind of every queued and running job:
    digesting a command of 4 MB of two-byte characters as escaped JSON took 36 ms a job, and
    one user's 200 such array tasks (one stored command) made each pass 15 s under the
    daemon's mutex."""
    fields = [
        command_digest(job.spec.argv) if name == "argv" else getattr(job.spec, name)
        for name in _KIND_FIELDS
    ]
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()


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
#: Fits run per owner and pass (``ModelCache.begin_pass``; a fit costs 8-30 ms): past it, that
#: owner's jobs whose points changed keep their older model (or none yet) until a later pass,
#: the longest-waiting first.  Fits of points already fitted (jobs of a kind whose merged
#: points are the same) are shared and not counted.
FITS_PER_OWNER = 8


@dataclass
class _Fit:
    """One job's model inputs and fit: its profile rows as last seen (the report's list), its
    points, the version of its kind's pool it last looked at, the digest of the merged points
    its fit is of (``b""``: none yet), the fit, and the pass since which a fit it needs has
    been put off (0: none is)."""

    rows: Sequence[ProfileRow]
    own: dict[Point, Times]
    version: int = -1
    key: bytes = b""
    own_key: bytes = b""
    params: Any = None
    correction: Any = None
    waiting_since: int = 0


def _goodput_model(slot: _Fit, grad: GradStats | None, bounds: BatchBounds | None) -> Any | None:
    """The ``GoodputModel`` of ``slot``'s fit with these statistics and bounds (``None`` when
    any of the three is missing): what a pass and ``show`` both build."""
    if slot.params is None or grad is None or bounds is None:
        return None
    return GoodputModel(params=slot.params, stats=grad, bounds=bounds, correction=slot.correction)


@dataclass(frozen=True)
class _Fitted:
    """A fit of one set of merged points (``params`` ``None``: they could not be fitted)."""

    params: Any
    correction: Any


def _points_digest(points: Mapping[Point, Times]) -> bytes:
    """A digest of merged points, in their order (what a fit is a function of)."""
    flat = np.array([(*point, *times) for point, times in points.items()], dtype=np.float64)
    return hashlib.sha256(flat.tobytes()).digest()


class ModelCache:
    """Fitted goodput models per job.  A job's throughput model is fitted to the points its
    owner's jobs of its kind reported (its own win where both have one): one user's reports
    never reach another user's model.  Its points are taken in when its report's profile
    changed and it is refitted only when they or its kind's pooled points changed (the pool's
    version), so a pass costs O(jobs) whatever the jobs reported: a report holds at most
    ``api.report.MAX_PROFILE_ROWS`` rows, a pool ``POOL_POINTS`` per kind and ``POOL_KINDS``
    kinds per owner.  Before a job has reported gradient statistics it uses the first ones its
    owner's jobs of its kind reported in a first epoch."""

    def __init__(self, fits_per_owner: int = FITS_PER_OWNER) -> None:
        self._fits: OrderedDict[int | tuple[int, str], _Fit] = OrderedDict()
        self._pools: dict[int, ProfilePool] = {}
        #: fits by the digest of the merged points they are of, shared by the jobs (of any
        #: owner) whose merged points are the same
        self._shared: OrderedDict[bytes, _Fitted] = OrderedDict()
        self.fits_per_owner = fits_per_owner
        self._spent: dict[int, int] = {}
        self._pass = 1
        self.fit_count = 0

    def begin_pass(self) -> None:
        """A new scheduling pass: each owner may have :data:`FITS_PER_OWNER` fits run again."""
        self._pass += 1
        self._spent.clear()

    def fit_order(self, jobs: Sequence[JobRecord]) -> list[JobRecord]:
        """``jobs`` with those whose fit has waited longest first (the order a pass asks for
        models in, so that a budget spent every pass reaches every job in turn)."""

        def waited(job: JobRecord) -> int:
            slot = self._fits.get(job.id)
            return slot.waiting_since if slot is not None and slot.waiting_since else self._pass

        return sorted(jobs, key=waited)

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
        """How many points the job's (untyped) model is fitted to: its own and its kind's
        (a read: nothing is made or changed)."""
        slot = self._fits.get(job.id)
        own = slot.own if slot is not None else {}
        pool = self._pools.get(job.owner_uid)
        return len(own) if pool is None else len(pool.points_for(job_kind(job), own))

    def current(self, job: JobRecord) -> Any | None:
        """The job's (untyped) model as the passes last fitted it, or ``None`` when they have
        fitted none: a read for ``show``, which changes nothing.  A request of any user's
        runs no fit (8-30 ms on the daemon's event loop), spends no owner's budget of fits and
        touches no slot or pool while a pass uses them in its thread (:meth:`model_for`
        does all three: review s63)."""
        slot = self._fits.get(job.id)
        if slot is None or slot.params is None:
            return None
        report = job.report or _NO_REPORT
        stats = report.grad_stats
        grad = None if stats is None else GradStats(sqr=stats.sqr, var=stats.var)
        if grad is None:
            pool = self._pools.get(job.owner_uid)
            grad = None if pool is None else pool.start_stats(job_kind(job))
        return _goodput_model(slot, grad, _bounds_from(job, report))

    def models_by_type(
        self,
        job: JobRecord,
        types: Sequence[str],
        memory: Mapping[str, int] | None = None,
        refit: bool = True,
    ) -> dict[str, Any]:
        """On a cluster of several device ``types``: the job's model per type, each fitted to
        the points its kind measured on that type (profile rows tagged ``device_type``) and
        with its local batch bounded by the type's ``memory``; a type nothing was measured on,
        or on which not even one example fits, has none."""
        rows = (job.report or _NO_REPORT).profile
        models: dict[str, Any] = {}
        for device_type in types:
            mine = [row for row in rows if row.device_type == device_type]
            memory_bytes = (memory or {}).get(device_type)
            if refit:
                model = self.model_for(job, device_type, mine, memory_bytes)
            else:
                model = self.model_for(job, device_type, mine, memory_bytes, refit=False)
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
        *,
        refit: bool = True,
    ) -> Any | None:
        """The job's ``GoodputModel``, or ``None`` while neither it nor its kind has reported a
        profile and gradient statistics.  With ``device_type``, the model of that type, fitted
        to ``rows`` (the job's rows measured there) and its kind's points on that type.  With
        ``memory_bytes`` (a device's memory) and peak-memory points in the job's report, the
        local batch is bounded by what fits (``core.memory.largest_local_batch``); ``None``
        when not even one example fits.  Without ``refit``, the fit it has (none: ``None``) even
        when its points changed."""
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
            if slot is None:
                slot = _Fit(rows=list(raw), own=own)
            else:  # new points: looked at again, its older fit kept meanwhile
                slot.rows, slot.own, slot.own_key, slot.version = list(raw), own, b"", -1
            self._fits[slot_key] = slot
            self._fits.move_to_end(slot_key)
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
        if slot.version != version and refit:  # first use, or its or its kind's points changed
            self._refit(slot, pool, kind, version, job.owner_uid)
        return _goodput_model(slot, grad, bounds)

    def _refit(
        self, slot: _Fit, pool: ProfilePool, kind: str, version: int, owner_uid: int
    ) -> None:
        """Fit ``slot`` to its merged points (its own and its ``kind``'s in ``pool``, at the
        pool's ``version``):
        nothing when they are those its fit is of, a shared fit when another job's merged
        points are the same, else a fit within its owner's budget for the pass (past it, the
        older fit stays and the slot is looked at again next pass)."""
        spent = self._spent.get(owner_uid, 0)
        if spent >= self.fits_per_owner and slot.waiting_since:
            return  # already put off, and no fit left to this owner now: not looked at again
        own = slot.own
        points: dict[Point, Times] | None = None
        if pool.covered_by(kind, own):  # its own points are all of them: digested once
            if not slot.own_key:
                slot.own_key = _points_digest(dict(sorted(own.items())))
            key = slot.own_key
        else:
            points = dict(sorted(pool.points_for(kind, own).items()))
            key = _points_digest(points)
        if key == slot.key:
            slot.version, slot.waiting_since = version, 0
            return
        fitted = self._shared.get(key)
        if fitted is None:
            if spent >= self.fits_per_owner:
                slot.waiting_since = slot.waiting_since or self._pass
                return
            self._spent[owner_uid] = spent + 1
            self.fit_count += 1
            if points is None:
                points = dict(sorted(own.items()))
            try:
                done = fit_points(points)
                fitted = _Fitted(done.params, done.correction)
            except ValueError:  # none, or hopeless: tried again when the points change
                fitted = _Fitted(None, None)
            self._shared[key] = fitted
            while len(self._shared) > FITS_KEPT:
                self._shared.popitem(last=False)
        else:
            self._shared.move_to_end(key)
        slot.version, slot.key, slot.waiting_since = version, key, 0
        slot.params, slot.correction = fitted.params, fitted.correction


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


def _dependency(job_id: int, state: JobState | None) -> Dependency:
    outcome = None if state is None else _OUTCOMES.get(state, Outcome.PENDING)
    return Dependency(job_id, outcome, "" if state is None else state.value)


def dependencies_of(job: JobRecord, states: Mapping[int, JobState]) -> tuple[Dependency, ...]:
    """The jobs ``job`` runs after, each with its outcome from ``states`` (job id -> state;
    a job absent there does not exist).  A pass takes :func:`after_summary` instead."""
    return tuple(_dependency(int(dep), states.get(int(dep))) for dep in job.spec.after)


@dataclass(frozen=True)
class AfterSummary:
    """A job's dependencies as a pass needs them (``JobInput.after`` and ``after_pending``):
    ``after`` holds the first one not met (it decides the verdict and names the reason) and,
    when one further on fails the job whatever else ends, that one; ``pending`` the ids of
    those not ended between them.  After one of its dependencies (``ONE_SUCCEEDED``): none
    when one succeeded, else the first not ended (or, when all ended, the first named) and
    the ids of the others not ended.  A job naming a thousand jobs costs a pass one or two
    objects, not a thousand."""

    after: tuple[Dependency, ...] = ()
    pending: tuple[int, ...] = ()

    def verdict(self, mode: AfterMode) -> tuple[Verdict, str]:
        """The same as ``dependency_verdict`` over every dependency."""
        return dependency_verdict(self.after, mode, self.pending)


_NO_DEPENDENCIES = AfterSummary()
_SUCCEEDED = frozenset({JobState.SUCCEEDED})
#: The states in which a dependency is met: succeeded (``--after``, ``--after-one-of``), or
#: ended (``--after-any``).
_MET = {
    AfterMode.ALL_SUCCEEDED: _SUCCEEDED,
    AfterMode.ALL_ENDED: TERMINAL_STATES,
    AfterMode.ONE_SUCCEEDED: _SUCCEEDED,
}


def after_mode(spec: JobSpec) -> AfterMode:
    """What ``spec``'s dependencies must do before it starts (``after_any``, ``after_one``;
    a spec giving both is refused, ``jobrules.check_job``)."""
    if spec.after_one:
        return AfterMode.ONE_SUCCEEDED
    return AfterMode.ALL_ENDED if spec.after_any else AfterMode.ALL_SUCCEEDED


class DependencyStates:
    """The states of the jobs others depend on (job id -> state; a job absent does not exist),
    as one pass reads them: the ids met each way (:data:`_MET`) kept as sets of integers, so
    that a job's list is mostly skipped at C speed (hashing a ``JobState`` is a Python call),
    and each job's ids parsed once."""

    def __init__(self, states: Mapping[int, JobState]) -> None:
        self.states = states
        # one set per distinct meaning (``--after`` and ``--after-one-of`` share theirs)
        built = {
            met: {job_id for job_id, state in states.items() if state in met}
            for met in set(_MET.values())
        }
        self._met = {mode: built[met] for mode, met in _MET.items()}
        self._ids: dict[int, list[int]] = {}

    def ids(self, job: JobRecord) -> list[int]:
        """The ids ``job`` names, in order."""
        ids = self._ids.get(job.id)
        if ids is None:
            ids = self._ids[job.id] = list(map(int, job.spec.after))
        return ids

    def failed(self, states: dict[int, JobState], job_id: int) -> None:
        """Job ``job_id``, depended on, failed (``states``: the same mapping, writable)."""
        states[job_id] = JobState.FAILED
        for mode, met in self._met.items():
            if JobState.FAILED in _MET[mode]:
                met.add(job_id)
            else:
                met.discard(job_id)

    def summary(self, job: JobRecord) -> AfterSummary:
        """``job``'s dependencies summarised in one scan of its list, stopping at the first
        that fails it (or, after one of them, that lets it start)."""
        spec = job.spec
        if not spec.after:
            return _NO_DEPENDENCIES
        ids = self.ids(job)
        mode = after_mode(spec)
        met = self._met[mode]
        get = self.states.get
        if mode is AfterMode.ONE_SUCCEEDED:
            if not met.isdisjoint(ids):
                return _NO_DEPENDENCIES
            ended, states = self._met[AfterMode.ALL_ENDED], self.states
            waiting = [
                dep for dep in itertools.filterfalse(ended.__contains__, ids) if dep in states
            ]
            # the reason names what it waits for, or (none left) the first it fails on
            named = waiting[0] if waiting else ids[0]
            return AfterSummary((_dependency(named, get(named)),), tuple(waiting[1:]))
        first: Dependency | None = None
        pending: list[int] = []
        # only those not met are looked at one by one
        for dep in itertools.filterfalse(met.__contains__, ids):
            state = get(dep)
            if first is None:
                first = _dependency(dep, state)
                if first.outcome is not Outcome.PENDING:
                    break
            elif state is None or state is JobState.FAILED or state is JobState.CANCELLED:
                # it fails the job whatever else ends (``after_any``: only one that is missing)
                return AfterSummary((first, _dependency(dep, state)), tuple(pending))
            else:
                pending.append(dep)
        return AfterSummary(() if first is None else (first,), tuple(pending))


def after_summary(job: JobRecord, states: Mapping[int, JobState]) -> AfterSummary:
    """``job``'s dependencies summarised from ``states`` (as for :func:`dependencies_of`)."""
    if not job.spec.after:
        return _NO_DEPENDENCIES
    return DependencyStates(states).summary(job)


def dependency_ids(jobs: Sequence[JobRecord]) -> tuple[set[int], DependencyStates]:
    """Every job id the ``jobs`` depend on, and a :class:`DependencyStates` that remembers each
    job's ids as parsed here (its states are given to :func:`resolve_dependencies`)."""
    parsed = DependencyStates({})
    return set().union(*(parsed.ids(job) for job in jobs)), parsed


def resolve_dependencies(
    jobs: Sequence[JobRecord],
    states: dict[int, JobState],
    parsed: DependencyStates | None = None,
) -> tuple[dict[int, AfterSummary], list[tuple[JobRecord, str]]]:
    """The queued and held ``jobs`` whose dependencies fail them (``dependency N failed``), and
    their dependents in turn, in the order found, each with its reason (``states``, of the
    jobs depended on, is updated: each of them failed), and the :class:`AfterSummary` of every
    other one.  Pure (the loop runs it off the event loop and records the failures): each
    job's dependencies are scanned once, and again only when one it depends on failed in the
    same pass, the same verdicts in the same order as scanning every job again until none
    fails.  ``parsed``: from :func:`dependency_ids` (the ids it parsed are not parsed again)."""
    view = DependencyStates(states)
    if parsed is not None:
        view._ids = parsed._ids
    summaries: dict[int, AfterSummary] = {}
    failures: list[tuple[JobRecord, str]] = []
    failed: set[int] = set()

    def scan(batch: Sequence[JobRecord]) -> list[int]:
        newly = []
        for job in batch:
            if job.id in failed or job.state in TERMINAL_STATES:
                continue
            summary = view.summary(job)
            verdict, why = summary.verdict(after_mode(job.spec))
            if verdict is not Verdict.FAIL:
                summaries[job.id] = summary
                continue
            summaries.pop(job.id, None)
            failures.append((job, why))
            failed.add(job.id)
            if job.id in states:
                view.failed(states, job.id)
                newly.append(job.id)
        return newly

    newly = scan(jobs)
    dependents: dict[int, list[JobRecord]] | None = None
    order = {job.id: n for n, job in enumerate(jobs)}
    while newly:  # only the dependents of the jobs that just failed can change
        if dependents is None:
            dependents = {}
            for job in jobs:
                for dep in set(view.ids(job)):
                    dependents.setdefault(dep, []).append(job)
        again = {job.id: job for gone in newly for job in dependents.get(gone, ())}
        newly = scan(sorted(again.values(), key=lambda job: order[job.id]))
    return summaries, failures


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
    dependencies: AfterSummary | None = None,
) -> JobInput:
    """A stored job as the pass takes it (``states``: of the jobs it depends on, or
    ``dependencies``: its dependencies summarised from them; ``resize_costs``: what its resizes
    were measured to cost)."""
    costs = resize_costs or ResizeCosts()
    after = dependencies if dependencies is not None else after_summary(job, states or {})
    report = job.report or _NO_REPORT
    profiled = [row.replicas for row in report.profile]
    spec = job.spec
    constraint = spec.constraint
    return JobInput(
        id=job.id,
        owner=job.owner_name,
        phase=_PHASES.get(job.state, JobPhase.QUEUED),
        submit_time=job.submit_time,
        queued_since=job.queued_since,
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
        after=after.after,
        after_mode=after_mode(spec),
        after_pending=after.pending,
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
    a group is the admin's), each paused as the store says (an admin's group by the admin's
    pause alone: a user's hidden group of its name keeps its own, ``GroupRecord``)."""
    paused = {row.name: row.admins_paused for row in stored}
    limits = {
        row.name: GroupLimit(row.max_devices, row.max_running, row.paused, owner=row.owner_name)
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
    dependencies: Mapping[int, AfterSummary] | None = None,
    stopping: Sequence[Holding] = (),
    resize_costs: Mapping[int, ResizeCosts] | None = None,
) -> Snapshot:
    """The pass's snapshot: the queued, running and rescaling ``jobs``, each with its fitted
    models (the jobs the pass may schedule: queued past any back-off, and running), on the
    smallest device memory of the cluster and, on a cluster of several device types, per
    type, with its kind's speed per type; under ``limits``, with ``states`` (job id -> state,
    any state) of the jobs others depend on (or, per job, ``dependencies``: each job's
    summarised from them once a pass, ``resolve_dependencies``) and the jobs still ``stopping``, each counted as a
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
    bare: dict[int, JobInput] = {}
    view: DependencyStates | None = None
    for job in jobs:
        if job.state not in _PHASES:  # held or ended: no part in a pass
            continue
        summary = (dependencies or {}).get(job.id)
        if summary is None:
            if view is None:
                view = DependencyStates(states or {})
            summary = view.summary(job)
        bare[job.id] = job_input(
            job, resize_costs=(resize_costs or {}).get(job.id), dependencies=summary
        )
    fitted: dict[int, JobInput] = {}
    wanted = [job for job in jobs if job.id in bare and schedulable(bare[job.id], now)]
    for job in models.fit_order(wanted):  # the longest waiting for a fit first
        # a queued job that cannot start this pass (its --begin is later, its dependencies
        # have not let it) keeps the model it has: it is not fitted for it
        refit = _may_start(bare[job.id], now)
        if refit:
            model = models.model_for(job, memory_bytes=smallest)
        else:
            model = models.model_for(job, memory_bytes=smallest, refit=False)
        if typed:
            fitted[job.id] = replace(
                bare[job.id],
                model=model,
                models_by_type=models.models_by_type(job, types, memory_of, refit=refit),
                type_rates=models.type_rates(job, types, slowdowns),
            )
        else:
            fitted[job.id] = replace(bare[job.id], model=model)
    limits = limits or Limits()
    inputs = [in_own_group(fitted.get(job_id, found), limits) for job_id, found in bare.items()]
    stopping = [in_own_group(stop, limits) for stop in stopping]
    return Snapshot(jobs=inputs, nodes=nodes, now=now, limits=limits, holdings=stopping)


_Member = TypeVar("_Member", JobInput, Holding)


def in_own_group(job: _Member, limits: Limits) -> _Member:
    """``job`` (or a stopping job's holding) with no group when the group it names is another
    user's: a user's group holds its owner's jobs alone, whatever names a job kept (an
    admin's group the config dropped, whose name a user then took)."""
    group = limits.groups.get(job.group) if job.group is not None else None
    if group is None or group.has_member(job.owner):
        return job
    return replace(job, group=None)


def _may_start(job: JobInput, now: float) -> bool:
    """Whether the pass may start or keep ``job`` now: running, or queued past its --begin
    with its dependencies met."""
    if job.phase is not JobPhase.QUEUED:
        return True
    if job.begin_at is not None and job.begin_at > now:
        return False
    verdict, _ = dependency_verdict(job.after, job.after_mode, job.after_pending)
    return verdict is Verdict.READY


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
    dependencies: Mapping[int, AfterSummary] | None = None,
    stopping: Sequence[Holding] = (),
    resize_costs: Mapping[int, ResizeCosts] | None = None,
) -> Plan:
    """The pass (``core.schedule.run_pass``) on the stored jobs (arguments as
    :func:`snapshot_of`); each owner's budget of fits starts again
    (``ModelCache.begin_pass``)."""
    models.begin_pass()
    snapshot = snapshot_of(
        jobs, nodes, models, now, limits, states=states, dependencies=dependencies,
        stopping=stopping, resize_costs=resize_costs,
    )  # fmt: skip
    return run_pass(snapshot, policy, rng)


def run_time_s(job: JobRecord, now: float) -> float:
    """Seconds the job has run, the run in progress included."""
    return views.run_time_s(job_input(job, dependencies=_NO_DEPENDENCIES), now)


def time_left_s(job: JobRecord, now: float) -> float | None:
    """Seconds the job may still run before its time limit (``None``: no limit)."""
    return views.time_left_s(job_input(job, dependencies=_NO_DEPENDENCIES), now)


def progress_eta(job: JobRecord, now: float) -> float | None:
    """Seconds to the end of the job's declared length at its pace so far
    (``core.schedule.views.progress_eta``)."""
    return views.progress_eta(job_input(job, dependencies=_NO_DEPENDENCIES), now)
