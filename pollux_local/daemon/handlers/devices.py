"""``drain`` and ``resume``: an admin withholds a node or a device from new jobs, and gives it
back.  The drained set is stored (it outlives a daemon restart); jobs running there go on until
they end or are moved, and no new job is placed there (``loop.node_snapshot``)."""

from __future__ import annotations

from pollux_local.api.errors import InvalidRequest, PermissionDenied
from pollux_local.api.messages import Drain, DrainReply, Resume
from pollux_local.daemon.config import resolve_target
from pollux_local.daemon.context import Context
from pollux_local.errors import PolluxError


def _target(ctx: Context, verb: str, raw: str) -> str:
    if not ctx.is_admin():
        raise PermissionDenied(f"permission denied: only an admin may {verb} nodes or devices")
    try:
        return resolve_target(raw, ctx.config.nodes)
    except PolluxError as exc:
        raise InvalidRequest(f"{verb}: {exc}") from None


def drain(ctx: Context, request: Drain) -> DrainReply:
    target = _target(ctx, "drain", request.target)
    ctx.store.set_withheld(target, True, ctx.clock())
    ctx.wake()
    return DrainReply(withheld=ctx.store.withheld())


def resume(ctx: Context, request: Resume) -> DrainReply:
    target = _target(ctx, "resume", request.target)
    if target not in ctx.store.withheld():
        raise InvalidRequest(f"resume: {request.target} is not drained")
    ctx.store.set_withheld(target, False, ctx.clock())
    ctx.wake()
    return DrainReply(withheld=ctx.store.withheld())
