"""Shared jobs (``--shared``: small rigid one-device jobs) packed outside the policy.

Queued shared jobs join devices that already run shared jobs while the memory they declared
fits and the device runs fewer than the admin's cap (``[devices] max_jobs_per_device``;
``core.sharing.choose_shared_device``); one that fits nowhere goes to the policy as a
one-device rigid job, and those the policy starts in one pass are packed together.  One that
would fit but for the cap and then gets no device waits with a reason naming the cap.  Devices running shared jobs are never offered to the policy: no elastic job
ever shares a device.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from pollux_local.core.schedule.plan import Action, ActionKind
from pollux_local.core.schedule.snapshot import Allocation, JobInput, NodeInput
from pollux_local.core.schedule.views import allowed_nodes
from pollux_local.core.sharing import (
    DEFAULT_MAX_JOBS_PER_DEVICE,
    SharedDevice,
    choose_shared_device,
    full_devices,
    shared_speed,
)
from pollux_local.sizes import format_size


@dataclass(frozen=True)
class Sharing:
    """Shared jobs handled outside the policy: ``starts`` (queued ones packed onto devices
    that run shared jobs), ``kept`` (running ones, left as they are), the nodes the policy
    sees (``policy_nodes``: those devices withheld, so that no other job is placed there), and
    why queued ones that would fit but for the cap did not join (``capped``: job id -> the
    words of its waiting reason)."""

    starts: tuple[Action, ...]
    kept: tuple[int, ...]
    policy_nodes: list[NodeInput]
    capped: dict[int, str] = field(default_factory=dict)

    @property
    def handled(self) -> set[int]:
        return {action.job_id for action in self.starts} | set(self.kept)


def pack_shared(
    candidates: Sequence[JobInput],
    nodes: Sequence[NodeInput],
    slowdown: float,
    max_jobs: int = DEFAULT_MAX_JOBS_PER_DEVICE,
) -> Sharing:
    """Queued shared jobs onto the devices running shared jobs (at most ``max_jobs`` on
    each), by priority then submission; the nodes the policy then sees."""
    hosts: dict[tuple[str, str], list[JobInput]] = {}
    for job in candidates:
        if job.shared and job.phase.placed:
            for node_name, held in job.allocation.items():
                for device in held:
                    hosts.setdefault((node_name, device), []).append(job)
    by_name = {node.name: node for node in nodes}
    offered: list[SharedDevice] = []
    for (node_name, device), jobs in sorted(hosts.items()):
        node = by_name.get(node_name)
        if node is None or node.memory is None or device not in node.free_devices:
            continue  # unknown memory, node down, drained or busy: nobody joins
        offered.append(
            SharedDevice(
                key=(node_name, device),
                jobs=len(jobs),
                used=sum(job.gpu_memory or 0 for job in jobs),
                total=node.memory,
                free=node.free_memory.get(device),
            )
        )
    starts: list[Action] = []
    capped: dict[int, str] = {}
    queued = [job for job in candidates if job.shared and not job.phase.placed]
    for job in sorted(queued, key=lambda j: (-j.priority, j.id)):
        memory = job.gpu_memory or 0
        allowed = allowed_devices(job, offered, nodes)
        chosen = choose_shared_device(allowed, memory, slowdown, max_jobs)
        if chosen is None:
            full = full_devices(allowed, memory, max_jobs)
            if full:
                capped[job.id] = cap_words(full, max_jobs)
            continue
        offered[offered.index(chosen)] = replace(
            chosen, jobs=chosen.jobs + 1, used=chosen.used + memory
        )
        node_name, device = chosen.key
        others = ", ".join(str(j.id) for j in hosts[chosen.key])
        speed = shared_speed(chosen.jobs + 1, slowdown)
        reason = (
            f"1 device(s) on {node_name}[{device}]; sharing it with job(s) {others}"
            f" ({chosen.jobs + 1} jobs, {format_size(chosen.used + memory)} of"
            f" {format_size(chosen.total)} declared); predicted speed {speed:.2f} of a device each"
        )
        starts.append(Action(ActionKind.START, job.id, {node_name: [device]}, None, reason))
        hosts[chosen.key].append(job)
    hosted: dict[str, set[str]] = {}
    for name, device in hosts:
        hosted.setdefault(name, set()).add(device)
    policy_nodes = [
        replace(node, withheld=node.withheld | frozenset(hosted[node.name]))
        if node.name in hosted
        else node
        for node in nodes
    ]
    kept = tuple(job.id for job in candidates if job.shared and job.phase.placed)
    return Sharing(starts=tuple(starts), kept=kept, policy_nodes=policy_nodes, capped=capped)


def cap_words(full: Sequence[SharedDevice], max_jobs: int) -> str:
    """``box[cuda:0] runs 4 shared jobs, the most [devices] max_jobs_per_device = 4 allows``"""
    names = ", ".join(f"{node}[{device}]" for node, device in (d.key for d in full[:3]))
    more = f" and {len(full) - 3} more" if len(full) > 3 else ""
    verb = "runs" if len(full) == 1 else "each run"
    return (
        f"{names}{more} {verb} {max_jobs} shared jobs, the most"
        f" [devices] max_jobs_per_device = {max_jobs} allows"
    )


def allowed_devices(
    job: JobInput, devices: Sequence[SharedDevice], nodes: Sequence[NodeInput]
) -> list[SharedDevice]:
    """The shared devices on nodes the job's constraint allows."""
    allowed = allowed_nodes(job, nodes)
    if allowed is None:
        return list(devices)
    names = {nodes[i].name for i in allowed}
    return [device for device in devices if device.key[0] in names]


def pack_onto_new_hosts(
    candidates: Sequence[JobInput],
    allocations: dict[int, Allocation],
    nodes: Sequence[NodeInput],
    slowdown: float,
    max_jobs: int = DEFAULT_MAX_JOBS_PER_DEVICE,
) -> dict[int, str]:
    """Shared jobs the policy started (or left waiting) in this pass, packed together (in
    place): in priority then submission order, each joins a device another one just started
    on when it fits there (``choose_shared_device``), else keeps what the policy gave it (its
    device then takes the next ones).  Devices the policy gave but nobody uses stay free for
    the next pass.  Returns why those left without a device that would fit but for the cap
    of ``max_jobs`` did not join (job id -> words for the waiting reason)."""
    memory = {node.name: node.memory for node in nodes}
    hosts: list[SharedDevice] = []
    capped: dict[int, str] = {}
    queued = [job for job in candidates if job.shared and not job.phase.placed]
    for job in sorted(queued, key=lambda j: (-j.priority, j.id)):
        need = job.gpu_memory or 0
        allowed = allowed_devices(job, hosts, nodes)
        chosen = choose_shared_device(allowed, need, slowdown, max_jobs)
        if chosen is not None:
            hosts[hosts.index(chosen)] = replace(
                chosen, jobs=chosen.jobs + 1, used=chosen.used + need
            )
            allocations[job.id] = {chosen.key[0]: [chosen.key[1]]}
            continue
        allocation = allocations.get(job.id) or {}
        for node_name, devices in allocation.items():
            total = memory.get(node_name)
            if total is not None and devices:
                hosts.append(SharedDevice((node_name, devices[0]), jobs=1, used=need, total=total))
        full = full_devices(allowed, need, max_jobs)
        if not allocation and full:
            capped[job.id] = cap_words(full, max_jobs)
    return capped
