"""One name per policy, and the other names it is known by.

The goodput policy is ``goodput`` everywhere (daemon config, ``daemon --policy``, ``simulate
--policy``, JSON output); ``pollux`` is accepted for it, the name of the system it improves on.
"""

from __future__ import annotations

#: other name -> the policy's one name
POLICY_ALIASES: dict[str, str] = {"pollux": "goodput"}


def canonical_policy(name: str) -> str:
    """A policy's one name (``pollux`` -> ``goodput``); other names are returned unchanged."""
    return POLICY_ALIASES.get(name, name)
