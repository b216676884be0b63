"""``report``: a job's report, sent by its rank 0 (only the job's owner may send it).

The report was checked against ``api.JobReport`` when the request was decoded; it is stored as
``reports.report_record`` makes it, exactly as a ``report.json`` file read by the loop."""

from __future__ import annotations

from pollux_local.api.messages import Report, ReportReply
from pollux_local.api.states import TERMINAL_STATES
from pollux_local.daemon.context import Context
from pollux_local.daemon.reports import report_record


def report(ctx: Context, request: Report) -> ReportReply:
    """Store the report; a finished job's is not taken (``accepted`` false)."""
    job = ctx.job(request.job_id)
    ctx.require_owner(job, "report for")
    if job.state in TERMINAL_STATES:
        return ReportReply(accepted=False)
    record = report_record(request.report)
    ctx.store.update_job(job.id, report=record)
    ctx.metrics.note(job, record, ctx.clock())
    return ReportReply(accepted=True)
