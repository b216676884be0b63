"""``cancel``, ``hold``, ``release`` and ``set_priority``: changing jobs (their owner or an
admin only).  Whatever stops a job runs under the daemon's mutex, never during a pass.
``hold --all`` and ``release --all`` pause and resume one's own queue, job by job through the
path a job named alone takes (:func:`targets`).

Stopping a job records its new state first, then has its processes stopped: when that one
write fails (``sqlite3.Error``) the request fails with one line and nothing changed (the job
still runs, recorded as running); once it is written the processes are stopped whatever
happens next, so no process is left holding a device the store counts as free (what could not
be recorded after that is repaired by the next pass, ``SchedulingLoop.reconcile``).  A raised priority
needs an admin (``Context.require_priority``)."""

from __future__ import annotations

import contextlib
import logging
import sqlite3
from typing import Any

from pollux_local.api.errors import (
    Conflict,
    InternalError,
    InvalidRequest,
    LimitExceeded,
    NotFound,
    PermissionDenied,
)
from pollux_local.api.messages import (
    Cancel,
    CancelReply,
    Hold,
    PriorityReply,
    Release,
    SetPriority,
    SkippedJob,
    StateChangeReply,
)
from pollux_local.api.states import TERMINAL_STATES, DecisionKind, JobState, StopIntent
from pollux_local.daemon.auth import is_owner
from pollux_local.daemon.context import Context
from pollux_local.daemon.handlers.submit import validate_jobs
from pollux_local.daemon.pacing import give_way
from pollux_local.daemon.state import DecisionEntry, JobRecord

log = logging.getLogger("pollux_local.daemon")


def _write_failed(verb: str, job: JobRecord, exc: sqlite3.Error, done: list[str]) -> InternalError:
    already = f" (already {verb}: {', '.join(done)})" if done else ""
    return InternalError(
        f"could not {verb} job {job.id}: the daemon's database write failed ({exc});"
        f" the job was left as it was{already}"
    )


#: A cancel gives the event loop to the others after each this many jobs (a cancel of a
#: 1000-task array held it for a second in one piece).
GIVE_WAY_EVERY = 64

#: What stops a job for each state a request gives it: the stop's intent, the decision.
_STOPS = {
    JobState.CANCELLED: (StopIntent.CANCEL, DecisionKind.CANCELLED),
    JobState.HELD: (StopIntent.HOLD, DecisionKind.HELD),
}


def admin_hold(ctx: Context, job: JobRecord) -> bool:
    """Whether a hold of ``job`` by the caller is an admin's: an admin's (or root's) hold of
    another user's job, which only an admin may release (its owner could undo it before)."""
    return ctx.is_admin() and not is_owner(ctx.peer, job.owner_uid, job.owner_name)


async def stop_as(ctx: Context, job: JobRecord, state: JobState) -> None:
    """Record ``state`` for the job with its decision (first, one transaction; its caller
    makes it durable before it answers), then have its processes stopped (they checkpoint;
    SIGKILL after ``stop_grace_s``; the executor handles their exit when it comes).
    ``sqlite3.Error`` from that write propagates with nothing changed."""
    now = ctx.clock()
    intent, kind = _STOPS[state]
    reason = kind.value
    changes: dict[str, Any] = {"reason": reason}
    if state == JobState.HELD:  # a hold is the admin's or its owner's, recorded with it
        changes["admin_hold"] = admin_hold(ctx, job)
        if changes["admin_hold"]:
            changes["reason"] = "held by an admin"
    if state == JobState.CANCELLED:
        changes["end_time"] = now
    decision = DecisionEntry(kind, f"{reason} by {ctx.peer.name}")
    # not synced one by one: the request makes its changes durable at once before it answers
    # (``StateStore.make_durable``); a cancel of a thousand jobs took a second of fsyncs
    ctx.store.transition(job.id, state, now, decision, durable=False, **changes)
    await ctx.executor.stop_job(job.id, intent)


def array_tasks(ctx: Context, array_id: str) -> list[JobRecord]:
    """Every task of an array: the job ``array_id`` (its first task) and every job tagged
    with it (restarted tasks too)."""
    first = ctx.job(array_id)
    if first.spec.array_id != first.job_id:
        raise NotFound(f"job {array_id} is not an array (cancel it by its id)")
    return ctx.store.array_tasks(first.id)


