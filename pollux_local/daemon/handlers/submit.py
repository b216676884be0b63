"""``submit``: check a new job once and commit it to the store before replying.

The request's types and ranges were checked when it was decoded (``api.Submit``); what depends
on several fields or on this daemon is checked here, in :func:`check_submit`, and nowhere else;
a priority above ``[limits] max_priority`` (default 0) needs an admin
(``Context.require_priority``).
"""

from __future__ import annotations

import os

import msgspec

from pollux_local.api.errors import InvalidRequest
from pollux_local.api.messages import Submit, SubmitReply
from pollux_local.api.spec import Constraint, JobSpec
from pollux_local.daemon.config import DaemonConfig
from pollux_local.daemon.context import Context
from pollux_local.durations import format_duration
from pollux_local.sizes import format_size


def default_job_name(argv: list[str]) -> str:
    """The script's file name (skipping the interpreter and its options), else the program."""
    program = os.path.basename(argv[0])
    if program.startswith("python"):
        for arg in argv[1:]:
            if not arg.startswith("-"):
                return os.path.basename(arg)
    return program


def check_submit(request: Submit, config: DaemonConfig) -> None:
    """The checks across fields, and against the daemon's devices (:class:`InvalidRequest`)."""
    check_shape(
        argv=request.argv,
        workdir=request.workdir,
        min_gpus=request.min_gpus,
        max_gpus=request.max_gpus,
        elastic=request.elastic,
        config=config,
    )
    batch, max_batch = request.batch_size, request.max_batch_size
    if max_batch is not None and batch is None:
        raise InvalidRequest("max_batch_size needs batch_size")
    if max_batch is not None and batch is not None and max_batch < batch:
        raise InvalidRequest(f"max_batch_size {max_batch} is below batch_size {batch}")
    min_local, max_local = request.min_local_batch, request.max_local_batch
    if min_local is not None and max_local is not None and max_local < min_local:
        raise InvalidRequest(f"max_local_batch {max_local} is below min_local_batch {min_local}")
    check_time_limit(request.time_limit_s, config)
    check_sharing(request, config)
    if request.constraint is not None:
        check_constraint(request.constraint, request.min_gpus, config)
    if request.array is not None:
        indices = [task.index for task in request.array]
        if len(set(indices)) != len(indices):
            raise InvalidRequest("submit: an array index is given twice")
        for task in request.array:
            if task.argv is not None and not task.argv[0]:
                raise InvalidRequest(f"submit: array task {task.index}: the command is empty")
    elif request.max_running is not None:
        raise InvalidRequest("submit: max_running is for arrays (give array tasks)")


def check_shape(
    *,
    argv: list[str],
    workdir: str,
    min_gpus: int,
    max_gpus: int | None,
    elastic: bool,
    config: DaemonConfig,
) -> None:
    """Command, folder and device bounds (also what ``edit`` may change)."""
    if not argv[0]:
        raise InvalidRequest("submit: the command is empty")
    if not os.path.isabs(workdir):
        raise InvalidRequest(f"submit: workdir must be an absolute path, got {workdir!r}")
    if max_gpus is not None and max_gpus < min_gpus:
        raise InvalidRequest(f"min_gpus {min_gpus} is greater than max_gpus {max_gpus}")
    if not elastic and max_gpus is not None and max_gpus != min_gpus:
        raise InvalidRequest(
            f"a rigid job runs on exactly min_gpus devices, but max_gpus is {max_gpus} and"
            f" min_gpus {min_gpus} (a range is for elastic jobs)"
        )
    total_devices = config.total_devices
    if min_gpus > total_devices:
        raise InvalidRequest(
            f"the job needs at least {min_gpus} device(s) but this daemon has {total_devices}"
        )
    cap = config.max_devices_per_user
    if cap is not None and min_gpus > cap:
        raise InvalidRequest(
            f"the job needs at least {min_gpus} device(s) but a user may hold at most {cap}"
            " ([limits] max_devices_per_user)"
        )


