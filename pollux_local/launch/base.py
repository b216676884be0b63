"""The launcher interface: how the daemon's executor starts and stops a job's replicas.

A launcher knows nothing of policies or batch sizes; it receives a fully resolved
:class:`LaunchSpec` (one :class:`ReplicaSlot` per rank, the environment already built) and
returns a :class:`ReplicaGroup` handle.  ``LocalLauncher`` (``launch/local.py``) runs replicas on
this machine under a per-incarnation supervisor (``launch/supervisor.py``); ``SshLauncher``
(``launch/ssh.py``) runs them on other nodes through the OpenSSH client.  Both must behave
identically as seen from the executor.
"""

from __future__ import annotations

import random
import socket
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, runtime_checkable

from pollux_local.api.resize import ResizeOrder
from pollux_local.errors import PolluxError
from pollux_local.launch.cgroups import Limits

#: Master (rendezvous) ports are drawn from [20000, 32000): below Linux's ephemeral range
#: (32768-60999 by default), where the kernel picks the local ports of outgoing connections.
#: A port "found free" there can be handed to a rank's own connect(); a rank that dials the
#: master before it listens may then connect to itself and wait for ever.
MASTER_PORT_RANGE = (20000, 32000)


class NoFreePort(PolluxError):
    """No master port could be bound: another process holds them (it may be a user holding
    the range on purpose); a start waits and tries again rather than fail its job."""


def pick_master_port(host: str = "127.0.0.1", rng: random.Random | None = None) -> int:
    """A port in ``MASTER_PORT_RANGE`` that can be bound on ``host`` right now."""
    draw = rng or random.Random()
    for _ in range(128):
        port = draw.randrange(*MASTER_PORT_RANGE)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
        return port
    low, high = MASTER_PORT_RANGE
    raise NoFreePort(f"no free master port in {low}-{high - 1} on {host}")


@dataclass(frozen=True)
class ReplicaSlot:
    """Where one rank runs: node name, device id on that node (``"cpu:0"``, ``"cuda:1"``)."""

    rank: int
    node: str
    device: str
    local_rank: int
    node_rank: int


@dataclass(frozen=True)
class LaunchSpec:
    """Everything needed to start one incarnation of a job.

    ``env`` is the common environment (user env + POLLUX_* + torchrun variables that do not
    depend on the rank); the launcher adds RANK, LOCAL_RANK, NODE_RANK and, for GPU devices,
    CUDA_VISIBLE_DEVICES per replica.  ``run_as`` is a Unix user name to run as (daemon running
    as root) or ``None`` for the daemon's own user; ``run_as_uid`` is that user's uid as the
    daemon recorded it (this machine's launcher goes by the uid: a name may have been given to
    another user since).  ``log_dir`` is the job's directory.  ``limits``: the host memory and
    CPUs its replicas may use, as cgroups (this machine's launcher only; ``None``: none).
    """

    job_id: str
    argv: Sequence[str]
    workdir: Path
    env: Mapping[str, str]
    slots: Sequence[ReplicaSlot]
    log_dir: Path
    run_as: str | None = None
    extra: Mapping[str, str] = field(default_factory=dict)
    run_as_uid: int | None = None
    limits: Limits | None = None
    #: where this machine's launcher writes the incarnation's warm resize orders (a file of
    #: the daemon's, given to the replicas as ``POLLUX_RESIZE_FILE``); ``None``: none here.
    #: Never taken from the job's environment.
    resize_file: Path | None = None
    #: the replicas are started to take warm resize orders (this machine's: at
    #: ``resize_file``; an SSH node's: at a file its node agent makes); ``False``: the
    #: incarnation is only ever resized by a restart
    takes_orders: bool = False
    #: the file-mode creation mask of the replicas (the submitter's); ``None``: the launcher's
    umask: int | None = None
    #: rank 0 reads the job's input FIFO ``JOB_DIR/stdin`` (``--stdin``; this machine's
    #: launcher only); the other ranks, and every rank without it, read ``/dev/null``
    stdin: bool = False


#: The state of an incarnation's record (this machine's run file, an SSH node's exit record)
#: once every replica has ended, written before its helper (supervisor, node agent) cleans
#: up what they left; ``"ended"`` follows the clean-up.
EXITED = "exited"


