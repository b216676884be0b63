"""When will each job run: the scheduling pass replayed forward from a snapshot, event to event.

Pure: the snapshot brings the time, and each job's expected remaining running time comes in as
a number (``None``: unknown).  From the snapshot, :func:`forecast` runs the pass
(:func:`~pollux_local.core.schedule.run.run_pass`), lets the jobs it placed run, jumps to the
first expected end (or a waiting job's ``--begin`` time), runs the pass again on what is left
(the ended jobs gone, the dependencies on them succeeded, the devices of stopping jobs free),
and so on, recording when each job first starts, when it is expected to end, and on how many
devices of which type.  A job preempted on the way keeps the work it did: its remaining time r
at a stop at t, having run since t0, becomes r - (t - t0).

A pass costs milliseconds and a queue may hold a thousand jobs, so a replayed pass sees the
running jobs and the front of the queue only (:data:`WINDOW` jobs, or twice the devices), and
only the first :data:`EXACT_STEPS` events run the pass; the rest of the queue is then laid out
by list scheduling in the queue's order (priority, then submission): each job takes the
devices it needs that free up first, and starts no earlier than its ``--begin`` time.  A job
behind one whose end is unknown (no expected length, no time limit) waits an unknown time
(``start`` ``None``), and so do a job needing more devices than there are and a queued job of a
paused group (it waits for a resume).

Worst cases.  A job whose expected remaining time is unknown but whose time limit bounds it
(``JobInput.time_limit_s``) is replayed running until its limit, its time left under the limit
(``views.time_left_s``): the worst case, not an expectation.  A figure that rests on a worst case
is an upper bound ("at the latest", ``Prediction.start_at_latest``, ``finish_at_latest``), by
this rule, where W is the earliest worst-case end of the replay (the replayed end of a job run
until its limit; none: nothing is marked):

* the finish of a job run until its limit is marked;
* a start later than the snapshot's ``now`` and no earlier than W is marked (the job waited
  through W: had the worst-case job ended sooner, it might have started sooner);
* the finish of a job whose last run in the replay (a restart after a preemption included)
  began later than ``now`` and no earlier than W is marked;
* nothing else is: a start at ``now`` or before W, and the finish of a run that began then,
  do not rest on any worst case (a job's remaining time does not depend on when others end).

The rule goes by time alone, so it marks, conservatively, a job that starts after W on devices
the worst-case job never held too.  What it leaves unmarked lies before W, where the replay is
the same whatever the worst-case job's length past that time (the pass never reads remaining
times); such a figure is an expectation as any other is.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from pollux_local.core.schedule.admission import Verdict, dependency_verdict
from pollux_local.core.schedule.plan import ActionKind
from pollux_local.core.schedule.run import run_pass
from pollux_local.core.schedule.snapshot import (
    AfterMode,
    JobInput,
    JobPhase,
    NodeInput,
    Outcome,
    Snapshot,
)
from pollux_local.core.schedule.views import time_left_s
from pollux_local.core.types import Policy

#: Events (job ends) replayed through the pass; the queue past them is list-scheduled.
EXACT_STEPS = 12
#: Queued jobs a replayed pass sees besides the running ones (at least; twice the devices when
#: there are more): the front of the queue, where the next starts come from.
WINDOW = 16


@dataclass(frozen=True)
class Placed:
    """Where a job runs after a pass: node -> device ids, and the devices' type."""

    allocation: Mapping[str, tuple[str, ...]]
    device_type: str = ""

    @property
    def devices(self) -> int:
        return sum(len(v) for v in self.allocation.values())


@dataclass(frozen=True)
class Prediction:
    """A job's forecast: when it starts (a running job: when its run began; ``None``:
    unknown) and finishes (``None``: unknown), on how many devices of which type (``""``: not
    known); ``start_at_latest`` and ``finish_at_latest``: that figure rests on a job run until
    its time limit, and is an upper bound rather than an expectation (the module's rule)."""

    job_id: int
    start: float | None
    finish: float | None
    devices: int = 0
    device_type: str = ""
    start_at_latest: bool = False
    finish_at_latest: bool = False


@dataclass(frozen=True)
class Work:
    """One job of a replay: ``remaining_s`` expected seconds of running still to go
    (``None``: unknown), ``running`` where it runs now (``None``: waiting), ``needs`` the
    devices it starts on, ``order`` its place in the queue (smaller first), ``not_before``
    its earliest start (``--begin``; ``None``: any time); ``worst_case``: ``remaining_s`` is
    not an expectation but the most it may run (its time left under its time limit)."""

    id: int
    remaining_s: float | None
    running: Placed | None = None
    needs: int = 1
    order: tuple[float, ...] = ()
    not_before: float | None = None
    worst_case: bool = False