def check_sharing(request: Submit, config: DaemonConfig) -> None:
    """A shared job is rigid, on one device, declares its memory, and some node's devices
    are known to have that much."""
    if not request.shared:
        return
    if request.elastic:
        raise InvalidRequest("submit: --shared is for rigid jobs; an elastic job never shares")
    if request.min_gpus != 1 or (request.max_gpus or 1) != 1:
        raise InvalidRequest("submit: a shared job runs on one device (--gpus 1)")
    if request.gpu_memory is None:
        raise InvalidRequest("submit: --shared needs --gpu-memory (the memory the job uses)")
    sizes = [node.device_memory for node in config.nodes if node.device_memory is not None]
    if not sizes:
        raise InvalidRequest(
            "submit: --shared: no node declares its devices' memory ([nodes.NAME] memory)"
        )
    if request.gpu_memory > max(sizes):
        raise InvalidRequest(
            f"submit: --gpu-memory {format_size(request.gpu_memory)} is more than any device"
            f" has (at most {format_size(max(sizes))})"
        )


def check_time_limit(limit: float | None, config: DaemonConfig) -> None:
    longest = config.max_time_s
    if limit is not None and longest is not None and limit > longest:
        raise InvalidRequest(
            f"submit: time limit {format_duration(limit)} is longer than this daemon's maximum"
            f" {format_duration(longest)} ([limits] max_time)"
        )


def check_constraint(constraint: Constraint, min_gpus: int, config: DaemonConfig) -> None:
    """Every node named exists, the type is some node's, and the allowed nodes have
    ``min_gpus`` devices."""
    names = [node.name for node in config.nodes]
    for name in constraint.nodes:
        if name not in names:
            raise InvalidRequest(
                f"submit: --constraint names no node {name!r} (nodes: {', '.join(names)})"
            )
    types = sorted({node.device_type for node in config.nodes})
    if constraint.device_type is not None and constraint.device_type not in types:
        raise InvalidRequest(
            f"submit: --constraint asks for device type {constraint.device_type!r}; this"
            f" daemon has {', '.join(types)}"
        )
    allowed = sum(
        len(node.devices)
        for node in config.nodes
        if constraint.allows_node(node.name, node.device_type)
    )
    if min_gpus > allowed:
        raise InvalidRequest(
            f"submit: the job needs {min_gpus} device(s) but {constraint.describe()} offer"
            f" {allowed}"
        )


def check_dependencies(ctx: Context, after: list[str]) -> None:
    for job_id in after:
        if ctx.store.get_job(int(job_id)) is None:
            raise InvalidRequest(f"submit: --after names job {job_id}, which does not exist")


def spec_of(request: Submit, config: DaemonConfig) -> JobSpec:
    """The stored spec of a checked request (an array's tasks get theirs from it)."""
    limit = request.time_limit_s if request.time_limit_s is not None else config.default_time_s
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
        time_limit_s=limit,
        notify=list(request.notify),
        notify_on=request.notify_on,
        constraint=request.constraint,
        array_max_running=request.max_running,
        gpu_memory=request.gpu_memory,
        shared=request.shared,
    )


def submit(ctx: Context, request: Submit) -> SubmitReply:
    check_submit(request, ctx.config)
    check_dependencies(ctx, request.after)
    ctx.require_priority(request.priority)
    spec = spec_of(request, ctx.config)
    name = request.name or default_job_name(request.argv)
    if request.array is None:
        names, specs = [name], [spec]
    else:
        names = [task.name or f"{name}[{task.index}]" for task in request.array]
        specs = [
            msgspec.structs.replace(spec, argv=list(task.argv or spec.argv), array_index=task.index)
            for task in request.array
        ]
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
        ctx.store.record_decision(job.id, job.submit_time, "submitted", f"by {ctx.peer.name}")
        if request.hold:
            ctx.store.update_job(job.id, reason="waiting: held")
    ctx.wake()
    return SubmitReply(
        id=jobs[0].job_id,
        state=jobs[0].state,
        ids=[job.job_id for job in jobs] if request.array is not None else [],
    )
