"""Replicas on other nodes through the OpenSSH client.

One ``ssh`` session per node per job incarnation runs the node-side supervisor there: the
source of ``node_agent.py`` (standard library only), sent as ``python3 -u -c <source>``, so that
the node needs no pollux-local installed.  The supervisor receives the replicas to start as one
JSON line on its stdin (so environments never appear in the node's process list), starts each
replica in its own session/process group with exactly the environment the daemon built, writes
each replica's output to a log file in the node's work dir, streams that log back to the
daemon, and reports ``PID``/``EXIT`` lines (the protocol is in ``node_agent.py``).  Commands the
daemon sends on the same stdin (``TERM``/``KILL``) signal the replicas' process groups; when the
stdin closes (daemon gone, link lost and noticed by the node's sshd) the supervisor stops its
replicas itself, so no orphan keeps running.

Each node's supervisor keeps an exit record there (``WORKDIR/run/<key>/<job id>.json``, the
key naming this daemon's state): a restarted daemon reads it over ssh
(:meth:`SshLauncher.recover`) and applies the recorded exit of a job that ended while it was
down, or waits for the replicas still stopping, rather than running a finished job again.

Connections are shared (``ControlMaster``/``ControlPersist``) under the daemon's state dir, so
that only the first contact with a node pays for a login.  ``ServerAliveInterval`` x
``ServerAliveCountMax`` bounds the time to notice a dead link: every session of that node then
exits with 255 and its replicas count as unreachable (exit code 255).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import errno
import functools
import hashlib
import importlib.resources
import json
import logging
import os
import secrets
import shlex
import signal
import stat
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pollux_local.api.states import ExitCode
from pollux_local.errors import PolluxError
from pollux_local.launch.base import LaunchSpec, NodeHealth, ReplicaSlot
from pollux_local.launch.local import replica_env
from pollux_local.launch.logcap import (
    disk_note,
    floor_of,
    free_bytes,
    resumed_note,
    truncation_note,
)

#: Exit code of a replica whose node could not be reached (ssh's own failure code).
UNREACHABLE_EXIT_CODE = ExitCode.NODE_LOST
#: Exit code when the node's agent could not start the replicas (bad work dir, unshared path).
SETUP_FAILED_EXIT_CODE = ExitCode.NODE_SETUP
#: How often a recovered group's exit records are read again while its replicas run.
RECORD_POLL_S = 1.0
#: How long a recovered group's node may stay unanswering before its ranks count as lost.
RECORD_LOST_S = 60.0

#: Reads (``cat``) or removes (``rm``) an exit record on a node, its path as the argument.
_RECORD_SCRIPT = (
    "import os,sys\n"
    "p=os.path.expanduser(sys.argv[2])\n"
    "if sys.argv[1]=='rm':\n"
    "  try: os.unlink(p)\n"
    "  except OSError: pass\n"
    "else:\n"
    "  try: sys.stdout.write(open(p).read())\n"
    "  except OSError: sys.exit(3)\n"
)

log = logging.getLogger("pollux_local.launch.ssh")


@functools.cache
def node_agent_source() -> str:
    """The node-side supervisor's program (``launch/node_agent.py``) as the text sent to each
    node and run there with ``python -u -c``: no installation on the node is needed."""
    package = importlib.resources.files("pollux_local.launch")
    return package.joinpath("node_agent.py").read_text(encoding="utf-8")


@dataclass(frozen=True)
class SshNodeConfig:
    """One node reached over SSH.

    ``host`` is an ssh destination (``[user@]name``) resolved through the user's
    ``~/.ssh/config``; ``address`` is the address the node's replicas are reached at by the
    other replicas (defaults to the host part of ``host``; used as ``MASTER_ADDR`` when rank 0
    runs there); ``workdir`` holds the replicas' log files on the node; ``gloo_ifname`` is the
    node's network interface for torch.distributed (``GLOO_SOCKET_IFNAME``); ``ssh_options``
    are extra ``ssh`` arguments (e.g. ``["-p", "2222"]``); ``python`` is the interpreter that
    runs the supervisor on the node.
    """

    name: str
    host: str
    devices: tuple[str, ...] = ("cpu:0",)
    address: str | None = None
    workdir: str = "~/.pollux-local"
    gloo_ifname: str | None = None
    ssh_options: tuple[str, ...] = ()
    python: str = "python3"

    @property
    def master_addr(self) -> str:
        """Address other nodes use to reach this one."""
        if self.address:
            return self.address
        return self.host.rsplit("@", 1)[-1]

    @classmethod
    def from_node(cls, node: Any) -> SshNodeConfig:
        """Adapt the daemon's node config (``name``, ``host``, ``devices``, ``workdir`` and,
        when present, ``address``, ``gloo_ifname``, ``ssh_options``, ``python``)."""
        raw = {
            key: getattr(node, key)
            for key in (
                "host",
                "devices",
                "workdir",
                "address",
                "gloo_ifname",
                "ssh_options",
                "python",
            )
            if getattr(node, key, None) is not None
        }
        return cls.from_mapping(str(node.name), raw)

    @classmethod
    def from_mapping(cls, name: str, raw: Mapping[str, Any]) -> SshNodeConfig:
        """Build from a config table; raises PolluxError naming the problem."""
        known = {"host", "devices", "address", "workdir", "gloo_ifname", "ssh_options", "python"}
        # the scheduler's own keys of a node (its devices' type, memory, declared slowdown)
        scheduler_keys = {"name", "device_type", "type", "memory", "slowdown"}
        unknown = sorted(set(raw) - known - scheduler_keys)
        if unknown:
            raise PolluxError(f"node {name}: unknown setting(s) {', '.join(unknown)}")
        host = raw.get("host")
        if not isinstance(host, str) or not host or host.startswith("-"):
            raise PolluxError(f"node {name}: 'host' must be an ssh destination such as user@name")
        devices = raw.get("devices", ("cpu:0",))
        if isinstance(devices, int) and not isinstance(devices, bool) and devices > 0:
            kind = raw.get("device_type", "cpu")
            devices = tuple(f"{kind}:{i}" for i in range(devices))
        if isinstance(devices, str):
            devices = tuple(d.strip() for d in devices.split(","))
        if not isinstance(devices, list | tuple) or not all(
            isinstance(d, str) and d.partition(":")[0] in ("cpu", "cuda") for d in devices
        ):
            raise PolluxError(f"node {name}: 'devices' must list devices such as 'cuda:0'")
        options = raw.get("ssh_options", ())
        if isinstance(options, str):
            options = shlex.split(options)
        if not isinstance(options, list | tuple) or not all(isinstance(o, str) for o in options):
            raise PolluxError(f"node {name}: 'ssh_options' must be a list of strings")
        for key in ("address", "workdir", "gloo_ifname", "python"):
            if key in raw and not isinstance(raw[key], str):
                raise PolluxError(f"node {name}: '{key}' must be a string")
        return cls(
            name=name,
            host=host,
            devices=tuple(devices),
            address=raw.get("address"),
            workdir=raw.get("workdir") or "~/.pollux-local",
            gloo_ifname=raw.get("gloo_ifname"),
            ssh_options=tuple(options),
            python=raw.get("python", "python3"),
        )


@dataclass
class _NodeSession:
    """The ssh session that supervises one node's replicas of one group."""

    node: SshNodeConfig
    ranks: list[int]
    proc: asyncio.subprocess.Process
    exit_codes: dict[int, int] = field(default_factory=dict)
    remote_pids: dict[int, int] = field(default_factory=dict)
    failure: str | None = None
    reader: asyncio.Task[None] | None = None


