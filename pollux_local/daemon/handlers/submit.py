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
from pollux_local.daemon.context import Context


def default_job_name(argv: list[str]) -> str:
    """The script's file name (skipping the interpreter and its options), else the program."""
    program = os.path.basename(argv[0])
    if program.startswith("python"):
        for arg in argv[1:]:
            if not arg.startswith("-"):
                return os.path.basename(arg)
    return program


def check_submit(request: Submit, total_devices: int) -> None:
    """The checks across fields, and against the daemon's devices (:class:`InvalidRequest`)."""
    if not request.argv[0]:
        raise InvalidRequest("submit: the command is empty")
    if not os.path.isabs(request.workdir):
        raise InvalidRequest(f"submit: workdir must be an absolute path, got {request.workdir!r}")
    min_gpus, max_gpus = request.min_gpus, request.max_gpus
    if max_gpus is not None and max_gpus < min_gpus:
        raise InvalidRequest(f"min_gpus {min_gpus} is greater than max_gpus {max_gpus}")
    if not request.elastic and max_gpus is not None and max_gpus != min_gpus:
        raise InvalidRequest(
            f"a rigid job runs on exactly min_gpus devices, but max_gpus is {max_gpus} and"
            f" min_gpus {min_gpus} (a range is for elastic jobs)"
        )
    if min_gpus > total_devices:
        raise InvalidRequest(
            f"the job needs at least {min_gpus} device(s) but this daemon has {total_devices}"
        )
    batch, max_batch = request.batch_size, request.max_batch_size
    if max_batch is not None and batch is None:
        raise InvalidRequest("max_batch_size needs batch_size")
    if max_batch is not None and batch is not None and max_batch < batch:
        raise InvalidRequest(f"max_batch_size {max_batch} is below batch_size {batch}")
    min_local, max_local = request.min_local_batch, request.max_local_batch
    if min_local is not None and max_local is not None and max_local < min_local:
        raise InvalidRequest(f"max_local_batch {max_local} is below min_local_batch {min_local}")


def submit(ctx: Context, request: Submit) -> SubmitReply:
    check_submit(request, ctx.config.total_devices)
    ctx.require_priority(request.priority)
    spec = {
        "argv": list(request.argv),
        "workdir": request.workdir,
        "min_gpus": request.min_gpus,
        "max_gpus": request.max_gpus,
        "batch_size": request.batch_size,
        "max_batch_size": request.max_batch_size,
        "min_local_batch": request.min_local_batch,
        "max_local_batch": request.max_local_batch,
        "target": msgspec.to_builtins(request.target) if request.target is not None else None,
        # rigid (not elastic): exactly min_gpus devices, never resized; stopped only when
        # preemptible
        "elastic": request.elastic,
        "preemptible": request.preemptible,
    }
    job = ctx.store.add_job(
        name=request.name or default_job_name(request.argv),
        owner_uid=ctx.peer.uid,
        owner_gid=ctx.peer.gid,
        owner_name=ctx.peer.name,
        spec=spec,
        priority=request.priority,
        submit_time=ctx.clock(),
        held=request.hold,
        env=dict(request.env),
    )
    ctx.store.record_decision(job.id, job.submit_time, "submitted", f"by {ctx.peer.name}")
    if request.hold:
        ctx.store.update_job(job.id, reason="waiting: held")
    ctx.wake()
    return SubmitReply(id=job.job_id, state=job.state)
