"""Which resizes can be done in place, and how: the one rule the daemon's executor applies
(``daemon/executor/warm.py``) and the simulator models (``sim/engine.py``)."""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

#: (node, device)
Device = tuple[str, str]


def plan_in_place(
    old: Sequence[Device], new: Mapping[str, Sequence[str]], claimed: Collection[Device]
) -> tuple[list[Device], list[int]] | None:
    """How the running replicas (``old``: (node, device) by rank) become ``new``'s (node ->
    devices, the policy's choice) in place: the new group's (node, device) by rank, and the
    running ranks that stay, in their new order (``stayers``: new rank i is old rank
    ``stayers[i]``); ``None`` when it must be a checkpoint-restart.

    On each node of ``new`` the first running ranks there (by rank) stay, as many as ``new``
    puts on that node; they keep their devices, in place of the policy's choice on their node
    where it differs, unless another start of the plan claims one (``claimed``), and take the
    new ranks 0, 1, ... in the order of their old ranks (rank 0, when it stays, stays rank 0;
    when its node is given up, the lowest rank that stays takes over: every replica holds the
    same training state, which the new rank 0 sends to the joiners).  The others leave, and
    joiners take the ranks after the stayers on the devices of the policy's choice that no
    running replica holds: a joiner never waits for a leaver's device, and a node never has
    both (its agent knows a replica by rank)."""
    counts = {node: len(devices) for node, devices in new.items() if devices}
    on: dict[str, int] = {}
    stayers: list[int] = []
    for rank, (node, _) in enumerate(old):
        if on.get(node, 0) < counts.get(node, 0):
            on[node] = on.get(node, 0) + 1
            stayers.append(rank)
    if not stayers:
        return None  # no node keeps a replica
    held = set(old)
    staying = set(stayers)
    leaving = {node for rank, (node, _) in enumerate(old) if rank not in staying}
    slots = [old[rank] for rank in stayers]
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
    if any((node, device) in claimed for node, device in slots[: len(stayers)]
           if device not in new.get(node, ())):  # fmt: skip
        return None
    if slots == list(old):
        return None  # nothing changes
    return slots, stayers
