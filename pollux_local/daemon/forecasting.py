"""Expected starts and finishes: the live state replayed forward through the scheduling pass.

:class:`Forecasts` is what the loop keeps: after each pass it forecasts every queued and
running job (``core.schedule.forecast``: the pass itself run again on the snapshot at each
expected job end), and ``estimate`` answers for jobs as they would be submitted now,
without storing them.  A job's expected remaining time is, running, its own
ETA (``readmodel.job_eta``) or else its kind's typical length less the time it has run;
queued, its kind's typical length (:class:`Durations`: the median run time of its owner's
finished jobs of the same kind), less what it ran before; never past its time limit; and
unknown when its kind never finished.  An unknown length under a time limit is replayed until
the limit, a worst case, and what rests on it is marked an upper bound ("at the latest":
``Prediction.start_at_latest``, ``finish_at_latest``; the rule is ``core.schedule.forecast``'s).

The jobs ``estimate`` adds are forecast with the ids a submit would give them, above every
stored one: the pass orders jobs that are equal to it by id.
"""

from __future__ import annotations

import statistics
from collections import OrderedDict, deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from pollux_local.api.states import PLACED_STATES, JobState
from pollux_local.core.schedule import Holding, Limits, NodeInput
from pollux_local.core.schedule.forecast import Prediction, forecast
from pollux_local.core.types import Policy
from pollux_local.daemon.readmodel import MetricHistory, job_eta
from pollux_local.daemon.resizes import ResizeCosts
from pollux_local.daemon.scheduler import (
    AfterSummary,
    ModelCache,
    job_kind,
    progress_eta,
    run_time_s,
    snapshot_of,
    time_left_s,
)
from pollux_local.daemon.state import JobRecord, StateStore

#: Run times kept per kind (the newest).
KEPT_PER_KIND = 20
#: Kinds remembered per owner (the least recently finished is forgotten first).
KINDS_PER_OWNER = 64
#: Finished jobs read per refresh.
READ_AT_ONCE = 1000


class Durations:
    """How long jobs of a kind run: the run times of its owner's finished (succeeded) jobs of
    that kind (``scheduler.job_kind``, a fixed-size digest), the newest :data:`KEPT_PER_KIND`
    per kind and :data:`KINDS_PER_OWNER` kinds per owner (the one whose last job finished
    longest ago is forgotten first), so one owner's thousands of kinds hold a bounded
    memory."""

    def __init__(self, kinds_per_owner: int = KINDS_PER_OWNER) -> None:
        self._times: dict[int, OrderedDict[str, deque[float]]] = {}
        self.kinds_per_owner = kinds_per_owner
        self._since: float | None = None
        self._seen: set[int] = set()

    def note(self, job: JobRecord) -> None:
        if job.id in self._seen or job.run_time_s <= 0:
            return
        self._seen.add(job.id)
        kinds = self._times.setdefault(job.owner_uid, OrderedDict())
        kind = job_kind(job)
        times = kinds.pop(kind, None) or deque(maxlen=KEPT_PER_KIND)
        times.append(job.run_time_s)
        kinds[kind] = times  # the most recently finished last
        while len(kinds) > self.kinds_per_owner:
            kinds.popitem(last=False)

    def kinds(self, owner_uid: int) -> int:
        """How many kinds of ``owner_uid`` are remembered."""
        return len(self._times.get(owner_uid, ()))

    def refresh(self, store: StateStore) -> None:
        """Take in the jobs that succeeded since the last refresh (the newest
        :data:`READ_AT_ONCE` at first)."""
        jobs, _, _ = store.page_jobs(
            states=[JobState.SUCCEEDED], finished_since=self._since, limit=READ_AT_ONCE
        )
        for job in reversed(jobs):
            self.note(job)
        ends = [job.end_time for job in jobs if job.end_time is not None]
        if ends:
            self._since = max(ends)
            self._seen = {job.id for job in jobs if job.end_time == self._since}

    def typical(self, job: JobRecord) -> float | None:
        """The median run time of the job's kind (``None``: none finished)."""
        kinds = self._times.get(job.owner_uid)
        times = None if kinds is None else kinds.get(job_kind(job))
        return statistics.median(times) if times else None


def remaining_s(
    job: JobRecord, now: float, durations: Durations, metrics: MetricHistory | None = None
) -> float | None:
    """Expected seconds of running the job still has (``None``: unknown)."""
    typical = durations.typical(job)
    done = run_time_s(job, now)
    if job.state in PLACED_STATES:
        left = job_eta(job, now, metrics)
        if left is None and typical is not None:
            # past its kind's typical length: it ends soon, by an unknown amount
            left = max(typical - done, 0.05 * typical)
    else:
        left = progress_eta(job, now)
        if left is None and typical is not None:
            left = max(typical - done, 0.05 * typical)
    limit = time_left_s(job, now)
    if left is not None and limit is not None:
        left = min(left, limit)
    return left


