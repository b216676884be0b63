"""``submit``: check a new job once and commit it to the store before replying.

The request's types and ranges were checked when it was decoded (``api.Submit``); what only a
request has (an array's indices and task commands) is checked by :func:`check_request`; the
jobs it makes are checked by :func:`validate_jobs`, the one validation of a resulting job that
``submit``, ``restart``, ``edit`` and ``release`` all call: the stored :class:`JobSpec` against
this daemon's config and ``[limits]`` (shape, batch bounds, time limit, sharing, constraint,
host memory and CPUs (``launchspec.check_host_limits``), the size of its command and
environment), the group it names (an admin's or its owner's own, ``groups.check_job_groups``),
its command not torch's launcher (``api.torchrun``: the client's rule, applied to whatever a
request sends), for a job queued again (a restart, an edit, a release) its owner still on this
machine (``jobrules.check_owner``), the account it is charged to (one its owner may charge,
``jobrules.check_account``) and what its owner already holds in the queue.  A job without a time
limit gets ``[limits] default_time``, else ``max_time`` (none when neither is set).  A priority
above ``[limits] max_priority`` (default 0) needs an admin (``Context.require_priority``).  The
limits hold for everyone, admins too: they protect the daemon, and an admin who needs more
raises them in the config.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import msgspec

from pollux_local.api.errors import InvalidRequest, LimitExceeded
from pollux_local.api.messages import (
    JOB_NAME_MAX,
    Submit,
    SubmitReply,
    default_job_name,
    job_name,
)
from pollux_local.api.spec import JobSpec
from pollux_local.api.states import DecisionKind
from pollux_local.api.torchrun import torchrun_refusal
from pollux_local.daemon.commands import StoredEnvironment, environment_bytes
from pollux_local.daemon.config import DaemonConfig
from pollux_local.daemon.context import Context
from pollux_local.daemon.handlers.groups import check_job_groups
from pollux_local.daemon.jobrules import check_account, check_job, check_owner
from pollux_local.daemon.state import stored_row
from pollux_local.sizes import format_size


def validate_jobs(
    ctx: Context,
    specs: Sequence[JobSpec],
    *,
    owner_uid: int,
    owner_name: str,
    env: Mapping[str, str] | StoredEnvironment,
    adding: int,
    kept_group: str | None = None,
    queued_again: int | None = None,
) -> list[JobSpec]:
    """The one validation of the jobs a request results in (``specs``: what the store would
    hold, all with environment ``env``: a stored job's as the store measured it,
    ``StateStore.stored_environment``, not loaded), owned by ``owner_uid``: ``adding`` of
    them are new to the queue (a submit's jobs, a restart's copy; 0 for an edit or a release);
    ``kept_group``: the group the stored job names (a release, edit or restart: a group gone
    since is left, :func:`~.groups.check_job_groups`); ``queued_again``: the id of the stored
    job a restart, an edit or a release puts back in the queue, whose owner must still have
    their account (:func:`~pollux_local.daemon.jobrules.check_owner`: :class:`Conflict`).
    Returns the specs to store (time limits settled, :func:`check_job`);
    :class:`LimitExceeded` or :class:`InvalidRequest`, one line, when one may not be."""
    config = ctx.config
    if queued_again is not None:
        check_owner(queued_again, owner_uid, owner_name, ctx.accounts)
    if len(specs) > config.max_array_size:
        raise LimitExceeded(
            f"limit exceeded: an array of {len(specs)} tasks is more than {config.max_array_size},"
            " the most an array may have ([limits] max_array_size)"
        )
    specs = check_job_groups(
        ctx, specs, owner_uid=owner_uid, owner_name=owner_name, kept=kept_group
    )
    if adding:
        held, most = ctx.store.count_active(owner_uid), config.max_queued_per_user
        if held + adding > most:
            what = (
                f"{held} jobs queued or running, the most a user may have"
                if held >= most
                else f"{held} jobs queued or running and this adds {adding}, more than {most},"
                " the most a user may have"
            )
            raise LimitExceeded(
                f"limit exceeded: {owner_name} has {what} ([limits] max_queued_per_user)"
            )
    env_bytes = env.exec_bytes if isinstance(env, StoredEnvironment) else environment_bytes(env)
    checked = [check_job(spec, config, env_bytes=env_bytes) for spec in specs]
    # work charged to an account, new, changed or queued again: its owner must be one who
    # may charge it now (a job held, or edited, while they could is no way round it)
    for spec in {spec.account: spec for spec in checked}.values():
        check_account(spec, config, owner_uid, owner_name)
    commands = list({id(spec.argv): spec.argv for spec in specs}.values())
    for argv in commands:  # a launcher of ranks inside a job: the client's rule, whoever sent it
        refused = torchrun_refusal(argv)
        if refused is not None:
            raise InvalidRequest(refused)
    kept_env = env.digest if isinstance(env, StoredEnvironment) else dict(env)
    new = ctx.store.unkept_bytes(owner_uid, [kept_env, *commands])
    if adding:  # each new job's own row: its settings (an array's tasks each) and its name
        new += sum(len(stored_row(spec)) + JOB_NAME_MAX for spec in checked)
    kept = ctx.store.stored_bytes(owner_uid) if new else 0  # nothing new: nothing to count
    if new and kept + new > config.max_stored_per_user:
        raise LimitExceeded(
            f"limit exceeded: {owner_name}'s jobs keep {format_size(kept)} of commands,"
            f" environments and settings and this adds {format_size(new)}, more than"
            f" {format_size(config.max_stored_per_user)}, the most a user's jobs may keep"
            " ([limits] max_stored_per_user)"
        )
    return checked


def check_request(request: Submit, config: DaemonConfig) -> None:
    """What only a submit request has: its array's indices and task commands."""
    if request.array is not None:
        indices = [task.index for task in request.array]
        if len(set(indices)) != len(indices):
            raise InvalidRequest("submit: an array index is given twice")
        for task in request.array:
            if task.argv is not None and not task.argv[0]:
                raise InvalidRequest(f"submit: array task {task.index}: the command is empty")
    elif request.max_running is not None:
        raise InvalidRequest("submit: max_running is for arrays (give array tasks)")