#: ``step(t, running, ended)``: the pass at time ``t`` where ``running`` (job -> where) run and
#: ``ended`` have ended; returns where every job runs after it.
Step = Callable[[float, Mapping[int, Placed], frozenset[int]], Mapping[int, Placed]]


@dataclass
class _Run:
    left: float | None  # remaining seconds at ``since``
    since: float
    placed: Placed


@dataclass
class _Book:
    starts: dict[int, float] = field(default_factory=dict)
    where: dict[int, Placed] = field(default_factory=dict)
    finishes: dict[int, float] = field(default_factory=dict)
    #: when the run each finish ends began (the job's last start in the replay)
    began: dict[int, float] = field(default_factory=dict)


def replay(
    jobs: Sequence[Work],
    step: Step,
    now: float,
    *,
    capacity: int,
    exact_steps: int = EXACT_STEPS,
    started: Mapping[int, float] | None = None,
    blocked: Callable[[int], bool] | None = None,
) -> dict[int, Prediction]:
    """Every job's :class:`Prediction`, stepping ``step`` from end to end.  ``capacity``: the
    devices there are (for the list-scheduled tail); ``started``: when each running job's run
    began (default ``now``); ``blocked``: whether a job the replayed steps left waiting still
    waits for something the tail does not know (its dependencies): it has no start.  A
    start or finish that rests on a ``worst_case`` job's end is marked "at the latest" (the
    module's rule)."""
    work = {job.id: job for job in jobs}
    left: dict[int, float | None] = {job.id: job.remaining_s for job in jobs}
    book = _Book()
    runs: dict[int, _Run] = {}
    for job in jobs:
        if job.running is not None:
            runs[job.id] = _Run(job.remaining_s, now, job.running)
            book.starts[job.id] = (started or {}).get(job.id, now)
            book.where[job.id] = job.running
    ended: set[int] = set()
    t = now
    for _ in range(max(exact_steps, 1)):
        placed = step(t, {i: r.placed for i, r in runs.items()}, frozenset(ended))
        for job_id in [i for i in runs if i not in placed]:  # stopped: it keeps its work
            gone = runs.pop(job_id)
            if gone.left is not None:
                left[job_id] = max(0.0, gone.left - (t - gone.since))
        for job_id, where in placed.items():
            if job_id in ended or job_id not in work:
                continue
            run = runs.get(job_id)
            if run is None:
                runs[job_id] = _Run(left[job_id], t, where)
                book.starts.setdefault(job_id, t)
            else:
                run.placed = where
            book.where[job_id] = where
        if len(ended) + len(runs) == len(work):  # nothing waits: the ends are known
            break
        ends = [(r.since + r.left, i) for i, r in runs.items() if r.left is not None]
        # a waiting job's earliest start is an event too: the pass may start it then
        begins = [
            job.not_before
            for job in jobs
            if job.not_before is not None and job.not_before > t
            and job.id not in runs and job.id not in ended
        ]  # fmt: skip
        if not ends and not begins:
            break
        t = min([end for end, _ in ends] + begins)
        for end, job_id in ends:
            if end <= t:
                ended.add(job_id)
                book.finishes[job_id] = end
                book.began[job_id] = runs.pop(job_id).since
    for job_id, run in runs.items():
        if run.left is not None:
            book.finishes[job_id] = run.since + run.left
            book.began[job_id] = run.since
    queue = sorted(
        (
            work[i]
            for i in work
            if i not in ended and i not in runs and not (blocked is not None and blocked(i))
        ),
        key=lambda job: (job.order, job.id),
    )
    _list_schedule(queue, runs, left, t, capacity, book)
    # the earliest worst-case end, and what comes no earlier (the module's rule)
    worst = min(
        (end for job_id, end in book.finishes.items() if work[job_id].worst_case),
        default=math.inf,
    )

    def after_worst(when: float | None) -> bool:
        return when is not None and when > now and when >= worst

    return {
        job_id: Prediction(
            job_id=job_id,
            start=book.starts.get(job_id),
            finish=book.finishes.get(job_id),
            devices=book.where[job_id].devices if job_id in book.where else work[job_id].needs,
            device_type=book.where[job_id].device_type if job_id in book.where else "",
            start_at_latest=after_worst(book.starts.get(job_id)),
            finish_at_latest=job_id in book.finishes
            and (work[job_id].worst_case or after_worst(book.began.get(job_id))),
        )
        for job_id in work
    }