@dataclass
class Forecasts:
    """The latest forecast of every queued and running job (job id -> :class:`Prediction`)
    and what the last pass saw, for ``estimate``."""

    latest: dict[int, Prediction] = field(default_factory=dict)
    durations: Durations = field(default_factory=Durations)
    metrics: MetricHistory | None = None
    #: the last pass's policy, nodes, models, limits, dependencies' states and stopping jobs
    inputs: _Inputs | None = None

    def update(
        self,
        policy: Policy,
        jobs: Sequence[JobRecord],
        nodes: Sequence[NodeInput],
        models: ModelCache,
        limits: Limits,
        now: float,
        *,
        states: Mapping[int, JobState] | None = None,
        dependencies: Mapping[int, AfterSummary] | None = None,
        stopping: Sequence[Holding] = (),
        resize_costs: Mapping[int, ResizeCosts] | None = None,
    ) -> None:
        """Forecast every job of a pass (its inputs, as ``scheduler.plan_round`` takes them,
        the measured ``resize_costs`` included: without them the replayed pass decided with
        the configured restart cost and forecast other allocations than the pass made)."""
        self.inputs = _Inputs(
            policy, list(nodes), models, limits, dict(states or {}), stopping,
            dict(dependencies or {}), dict(resize_costs or {}),
        )  # fmt: skip
        self.latest, _ = self._run(jobs, now)

    def estimate(
        self,
        jobs: Sequence[JobRecord],
        extra: Sequence[JobRecord],
        now: float,
        states: Mapping[int, JobState] | None = None,
    ) -> tuple[dict[int, Prediction], dict[int, str]]:
        """The forecast of ``jobs`` (the store's now) with ``extra`` jobs added, on the nodes
        and under the limits of the last pass, and the reason of each job the first pass
        leaves waiting; ``states``: of the jobs ``extra`` depend on (the store's now: the
        last pass read only those its jobs depend on, and to a job it did not read, as to one
        that does not exist, a dependency fails)."""
        try:
            return self._run([*jobs, *extra], now, new=[job.id for job in extra], states=states)
        finally:
            if self.inputs is not None:
                for job in extra:
                    self.inputs.models.forget(job.id)

    def _run(
        self,
        jobs: Sequence[JobRecord],
        now: float,
        new: Sequence[int] = (),
        states: Mapping[int, JobState] | None = None,
    ) -> tuple[dict[int, Prediction], dict[int, str]]:
        got = self.inputs
        if got is None:
            return {}, {}
        active = [job for job in jobs if job.state in (JobState.QUEUED, *PLACED_STATES)]
        snapshot = snapshot_of(
            active, got.nodes, got.models, now, got.limits,
            states={**got.states, **states} if states else got.states,
            dependencies=got.dependencies, stopping=got.stopping,
            resize_costs=got.resize_costs,
        )  # fmt: skip
        remaining = {job.id: remaining_s(job, now, self.durations, self.metrics) for job in active}
        # the jobs not yet submitted get, in order, ids above every stored one, as a submit
        # gives them: the pass breaks ties among equals by id, so they come last among equals
        top = max((job.id for job in active if job.id not in new), default=0)
        ids = {old: top + 1 + i for i, old in enumerate(new)}
        if not ids:
            return forecast(snapshot, got.policy, remaining)
        back = {fresh: old for old, fresh in ids.items()}
        # only the jobs not yet submitted change: no stored job can name one of them
        jobs_in = [
            replace(
                job,
                id=ids[job.id],
                after=tuple(replace(d, job_id=ids.get(d.job_id, d.job_id)) for d in job.after),
                after_pending=tuple(ids.get(d, d) for d in job.after_pending),
            )
            if job.id in ids
            else job
            for job in snapshot.jobs
        ]
        predictions, reasons = forecast(
            replace(snapshot, jobs=jobs_in),
            got.policy,
            {ids.get(job_id, job_id): left for job_id, left in remaining.items()},
        )
        return (
            {
                back.get(job_id, job_id): replace(found, job_id=back.get(job_id, job_id))
                for job_id, found in predictions.items()
            },
            {back.get(job_id, job_id): why for job_id, why in reasons.items()},
        )


@dataclass(frozen=True)
class _Inputs:
    policy: Policy
    nodes: list[NodeInput]
    models: ModelCache
    limits: Limits
    states: Mapping[int, JobState]
    stopping: Sequence[Holding]
    dependencies: Mapping[int, AfterSummary] = field(default_factory=dict)
    resize_costs: Mapping[int, ResizeCosts] = field(default_factory=dict)
