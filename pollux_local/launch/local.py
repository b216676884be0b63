"""Run a job's replicas as processes of this machine, each incarnation under its own
supervisor (``launch/supervisor.py``).

The daemon never starts a replica itself: :meth:`LocalLauncher.launch` starts a supervisor
(``python -m pollux_local.launch.supervisor``, in a session of its own, as the daemon's user)
and hands it the incarnation's spec on stdin.  The supervisor forks the replicas, each of
which becomes the job's user before it touches anything in the job's directory (its log
``rank<rank>.log``, the checkpoint directory) or enters the working directory; it forwards a
stop, kills what is left after the grace period, and writes the incarnation's result to
``RUN_DIR/<job id>.json`` (``RUN_DIR`` is the daemon's own, ``STATE_DIR/run``).  The daemon
only signals the supervisor and reads that file.  A spec's ``limits`` (``--mem``, ``--cpus``)
go to the supervisor, which puts every replica into the incarnation's cgroups
(``launch/cgroups.py``) and records whether the OOM killer ended one
(:attr:`LocalReplicaGroup.over_memory` says so in one line).

A :class:`LocalReplicaGroup` watches one supervisor: its own child, or, after a restart of the
daemon, a supervisor it adopts (:meth:`LocalLauncher.adopt`) through a pidfd (polling
``/proc`` where there is none).  ``stop(grace_s)`` writes the grace to the supervisor's
control file and sends it SIGTERM; the SIGKILL after the grace is the supervisor's to send.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import pwd
import resource
import signal
import stat
import sys
import tempfile
import time
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pollux_local
from pollux_local.api.launch import replica_environ
from pollux_local.api.resize import ResizeOrder, encode_order
from pollux_local.errors import PolluxError
from pollux_local.launch import cgroups
from pollux_local.launch.base import (
    EXITED,
    LaunchSpec,
    NodeHealth,
    ReplicaSlot,
    settles,
)
from pollux_local.launch.supervisor import (
    EXEC_EXIT_CODE,
    RUN_FILE_VERSION,
    SETUP_EXIT_CODE,
    WORKDIR_EXIT_CODE,
    boot_id,
    combine_exit_codes,
    descendants,
    proc_start_time,
    read_own_json,
    signal_group_of,
    write_private_json,
)
from pollux_local.sizes import format_size

__all__ = [
    "EXEC_EXIT_CODE",
    "SETUP_EXIT_CODE",
    "WORKDIR_EXIT_CODE",
    "LocalLauncher",
    "LocalReplicaGroup",
    "RunRecord",
    "combine_exit_codes",
    "read_run_file",
    "replica_env",
]

log = logging.getLogger("pollux_local.daemon")

#: How long a supervisor may take to start its replicas (fork, setup, exec) before the
#: launch is given up.
START_TIMEOUT_S = 60.0
#: How long past a stop's grace ``stop`` waits for the group's end (the supervisor's SIGKILL,
#: its reaping and its result).
REAP_MARGIN_S = 1.0
#: After a stop's grace, how long the supervisor gets to kill and reap before the daemon
#: kills the replicas' group and the supervisor itself (it should never come to that).
STOP_MARGIN_S = 10.0
#: How often an adopted supervisor is looked at where no pidfd can be had.
POLL_S = 0.5
#: Largest run file read: it holds the job's command (``launch``), which a request may make
#: as large as its 16 MiB frame (control characters written as JSON escapes); the file is the
#: daemon's own, the cap only bounds memory.
MAX_RUN_FILE_BYTES = 64 << 20


def replica_env(spec: LaunchSpec, slot: ReplicaSlot) -> dict[str, str]:
    """The environment of one replica: the spec's common env plus the per-rank variables
    (``api.launch.replica_environ``: torchrun's whole contract).  A ``cuda:<i>`` device is
    NVML's index ``i`` (PCI bus order): ``CUDA_VISIBLE_DEVICES=i`` with
    ``CUDA_DEVICE_ORDER=PCI_BUS_ID``, without which CUDA would number a mixed box's GPUs
    fastest first."""
    same_node = [other for other in spec.slots if other.node == slot.node]
    kind, _, index = slot.device.partition(":")
    common = {**spec.env, "WORLD_SIZE": str(len(spec.slots))}
    if kind == "cuda":
        common["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    return replica_environ(
        common,
        rank=slot.rank,
        local_rank=slot.local_rank,
        node_rank=slot.node_rank,
        local_world_size=len(same_node),
        device="cuda" if kind == "cuda" else "cpu",
        device_index=index if kind == "cuda" else None,
    )


# --- the daemon's run directory -----------------------------------------------------------------


def ensure_private_dir(path: Path) -> Path:
    """``path`` as a 0700 directory of the daemon's user (created when absent); a symlink,
    anything not a directory or another user's directory is refused."""
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode):
        raise PolluxError(f"{path} is not a directory (a symlink?)")
    if info.st_uid != os.geteuid():
        raise PolluxError(f"{path} belongs to uid {info.st_uid}, not to the daemon's user")
    if stat.S_IMODE(info.st_mode) & 0o077:
        os.chmod(path, 0o700)
    return path