class SshReplicaGroup:
    """A job incarnation whose replicas run on SSH nodes (see :class:`ReplicaGroup`)."""

    def __init__(
        self,
        spec: LaunchSpec,
        sessions: list[_NodeSession],
        log_files: Mapping[int, Path],
        failure_grace_s: float,
        max_log_bytes: int | None = None,
        log_keep_free: int = 0,
    ) -> None:
        self.spec = spec
        #: a rank's local log ends, with one note, at this size (``[limits] max_log_size``)
        self._max_log_bytes = max_log_bytes
        #: and is not written while its disk has less than this free (``log_keep_free``)
        self._log_keep_free = log_keep_free
        #: ranks whose output is discarded for lack of room, with the bytes dropped so far
        self._dropping: dict[int, int] = {}
        self._sessions = sessions
        self._log_files = dict(log_files)
        self._failure_grace_s = failure_grace_s
        self._first_failure: tuple[int, int] | None = None  # (rank, code), in order of arrival
        #: One line explaining why the group failed, when it did (unreachable node, ...).
        self.failure_reason: str | None = None
        #: ``time.monotonic()`` when the first replica failed (or its node was lost).
        self.failed_at: float | None = None
        self._done = asyncio.Event()
        self._stopping = False
        self._reaper: asyncio.Task[None] | None = None
        self._watcher: asyncio.Task[None] | None = None
        self.started_at = time.monotonic()
        #: the launcher that started it (removes its exit records once its end is stored)
        self._launcher: SshLauncher | None = None

    # -- bookkeeping -------------------------------------------------------------------
    def _record_exit(self, session: _NodeSession, rank: int, code: int) -> None:
        if rank in session.exit_codes:
            return
        session.exit_codes[rank] = code
        if code not in (0, ExitCode.RESCALE) and self._first_failure is None:
            self._first_failure = (rank, code)
            self.failed_at = time.monotonic()
            if self.failure_reason is None:
                if code == UNREACHABLE_EXIT_CODE:
                    self.failure_reason = f"node {session.node.name} became unreachable"
                elif session.failure:
                    self.failure_reason = session.failure
                else:
                    self.failure_reason = (
                        f"rank {rank} on node {session.node.name} exited with {code}"
                    )
            if not self._stopping and self._reaper is None:
                # Like torchrun: one failed rank ends the incarnation; the others would only
                # block in their next collective until the process-group timeout.
                self._reaper = asyncio.ensure_future(self._stop_after_failure())

    async def _stop_after_failure(self) -> None:
        await self._signal_all("TERM")
        await self._wait_for(self._failure_grace_s)
        await self._signal_all("KILL")
        await self._wait_for(2.0)
        self._abandon_sessions()

    async def _read_session(self, session: _NodeSession) -> None:
        assert session.proc.stdout is not None
        while True:
            raw = await session.proc.stdout.readline()
            if not raw:
                break
            parts = raw.decode(errors="replace").rstrip("\n").split(" ", 2)
            kind = parts[0]
            try:
                if kind == "PID" and len(parts) == 3:
                    session.remote_pids[int(parts[1])] = int(parts[2])
                elif kind == "LOG" and len(parts) == 3:
                    self._append_log(int(parts[1]), base64.b64decode(parts[2]))
                elif kind == "EXIT" and len(parts) == 3:
                    self._record_exit(session, int(parts[1]), int(parts[2]))
                elif kind == "FAIL":
                    session.failure = f"node {session.node.name}: " + " ".join(parts[1:])
            except ValueError:
                continue
        rc = await session.proc.wait()
        for rank in session.ranks:
            if rank not in session.exit_codes:
                if session.failure:
                    code = SETUP_FAILED_EXIT_CODE
                elif rc == UNREACHABLE_EXIT_CODE or rc == 0:
                    code = UNREACHABLE_EXIT_CODE
                else:
                    code = rc if rc > 0 else UNREACHABLE_EXIT_CODE
                self._record_exit(session, rank, code)

    async def _watch(self) -> None:
        readers = [s.reader for s in self._sessions if s.reader is not None]
        await asyncio.gather(*readers, return_exceptions=True)
        self._done.set()

    def _append_log(self, rank: int, data: bytes) -> None:
        """Append a remote rank's output to its local log, which lies in a directory the job's
        user can write: never following a symlink, never blocking on a FIFO, never writing
        through a hard link or into a file the job's user does not own (the daemon may be
        root).  A log the daemon makes is given to the job's user, as a local replica's own
        log is theirs.  An unsafe log loses the bytes."""
        path = self._log_files.get(rank)
        if path is None:
            return
        flags = os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        flags |= os.O_NOCTTY
        owner = os.geteuid() if self.spec.run_as_uid is None else self.spec.run_as_uid
        if os.geteuid() != 0:
            owner = os.geteuid()  # a daemon that is not root runs every job as itself
        try:
            try:
                fd = os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o644)
                created = True
            except FileExistsError:
                fd, created = os.open(path, flags), False
        except OSError as exc:
            log.warning("not writing to %s: %s", path, exc.strerror)
            return
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode) or info.st_nlink != 1:
                log.warning("not writing to %s: not a plain file", path)
                return
            if created and info.st_uid != owner:
                folder = os.stat(path.parent, follow_symlinks=False)
                os.fchown(fd, owner, folder.st_gid)
            elif info.st_uid != owner:
                log.warning("not writing to %s: it belongs to uid %d", path, info.st_uid)
                return
            if self._log_keep_free and not self._room_for(rank, fd, len(data)):
                return
            limit = self._max_log_bytes
            if limit is not None and info.st_size + len(data) > limit:
                if info.st_size > limit:
                    return  # cut already (the note is past the limit): the rest is discarded
                data = data[: limit - info.st_size] + truncation_note(limit)
            os.write(fd, data)
        finally:
            os.close(fd)

    def _room_for(self, rank: int, fd: int, size: int) -> bool:
        """Whether ``size`` more bytes of rank ``rank``'s output may go to its log ``fd`` and
        leave its disk ``log_keep_free`` free; the first refusal writes one note, and a log
        written again after it says how much was dropped (as :func:`logcap.copy_capped`)."""
        floor = floor_of(fd, self._log_keep_free)
        free = free_bytes(fd)
        dropped = self._dropping.get(rank)
        if dropped is None and free is not None and free - size < floor:
            with contextlib.suppress(OSError):
                os.write(fd, disk_note(floor))
            dropped = 0
        elif dropped is not None and (free is None or free >= 2 * floor + size):
            with contextlib.suppress(OSError):
                os.write(fd, resumed_note(dropped))
            del self._dropping[rank]
            return True
        if dropped is None:
            return True
        self._dropping[rank] = dropped + size
        return False

    def _abandon_sessions(self) -> None:
        """Drop ssh clients that still run (their link is dead or the node hangs)."""
        for session in self._sessions:
            if session.proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    session.proc.kill()

    async def _signal_all(self, command: str) -> None:
        for session in self._sessions:
            stdin = session.proc.stdin
            if session.proc.returncode is not None or stdin is None or stdin.is_closing():
                continue
            try:
                stdin.write(command.encode() + b"\n")
                await asyncio.wait_for(stdin.drain(), 2.0)
            except (ConnectionError, TimeoutError, RuntimeError):
                continue

    async def _wait_for(self, timeout_s: float) -> bool:
        try:
            await asyncio.wait_for(asyncio.shield(self._done.wait()), max(timeout_s, 0.0))
        except TimeoutError:
            return False
        return True

    # -- the ReplicaGroup interface -----------------------------------------------------
    def exit_codes(self) -> dict[int, int]:
        """rank -> exit code, for the replicas that ended so far."""
        codes: dict[int, int] = {}
        for session in self._sessions:
            codes.update(session.exit_codes)
        return codes

    def poll(self) -> int | None:
        """``None`` while any replica runs; else the group's exit code."""
        if not self._done.is_set():
            return None
        if self._first_failure is not None:
            return self._first_failure[1]
        codes = set(self.exit_codes().values())
        if codes == {0}:
            return 0
        return ExitCode.RESCALE

    async def wait(self) -> int:
        await self._done.wait()
        if self._reaper is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper
        code = self.poll()
        assert code is not None
        return code

    async def stop(self, grace_s: float) -> int:
        """SIGTERM every replica, wait ``grace_s`` for the checkpoint exit, then SIGKILL."""
        self._stopping = True
        if not self._done.is_set():
            await self._signal_all("TERM")
            if not await self._wait_for(grace_s):
                await self._signal_all("KILL")
                if not await self._wait_for(3.0):
                    self._abandon_sessions()
        return await self.wait()

    def pids(self) -> Mapping[int, int]:
        """rank -> pid on its node."""
        pids: dict[int, int] = {}
        for session in self._sessions:
            pids.update(session.remote_pids)
        return pids

    def nodes(self) -> list[str]:
        return [s.node.name for s in self._sessions]

    async def forget(self) -> None:
        """Remove the exit records of this incarnation from its nodes (its end is in the
        daemon's store now)."""
        if self._launcher is not None:
            await self._launcher.forget_records(self.spec.job_id, self.nodes())


