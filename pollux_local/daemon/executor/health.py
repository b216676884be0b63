"""What the daemon knows of each node's health: one :class:`NodeStatus` per node."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class NodeStatus:
    """What the daemon knows of one node: whether it is up (it offers its devices only
    then), why not, when it was last checked or marked, and its load per core at its last
    check (``None``: not known)."""

    up: bool = True
    error: str = ""
    checked: float = 0.0
    load: float | None = None


class NodeHealthBook:
    """One :class:`NodeStatus` per node; a node never heard of is up."""

    def __init__(self, names: list[str] | tuple[str, ...] = ()) -> None:
        self._nodes: dict[str, NodeStatus] = {name: NodeStatus() for name in names}

    def __getitem__(self, name: str) -> NodeStatus:
        return self._nodes.setdefault(name, NodeStatus())

    def is_up(self, name: str) -> bool:
        status = self._nodes.get(name)
        return status is None or status.up

    def mark(self, name: str, up: bool, error: str, now: float) -> bool:
        """Record a check's or a lost connection's verdict; ``True`` when ``up`` changed."""
        status = self[name]
        changed = status.up != up
        status.up, status.error, status.checked = up, error, now
        return changed
