"""The SSH launcher: starts an incarnation's replicas on their nodes (shared connections,
a checkpoint directory every node sees) and recovers those a previous daemon started."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hashlib
import json
import logging
import os
import re
import secrets
import shlex
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pollux_local.errors import PolluxError
from pollux_local.launch.base import (
    EXITED,
    LaunchSpec,
    NodeHealth,
    ReplicaSlot,
    incarnation,
    settles,
)
from pollux_local.launch.identity import KEYCTL_NUMBERS
from pollux_local.launch.local import replica_env
from pollux_local.launch.ssh.group import MAX_LINE_BYTES, SshReplicaGroup, _NodeSession
from pollux_local.launch.ssh.nodes import (
    UNREACHABLE_EXIT_CODE,
    SshNodeConfig,
    agent_command,
)
from pollux_local.launch.ssh.recovery import (
    RecordUnanswered,
    SshRecordedGroup,
    agent_tool,
    record_token,
    unread_record,
)

log = logging.getLogger("pollux_local.launch.ssh")


def _path_word(name: str) -> str:
    """``name`` as one word of a file name: itself when it is letters, digits and ``_.-`` (not
    starting with a dot), else those kept, the rest as ``_``, and eight hex digits of the name
    (so that two names never share a word)."""
    if re.fullmatch(r"[A-Za-z0-9_-][A-Za-z0-9_.-]*", name):
        return name
    kept = re.sub(r"[^A-Za-z0-9_.-]", "_", name).lstrip(".")
    return f"{kept}-{hashlib.sha1(name.encode()).hexdigest()[:8]}"


#: The line between a node check's facts and its agent's word on its work directory.
_WORKDIR_MARK = "--- workdir"
#: How long an earlier start's agent and replicas, SIGKILLed, are waited for before a launch
#: goes on (:meth:`SshLauncher.end_earlier_start`).
EARLIER_KILL_WAIT_S = 10.0


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
        """Where ``node``'s supervisor keeps the exit record of ``job_id`` (``~`` unexpanded):
        ``WORKDIR/run/KEY/JOB@NODE.json``, one per node, since nodes may share their work
        directory (a home on NFS)."""
        return f"{self._record_dir(node)}/{job_id}@{_path_word(node.name)}.json"

    def _record_dir(self, node: SshNodeConfig) -> str:
        return f"{node.workdir.rstrip('/')}/{self._record_subdir()}"

    def _record_subdir(self) -> str:
        return f"run/{self.record_key}"

    async def _record_command(
        self, name: str, action: str, relpath: str, *more: str
    ) -> tuple[int, str]:
        """``record ACTION WORKDIR RELPATH [MORE]`` of the agent's tool on node ``name``
        (``node_agent.tool``: it refuses a work directory others could write to, and reads
        no more than ``MAX_RECORD_BYTES``)."""
        node = self._node(name)
        command = agent_tool(node.python, "record", action, node.workdir, relpath, *more)
        rc, out, err = await self.run(name, command, timeout_s=self.connect_timeout_s + 10)
        if rc == 2:
            log.warning("node %s: exit record not read: %s", name, err.strip()[-300:])
        return rc, out

    def _record_paths(self, name: str, job_id: str) -> list[str]:
        """The record's path below the node's work directory, then the one of versions
        before records were per node (``JOB.json``: incarnations started before an upgrade
        still write there)."""
        node = self._node(name)
        subdir = self._record_subdir()
        return [f"{subdir}/{job_id}@{_path_word(node.name)}.json", f"{subdir}/{job_id}.json"]

    async def read_record(self, name: str, job_id: str) -> dict[str, Any] | None:
        """The exit record of ``job_id`` on node ``name``; ``None`` when the node says there
        is none (its agent's tool: exit 3), refuses to read it (a work directory others may
        write to: exit 2), or it is another node's or no record.  A node that does not
        answer (ssh failed or timed out, the tool did not run) raises
        :class:`RecordUnanswered`: that the record is not there is not known then (review
        s61: a restarted daemon took a node whose sshd was flooded for one without a
        record, and ran a job that had finished there a second time)."""
        for path in self._record_paths(name, job_id):
            try:
                rc, out = await self._record_command(name, "cat", path)
            except OSError as exc:  # ssh could not even be started (no file descriptors)
                raise RecordUnanswered(
                    f"node {name}: job {job_id}'s exit record not read: {exc.strerror or exc}"
                ) from None
            if rc == 0:
                break
            if rc not in (2, 3):
                raise RecordUnanswered(
                    f"node {name} did not answer a read of job {job_id}'s exit record (exit {rc})"
                )
        else:
            return None
        try:
            record = json.loads(out)
        except ValueError:
            return None
        if not isinstance(record, dict) or record.get("version") != 1:
            return None
        return record if record.get("node", name) == name else None

    async def forget_records(self, job_id: str, names: Sequence[str], token: str) -> None:
        """Remove the exit records of incarnation ``token`` of ``job_id`` from ``names``
        (best effort): a record of a later incarnation, started there since, stays
        (``node_agent.remove_record_of``)."""
        for name in names:
            for path in self._record_paths(name, job_id):
                with contextlib.suppress(PolluxError, OSError):
                    await self._record_command(name, "rm", path, token)

    async def signal_recorded(
        self, name: str, record: Mapping[str, Any], run_as: str | None, sig: str
    ) -> None:
        """Signal the process group of each replica ``record`` (an exit record on node
        ``name``) names as still running, while it is the process the record names (its pid
        and start time; a record of an agent that kept no start times names no process it
        can be told apart from a later one: none) and a process of ``run_as`` (or any user,
        for a job of the daemon's own user) (``node_agent.signal_replicas``), and only while
        the node's work directory, where the record lies, is root's alone.  Best effort."""
        pairs = [
            f"{int(r['pid'])}:{int(r['start_time'])}"
            for r in record.get("replicas", ())
            if r.get("exit_code") is None
            and int(r.get("pid") or 0) > 1
            and r.get("start_time") is not None
        ]
        if pairs and record.get("state") != "ended":
            node = self._node(name)
            command = agent_tool(node.python, "signal", sig, node.workdir, run_as or "-", *pairs)
            await self.run(name, f"{command} 2>/dev/null; true")

    async def _still_running(self, name: str, record: Mapping[str, Any]) -> bool:
        """Whether a process ``record`` names on node ``name`` still runs: its agent (which
        writes the record once more as it ends) or a replica not ended, each told apart from
        a later process by its start time.  A record without the agent's start time (an
        agent of an earlier version) counts its agent as running."""
        if record.get("agent_pid") and record.get("agent_start") is None:
            return True
        pairs = [
            f"{int(r['pid'])}:{int(r['start_time'])}"
            for r in record.get("replicas", ())
            if r.get("exit_code") is None and r.get("start_time") is not None
        ]
        if record.get("agent_pid"):
            pairs.append(f"{int(record['agent_pid'])}:{int(record['agent_start'])}")
        if not pairs:
            return False
        node = self._node(name)
        command = agent_tool(node.python, "signal", "0", node.workdir, "-", *pairs)
        rc, out, _ = await self.run(name, command, timeout_s=self.connect_timeout_s + 10)
        return rc != 0 or bool(out.split())  # (no answer: not known to be gone)

    async def settle(self, name: str, record: dict[str, Any]) -> dict[str, Any]:
        """``record`` (node ``name``'s exit record of an incarnation); but one written once
        every replica had ended (``"exited"``) by an agent that is gone (it died during its
        clean-up: a power cut, a kill) is the incarnation's result (:func:`settles`, the rule
        every launcher's recovery shares): what is left of it is ended (the node's stale
        agent fences, as a node check ends them) and it is taken as ``"ended"``.  Without
        it, a restarted daemon waited for ever on a job that had finished there."""
        if record.get("state") != EXITED:
            return record
        try:
            alive = await self._still_running(name, record)
        except (PolluxError, OSError) as exc:  # (read again at the next refresh)
            log.warning("node %s: %s", name, exc)
            return record
        if not settles(record.get("state"), False, alive):
            return record
        token, node = record.get("token"), self._node(name)
        command = agent_tool(node.python, "workdir", node.workdir)
        rc, _, err = await self.run(name, command, timeout_s=self.connect_timeout_s + 10)
        if rc != 0:  # what the job left is not known to be ended: not yet its result
            log.warning("node %s: what a gone agent left not ended: %s", name, err.strip()[-300:])
            return record
        log.info("node %s: %s's agent died in its clean-up: its record settled", name, token)
        return {**record, "state": "ended", "ended": record.get("ended") or time.time()}

    async def end_earlier_start(self, name: str, spec: LaunchSpec) -> None:
        """End what an earlier start of ``spec``'s job left running on node ``name`` (its
        exit record there is not ``ended``), and wait for its agent's last write: a start a
        killed daemon never recorded (the job queued again with the same incarnation, the
        same record path and token), or an incarnation given up while its node's agent ran
        on.  Else it ran beside this one, on the same devices, for up to
        ``orphan_grace_s``, and its agent's last write ("ended") replaced this one's record,
        so that a restarted daemon read the running job as ended (review s74).  Its
        replicas get SIGTERM, SIGKILL after ``orphan_grace_s``
        (:meth:`signal_recorded`: only the processes the record names); waited for
        :data:`EARLIER_KILL_WAIT_S` more at most."""
        try:
            record = await self.read_record(name, spec.job_id)
        except RecordUnanswered as exc:  # (the start there fails alike)
            log.warning("%s", exc)
            return
        if record is None or record.get("state") == "ended":
            return
        log.warning(
            "node %s: job %s's earlier start (%s) still runs there: ending it first",
            name, spec.job_id, record.get("token"),
        )  # fmt: skip
        await self.signal_recorded(name, record, spec.run_as, "TERM")
        now = time.monotonic()
        kill_at, deadline = now + self.orphan_grace_s, now + self.orphan_grace_s
        deadline += EARLIER_KILL_WAIT_S
        killed = False
        while time.monotonic() < deadline:
            await asyncio.sleep(0.5)
            with contextlib.suppress(RecordUnanswered):
                record = await self.read_record(name, spec.job_id) or {"state": "ended"}
            if record.get("state") == "ended" or not await self._still_running(name, record):
                return
            if not killed and time.monotonic() >= kill_at:
                await self.signal_recorded(name, record, spec.run_as, "KILL")
                killed = True
        log.warning("node %s: job %s's earlier start did not end", name, spec.job_id)

    async def recover(self, spec: LaunchSpec, token: str) -> SshRecordedGroup | None:
        """The incarnation ``token`` of a job recorded as running when the daemon stopped,
        from the exit records on its nodes: ``None`` when a node says it has no record of it
        (then nothing is known, and the caller queues the job again).  A node that does not
        answer keeps its part unknown, read again until it answers
        (:data:`~pollux_local.launch.ssh.recovery.RECORD_UNREAD_S` at most): the job may have
        ended there."""
        records: dict[str, dict[str, Any]] = {}
        for name in dict.fromkeys(slot.node for slot in spec.slots):
            try:
                record: dict[str, Any] | None = await self.read_record(name, spec.job_id)
            except RecordUnanswered as exc:
                log.warning("%s; waiting for it", exc)
                record = unread_record(token)
            if record is None or record.get("token") != token:
                return None
            records[name] = await self.settle(name, record)
        return SshRecordedGroup(self, spec, records, token)

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
        slots) and the 1-minute load average per CPU.  A node whose work directory its agent
        would refuse (``node_agent.workdir_problem``) is not usable: unreachable, with why."""
        config = self._node(node)
        script = (
            "nproc; cat /proc/loadavg; command -v nvidia-smi >/dev/null && nvidia-smi -L || true;"
            f" echo {_WORKDIR_MARK}; "
            + agent_command(config.python, "workdir", config.workdir)
            + " || true"
        )
        rc, out, err = await self.run(node, script, timeout_s=self.connect_timeout_s + 10)
        if rc != 0:
            message = (err.strip().splitlines() or [f"ssh exited with {rc}"])[-1]
            return NodeHealth(node=node, reachable=False, error=message)
        out, _, workdir = out.partition(f"\n{_WORKDIR_MARK}\n")
        answer = (workdir.strip().splitlines() or ["no answer from the node agent"])[-1]
        if answer != "ok":
            return NodeHealth(node=node, reachable=False, error=answer)
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

    def replica_payload(
        self,
        spec: LaunchSpec,
        slot: ReplicaSlot,
        node: SshNodeConfig,
        master: str | None,
        what: str,
        *,
        joining: int | None = None,
        **extra: str,
    ) -> dict[str, Any]:
        """One replica as the node agent starts it: its command, environment (``extra``
        added), log on the node and the banner its log gets first (``what``: why it starts).

        The log on the node is ``rank<N>.start<I>.log`` for incarnation I
        (``POLLUX_RESTARTS``), or ``rank<N>.start<I>.join<G>.log`` for a replica joining at
        warm resize ``joining`` = G.  Nodes often share their work directory (a home on NFS),
        and two replicas of one rank may run at once: after a resize that renumbers the
        ranks a joiner may take the rank of a replica that still runs, and after a node's
        link is cut its replicas run on until its sshd notices, while the next incarnation
        starts elsewhere.  So every replica writes a file of its own, and no node's agent
        streams another replica's output as its own."""
        remote_logs = f"{node.workdir.rstrip('/')}/logs/{self.record_key}/{spec.job_id}"
        name = f"rank{slot.rank}.start{incarnation(spec)}"
        if joining is not None:
            name += f".join{joining}"
        replica: dict[str, Any] = {
            "rank": slot.rank,
            "argv": list(spec.argv),
            "env": {**self._replica_env(spec, slot, node, master), **extra},
            "log": f"{remote_logs}/{name}.log",
            "banner": (
                f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} {what}: rank {slot.rank}/"
                f"{len(spec.slots)} on {node.name} {slot.device}\n"
            ),
        }
        if spec.umask is not None:  # the submitter's, applied by the agent before exec
            replica["umask"] = int(spec.umask)
        return replica

    async def start_session(
        self,
        spec: LaunchSpec,
        name: str,
        slots: Sequence[ReplicaSlot],
        master: str | None,
        what: str,
        probe: tuple[Path, str] | None,
        join: Mapping[str, Any] | None = None,
        **extra: str,
    ) -> _NodeSession:
        """Start node ``name``'s agent with ``slots``' replicas (``what``: their banner; with
        ``join``, joiners of a held warm resize: ``node_agent.py``)."""
        node = self._node(name)
        await self._ensure_master(node)
        joining = int(join["generation"]) if join is not None else None
        payload: dict[str, Any] = {
            "node": name,
            "cwd": str(spec.workdir),
            "node_workdir": node.workdir,
            "cwd_required": True,
            "user": spec.run_as,
            "user_uid": spec.run_as_uid,  # (the name's uid there must be the same)
            # keyctl(2)'s number per machine: a replica of another user leaves the agent's
            # session keyring, which other users' jobs share (``identity.py``)
            "keyctl_numbers": KEYCTL_NUMBERS,
            "orphan_grace_s": self.orphan_grace_s,
            # what of a replica's log is sent at most (the daemon keeps no more of it)
            "max_log_bytes": self.max_log_bytes,
            "record": {
                "path": self.record_path(node, spec.job_id),
                "token": record_token(spec.job_id, spec.env.get("POLLUX_RESTARTS", "0")),
            },
            "replicas": [
                self.replica_payload(spec, slot, node, master, what, joining=joining, **extra)
                for slot in slots
            ],
        }
        if spec.takes_orders:
            payload["resize"] = True  # the agent makes the order file (node_agent.py)
        if join is not None:
            payload["join"] = dict(join)
        if probe is not None:
            payload["probe"] = {
                "path": str(probe[0]),
                "token": probe[1],
                "dir": spec.env.get("POLLUX_CHECKPOINT_DIR"),
            }
        proc = await asyncio.create_subprocess_exec(
            *self.ssh_argv(node),
            agent_command(node.python, unbuffered=True),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.DEVNULL,
            start_new_session=True,
            limit=MAX_LINE_BYTES,  # the agent's lines are far shorter (node_agent.LOG_CHUNK)
        )
        assert proc.stdin is not None
        proc.stdin.write(json.dumps(payload).encode() + b"\n")
        with contextlib.suppress(ConnectionError):
            await proc.stdin.drain()
        joining = int(join["generation"]) if join is not None else None
        return _NodeSession(node=node, ranks=[s.rank for s in slots], proc=proc, joining=joining)

    def checkpoint_probe(self, spec: LaunchSpec) -> tuple[Path, str] | None:
        """A probe file in ``spec``'s checkpoint dir, which each node's agent must see before
        it starts anything (``None``: the job has no checkpoint dir)."""
        checkpoint_dir = spec.env.get("POLLUX_CHECKPOINT_DIR")
        return _write_probe(Path(checkpoint_dir)) if checkpoint_dir else None

    def master_of(self, spec: LaunchSpec) -> str | None:
        """The address of rank 0's node when ``spec`` spans several nodes (``None``: one node,
        where the replicas meet at 127.0.0.1)."""
        if len({slot.node for slot in spec.slots}) < 2:
            return None
        rank0 = min(spec.slots, key=lambda s: s.rank)
        return self._node(rank0.node).master_addr

    async def launch(self, spec: LaunchSpec) -> SshReplicaGroup:
        """Start every replica of ``spec`` (all its slots must be on this launcher's nodes)."""
        by_node: dict[str, list[ReplicaSlot]] = {}
        for slot in sorted(spec.slots, key=lambda s: s.rank):
            self._node(slot.node)
            by_node.setdefault(slot.node, []).append(slot)
        if not by_node:
            raise PolluxError(f"job {spec.job_id}: nothing to launch (no replica slots)")
        master = self.master_of(spec)
        spec.log_dir.mkdir(parents=True, exist_ok=True)
        log_files = {slot.rank: spec.log_dir / f"rank{slot.rank}.log" for slot in spec.slots}
        probe = self.checkpoint_probe(spec)

        # never beside an earlier start still running there, nor its record replacing ours
        await asyncio.gather(*(self.end_earlier_start(name, spec) for name in by_node))
        what = f"start #{spec.env.get('POLLUX_RESTARTS', '0')}"
        sessions = list(
            await asyncio.gather(
                *(self.start_session(spec, n, s, master, what, probe) for n, s in by_node.items())
            )
        )
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
        """Close the shared connections this launcher opened, then remove their directory
        if nothing is left in it (a daemon's ``/run/pollux-ssh-*`` does not outlive it)."""
        for node in self.nodes.values():
            proc = await asyncio.create_subprocess_exec(
                *self.ssh_argv(node)[:-3], "-O", "exit", "--", node.host,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.DEVNULL,
                stderr=asyncio.subprocess.DEVNULL,
            )  # fmt: skip
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(proc.wait(), 5)
        with contextlib.suppress(OSError):  # not empty (a master still closing), or gone
            os.rmdir(self.control_dir)


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
