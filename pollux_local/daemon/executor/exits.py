"""Exit classification: what a group's end means for its job, by what its stop was for
(:class:`api.states.StopIntent`) or, when nothing stopped it, by its exit code (success, a
lost node, a crash retried with back-off or failed at once when no retry can help)."""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pollux_local.api.exits import ReplicaExit, split_status
from pollux_local.api.spec import JobSpec
from pollux_local.api.states import PLACED_STATES, DecisionKind, ExitCode, JobState, StopIntent
from pollux_local.daemon.config import DaemonConfig
from pollux_local.daemon.executor.accounting import Accounting
from pollux_local.daemon.executor.base import allocation_devices, log
from pollux_local.daemon.failures import permanent_cause
from pollux_local.daemon.jobfiles import read_job_file
from pollux_local.daemon.state import DecisionEntry, JobRecord
from pollux_local.launch.base import (
    ReplicaGroup,
    ReplicaSlot,
)
from pollux_local.launch.local import LocalReplicaGroup
from pollux_local.launch.ssh.group import SshReplicaGroup

#: How often a group with remote replicas is looked at for ranks whose node was lost.
LOST_NODE_POLL_S = 0.5
#: Why an exit 75 that no resize asked for is not a rescale.
UNASKED_RESCALE = (
    f"exited {ExitCode.RESCALE:d} (the rescale code) but no rescale was asked; counted as a crash"
)


#: The stops after which an exit 0 means the job finished its work (a cancel and a time
#: limit have already given it its end).  A reconcile (replicas of a start the store did not
#: record) too, for a job whose stop is a checkpoint (elastic or preemptible: exit 75); a
#: rigid script's 0 after SIGTERM may be its graceful stop (``Exits._on_stopped``).
FINISHED_IF_OK = frozenset(
    {StopIntent.HOLD, StopIntent.PREEMPT, StopIntent.RESIZE, StopIntent.SHUTDOWN}
)
#: The most crash restarts a user may ask of a job (``--retries``) when the admin's
#: ``[daemon] max_retries`` is lower (:func:`most_retries`).
USER_RETRIES = 10


def most_retries(config: DaemonConfig) -> int:
    """The most crash restarts a job may have: the larger of ``[daemon] max_retries`` and
    :data:`USER_RETRIES`.  A user may ask for up to 10 whatever the admin's default (each
    restart waits twice as long as the one before, so 10 cost little), and an admin who wants
    more raises ``max_retries``, which raises the cap with it."""
    return max(config.max_retries, USER_RETRIES)


def retries_allowed(spec: JobSpec, config: DaemonConfig) -> int:
    """How many crash restarts ``spec`` gets: its own ``retries`` (``--retries``) if given,
    else none for a rigid job (a plain script is run once unless asked) and ``[daemon]
    max_retries`` for an elastic one (it resumes from its checkpoint); never more than
    :func:`most_retries` under the config in force now."""
    if spec.retries is not None:
        return min(spec.retries, most_retries(config))
    return config.max_retries if spec.elastic else 0


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


def exit_columns(
    slots: Sequence[ReplicaSlot], codes: Mapping[int, int], code: int
) -> dict[str, Any]:
    """An incarnation's exit as its job's columns (``api.exits``): the group's ``code`` (a
    launcher's raw status: -N for signal N), and each rank's from ``codes`` (every rank of
    ``slots``; one whose end is unknown has neither code nor signal)."""
    replicas = []
    for slot in sorted(slots, key=lambda s: s.rank):
        rank_code, rank_signal = split_status(codes.get(slot.rank))
        replicas.append(ReplicaExit(rank=slot.rank, node=slot.node, code=rank_code,
                                    signal=rank_signal))  # fmt: skip
    job_code, job_signal = split_status(code)
    return {"exit_code": job_code, "exit_signal": job_signal, "replica_exits": replicas}


def finished_by_ok(job: JobRecord) -> bool:
    """Whether an exit 0 of ``job``'s incarnation, after a stop for a hold, a preemption, a
    resize or a shutdown (:data:`FINISHED_IF_OK`), means it finished its work: queued or
    placed, or held when it may be stopped at all (elastic: its stop is a checkpoint, exit 75;
    or preemptible).  A held rigid script's 0 may be its graceful stop: it stays held.  The one
    rule of a running daemon (:meth:`Exits._on_stopped`) and a restarted one
    (``Recovery._recover_stray``)."""
    return job.state in (JobState.QUEUED, *PLACED_STATES) or (
        job.state == JobState.HELD and (job.spec.elastic or job.spec.preemptible)
    )