async def cancel(ctx: Context, request: Cancel) -> CancelReply:
    """Cancel every job named, or none: an unknown id or a job the caller may not change
    refuses the whole request.  Jobs already finished are listed as skipped."""
    if not request.ids and not request.arrays:
        raise InvalidRequest("cancel: name at least one job or array")
    jobs = await ctx.jobs_in_parts(request.ids)  # each once, whatever a request repeats
    listed = {job.id for job in jobs}
    for array_id in dict.fromkeys(request.arrays):
        await give_way()
        tasks = [task for task in array_tasks(ctx, array_id) if task.id not in listed]
        jobs.extend(tasks)
        listed.update(task.id for task in tasks)
    for job in jobs:
        ctx.require_owner(job, "cancel")
    cancelled: list[str] = []
    skipped: list[SkippedJob] = []
    try:
        async with ctx.mutex:
            states = ctx.store.states_of(job.id for job in jobs)  # as they are now
            for done, job in enumerate(jobs):
                if done and done % GIVE_WAY_EVERY == 0:
                    await give_way()  # a cancel of thousands does not hold the others up
                    # jobs may have ended meanwhile (their exits are taken in between)
                    states = ctx.store.states_of(job.id for job in jobs[done:])
                state = states.get(job.id)
                if state is None or state in TERMINAL_STATES:
                    skipped.append(SkippedJob(id=job.job_id, state=state or job.state))
                    continue
                try:
                    await stop_as(ctx, job, JobState.CANCELLED)
                except sqlite3.Error as exc:
                    raise _write_failed("cancel", job, exc, cancelled) from None
                cancelled.append(job.job_id)
    finally:
        ctx.store.make_durable()
        ctx.wake()
    return CancelReply(cancelled=cancelled, skipped=skipped)


def targets(ctx: Context, request: Hold | Release, state: JobState, verb: str) -> list[JobRecord]:
    """The jobs a ``hold`` or ``release`` names: the job ``id``, or with ``all`` every job in
    ``state`` of the caller, or of ``user`` (an admin's ``all`` takes the admin's own jobs
    unless ``user`` is given: holding everyone's queue is ``drain``'s, not a slip of
    ``--all``).  Each passes :meth:`Context.require_owner`, as one named alone does."""
    if request.all == (request.id is not None):
        raise InvalidRequest(f"{verb}: give a job id or all, not both" if request.all
                             else f"{verb}: give a job id or all")  # fmt: skip
    if request.id is not None:
        if request.user is not None:
            raise InvalidRequest(f"{verb}: user goes with all (a job id names its owner)")
        job = ctx.job(request.id)
        ctx.require_owner(job, verb)
        return [job]
    user = request.user
    if user is not None and user != ctx.peer.name and not ctx.is_admin():
        raise PermissionDenied(
            f"{verb} --all --user {user}: only an admin may {verb} another user's jobs"
        )
    if user is not None:
        jobs = [job for job in ctx.store.jobs([state]) if job.owner_name == user]
    else:  # the caller's own (a reused uid's old jobs are not: ``auth.is_owner``)
        jobs = [
            job
            for job in ctx.store.jobs([state])
            if is_owner(ctx.peer, job.owner_uid, job.owner_name)
        ]
    for job in jobs:
        ctx.require_owner(job, verb)
    return jobs


#: Jobs a ``hold --all`` or ``release --all`` changes under one hold of the daemon's mutex;
#: the other requests and a pass are served between two parts.
CHANGE_PART = 100


def _parts(jobs: list[JobRecord]) -> list[list[JobRecord]]:
    return [jobs[start : start + CHANGE_PART] for start in range(0, len(jobs), CHANGE_PART)]


