"""A restarted daemon's view of an incarnation started before it: the nodes' exit records,
read over ssh until every rank has ended (:class:`SshRecordedGroup`)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from pollux_local.api.states import ExitCode
from pollux_local.errors import PolluxError
from pollux_local.launch.base import LaunchSpec
from pollux_local.launch.ssh.nodes import UNREACHABLE_EXIT_CODE, agent_command

if TYPE_CHECKING:
    from pollux_local.launch.ssh.launcher import SshLauncher


#: How often a recovered group's exit records are read again while its replicas run.
RECORD_POLL_S = 1.0
#: How long a recovered group's node may stay unanswering before its ranks count as lost.
RECORD_LOST_S = 60.0
#: The same for a node that has not answered since the daemon restarted (its record never
#: read): the job may have ended there, and queued again it would run a second time; a
#: node that does not answer now (down, or its sshd's slots held by someone) is waited for
#: longer before the job is taken for lost and queued again.
RECORD_UNREAD_S = 600.0


class RecordUnanswered(PolluxError):
    """The node did not answer a read of an exit record (ssh failed or timed out, its
    agent's tool did not run): whether the record is there is not known."""


def unread_record(token: str) -> dict[str, Any]:
    """What stands for a node's exit record not read yet (its node did not answer)."""
    return {"version": 1, "token": token, "state": "running", "replicas": [], "unread": True}


def agent_tool(python: str, *args: str) -> str:
    """The shell command that runs the node agent's tool (``node_agent.tool``: the agent's
    own source, given ``args``) with the node's ``python``: exit records read or removed,
    recorded replicas signalled, each only in a work directory that is root's (or the
    login's) alone."""
    return agent_command(python, *args)


log = logging.getLogger("pollux_local.launch.ssh")


class SshRecordedGroup:
    """An incarnation found on its SSH nodes by a restarted daemon, through the exit records
    their supervisors keep (see :class:`ReplicaGroup`): its end is read from them, polled
    over ssh, and a stop is sent to its replicas' process groups.  ``orphaned``: a
    supervisor stopped replicas itself because the daemon was gone (the job did not end on
    its own)."""

    def __init__(
        self,
        launcher: SshLauncher,
        spec: LaunchSpec,
        records: Mapping[str, Mapping[str, Any]],
        token: str | None = None,
    ) -> None:
        self.spec = spec
        self._launcher = launcher
        self.records = dict(records)
        #: the incarnation the records are of (``spec`` is built for the job's next start, so
        #: its ``POLLUX_RESTARTS`` names the next one); by default the records' own
        self.token = token or next(
            (str(r["token"]) for r in self.records.values() if r.get("token")),
            record_token(spec.job_id, spec.env.get("POLLUX_RESTARTS", "0")),
        )
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

    def lost_nodes(self) -> set[str]:
        """The nodes whose exit record could not be read (a replica's own exit code, 255
        included, is the job's)."""
        return set(self._lost)

    def unanswered_nodes(self) -> set[str]:
        return set()

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

    def unread_nodes(self) -> list[str]:
        """The nodes whose record has not been read yet (they did not answer)."""
        return [name for name, record in self.records.items() if record.get("unread")]

    async def _refresh(self) -> None:
        """Read again the records of the nodes whose replicas had not all ended.  A node
        unanswering for :data:`RECORD_LOST_S` (:data:`RECORD_UNREAD_S` while its record
        was never read), or whose record is gone or replaced, ends its part: its ranks
        without an exit code count as lost (255)."""
        for name in list(self.records):
            known = self.records[name]
            if known.get("state") == "ended":
                continue
            answered = True
            try:
                record = await self._launcher.read_record(name, self.spec.job_id)
            except RecordUnanswered:
                answered, record = False, None
            if record is not None and record.get("token") == known.get("token"):
                self.records[name] = await self._launcher.settle(name, record)
                self._lost.pop(name, None)
                continue
            since = self._lost.setdefault(name, time.monotonic())
            limit = RECORD_UNREAD_S if known.get("unread") else RECORD_LOST_S
            if known.get("unread") and answered:
                limit = 0.0  # it answers that it has none: nothing to wait for there
            if time.monotonic() - since >= limit:
                self.records[name] = {**known, "state": "ended"}
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
        """Signal each replica still running, on its node, as its record names it
        (:meth:`SshLauncher.signal_recorded`: only that user's processes)."""
        for name, record in self.records.items():
            await self._launcher.signal_recorded(name, record, self.spec.run_as, sig)

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
        """Remove the recovered incarnation's exit records from its nodes (only while they
        name it: :attr:`token`, not the next start's)."""
        await self._launcher.forget_records(self.spec.job_id, list(self.records), self.token)


def record_token(job_id: str, restarts: object) -> str:
    """Names one incarnation in its exit records: the job and how often it was started
    before (``POLLUX_RESTARTS``)."""
    return f"{job_id}:{restarts}"