def check_submit(request: Submit, config: DaemonConfig) -> JobSpec:
    """A request's checks that need no store: :func:`check_request`, then :func:`check_job`
    of the job it describes (its spec, time limit settled)."""
    check_request(request, config)
    return check_job(spec_of(request), config, env_bytes=environment_bytes(request.env))


def check_dependencies(ctx: Context, after: list[str]) -> None:
    """Every job ``after`` names exists (one query, each id once)."""
    wanted = list(dict.fromkeys(int(job_id) for job_id in after))
    known = ctx.store.states_of(wanted)
    for number in wanted:
        if number not in known:
            raise InvalidRequest(f"submit: --after names job {number}, which does not exist")


def spec_of(request: Submit) -> JobSpec:
    """The spec a request describes, as given (:func:`check_job` settles its time limit; an
    array's tasks get theirs from it)."""
    return JobSpec(
        argv=list(request.argv),
        workdir=request.workdir,
        min_gpus=request.min_gpus,
        max_gpus=request.max_gpus,
        batch_size=request.batch_size,
        max_batch_size=request.max_batch_size,
        min_local_batch=request.min_local_batch,
        max_local_batch=request.max_local_batch,
        target=request.target,
        # rigid (not elastic): exactly min_gpus devices, never resized; stopped only when
        # preemptible
        elastic=request.elastic,
        preemptible=request.preemptible,
        after=list(dict.fromkeys(request.after)),
        after_any=request.after_any,
        after_one=request.after_one,
        time_limit_s=request.time_limit_s,
        notify=list(request.notify),
        notify_on=request.notify_on,
        constraint=request.constraint,
        array_max_running=request.max_running,
        gpu_memory=request.gpu_memory,
        shared=request.shared,
        retries=request.retries,
        begin_at=request.begin_at,
        group=request.group,
        account=request.account,
        host_memory=request.host_memory,
        cpus=request.cpus,
        umask=request.umask,
        stdin=request.stdin,
    )


def checked_jobs(ctx: Context, request: Submit) -> tuple[list[str], list[JobSpec]]:
    """The names and specs of the jobs ``request`` makes (one, or an array's tasks), each
    checked as it would be stored: what ``submit`` stores and ``estimate`` forecasts."""
    check_request(request, ctx.config)
    check_dependencies(ctx, request.after)
    ctx.require_priority(request.priority)
    spec = spec_of(request)
    name = request.name or default_job_name(request.argv)
    if request.array is None:
        names, specs = [name], [spec]
    else:
        names = [task.name or job_name(name, f"[{task.index}]") for task in request.array]
        # tasks that keep the array's command share its list: the store keeps it once
        specs = [
            msgspec.structs.replace(
                spec, argv=list(task.argv) if task.argv else spec.argv, array_index=task.index
            )
            for task in request.array
        ]
    specs = validate_jobs(
        ctx, specs, owner_uid=ctx.peer.uid, owner_name=ctx.peer.name, env=request.env,
        adding=len(specs),
    )  # fmt: skip
    return names, specs


def submit(ctx: Context, request: Submit) -> SubmitReply:
    names, specs = checked_jobs(ctx, request)
    jobs = ctx.store.add_jobs(
        name=names,
        owner_uid=ctx.peer.uid,
        owner_gid=ctx.peer.gid,
        owner_name=ctx.peer.name,
        specs=specs,
        priority=request.priority,
        submit_time=ctx.clock(),
        held=request.hold,
        env=dict(request.env),
        array=request.array is not None,
    )
    for job in jobs:
        ctx.store.record_decision(
            job.id, job.submit_time, DecisionKind.SUBMITTED, f"by {ctx.peer.name}"
        )
        if request.hold:
            ctx.store.update_job(job.id, reason="waiting: held")
    ctx.wake()
    return SubmitReply(
        id=jobs[0].job_id,
        state=jobs[0].state,
        ids=[job.job_id for job in jobs] if request.array is not None else [],
    )
