"""Dispatch: a request decoded strictly into its ``api.messages`` class goes to its handler
(``handlers/``) by one ``match`` over the request classes; the typed reply, or the typed error
(``api.errors``), is the answer.  A new request type is one ``case`` here."""

from __future__ import annotations

import logging
import mmap
import time
from typing import Any, cast

from pollux_local.api import wire
from pollux_local.api.errors import (
    InternalError,
    InvalidRequest,
    PolluxError,
    StateDiskFull,
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
    ReportReply,
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


#: The requests that are not served in turns: a ping (nothing to do), and a job's own
#: report (limited per job and per user apart, ``handlers.report``; a job must not wait
#: behind its user's reads).
UNPACED = (Ping, Report)


def in_turns(request: Request[Any]) -> bool:
    """Whether ``request`` is served in its user's turn (``pacing.LoopShare``): every one
    but :data:`UNPACED`.  A request's cost depends on what it names (a ``status`` page, a
    ``cancel`` of 10,000 ids, a 100-task array, a group's row): turns bound a user's share
    of the daemon whatever they send, where a bound per request let a loop of requests each
    under it take the daemon from the others."""
    return not isinstance(request, UNPACED)


#: The requests not synced before their answer: a ping (it changes nothing) and a job's own
#: report (its next one, half a second later, replaces it; up to 20 a second per user would
#: each cost an fsync).
UNSYNCED = (Ping, Report)


async def dispatch(ctx: Context, request: Request[Any]) -> Reply:
    """The handler of ``request``'s type, and its reply (in its user's turn, :func:`in_turns`).

    What the request changed is on the disk before it is answered (:func:`_durably`)."""
    if ctx.read_share is not None and in_turns(request):
        async with ctx.read_share.turn(ctx.peer.uid):
            if ctx.room_for_reply is not None:  # in the turn: the earlier replies counted
                ctx.room_for_reply()
            return await _durably(ctx, request)
    return await _durably(ctx, request)


async def _durably(ctx: Context, request: Request[Any]) -> Reply:
    """:func:`_handle`, then, when the database changed meanwhile, its write-ahead log synced
    (``StateStore.make_durable``) before the answer goes, refusal or not (a part already
    done is named in it): nothing a user was told is undone by a power cut (an edited
    command, a priority, a drained device, a paused group were committed with
    ``synchronous=NORMAL`` and answered unsynced).  :data:`UNSYNCED` excepted."""
    if isinstance(request, UNSYNCED):
        return await _handle(ctx, request)
    written = ctx.store.db.total_changes
    try:
        return await _handle(ctx, request)
    finally:
        if ctx.store.db.total_changes != written:
            ctx.store.make_durable()


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


#: A request refused for a full state disk is logged at most this often (seconds).
DISK_FULL_LOG_S = 60.0
#: When one was last logged (monotonic seconds; empty: never).
_disk_full_logged: list[float] = []


def _note_disk_full(kind: str, message: str) -> None:
    """Log a request refused for a full state disk, at most once a minute."""
    now = time.monotonic()
    if _disk_full_logged and now - _disk_full_logged[0] < DISK_FULL_LOG_S:
        return
    _disk_full_logged[:] = [now]
    log.error("%s request refused: %s", kind, message)


async def answer(ctx: Context, body: bytes | mmap.mmap) -> bytes:
    """One request frame's body -> one reply frame.  A refusal is the typed error's reply;
    anything else that goes wrong is logged and answered as an ``InternalError``.  The time
    spent decoding the request and encoding its reply, and all of a request served outside
    the turns (:data:`UNPACED`, each first admitted at its user's rate), is charged to its
    user (``pacing.LoopShare.charge``): a loop of 16 MiB frames, or of pings, cost the
    daemon a core that no turn counted."""
    kind = "?"
    share = ctx.read_share
    clock = time.perf_counter
    spent = 0.0
    try:
        began = clock()
        try:
            request = wire.decode_request(cast(bytes, body))  # any buffer decodes
        finally:
            spent += clock() - began
        kind = type(request).__name__
        paced = in_turns(request)
        if share is not None and not paced:
            # a report over its user's rate is not taken (its job reports again), rather
            # than held asleep on one of the user's connections; a ping waits
            reporting = isinstance(request, Report)
            if not await share.admit_unpaced(ctx.peer.uid, wait=not reporting):
                return wire.encode_reply(ReportReply(accepted=False))
        began = clock()
        try:
            reply = await dispatch(ctx, request)
        finally:
            if not paced:
                spent += clock() - began
        began = clock()
        try:
            return wire.encode_reply(reply)
        finally:
            spent += clock() - began
    except StateDiskFull as exc:  # the admin's to fix: said in the daemon's log too
        _note_disk_full(kind, str(exc))
        return wire.encode_error(exc)
    except PolluxError as exc:
        return wire.encode_error(exc)
    except Exception as exc:  # never let one request take the daemon down
        log.exception("%s request failed", kind)
        return wire.encode_error(InternalError(f"internal error: {exc.__class__.__name__}: {exc}"))
    finally:
        if share is not None:
            share.charge(ctx.peer.uid, spent)