def _list_schedule(
    queue: Sequence[Work],
    runs: Mapping[int, _Run],
    left: Mapping[int, float | None],
    now: float,
    capacity: int,
    book: _Book,
) -> None:
    """The jobs still waiting, in order: each starts when the devices it needs are free (the
    ``needs``-th earliest free time) and holds them for its remaining time; an unknown end
    holds them for ever."""
    free: list[float] = []
    for run in runs.values():
        end = math.inf if run.left is None else run.since + run.left
        free.extend([end] * run.placed.devices)
    free.extend([now] * max(0, capacity - len(free)))
    heapq.heapify(free)
    for job in queue:
        if job.needs > len(free) or job.needs <= 0:
            continue
        taken = [heapq.heappop(free) for _ in range(job.needs)]
        start = max(now, taken[-1], job.not_before or now)
        duration = left.get(job.id)
        end = math.inf if duration is None or not math.isfinite(start) else start + duration
        for _ in taken:
            heapq.heappush(free, end)
        if math.isfinite(start):
            book.starts[job.id] = start
        if math.isfinite(end):
            book.finishes[job.id] = end
            book.began[job.id] = start


# --- the pass replayed -------------------------------------------------------------------


def queue_order(job: JobInput) -> tuple[float, ...]:
    """The queue's order: priority first, then submission."""
    return (-float(job.priority), job.submit_time, float(job.id))


def _type_of(nodes: Sequence[NodeInput], allocation: Mapping[str, Sequence[str]]) -> str:
    types = {node.device_type for node in nodes if allocation.get(node.name)}
    return types.pop() if len(types) == 1 else ""


