"""``usage``: accounting from the job history, per user and in total.

A job counts when it ran (it has a start) and is still active or ended since ``since``; its
device-hours are the device-seconds of its runs that ended, by the type of the devices they ran
on (``JobRecord.device_seconds``), plus the run in progress.  Device-seconds recorded before
types were (an older daemon's) count under the type ``untyped``.

Those are the device-hours *held*.  Beside them: the median wait to a first start, and the
device-hours *used*, held device-hours weighed by the statistical efficiency of the batch a
job ran at, from its latest report (:func:`report_efficiency`; ``api.DeviceUsage`` says why
and what is left out)."""

from __future__ import annotations

import statistics
from collections import defaultdict

from pollux_local.api.messages import DeviceUsage, Usage, UsageReply
from pollux_local.api.states import PLACED_STATES, JobState
from pollux_local.core.efficiency import efficiency
from pollux_local.core.types import GradStats
from pollux_local.daemon.context import Context
from pollux_local.daemon.state import JobRecord

#: Seconds of difference between a job's total and its typed device-seconds left unnamed.
_SLACK_S = 0.5


def device_seconds(job: JobRecord, now: float, type_of: dict[str, str]) -> dict[str, float]:
    """Device-seconds by device type: ended runs, the untyped rest of the total, the run in
    progress (replicas on each node x seconds since its start)."""
    seconds: dict[str, float] = defaultdict(float)
    for kind, value in job.device_seconds.items():
        seconds[kind] += float(value)
    rest = job.attained_gpu_s - sum(seconds.values())
    if rest > _SLACK_S:
        seconds["untyped"] += rest
    if job.state in PLACED_STATES and job.last_start is not None:
        elapsed = max(0.0, now - job.last_start)
        for node, devices in job.placement.items():
            seconds[type_of.get(node, "gpu")] += elapsed * len(devices)
    return dict(seconds)


def report_efficiency(job: JobRecord) -> float | None:
    """The statistical efficiency E(M) of the total batch M the job's latest report says it
    ran at, against its base batch M0 (the report's, else the spec's), from the report's
    gradient statistics; ``None`` when the report lacks one of them."""
    report = job.report
    if report is None or report.grad_stats is None or report.batch is None:
        return None
    base = report.bounds.base_batch if report.bounds is not None else job.spec.batch_size
    if not base:
        return None
    batch = report.batch
    total = batch.local_batch * batch.accum_steps * batch.replicas
    stats = GradStats(sqr=report.grad_stats.sqr, var=report.grad_stats.var)
    value = float(efficiency(stats, float(base), float(total)))
    return value if 0.0 <= value <= 1.0 else None


def wait_s(job: JobRecord) -> float | None:
    """How long the job waited for its first start, from its submit or its ``--begin`` time
    when later (``None``: it never started)."""
    if job.start_time is None:
        return None
    ready = max(job.submit_time, job.spec.begin_at or 0.0)
    return max(0.0, job.start_time - ready)


def _row(user: str, jobs: list[JobRecord], now: float, type_of: dict[str, str]) -> DeviceUsage:
    by_type: dict[str, float] = defaultdict(float)
    used = measured = 0.0
    for job in jobs:
        held = 0.0
        for kind, value in device_seconds(job, now, type_of).items():
            by_type[kind] += value / 3600.0
            held += value / 3600.0
        if (share := report_efficiency(job)) is not None:
            used += held * share
            measured += held
    waits = [wait for job in jobs if (wait := wait_s(job)) is not None]
    states = [job.state for job in jobs]
    return DeviceUsage(
        user=user,
        device_hours=sum(by_type.values()),
        by_type=dict(sorted(by_type.items())),
        jobs=len(jobs),
        succeeded=states.count(JobState.SUCCEEDED),
        failed=states.count(JobState.FAILED),
        cancelled=states.count(JobState.CANCELLED),
        running=sum(state in PLACED_STATES for state in states),
        median_wait_s=statistics.median(waits) if waits else None,
        used_device_hours=used if measured > 0 else None,
        measured_device_hours=measured,
    )


def usage(ctx: Context, request: Usage) -> UsageReply:
    now = ctx.clock()
    type_of = {node.name: node.device_type for node in ctx.config.nodes}
    jobs = ctx.store.usage_rows(request.since, request.user)
    by_user: dict[str, list[JobRecord]] = defaultdict(list)
    for job in jobs:
        by_user[job.owner_name].append(job)
    rows = [_row(user, owned, now, type_of) for user, owned in by_user.items()]
    rows.sort(key=lambda row: (-row.device_hours, row.user))
    return UsageReply(users=rows, total=_row("*", jobs, now, type_of), since=request.since)