def settles(state: object, exits_known: bool, helper_alive: bool) -> bool:
    """The one rule by which every launcher's recovery takes a record that is not
    ``"ended"`` for its incarnation's result: every replica's exit is in it (``"exited"``;
    for a Slurm step, each task's own record of its end: ``exits_known``) and the helper
    that wrote it (a local supervisor, an SSH node's agent, a Slurm step's keeper) is gone:
    it died during its clean-up (a power cut, a kill).  The caller kills what the
    incarnation left before it takes the result.  Without it, the finished job was queued
    again and ran a second time, or was waited for for ever."""
    return (state == EXITED or exits_known) and not helper_alive


def incarnation(spec: LaunchSpec) -> int:
    """The incarnation ``spec`` starts (``POLLUX_RESTARTS``, which only the daemon sets), as
    a number: it names files on nodes and Slurm steps, so nothing else of the variable gets
    there."""
    try:
        return max(0, int(spec.env.get("POLLUX_RESTARTS", "0")))
    except ValueError:
        return 0


class ReplicaGroup(Protocol):
    """A running incarnation of a job (all its replicas)."""

    spec: LaunchSpec

    def poll(self) -> int | None:
        """``None`` while any replica runs; else the group's exit code (0 when all succeeded,
        ``ExitCode.RESCALE`` when all checkpointed for a rescale, otherwise the first
        failing replica's code, or 255 when the node became unreachable)."""
        ...

    async def wait(self) -> int:
        """Wait until every replica has exited; return the group's exit code (as ``poll``)."""
        ...

    async def stop(self, grace_s: float) -> int | None:
        """SIGTERM every replica, SIGKILL what is left ``grace_s`` later (whoever supervises
        the replicas sends it), and wait for the group's exit: its code, or ``None`` when the
        group did not end in time (its exit then still comes through :meth:`wait`).  The
        executor never awaits this during a scheduling pass: it runs it as a task and takes
        the exit from :meth:`wait`."""
        ...

    def pids(self) -> Mapping[int, int]:
        """rank -> pid (local pid for local replicas; remote pid when known)."""
        ...

    def lost_nodes(self) -> set[str]:
        """The nodes this incarnation lost, as its launcher tells (an SSH node's agent refused
        the node, Slurm reports it down, an exit record cannot be read back; never inferred
        from a replica's exit code, which is the job's to choose): they are marked down.
        Empty for this machine's replicas."""
        ...

    def unanswered_nodes(self) -> set[str]:
        """The nodes where its replicas' ends are not known and that may still be up (its
        ssh client ended by the daemon after a stop was not answered in time, or ssh ended on
        its own, as it does when the link or the agent is lost): checked now, marked down
        only if the check fails.  Empty for this machine's replicas."""
        ...


@runtime_checkable
class WarmResizable(ReplicaGroup, Protocol):
    """A running incarnation that may change its replica count in place (``api/resize.py``,
    ``daemon/executor/warm.py``): this machine's and an SSH node's groups."""

    @property
    def warm_capable(self) -> bool:
        """Whether its replicas were started to take warm resize orders (an adopted group's
        are not known)."""
        ...

    def resizes_onto(self, nodes: Collection[str]) -> bool:
        """Whether it can be resized in place onto ``nodes`` (this machine's: its one node;
        SSH nodes: any of its launcher's)."""
        ...

    async def resize_warm(
        self, spec: LaunchSpec, order: ResizeOrder, ready_timeout_s: float
    ) -> str | None:
        """Change the running replicas to ``spec``'s in place: the ranks below
        ``order.kept`` (by default those ``spec`` keeps) stay, ``spec``'s others are started
        to join, the running others leave.  Returns once the order is given and the
        leavers are gone (``None``), or why the resize could not be ordered (one line; the
        running replicas then never saw an order)."""
        ...


class Launcher(Protocol):
    """Starts replica groups on the nodes it is responsible for."""

    async def launch(self, spec: LaunchSpec) -> ReplicaGroup: ...

    async def check_node(self, node: str) -> NodeHealth: ...


@dataclass(frozen=True)
class NodeHealth:
    """Result of a node check (``pollux-local nodes``)."""

    node: str
    reachable: bool
    devices: Sequence[str] = ()
    load: float | None = None
    error: str | None = None
