"""Job states and exit codes: the words the daemon, the CLI, the TUI and jobs share."""

from __future__ import annotations

from collections.abc import Mapping
from enum import IntEnum, StrEnum
from types import MappingProxyType


class JobState(StrEnum):
    """The life of a job in the daemon.

    ::

        submit ──► QUEUED ◄──────────── release ──────── HELD
        (--hold) ─────────────────────────────────────► ▲
                     │  ▲                                │ hold (queued, running,
              start  │  │ preempted, node lost, crashed  │       rescaling)
                     ▼  │ (retried after a back-off)     │
                   RUNNING ── resize: SIGTERM, exit 75 ──► RESCALING ──► RUNNING
                     │                                      (restarted at its new size)
                     ├── every replica exits 0 ──────────────────────► SUCCEEDED
                     ├── fails, retries exhausted or cannot start ───► FAILED
                     └── cancel (from any active state) ─────────────► CANCELLED

    ``QUEUED``, ``RUNNING``, ``RESCALING`` and ``HELD`` are active; ``SUCCEEDED``, ``FAILED``
    and ``CANCELLED`` are terminal: a terminal job never runs again (a new submit is a new job).
    A job that was running when the daemon stopped is queued again at its next start.  A job
    whose replicas exit 0 while they stop for a preemption, a resize or a hold has succeeded
    (from ``QUEUED``, ``RESCALING`` or ``HELD``: released, it would run its work again); a
    queued or held job whose dependency failed has failed; a queued job stays queued with a
    new reason (a stop that found it waiting, a back-off).

    Every move, as :data:`TRANSITIONS` has it (``can_become``; a test keeps the two equal)::

        queued    -> queued, running, held, succeeded, failed, cancelled
        running   -> queued, rescaling, held, succeeded, failed, cancelled
        rescaling -> queued, running, held, succeeded, failed, cancelled
        held      -> queued, succeeded, failed, cancelled
        succeeded -> (none)
        failed    -> (none)
        cancelled -> (none)
    """

    QUEUED = "queued"
    RUNNING = "running"
    RESCALING = "rescaling"
    HELD = "held"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def terminal(self) -> bool:
        return self in TERMINAL_STATES

    @property
    def active(self) -> bool:
        return self in ACTIVE_STATES

    def can_become(self, other: JobState) -> bool:
        """Whether the state machine lets a job in this state move to ``other``."""
        return other in TRANSITIONS[self]


ACTIVE_STATES = frozenset({JobState.QUEUED, JobState.RUNNING, JobState.RESCALING, JobState.HELD})
TERMINAL_STATES = frozenset({JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED})
#: States in which a job holds devices.
PLACED_STATES = frozenset({JobState.RUNNING, JobState.RESCALING})
_FROM_PLACED = frozenset(
    {
        JobState.QUEUED,
        JobState.HELD,
        JobState.SUCCEEDED,
        JobState.FAILED,
        JobState.CANCELLED,
    }
)
#: The state machine of :class:`JobState` as data: each state -> the states it may become.
TRANSITIONS: Mapping[JobState, frozenset[JobState]] = MappingProxyType(
    {
        JobState.QUEUED: frozenset({JobState.RUNNING} | _FROM_PLACED),
        JobState.RUNNING: _FROM_PLACED | {JobState.RESCALING},
        JobState.RESCALING: _FROM_PLACED | {JobState.RUNNING},
        JobState.HELD: frozenset(
            {JobState.QUEUED, JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED}
        ),
        JobState.SUCCEEDED: frozenset(),
        JobState.FAILED: frozenset(),
        JobState.CANCELLED: frozenset(),
    }
)


class ExitCode(IntEnum):
    """Exit codes with a meaning across a process boundary."""

    #: a replica (or the CLI) finished successfully
    OK = 0
    #: the CLI refused bad input or the daemon refused the request (one line on stderr)
    USAGE = 2
    #: a job of ``jobs/`` ended without reaching its declared quality target
    TARGET_MISSED = 3
    #: a replica checkpointed on SIGTERM so that the job can be resized (sysexits EX_TEMPFAIL)
    RESCALE = 75
    #: a replica's command could not be executed (the shell's code for it)
    EXEC_FAILED = 127
    #: the CLI was interrupted (SIGINT)
    INTERRUPTED = 130
    #: a replica's user could not enter its working directory (the local supervisor)
    WORKDIR = 252
    #: a replica could not be prepared: privileges, its log, the checkpoint directory
    SETUP = 253
    #: a node's agent could not start any replica (working directory, unshared path, user)
    NODE_SETUP = 254
    #: a replica's node became unreachable (the ssh client's own code for a lost link)
    NODE_LOST = 255


class StopIntent(StrEnum):
    """Why the daemon asked an incarnation of a job to stop: its exit is read by this.

    Only an incarnation of an elastic job asked to stop for :attr:`RESIZE` may end with
    :attr:`ExitCode.RESCALE` as a rescale; an exit 75 nobody asked for is a crash."""

    #: ``cancel``: the job ends cancelled
    CANCEL = "cancel"
    #: ``hold``: the job waits, held, until released
    HOLD = "hold"
    #: the policy took its devices: back in the queue
    PREEMPT = "preempt"
    #: the policy gave it other devices (a resize or a move): restarted there from its
    #: checkpoint
    RESIZE = "resize"
    #: its time limit was reached: it ends failed
    TIME_LIMIT = "time-limit"
    #: the daemon is stopping: back in the queue at its next start
    SHUTDOWN = "shutdown"
    #: replicas the database does not record as running
    RECONCILE = "reconcile"


class DecisionKind(StrEnum):
    """What a line of a job's decision log records (``show``'s decisions)."""

    SUBMITTED = "submitted"
    #: the policy started it, resized it (restarted at a new size) or took its devices
    START = "start"
    RESIZE = "resize"
    STOP = "stop"
    #: back in the queue (a shutdown, an orphaned or vanished incarnation, a resize's wait)
    REQUEUED = "requeued"
    #: a restarted daemon took it over
    RECOVERED = "recovered"
    #: a crash, retried after a back-off
    CRASHED = "crashed"
    FAILED = "failed"
    FINISHED = "finished"
    CANCELLED = "cancelled"
    HELD = "held"
    RELEASED = "released"
    EDITED = "edited"
    PRIORITY = "priority"
    #: a node it ran on became unreachable
    NODE_DOWN = "node-down"
