"""The one scheduling pass: a :class:`Snapshot` in, a :class:`Plan` out, nothing else touched.

In (:mod:`.snapshot`): the jobs (:class:`JobInput`: queued, running or rescaling, each with its
size bounds, rigidity, priority, constraint, dependencies' outcomes, array cap, time limit,
sharing, attained service, current devices and fitted models), the nodes in order
(:class:`NodeInput`: devices as strings, up or down, busy, withheld, type, memory), what jobs
still stopping hold (:class:`Holding`), the per-user :class:`Limits` and the time ``now``.
The daemon builds it from its store and the simulator from its trace; nothing here reads a
clock, a file or a process, and randomness comes from the ``rng`` passed in.

Out (:mod:`.plan`): :func:`run_pass` returns a :class:`Plan`: start / resize / stop
:class:`Action` s (:class:`ActionKind`) with concrete devices, batch sizes (m, s, K), a
one-line reason and predicted figures; the jobs left as they are; the new reason of every job
left waiting (only where it changed) and the new predictions of running jobs (likewise).

Guarantees, whatever the policy answers:

* admission (:mod:`.admission`): a queued job whose dependencies have not succeeded, whose
  array runs its ``max_running`` tasks, whose group is paused or at its ``max_running`` /
  ``max_devices``, or whose owner is at ``max_running_per_user`` / ``max_devices_per_user``
  (counting what stopping jobs still hold) is not shown to the policy, and gets its reason;
* placement (:mod:`.placement`): a rigid job starts on exactly ``min_devices`` devices or
  waits, is never resized or moved, and is stopped only when preemptible; no job runs outside
  its constraint or beyond its owner's or its group's device cap; no job is placed on a busy, withheld or
  stopping device;
* sharing (:mod:`.shared`): shared jobs are packed onto devices running shared jobs while the
  declared memory fits and sharing pays; no other job lands on such a device;
* every waiting job schedulable this pass has a reason (:mod:`.reasons`): from admission, a
  back-off, or the policy's facts (what it needs, what is free, who holds it, why they come
  first and when they are expected to end).
"""

from pollux_local.core.schedule.admission import Verdict, dependency_verdict
from pollux_local.core.schedule.plan import Action, ActionKind, Plan
from pollux_local.core.schedule.run import run_pass, schedulable
from pollux_local.core.schedule.snapshot import (
    AfterMode,
    Allocation,
    Constraint,
    Dependency,
    GroupLimit,
    Holding,
    JobInput,
    JobPhase,
    Limits,
    NodeInput,
    Outcome,
    Snapshot,
)

__all__ = [
    "Action",
    "ActionKind",
    "AfterMode",
    "Allocation",
    "Constraint",
    "Dependency",
    "GroupLimit",
    "Holding",
    "JobInput",
    "JobPhase",
    "Limits",
    "NodeInput",
    "Outcome",
    "Plan",
    "Snapshot",
    "Verdict",
    "dependency_verdict",
    "run_pass",
    "schedulable",
]
