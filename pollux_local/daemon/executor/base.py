"""The executor's state and what every part of it uses: launchers, the job directory, a
failed job."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import psutil

from pollux_local.api.states import DecisionKind, JobState, StopIntent
from pollux_local.daemon.config import DaemonConfig, NodeConfig
from pollux_local.daemon.executor.health import NodeHealthBook
from pollux_local.daemon.executor.launchspec import (
    build_launch_spec,
    make_ssh_launcher,
    ssh_nodes,
)
from pollux_local.daemon.scheduler import Action, Allocation
from pollux_local.daemon.state import DecisionEntry, JobRecord, StateStore
from pollux_local.daemon.statedir import own_directory
from pollux_local.launch.base import (
    Launcher,
    LaunchSpec,
    ReplicaGroup,
    ReplicaSlot,
)
from pollux_local.launch.local import LocalLauncher

log = logging.getLogger("pollux_local.daemon")

Device = tuple[str, str]  # (node name, device id)


def slurm_job_id() -> str:
    """The Slurm job (allocation) the daemon runs in."""
    return os.environ.get("SLURM_JOB_ID", "")


def allocation_devices(allocation: Allocation) -> Iterable[Device]:
    for node, devices in allocation.items():
        for device in devices:
            yield (node, device)


class ExecutorBase:
    """The executor's state, shared by its parts (:mod:`.accounting`, :mod:`.exits`,
    :mod:`.applying`, :mod:`.recovery`).

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
        #: the exit of a group that ended, as the job's columns, until its end is stored
        self._exits: dict[int, dict[str, Any]] = {}
        self.nodes = NodeHealthBook([node.name for node in config.nodes])
        self.run_dir = state_dir / "run"
        self._local = LocalLauncher(
            {n.name: n.devices for n in config.nodes if n.is_local},
            run_dir=self.run_dir,
            stop_grace_s=config.stop_grace_s,
            max_log_bytes=config.max_log_bytes,
            log_keep_free=config.log_keep_free,
        )
        self._ssh: Launcher | None = None
        self._slurm: Launcher | None = None
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
        #: warm resizes under way (``executor/warm.py``), and how many each job had
        self._warming: dict[int, asyncio.Task[None]] = {}
        self._warm_count: dict[int, int] = {}

    # --- launchers and nodes ----------------------------------------------------------------

    def known_node(self, name: str) -> NodeConfig | None:
        """Node ``name`` of the config (``None``: the config no longer has it)."""
        try:
            return self.config.node(name)
        except KeyError:
            return None

    def is_remote(self, name: str) -> bool:
        """Whether node ``name`` is one of the config's remote nodes (a node the config no
        longer has is not: only a local run file is adopted on one)."""
        node = self.known_node(name)
        return node is not None and not node.is_local

    def pid_records(
        self, slots: Iterable[ReplicaSlot], pids: Mapping[int, int]
    ) -> list[dict[str, Any]]:
        """A running incarnation's ``pids`` as the store keeps them: ``{"rank", "pid",
        "node"}`` per replica, and ``"create_time"`` for one on this machine (what tells the
        process from a later one given its pid)."""
        nodes = {slot.rank: slot.node for slot in slots}
        records = []
        for rank, pid in pids.items():
            record: dict[str, Any] = {"rank": rank, "pid": pid, "node": nodes[rank]}
            node = self.known_node(nodes[rank])
            if node is not None and node.is_local:
                with contextlib.suppress(psutil.Error):
                    record["create_time"] = psutil.Process(pid).create_time()
            records.append(record)
        return records

    def launcher_for(self, node: NodeConfig) -> Launcher:
        if node.slurm is not None:
            return self._slurm_launcher()
        if node.is_local:
            return self._local
        if self._ssh is None:
            self._ssh = make_ssh_launcher(self.config, self.state_dir)
        return self._ssh

    def _slurm_launcher(self) -> Launcher:
        """The launcher of the Slurm allocation's nodes (made on first use)."""
        if self._slurm is None:
            from pollux_local.launch.slurm import Allocation, SlurmLauncher

            nodes = tuple(n.slurm for n in self.config.nodes if n.slurm is not None)
            self.run_dir.mkdir(mode=0o700, exist_ok=True)
            records = self.run_dir / "slurm"  # the keepers' records, beside the run files
            records.mkdir(mode=0o700, exist_ok=True)
            self._slurm = SlurmLauncher(Allocation(slurm_job_id(), nodes), records)
        return self._slurm

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
            from pollux_local.launch.ssh import SshLauncher

            if isinstance(self._ssh, SshLauncher):
                self._ssh.max_log_bytes = config.max_log_bytes
                self._ssh.log_keep_free = config.log_keep_free
                for node in ssh_nodes(config):
                    self._ssh.nodes[node.name] = node

    async def close_shared_connections(self) -> None:
        """Close the SSH launcher's shared connections and remove their directory (at
        shutdown, once no job runs through them: closing a connection ends its sessions)."""
        if self._ssh is None:
            return
        from pollux_local.launch.ssh import SshLauncher

        if isinstance(self._ssh, SshLauncher):
            await self._ssh.close()

    def _job_dir(self, job: JobRecord) -> Path:
        return self.state_dir / "jobs" / job.job_id

    def build_spec(self, job: JobRecord, action: Action) -> LaunchSpec:
        """The launch spec of one incarnation (ranks in node order, env per the contract).
        With ``[scheduler] warm_resize`` on, an elastic job on one node of this machine, or
        on SSH nodes (one or several), is started to take warm resize orders
        (``executor/warm.py``): here at a file of the daemon's, there at one its node agent
        makes.  A Slurm step, or a job on this machine's and other nodes, is resized by a
        restart."""
        spec = build_launch_spec(
            job, action, self.config, self._job_dir(job), self.socket_path, self.state_dir
        )
        nodes = [self.config.node(name) for name in dict.fromkeys(s.node for s in spec.slots)]
        env = {k: v for k, v in spec.env.items() if k != "POLLUX_RESIZE_FILE"}  # never the job's
        if not (self.config.warm_resize and job.spec.elastic and nodes):
            return dataclasses.replace(spec, env=env)
        if all(node.ssh is not None and node.slurm is None for node in nodes):
            return dataclasses.replace(spec, env=env, takes_orders=True)
        if len(nodes) != 1 or not nodes[0].is_local:
            return dataclasses.replace(spec, env=env)
        order_file = self.order_dir() / f"{job.job_id}-{job.restarts}.json"
        with contextlib.suppress(FileNotFoundError):
            order_file.unlink()  # never an order of an earlier incarnation
        env["POLLUX_RESIZE_FILE"] = str(order_file)
        return dataclasses.replace(spec, env=env, resize_file=order_file, takes_orders=True)

    def order_dir(self) -> Path:
        """``STATE_DIR/resize``: the warm resize orders, readable by the jobs (0755; each
        order 0644, named after its job and incarnation)."""
        path = self.state_dir / "resize"
        own_directory(path, "warm resize order directory", 0o755)
        return path

    def _fail(self, job_id: int, reason: str) -> None:
        now = self.clock()
        log.error("job %s: %s", job_id, reason)
        self.store.transition(
            job_id, JobState.FAILED, now, DecisionEntry(DecisionKind.FAILED, reason),
            reason=reason, end_time=now, placement={}, pids=[],
        )  # fmt: skip

    # --- provided by the parts above this one ------------------------------------------------

    async def _start_when_free(self, action: Action, claimed: set[Device]) -> bool:
        """Start ``action`` once its devices are free (:mod:`.applying`)."""
        raise NotImplementedError

    async def _launch_waiting(self) -> None:
        """Start the waiting starts whose devices were released (:mod:`.applying`)."""
        raise NotImplementedError

    def _begin_stop(self, job_id: int, group: ReplicaGroup, intent: StopIntent) -> None:
        """Move a running group to ``stopping`` and send its stop (:mod:`.applying`)."""
        raise NotImplementedError
