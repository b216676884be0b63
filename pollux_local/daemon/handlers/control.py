"""``cancel``, ``hold``, ``release`` and ``set_priority``: changing jobs (their owner or an
admin only).  Whatever stops a job runs under the daemon's mutex, never during a pass."""

from __future__ import annotations

from pollux_local.api.errors import Conflict
from pollux_local.api.messages import (
    Cancel,
    CancelReply,
    Hold,
    JobStateReply,
    PriorityReply,
    Release,
    SetPriority,
    SkippedJob,
)
from pollux_local.api.states import TERMINAL_STATES, JobState
from pollux_local.daemon.context import Context


async def cancel(ctx: Context, request: Cancel) -> CancelReply:
    """Cancel every job named, or none: an unknown id or a job the caller may not change
    refuses the whole request.  Jobs already finished are listed as skipped."""
    jobs = [ctx.job(job_id) for job_id in request.ids]
    for job in jobs:
        ctx.require_owner(job, "cancel")
    cancelled: list[str] = []
    skipped: list[SkippedJob] = []
    async with ctx.mutex:
        for job in jobs:
            current = ctx.job(job.job_id)
            if current.state in TERMINAL_STATES:
                skipped.append(SkippedJob(id=job.job_id, state=current.state))
                continue
            await ctx.executor.cancel(job.id)
            cancelled.append(job.job_id)
    ctx.wake()
    return CancelReply(cancelled=cancelled, skipped=skipped)


async def hold(ctx: Context, request: Hold) -> JobStateReply:
    """Keep the job from being started; a running job is stopped (it checkpoints)."""
    ctx.require_owner(ctx.job(request.id), "hold")
    async with ctx.mutex:
        job = ctx.job(request.id)
        if job.state in TERMINAL_STATES:
            raise Conflict(f"job {job.id} has already {job.state}")
        if job.state != JobState.HELD:
            await ctx.executor.hold(job.id)
    ctx.wake()
    return JobStateReply(id=job.job_id, state=JobState.HELD)


async def release(ctx: Context, request: Release) -> JobStateReply:
    """Queue a held job again (:class:`Conflict` for a job that is not held)."""
    ctx.require_owner(ctx.job(request.id), "release")
    async with ctx.mutex:
        job = ctx.job(request.id)
        if job.state != JobState.HELD:
            raise Conflict(f"job {job.id} is not held (it is {job.state})")
        ctx.store.update_job(job.id, state=JobState.QUEUED, reason="released", retry_after=0.0)
        ctx.store.record_decision(job.id, ctx.clock(), "released", f"by {ctx.peer.name}")
    ctx.wake()
    return JobStateReply(id=job.job_id, state=JobState.QUEUED)


def set_priority(ctx: Context, request: SetPriority) -> PriorityReply:
    job = ctx.job(request.id)
    ctx.require_owner(job, "change the priority of")
    ctx.store.update_job(job.id, priority=request.priority)
    ctx.store.record_decision(job.id, ctx.clock(), "priority", f"set to {request.priority}")
    ctx.wake()
    return PriorityReply(id=job.job_id, priority=request.priority)
