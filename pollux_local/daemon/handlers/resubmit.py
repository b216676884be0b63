"""``restart`` and ``edit``: a job submitted again, and a waiting job changed.

``restart ID`` queues a copy of a job that ended (succeeded, failed or cancelled): the same
command, folder, environment, bounds and options under a new id, owned by the original job's
owner (it runs as them, whoever asks: its owner or an admin). Dependencies are dropped: they
were met, or failed, for the original; an array task stays a task of its array (its index, and
the array's ``max_running``), so it is refused while a task of that index is active. The copy
shares the original's stored environment and command (nothing is copied). ``edit ID`` changes a
queued or held job's command, device bounds, time limit, priority, retries (``--retries``) or
earliest start (``--begin``); its command only by its owner (or root: ``auth.may_act_for``),
since it runs as them. Both check the job that results as a submit does, with the daemon's
config as it is now (``submit.validate_jobs``): a restart counts against its owner's ``[limits]
max_queued_per_user``."""

from __future__ import annotations

import msgspec
from msgspec import UNSET

from pollux_local.api.errors import Conflict, InvalidRequest
from pollux_local.api.messages import Edit, JobStateReply, Restart, SubmitReply
from pollux_local.api.states import TERMINAL_STATES, DecisionKind, JobState
from pollux_local.daemon.context import Context
from pollux_local.daemon.handlers.submit import validate_jobs
from pollux_local.daemon.state import REMOVED_ARGV, JobRecord


def restart(ctx: Context, request: Restart) -> SubmitReply:
    old = ctx.job(request.id)  # with its environment
    ctx.require_owner(old, "restart")
    check_restartable(ctx, old)
    spec = msgspec.structs.replace(old.spec, after=[], after_any=False, after_one=False)
    [spec] = validate_jobs(
        ctx, [spec], owner_uid=old.owner_uid, owner_name=old.owner_name,
        env=ctx.store.stored_environment(old.id), adding=1, kept_group=old.spec.group,
        queued_again=old.id,
    )  # fmt: skip
    ctx.require_priority(old.priority)
    job = ctx.store.add_job(
        name=old.name,
        owner_uid=old.owner_uid,
        owner_gid=old.owner_gid,
        owner_name=old.owner_name,
        spec=spec,
        priority=old.priority,
        submit_time=ctx.clock(),
        held=request.hold,
        env_of=old.id,
    )
    ctx.store.record_decision(
        job.id,
        job.submit_time,
        DecisionKind.SUBMITTED,
        f"by {ctx.peer.name}: a restart of job {old.id}",
    )
    if request.hold:
        ctx.store.update_job(job.id, reason="waiting: held")
    ctx.wake()
    return SubmitReply(id=job.job_id, state=job.state)


def check_restartable(ctx: Context, old: JobRecord) -> None:
    """Refuse, in one line, a restart of a job that has not ended, whose command is gone, or
    that is a task of an array whose task of the same index is active (one task per index)."""
    if old.state not in TERMINAL_STATES:
        raise Conflict(f"job {old.id} is {old.state.value}; only a job that ended can be restarted")
    if old.spec.argv == REMOVED_ARGV:
        raise Conflict(
            f"job {old.id}'s command and environment were removed (beyond its owner's [limits]"
            " max_ended_stored_per_user); submit it again"
        )
    array_id, index = old.spec.array_id, old.spec.array_index
    if array_id is not None and index is not None:
        active = ctx.store.active_array_task(array_id, index)
        if active is not None:
            raise Conflict(
                f"job {old.id}: task {index} of array {array_id} is already"
                f" {active.state.value} as job {active.id}; restart it once that job ended"
            )


async def edit(ctx: Context, request: Edit) -> JobStateReply:
    """Change a queued or held job, under the daemon's mutex: never between a pass's plan
    (made from the job as it was) and the starts that follow it."""
    async with ctx.mutex:
        return _edit(ctx, request)


def _edit(ctx: Context, request: Edit) -> JobStateReply:
    job = ctx.job(request.id)
    ctx.require_owner(job, "edit")
    if job.state not in (JobState.QUEUED, JobState.HELD):
        raise Conflict(
            f"job {job.id} is {job.state.value}; only a queued or held job can be edited"
        )
    changes: dict[str, object] = {}
    if request.argv is not UNSET:
        ctx.require_acting_for(job, "change its command")  # it would run as them
        changes["argv"] = list(request.argv)
    if request.min_gpus is not UNSET:
        changes["min_gpus"] = request.min_gpus
    if request.max_gpus is not UNSET:
        changes["max_gpus"] = request.max_gpus
    if request.time_limit_s is not UNSET:
        changes["time_limit_s"] = request.time_limit_s
    if request.retries is not UNSET:
        changes["retries"] = request.retries
    if request.begin_at is not UNSET:
        changes["begin_at"] = request.begin_at
    if not changes and request.priority is UNSET:
        raise InvalidRequest(
            "edit: nothing to change (give the command, bounds, time, priority, retries or begin)"
        )
    spec = msgspec.structs.replace(job.spec, **changes)
    if not spec.elastic and request.min_gpus is not UNSET and request.max_gpus is UNSET:
        spec = msgspec.structs.replace(spec, max_gpus=None)
    [spec] = validate_jobs(
        ctx, [spec], owner_uid=job.owner_uid, owner_name=job.owner_name,
        env=ctx.store.stored_environment(job.id), adding=0, kept_group=job.spec.group,
        queued_again=job.id,
    )  # fmt: skip
    update: dict[str, object] = {"spec": spec}
    if request.priority is not UNSET:
        ctx.require_priority(request.priority, job.priority)
        update["priority"] = request.priority
    ctx.store.update_job(job.id, **update)
    what = ", ".join([*changes, *(["priority"] if "priority" in update else [])])
    ctx.store.record_decision(
        job.id, ctx.clock(), DecisionKind.EDITED, f"{what} by {ctx.peer.name}"
    )
    ctx.wake()
    return JobStateReply(id=job.job_id, state=job.state)
