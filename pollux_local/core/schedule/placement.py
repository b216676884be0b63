"""From the policy's per-node counts to concrete devices, within every rule the pass keeps.

Whatever the policy answers: a rigid job starts only on exactly its size, a running rigid job
keeps its devices unless it is preemptible (then it may only be stopped), no job runs outside
its constraint and no user holds more than ``max_devices_per_user``, no group more than its
``max_devices`` (devices that stopping jobs still hold included).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar

from pollux_local.core.schedule.snapshot import (
    Allocation,
    Holding,
    JobInput,
    Limits,
    NodeInput,
)
from pollux_local.core.schedule.views import allowed_nodes, placement_of
from pollux_local.core.types import Placement

_K = TypeVar("_K")


def rigid_targets(
    candidates: Sequence[JobInput], targets: dict[int, Placement], nodes: Sequence[NodeInput]
) -> None:
    """Rigid jobs' targets as the rules allow (in place): a running one keeps its devices
    unless it is preemptible and the policy stopped it; a queued one gets exactly its size or
    nothing."""
    empty: Placement = tuple(0 for _ in nodes)
    for job in candidates:
        if job.elastic:
            continue
        target = targets[job.id]
        if job.running:
            if sum(target) > 0 or not job.may_stop:
                targets[job.id] = placement_of(job.allocation, nodes)
        elif sum(target) not in (0, job.needs):
            targets[job.id] = empty


def within_user_caps(
    order: Sequence[JobInput],
    targets: dict[int, Placement],
    nodes: Sequence[NodeInput],
    limits: Limits,
    holdings: Sequence[Holding] = (),
) -> None:
    """Cut each user's targets to ``max_devices_per_user`` devices (in place): jobs that keep
    their devices first, then by priority and submission; an elastic job is trimmed to what is
    left when that is at least its minimum, any other job gets nothing (it waits, or is
    stopped when preemptible).  A job outside its allowed nodes gets nothing either."""
    for job in order:
        allowed = allowed_nodes(job, nodes)
        if allowed is not None and any(
            count > 0 and i not in allowed for i, count in enumerate(targets[job.id])
        ):
            targets[job.id] = tuple(0 for _ in nodes)
    cap = limits.max_devices_per_user
    if cap is None:
        return
    used: dict[str, int] = {}
    for stop in holdings:  # devices its stopping jobs still hold
        used[stop.owner] = used.get(stop.owner, 0) + stop.count
    _cut_to_caps(order, targets, lambda job: job.owner, lambda owner: cap, used)


def within_group_caps(
    order: Sequence[JobInput],
    targets: dict[int, Placement],
    limits: Limits,
    holdings: Sequence[Holding] = (),
) -> None:
    """Cut each group's targets to its ``max_devices`` (in place), as
    :func:`within_user_caps` cuts a user's (devices its stopping jobs hold included)."""
    caps = {
        name: group.max_devices
        for name, group in limits.groups.items()
        if group.max_devices is not None
    }
    if not caps:
        return
    used: dict[str | None, int] = {}
    for stop in holdings:
        used[stop.group] = used.get(stop.group, 0) + stop.count
    _cut_to_caps(order, targets, lambda job: job.group, lambda name: caps.get(name or ""), used)


def _cut_to_caps(
    order: Sequence[JobInput],
    targets: dict[int, Placement],
    key: Callable[[JobInput], _K],
    cap_of: Callable[[_K], int | None],
    used: dict[_K, int],
) -> None:
    """Cut the targets of the jobs sharing a ``key`` to its cap (``used``: what each key
    holds already): jobs that keep their devices first, then by priority and submission; an
    elastic job is trimmed to what is left when that is at least its minimum, any other job
    gets nothing (it waits, or is stopped when preemptible)."""
    ranked = sorted(
        order,
        key=lambda j: (
            not j.phase.placed,
            not (j.replicas and not j.elastic),
            -j.priority,
            j.id,
        ),
    )
    for job in ranked:
        owner = key(job)
        cap = cap_of(owner)
        if cap is None:
            continue
        target = list(targets[job.id])
        have = used.get(owner, 0)
        count = sum(target)
        if have + count > cap:
            room = cap - have
            if job.elastic and room >= job.needs:
                for i in reversed(range(len(target))):
                    cut = min(target[i], count - room)
                    target[i] -= cut
                    count -= cut
            elif not (job.phase.placed and not job.may_stop):
                target = [0] * len(target)
            targets[job.id] = tuple(target)
        used[owner] = have + sum(targets[job.id])


def assign_devices(
    targets: Mapping[int, Placement],
    current: Mapping[int, Mapping[str, Sequence[str]]],
    nodes: Sequence[NodeInput],
) -> dict[int, Allocation]:
    """Concrete devices for per-node counts.  A job keeps, in their order, as many of its
    devices on a node as its count there allows: all of them when its count is unchanged or
    grows, its first ones (its lowest ranks') when it shrinks, so that a resize changes only
    the devices it must (the replicas that stay keep theirs: a resize can be done in place).
    The rest take the lowest free devices.  A count that cannot be met (devices busy outside
    the scheduler) is cut to what is free."""
    pool = {node.name: list(node.free_devices) for node in nodes}
    result: dict[int, Allocation] = {job_id: {} for job_id in targets}
    pending: list[tuple[int, str, int]] = []
    for job_id, placement in targets.items():
        for node, count in zip(nodes, placement, strict=False):
            if count <= 0:
                continue
            free = pool[node.name]
            kept = [d for d in current.get(job_id, {}).get(node.name, ()) if d in free][:count]
            for device in kept:
                free.remove(device)
            if kept:
                result[job_id][node.name] = kept
            if len(kept) < count:
                pending.append((job_id, node.name, count - len(kept)))
    for job_id, node_name, count in pending:
        take, pool[node_name] = pool[node_name][:count], pool[node_name][count:]
        if take:
            result[job_id][node_name] = result[job_id].get(node_name, []) + take
    return result


def allocate(
    candidates: Sequence[JobInput], targets: Mapping[int, Placement], nodes: Sequence[NodeInput]
) -> dict[int, Allocation]:
    """Each candidate's devices for its target: rigid jobs first (the devices they keep are
    theirs before any other job's); an allocation below the job's minimum is none."""
    order = sorted(candidates, key=lambda job: job.elastic)
    assigned = assign_devices(
        {job.id: targets[job.id] for job in order},
        {job.id: job.allocation for job in candidates},
        nodes,
    )
    allocations: dict[int, Allocation] = {}
    for job in candidates:
        allocation = {k: v for k, v in assigned[job.id].items() if v}
        if 0 < sum(len(v) for v in allocation.values()) < job.needs:
            allocation = {}
        allocations[job.id] = allocation
    return allocations


def same_allocation(a: Mapping[str, Sequence[str]], b: Mapping[str, Sequence[str]]) -> bool:
    """Whether two allocations hold the same devices (empty nodes aside)."""
    keys = {k for k, v in a.items() if v} | {k for k, v in b.items() if v}
    return all(sorted(a.get(k, ())) == sorted(b.get(k, ())) for k in keys)