def read_run_file(path: Path) -> dict[str, Any] | None:
    """A run file as the supervisor wrote it (``None``: absent, unreadable, not a plain file
    of the daemon's user, over :data:`MAX_RUN_FILE_BYTES`, or not a version-1 record)."""
    data = read_own_json(path, MAX_RUN_FILE_BYTES)
    if data is None or data.get("version") != RUN_FILE_VERSION:
        return None
    return data


@dataclass(frozen=True)
class RunRecord:
    """What a run file says of one incarnation (see ``launch/supervisor.py``)."""

    path: Path
    job_id: str
    state: str
    supervisor_pid: int
    supervisor_start: int | None
    boot_id: str
    pgid: int
    replicas: tuple[dict[str, Any], ...]
    exit_code: int | None
    error: str | None
    ended: float | None
    launch: Mapping[str, Any]
    #: the OOM killer ended a process of the incarnation, over its memory limit (bytes)
    oom_killed: bool = False
    memory_limit: int | None = None
    #: the incarnation's cgroups, while its supervisor has not removed them
    cgroups: tuple[str, ...] = ()
    #: where the newest warm resize stands (``launch/supervisor.py``), ``None``: none asked
    warm: Mapping[str, Any] | None = None
    #: when the supervisor started the replicas (Unix time; ``None``: not said)
    started: float | None = None

    @classmethod
    def load(cls, path: Path) -> RunRecord | None:
        """The run file at ``path`` (``None``: none, or not one of this daemon's), settled
        (:meth:`settled`)."""
        record = cls._read(path)
        return record.settled() if record is not None else None

    def settled(self) -> RunRecord:
        """This record; but one written once every replica had ended (``"exited"``, with
        their exits) by a supervisor that is gone (it died during its clean-up: a power cut,
        a kill) is the incarnation's result (:func:`~pollux_local.launch.base.settles`, the
        rule every launcher's recovery shares): what is left of it is killed
        (:meth:`kill_replicas`) and it is taken as ``"ended"``.  Without a result, a job that
        had finished was queued again and ran a second time."""
        if self.state != EXITED or self.exit_code is None:
            return self
        if not settles(self.state, False, self.supervisor_alive()):
            return self
        self.kill_replicas()
        return replace(self, state="ended")

    @classmethod
    def _read(cls, path: Path) -> RunRecord | None:
        data = read_run_file(path)
        if data is None:
            return None
        try:
            supervisor = data["supervisor"]
            code = data.get("exit_code")
            return cls(
                path=path,
                job_id=str(data["job_id"]),
                state=str(data["state"]),
                supervisor_pid=int(supervisor["pid"]),
                supervisor_start=(
                    int(supervisor["start_time"])
                    if supervisor.get("start_time") is not None
                    else None
                ),
                boot_id=str(supervisor.get("boot_id") or ""),
                pgid=int(data.get("pgid") or 0),
                replicas=tuple(dict(r) for r in data.get("replicas") or ()),
                exit_code=int(code) if code is not None else None,
                error=str(data["error"]) if data.get("error") else None,
                ended=float(data["ended"]) if data.get("ended") is not None else None,
                launch=dict(data.get("launch") or {}),
                oom_killed=data.get("oom_killed") is True,
                memory_limit=(
                    int(data["memory_limit"]) if data.get("memory_limit") is not None else None
                ),
                cgroups=tuple(
                    str(p) for p in data.get("cgroups") or () if cgroups.is_job_group(str(p))
                ),
                warm=dict(data["warm"]) if isinstance(data.get("warm"), dict) else None,
                started=float(data["started"]) if data.get("started") is not None else None,
            )
        except (KeyError, TypeError, ValueError, AttributeError):
            return None

    @property
    def finished(self) -> bool:
        return self.state == "ended" and self.exit_code is not None

    def supervisor_alive(self) -> bool:
        """Is the process with the supervisor's pid still that supervisor (same boot, same
        start time)?"""
        if self.boot_id and self.boot_id != boot_id():
            return False
        start = proc_start_time(self.supervisor_pid)
        return (
            start is not None
            and start == self.supervisor_start
            and not _is_zombie(self.supervisor_pid)
        )

    def pids(self) -> dict[int, int]:
        return {int(r["rank"]): int(r["pid"]) for r in self.replicas}

    def exit_codes(self) -> dict[int, int]:
        return {
            int(r["rank"]): int(r["exit_code"])
            for r in self.replicas
            if r.get("exit_code") is not None
        }

    def live_pids(self) -> dict[int, int]:
        """rank -> pid of the replicas this record names that are still those processes
        (this boot, the start time the record names: not gone, not a later process given the
        pid)."""
        if self.boot_id and self.boot_id != boot_id():
            return {}
        live = {}
        for replica in self.replicas:
            pid, start = int(replica["pid"]), replica.get("start_time")
            if start is not None and proc_start_time(pid) == int(start):
                live[int(replica["rank"])] = pid
        return live

    def kill_replicas(self) -> None:
        """SIGKILL the replicas this record names that are still those processes (a
        supervisor that died without its result leaves them orphaned), and whatever is left
        in the incarnation's cgroups (:func:`remove_cgroups` then removes them); nothing after
        a reboot."""
        if self.boot_id and self.boot_id != boot_id():
            return
        for pid in self.live_pids().values():
            with contextlib.suppress(OSError):
                if pid == self.pgid:
                    os.killpg(pid, signal.SIGKILL)
                os.kill(pid, signal.SIGKILL)
        remove_cgroups(self.cgroups)


