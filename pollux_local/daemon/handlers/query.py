"""``status``, ``show`` and ``logs``: reading jobs (everyone may read every job)."""

from __future__ import annotations

import os

from pollux_local.api.errors import NotFound
from pollux_local.api.messages import Logs, LogsReply, Show, ShowReply, Status, StatusReply
from pollux_local.api.states import ACTIVE_STATES, JobState
from pollux_local.daemon.context import Context
from pollux_local.daemon.readmodel import decision_records, job_detail, job_summary

#: The most bytes of a log one ``logs`` request returns.
MAX_LOG_CHUNK = 1 << 20
#: Decisions ``show`` returns (the newest).
SHOW_DECISIONS = 100


def status(ctx: Context, request: Status) -> StatusReply:
    jobs = ctx.store.jobs() if request.all else ctx.store.jobs(ACTIVE_STATES)
    now = ctx.clock()
    return StatusReply(jobs=[job_summary(job, now, ctx.metrics) for job in jobs])


def show(ctx: Context, request: Show) -> ShowReply:
    job = ctx.job(request.id)
    detail = job_detail(
        job,
        job_summary(job, ctx.clock(), ctx.metrics),
        job_dir=ctx.job_dir(job),
        models=ctx.models,
        history=ctx.store.history(job.id),
        with_env=ctx.may_modify(job),
    )
    decisions = decision_records(ctx.store.decisions(job.id, limit=SHOW_DECISIONS))
    return ShowReply(job=detail, decisions=decisions)


def logs(ctx: Context, request: Logs) -> LogsReply:
    """Up to ``max_bytes`` (at most :data:`MAX_LOG_CHUNK`) of a rank's log from ``offset``
    (negative: that many bytes before the end).  A job that has not started yet has an empty
    rank-0 log; another rank without a log is :class:`NotFound`."""
    job = ctx.job(request.id)
    rank = request.rank
    path = ctx.job_dir(job) / f"rank{rank}.log"
    max_bytes = max(1, min(request.max_bytes, MAX_LOG_CHUNK))
    offset = request.offset
    try:
        with open(path, "rb") as handle:
            size = os.fstat(handle.fileno()).st_size
            start = max(0, size + offset) if offset < 0 else min(offset, size)
            handle.seek(start)
            data = handle.read(max_bytes)
    except FileNotFoundError:
        if rank != 0 and job.state not in (JobState.QUEUED, JobState.HELD):
            raise NotFound(f"job {job.id} has no log for rank {rank}") from None
        size, start, data = 0, 0, b""
    return LogsReply(
        data=data.decode(errors="replace"), offset=start + len(data), size=size, state=job.state
    )
