"""``usage``: accounting from the job history, per user (or per account, ``by``) and in total.

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
from collections import Counter, defaultdict

from pollux_local.api.messages import DeviceUsage, Usage, UsageReply
from pollux_local.api.states import PLACED_STATES, JobState
from pollux_local.core.efficiency import efficiency
from pollux_local.core.types import GradStats
from pollux_local.daemon.context import Context
from pollux_local.daemon.pacing import give_way
from pollux_local.daemon.state import JobRecord

#: Seconds of difference between a job's total and its typed device-seconds left unnamed.
_SLACK_S = 0.5
#: Jobs read and summed between two turns of the event loop.
READ_CHUNK = 1000


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


class _Tally:
    """One row of ``usage``, summed a job at a time."""

    def __init__(self) -> None:
        self.by_type: dict[str, float] = defaultdict(float)
        self.used = 0.0
        self.measured = 0.0
        self.waits: list[float] = []
        self.states: Counter[JobState] = Counter()

    def add(
        self, held: dict[str, float], share: float | None, wait: float | None, job: JobRecord
    ) -> None:
        """A job's device-hours by type (``held``), efficiency, wait and state."""
        total = 0.0
        for kind, hours in held.items():
            self.by_type[kind] += hours
            total += hours
        if share is not None:
            self.used += total * share
            self.measured += total
        if wait is not None:
            self.waits.append(wait)
        self.states[job.state] += 1

    def row(self, user: str, account: str | None = None) -> DeviceUsage:
        return DeviceUsage(
            user=user,
            account=account,
            device_hours=sum(self.by_type.values()),
            by_type=dict(sorted(self.by_type.items())),
            jobs=self.states.total(),
            succeeded=self.states[JobState.SUCCEEDED],
            failed=self.states[JobState.FAILED],
            cancelled=self.states[JobState.CANCELLED],
            running=sum(count for state, count in self.states.items() if state in PLACED_STATES),
            median_wait_s=statistics.median(self.waits) if self.waits else None,
            used_device_hours=self.used if self.measured > 0 else None,
            measured_device_hours=self.measured,
        )


async def usage(ctx: Context, request: Usage) -> UsageReply:
    """Per user and in total; the history is read and summed :data:`READ_CHUNK` jobs at a
    time, the event loop serving others between two (a lab's whole history takes seconds)."""
    now = ctx.clock()
    type_of = {node.name: node.device_type for node in ctx.config.nodes}
    tallies: dict[str, _Tally] = defaultdict(_Tally)
    total = _Tally()
    after: int | None = None
    while True:
        jobs = ctx.store.usage_rows(request.since, request.user, after, READ_CHUNK)
        for job in jobs:
            held = {k: v / 3600.0 for k, v in device_seconds(job, now, type_of).items()}
            facts = (held, report_efficiency(job), wait_s(job), job)
            key = job.owner_name if request.by == "user" else job.spec.account or ""
            tallies[key].add(*facts)
            total.add(*facts)
        if len(jobs) < READ_CHUNK:
            break
        after = jobs[-1].id
        await give_way()
    if request.by == "user":
        rows = [tally.row(user) for user, tally in tallies.items()]
    else:  # every user's jobs, by the account they were charged to ("": none)
        rows = [tally.row("*", account) for account, tally in tallies.items()]
    rows.sort(key=lambda row: (-row.device_hours, row.account or "", row.user))
    return UsageReply(users=rows, total=total.row("*"), since=request.since)