class SshRecordedGroup:
    """An incarnation found on its SSH nodes by a restarted daemon, through the exit records
    their supervisors keep (see :class:`ReplicaGroup`): its end is read from them, polled
    over ssh, and a stop is sent to its replicas' process groups.  ``orphaned``: a
    supervisor stopped replicas itself because the daemon was gone (the job did not end on
    its own)."""

    def __init__(
        self, launcher: SshLauncher, spec: LaunchSpec, records: Mapping[str, Mapping[str, Any]]
    ) -> None:
        self.spec = spec
        self._launcher = launcher
        self.records = dict(records)
        self.ended: float | None = None
        self.failure_reason: str | None = None
        self._lost: dict[str, float] = {}
        self._note_end()

    @property
    def orphaned(self) -> bool:
        return any(record.get("orphaned") for record in self.records.values())

    def _note_end(self) -> None:
        if all(r.get("state") == "ended" for r in self.records.values()):
            ends = [float(r.get("ended") or time.time()) for r in self.records.values()]
            self.ended = max(ends, default=time.time())

    def exit_codes(self) -> dict[int, int]:
        codes: dict[int, int] = {}
        for name, record in self.records.items():
            for replica in record.get("replicas", ()):
                if replica.get("exit_code") is not None:
                    codes[int(replica["rank"])] = int(replica["exit_code"])
            if name in self._lost:
                for slot in self.spec.slots:
                    if slot.node == name:
                        codes.setdefault(slot.rank, UNREACHABLE_EXIT_CODE)
        return codes

    def poll(self) -> int | None:
        """As :meth:`SshReplicaGroup.poll`: the first failure in the order the ranks ended,
        else 0 when all succeeded, else 75."""
        if self.ended is None:
            return None
        codes = self.exit_codes()
        order = [int(rank) for r in self.records.values() for rank in r.get("exits", ())]
        for rank in [*order, *sorted(codes)]:
            if codes.get(rank, 0) not in (0, ExitCode.RESCALE):
                return codes[rank]
        return 0 if set(codes.values()) <= {0} else ExitCode.RESCALE

    async def _refresh(self) -> None:
        """Read again the records of the nodes whose replicas had not all ended.  A node
        unanswering for :data:`RECORD_LOST_S`, or whose record is gone or replaced, ends its
        part: its ranks without an exit code count as lost (255)."""
        for name in list(self.records):
            if self.records[name].get("state") == "ended":
                continue
            record = await self._launcher.read_record(name, self.spec.job_id)
            if record is not None and record.get("token") == self.records[name].get("token"):
                self.records[name] = record
                self._lost.pop(name, None)
                continue
            since = self._lost.setdefault(name, time.monotonic())
            if time.monotonic() - since > RECORD_LOST_S:
                self.records[name] = {**self.records[name], "state": "ended"}
                self.failure_reason = f"node {name}: the job's exit record could not be read"
        self._note_end()

    async def wait(self) -> int:
        while self.ended is None:
            await self._refresh()
            if self.ended is None:
                await asyncio.sleep(RECORD_POLL_S)
        code = self.poll()
        assert code is not None
        return code

    async def _signal(self, sig: str) -> None:
        for name, record in self.records.items():
            pids = [
                int(r["pid"])
                for r in record.get("replicas", ())
                if r.get("exit_code") is None and int(r.get("pid") or 0) > 1
            ]
            if pids and record.get("state") != "ended":
                groups = " ".join(f"-{pid}" for pid in pids)
                await self._launcher.run(name, f"kill -{sig} -- {groups} 2>/dev/null; true")

    async def stop(self, grace_s: float) -> int | None:
        """SIGTERM every replica still running (its process group), SIGKILL after
        ``grace_s``; the exit as :meth:`wait` reads it."""
        await self._signal("TERM")
        try:
            return await asyncio.wait_for(asyncio.shield(self.wait()), max(grace_s, 0.0))
        except TimeoutError:
            await self._signal("KILL")
        return await self.wait()

    def pids(self) -> Mapping[int, int]:
        return {
            int(r["rank"]): int(r["pid"])
            for record in self.records.values()
            for r in record.get("replicas", ())
            if r.get("pid")
        }

    async def forget(self) -> None:
        await self._launcher.forget_records(self.spec.job_id, list(self.records))


