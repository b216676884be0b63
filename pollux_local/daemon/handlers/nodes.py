"""``nodes``: each node's health, devices and who holds them (a job still stopping holds its
devices until its processes are gone)."""

from __future__ import annotations

from pollux_local.api.messages import Nodes, NodesReply
from pollux_local.api.states import PLACED_STATES
from pollux_local.daemon.context import Context
from pollux_local.daemon.loop import node_snapshot, stopping_jobs
from pollux_local.daemon.readmodel import node_rows


def nodes(ctx: Context, request: Nodes) -> NodesReply:
    placed = ctx.store.jobs(PLACED_STATES)
    drained = ctx.store.withheld()
    stopping = stopping_jobs(ctx.store, ctx.executor)
    rows = node_rows(
        ctx.config,
        ctx.executor.nodes,
        node_snapshot(ctx.config, ctx.executor, drained, placed, stopping),
        placed,
        drained,
        stopping,
    )
    return NodesReply(nodes=rows)
