"""``status``, ``show`` and ``logs``: reading jobs (everyone who may connect may read every job).

``status`` pages in SQL (``StateStore.page_jobs``): by default the active jobs and those that
finished in the last :data:`RECENT_S` seconds, newest :data:`DEFAULT_LIMIT` at most.  ``logs``
reads a rank's log through :mod:`..jobfiles` as the job's owner's plain file: a symlink, FIFO,
hard link or someone else's file there is refused in one line and never read.
"""

from __future__ import annotations

from typing import NamedTuple

from pollux_local.api.errors import NotFound, PermissionDenied
from pollux_local.api.messages import (
    JobSummary,
    Logs,
    LogsReply,
    Show,
    ShowReply,
    Status,
    StatusReply,
)
from pollux_local.api.states import PLACED_STATES, JobState
from pollux_local.api.wire import MAX_PAGE_BYTES, encoded_size
from pollux_local.core.schedule.forecast import Prediction
from pollux_local.daemon.context import Context
from pollux_local.daemon.handlers.groups import group_owner
from pollux_local.daemon.jobfiles import UnsafeJobFile, read_job_file
from pollux_local.daemon.pacing import give_way
from pollux_local.daemon.readmodel import decision_records, job_detail, job_summary
from pollux_local.daemon.resizes import resizes_of
from pollux_local.daemon.state import DECISIONS_LIMIT, JobRecord

#: The states whose jobs carry a forecast.
FORECAST_STATES = frozenset({JobState.QUEUED, *PLACED_STATES})

#: The most bytes of a log one ``logs`` request returns.
MAX_LOG_CHUNK = 1 << 20
#: Decisions ``show`` returns (the newest): all a job keeps.
SHOW_DECISIONS = DECISIONS_LIMIT
#: ``status`` without ``all`` shows the jobs that finished this recently (seconds).
RECENT_S = 24 * 3600.0
#: Jobs a ``status`` page reads (and summarises) between two turns of the event loop.
READ_CHUNK = 500


class Filters(NamedTuple):
    """A ``status`` page's filters as ``StateStore.page_jobs`` takes them."""

    states: list[JobState] | None
    user: str | None
    group: str | None
    finished_since: float | None


async def status(ctx: Context, request: Status) -> StatusReply:
    """The newest ``limit`` jobs that match, oldest first, and how many more match
    (``more``: older than the page; ``hidden``: finished before the recent window).  A page
    is read and summarised :data:`READ_CHUNK` jobs at a time, the event loop served between
    two (a page of 10,000 does not hold up the others' requests for its whole time).  It
    also ends, early, once its rows take :data:`~pollux_local.api.wire.MAX_PAGE_BYTES`:
    rows a job shapes (its name, its reported metrics) can be 25 KB, and a reply over the
    frame limit would fail every ``status`` of everyone (the client asks for the rest)."""
    now = ctx.clock()
    finished_since = None if request.all else now - RECENT_S
    original_before = int(request.before_id) if request.before_id is not None else None
    filters = _filters(ctx, request, finished_since)
    jobs: list[JobRecord] = []
    before = original_before
    while len(jobs) < request.limit:
        want = min(READ_CHUNK, request.limit - len(jobs))
        chunk, _, _ = ctx.store.page_jobs(
            **filters._asdict(), before_id=before, limit=want, count=False
        )
        jobs.extend(chunk)
        if len(chunk) < want:
            break
        before = chunk[-1].id
        await give_way()
    summaries: list[JobSummary] = []  # newest first
    size = 0
    cut = False  # ended at MAX_PAGE_BYTES: the rest on the next page
    for index, job in enumerate(jobs):
        if index and index % READ_CHUNK == 0:
            await give_way()
        row = job_summary(job, now, ctx.metrics, held_type(ctx, job), forecast_of(ctx, job))
        size += encoded_size(row) + 1
        if summaries and size > MAX_PAGE_BYTES:
            cut = True
            break
        summaries.append(row)
    full = cut or len(jobs) == request.limit
    last_id = jobs[len(summaries) - 1].id if full and summaries else None
    more, hidden = ctx.store.page_counts(
        **filters._asdict(), before_id=original_before, last_id=last_id
    )
    summaries.reverse()
    return StatusReply(
        jobs=summaries,
        more=more,
        hidden=hidden,
        next_before_id=summaries[0].id if more and summaries else None,
    )


def _filters(ctx: Context, request: Status, finished_since: float | None) -> Filters:
    """The page's filters; ``--group`` of a user's group selects its owner's jobs alone, as
    the pass and ``groups`` count them (another user's job that kept the name is in none)."""
    user = request.user
    owner = group_owner(ctx, request.group) if request.group is not None else None
    states = request.states
    if owner is not None:
        if user is not None and user != owner:
            states = []  # another user's jobs: none is in this group
        user = owner
    return Filters(states, user, request.group, finished_since)


def held_type(ctx: Context, job: JobRecord) -> str | None:
    """The type of the devices the job holds (``None``: none)."""
    for node in job.placement:
        return ctx.config.device_type_of(node)
    return None


def forecast_of(ctx: Context, job: JobRecord) -> Prediction | None:
    """The loop's forecast of a queued or running job (``None``: none)."""
    if ctx.forecasts is None or job.state not in FORECAST_STATES:
        return None
    return ctx.forecasts.latest.get(job.id)


def show(ctx: Context, request: Show) -> ShowReply:
    job = ctx.job(request.id)
    detail = job_detail(
        job,
        job_summary(
            job,
            ctx.clock(),
            ctx.metrics,
            held_type(ctx, job),
            forecast_of(ctx, job),
            after_ids=None,  # all of them
        ),
        job_dir=ctx.job_dir(job),
        models=ctx.models,
        history=ctx.store.history(job.id),
        with_env=ctx.may_act_for(job),
        config=ctx.config,
        resize_costs=resizes_of(ctx.store).costs(job.id),
    )
    decisions = decision_records(ctx.store.decisions(job.id, limit=SHOW_DECISIONS))
    return ShowReply(job=detail, decisions=decisions)


def logs(ctx: Context, request: Logs) -> LogsReply:
    """Up to ``max_bytes`` (at most :data:`MAX_LOG_CHUNK`) of a rank's log from ``offset``
    (negative: that many bytes before the end).  A job that has not started yet has an empty
    rank-0 log; another rank without a log is :class:`NotFound`; a log that is not the job's
    owner's plain file (a symlink, a FIFO, a hard link) is :class:`PermissionDenied`."""
    job = ctx.job(request.id)
    rank = request.rank
    name = f"rank{rank}.log"
    max_bytes = max(1, min(request.max_bytes, MAX_LOG_CHUNK))
    try:
        data, start, size = read_job_file(
            ctx.job_dir(job), name, job.owner_uid, request.offset, max_bytes
        )
    except FileNotFoundError:
        if rank != 0 and job.state not in (JobState.QUEUED, JobState.HELD):
            raise NotFound(f"job {job.id} has no log for rank {rank}") from None
        size, start, data = 0, 0, b""
    except UnsafeJobFile as exc:
        raise PermissionDenied(
            f"job {job.id}: refusing to read its rank {rank} log: {exc}"
        ) from None
    except OSError as exc:
        raise PermissionDenied(
            f"job {job.id}: cannot read its rank {rank} log: {exc.strerror or exc}"
        ) from None
    return LogsReply(
        data=data.decode(errors="replace"), offset=start + len(data), size=size, state=job.state
    )
