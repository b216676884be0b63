"""``report``: a job's report, sent by its rank 0.

The report was checked against ``api.JobReport`` (its bounds included) when the request was
decoded.  Who may send it is ``reports.check_reporter``, the rule a ``report.json`` file is
read under too: the job's own user, root or the daemon's user, for a job of which a process
runs (placed, or still stopping).
It is stored as the ``JobReport`` it is, exactly as a file read by the loop, at
most every ``reports.MIN_REPORT_INTERVAL_S`` per job and ``reports.USER_REPORTS_PER_S`` per
user (a burst of ``USER_REPORT_BURST`` above it; a report beyond is not taken)."""

from __future__ import annotations

from pollux_local.api.messages import Report, ReportReply
from pollux_local.daemon.context import Context
from pollux_local.daemon.reports import check_reporter, pace_of
from pollux_local.daemon.resizes import resizes_of


def report(ctx: Context, request: Report) -> ReportReply:
    """Store the report; a finished job's, or one sent sooner than the pace allows, is not
    taken (``accepted`` false)."""
    job = ctx.job(request.job_id)
    if not check_reporter(job, ctx.peer.uid, ctx.daemon_uid):
        return ReportReply(accepted=False)
    if not pace_of(ctx.store).take(job.id, job.owner_uid):
        return ReportReply(accepted=False)
    ctx.store.update_job(job.id, report=request.report)
    ctx.metrics.note(job, request.report, ctx.clock())
    resizes_of(ctx.store).reported(job.id, request.report, ctx.clock())
    return ReportReply(accepted=True)
