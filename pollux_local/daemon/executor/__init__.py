"""Applying plans: launch, resize (checkpoint-restart), stop, and react to replicas exiting.

The executor owns the running replica groups.  A group that exits on its own is classified
(``api.states.ExitCode``): 0 -> succeeded; 255 from a remote node -> the node is marked down
and the job re-queued to resume elsewhere; anything else -> a crash, retried from the
checkpoint with exponential back-off as many times as the job may be
(``exits.retries_allowed``: its ``--retries``, else none for a rigid job and ``max_retries``
for an elastic one), then ``failed``.  That includes 75
(``ExitCode.RESCALE``): it is a rescale only from an incarnation the daemon asked to stop for
a resize or a move (a :class:`api.states.StopIntent`, recorded when the stop is sent), so a job
cannot have itself relaunched by exiting 75.  What is known of each node's health is kept in
one :class:`NodeStatus` per node (:class:`NodeHealthBook`).

Stopping never blocks a scheduling pass or a request: a stop (cancel, hold, preemption,
resize, a daemon shutdown) moves the group from :attr:`Executor.groups` to
:attr:`Executor.stopping`, sends the stop as a task of its own (SIGTERM, and SIGKILL after
``stop_grace_s``, which on this machine the job's supervisor sends) and returns; the group's
exit is handled when it comes, by what the stop was for (:attr:`Executor.intent`).  Until then
the group keeps its devices: a start that needs one of them takes another free device of the
same node when there is one, else waits (the newest plan's waiting starts are launched as
soon as the devices are released, or re-planned by the next pass).  A resized job restarts at
its new size once its old incarnation has ended.

The daemon never opens, creates, chmods or chowns anything inside a job's directory: it makes
``STATE_DIR/jobs/<id>`` itself and gives it to the job's user (``jobfiles.make_owned_dir``);
logs and the checkpoint directory are made by the job's processes as its user (on this
machine by the supervisor's children, ``launch/supervisor.py``), and what the daemon reads
there (the last log line of a failure, the final ``report.json``) goes through
:mod:`.jobfiles`.

After a restart of the daemon (:meth:`Executor.recover`) the run files of the local
supervisors (``STATE_DIR/run``) say what became of the jobs that were running: a supervisor
still running is adopted (its job keeps running), one that ended meanwhile has its recorded
exit code applied as if the daemon had seen it, and only a job with nothing recorded is
queued again to resume from its checkpoint.
"""

from __future__ import annotations

from pollux_local.daemon.executor.health import NodeHealthBook, NodeStatus
from pollux_local.daemon.executor.launchspec import (
    build_launch_spec,
    make_ssh_launcher,
    make_user_dir,
    ssh_control_dir,
)
from pollux_local.daemon.executor.recovery import Recovery

__all__ = [
    "Executor",
    "NodeHealthBook",
    "NodeStatus",
    "build_launch_spec",
    "make_ssh_launcher",
    "make_user_dir",
    "ssh_control_dir",
]


class Executor(Recovery):
    """Starts and stops jobs' replica groups and keeps the store in step with them.

    ``groups``: the running groups; ``stopping``: groups asked to stop whose exit has not come
    yet (``intent`` says what the stop was for); ``watchers``: the task waiting for each
    group's exit (a job is in ``watchers`` until that exit has been handled).  Its parts, one
    module each: :mod:`.applying` (plans and stops), :mod:`.launchspec`, :mod:`.exits`
    (classifying an end), :mod:`.recovery` (after a restart), :mod:`.accounting` (node health,
    device-seconds)."""
