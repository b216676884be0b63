"""Dispatch: a request decoded strictly into its ``api.messages`` class goes to its handler
(``handlers/``) by one ``match`` over the request classes; the typed reply, or the typed error
(``api.errors``), is the answer.  A new request type is one ``case`` here."""

from __future__ import annotations

import logging
import mmap
from typing import Any, cast

from pollux_local.api import wire
from pollux_local.api.errors import (
    InternalError,
    InvalidRequest,
    PolluxError,
)
from pollux_local.api.messages import (
    Cancel,
    DeleteGroup,
    Drain,
    Edit,
    Estimate,
    Hold,
    ListGroups,
    Logs,
    Nodes,
    PauseGroup,
    Ping,
    Release,
    Reply,
    Report,
    Request,
    Restart,
    Resume,
    ResumeGroup,
    SetGroup,
    SetPriority,
    Show,
    Status,
    Submit,
    Usage,
)
from pollux_local.daemon.context import Context
from pollux_local.daemon.handlers import (
    control,
    devices,
    estimate,
    groups,
    nodes,
    ping,
    query,
    report,
    resubmit,
    submit,
    usage,
)

log = logging.getLogger("pollux_local.daemon")


#: The requests that only read: served to each user in turns (``pacing.LoopShare``).
READS = (Status, Show, Logs, Usage, Nodes, ListGroups)
#: The group changes, each answered with its group's row (counted as ``groups`` counts):
#: served in turns as that read is.
GROUP_CHANGES = (SetGroup, DeleteGroup, PauseGroup, ResumeGroup)
#: More jobs than this named in one request (ids, array tasks, dependencies) make it costly.
BULK = 100


def costly(request: Request[Any]) -> bool:
    """Whether ``request`` is served in its user's turn: a read, a group change (its reply
    is a read), or one that names many jobs (reading them costs what a page of ``status``
    does) or whole arrays."""
    if isinstance(request, READS + GROUP_CHANGES):
        return True
    if isinstance(request, Cancel):
        return len(request.ids) > BULK or bool(request.arrays)
    if isinstance(request, Hold | Release):
        return request.all
    if isinstance(request, Submit):
        return len(request.after) > BULK or len(request.array or ()) > BULK
    return False  # (``match`` here would read as a handler's case: tests/docs/test_lists.py)


async def dispatch(ctx: Context, request: Request[Any]) -> Reply:
    """The handler of ``request``'s type, and its reply (a costly one in its user's turn)."""
    if ctx.read_share is not None and costly(request):
        async with ctx.read_share.turn(ctx.peer.uid):
            return await _handle(ctx, request)
    return await _handle(ctx, request)


async def _handle(ctx: Context, request: Request[Any]) -> Reply:
    match request:
        case Ping():
            return ping.ping(ctx, request)
        case Submit():
            return submit.submit(ctx, request)
        case Status():
            return await query.status(ctx, request)
        case Show():
            return query.show(ctx, request)
        case Logs():
            return query.logs(ctx, request)
        case Cancel():
            return await control.cancel(ctx, request)
        case Hold():
            return await control.hold(ctx, request)
        case Release():
            return await control.release(ctx, request)
        case SetPriority():
            return control.set_priority(ctx, request)
        case Nodes():
            return nodes.nodes(ctx, request)
        case Report():
            return report.report(ctx, request)
        case Restart():
            return resubmit.restart(ctx, request)
        case Edit():
            return await resubmit.edit(ctx, request)
        case Usage():
            return await usage.usage(ctx, request)
        case Drain():
            return devices.drain(ctx, request)
        case Resume():
            return devices.resume(ctx, request)
        case Estimate():
            return await estimate.estimate(ctx, request)
        case ListGroups():
            return groups.list_groups(ctx, request)
        case SetGroup():
            return groups.set_group(ctx, request)
        case DeleteGroup():
            return groups.delete_group(ctx, request)
        case PauseGroup():
            return groups.pause_group(ctx, request)
        case ResumeGroup():
            return groups.resume_group(ctx, request)
    raise InvalidRequest(f"this daemon has no handler for {type(request).__name__} requests")


async def answer(ctx: Context, body: bytes | mmap.mmap) -> bytes:
    """One request frame's body -> one reply frame.  A refusal is the typed error's reply;
    anything else that goes wrong is logged and answered as an ``InternalError``."""
    kind = "?"
    try:
        request = wire.decode_request(cast(bytes, body))  # any buffer decodes
        kind = type(request).__name__
        return wire.encode_reply(await dispatch(ctx, request))
    except PolluxError as exc:
        return wire.encode_error(exc)
    except Exception as exc:  # never let one request take the daemon down
        log.exception("%s request failed", kind)
        return wire.encode_error(InternalError(f"internal error: {exc.__class__.__name__}: {exc}"))