class Exits(Accounting):
    """Watching groups and moving their jobs on when they end."""

    async def _watch(self, job_id: int, group: ReplicaGroup) -> None:
        remote = any(self.is_remote(slot.node) for slot in group.spec.slots)
        waiting = asyncio.ensure_future(group.wait())
        checked: set[str] = set()
        try:
            while not waiting.done():
                await asyncio.wait({waiting}, timeout=LOST_NODE_POLL_S if remote else None)
                if remote:
                    # A lost node is marked down as soon as its launcher says so, and one
                    # whose session ended unanswered is checked at once: not only once the
                    # surviving replicas have been stopped.
                    self._mark_lost_nodes(group)
                    for name in group.unanswered_nodes() - checked:
                        checked.add(name)
                        self._check_soon(self.config.node(name))
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
        its stop was for (``intent``) or, when nothing stopped it, by its exit code.  Its
        devices stay its own until what may still run on them is settled
        (:meth:`_settle_unanswered`)."""
        await self._settle_unanswered(group)
        if self.groups.get(job_id) is group:
            del self.groups[job_id]
        if self.stopping.get(job_id) is group:
            del self.stopping[job_id]
        intent = self.intent.pop(job_id, None)
        self._stop_tasks.pop(job_id, None)
        self._warm_count.pop(job_id, None)  # an incarnation's warm resizes end with it
        now = self.clock()
        ended = getattr(group, "ended", None)
        self._account(job_id, min(now, ended) if isinstance(ended, float) else now)
        job = self.store.get_job(job_id)
        # the exit goes with the state change it leads to (``_take_exit``), or alone after
        known = getattr(group, "exit_codes", None)
        self._exits[job_id] = exit_columns(group.spec.slots, known() if known else {}, code)
        if job is not None:
            self._read_final_report(job)
            if intent is None and getattr(group, "orphaned", False) and code != ExitCode.OK:
                reason = (
                    "daemon restarted; its nodes stopped the job when the daemon went away;"
                    " resuming from checkpoint"
                )
                self._requeue(job.id, reason, now)
            elif intent is None:
                await self._on_exit(job, group, code, now)
            else:
                await self._on_stopped(job, intent, code, now)
            if left := self._exits.pop(job_id, None):
                self.store.update_job(job_id, **left)
        self._exits.pop(job_id, None)
        newer = self.groups.get(job_id) or self.stopping.get(job_id)
        if newer is not None and newer is not group:
            # a resize's restart, started from this end (``_on_stopped``): its launch
            # replaced this group's files with its own, kept by the job's id as this one's
            # were (a run file here, an exit record per node on SSH nodes, the keeper's
            # record under Slurm), which must stay (review s66: they were removed, and a
            # daemon restarted while it ran stopped it and ran it again).  On an SSH node
            # the new incarnation does not use, this one's record is left (a stale token)
            pass
        elif isinstance(group, LocalReplicaGroup):
            self._local.forget(group.spec.job_id)  # its result is in the store now
        elif callable(forget := getattr(group, "forget", None)):
            task = asyncio.ensure_future(forget())  # the nodes' exit records, likewise
            self._forgetting.add(task)
            task.add_done_callback(self._forgetting.discard)
        await self._launch_waiting()

    def _take_exit(self, job_id: int) -> dict[str, Any]:
        """The exit columns of the group whose end is being handled (none otherwise)."""
        return self._exits.pop(job_id, {})

    def _finished(self, job_id: int, now: float) -> None:
        self.store.transition(
            job_id, JobState.SUCCEEDED, now,
            DecisionEntry(DecisionKind.FINISHED, "all replicas exited 0"),
            end_time=now, reason="finished", **self._take_exit(job_id),
        )  # fmt: skip

    def _requeue(self, job_id: int, reason: str, now: float) -> None:
        self.store.transition(
            job_id, JobState.QUEUED, now, DecisionEntry(DecisionKind.REQUEUED, reason),
            reason=reason, **self._take_exit(job_id),
        )  # fmt: skip

    async def _on_stopped(self, job: JobRecord, intent: StopIntent, code: int, now: float) -> None:
        """The end of a group that was asked to stop.  Cancel, hold and the others set the
        job's state when they asked; a job that exited 0 while being held, preempted, resized
        or stopped for a shutdown has finished, and one whose unrecorded start was stopped
        (a reconcile) when its stop is a checkpoint (a held one too, when it may be stopped at all:
        an elastic job's stop is a checkpoint, exit 75, so its 0 is its end, and released it
        would run its finished work again; a rigid script's 0 after SIGTERM may be its
        graceful stop, so it stays held); a resized job restarts at its new size."""
        action = self._resize.pop(job.id, None) if intent is StopIntent.RESIZE else None
        checkpoints = job.spec.elastic or job.spec.preemptible  # its stop is an exit 75
        if code == ExitCode.OK and (
            intent in FINISHED_IF_OK or (intent is StopIntent.RECONCILE and checkpoints)
        ):
            if finished_by_ok(job):
                self._finished(job.id, now)
            return
        if intent is StopIntent.SHUTDOWN and job.state in PLACED_STATES:
            self._requeue(job.id, "daemon stopped; will resume from checkpoint", now)
            return
        if intent is not StopIntent.RESIZE or job.state != JobState.RESCALING:
            return
        if action is None or self._closing:
            self._requeue(job.id, "checkpointed for a resize; back in the queue", now)
            return
        claimed = {
            d for other in self._deferred.values() for d in allocation_devices(other.allocation)
        }
        if not await self._start_when_free(action, claimed):
            current = self.store.get_job(job.id)
            if current is not None and current.state == JobState.RESCALING:
                reason = "resizing: waiting for its new devices to be released"
                self.store.transition(
                    job.id, JobState.QUEUED, now, None, reason=reason, **self._take_exit(job.id)
                )

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
        elif isinstance(group, LocalReplicaGroup) and (over := group.over_memory) is not None:
            what, cause = over, "a retry would be killed again"  # the OOM killer, at --mem
        else:
            down = await self._lost_nodes(group, code)
            if down:
                self._note_node_down(job.id, down, now)
                self.store.transition(job.id, JobState.QUEUED, now, None, **self._take_exit(job.id))
                return
            unanswered = sorted(group.unanswered_nodes())
            if unanswered:
                await self._requeue_unanswered(job, group, unanswered, now)
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

    async def _settle_unanswered(self, group: ReplicaGroup) -> None:
        """The nodes where ``group``'s replicas' ends are not known (ssh's own exit 255: a lost
        link, or a killed agent or sshd; or no answer to a stop) are checked, and on those
        that answer whatever may still run there is killed through its exit record (the
        agent may be gone), before the group's devices go to another job: while this runs
        the group still holds them (``groups``, ``stopping``).  A node that fails its check
        is marked down (:meth:`_lost_nodes` then re-queues the job)."""
        named = (self.config.node(name) for name in sorted(group.unanswered_nodes()))
        nodes = [node for node in named if not node.is_local]
        if not nodes:
            return
        await asyncio.gather(*(self._check_soon(node) for node in nodes))
        up = [node.name for node in nodes if self.nodes.is_up(node.name)]
        if up and isinstance(group, SshReplicaGroup):
            await group.end_unanswered(up)

    async def _requeue_unanswered(
        self, job: JobRecord, group: ReplicaGroup, nodes: list[str], now: float
    ) -> None:
        """The group's sessions to ``nodes`` ended before their replicas said how they ended
        (ssh lost the link for a while, or the node's agent or sshd was killed) and the nodes
        answer a check (:meth:`_settle_unanswered` killed what may have been left there).
        Nothing says the job caused it (a stall of the node ends every session there, other
        users' too), so it is queued again without a failure counted, after ``backoff_s``."""
        why = getattr(group, "failure_reason", None) or "its replicas' ends are not known"
        reason = (
            f"{why}; node(s) {', '.join(nodes)} answer a check: resuming from checkpoint "
            f"in {self.config.backoff_s:g} s (no retry spent)"
        )
        self.store.transition(
            job.id, JobState.QUEUED, now, DecisionEntry(DecisionKind.REQUEUED, reason),
            retry_after=now + self.config.backoff_s, reason=reason, **self._take_exit(job.id),
        )  # fmt: skip

    def _crashed(self, job: JobRecord, what: str, cause: str | None, now: float) -> None:
        """One crash of ``job`` (``what`` happened): failed at once when ``cause`` says a
        retry cannot help or its restarts (:func:`retries_allowed`) are spent, else queued
        again after an exponential back-off, ``backoff_s * 2^(failures - 1)``."""
        failures = job.failures + 1
        allowed = retries_allowed(job.spec, self.config)
        if cause is not None:
            reason = f"{what}: {cause}; not retried"
        elif job.spec.retries is None and not job.spec.elastic:
            reason = (
                f"{what}; not retried (a rigid job runs once unless submitted with --retries N)"
            )
        elif failures > allowed:
            reason = f"{what}; gave up after {failures - 1} restart(s)"
        else:
            delay = self.config.backoff_s * 2 ** (failures - 1)
            reason = f"{what}; retry {failures}/{allowed} in {delay:g} s"
            self.store.transition(
                job.id, JobState.QUEUED, now, DecisionEntry(DecisionKind.CRASHED, reason),
                failures=failures, retry_after=now + delay, reason=reason,
                **self._take_exit(job.id),
            )  # fmt: skip
            return
        self.store.transition(
            job.id, JobState.FAILED, now, DecisionEntry(DecisionKind.FAILED, reason),
            failures=failures, end_time=now, reason=reason, **self._take_exit(job.id),
        )  # fmt: skip
