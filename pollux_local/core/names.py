"""The one registry of policies: each name with its description and its factory.

The goodput policy is ``goodput`` everywhere (daemon config, ``daemon --policy``, ``simulate
--policy``, JSON output); ``pollux`` is accepted for it, the name of the system it improves on.
Every list of policy names (the daemon's choices, the simulator's, those that run on a cluster
of several device types) and every factory reads :data:`POLICIES`; adding a policy is one entry
here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pollux_local.core.types import Policy

#: other name -> the policy's one name
POLICY_ALIASES: dict[str, str] = {"pollux": "goodput"}


@dataclass(frozen=True)
class PolicySettings:
    """What a policy is built with: the scheduling interval, the cost of a restart and (the
    goodput policy) the fairness exponent ``p`` (``None``: the policy's default)."""

    interval_s: float = 60.0
    restart_cost_s: float = 30.0
    p: float | None = None


@dataclass(frozen=True)
class PolicyEntry:
    """One policy: its description, its factory, whether it runs on a cluster of several
    device types (``typed``) and whether the daemon offers it (``daemon``)."""

    name: str
    description: str
    factory: Callable[[PolicySettings], Policy]
    typed: bool = False
    daemon: bool = False


def _goodput(settings: PolicySettings, type_aware: bool = True) -> Policy:
    from pollux_local.core.policy import GoodputPolicy

    if settings.p is None:
        return GoodputPolicy(
            restart_cost_s=settings.restart_cost_s,
            interval_s=settings.interval_s,
            type_aware=type_aware,
        )
    return GoodputPolicy(
        p=settings.p,
        restart_cost_s=settings.restart_cost_s,
        interval_s=settings.interval_s,
        type_aware=type_aware,
    )


def _fifo(_: PolicySettings) -> Policy:
    from pollux_local.core.baselines import FifoPolicy

    return FifoPolicy()


def _tiresias(_: PolicySettings) -> Policy:
    from pollux_local.core.baselines import TiresiasPolicy

    return TiresiasPolicy()


def _optimus(_: PolicySettings) -> Policy:
    from pollux_local.core.baselines import OptimusPolicy

    return OptimusPolicy()


def _sia(_: PolicySettings) -> Policy:
    from pollux_local.core.sia import SiaPolicy

    return SiaPolicy()


#: Every policy, in the order the CLI lists them.
POLICIES: dict[str, PolicyEntry] = {
    entry.name: entry
    for entry in (
        PolicyEntry(
            "goodput",
            "devices and batch sizes for the most goodput, shared fairly (p)",
            _goodput,
            typed=True,
            daemon=True,
        ),
        PolicyEntry("tiresias", "least attained service first, fixed sizes", _tiresias),
        PolicyEntry("optimus", "marginal throughput gain, fixed batch sizes", _optimus),
        PolicyEntry("fifo", "first come first served at the requested size", _fifo, daemon=True),
        PolicyEntry("sia", "per-type configurations by an integer program", _sia, typed=True),
        PolicyEntry(
            "goodput-unaware",
            "the goodput policy blind to device types (a cluster's types as one)",
            lambda settings: _goodput(settings, type_aware=False),
            typed=True,
        ),
    )
}


def canonical_policy(name: str) -> str:
    """A policy's one name (``pollux`` -> ``goodput``); other names are returned unchanged."""
    return POLICY_ALIASES.get(name, name)


def policy_names(*, typed: bool = False, daemon: bool = False) -> tuple[str, ...]:
    """The policies' names, in order; ``typed``: only those for several device types,
    ``daemon``: only those the daemon offers."""
    return tuple(
        entry.name
        for entry in POLICIES.values()
        if (entry.typed or not typed) and (entry.daemon or not daemon)
    )


def make_policy(
    name: str, interval_s: float = 60.0, restart_cost_s: float = 30.0, p: float | None = None
) -> Policy:
    """A fresh policy object by name (or alias); ``ValueError`` naming the choices for an
    unknown one."""
    entry = POLICIES.get(canonical_policy(name))
    if entry is None:
        raise ValueError(f"unknown policy {name!r} (choose from {', '.join(POLICIES)})")
    return entry.factory(PolicySettings(interval_s=interval_s, restart_cost_s=restart_cost_s, p=p))
