"""``ping``: is a daemon there, and who am I to it?"""

from __future__ import annotations

import os

from pollux_local.api.messages import PROTOCOL_VERSION, Identity, Ping, PingReply
from pollux_local.daemon.context import Context


def ping(ctx: Context, request: Ping) -> PingReply:
    return PingReply(
        version=PROTOCOL_VERSION,
        pid=os.getpid(),
        state_dir=str(ctx.state_dir),
        devices=ctx.config.total_devices,
        policy=ctx.policy_name,
        you=Identity(uid=ctx.peer.uid, name=ctx.peer.name),
    )