def forecast(
    snapshot: Snapshot,
    policy: Policy,
    remaining: Mapping[int, float | None],
    *,
    exact_steps: int = EXACT_STEPS,
    window: int = WINDOW,
    seed: int = 0,
) -> tuple[dict[int, Prediction], dict[int, str]]:
    """Each queued and running job's :class:`Prediction` from ``snapshot`` (``remaining``: job
    id -> expected seconds of running left, ``None`` or absent: unknown, and then, for a job
    with a time limit, its time left under the limit, a worst case), and the reason of each
    job the first pass leaves waiting (where the pass gives one)."""
    now = snapshot.now
    active = [job for job in snapshot.jobs if job.phase is JobPhase.QUEUED or job.replicas > 0]
    if not active:
        return {}, {}
    nodes = snapshot.nodes
    capacity = sum(
        len([d for d in n.devices if d not in n.busy and d not in n.withheld])
        for n in nodes
        if n.up
    )
    width = max(window, 2 * capacity)
    queue = sorted(active, key=queue_order)
    free_nodes = [replace(node, stopping={}) for node in nodes]
    rng = np.random.default_rng(seed)
    began: dict[int, float] = {}
    reasons: dict[int, str] = {}

    # the dependents of each job, indexed by the one dependency each waits for now: a step
    # touches only the jobs whose watched dependency ended (not every job's whole list); a
    # job after one of its dependencies (``ONE_SUCCEEDED``) is watched under each of them
    waits: dict[int, tuple[int, ...]] = {}
    at: dict[int, int] = {}
    watch: dict[int, list[int]] = {}
    one_of: set[int] = set()
    for job in queue:
        ids = _waits_for(job)
        if not ids:
            continue
        waits[job.id], at[job.id] = ids, 0
        if job.after_mode is AfterMode.ONE_SUCCEEDED:
            one_of.add(job.id)
            for dep in ids:
                watch.setdefault(dep, []).append(job.id)
        else:
            watch.setdefault(ids[0], []).append(job.id)
    seen: set[int] = set()
    ready: dict[int, JobInput] = {}

    def release(ended: frozenset[int]) -> None:
        """Let the dependents of the jobs that ended since the last step go on to their next
        dependency not ended, and mark those left with none ready (a job after one of its
        dependencies: ready at the first that ends; a replay's jobs succeed)."""
        fresh = ended - seen
        seen.update(fresh)
        for gone in fresh:
            for job_id in watch.pop(gone, ()):
                if job_id in one_of:
                    if job_id not in ready:  # the first of its dependencies to end
                        ready[job_id] = replace(by_id[job_id], after=(), after_pending=())
                    continue
                ids, i = waits[job_id], at[job_id]
                while i < len(ids) and ids[i] in seen:
                    i += 1
                at[job_id] = i
                if i < len(ids):
                    watch.setdefault(ids[i], []).append(job_id)
                else:
                    ready[job_id] = replace(by_id[job_id], after=(), after_pending=())

    by_id = {job.id: job for job in queue}

    def step(t: float, running: Mapping[int, Placed], ended: frozenset[int]) -> dict[int, Placed]:
        first = t <= now
        jobs: list[JobInput] = []
        waiting = 0
        release(ended)
        for job in queue:
            if job.id in ended:
                continue
            job = ready.get(job.id, job)
            where = running.get(job.id)
            if where is not None:
                if not (job.phase.placed and _same(job.allocation, where.allocation)):
                    job = replace(
                        job,
                        phase=JobPhase.RUNNING,
                        allocation={k: list(v) for k, v in where.allocation.items()},
                        last_start=began.get(job.id, t),
                    )
                jobs.append(job)
            elif waiting < width:
                waiting += 1
                if job.phase is not JobPhase.QUEUED:
                    job = replace(job, phase=JobPhase.QUEUED, allocation={}, last_start=None)
                jobs.append(job)
        plan = run_pass(
            replace(
                snapshot,
                jobs=jobs,
                nodes=nodes if first else free_nodes,
                now=t,
                holdings=snapshot.holdings if first else (),
            ),
            policy,
            rng,
        )
        after: dict[int, Placed] = {}
        for job in jobs:
            if job.id in running:
                after[job.id] = running[job.id]
        for action in plan.actions:
            if action.kind is ActionKind.STOP:
                after.pop(action.job_id, None)
                continue
            allocation = {k: tuple(v) for k, v in action.allocation.items() if v}
            after[action.job_id] = Placed(allocation, _type_of(nodes, allocation))
            began.setdefault(action.job_id, t)
        if first:
            reasons.update(plan.reasons)
        return after

    paused = [job for job in active if not job.phase.placed and _paused(snapshot, job)]
    waits_for_resume = {job.id for job in paused}
    expected = {job.id: remaining.get(job.id) for job in active}
    # unknown but bounded by a time limit: run until the limit, the worst case
    limited = {
        job.id: limit
        for job in active
        if expected[job.id] is None and (limit := time_left_s(job, now)) is not None
    }
    work = [
        Work(
            id=job.id,
            remaining_s=limited.get(job.id, expected[job.id]),
            worst_case=job.id in limited,
            running=(
                Placed(
                    {k: tuple(v) for k, v in job.allocation.items() if v},
                    _type_of(nodes, job.allocation),
                )
                if job.phase.placed and job.replicas > 0
                else None
            ),
            needs=job.needs,
            order=queue_order(job),
            not_before=job.begin_at,
        )
        for job in active
        if job.id not in waits_for_resume
    ]
    started = {
        job.id: job.last_start if job.last_start is not None else now
        for job in active
        if job.phase.placed
    }
    # a job still waiting for its dependencies when the replayed steps end: the tail, which
    # knows no dependencies, would start it as soon as devices are free (at once, behind a
    # dependency of unknown length)
    dependent = {
        job.id
        for job in queue
        if (job.after or job.after_pending)
        and dependency_verdict(job.after, job.after_mode, job.after_pending)[0] is not Verdict.READY
    }
    predictions = replay(work, step, now, capacity=capacity, exact_steps=exact_steps,
                         started=started,
                         blocked=lambda i: i in dependent and i not in ready)  # fmt: skip
    for job in paused:
        predictions[job.id] = Prediction(job_id=job.id, start=None, finish=None, devices=job.needs)
    types = {node.device_type for node in nodes}
    only = types.pop() if len(types) == 1 else ""
    for job_id, found in predictions.items():
        if not found.device_type and only:
            predictions[job_id] = replace(found, device_type=only)
    return predictions, reasons


def _waits_for(job: JobInput) -> tuple[int, ...]:
    """The ids of the jobs ``job``'s dependencies still wait for, each of which a replay may
    end (then it succeeded); none when it waits for none, or when one of its dependencies
    keeps it waiting whatever ends (one failed, or does not exist; after one of them: every
    one ended and none succeeded): only its first pass's reason, which the replay keeps, tells
    these apart."""
    mode = job.after_mode
    ids: list[int] = []
    for dep in job.after:
        outcome = dep.outcome
        if outcome is Outcome.PENDING:
            ids.append(dep.job_id)
        elif mode is AfterMode.ONE_SUCCEEDED:
            if outcome is Outcome.SUCCEEDED:
                return ()
        elif outcome is None or not (mode is AfterMode.ALL_ENDED or outcome is Outcome.SUCCEEDED):
            return ()
    return (*ids, *job.after_pending)


def _paused(snapshot: Snapshot, job: JobInput) -> bool:
    """Whether ``job``'s group is paused."""
    group = snapshot.limits.groups.get(job.group) if job.group is not None else None
    return group is not None and group.paused


def _same(a: Mapping[str, Sequence[str]], b: Mapping[str, Sequence[str]]) -> bool:
    keys = {k for k, v in a.items() if v} | {k for k, v in b.items() if v}
    return all(sorted(a.get(k, ())) == sorted(b.get(k, ())) for k in keys)
