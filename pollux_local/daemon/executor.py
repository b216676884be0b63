"""Applying plans: launch, resize (checkpoint-restart), stop, and react to replicas exiting.

The executor owns the running replica groups.  A group that exits on its own is classified
(``api.states.ExitCode``): 0 -> succeeded; 75 -> back to the queue (it checkpointed); 255 from
a remote node -> the node is marked down and the job re-queued to resume elsewhere; anything
else -> a crash, retried from the checkpoint with exponential back-off until ``max_retries``,
then ``failed``.  What is known of each node's health is kept in one :class:`NodeStatus` per
node (:class:`NodeHealthBook`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import logging
import os
import signal
import stat
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from pollux_local.api.launch import LaunchEnvironment
from pollux_local.api.states import ExitCode, JobState
from pollux_local.core.types import BatchChoice
from pollux_local.daemon.config import DaemonConfig, NodeConfig
from pollux_local.daemon.reports import InvalidReport, read_report_file
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
from pollux_local.launch.local import LocalLauncher

log = logging.getLogger("pollux_local.daemon")

#: How often a group with remote replicas is looked at for ranks whose node was lost.
LOST_NODE_POLL_S = 0.5


def last_log_line(path: Path, limit: int = 4096) -> str:
    """The last non-empty line of a log file (for a failure's reason)."""
    try:
        with open(path, "rb") as handle:
            handle.seek(0, os.SEEK_END)
            size = handle.tell()
            handle.seek(max(0, size - limit))
            lines = handle.read().decode(errors="replace").splitlines()
    except OSError:
        return ""
    for line in reversed(lines):
        if line.strip() and not line.startswith("--- "):
            return line.strip()[:200]
    return ""


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
    """Starts and stops jobs' replica groups and keeps the store in step with them."""

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
        self.watchers: dict[int, asyncio.Task[None]] = {}
        self.intent: dict[int, str] = {}
        self.nodes = NodeHealthBook([node.name for node in config.nodes])
        self.last_launch: dict[int, float] = {}
        self._local = LocalLauncher({n.name: n.devices for n in config.nodes if n.is_local})
        self._ssh: Launcher | None = None
        self._checking: dict[str, asyncio.Task[None]] = {}
        self._noted_down: set[tuple[int, str]] = set()

    # --- launchers and nodes ----------------------------------------------------------------

    def launcher_for(self, node: NodeConfig) -> Launcher:
        if node.is_local:
            return self._local
        if self._ssh is None:
            self._ssh = make_ssh_launcher(self.config, self.state_dir)
        return self._ssh

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
        """Stop what must stop (in parallel), then start on the new allocations."""
        now = self.clock()
        stopping = [a for a in plan.actions if a.kind in ("stop", "resize")]
        for action in stopping:
            if action.kind == "resize":
                self.store.update_job(action.job_id, state=JobState.RESCALING)
        codes = await asyncio.gather(*(self.stop_job(a.job_id, "preempt") for a in stopping))
        for action, code in zip(stopping, codes, strict=True):
            if code == ExitCode.OK:  # it finished just as it was asked to stop
                self.store.update_job(
                    action.job_id,
                    state=JobState.SUCCEEDED,
                    end_time=self.clock(),
                    reason="finished",
                )
                self.store.record_decision(action.job_id, now, "finished", "all replicas exited 0")
            elif action.kind == "stop":
                self.store.update_job(action.job_id, state=JobState.QUEUED, reason=action.reason)
                self.store.record_decision(action.job_id, now, "stop", action.reason)
        for action in plan.actions:
            if action.kind in ("start", "resize"):
                job = self.store.get_job(action.job_id)
                if job is not None and job.state in (JobState.QUEUED, JobState.RESCALING):
                    await self.start_job(job, action)

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
        if not spec.get("elastic", True):
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
        if os.geteuid() == 0 and job.owner_uid != 0:
            run_as = job.owner_name
        return LaunchSpec(
            job_id=job.job_id,
            argv=list(spec["argv"]),
            workdir=Path(spec["workdir"]),
            env=env,
            slots=slots,
            log_dir=job_dir,
            run_as=run_as,
        )

    def _prepare_dirs(self, job: JobRecord, spec: LaunchSpec) -> None:
        job_dir = self._job_dir(job)
        checkpoint_dir = Path(spec.env["POLLUX_CHECKPOINT_DIR"])
        for path in (job_dir, checkpoint_dir):
            path.mkdir(parents=True, exist_ok=True)
            if os.geteuid() == 0 and job.owner_uid != 0:
                with contextlib.suppress(OSError):
                    os.chown(path, job.owner_uid, job.owner_gid)

    async def start_job(self, job: JobRecord, action: Action) -> None:
        now = self.clock()
        nodes = [self.config.node(name) for name in action.allocation]
        launchers = {id(self.launcher_for(node)) for node in nodes}
        try:
            if len(launchers) != 1:
                raise PolluxError("a job cannot span this machine and remote nodes at once")
            launcher = self.launcher_for(nodes[0])
            spec = self.build_spec(job, action)
            self._prepare_dirs(job, spec)
            group = await launcher.launch(spec)
        except (PolluxError, OSError) as exc:
            reason = f"could not start: {exc}"
            log.error("job %s: %s", job.id, reason)
            self.store.update_job(
                job.id, state=JobState.FAILED, reason=reason, end_time=now, placement={}
            )
            self.store.record_decision(job.id, now, "failed", reason)
            return
        self.groups[job.id] = group
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
        self.watchers[job.id] = asyncio.ensure_future(self._watch(job.id, group))

    def _read_final_report(self, job_id: int) -> None:
        """Store the report a job wrote last (its final progress) once its replicas exited."""
        path = self.state_dir / "jobs" / str(job_id) / "report.json"
        try:
            report = read_report_file(path)
        except InvalidReport as exc:
            log.warning("job %s: ignoring its final report %s: %s", job_id, path, exc)
            return
        if report is not None:
            self.store.update_job(job_id, report=report)

    def _account(self, job_id: int, now: float) -> None:
        job = self.store.get_job(job_id)
        if job is None or job.last_start is None:
            return
        elapsed = max(0.0, now - job.last_start)
        self.store.update_job(
            job_id,
            attained_gpu_s=job.attained_gpu_s + elapsed * job.replicas,
            run_time_s=job.run_time_s + elapsed,
            last_start=None,
            placement={},
            pids=[],
        )

    async def stop_job(self, job_id: int, intent: str) -> int | None:
        """Checkpoint-stop a running job (SIGTERM, bounded wait, SIGKILL); ``None`` if it was
        not running.  The caller sets the job's next state."""
        group = self.groups.get(job_id)
        if group is None:
            return None
        self.intent[job_id] = intent
        try:
            code = await group.stop(self.config.stop_grace_s)
        finally:
            watcher = self.watchers.pop(job_id, None)
            if watcher is not None:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await watcher
            self.groups.pop(job_id, None)
            self.intent.pop(job_id, None)
            self._account(job_id, self.clock())
            self._read_final_report(job_id)
        return code

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
        code = waiting.result()
        if job_id in self.intent:
            return  # stop_job handles it
        self.groups.pop(job_id, None)
        self.watchers.pop(job_id, None)
        now = self.clock()
        job = self.store.get_job(job_id)
        self._account(job_id, now)
        self._read_final_report(job_id)
        if job is None:
            return
        try:
            await self._on_exit(job, group, code, now)
        finally:
            self.on_change()

    async def _on_exit(self, job: JobRecord, group: ReplicaGroup, code: int, now: float) -> None:
        if code == ExitCode.OK:
            self.store.update_job(job.id, state=JobState.SUCCEEDED, end_time=now, reason="finished")
            self.store.record_decision(job.id, now, "finished", "all replicas exited 0")
            return
        if code == ExitCode.RESCALE:
            reason = f"checkpointed and exited ({ExitCode.RESCALE:d}); back in the queue"
            self.store.update_job(job.id, state=JobState.QUEUED, reason=reason)
            self.store.record_decision(job.id, now, "requeued", reason)
            return
        down = await self._lost_nodes(group, code)
        if down:
            self._note_node_down(job.id, down, now)
            self.store.update_job(job.id, state=JobState.QUEUED)
            return
        failures = job.failures + 1
        detail = next(
            (
                line
                for slot in group.spec.slots
                if (line := last_log_line(group.spec.log_dir / f"rank{slot.rank}.log"))
            ),
            "",
        )
        what = f"replica exited with code {code}" + (f" ({detail})" if detail else "")
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
        failure = getattr(group, "failure_reason", None) or "ssh connection lost"
        for name in lost:
            if self.nodes.is_up(name):
                self._set_node_state(name, False, str(failure))
        return lost

    # --- cancel / hold ----------------------------------------------------------------------

    async def cancel(self, job_id: int) -> None:
        now = self.clock()
        await self.stop_job(job_id, "cancel")
        self.store.update_job(job_id, state=JobState.CANCELLED, end_time=now, reason="cancelled")
        self.store.record_decision(job_id, now, "cancelled", "cancelled by request")

    async def hold(self, job_id: int) -> None:
        now = self.clock()
        await self.stop_job(job_id, "hold")
        self.store.update_job(job_id, state=JobState.HELD, reason="held")
        self.store.record_decision(job_id, now, "held", "held by request")

    # --- daemon start and stop ----------------------------------------------------------------

    async def recover(self) -> list[int]:
        """After a daemon restart: stop what is left of jobs that were running (SIGTERM, so
        they checkpoint) and put them back in the queue to resume from their checkpoints."""
        now = self.clock()
        jobs = self.store.jobs([JobState.RUNNING, JobState.RESCALING])
        await asyncio.gather(*(self._stop_orphans(job) for job in jobs))
        for job in jobs:
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
        return [job.id for job in jobs]

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
        """Daemon stopping: checkpoint-stop every running job and re-queue it."""
        for task in list(self._checking.values()):
            task.cancel()
        job_ids = list(self.groups)
        await asyncio.gather(*(self.stop_job(job_id, "shutdown") for job_id in job_ids))
        now = self.clock()
        for job_id in job_ids:
            reason = "daemon stopped; will resume from checkpoint"
            self.store.update_job(job_id, state=JobState.QUEUED, reason=reason)
            self.store.record_decision(job_id, now, "requeued", reason)


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
    return SshLauncher(nodes, ssh_control_dir(state_dir))


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
