"""The simulated cluster: groups of identical nodes, each group of one device type.

An untyped cluster (``simulate --nodes N --gpus-per-node K``) is one group whose devices have
no type (``""``); a typed one (``simulate --cluster aws:6x4,dgx-ext:2x8``) is several groups,
each read from its type's measured profiles.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

from pollux_local.core.types import NodeView, Placement
from pollux_local.errors import PolluxError

_GROUP = re.compile(r"^([A-Za-z0-9][A-Za-z0-9_.-]*):(\d+)x(\d+)$")


@dataclass(frozen=True)
class NodeGroup:
    """``nodes`` identical nodes of ``devices_per_node`` devices of type ``device_type``
    (``""``: untyped)."""

    device_type: str
    nodes: int
    devices_per_node: int


def parse_cluster(text: str) -> tuple[NodeGroup, ...]:
    """``type:NxK[,type:NxK...]`` -> node groups, in the order given (the cluster order)."""
    groups: list[NodeGroup] = []
    seen: set[str] = set()
    for part in text.split(","):
        part = part.strip()
        match = _GROUP.match(part)
        if match is None:
            raise PolluxError(
                f"bad cluster group {part!r}: expected TYPE:NODESxDEVICES, e.g. aws:6x4"
            )
        name, nodes, per_node = match.group(1), int(match.group(2)), int(match.group(3))
        if nodes < 1 or per_node < 1:
            raise PolluxError(f"bad cluster group {part!r}: nodes and devices must be >= 1")
        if per_node > 9:
            raise PolluxError(
                f"bad cluster group {part!r}: at most 9 devices per node (profiles' placements)"
            )
        if name in seen:
            raise PolluxError(f"bad cluster: device type {name!r} given twice")
        seen.add(name)
        groups.append(NodeGroup(name, nodes, per_node))
    return tuple(groups)


def format_cluster(groups: Sequence[NodeGroup]) -> str:
    return ",".join(f"{g.device_type}:{g.nodes}x{g.devices_per_node}" for g in groups)


@dataclass(frozen=True)
class Cluster:
    """The nodes a simulation schedules, in order: each group's nodes one after the other,
    named ``node<i>`` (untyped) or ``<type>-<i>``."""

    groups: tuple[NodeGroup, ...]

    @classmethod
    def untyped(cls, nodes: int, devices_per_node: int) -> Cluster:
        """``nodes`` nodes of ``devices_per_node`` devices of no particular type."""
        if nodes < 1:
            raise PolluxError(f"impossible cluster size: {nodes} nodes (need at least 1)")
        if devices_per_node < 1:
            raise PolluxError(
                f"impossible cluster size: {devices_per_node} GPUs per node (need at least 1)"
            )
        return cls((NodeGroup("", nodes, devices_per_node),))

    def __post_init__(self) -> None:
        if not self.groups:
            raise PolluxError("impossible cluster: no node groups")

    @property
    def typed(self) -> bool:
        """Whether the devices have types (each type with its own profiles)."""
        return any(g.device_type for g in self.groups)

    @property
    def types(self) -> list[str]:
        return [g.device_type for g in self.groups]

    @property
    def total_devices(self) -> int:
        return sum(g.nodes * g.devices_per_node for g in self.groups)

    @cached_property
    def nodes(self) -> list[NodeView]:
        views: list[NodeView] = []
        for group in self.groups:
            for i in range(group.nodes):
                name = f"{group.device_type}-{i}" if group.device_type else f"node{i}"
                views.append(NodeView(name, group.devices_per_node, device_type=group.device_type))
        return views

    @cached_property
    def node_types(self) -> list[str]:
        """The device type of each node, in node order."""
        return [node.device_type for node in self.nodes]

    def describe(self) -> str:
        """``type:NxK,...`` (untyped: ``NxK``)."""
        if not self.typed:
            group = self.groups[0]
            return f"{group.nodes}x{group.devices_per_node}"
        return format_cluster(self.groups)

    def one_type(self, placement: Placement, rank: Sequence[str] = ()) -> Placement:
        """``placement`` cut down to the type holding most of its devices (ties: the type
        earlier in ``rank``, then the others); the other nodes' counts become 0."""
        held: dict[str, int] = {}
        types = self.node_types
        for i, c in enumerate(placement):
            if c > 0:
                held[types[i]] = held.get(types[i], 0) + c
        if len(held) <= 1:
            return placement

        def order(t: str) -> tuple[int, int]:
            return (-held[t], rank.index(t) if t in rank else len(rank))

        keep = min(held, key=order)
        return tuple(c if types[i] == keep else 0 for i, c in enumerate(placement))

    def check(self, policy: str, placements: dict[str, Placement], names: set[str]) -> None:
        """Raise when a policy placed unknown jobs, gave a malformed placement or put more
        devices on a node than it has."""
        unknown = set(placements) - names
        if unknown:
            raise RuntimeError(f"policy {policy} placed unknown jobs {sorted(unknown)}")
        used = [0] * len(self.nodes)
        for name, placement in placements.items():
            if sum(placement) == 0:
                continue
            if len(placement) != len(self.nodes) or min(placement) < 0:
                raise RuntimeError(f"policy {policy}: bad placement {placement} for {name}")
            used = [u + int(c) for u, c in zip(used, placement, strict=True)]
        if any(u > node.devices for u, node in zip(used, self.nodes, strict=True)):
            raise RuntimeError(f"policy {policy} over-committed nodes: {used}")