class SshLauncher:
    """Starts replica groups on SSH nodes (implements the ``Launcher`` interface)."""

    def __init__(
        self,
        nodes: Sequence[SshNodeConfig],
        control_dir: Path,
        *,
        alive_interval_s: int = 2,
        alive_count_max: int = 3,
        connect_timeout_s: int = 5,
        control_persist_s: int = 300,
        failure_grace_s: float = 5.0,
        orphan_grace_s: float = 10.0,
        max_log_bytes: int | None = None,
        log_keep_free: int = 0,
    ) -> None:
        self.nodes = {node.name: node for node in nodes}
        #: the size at which a rank's local log is cut (``[limits] max_log_size``)
        self.max_log_bytes = max_log_bytes
        #: the free room a rank's local log leaves on its disk (``[limits] log_keep_free``)
        self.log_keep_free = log_keep_free
        if len(self.nodes) != len(nodes):
            raise PolluxError("node names must be unique")
        self.control_dir = Path(control_dir)
        self.alive_interval_s = alive_interval_s
        self.alive_count_max = alive_count_max
        self.connect_timeout_s = connect_timeout_s
        self.control_persist_s = control_persist_s
        self.failure_grace_s = failure_grace_s
        self.orphan_grace_s = orphan_grace_s
        # Unix socket paths are limited to 107 bytes; %C is a 40-character hash.
        if len(str(self.control_dir)) + 42 > 104:
            raise PolluxError(
                f"ssh control dir {self.control_dir} is too long for a socket path; "
                "use a shorter state dir"
            )
        self._masters: dict[str, asyncio.Lock] = {}
        #: names this daemon's exit records on the nodes (its state, by its control dir)
        self.record_key = hashlib.sha1(str(self.control_dir).encode()).hexdigest()[:12]

    def record_path(self, node: SshNodeConfig, job_id: str) -> str:
        """Where ``node``'s supervisor keeps the exit record of ``job_id`` (``~`` unexpanded)."""
        return f"{node.workdir.rstrip('/')}/run/{self.record_key}/{job_id}.json"

    async def _record_command(self, name: str, action: str, job_id: str) -> tuple[int, str]:
        node = self._node(name)
        command = " ".join(
            shlex.quote(part)
            for part in (node.python, "-c", _RECORD_SCRIPT, action, self.record_path(node, job_id))
        )
        rc, out, _ = await self.run(name, command, timeout_s=self.connect_timeout_s + 10)
        return rc, out

    async def read_record(self, name: str, job_id: str) -> dict[str, Any] | None:
        """The exit record of ``job_id`` on node ``name``; ``None`` when there is none, it
        cannot be read or the node does not answer."""
        rc, out = await self._record_command(name, "cat", job_id)
        if rc != 0:
            return None
        try:
            record = json.loads(out)
        except ValueError:
            return None
        return record if isinstance(record, dict) and record.get("version") == 1 else None

    async def forget_records(self, job_id: str, names: Sequence[str]) -> None:
        """Remove the exit records of ``job_id`` from ``names`` (best effort)."""
        for name in names:
            with contextlib.suppress(PolluxError, OSError):
                await self._record_command(name, "rm", job_id)

    async def recover(self, spec: LaunchSpec, token: str) -> SshRecordedGroup | None:
        """The incarnation ``token`` of a job recorded as running when the daemon stopped,
        from the exit records on its nodes: ``None`` when a node has no record of it (then
        nothing is known, and the caller queues the job again)."""
        records: dict[str, dict[str, Any]] = {}
        for name in dict.fromkeys(slot.node for slot in spec.slots):
            record = await self.read_record(name, spec.job_id)
            if record is None or record.get("token") != token:
                return None
            records[name] = record
        return SshRecordedGroup(self, spec, records)

    @property
    def detect_dead_link_s(self) -> int:
        """Upper bound on the time for ssh to notice a cut link (keepalive interval x count)."""
        return self.alive_interval_s * (self.alive_count_max + 1)

    def _node(self, name: str) -> SshNodeConfig:
        try:
            return self.nodes[name]
        except KeyError:
            raise PolluxError(f"unknown node {name!r}") from None

    def ssh_argv(self, node: SshNodeConfig, *, master: bool = False) -> list[str]:
        """The ``ssh`` command prefix for ``node`` (user options last so they take precedence
        over nothing but ours; ``~/.ssh/config`` still applies to everything we leave unset)."""
        argv = [
            "ssh",
            *node.ssh_options,
            "-o", "BatchMode=yes",
            "-o", f"ConnectTimeout={self.connect_timeout_s}",
            "-o", f"ServerAliveInterval={self.alive_interval_s}",
            "-o", f"ServerAliveCountMax={self.alive_count_max}",
            "-o", f"ControlPath={self.control_dir}/%C",
        ]  # fmt: skip
        if master:
            argv += [
                "-o", "ControlMaster=yes",
                "-o", f"ControlPersist={self.control_persist_s}",
                "-N", "-f",
            ]  # fmt: skip
        else:
            argv += ["-o", "ControlMaster=no"]
        return argv + ["-T", "--", node.host]

    async def _ensure_master(self, node: SshNodeConfig) -> None:
        """Start the shared connection to ``node`` unless one is alive.  A failure here is not
        fatal: sessions then log in directly (and report the real error)."""
        self.control_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        lock = self._masters.setdefault(node.name, asyncio.Lock())
        async with lock:
            check = await asyncio.create_subprocess_exec(
                *self.ssh_argv(node)[:-3], "-O", "check", "--", node.host,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.DEVNULL,
                stderr=asyncio.subprocess.DEVNULL,
            )  # fmt: skip
            if await check.wait() == 0:
                return
            master = await asyncio.create_subprocess_exec(
                *self.ssh_argv(node, master=True),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.DEVNULL,
                stderr=asyncio.subprocess.DEVNULL,
            )
            try:
                await asyncio.wait_for(master.wait(), self.connect_timeout_s + 5)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    master.kill()

    async def run(
        self, node_name: str, command: str, timeout_s: float = 20.0, stdin: bytes | None = None
    ) -> tuple[int, str, str]:
        """Run a shell ``command`` on a node; returns (exit code, stdout, stderr)."""
        node = self._node(node_name)
        await self._ensure_master(node)
        proc = await asyncio.create_subprocess_exec(
            *self.ssh_argv(node),
            command,
            stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        try:
            out, err = await asyncio.wait_for(proc.communicate(stdin), timeout_s)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
            return UNREACHABLE_EXIT_CODE, "", f"no answer within {timeout_s:g} s"
        assert proc.returncode is not None
        return proc.returncode, out.decode(errors="replace"), err.decode(errors="replace")

    async def check_node(self, node: str) -> NodeHealth:
        """Reachable?  Which devices (GPUs from ``nvidia-smi -L``, else the configured CPU
        slots) and the 1-minute load average per CPU."""
        config = self._node(node)
        script = (
            "nproc; cat /proc/loadavg; command -v nvidia-smi >/dev/null && nvidia-smi -L || true"
        )
        rc, out, err = await self.run(node, script, timeout_s=self.connect_timeout_s + 10)
        if rc != 0:
            message = (err.strip().splitlines() or [f"ssh exited with {rc}"])[-1]
            return NodeHealth(node=node, reachable=False, error=message)
        lines = out.splitlines()
        try:
            cpus = int(lines[0])
            load = float(lines[1].split()[0]) / max(cpus, 1)
        except (IndexError, ValueError):
            return NodeHealth(node=node, reachable=True, error=f"unexpected answer: {out[:80]!r}")
        gpus = [line for line in lines[2:] if line.startswith("GPU ")]
        devices = [f"cuda:{i}" for i in range(len(gpus))] if gpus else list(config.devices)
        return NodeHealth(node=node, reachable=True, devices=devices, load=round(load, 3))

    async def check_shared_dir(self, node: str, path: Path) -> None:
        """Raise PolluxError unless a probe file written here under ``path`` is visible on
        ``node`` at the same path (checkpoints must be on a filesystem all nodes share)."""
        probe, token = _write_probe(Path(path))
        try:
            rc, out, err = await self.run(node, f"cat {shlex.quote(str(probe))}")
        finally:
            probe.unlink(missing_ok=True)
        if rc == UNREACHABLE_EXIT_CODE:
            raise PolluxError(f"node {node} is unreachable: {err.strip() or 'ssh failed'}")
        if out.strip() != token:
            raise PolluxError(
                f"{path} is not shared with node {node}: put POLLUX_CHECKPOINT_DIR on a "
                "filesystem every node mounts at the same path"
            )

    def _replica_env(
        self, spec: LaunchSpec, slot: ReplicaSlot, node: SshNodeConfig, master: str | None
    ) -> dict[str, str]:
        """Exactly what the local launcher gives a replica, plus MASTER_ADDR (rank 0's node
        when the group spans nodes) and the node's GLOO_SOCKET_IFNAME."""
        env = replica_env(spec, slot)
        if master is not None:
            env["MASTER_ADDR"] = master
        if node.gloo_ifname:
            env["GLOO_SOCKET_IFNAME"] = node.gloo_ifname
        return env

    async def launch(self, spec: LaunchSpec) -> SshReplicaGroup:
        """Start every replica of ``spec`` (all its slots must be on this launcher's nodes)."""
        by_node: dict[str, list[ReplicaSlot]] = {}
        for slot in sorted(spec.slots, key=lambda s: s.rank):
            self._node(slot.node)
            by_node.setdefault(slot.node, []).append(slot)
        if not by_node:
            raise PolluxError(f"job {spec.job_id}: nothing to launch (no replica slots)")
        rank0 = min(spec.slots, key=lambda s: s.rank)
        master = self._node(rank0.node).master_addr if len(by_node) > 1 else None
        spec.log_dir.mkdir(parents=True, exist_ok=True)
        log_files = {slot.rank: spec.log_dir / f"rank{slot.rank}.log" for slot in spec.slots}
        probe: tuple[Path, str] | None = None
        checkpoint_dir = spec.env.get("POLLUX_CHECKPOINT_DIR")
        if checkpoint_dir:
            probe = _write_probe(Path(checkpoint_dir))

        async def start(name: str, slots: list[ReplicaSlot]) -> _NodeSession:
            node = self._node(name)
            await self._ensure_master(node)
            remote_logs = f"{node.workdir.rstrip('/')}/logs/{spec.job_id}"
            payload: dict[str, Any] = {
                "node": name,
                "cwd": str(spec.workdir),
                "node_workdir": node.workdir,
                "cwd_required": True,
                "user": spec.run_as,
                "orphan_grace_s": self.orphan_grace_s,
                "record": {
                    "path": self.record_path(node, spec.job_id),
                    "token": record_token(spec.job_id, spec.env.get("POLLUX_RESTARTS", "0")),
                },
                "replicas": [
                    {
                        "rank": slot.rank,
                        "argv": list(spec.argv),
                        "env": self._replica_env(spec, slot, node, master),
                        "log": f"{remote_logs}/rank{slot.rank}.log",
                        "banner": (
                            f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} start "
                            f"#{spec.env.get('POLLUX_RESTARTS', '0')}: rank {slot.rank}/"
                            f"{len(spec.slots)} on {name} {slot.device}\n"
                        ),
                    }
                    for slot in slots
                ],
            }
            if probe is not None:
                payload["probe"] = {"path": str(probe[0]), "token": probe[1], "dir": checkpoint_dir}
            proc = await asyncio.create_subprocess_exec(
                *self.ssh_argv(node),
                f"{shlex.quote(node.python)} -u -c {shlex.quote(node_agent_source())}",
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.DEVNULL,
                start_new_session=True,
            )
            assert proc.stdin is not None
            proc.stdin.write(json.dumps(payload).encode() + b"\n")
            with contextlib.suppress(ConnectionError):
                await proc.stdin.drain()
            return _NodeSession(node=node, ranks=[s.rank for s in slots], proc=proc)

        sessions = list(await asyncio.gather(*(start(n, s) for n, s in by_node.items())))
        group = SshReplicaGroup(
            spec, sessions, log_files, self.failure_grace_s, self.max_log_bytes,
            self.log_keep_free,
        )  # fmt: skip
        group._launcher = self
        for session in sessions:
            session.reader = asyncio.ensure_future(group._read_session(session))
        group._watcher = asyncio.ensure_future(group._watch())
        if probe is not None:
            asyncio.ensure_future(_remove_probe_later(group, probe[0]))
        return group

    async def close(self) -> None:
        """Close the shared connections this launcher opened."""
        for node in self.nodes.values():
            proc = await asyncio.create_subprocess_exec(
                *self.ssh_argv(node)[:-3], "-O", "exit", "--", node.host,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.DEVNULL,
                stderr=asyncio.subprocess.DEVNULL,
            )  # fmt: skip
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(proc.wait(), 5)


