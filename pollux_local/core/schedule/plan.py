"""What a scheduling pass returns: the actions to apply and what to store of the others."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum

from pollux_local.core.schedule.snapshot import Allocation
from pollux_local.core.types import BatchChoice, Decision


class ActionKind(Enum):
    """``START``: not running -> devices; ``RESIZE``: devices -> other devices; ``STOP``:
    devices -> none, back to the queue.  The value is the word a decision record stores."""

    START = "start"
    RESIZE = "resize"
    STOP = "stop"


@dataclass(frozen=True)
class Action:
    """One change to apply: the job, its new devices (``{}`` for a stop), the batch to run
    with (``None``: the job's own or none), the one-line reason and the predicted figures
    (``goodput``, ``efficiency``, ``speedup``; empty when unknown)."""

    kind: ActionKind
    job_id: int
    allocation: Allocation
    batch: BatchChoice | None
    reason: str
    prediction: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Plan:
    """``actions`` to apply; ``unchanged``: jobs left as they are; ``reasons``: the new
    reason of each job left waiting whose reason changed; ``predictions``: the new predicted
    figures of each job left running as it was whose figures changed; ``decision``: what the
    policy answered."""

    actions: tuple[Action, ...]
    decision: Decision
    unchanged: tuple[int, ...] = ()
    reasons: Mapping[int, str] = field(default_factory=dict)
    predictions: Mapping[int, dict[str, float]] = field(default_factory=dict)

    def for_job(self, job_id: int) -> Action | None:
        for action in self.actions:
            if action.job_id == job_id:
                return action
        return None
