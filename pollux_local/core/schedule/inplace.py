"""Which resizes can be done in place, and how: the one rule the daemon's executor applies
(``daemon/executor/warm.py``) and the simulator models (``sim/engine.py``)."""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

#: (node, device)
Device = tuple[str, str]


def plan_in_place(
    old: Sequence[Device], new: Mapping[str, Sequence[str]], claimed: Collection[Device]
) -> tuple[list[Device], int] | None:
    """How the running replicas (``old``: (node, device) by rank) become ``new``'s (node ->
    devices, the policy's choice) in place: the new group's (node, device) by rank, and how
    many of the running ranks stay (``kept``); ``None`` when it must be a checkpoint-restart.

    The ranks that stay are the longest prefix of ``old`` that ``new``'s count on each node
    holds (rank 0 among them: it holds the state the others receive); they keep their
    devices, in place of the policy's choice on their node where it differs, unless another
    start of the plan claims one (``claimed``).  The others leave, and joiners take ranks
    ``kept`` and up on the devices of the policy's choice that no running replica holds: a
    joiner never waits for a leaver's device, and a node never has both (its agent knows a
    replica by rank)."""
    counts = {node: len(devices) for node, devices in new.items() if devices}
    on: dict[str, int] = {}
    kept = 0
    for node, _ in old:
        if on.get(node, 0) >= counts.get(node, 0):
            break
        on[node] = on.get(node, 0) + 1
        kept += 1
    if kept == 0:
        return None  # rank 0's node is not in the new allocation
    stay = list(old[:kept])
    held = set(old)
    leaving = {node for node, _ in old[kept:]}
    slots = list(stay)
    for node, devices in new.items():
        need = counts.get(node, 0) - on.get(node, 0)
        if need <= 0:
            continue
        if node in leaving:
            return None
        free = [device for device in devices if (node, device) not in held]
        if len(free) < need:
            return None
        slots += [(node, device) for device in free[:need]]
    if any((node, device) in claimed for node, device in stay if device not in new.get(node, ())):
        return None
    if len(slots) == len(old) and kept == len(old):
        return None  # nothing changes
    return slots, kept
