"""``estimate`` (and ``submit --dry-run``): when would this submit run if it were sent now.

The request is checked exactly as ``submit`` checks it (the same errors, the same limits);
the jobs it would make are added, with ids no stored job has, to the store's queued and
running jobs, and the last pass's nodes and limits are replayed forward
(``forecasting.Forecasts.estimate``).  Nothing is stored.  Each user has one estimate in
flight at most, and ``pacing.ESTIMATES_PER_MINUTE`` a minute.
"""

from __future__ import annotations

import asyncio
from contextlib import nullcontext

from pollux_local.api.messages import Estimate, EstimateReply, JobForecast, Submit
from pollux_local.api.states import JobState
from pollux_local.daemon.context import Context
from pollux_local.daemon.forecasting import remaining_s
from pollux_local.daemon.handlers.submit import checked_jobs
from pollux_local.daemon.loop import SCHEDULED_STATES
from pollux_local.daemon.state import JobRecord


async def estimate(ctx: Context, request: Estimate) -> EstimateReply:
    """One :class:`JobForecast` per job the submit would make."""
    sub = request.submit
    pacing = ctx.estimate_pacer.slot(ctx.peer.uid) if ctx.estimate_pacer else nullcontext()
    with pacing:  # the request's checks too: they read the store
        return await _estimate(ctx, sub)


async def _estimate(ctx: Context, sub: Submit) -> EstimateReply:
    names, specs = checked_jobs(ctx, sub)
    now = ctx.clock()
    held = JobState.HELD if sub.hold else JobState.QUEUED
    # ids below every stored one, nothing keeps them; the forecast gives them, in order, ids
    # above every stored one, as a submit would (the pass orders equal jobs by id)
    extra = [
        JobRecord(
            id=-1 - i,
            name=task_name,
            owner_uid=ctx.peer.uid,
            owner_gid=ctx.peer.gid,
            owner_name=ctx.peer.name,
            state=held,
            spec=task_spec,
            priority=sub.priority,
            submit_time=now,
        )
        for i, (task_name, task_spec) in enumerate(zip(names, specs, strict=True))
    ]
    forecasts = ctx.forecasts
    if forecasts is None:
        return EstimateReply(
            now=now, jobs=[_unknown(job, "no scheduling loop runs") for job in extra]
        )
    async with ctx.mutex:  # the passes' models and store, one at a time
        jobs = ctx.store.jobs(SCHEDULED_STATES)
        states = ctx.store.states_of({int(job_id) for job_id in sub.after})
        predictions, reasons = await asyncio.to_thread(forecasts.estimate, jobs, extra, now, states)
        lengths = {job.id: remaining_s(job, now, forecasts.durations) for job in extra}
    out = []
    for job in extra:
        if sub.hold:
            out.append(_unknown(job, "held: it starts only when released"))
            continue
        found = predictions.get(job.id)
        if found is None:
            out.append(_unknown(job, reasons.get(job.id, "")))
            continue
        waiting = "" if found.start is not None and found.start <= now else reasons.get(job.id, "")
        out.append(
            JobForecast(
                name=job.name,
                start=found.start,
                finish=found.finish,
                devices=found.devices,
                device_type=found.device_type,
                waiting=waiting,
                length_s=lengths[job.id],
                start_at_latest=found.start_at_latest,
                finish_at_latest=found.finish_at_latest,
            )
        )
    return EstimateReply(now=now, jobs=out)


def _unknown(job: JobRecord, why: str) -> JobForecast:
    return JobForecast(
        name=job.name,
        start=None,
        finish=None,
        devices=int(job.spec.min_gpus or 1),
        device_type="",
        waiting=why,
        length_s=None,
    )