def record_token(job_id: str, restarts: object) -> str:
    """Names one incarnation in its exit records: the job and how often it was started
    before (``POLLUX_RESTARTS``)."""
    return f"{job_id}:{restarts}"


def _write_probe(directory: Path) -> tuple[Path, str]:
    """Write a file with a random token into ``directory``; returns (path, token).

    The directory (the job's checkpoint dir, made beforehand as the job's user) is opened
    without following a symlink in its last component, and the probe created in it with
    ``O_EXCL | O_NOFOLLOW``: a job that swapped its checkpoint dir for a link elsewhere gets a
    one-line error, and the daemon (perhaps root) writes nothing there."""
    token = secrets.token_hex(16)
    name = f".pollux-probe-{token[:12]}"
    try:
        if not os.path.lexists(directory):
            directory.mkdir(parents=True, exist_ok=True)
        dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        raise PolluxError(
            f"cannot write to checkpoint dir {directory}: {exc.strerror}"
            + (" (a symlink?)" if exc.errno in (errno.ELOOP, errno.ENOTDIR) else "")
        ) from None
    try:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(name, flags, 0o644, dir_fd=dir_fd)
        try:
            os.write(fd, token.encode())
        finally:
            os.close(fd)
    except OSError as exc:
        raise PolluxError(f"cannot write to checkpoint dir {directory}: {exc.strerror}") from None
    finally:
        os.close(dir_fd)
    return directory / name, token


async def _remove_probe_later(group: SshReplicaGroup, path: Path) -> None:
    """The probe is read by every supervisor right at start; remove it once all reported."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and group.poll() is None:
        if all(s.remote_pids or s.exit_codes or s.failure for s in group._sessions):
            break
        await asyncio.sleep(0.2)
    path.unlink(missing_ok=True)


def signal_name(code: int) -> str:
    """Human-readable form of a replica exit code (``137`` -> ``SIGKILL``)."""
    if code > 128:
        with contextlib.suppress(ValueError):
            return signal.Signals(code - 128).name
    return str(code)


__all__ = [
    "SETUP_FAILED_EXIT_CODE",
    "UNREACHABLE_EXIT_CODE",
    "SshLauncher",
    "SshNodeConfig",
    "SshReplicaGroup",
    "signal_name",
]
