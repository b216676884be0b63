"""A job incarnation whose replicas run on SSH nodes: one ssh session per node, its ``PID``,
``EXIT`` and ``LOG`` lines read back (:class:`SshReplicaGroup`); it may be resized in place
(``RESIZE``, ``READY``, ``ORDER``, ``ORDERED`` or ``WARMFAIL``, ``LEFT`` for the replicas that
go: ``launch/node_agent.py``)."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import os
import re
import signal
import stat
import time
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from pollux_local.api.resize import ResizeOrder, encode_order
from pollux_local.api.states import ExitCode
from pollux_local.errors import PolluxError
from pollux_local.launch.base import LaunchSpec, ReplicaSlot
from pollux_local.launch.logcap import (
    disk_note,
    floor_of,
    free_bytes,
    resumed_note,
    truncation_note,
)
from pollux_local.launch.node_agent import relabelling
from pollux_local.launch.ssh.nodes import (
    SETUP_FAILED_EXIT_CODE,
    UNREACHABLE_EXIT_CODE,
    SshNodeConfig,
)
from pollux_local.launch.ssh.recovery import record_token

if TYPE_CHECKING:
    from pollux_local.launch.ssh.launcher import SshLauncher


log = logging.getLogger("pollux_local.launch.ssh")

#: Seconds a warm resize waits for its node's answer beyond the joiners' ready timeout.
ORDER_MARGIN_S = 10.0
#: Most output of one joiner kept while its log is still another replica's (bytes).
MAX_HELD_LOG_BYTES = 1 << 20
#: Longest line read from a node's agent (its ``LOG`` lines carry ``node_agent.LOG_CHUNK``
#: bytes, under 48 KiB once encoded): a longer one is skipped, never the session's end.
MAX_LINE_BYTES = 1 << 20


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
    #: the warm resize this session's replicas joined and that is not ordered yet (a node the
    #: group grew onto): until it is, their end is the resize's failure, not the job's
    joining: int | None = None
    #: where each warm resize stands on this node: ``ready``, ``ordered`` or why it failed
    warm: dict[int, str] = field(default_factory=dict)
    #: the ranks that stay at a warm resize that renumbers them (by generation), until the
    #: agent says it renamed its replicas (``RENAMED``)
    renames: dict[int, list[int]] = field(default_factory=dict)
    #: the daemon ended its ssh client itself (no answer to a stop, or its lines unreadable)
    abandoned: bool = False
    #: its agent refused the node (``NODEFAIL``: its work directory): the node is lost.  Only
    #: this says so at once: a replica's own exit code is the job's, whatever its value (a
    #: job exiting 255 is a crash, not a lost node)
    lost: bool = False
    #: its agent refused to start anything for a fault of the node's (``NODEFAIL``)
    node_failed: bool = False
    #: the session ended with ranks that had not said how they ended: its ssh client was
    #: ended here (the daemon got no answer to a stop in time, or a signal), or ssh ended on
    #: its own (exit 255: the link was lost, or the agent or its sshd was killed, by the OOM
    #: killer say).  Whether the node is lost is for a check of the node to say: a job can
    #: keep its agent busy past any grace, or fill the node's memory
    unanswered: bool = False
    #: ssh's exit status when it ended on its own with such ranks (the reason says so)
    dropped: int | None = None


#: The notes of nodes' agents already in the daemon's log: (node, note).
_NOTED: set[tuple[str, str]] = set()


def note_from_node(node: str, note: str) -> None:
    """A node's agent says what its admin should know (``NOTE``: that its jobs run without
    a fence, say): a warning in the daemon's log, once per node and note (the agent's
    stderr reaches no one)."""
    text = "".join(ch if ch.isprintable() else "?" for ch in note[:500])
    # (the same note of each agent names its own group: agent-<token>)
    key = (node, re.sub(r"agent-[0-9a-f]+", "agent-*", text))
    if key in _NOTED:
        return
    if len(_NOTED) < 10_000:
        _NOTED.add(key)
    log.warning("node %s: %s", node, text)


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
        #: (node, rank) -> the local log its replica's output goes to
        self._log_files = {
            (slot.node, slot.rank): log_files[slot.rank]
            for slot in spec.slots
            if slot.rank in log_files
        }
        #: the logs of joiners not started yet, and the output of joiners whose log another
        #: replica still writes (a renumbering resize), kept until the resize is over
        self._joiner_logs: dict[tuple[str, int], Path] = {}
        self._held_logs: dict[tuple[str, int], bytearray] = {}
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
        """Rank ``rank`` on ``session``'s node ended with ``code`` (its own, from its agent's
        ``EXIT``; or the session's, :meth:`_session_ended`)."""
        if rank in session.exit_codes:
            return
        session.exit_codes[rank] = code
        if code not in (0, ExitCode.RESCALE) and self._first_failure is None:
            self._first_failure = (rank, code)
            self.failed_at = time.monotonic()
            if self.failure_reason is None:
                if session.failure:
                    self.failure_reason = session.failure
                elif session.dropped is not None:
                    self.failure_reason = (
                        f"node {session.node.name}'s session ended (ssh exit "
                        f"{session.dropped}) before its replicas said how they ended"
                    )
                elif session.unanswered:
                    self.failure_reason = (
                        f"node {session.node.name} did not answer in time (its replicas' ends "
                        "are not known)"
                    )
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
        """Take ``session``'s lines until its agent's stdout ends, then its ranks' ends.
        Only the end of the session ends it: a line too long or not understood is skipped
        (logged), and should reading fail otherwise, the agent is told to kill its replicas
        and the session is ended and waited for before its ranks count as ended."""
        try:
            await self._read_lines(session)
        except Exception:  # noqa: BLE001 - whatever it was, the replicas must not run on
            log.exception(
                "node %s: reading its agent failed; killing its replicas", session.node.name
            )
            await self._send(session, "KILL")
            await asyncio.sleep(1.0)
            with contextlib.suppress(ProcessLookupError):
                session.proc.kill()
                session.abandoned = True
        rc = await session.proc.wait()
        self._session_ended(session, rc)

    async def _read_lines(self, session: _NodeSession) -> None:
        assert session.proc.stdout is not None
        skipped = 0
        while True:
            try:
                raw = await session.proc.stdout.readline()
            except ValueError:  # over MAX_LINE_BYTES: dropped by the reader, up to its end
                skipped += 1
                log.warning(
                    "node %s: skipped a line over %d bytes from its agent (%d so far)",
                    session.node.name, MAX_LINE_BYTES, skipped,
                )  # fmt: skip
                continue
            if not raw:
                break
            try:
                self._take_line(session, raw)
            except (ValueError, TypeError, KeyError, OSError) as exc:
                log.warning("node %s: a line of its agent not taken: %s", session.node.name, exc)

    def _take_line(self, session: _NodeSession, raw: bytes) -> None:
        """One line of ``session``'s agent (``node_agent.py``)."""
        parts = raw.decode(errors="replace").rstrip("\n").split(" ", 2)
        kind = parts[0]
        try:
            if kind == "PID" and len(parts) == 3:
                session.remote_pids[int(parts[1])] = int(parts[2])
                if int(parts[1]) not in session.ranks:  # a joiner of a warm resize
                    session.ranks.append(int(parts[1]))
                self._joiner_started(session, int(parts[1]))
            elif kind == "LOG" and len(parts) == 3:
                self._append_log(session.node.name, int(parts[1]), base64.b64decode(parts[2]))
            elif kind == "RENAMED" and len(parts) == 2:
                self._rename(session, int(parts[1]))
            elif kind == "EXIT" and len(parts) == 3:
                self._record_exit(session, int(parts[1]), int(parts[2]))
            elif kind == "NOTE":
                note_from_node(session.node.name, " ".join(parts[1:]))
            elif kind in ("FAIL", "NODEFAIL"):
                session.failure = f"node {session.node.name}: " + " ".join(parts[1:])
                # the node cannot start any job (its work directory, say): lost, not the job's
                session.node_failed = kind == "NODEFAIL"
            elif kind in ("READY", "ORDERED") and len(parts) == 2:
                generation = int(parts[1])
                session.warm[generation] = kind.lower()
                if kind == "ORDERED" and session.joining == generation:
                    session.joining = None
            elif kind == "WARMFAIL" and len(parts) == 3:
                session.warm[int(parts[1])] = f"failed: {parts[2]}"
            elif kind == "LEFT" and len(parts) == 3:
                rank = int(parts[1])
                session.remote_pids.pop(rank, None)
                session.ranks = [r for r in session.ranks if r != rank]
                self._log_files.pop((session.node.name, rank), None)  # its output ended
        except ValueError:
            return

    def _session_ended(self, session: _NodeSession, rc: int) -> None:
        """``session``'s ssh ended with ``rc``: its ranks that did not say how they ended
        count as lost (or failed at the setup)."""
        if session.joining is not None:  # joiners that never joined: the resize failed
            why = session.failure or f"node {session.node.name}'s agent ended (ssh exit {rc})"
            session.warm.setdefault(session.joining, f"failed: {why}")
            session.ranks = []
        for rank in session.ranks:
            if rank not in session.exit_codes:
                if session.failure:
                    code = SETUP_FAILED_EXIT_CODE
                    session.lost = session.node_failed
                elif rc < 0 or session.abandoned:
                    # ssh was ended here (the daemon gave up waiting, or a signal): the
                    # replicas were told to stop and may be gone; the node is checked
                    code = 128 + (-rc if rc < 0 else int(signal.SIGKILL))
                    session.unanswered = True
                elif rc == UNREACHABLE_EXIT_CODE or rc == 0:
                    # ssh lost the node, or its agent or sshd ended first: the node is checked
                    code = UNREACHABLE_EXIT_CODE
                    session.unanswered = True
                    session.dropped = rc
                else:
                    code = rc
                self._record_exit(session, rank, code)

    async def _watch(self) -> None:
        """The group is done once every session has ended, those a warm resize added too."""
        while True:
            readers = [s.reader for s in self._sessions if s.reader is not None]
            await asyncio.gather(*readers, return_exceptions=True)
            if all(s.reader is None or s.reader.done() for s in self._sessions):
                break
        self._done.set()

    def _rename(self, session: _NodeSession, generation: int) -> None:
        """``session``'s agent renamed its replicas for the renumbering resize
        ``generation`` (``node_agent.relabelling``): the same renaming here.  Each keeps its
        log until the resize is over (:meth:`_settle_logs`)."""
        ranks = session.renames.pop(generation, None)
        if ranks is None:
            return
        name = session.node.name
        mapping = relabelling([*session.ranks, *session.exit_codes], ranks)
        session.ranks = [mapping.get(r, r) for r in session.ranks]
        session.remote_pids = {mapping.get(r, r): p for r, p in session.remote_pids.items()}
        session.exit_codes = {mapping.get(r, r): c for r, c in session.exit_codes.items()}
        moved = {
            (name, mapping.get(rank, rank)): path
            for (node, rank), path in self._log_files.items()
            if node == name
        }
        self._log_files = {k: v for k, v in self._log_files.items() if k[0] != name} | moved

    def _joiner_started(self, session: _NodeSession, rank: int) -> None:
        """A replica's first line: a joiner's log is the one planned for it, held while
        another replica still writes that file (nothing for the others)."""
        key = (session.node.name, rank)
        path = self._joiner_logs.pop(key, None)
        if path is None:
            return
        if path in self._log_files.values():
            self._held_logs[key] = bytearray()
        self._log_files[key] = path

    def _settle_logs(self, spec: LaunchSpec, generation: int) -> None:
        """A renumbering resize is over (the leavers are gone): every replica's output goes
        on in its new rank's log (``rank<N>.log``, which ``logs`` reads), after one line
        saying where it came from; the joiners' held output follows."""
        for session in self._sessions:
            name = session.node.name
            for rank in session.ranks:
                key = (name, rank)
                target = spec.log_dir / f"rank{rank}.log"
                current = self._log_files.get(key)
                if current is not None and current != target:
                    self._log_files[key] = target
                    note = f"[pollux-local] continued from {current.name} (resize {generation})"
                    self._append_log(name, rank, note.encode() + b"\n")
                held = self._held_logs.pop(key, None)
                if held:
                    self._append_log(name, rank, bytes(held))

    def _append_log(self, node: str, rank: int, data: bytes) -> None:
        """Append the output of ``node``'s replica ``rank`` to its local log, which lies in a
        directory the job's user can write: never following a symlink, never blocking on a
        FIFO, never writing through a hard link or into a file the job's user does not own
        (the daemon may be root).  A log the daemon makes is given to the job's user, as a
        local replica's own log is theirs.  An unsafe log loses the bytes."""
        key = (node, rank)
        held = self._held_logs.get(key)
        if held is not None:
            held += data[: max(0, MAX_HELD_LOG_BYTES - len(held))]
            return
        path = self._log_files.get(key)
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

    async def _send(self, session: _NodeSession, line: str) -> bool:
        """Write ``line`` to ``session``'s agent; whether it went."""
        stdin = session.proc.stdin
        if session.proc.returncode is not None or stdin is None or stdin.is_closing():
            return False
        try:
            stdin.write(line.encode() + b"\n")
            await asyncio.wait_for(stdin.drain(), 2.0)
        except (ConnectionError, TimeoutError, RuntimeError):
            return False
        return True

    def _abandon_sessions(self) -> None:
        """Drop ssh clients that still run (their link is dead or the node hangs)."""
        for session in self._sessions:
            if session.proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    session.proc.kill()
                    session.abandoned = True

    async def _signal_all(self, command: str) -> None:
        for session in self._sessions:
            await self._send(session, command)

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

    def unanswered_nodes(self) -> set[str]:
        """The nodes whose session ended with replicas that had not said how they ended (no
        answer to a stop in time, or ssh's own exit 255): to be checked, not taken as lost."""
        return {session.node.name for session in self._sessions if session.unanswered}

    async def end_unanswered(self, nodes: Collection[str]) -> None:
        """SIGKILL, through the exit record on each of ``nodes`` (those of :meth:`unanswered_
        nodes` that answer a check), the replicas that may still run there: a session that
        ended first may have lost its agent (killed), and nothing else would ever stop them
        on devices given to the next job.  Best effort: a node that does not answer now is
        left to its agent, which stops its replicas once it sees the daemon gone."""
        launcher = self._launcher
        if launcher is None:
            return
        token = record_token(self.spec.job_id, self.spec.env.get("POLLUX_RESTARTS", "0"))

        async def end_on(name: str) -> None:
            try:
                record = await launcher.read_record(name, self.spec.job_id)
                if record is not None and record.get("token") == token:
                    await launcher.signal_recorded(name, record, self.spec.run_as, "KILL")
            except (PolluxError, OSError) as exc:
                log.warning("node %s: the replicas of job %s not ended: %s", name,
                            self.spec.job_id, exc)  # fmt: skip

        names = {s.node.name for s in self._sessions if s.unanswered and s.node.name in nodes}
        await asyncio.gather(*(end_on(name) for name in sorted(names)))

    def lost_nodes(self) -> set[str]:
        """The nodes whose agent refused the node itself (``NODEFAIL``: its work directory)."""
        return {session.node.name for session in self._sessions if session.lost}

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

    # -- warm resizes (launch.base.WarmResizable) --------------------------------------------
    @property
    def warm_capable(self) -> bool:
        """Whether the replicas were started to take warm resize orders."""
        return self.spec.takes_orders and self._launcher is not None and not self._done.is_set()

    def resizes_onto(self, nodes: Collection[str]) -> bool:
        """Whether this group can be resized in place onto ``nodes``: all are its launcher's."""
        return self._launcher is not None and all(n in self._launcher.nodes for n in nodes)

    async def resize_warm(
        self, spec: LaunchSpec, order: ResizeOrder, ready_timeout_s: float
    ) -> str | None:
        """Change the running replicas to ``spec``'s in place (``launch/node_agent.py``).  The
        ranks below ``order.kept`` stay where they are; ``spec``'s ranks from there on are
        started to join, by the agents of their nodes (a node new to the group gets one);
        the other running ones leave.  On one node its agent gives the order once the joiners
        are ready.  On several, each agent says when its joiners are ready and is then told
        to give the order, rank 0's node last (it writes the order its replicas read), so
        that every node knows its leavers before any leaves.  Returns once the order is given
        and the leavers are gone (``None``), or why the resize could not be ordered (one
        line; the running replicas then never saw an order, and joiners were killed)."""
        if not self.warm_capable or self._stopping:
            return "the job's replicas do not take warm resize orders"
        launcher = self._launcher
        assert launcher is not None
        old = self.spec
        kept = order.kept if order.kept is not None else min(len(old.slots), order.world_size)
        ranks = list(order.ranks) if order.ranks is not None else list(range(kept))
        kept = len(ranks)
        master = launcher.master_of(spec)
        if master is not None:
            order = msgspec.structs.replace(order, master_addr=master)
        rank0 = min(old.slots, key=lambda s: s.rank).node
        joiners: dict[str, list[ReplicaSlot]] = {}
        for slot in sorted(spec.slots, key=lambda s: s.rank):
            if slot.rank >= kept:
                joiners.setdefault(slot.node, []).append(slot)
                path = spec.log_dir / f"rank{slot.rank}.log"
                self._joiner_logs[(slot.node, slot.rank)] = path
        generation = order.generation
        what = f"joined at resize {generation}"
        extra = {"POLLUX_RESIZE_JOIN": str(generation)}
        # the sessions with replicas (one whose replicas all left ends, or is about to)
        running = {s.node.name: s for s in self._sessions if s.ranks and s.proc.returncode is None}
        hold = len(running.keys() | joiners.keys()) > 1
        common = {"ready_timeout_s": ready_timeout_s, "job_dir": str(spec.log_dir)}
        involved: list[_NodeSession] = []
        for name, session in running.items():
            if relabelling(session.ranks, ranks):
                session.renames[generation] = ranks
            request = {
                "generation": generation,
                **({"ranks": ranks} if order.ranks is not None else {"kept": kept}),
                "order": encode_order(order).decode() if name == rank0 else None,
                "hold": hold,
                "joiners": [
                    launcher.replica_payload(
                        spec, slot, session.node, master, what, joining=generation, **extra
                    )
                    for slot in joiners.get(name, ())
                ],
                **common,
            }
            if not await self._send(
                session, "RESIZE " + json.dumps(request, separators=(",", ":"))
            ):
                session.warm[generation] = f"failed: node {name} did not take the warm resize"
            involved.append(session)
        if joiners:  # the joiners' devices are the group's from the start of a grow
            self.spec = spec
        new_nodes = [name for name in joiners if name not in running]
        if new_nodes:
            try:
                probe = launcher.checkpoint_probe(spec)
            except PolluxError as exc:
                return await self._call_off(involved, generation, old, str(exc))
            join = {"generation": generation, **common}
            try:
                started = await asyncio.gather(
                    *(
                        launcher.start_session(
                            spec, name, joiners[name], master, what, probe, join, **extra
                        )
                        for name in new_nodes
                    )
                )
            finally:
                if probe is not None:
                    asyncio.get_running_loop().call_later(ready_timeout_s, probe[0].unlink, True)
            for session in started:
                self._sessions.append(session)
                session.reader = asyncio.ensure_future(self._read_session(session))
                involved.append(session)
        deadline = time.monotonic() + ready_timeout_s + ORDER_MARGIN_S
        wanted = "ready" if hold else "ordered"
        error = await self._answers(involved, generation, wanted, deadline)
        if error is None and hold:
            first = [s for s in involved if s.node.name != rank0]
            last = [s for s in involved if s.node.name == rank0]
            for batch in (first, last):
                for session in batch:
                    await self._send(session, f"ORDER {generation}")
                error = await self._answers(batch, generation, "ordered", deadline)
                if error is not None:
                    break
        if error is not None:
            return await self._call_off(involved, generation, old, error)
        while not self._done.is_set() and time.monotonic() < deadline:
            if all(  # the leavers are gone, every node holds its ranks of ``spec``
                sorted(session.ranks)
                == sorted(s.rank for s in spec.slots if s.node == session.node.name)
                for session in involved
            ):
                self.spec = spec
                self._settle_logs(spec, generation)
                return None
            await asyncio.sleep(0.02)
        return (
            "the job ended during its warm resize"
            if self._done.is_set()
            else "the leaving replicas did not exit after the warm resize order"
        )

    async def _answers(
        self, sessions: list[_NodeSession], generation: int, wanted: str, deadline: float
    ) -> str | None:
        """Wait until each of ``sessions`` says ``wanted`` (or is past it) for ``generation``:
        ``None``, or the first failure, or why none came in time."""
        passed = {"ready": ("ready", "ordered"), "ordered": ("ordered",)}[wanted]
        while True:
            for session in sessions:
                state = session.warm.get(generation, "")
                if state.startswith("failed: "):
                    return state.removeprefix("failed: ")
            if all(session.warm.get(generation) in passed for session in sessions):
                return None
            if self._done.is_set():
                return "the job ended during its warm resize"
            if time.monotonic() > deadline:
                late = next(s for s in sessions if s.warm.get(generation) not in passed)
                return f"node {late.node.name} did not answer the warm resize in time"
            await asyncio.sleep(0.02)

    async def _call_off(
        self, sessions: list[_NodeSession], generation: int, old: LaunchSpec, why: str
    ) -> str:
        """The resize failed before its order: every node told (their joiners are killed);
        the group is ``old`` again.  Returns ``why``."""
        for session in sessions:
            await self._send(session, f"ABORT {generation}")
        self.spec = old
        return why

    def nodes(self) -> list[str]:
        return list(dict.fromkeys(s.node.name for s in self._sessions))

    async def forget(self) -> None:
        """Remove the exit records of this incarnation from its nodes (its end is in the
        daemon's store now)."""
        if self._launcher is not None:
            token = record_token(self.spec.job_id, self.spec.env.get("POLLUX_RESTARTS", "0"))
            await self._launcher.forget_records(self.spec.job_id, self.nodes(), token)