def remove_cgroups(paths: Sequence[str]) -> None:
    """Remove the cgroups a dead supervisor left (their processes killed): at once where
    they are empty, else again for :data:`cgroups.REMOVE_TIMEOUT_S` in the background."""
    left = [path for path in paths if not cgroups.sweep(path)]
    if not left:
        return
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return  # no loop to wait in: the next incarnation of that name removes it

    async def retry() -> None:
        pending = list(left)
        deadline = loop.time() + cgroups.REMOVE_TIMEOUT_S
        while pending and loop.time() < deadline:
            await asyncio.sleep(0.1)
            pending = [path for path in pending if not cgroups.sweep(path)]
        if pending:
            log.warning("cannot remove cgroup(s) %s", ", ".join(pending))

    _REMOVING.add(task := loop.create_task(retry()))
    task.add_done_callback(_REMOVING.discard)


#: Removals of cgroups in the background (kept referenced while they run).
_REMOVING: set[asyncio.Task[None]] = set()


def memory_text(size: int) -> str:
    """A memory limit as ``--mem`` takes it: ``64M``, ``16G`` (else ``1.5G``, rounded)."""
    for unit, factor in (("T", 1 << 40), ("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if size >= factor and size % factor == 0:
            return f"{size // factor}{unit}"
    return format_size(size)


def _is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            data = fh.read()
        return data[data.rindex(b")") + 2 : data.rindex(b")") + 3] in (b"Z", b"X")
    except (OSError, ValueError):
        return False


def replica_payload(
    spec: LaunchSpec, slot: ReplicaSlot, what: str, stamp: str, **extra: str
) -> dict[str, Any]:
    """One replica as the supervisor starts it: its command, environment (``extra`` added),
    log and the banner its log gets first."""
    return {
        "rank": slot.rank,
        "argv": list(spec.argv),
        "env": {**replica_env(spec, slot), **extra},
        "log": f"rank{slot.rank}.log",
        "banner": f"--- {stamp} {what}: rank {slot.rank}/{len(spec.slots)}"
        f" on {slot.node} {slot.device}\n",
    }


def launch_record(spec: LaunchSpec) -> dict[str, Any]:
    """What a run file keeps of a launch, for a restarted daemon (:func:`spec_from_launch`)."""
    return {
        "slots": [
            {
                "rank": s.rank,
                "node": s.node,
                "device": s.device,
                "local_rank": s.local_rank,
                "node_rank": s.node_rank,
            }  # fmt: skip
            for s in spec.slots
        ],
        "job_dir": str(spec.log_dir),
        "workdir": str(spec.workdir),
        "argv": list(spec.argv),
        "run_as": spec.run_as,
        # which start of the job this is (``POLLUX_RESTARTS``): a restarted daemon tells an
        # incarnation it never recorded from one it asked to stop
        "incarnation": int(restarts)
        if (restarts := spec.env.get("POLLUX_RESTARTS", "")).isdigit()
        else None,
    }


def spec_from_launch(job_id: str, launch: Mapping[str, Any]) -> LaunchSpec:
    """A :class:`LaunchSpec` rebuilt from a run file's ``launch`` part (no environment: an
    adopted group is only watched and stopped)."""
    slots = [
        ReplicaSlot(
            int(s["rank"]),
            str(s["node"]),
            str(s["device"]),
            int(s["local_rank"]),
            int(s["node_rank"]),
        )  # fmt: skip
        for s in launch.get("slots") or ()
    ]
    return LaunchSpec(
        job_id=job_id,
        argv=[str(a) for a in launch.get("argv") or ()],
        workdir=Path(str(launch.get("workdir") or "/")),
        env={},
        slots=slots,
        log_dir=Path(str(launch.get("job_dir") or "/")),
        run_as=launch.get("run_as"),
    )


# --- watching a supervisor ------------------------------------------------------------------------


class _Watched:
    """A supervisor process to signal and wait for: the daemon's child, or an adopted one."""

    def __init__(
        self,
        pid: int,
        start_time: int | None,
        proc: asyncio.subprocess.Process | None = None,
        ended: bool = False,
    ) -> None:
        self.pid = pid
        self.start_time = start_time
        self.proc = proc
        #: a pidfd of an adopted supervisor; -1 once it is known to have ended
        self.pidfd: int | None = -1 if ended else None
        if proc is None and not ended:
            with contextlib.suppress(OSError, AttributeError):
                self.pidfd = os.pidfd_open(pid)
            if self.pidfd is not None and proc_start_time(pid) != start_time:
                os.close(self.pidfd)  # the pid was reused between the check and the open
                self.pidfd = -1

    def alive(self) -> bool:
        if self.proc is not None:
            return self.proc.returncode is None
        if self.pidfd == -1:
            return False
        return proc_start_time(self.pid) == self.start_time and not _is_zombie(self.pid)

    def send(self, signum: int) -> None:
        """Signal the supervisor (never another process that got its pid)."""
        with contextlib.suppress(ProcessLookupError, OSError):
            if self.proc is not None:
                if self.proc.returncode is None:
                    self.proc.send_signal(signum)
            elif self.pidfd is not None and self.pidfd >= 0:
                signal.pidfd_send_signal(self.pidfd, signum)
            elif self.alive():
                os.kill(self.pid, signum)

    async def wait(self) -> None:
        if self.proc is not None:
            await self.proc.wait()
            return
        if self.pidfd is not None and self.pidfd >= 0:
            loop = asyncio.get_running_loop()
            ended = loop.create_future()
            fd = self.pidfd

            def readable() -> None:
                if not ended.done():
                    ended.set_result(None)

            loop.add_reader(fd, readable)
            try:
                await ended
            finally:
                loop.remove_reader(fd)
                os.close(fd)
                self.pidfd = -1
            return
        while self.alive():
            await asyncio.sleep(POLL_S)


class LocalReplicaGroup:
    """The replicas of one incarnation on this machine, seen through their supervisor."""

    #: After one replica fails, how long the others get to stop before being killed.
    FAILURE_GRACE_S = 5.0

    def __init__(
        self,
        spec: LaunchSpec,
        run_file: Path,
        control_file: Path,
        supervisor: _Watched,
        pgid: int,
        pids: Mapping[int, int],
        starts: Mapping[int, int] | None = None,
    ) -> None:
        self.spec = spec
        self.run_file = run_file
        self.control_file = control_file
        self.supervisor = supervisor
        self.pgid = pgid
        self._pids = dict(pids)
        #: pid -> start time of the replicas started (as the supervisor said)
        self._starts = dict(starts or {})
        self.started = time.time()
        self.record: RunRecord | None = None
        #: why the group ended without a result of its supervisor's (it was killed)
        self.supervisor_failure: str | None = None
        self._code: int | None = None
        self._done = asyncio.Event()
        self._fallback: asyncio.Task[None] | None = None
        self._watcher = asyncio.ensure_future(self._watch())
        #: the daemon's warm resize requests to the supervisor (``launch/supervisor.py``)
        self.warm_file = run_file.with_suffix(".warm")

    @property
    def supervisor_pid(self) -> int:
        return self.supervisor.pid

    @property
    def ended(self) -> float | None:
        """When the last replica ended, as the supervisor recorded it."""
        return self.record.ended if self.record is not None else None

    async def _watch(self) -> None:
        try:
            await self.supervisor.wait()
        except asyncio.CancelledError:
            # the daemon stops: the supervisor runs on with its replicas, for the next
            # daemon to adopt (it is not dead: nothing of it is killed)
            raise
        except BaseException:
            self._finish()
            raise
        self._finish()

    def _finish(self) -> None:
        record = RunRecord.load(self.run_file)
        if record is not None and record.finished and record.exit_code is not None:
            self.record = record
            self._code = record.exit_code
        else:
            # The supervisor ended without its result (killed): nothing of it may live on.
            if record is not None:
                record.kill_replicas()
            elif self.pgid:
                signal_group_of(self.pgid, signal.SIGKILL, self._members())
            self.supervisor_failure = (
                f"the job's supervisor (pid {self.supervisor.pid}) ended without a result: "
                + _tail(self.run_file.with_suffix(".err"))
            )
            self._code = -int(signal.SIGKILL)
        self._done.set()
        if self._fallback is not None:
            self._fallback.cancel()

    def poll(self) -> int | None:
        return self._code if self._done.is_set() else None

    @property
    def over_memory(self) -> str | None:
        """Why the group ended when the OOM killer ended a replica over the job's host
        memory limit (one line), else ``None``."""
        record = self.record
        if record is None or not record.oom_killed:
            return None
        limit = f" --mem {memory_text(record.memory_limit)}" if record.memory_limit else ""
        return f"killed: over its host memory limit{limit}"

    async def wait(self) -> int:
        await self._done.wait()
        assert self._code is not None
        return self._code

    def exit_codes(self) -> dict[int, int]:
        return self.record.exit_codes() if self.record is not None else {}

    def lost_nodes(self) -> set[str]:
        """None: this machine's replicas lose no node."""
        return set()

    def unanswered_nodes(self) -> set[str]:
        return set()

    async def stop(self, grace_s: float) -> int | None:
        """Ask the supervisor to stop the replicas: the grace goes to its control file, then
        SIGTERM (it forwards the SIGTERM and sends the SIGKILL ``grace_s`` later).  Waits
        ``grace_s`` (and :data:`REAP_MARGIN_S`) at most: the group's code, or ``None`` if it
        has not ended by then (its exit comes through :meth:`wait`).  Should the supervisor
        itself still be there :data:`STOP_MARGIN_S` after the grace, the daemon kills it and
        the replicas' group."""
        if self._done.is_set():
            return self._code
        with contextlib.suppress(OSError):
            write_private_json(str(self.control_file), {"grace_s": max(0.0, grace_s)})
        self.supervisor.send(signal.SIGTERM)
        if self._fallback is None:
            self._fallback = asyncio.ensure_future(self._kill_if_stuck(grace_s + STOP_MARGIN_S))
        try:
            await asyncio.wait_for(asyncio.shield(self._done.wait()), grace_s + REAP_MARGIN_S)
        except TimeoutError:
            return None
        return self._code

    async def _kill_if_stuck(self, delay_s: float) -> None:
        await asyncio.sleep(delay_s)
        if self._done.is_set():
            return
        log.error(
            "job %s: its supervisor (pid %s) is still there %g s after a stop; killing it",
            self.spec.job_id, self.supervisor.pid, delay_s,
        )  # fmt: skip
        if self.pgid:
            signal_group_of(self.pgid, signal.SIGKILL, self._members())
        self.supervisor.send(signal.SIGKILL)

    def pids(self) -> Mapping[int, int]:
        """rank -> pid of the replicas; read from the run file while none is known (a group
        adopted while its supervisor was still starting them: its run file said
        ``starting``, naming none yet)."""
        if not self._pids:
            record = RunRecord.load(self.run_file)
            if record is not None and record.replicas:
                self._pids = record.pids()
                self._starts.update(replica_starts(record.replicas))
        return dict(self._pids)

    def _members(self) -> list[tuple[int, int | None]]:
        """The processes known to be this incarnation's: its supervisor (while it is that
        process) and what runs below it, its replicas as its run file names them (each with
        its start time)."""
        members: list[tuple[int, int | None]] = list(self._starts.items())
        if self.supervisor.alive():
            members.extend((pid, None) for pid in descendants(self.supervisor.pid))
        record = RunRecord.load(self.run_file)
        if record is not None:
            members.extend(replica_starts(record.replicas).items())
        return members

    # --- warm resizes ---------------------------------------------------------------------

    @property
    def warm_capable(self) -> bool:
        """Whether the replicas were started to take warm resize orders (the daemon gave
        them an order file; an adopted group's is not known)."""
        return self.spec.resize_file is not None

    def resizes_onto(self, nodes: Collection[str]) -> bool:
        """Whether it can be resized in place onto ``nodes``: only onto the one node it runs
        on (this machine's other nodes hold other device types)."""
        return set(nodes) == {slot.node for slot in self.spec.slots}

    async def resize_warm(
        self, spec: LaunchSpec, order: ResizeOrder, ready_timeout_s: float
    ) -> str | None:
        """Change the running replicas to ``spec``'s in place (``launch/supervisor.py``):
        ranks ``spec`` adds are started to join, ranks it drops leave.  Returns once the
        order is written and the leavers are gone (``None``), or why the resize could not be
        ordered (one line; the running replicas then never saw an order).  The devices of
        ``spec`` count as the group's from the start of a grow and from the leavers' exit
        after a shrink."""
        old = self.spec
        order_file = old.resize_file
        if order_file is None or self._done.is_set():
            return "the job's replicas do not take warm resize orders"
        if order.ranks is not None and list(order.ranks) != list(range(len(order.ranks))):
            return "ranks are renumbered in place on SSH nodes only"
        kept = {slot.rank for slot in old.slots}
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        joiners = [
            replica_payload(
                spec,
                slot,
                f"joined at resize {order.generation}",
                stamp,
                POLLUX_RESIZE_JOIN=str(order.generation),
            )  # fmt: skip
            for slot in spec.slots
            if slot.rank not in kept
        ]
        request = {
            "generation": order.generation,
            "world_size": order.world_size,
            "order_file": str(order_file),
            "order": encode_order(order).decode(),
            "joiners": joiners,
            "ready_timeout_s": ready_timeout_s,
            "launch": launch_record(spec),
        }
        write_private_json(str(self.warm_file), request)
        growing = len(spec.slots) > len(old.slots)
        if growing:
            self.spec = spec
        self.supervisor.send(signal.SIGUSR1)
        deadline = time.monotonic() + ready_timeout_s + STOP_MARGIN_S
        ordered = False
        while not self._done.is_set() and time.monotonic() < deadline:
            record = RunRecord.load(self.run_file)
            warm = record.warm if record is not None else None
            if record is not None and warm and warm.get("generation") == order.generation:
                if warm.get("state") == "failed":
                    self.spec = old
                    return str(warm.get("error") or "the warm resize failed")
                if warm.get("state") == "ordered":
                    ordered = True
                    self._pids = record.pids()
                    if all(int(r["rank"]) < order.world_size for r in record.replicas):
                        self.spec = spec
                        return None
            await asyncio.sleep(0.02)
        if not ordered:
            self.spec = old
            return (
                "the job ended during its warm resize"
                if self._done.is_set()
                else "the job's supervisor did not take the warm resize in time"
            )
        return (
            "the job ended during its warm resize"
            if self._done.is_set()
            else "the leaving replicas did not exit after the warm resize order"
        )


# --- the launcher ---------------------------------------------------------------------------------


def _identity(spec: LaunchSpec) -> dict[str, Any] | None:
    """The user the replicas become: only when the daemon is root and the job's owner is
    not."""
    if os.geteuid() != 0 or (spec.run_as is None and spec.run_as_uid is None):
        return None
    try:
        if spec.run_as_uid is not None:
            entry = pwd.getpwuid(spec.run_as_uid)
        else:
            assert spec.run_as is not None
            entry = pwd.getpwnam(spec.run_as)
    except KeyError:
        who = f"uid {spec.run_as_uid}" if spec.run_as_uid is not None else spec.run_as
        raise PolluxError(f"owner {who} no longer exists") from None
    if entry.pw_uid == 0:
        return None
    return {
        "uid": entry.pw_uid,
        "gid": entry.pw_gid,
        "groups": os.getgrouplist(entry.pw_name, entry.pw_gid),
        "name": entry.pw_name,
    }


#: The soft limit on open files a job's processes start with: this process's when it was
#: first imported, before the daemon raised its own (``server.raise_open_files_limit``), so
#: that a job gets what it would get started by hand (``select()`` breaks past 1,024).
JOB_OPEN_FILES = resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def replica_starts(replicas: Iterable[Mapping[str, Any]]) -> dict[int, int]:
    """pid -> start time of the replicas a supervisor named (those it gave one)."""
    return {int(r["pid"]): int(r["start_time"]) for r in replicas if r.get("start_time")}


def package_root() -> str:
    """The directory holding ``pollux_local`` (a helper's ``PYTHONPATH``)."""
    return str(Path(pollux_local.__file__).resolve().parent.parent)


class LocalLauncher:
    """Starts replica groups on this machine, one supervisor per incarnation.

    ``run_dir`` is the daemon's directory for run files (``STATE_DIR/run``; a private
    temporary directory when not given); ``stop_grace_s`` the grace the supervisor gives a
    stop it was not told the grace of (a SIGTERM from elsewhere)."""

    def __init__(
        self,
        devices: Mapping[str, Sequence[str]] | None = None,
        run_dir: Path | None = None,
        stop_grace_s: float = 60.0,
        max_log_bytes: int | None = None,
        log_keep_free: int = 0,
    ) -> None:
        self.devices = dict(devices or {})
        self._run_dir = run_dir
        self.stop_grace_s = stop_grace_s
        #: each replica's log is cut at this many bytes (``None``: no limit)
        self.max_log_bytes = max_log_bytes
        #: a log is not written while its disk has less than this free (``[limits]
        #: log_keep_free``, see :func:`logcap.floor_of`)
        self.log_keep_free = log_keep_free

    @property
    def run_dir(self) -> Path:
        if self._run_dir is None:
            self._run_dir = Path(tempfile.mkdtemp(prefix="pollux-run-"))
        return ensure_private_dir(self._run_dir)

    def run_file(self, job_id: str) -> Path:
        return self.run_dir / f"{job_id}.json"

    def control_file(self, job_id: str) -> Path:
        return self.run_dir / f"{job_id}.ctl"

    def err_file(self, job_id: str) -> Path:
        return self.run_dir / f"{job_id}.err"

    def warm_file(self, job_id: str) -> Path:
        return self.run_dir / f"{job_id}.warm"

    def forget(self, job_id: str) -> None:
        """Remove an incarnation's run, control and warm resize files (its result was taken
        in)."""
        for path in (
            self.run_file(job_id),
            self.control_file(job_id),
            self.err_file(job_id),
            self.warm_file(job_id),
        ):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()

    def records(self) -> dict[str, RunRecord]:
        """Every run file in the run directory, by job id."""
        found: dict[str, RunRecord] = {}
        if self._run_dir is None or not self._run_dir.is_dir():
            return found
        for path in sorted(self.run_dir.glob("*.json")):
            record = RunRecord.load(path)
            if record is not None and path.stem == record.job_id:
                found[record.job_id] = record
            else:
                log.warning("ignoring %s: not a run file of this daemon", path)
        return found

    def _payload(self, spec: LaunchSpec, identity: dict[str, Any] | None) -> dict[str, Any]:
        restarts = spec.env.get("POLLUX_RESTARTS", "0")
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        checkpoint = spec.env.get("POLLUX_CHECKPOINT_DIR")
        return {
            "version": RUN_FILE_VERSION,
            "job_id": spec.job_id,
            "run_file": str(self.run_file(spec.job_id)),
            "control_file": str(self.control_file(spec.job_id)),
            "warm_file": str(self.warm_file(spec.job_id)),
            "grace_s": self.stop_grace_s,
            "failure_grace_s": LocalReplicaGroup.FAILURE_GRACE_S,
            "user": identity,
            "job_dir": str(spec.log_dir),
            "workdir": str(spec.workdir),
            "checkpoint_dir": checkpoint or None,
            "umask": spec.umask,
            "stdin": spec.stdin,
            "limits": spec.limits.to_json() if spec.limits is not None else None,
            "incarnation": int(restarts) if restarts.isdigit() else 0,
            "max_log_bytes": self.max_log_bytes,
            "open_files": JOB_OPEN_FILES,
            "log_keep_free": self.log_keep_free,
            "replicas": [
                replica_payload(spec, slot, f"start #{restarts}", stamp)
                for slot in sorted(spec.slots, key=lambda s: s.rank)
            ],
            "launch": launch_record(spec),
        }

    async def launch(self, spec: LaunchSpec) -> LocalReplicaGroup:
        """Start the incarnation's supervisor and wait until its replicas run (or one of
        them could not be set up: :class:`PolluxError` with the supervisor's one-line
        reason)."""
        identity = _identity(spec)
        self.forget(spec.job_id)
        payload = self._payload(spec, identity)
        err_path = self.err_file(spec.job_id)
        err_fd = os.open(
            err_path,
            os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC,
            0o600,
        )
        try:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "pollux_local.launch.supervisor", "--job", spec.job_id,
                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=err_fd,
                start_new_session=True, cwd="/",
                env={
                    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                    "PYTHONPATH": package_root(), "LANG": "C.UTF-8",
                },
            )  # fmt: skip
        finally:
            os.close(err_fd)
        assert proc.stdin is not None and proc.stdout is not None
        try:
            proc.stdin.write(json.dumps(payload).encode() + b"\n")
            await proc.stdin.drain()
            proc.stdin.close()
            line = await asyncio.wait_for(proc.stdout.readline(), START_TIMEOUT_S)
        except (TimeoutError, OSError) as exc:
            await self._give_up(proc, spec.job_id)
            what = "did not start" if isinstance(exc, TimeoutError) else f"failed ({exc})"
            raise PolluxError(f"the job's supervisor {what} within {START_TIMEOUT_S:g} s") from None
        try:
            answer = json.loads(line) if line else None
        except ValueError:
            answer = None
        if not isinstance(answer, dict) or not answer.get("ok"):
            await proc.wait()
            if isinstance(answer, dict) and answer.get("error"):
                reason = str(answer["error"])
            else:
                reason = f"the job's supervisor failed (exit {proc.returncode}): " + _tail(err_path)
            # a supervisor killed while it started the replicas: its run file lists their
            # cgroups (the fence), which are ended before the file goes
            record = RunRecord.load(self.run_file(spec.job_id))
            if record is not None and not record.finished:
                record.kill_replicas()
            self.forget(spec.job_id)
            raise PolluxError(reason)
        watched = _Watched(int(answer["pid"]), answer.get("start_time"), proc)
        replicas = answer.get("replicas") or ()
        pids = {int(r["rank"]): int(r["pid"]) for r in replicas}
        return LocalReplicaGroup(
            spec,
            self.run_file(spec.job_id),
            self.control_file(spec.job_id),
            watched,
            int(answer.get("pgid") or 0),
            pids,
            replica_starts(replicas),
        )

    async def _give_up(self, proc: asyncio.subprocess.Process, job_id: str) -> None:
        """End a supervisor whose start is given up (no answer in time), with whatever it
        started, before the start is reported failed: the job is then retried or failed,
        and nothing of this start may run on.  A SIGTERM was not enough (review s66): one
        still trying to write its run file (the state directory's disk full) has SIGTERM
        blocked, and once there was room it started the replicas, unknown to the daemon,
        beside the job's retry and on devices given to others, and its last write replaced
        the retry's run file.  Stopped first (it forks nothing more), its processes below
        killed, then itself (it is this process's child: its pid is not reused before it is
        reaped), and what its run file lists (the fence's cgroups) ended."""
        pid = proc.pid
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGSTOP)
        for _ in range(3):
            left = [child for child in descendants(pid) if not _is_zombie(child)]
            if not left:
                break
            for child in left:
                with contextlib.suppress(OSError):
                    os.kill(child, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        await proc.wait()
        record = RunRecord.load(self.run_file(job_id))
        if record is not None and not record.finished:
            record.kill_replicas()
        self.forget(job_id)

    def adopt(self, record: RunRecord) -> LocalReplicaGroup | None:
        """The group of an incarnation a previous daemon started: its supervisor still
        running (watched through a pidfd), or ended with its result recorded (a group that
        is already done).  ``None`` when neither: the supervisor is gone without a result
        (its replicas, if any are left, are killed)."""
        spec = spec_from_launch(record.job_id, record.launch)
        if record.finished:
            watched = _Watched(record.supervisor_pid, record.supervisor_start, ended=True)
        elif record.supervisor_alive():
            watched = _Watched(record.supervisor_pid, record.supervisor_start)
            if not watched.alive():
                record.kill_replicas()
                return None
        else:
            record.kill_replicas()
            return None
        return LocalReplicaGroup(
            spec,
            record.path,
            self.control_file(record.job_id),
            watched,
            record.pgid,
            record.pids(),
            replica_starts(record.replicas),
        )

    async def check_node(self, node: str) -> NodeHealth:
        return NodeHealth(
            node=node,
            reachable=True,
            devices=tuple(self.devices.get(node, ())),
            load=os.getloadavg()[0],
        )


def _tail(path: Path, limit: int = 400) -> str:
    """The end of the supervisor's own output (its ``.err`` file in the run directory), as
    one line."""
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            fh.seek(max(0, fh.tell() - limit))
            return " ".join(fh.read().decode(errors="replace").split()) or "no output"
    except OSError:
        return "no output"