async def hold(ctx: Context, request: Hold) -> StateChangeReply:
    """Keep jobs from being started: the one named (a running job is stopped: it
    checkpoints), or with ``all`` every queued one of the caller's (:func:`targets`; running
    jobs keep running)."""
    jobs = targets(ctx, request, JobState.QUEUED, "hold")
    held: list[str] = []
    try:
        for part in _parts(jobs):
            await give_way()
            async with ctx.mutex:
                for target in part:
                    job = ctx.job_without_env(target.job_id)
                    if request.all and job.state != JobState.QUEUED:
                        continue  # it started or ended since it was listed
                    if job.state in TERMINAL_STATES:
                        raise Conflict(f"job {job.id} has already {job.state}")
                    try:
                        if job.state != JobState.HELD:
                            await stop_as(ctx, job, JobState.HELD)
                        elif admin_hold(ctx, job) and not ctx.store.admin_held(job.id):
                            # held by its owner, and now by an admin too: the admin's holds
                            ctx.store.set_admin_hold(job.id, True)
                            ctx.store.update_job(job.id, reason="held by an admin")
                    except sqlite3.Error as exc:
                        raise _write_failed("hold", job, exc, held) from None
                    held.append(job.job_id)
    finally:
        ctx.store.make_durable()
        ctx.wake()
    return StateChangeReply(state=JobState.HELD, ids=held)


async def release(ctx: Context, request: Release) -> StateChangeReply:
    """Queue held jobs again: the one named (:class:`Conflict` for a job that is not held),
    or with ``all`` every held one of the caller's (:func:`targets`).  Each passes submit's
    checks under the config as it is now (``submit.validate_jobs``: a time limit lowered by a
    reload since, an option no longer allowed, is refused in one line); with ``all`` a job
    refused stays held and the reply says why, the others are released."""
    jobs = targets(ctx, request, JobState.HELD, "release")
    released: list[str] = []
    refused: dict[str, str] = {}
    try:
        for part in _parts(jobs):
            await give_way()
            async with ctx.mutex:
                for target in part:
                    job = ctx.job_without_env(target.job_id)
                    if job.state != JobState.HELD:
                        if request.all:
                            continue  # released or cancelled since it was listed
                        raise Conflict(f"job {job.id} is not held (it is {job.state})")
                    try:
                        _release_one(ctx, job, released)
                    except (Conflict, InvalidRequest, LimitExceeded, PermissionDenied) as exc:
                        if not request.all:
                            raise
                        refused[job.job_id] = str(exc)
                        continue
                    released.append(job.job_id)
    finally:
        ctx.store.make_durable()
        ctx.wake()
    return StateChangeReply(state=JobState.QUEUED, ids=released, refused=refused)


def _release_one(ctx: Context, job: JobRecord, done: list[str]) -> None:
    """``job`` (held) queued again once it passes ``validate_jobs`` (``done``: the jobs this
    request released before it, for the message of a failed write); a job an admin held only
    by an admin (:func:`admin_hold`)."""
    if not ctx.is_admin() and ctx.store.admin_held(job.id):
        raise PermissionDenied(
            f"permission denied: job {job.id} was held by an admin; only an admin may release it"
        )
    [spec] = validate_jobs(
        ctx, [job.spec], owner_uid=job.owner_uid, owner_name=job.owner_name,
        env=ctx.store.stored_environment(job.id), adding=0, kept_group=job.spec.group,
        queued_again=job.id,
    )  # fmt: skip
    changes: dict[str, Any] = {} if spec == job.spec else {"spec": spec}
    left = (
        f"; group {job.spec.group} is gone: it is in none" if spec.group != job.spec.group else ""
    )
    decision = DecisionEntry(DecisionKind.RELEASED, f"by {ctx.peer.name}{left}")
    try:
        ctx.store.transition(
            job.id, JobState.QUEUED, ctx.clock(), decision,
            reason="released", retry_after=0.0, admin_hold=False, durable=False, **changes,
        )  # fmt: skip
    except sqlite3.Error as exc:
        raise _write_failed("release", job, exc, done) from None


def set_priority(ctx: Context, request: SetPriority) -> PriorityReply:
    """Change a job's priority (its owner or an admin); raising it above ``[limits]
    max_priority`` needs an admin."""
    job = ctx.job(request.id)
    ctx.require_owner(job, "change the priority of")
    ctx.require_priority(request.priority, current=job.priority)
    try:
        ctx.store.update_job(job.id, priority=request.priority)
    except sqlite3.Error as exc:
        raise _write_failed("re-prioritise", job, exc, []) from None
    with contextlib.suppress(sqlite3.Error):
        ctx.store.record_decision(
            job.id, ctx.clock(), DecisionKind.PRIORITY, f"set to {request.priority}"
        )
    ctx.wake()
    return PriorityReply(id=job.job_id, priority=request.priority)
