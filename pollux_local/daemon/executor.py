"""Applying plans: launch, resize (checkpoint-restart), stop, and react to replicas exiting.

The executor owns the running replica groups.  A group that exits on its own is classified
(``api.states.ExitCode``): 0 -> succeeded; 255 from a remote node -> the node is marked down
and the job re-queued to resume elsewhere; anything else -> a crash, retried from the
checkpoint with exponential back-off until ``max_retries``, then ``failed``.  That includes 75
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

import asyncio
import contextlib
import dataclasses
import functools
import hashlib
import logging
import os
import pwd
import signal
import sqlite3
import stat
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from pollux_local.api.launch import LaunchEnvironment
from pollux_local.api.states import PLACED_STATES, ExitCode, JobState, StopIntent
from pollux_local.core.types import BatchChoice
from pollux_local.daemon.config import DaemonConfig, NodeConfig, busy_gpus
from pollux_local.daemon.failures import permanent_cause
from pollux_local.daemon.jobfiles import make_owned_dir, read_job_file
from pollux_local.daemon.reports import InvalidReport, read_job_report
from pollux_local.daemon.scheduler import Action, Allocation, Plan
from pollux_local.daemon.state import JobRecord, StateStore
from pollux_local.errors import PolluxError
from pollux_local.launch.base import (
    Launcher,
    LaunchSpec,
    NodeHealth,
    ReplicaGroup,
    ReplicaSlot,
    pick_master_port,
)
from pollux_local.launch.local import LocalLauncher, LocalReplicaGroup, RunRecord

log = logging.getLogger("pollux_local.daemon")

#: How often a group with remote replicas is looked at for ranks whose node was lost.
LOST_NODE_POLL_S = 0.5
#: At a daemon shutdown, how long past ``stop_grace_s`` the stops are waited for.
SHUTDOWN_MARGIN_S = 15.0
#: The intent of a stop found in flight after a daemon restart, by the job's recorded state.
RECOVERED_INTENT = {
    JobState.QUEUED: StopIntent.PREEMPT,
    JobState.RESCALING: StopIntent.RESIZE,
    JobState.HELD: StopIntent.HOLD,
    JobState.CANCELLED: StopIntent.CANCEL,
}
#: Why an exit 75 that no resize asked for is not a rescale.
UNASKED_RESCALE = (
    f"exited {ExitCode.RESCALE:d} (the rescale code) but no rescale was asked; counted as a crash"
)

Device = tuple[str, str]  # (node name, device id)


def last_log_line(directory: Path, name: str, owner_uid: int, limit: int = 4096) -> str:
    """The last non-empty line of a job's log (for a failure's reason), read through
    :func:`jobfiles.read_job_file` (never a symlink, a FIFO or another user's file)."""
    try:
        data, _, _ = read_job_file(directory, name, owner_uid, offset=-limit, max_bytes=limit)
    except OSError:
        return ""
    for line in reversed(data.decode(errors="replace").splitlines()):
        if line.strip() and not line.startswith("--- "):
            return line.strip()[:200]
    return ""


def one_line(text: object, limit: int = 300) -> str:
    return " ".join(str(text).split())[:limit]


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


class Executor:
    """Starts and stops jobs' replica groups and keeps the store in step with them.

    ``groups``: the running groups; ``stopping``: groups asked to stop whose exit has not come
    yet (``intent`` says what the stop was for); ``watchers``: the task waiting for each
    group's exit (a job is in ``watchers`` until that exit has been handled)."""

    def __init__(
        self,
        store: StateStore,
        config: DaemonConfig,
        state_dir: Path,
        socket_path: Path,
        on_change: Callable[[], None] = lambda: None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.store = store
        self.config = config
        self.state_dir = state_dir
        self.socket_path = socket_path
        self.on_change = on_change
        self.clock = clock
        self.groups: dict[int, ReplicaGroup] = {}
        self.stopping: dict[int, ReplicaGroup] = {}
        self.watchers: dict[int, asyncio.Task[None]] = {}
        #: ends of groups whose records failed (a full disk): (group, code, stop intent),
        #: recorded by :meth:`record_unrecorded` at the next passes
        self.unrecorded: dict[int, tuple[ReplicaGroup, int, Any]] = {}
        self.intent: dict[int, StopIntent] = {}
        self.nodes = NodeHealthBook([node.name for node in config.nodes])
        self.last_launch: dict[int, float] = {}
        self.run_dir = state_dir / "run"
        self._local = LocalLauncher(
            {n.name: n.devices for n in config.nodes if n.is_local},
            run_dir=self.run_dir,
            stop_grace_s=config.stop_grace_s,
            max_log_bytes=config.max_log_bytes,
            log_keep_free=config.log_keep_free,
        )
        self._ssh: Launcher | None = None
        self._checking: dict[str, asyncio.Task[None]] = {}
        self._noted_down: set[tuple[int, str]] = set()
        self._stop_tasks: dict[int, asyncio.Task[None]] = {}
        #: resizes waiting for the job's old incarnation to end
        self._resize: dict[int, Action] = {}
        #: starts of the newest plan waiting for devices still held by stopping groups
        self._deferred: dict[int, Action] = {}
        self._starting = asyncio.Lock()
        self._closing = False
        #: removals of SSH nodes' exit records under way
        self._forgetting: set[asyncio.Task[None]] = set()

    # --- launchers and nodes ----------------------------------------------------------------

    def launcher_for(self, node: NodeConfig) -> Launcher:
        if node.is_local:
            return self._local
        if self._ssh is None:
            self._ssh = make_ssh_launcher(self.config, self.state_dir)
        return self._ssh

    def reconfigure(self, config: DaemonConfig) -> None:
        """Use a config read again (``SIGHUP``) from now on: its nodes, devices and settings.
        The SSH launcher learns the remote nodes it adds and keeps the ones it drops, whose
        running groups it still watches and stops."""
        self.config = config
        self._local.devices = {n.name: n.devices for n in config.nodes if n.is_local}
        self._local.stop_grace_s = config.stop_grace_s
        self._local.max_log_bytes = config.max_log_bytes
        self._local.log_keep_free = config.log_keep_free
        if self._ssh is not None:
            from pollux_local.launch.ssh import SshLauncher, SshNodeConfig

            if isinstance(self._ssh, SshLauncher):
                self._ssh.max_log_bytes = config.max_log_bytes
                self._ssh.log_keep_free = config.log_keep_free
                for node in config.nodes:
                    if not node.is_local:
                        table = ssh_table(node)
                        self._ssh.nodes[node.name] = SshNodeConfig.from_mapping(node.name, table)

    async def check_nodes(self, force: bool = False, background: bool = False) -> None:
        """Check remote nodes every ``node_retry_s`` (all nodes when ``force``); a node that
        fails is marked down and offers no devices until a later check succeeds.

        With ``background`` the due checks run as tasks and this returns at once: a dead node
        costs its check seconds of ssh timeouts, which must not stall a scheduling pass.  A
        check that changes a node's state wakes the scheduler (``on_change``)."""
        now = self.clock()
        due = [
            node
            for node in self.config.nodes
            if force
            or (
                not node.is_local
                and node.name not in self._checking
                and now - self.nodes[node.name].checked >= self.config.node_retry_s
            )
        ]
        if not background:
            await asyncio.gather(*(self._check(node) for node in due))
            return
        for node in due:
            task = asyncio.ensure_future(self._check(node))
            self._checking[node.name] = task
            task.add_done_callback(functools.partial(self._check_done, node.name))

    def _check_done(self, name: str, task: asyncio.Task[None]) -> None:
        self._checking.pop(name, None)

    async def _check(self, node: NodeConfig) -> None:
        try:
            health = await self.launcher_for(node).check_node(node.name)
        except PolluxError as exc:
            health = NodeHealth(node=node.name, reachable=False, error=str(exc))
        except Exception as exc:  # a broken check must not take the daemon down
            health = NodeHealth(node=node.name, reachable=False, error=repr(exc))
        self.nodes[node.name].load = health.load
        self._set_node_state(node.name, health.reachable, health.error or "")

    def _set_node_state(self, name: str, up: bool, error: str) -> None:
        """Record a node's state; on a change, log it and wake the scheduler.  A node going
        down is noted in the decision log of every job running on it."""
        if not self.nodes.mark(name, up, error, self.clock()):
            return
        log.warning("node %s is %s%s", name, "up" if up else "down", f": {error}" if error else "")
        if not up:
            now = self.clock()
            for job_id, group in self.groups.items():
                if any(slot.node == name for slot in group.spec.slots):
                    self._note_node_down(job_id, [name], now)
        self.on_change()

    def _note_node_down(self, job_id: int, names: list[str], now: float) -> None:
        """One ``node-down`` decision per job and lost node (the check and the job's exit may
        both notice the same loss)."""
        fresh = [name for name in names if (job_id, name) not in self._noted_down]
        if not fresh:
            return
        self._noted_down.update((job_id, name) for name in fresh)
        errors = "; ".join(
            error if name in error else f"{name}: {error}"
            for name in fresh
            for error in [self.nodes[name].error or "no answer"]
        )
        reason = f"node(s) {', '.join(fresh)} unreachable ({errors}); resuming from checkpoint"
        self.store.update_job(job_id, reason=reason)
        self.store.record_decision(job_id, now, "node-down", reason)

    # --- applying a plan ---------------------------------------------------------------------

    async def apply(self, plan: Plan) -> None:
        """Send the plan's stops (without waiting for them), then start on the new
        allocations: at once where the devices are free, else as soon as they are.  A job
        whose action fails is failed (or left running) with a one-line reason; the other
        actions go on."""
        now = self.clock()
        self._deferred = {}  # the newest plan decides what waits
        for action in plan.actions:
            if action.kind in ("stop", "resize"):
                await self._guarded(action.job_id, "stop", self._stop_for(action, now))
        claimed = [
            (action.job_id, device)
            for action in plan.actions
            if action.kind in ("start", "resize")
            for device in _devices(action.allocation)
        ]
        shared = {job_id for job_id, _ in claimed if self._is_shared(job_id)}
        for action in plan.actions:
            if action.kind == "resize" and action.job_id in self._resize:
                continue  # restarts at its new size once its old incarnation has ended
            if action.kind in ("start", "resize"):
                # shared jobs packed onto one device in this plan do not claim it from
                # each other
                sharing = action.job_id in shared
                others = {
                    device
                    for job_id, device in claimed
                    if job_id != action.job_id and not (sharing and job_id in shared)
                }
                await self._guarded(action.job_id, "start", self._start_when_free(action, others))

    async def _stop_for(self, action: Action, now: float) -> None:
        job_id = action.job_id
        group = self.groups.get(job_id)
        if action.kind == "resize":
            self.store.update_job(job_id, state=JobState.RESCALING)
            if group is not None:
                self._resize[job_id] = action
                self._begin_stop(job_id, group, StopIntent.RESIZE)
            return
        if group is not None:
            self._begin_stop(job_id, group, StopIntent.PREEMPT)
        self.store.update_job(job_id, state=JobState.QUEUED, reason=action.reason)
        self.store.record_decision(job_id, now, "stop", action.reason)

    async def _guarded(self, job_id: int, what: str, work: Awaitable[Any]) -> None:
        """Run one job's part of a plan; an error there fails that job (one line), unless it
        is running, and never stops the rest.  Database errors are the pass's to handle."""
        try:
            await work
        except (asyncio.CancelledError, sqlite3.Error):
            raise
        except Exception as exc:
            log.exception("job %s: %s failed", job_id, what)
            if job_id in self.groups or job_id in self.stopping:
                return  # its processes still run; their exit decides
            self._fail(job_id, f"could not {what}: {type(exc).__name__}: {one_line(exc)}")

    def _fail(self, job_id: int, reason: str) -> None:
        now = self.clock()
        log.error("job %s: %s", job_id, reason)
        self.store.update_job(
            job_id, state=JobState.FAILED, reason=reason, end_time=now, placement={}, pids=[]
        )
        self.store.record_decision(job_id, now, "failed", reason)

    # --- devices held by groups that are running or stopping ---------------------------------

    def _held(self) -> dict[Device, int]:
        """Devices of running and stopping groups, and those of waiting resizes -> job id."""
        held: dict[Device, int] = {}
        for groups in (self.groups, self.stopping):
            for job_id, group in groups.items():
                for slot in group.spec.slots:
                    held[(slot.node, slot.device)] = job_id
        for job_id, action in self._resize.items():
            for device in _devices(action.allocation):
                held.setdefault(device, job_id)
        return held

    def _is_shared(self, job_id: int) -> bool:
        job = self.store.get_job(job_id)
        return job is not None and job.spec.shared

    def _shared_only(self, held: dict[Device, int]) -> set[Device]:
        """The held devices whose every holder is a shared job (another shared job may
        join them)."""
        holders: dict[Device, set[int]] = {}
        for groups in (self.groups, self.stopping):
            for job_id, group in groups.items():
                for slot in group.spec.slots:
                    holders.setdefault((slot.node, slot.device), set()).add(job_id)
        for job_id, action in self._resize.items():
            for device in _devices(action.allocation):
                holders.setdefault(device, set()).add(job_id)
        return {
            device
            for device, ids in holders.items()
            if device in held and all(self._is_shared(job_id) for job_id in ids)
        }

    def still_stopping(self) -> dict[int, Allocation]:
        """job id -> the devices (node -> device ids) of each group asked to stop whose
        processes are not yet gone: they stay held until its exit comes."""
        holds: dict[int, Allocation] = {}
        for job_id, group in self.stopping.items():
            for slot in group.spec.slots:
                holds.setdefault(job_id, {}).setdefault(slot.node, []).append(slot.device)
        return holds

    def draining_devices(self) -> dict[str, set[str]]:
        """node -> devices still held by groups being stopped (free once their exit comes):
        for a pass that wants to plan around them."""
        draining: dict[str, set[str]] = {}
        for group in self.stopping.values():
            for slot in group.spec.slots:
                draining.setdefault(slot.node, set()).add(slot.device)
        return draining

    def _place(
        self, action: Action, held: dict[Device, int], claimed: set[Device]
    ) -> Action | None:
        """``action`` on devices nobody holds: a device a stopping group still holds is
        swapped for a free device of the same node that no other start claims; ``None``
        when there are not enough."""
        allocation: Allocation = {}
        changed = False
        for node_name, devices in action.allocation.items():
            keep = [d for d in devices if (node_name, d) not in held]
            missing = len(devices) - len(keep)
            if missing:
                node = self.config.node(node_name)
                spare = [
                    d
                    for d in node.devices
                    if (node_name, d) not in held
                    and (node_name, d) not in claimed
                    and d not in keep
                ]
                if node.is_local and any(d.startswith("cuda") for d in spare):
                    busy = busy_gpus(self.own_pids(), self.config.busy_memory)
                    spare = [d for d in spare if d not in busy]
                if len(spare) < missing:
                    return None
                keep += spare[:missing]
                changed = True
            allocation[node_name] = keep
        return dataclasses.replace(action, allocation=allocation) if changed else action

    def own_pids(self) -> set[int]:
        """The pids of every replica of a running or stopping group, and their children."""
        own: set[int] = set()
        for groups in (self.groups, self.stopping):
            for group in groups.values():
                for pid in group.pids().values():
                    own.add(pid)
                    with contextlib.suppress(psutil.Error):
                        own.update(c.pid for c in psutil.Process(pid).children(recursive=True))
        return own

    async def _start_when_free(self, action: Action, claimed: set[Device]) -> bool:
        """Start ``action`` if its job may start and its devices (or others of the same
        nodes) are free; else keep it waiting in ``_deferred``.  ``True`` when it was
        started or is void (the job is no longer waiting)."""
        async with self._starting:
            job = self.store.get_job(action.job_id)
            if (
                self._closing
                or job is None
                or job.state not in (JobState.QUEUED, JobState.RESCALING)
                or job.id in self.groups
            ):
                self._deferred.pop(action.job_id, None)
                return not self._closing
            if job.id in self.stopping:  # its previous incarnation has not ended yet
                self._deferred[job.id] = action
                return False
            held = self._held()
            if job.spec.shared:
                for device in self._shared_only(held):
                    del held[device]
            placed = self._place(action, held, claimed)
            if placed is None:
                self._deferred[job.id] = action
                holders = sorted({held[d] for d in _devices(action.allocation) if d in held})
                reason = (
                    "starting once job(s) "
                    + ", ".join(map(str, holders))
                    + " release their devices"
                )
                if job.reason != reason and job.state == JobState.QUEUED:
                    self.store.update_job(job.id, reason=reason)
                return False
            self._deferred.pop(job.id, None)
            await self.start_job(job, placed)
            return True

    async def _launch_waiting(self) -> None:
        """Start the waiting starts whose devices were released."""
        for job_id, action in list(self._deferred.items()):
            if self._deferred.get(job_id) is not action:
                continue
            claimed = {
                device
                for other, waiting in self._deferred.items()
                if other != job_id
                for device in _devices(waiting.allocation)
            }
            await self._guarded(job_id, "start", self._start_when_free(action, claimed))

    # --- starting ------------------------------------------------------------------------------

    def _job_dir(self, job: JobRecord) -> Path:
        return self.state_dir / "jobs" / job.job_id

    def build_spec(self, job: JobRecord, action: Action) -> LaunchSpec:
        """The launch spec of one incarnation (ranks in node order, env per the contract)."""
        allocation = action.allocation
        order = [n for n in self.config.nodes if allocation.get(n.name)]
        slots: list[ReplicaSlot] = []
        for node_rank, node in enumerate(order):
            for local_rank, device in enumerate(allocation[node.name]):
                slots.append(ReplicaSlot(len(slots), node.name, device, local_rank, node_rank))
        job_dir = self._job_dir(job)
        spec = job.spec
        if self.config.checkpoint_root:
            checkpoint_dir = str(Path(self.config.checkpoint_root) / job.job_id)
        else:
            checkpoint_dir = str(job_dir / "checkpoint")
        batch: BatchChoice | None = action.batch
        if not spec.elastic:
            batch = None  # a rigid job chooses its own batch: no POLLUX_LOCAL_BATCH for it
        on_cpu = all(slot.device.startswith("cpu") for slot in slots)
        launch = LaunchEnvironment(
            world_size=len(slots),
            master_addr="127.0.0.1",
            master_port=pick_master_port(),
            job_id=job.job_id,
            restarts=job.restarts,
            job_dir=str(job_dir),
            checkpoint_dir=checkpoint_dir,
            daemon_socket=str(self.socket_path),
            num_nodes=len(order),
            local_batch=batch.local_batch if batch is not None else None,
            accum_steps=batch.accum_steps if batch is not None else None,
            device="cpu" if on_cpu else "cuda",
            pg_timeout_s=self.config.pg_timeout_s,
            array_id=spec.array_id,
            array_index=spec.array_index,
            time_limit_s=spec.time_limit_s,
            device_type=order[0].device_type if order else None,
            device_slowdown=order[0].slowdown if order else None,
        )
        env = dict(job.env or {})
        # without a batch choice the job picks its own: none may leak from the submitter
        env.pop("POLLUX_LOCAL_BATCH", None)
        env.pop("POLLUX_ACCUM_STEPS", None)
        env.update(launch.common_environ())
        env.setdefault("PYTHONUNBUFFERED", "1")
        if on_cpu:
            busiest = max(len(devices) for devices in allocation.values())
            env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // busiest)))
        run_as = None
        run_as_uid = None
        if os.geteuid() == 0 and job.owner_uid != 0:
            run_as, run_as_uid = job.owner_name, job.owner_uid
        return LaunchSpec(
            job_id=job.job_id,
            argv=list(spec.argv),
            workdir=Path(spec.workdir),
            env=env,
            slots=slots,
            log_dir=job_dir,
            run_as=run_as,
            run_as_uid=run_as_uid,
        )

    async def _prepare_dirs(self, job: JobRecord, spec: LaunchSpec, local: bool) -> None:
        """Make the job's directory (the daemon's ``jobs/<id>``, given to the job's user) and,
        under a ``checkpoint_root`` of the daemon's, its checkpoint directory the same way.
        Nothing inside the job's directory: on this machine the job's supervisor makes the
        rest as the job's user; for remote nodes the checkpoint directory is made here by a
        ``mkdir`` run as the job's user."""
        jobs = self.state_dir / "jobs"
        with contextlib.suppress(FileExistsError):
            os.mkdir(jobs, 0o755)  # the server makes it; a bare state dir (tests) may lack it
        make_owned_dir(jobs, job.job_id, job.owner_uid, job.owner_gid)
        checkpoint = Path(spec.env["POLLUX_CHECKPOINT_DIR"])
        if self.config.checkpoint_root:
            try:
                make_owned_dir(
                    Path(self.config.checkpoint_root), job.job_id, job.owner_uid, job.owner_gid
                )
            except OSError as exc:  # not a directory of the daemon's: the job's user makes it
                log.debug("job %s: checkpoint dir left to the job's user: %s", job.id, exc)
        if not local:
            await make_user_dir(job, checkpoint)

    def _owner_gone(self, job: JobRecord) -> str | None:
        """Why the job cannot run as its owner (a deleted Unix user), or ``None``."""
        if job.owner_uid == os.geteuid():
            return None
        try:
            pwd.getpwuid(job.owner_uid)
        except KeyError:
            return f"owner uid {job.owner_uid} no longer exists"
        return None

    async def start_job(self, job: JobRecord, action: Action) -> None:
        now = self.clock()
        gone = self._owner_gone(job)
        if gone is not None:
            self._fail(job.id, gone)
            return
        nodes = [self.config.node(name) for name in action.allocation]
        launchers = {id(self.launcher_for(node)) for node in nodes}
        try:
            if len(launchers) != 1:
                raise PolluxError("a job cannot span this machine and remote nodes at once")
            launcher = self.launcher_for(nodes[0])
            spec = self.build_spec(job, action)
            await self._prepare_dirs(job, spec, local=launcher is self._local)
            group = await launcher.launch(spec)
        except (PolluxError, OSError) as exc:
            self._fail(job.id, f"could not start: {one_line(exc)}")
            return
        self.groups[job.id] = group
        # watched at once: should recording the start fail, its exit is still handled
        self.watchers[job.id] = asyncio.ensure_future(self._watch(job.id, group))
        self._noted_down = {key for key in self._noted_down if key[0] != job.id}
        self.last_launch[job.id] = now
        pids = []
        for rank, pid in group.pids().items():
            record: dict[str, Any] = {"rank": rank, "pid": pid, "node": spec.slots[rank].node}
            if self.config.node(spec.slots[rank].node).is_local:
                with contextlib.suppress(psutil.Error):
                    record["create_time"] = psutil.Process(pid).create_time()
            pids.append(record)
        batch = action.batch
        self.store.update_job(
            job.id,
            state=JobState.RUNNING,
            placement=action.allocation,
            batch=(
                {
                    "local_batch": batch.local_batch,
                    "accum_steps": batch.accum_steps,
                    "replicas": batch.replicas,
                    "total": batch.total_batch,
                }
                if batch
                else {"replicas": len(spec.slots)}
            ),
            pids=pids,
            last_start=now,
            start_time=job.start_time or now,
            restarts=job.restarts + 1,
            reason=action.reason,
            prediction=action.prediction,
        )
        self.store.record_decision(
            job.id,
            now,
            action.kind,
            action.reason,
            action.allocation,
            dict(
                (k, v)
                for k, v in (
                    ("local_batch", batch.local_batch if batch else None),
                    ("accum_steps", batch.accum_steps if batch else None),
                    ("replicas", len(spec.slots)),
                )
                if v is not None
            ),
        )

    # --- stopping ------------------------------------------------------------------------------

    async def stop_job(self, job_id: int, intent: StopIntent | str) -> None:
        """Ask a running job's replicas to stop (they checkpoint; SIGKILL after
        ``stop_grace_s``) and return at once: the exit is handled when it comes.  The caller
        sets the job's next state.  A job already stopping gets ``intent`` as what its stop
        is now for; a job waiting to start no longer waits."""
        intent = StopIntent(intent)
        self._resize.pop(job_id, None)
        self._deferred.pop(job_id, None)
        group = self.groups.get(job_id)
        if group is not None:
            self._begin_stop(job_id, group, intent)
        elif job_id in self.stopping:
            self.intent[job_id] = intent

    def _begin_stop(self, job_id: int, group: ReplicaGroup, intent: StopIntent) -> None:
        self.groups.pop(job_id, None)
        self.stopping[job_id] = group
        self.intent[job_id] = intent
        if job_id not in self._stop_tasks:
            self._stop_tasks[job_id] = asyncio.ensure_future(self._send_stop(job_id, group))

    async def _send_stop(self, job_id: int, group: ReplicaGroup) -> None:
        try:
            await group.stop(self.config.stop_grace_s)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("job %s: stopping its replicas failed", job_id)

    # --- exits ---------------------------------------------------------------------------------

    def _read_final_report(self, job: JobRecord) -> None:
        """Store the report a job wrote last (its final progress) once its replicas exited:
        ``report.json`` taken as every report is (``reports.read_job_report``: the job's
        owner's plain file, for a job that has not ended)."""
        try:
            report = read_job_report(self._job_dir(job), job)
        except InvalidReport as exc:
            log.warning("job %s: ignoring its final report: %s", job.id, exc)
            return
        if report is not None:
            self.store.update_job(job.id, report=report)

    def _account(self, job_id: int, now: float) -> None:
        job = self.store.get_job(job_id)
        if job is None or job.last_start is None:
            return
        elapsed = max(0.0, now - job.last_start)
        by_type = dict(job.device_seconds)
        for node, devices in job.placement.items():
            kind = self.config.device_type_of(node)
            by_type[kind] = by_type.get(kind, 0.0) + elapsed * len(devices)
        self.store.update_job(
            job_id,
            attained_gpu_s=job.attained_gpu_s + elapsed * job.replicas,
            device_seconds=by_type,
            run_time_s=job.run_time_s + elapsed,
            last_start=None,
            placement={},
            pids=[],
        )

    async def _watch(self, job_id: int, group: ReplicaGroup) -> None:
        remote = any(not self.config.node(slot.node).is_local for slot in group.spec.slots)
        waiting = asyncio.ensure_future(group.wait())
        try:
            while not waiting.done():
                await asyncio.wait({waiting}, timeout=LOST_NODE_POLL_S if remote else None)
                if remote:
                    # A lost node is marked down as soon as its ssh session ends, not only
                    # once the surviving replicas have been stopped.
                    self._mark_lost_nodes(group)
        finally:
            if not waiting.done():
                waiting.cancel()
        intent = self.intent.get(job_id)
        try:
            code = waiting.result()
            try:
                await self._ended(job_id, group, code)
            except sqlite3.Error as exc:  # kept, and recorded once the store takes writes
                self.unrecorded[job_id] = (group, code, intent)
                log.error("job %s: its end (exit %s) is not recorded yet: %s", job_id, code, exc)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("job %s: handling the end of its replicas failed", job_id)
        finally:
            if self.watchers.get(job_id) is asyncio.current_task():
                del self.watchers[job_id]
            self.on_change()

    async def record_unrecorded(self) -> None:
        """Record the group ends whose first record failed, each once (``sqlite3.Error`` when
        the store still refuses: they stay kept)."""
        for job_id, (group, code, intent) in list(self.unrecorded.items()):
            if intent is not None:
                self.intent[job_id] = intent
            await self._ended(job_id, group, code)
            del self.unrecorded[job_id]
            log.info("job %s: its end (exit %s) is recorded", job_id, code)

    async def _ended(self, job_id: int, group: ReplicaGroup, code: int) -> None:
        """A group ended: account for it, take its last report, and move the job on, by what
        its stop was for (``intent``) or, when nothing stopped it, by its exit code."""
        if self.groups.get(job_id) is group:
            del self.groups[job_id]
        if self.stopping.get(job_id) is group:
            del self.stopping[job_id]
        intent = self.intent.pop(job_id, None)
        self._stop_tasks.pop(job_id, None)
        now = self.clock()
        ended = getattr(group, "ended", None)
        self._account(job_id, min(now, ended) if isinstance(ended, float) else now)
        job = self.store.get_job(job_id)
        if job is not None:
            self._read_final_report(job)
            if intent is None and getattr(group, "orphaned", False) and code != ExitCode.OK:
                reason = (
                    "daemon restarted; its nodes stopped the job when the daemon went away;"
                    " resuming from checkpoint"
                )
                self.store.update_job(job.id, state=JobState.QUEUED, reason=reason)
                self.store.record_decision(job.id, now, "requeued", reason)
            elif intent is None:
                await self._on_exit(job, group, code, now)
            else:
                await self._on_stopped(job, intent, code, now)
        if isinstance(group, LocalReplicaGroup):
            self._local.forget(group.spec.job_id)  # its result is in the store now
        elif callable(forget := getattr(group, "forget", None)):
            task = asyncio.ensure_future(forget())  # the nodes' exit records, likewise
            self._forgetting.add(task)
            task.add_done_callback(self._forgetting.discard)
        await self._launch_waiting()

    def _finished(self, job_id: int, now: float) -> None:
        self.store.update_job(job_id, state=JobState.SUCCEEDED, end_time=now, reason="finished")
        self.store.record_decision(job_id, now, "finished", "all replicas exited 0")

    async def _on_stopped(self, job: JobRecord, intent: StopIntent, code: int, now: float) -> None:
        """The end of a group that was asked to stop.  Cancel, hold and the others set the
        job's state when they asked; a job that exited 0 while being preempted, resized or
        stopped for a shutdown has finished; a resized job restarts at its new size."""
        action = self._resize.pop(job.id, None) if intent is StopIntent.RESIZE else None
        if (
            intent in (StopIntent.PREEMPT, StopIntent.RESIZE, StopIntent.SHUTDOWN)
            and code == ExitCode.OK
        ):
            if job.state in (JobState.QUEUED, *PLACED_STATES):
                self._finished(job.id, now)
            return
        if intent is StopIntent.SHUTDOWN and job.state in PLACED_STATES:
            reason = "daemon stopped; will resume from checkpoint"
            self.store.update_job(job.id, state=JobState.QUEUED, reason=reason)
            self.store.record_decision(job.id, now, "requeued", reason)
            return
        if intent is not StopIntent.RESIZE or job.state != JobState.RESCALING:
            return
        if action is None or self._closing:
            reason = "checkpointed for a resize; back in the queue"
            self.store.update_job(job.id, state=JobState.QUEUED, reason=reason)
            self.store.record_decision(job.id, now, "requeued", reason)
            return
        claimed = {d for other in self._deferred.values() for d in _devices(other.allocation)}
        if not await self._start_when_free(action, claimed):
            current = self.store.get_job(job.id)
            if current is not None and current.state == JobState.RESCALING:
                reason = "resizing: waiting for its new devices to be released"
                self.store.update_job(job.id, state=JobState.QUEUED, reason=reason)

    async def _on_exit(self, job: JobRecord, group: ReplicaGroup, code: int, now: float) -> None:
        """The end of a group nobody asked to stop: 0 has finished; a lost node re-queues it;
        anything else is a crash, 75 included (a rescale is a stop the daemon asked for,
        :meth:`_on_stopped`: a job cannot have itself relaunched by exiting 75)."""
        if code == ExitCode.OK:
            self._finished(job.id, now)
            return
        cause: str | None = None
        if code == ExitCode.RESCALE:
            what = UNASKED_RESCALE
        else:
            down = await self._lost_nodes(group, code)
            if down:
                self._note_node_down(job.id, down, now)
                self.store.update_job(job.id, state=JobState.QUEUED)
                return
            detail = getattr(group, "supervisor_failure", None) or next(
                (
                    line
                    for slot in group.spec.slots
                    if (line := last_log_line(group.spec.log_dir, f"rank{slot.rank}.log",
                                              job.owner_uid))
                ),
                "",
            )  # fmt: skip
            what = f"replica exited with code {code}" + (f" ({detail})" if detail else "")
            on_cpu = all(slot.device.startswith("cpu") for slot in group.spec.slots)
            cause = permanent_cause(detail, on_cpu)
        self._crashed(job, what, cause, now)

    def _crashed(self, job: JobRecord, what: str, cause: str | None, now: float) -> None:
        """One crash of ``job`` (``what`` happened): failed at once when ``cause`` says a
        retry cannot help or its ``max_retries`` are spent, else queued again after an
        exponential back-off, ``backoff_s * 2^(failures - 1)``."""
        failures = job.failures + 1
        if cause is not None:
            reason = f"{what}: {cause}; not retried"
            self.store.update_job(
                job.id, state=JobState.FAILED, failures=failures, end_time=now, reason=reason
            )
            self.store.record_decision(job.id, now, "failed", reason)
            return
        if failures > self.config.max_retries:
            reason = f"{what}; gave up after {failures - 1} restart(s)"
            self.store.update_job(
                job.id, state=JobState.FAILED, failures=failures, end_time=now, reason=reason
            )
            self.store.record_decision(job.id, now, "failed", reason)
            return
        delay = self.config.backoff_s * 2 ** (failures - 1)
        reason = f"{what}; retry {failures}/{self.config.max_retries} in {delay:g} s"
        self.store.update_job(
            job.id, state=JobState.QUEUED, failures=failures, retry_after=now + delay, reason=reason
        )
        self.store.record_decision(job.id, now, "crashed", reason)

    async def _lost_nodes(self, group: ReplicaGroup, code: int) -> list[str]:
        """The remote nodes a failed group lost.  A rank whose ssh session ended with 255
        lost its node's connection (keepalive or connect failure): that node is marked down
        at once and re-checked every ``node_retry_s``.  When the group's code is 255 without
        per-rank codes, the nodes are checked now.  Other failures (a rank timing out in a
        collective with a lost peer, say) count as node losses only when some node is down."""
        slots = group.spec.slots
        remote = [
            n for n in dict.fromkeys(self.config.node(s.node) for s in slots) if not n.is_local
        ]
        if not remote:
            return []
        lost = self._mark_lost_nodes(group)
        if code == ExitCode.NODE_LOST and not lost:
            await asyncio.gather(*(self._check(node) for node in remote))
        return [n.name for n in remote if not self.nodes.is_up(n.name)]

    def _mark_lost_nodes(self, group: ReplicaGroup) -> set[str]:
        """Mark down the nodes whose ranks in ``group`` ended with 255 (ssh lost the node);
        returns those nodes."""
        exit_codes = getattr(group, "exit_codes", None)
        codes: dict[int, int] = dict(exit_codes()) if callable(exit_codes) else {}
        lost = {s.node for s in group.spec.slots if codes.get(s.rank) == ExitCode.NODE_LOST}
        lost = {name for name in lost if not self.config.node(name).is_local}
        failure = getattr(group, "failure_reason", None) or "ssh connection lost"
        for name in lost:
            if self.nodes.is_up(name):
                self._set_node_state(name, False, str(failure))
        return lost

    # --- cancel / hold ----------------------------------------------------------------------

    async def cancel(self, job_id: int) -> None:
        """Cancel a job: recorded at once, its replicas stopped in the background."""
        now = self.clock()
        self.store.update_job(job_id, state=JobState.CANCELLED, end_time=now, reason="cancelled")
        self.store.record_decision(job_id, now, "cancelled", "cancelled by request")
        await self.stop_job(job_id, StopIntent.CANCEL)

    async def end_at_time_limit(self, job_id: int, reason: str) -> None:
        """A job reached its time limit: recorded as failed with ``reason`` at once, its
        replicas stopped in the background (SIGTERM, a checkpoint for an elastic job; SIGKILL
        after ``stop_grace_s``)."""
        now = self.clock()
        self.store.update_job(job_id, state=JobState.FAILED, end_time=now, reason=reason)
        self.store.record_decision(job_id, now, "failed", reason)
        await self.stop_job(job_id, StopIntent.TIME_LIMIT)

    async def hold(self, job_id: int) -> None:
        """Hold a job: recorded at once, its replicas stopped (checkpoint) in the background."""
        now = self.clock()
        self.store.update_job(job_id, state=JobState.HELD, reason="held")
        self.store.record_decision(job_id, now, "held", "held by request")
        await self.stop_job(job_id, StopIntent.HOLD)

    # --- daemon start and stop ----------------------------------------------------------------

    async def recover(self) -> list[int]:
        """After a daemon restart, for every job recorded as running: adopt its supervisor if
        it still runs (the job keeps running); apply its recorded exit code if it ended
        meanwhile; queue it again (to resume from its checkpoint) only when nothing is
        recorded.  Supervisors of jobs recorded as not running (a stop in flight when the
        daemon died) are adopted as stopping.  Returns the jobs queued again."""
        now = self.clock()
        records = self._local.records()
        requeued: list[int] = []
        for job in self.store.jobs([JobState.RUNNING, JobState.RESCALING]):
            record = records.pop(job.job_id, None)
            try:
                if await self._recover_job(job, record, now):
                    continue
            except sqlite3.Error:
                raise
            except Exception:
                log.exception("job %s: recovering it failed; queueing it again", job.id)
            self._requeue_recovered(job, now)
            requeued.append(job.id)
        for job_id, record in records.items():
            try:
                self._recover_stray(job_id, record, now)
            except sqlite3.Error:
                raise
            except Exception:
                log.exception("job %s: recovering its supervisor failed", job_id)
        return requeued

    async def _recover_job(self, job: JobRecord, record: RunRecord | None, now: float) -> bool:
        """Adopt the job's incarnation from its run file (on SSH nodes: from the exit
        records there); ``False`` when there is nothing to adopt (the caller queues the job
        again)."""
        remote = await self._recover_remote(job, now)
        if remote is not None:
            return remote
        if record is None:
            # a daemon from before the supervisors ran the replicas as its own children
            await self._stop_orphans(job)
            return False
        group = self._local.adopt(record)
        if group is None:
            log.warning(
                "job %s: its supervisor (pid %s) ended without a result",
                job.id, record.supervisor_pid,
            )  # fmt: skip
            self._local.forget(job.job_id)
            return False
        if record.finished:
            reason = f"daemon restarted; the job ended meanwhile with code {record.exit_code}"
        else:
            reason = (
                f"daemon restarted; the job kept running under its supervisor (pid"
                f" {record.supervisor_pid})"
            )
        log.info("job %s: %s", job.id, reason)
        self.store.record_decision(job.id, now, "recovered", reason)
        if job.state == JobState.RESCALING:
            self._adopt_stopping(job.id, group, StopIntent.RESIZE)
        else:
            self.groups[job.id] = group
        self.last_launch[job.id] = job.last_start or now
        self.watchers[job.id] = asyncio.ensure_future(self._watch(job.id, group))
        return True

    async def _recover_remote(self, job: JobRecord, now: float) -> bool | None:
        """A job placed on SSH nodes: its incarnation from the exit records its nodes keep
        (``SshLauncher.recover``), adopted like a local supervisor: a recorded exit is applied
        as if the daemon had seen it, replicas still running are waited for (their node
        stops them once the daemon is gone).  ``None`` for a job not on SSH nodes; ``False``
        when nothing is recorded there."""
        try:
            nodes = [self.config.node(name) for name in job.placement if job.placement[name]]
        except KeyError:
            return False
        if not nodes or any(node.is_local for node in nodes):
            return None
        launcher = self.launcher_for(nodes[0])
        recover = getattr(launcher, "recover", None)
        if recover is None:
            return False
        from pollux_local.launch.ssh import record_token

        spec = self.build_spec(job, Action("start", job.id, job.placement, None, ""))
        group = await recover(spec, record_token(job.job_id, max(0, job.restarts - 1)))
        if group is None:
            log.warning("job %s: no exit record of it on its nodes", job.id)
            return False
        code = group.poll()
        if code is not None:
            reason = (
                f"daemon restarted; the job ended meanwhile with code {code} (its nodes' record)"
            )
        else:
            reason = "daemon restarted; its replicas still run on its nodes: waiting for their end"
        log.info("job %s: %s", job.id, reason)
        self.store.record_decision(job.id, now, "recovered", reason)
        if job.state == JobState.RESCALING:
            self._adopt_stopping(job.id, group, StopIntent.RESIZE)
        else:
            self.groups[job.id] = group
        self.last_launch[job.id] = job.last_start or now
        self.watchers[job.id] = asyncio.ensure_future(self._watch(job.id, group))
        return True

    def _adopt_stopping(self, job_id: int, group: ReplicaGroup, intent: StopIntent) -> None:
        """A group whose stop was asked for before the daemon restarted: asked again (a
        supervisor takes a second SIGTERM as the first), its exit handled as ``intent``."""
        self.stopping[job_id] = group
        self.intent[job_id] = intent
        if group.poll() is None:
            self._stop_tasks[job_id] = asyncio.ensure_future(self._send_stop(job_id, group))

    def _recover_stray(self, name: str, record: RunRecord, now: float) -> None:
        """A run file of a job not recorded as running: a stop that was under way when the
        daemon died (adopted as stopping, its exit handled by the job's recorded state), or a
        result not yet taken in (a preempted job that exited 0 has finished)."""
        if not name.isdigit():
            return
        job = self.store.get_job(int(name))
        if record.finished or not record.supervisor_alive():
            if not record.finished:
                record.kill_replicas()
            elif job is not None and job.state == JobState.QUEUED and record.exit_code == 0:
                self._finished(job.id, now)
            self._local.forget(name)
            return
        group = self._local.adopt(record)
        if group is None:
            self._local.forget(name)
            return
        state = JobState(job.state) if job is not None else None
        intent = (
            StopIntent.RECONCILE
            if state is None
            else RECOVERED_INTENT.get(state, StopIntent.RECONCILE)
        )
        log.info("job %s: its replicas are still stopping (%s); waiting for them", name, intent)
        self._adopt_stopping(int(name), group, intent)
        self.watchers[int(name)] = asyncio.ensure_future(self._watch(int(name), group))

    def _requeue_recovered(self, job: JobRecord, now: float) -> None:
        if job.last_start is not None:
            elapsed = max(0.0, now - job.last_start)
            self.store.update_job(
                job.id,
                attained_gpu_s=job.attained_gpu_s + elapsed * job.replicas,
                run_time_s=job.run_time_s + elapsed,
            )
        reason = "daemon restarted; resuming from checkpoint"
        self.store.update_job(
            job.id, state=JobState.QUEUED, placement={}, pids=[], last_start=None, reason=reason
        )
        self.store.record_decision(job.id, now, "recovered", reason)

    async def _stop_orphans(self, job: JobRecord) -> None:
        procs: list[psutil.Process] = []
        for record in job.pids:
            try:
                node = self.config.node(str(record.get("node")))
            except KeyError:
                continue
            if not node.is_local:
                continue  # remote replicas stop themselves when their ssh session dies
            try:
                proc = psutil.Process(int(record["pid"]))
                created = record.get("create_time")
                if created is None or abs(proc.create_time() - float(created)) > 1.0:
                    continue  # the pid was reused: not ours
                procs.append(proc)
            except (psutil.Error, KeyError, ValueError):
                continue
        if not procs:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(procs[0].pid, signal.SIGTERM)
        for proc in procs:
            with contextlib.suppress(psutil.Error):
                proc.terminate()
        deadline = time.monotonic() + self.config.stop_grace_s
        while time.monotonic() < deadline and any(_alive(p) for p in procs):
            await asyncio.sleep(0.1)
        for proc in procs:
            if _alive(proc):
                with contextlib.suppress(psutil.Error):
                    proc.kill()
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(procs[0].pid, signal.SIGKILL)

    async def shutdown(self) -> None:
        """Daemon stopping: checkpoint-stop every running job and queue it again; wait (up to
        ``stop_grace_s`` and a margin) for those stops and the ones already under way.  What
        has not ended by then is left to its supervisor and adopted at the next start."""
        self._closing = True
        for task in list(self._checking.values()):
            task.cancel()
        self._deferred.clear()
        for job_id, group in list(self.groups.items()):
            self._begin_stop(job_id, group, StopIntent.SHUTDOWN)
        watchers = list(self.watchers.values())
        if watchers:
            await asyncio.wait(watchers, timeout=self.config.stop_grace_s + SHUTDOWN_MARGIN_S)
        left = sorted(self.stopping)
        if left:
            log.warning("job(s) %s still stopping at shutdown; left to their supervisors", left)


def _devices(allocation: Allocation) -> Iterable[Device]:
    for node, devices in allocation.items():
        for device in devices:
            yield (node, device)


async def make_user_dir(job: JobRecord, path: Path) -> None:
    """``mkdir -p PATH`` as the job's user (as the daemon's own user when that is the job's,
    or when the daemon is not root)."""
    if os.geteuid() != 0 or job.owner_uid in (0, os.geteuid()):
        path.mkdir(parents=True, exist_ok=True)
        return
    entry = pwd.getpwuid(job.owner_uid)
    proc = await asyncio.create_subprocess_exec(
        "mkdir", "-p", "--", str(path),
        user=entry.pw_uid, group=entry.pw_gid,
        extra_groups=os.getgrouplist(entry.pw_name, entry.pw_gid),
        stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE, cwd="/", env={"PATH": "/usr/bin:/bin", "LANG": "C"},
    )  # fmt: skip
    try:
        _, err = await asyncio.wait_for(proc.communicate(), 30)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        raise PolluxError(f"mkdir {path} as {entry.pw_name} did not finish in 30 s") from None
    if proc.returncode != 0:
        raise PolluxError(
            f"cannot create checkpoint dir {path} as {entry.pw_name}: {one_line(err.decode())}"
        )


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def make_ssh_launcher(config: DaemonConfig, state_dir: Path) -> Launcher:
    """The SSH launcher for the config's remote nodes (imported only when one is used)."""
    try:
        from pollux_local.launch.ssh import SshLauncher, SshNodeConfig
    except ImportError:
        raise PolluxError("remote nodes need the SSH launcher (pollux_local.launch.ssh)") from None
    nodes = [
        SshNodeConfig.from_mapping(node.name, ssh_table(node))
        for node in config.nodes
        if not node.is_local
    ]
    return SshLauncher(
        nodes,
        ssh_control_dir(state_dir),
        max_log_bytes=config.max_log_bytes,
        log_keep_free=config.log_keep_free,
    )


def ssh_control_dir(state_dir: Path) -> Path:
    """Where ssh keeps its shared connections: ``STATE_DIR/ssh``, or, when that path is too
    long for a Unix socket, a private directory under /tmp named after the state dir."""
    preferred = state_dir / "ssh"
    if len(str(preferred)) + 42 <= 104:
        return preferred
    digest = hashlib.sha1(str(state_dir).encode()).hexdigest()[:12]
    short = Path(tempfile.gettempdir()) / f"pollux-ssh-{os.geteuid()}-{digest}"
    short.mkdir(mode=0o700, exist_ok=True)
    info = short.lstat()
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid() or info.st_mode & 0o077:
        raise PolluxError(f"{short} is not a private directory of the daemon's user")
    return short


def ssh_table(node: NodeConfig) -> dict[str, Any]:
    """The node's config table as the SSH launcher reads it."""
    table = dict(node.raw)
    table.pop("name", None)
    table["host"] = node.host
    table["devices"] = list(node.devices)
    table.pop("device_type", None)
    return table


def allocation_nodes(allocation: Allocation) -> list[str]:
    return [name for name, devices in allocation.items() if devices]
