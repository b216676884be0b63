"""Shared jobs (``--shared``: small rigid one-device jobs) packed outside the policy.

Queued shared jobs join devices that already run shared jobs while the memory they declared
fits and sharing still pays (``core.sharing.choose_shared_device``); one that fits nowhere
goes to the policy as a one-device rigid job, and those the policy starts in one pass are
packed together.  Devices running shared jobs are never offered to the policy: no elastic job
ever shares a device.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from pollux_local.core.schedule.plan import Action, ActionKind
from pollux_local.core.schedule.snapshot import Allocation, JobInput, NodeInput
from pollux_local.core.schedule.views import allowed_nodes
from pollux_local.core.sharing import SharedDevice, choose_shared_device, shared_speed
from pollux_local.sizes import format_size


@dataclass(frozen=True)
class Sharing:
    """Shared jobs handled outside the policy: ``starts`` (queued ones packed onto devices
    that run shared jobs), ``kept`` (running ones, left as they are), and the nodes the policy
    sees (``policy_nodes``: those devices withheld, so that no other job is placed there)."""

    starts: tuple[Action, ...]
    kept: tuple[int, ...]
    policy_nodes: list[NodeInput]

    @property
    def handled(self) -> set[int]:
        return {action.job_id for action in self.starts} | set(self.kept)


def pack_shared(
    candidates: Sequence[JobInput], nodes: Sequence[NodeInput], slowdown: float
) -> Sharing:
    """Queued shared jobs onto the devices running shared jobs, by priority then
    submission; the nodes the policy then sees."""
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
    queued = [job for job in candidates if job.shared and not job.phase.placed]
    for job in sorted(queued, key=lambda j: (-j.priority, j.id)):
        memory = job.gpu_memory or 0
        chosen = choose_shared_device(allowed_devices(job, offered, nodes), memory, slowdown)
        if chosen is None:
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
    policy_nodes = [
        replace(
            node,
            withheld=node.withheld
            | frozenset(device for (name, device) in hosts if name == node.name),
        )
        for node in nodes
    ]
    kept = tuple(job.id for job in candidates if job.shared and job.phase.placed)
    return Sharing(starts=tuple(starts), kept=kept, policy_nodes=policy_nodes)


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
) -> None:
    """Shared jobs the policy started (or left waiting) in this pass, packed together (in
    place): in priority then submission order, each joins a device another one just started
    on when it fits there (``choose_shared_device``), else keeps what the policy gave it (its
    device then takes the next ones).  Devices the policy gave but nobody uses stay free for
    the next pass."""
    memory = {node.name: node.memory for node in nodes}
    hosts: list[SharedDevice] = []
    queued = [job for job in candidates if job.shared and not job.phase.placed]
    for job in sorted(queued, key=lambda j: (-j.priority, j.id)):
        need = job.gpu_memory or 0
        chosen = choose_shared_device(allowed_devices(job, hosts, nodes), need, slowdown)
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
