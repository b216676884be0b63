"""Recovery after a daemon restart: supervisors adopted from their run files (and SSH
nodes' exit records), recorded exits applied, and only a job with nothing recorded queued
again."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sqlite3
import time

import psutil

from pollux_local.api.states import DecisionKind, JobState, StopIntent
from pollux_local.daemon.executor.applying import Applying
from pollux_local.daemon.executor.base import log
from pollux_local.daemon.executor.exits import exit_columns, finished_by_ok
from pollux_local.daemon.scheduler import Action, ActionKind
from pollux_local.daemon.state import DecisionEntry, JobRecord
from pollux_local.launch.base import (
    ReplicaGroup,
)
from pollux_local.launch.local import RunRecord, spec_from_launch

#: The intent of a stop found in flight after a daemon restart, by the job's recorded state.
RECOVERED_INTENT = {
    JobState.QUEUED: StopIntent.PREEMPT,
    JobState.RESCALING: StopIntent.RESIZE,
    JobState.HELD: StopIntent.HOLD,
    JobState.CANCELLED: StopIntent.CANCEL,
}


def _alive(proc: psutil.Process) -> bool:
    try:
        return bool(proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE)
    except psutil.Error:
        return False


class Recovery(Applying):
    """What a restarted daemon adopts."""

    # --- daemon start and stop ----------------------------------------------------------------

    async def recover(self, last_alive: float | None = None) -> list[int]:
        """After a daemon restart, for every job recorded as running: adopt its supervisor if
        it still runs (the job keeps running); apply its recorded exit code if it ended
        meanwhile; queue it again (to resume from its checkpoint) only when nothing is
        recorded.  Supervisors of jobs recorded as not running (a stop in flight when the
        daemon died) are adopted as stopping.  Returns the jobs queued again.

        ``last_alive``: when the daemon before was last known alive (``statedir.last_alive``;
        ``None``: not known).  A job queued again is charged its run time up to then, not up
        to now (:meth:`_requeue_recovered`)."""
        now = self.clock()
        seen = now if last_alive is None else min(now, last_alive)
        records = self._local.records()
        self._take_unrecorded_starts(records, now)
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
                if record is not None and record.supervisor_alive():
                    # its supervisor runs: stopped as a stray (its next start waits for
                    # that), never left running beside it
                    records[job.job_id] = record
            self._requeue_recovered(job, now, seen)
            requeued.append(job.id)
        for job_id, record in records.items():
            try:
                self._recover_stray(job_id, record, now)
            except sqlite3.Error:
                raise
            except Exception:
                log.exception("job %s: recovering its supervisor failed", job_id)
        return requeued

    def _take_unrecorded_starts(self, records: dict[str, RunRecord], now: float) -> None:
        """Jobs recorded as queued (or resizing) whose run file is of the start the daemon
        was making when it died (launched, not yet recorded: its ``incarnation`` is the
        job's ``restarts``): recorded as running now, with the placement the run file names,
        so that they are adopted as any running job (their exit applied whatever its code),
        never stopped as a stray and run again."""
        for job in self.store.jobs([JobState.QUEUED, JobState.RESCALING]):
            record = records.get(job.job_id)
            if record is None or record.launch.get("incarnation") != job.restarts:
                continue
            if not record.finished and not record.supervisor_alive():
                continue  # it ended without a result: nothing to adopt
            try:
                self._take_unrecorded_start(job, record, now)
            except sqlite3.Error:
                raise
            except Exception:  # a run file not as written: left to the strays' handling
                log.exception("job %s: adopting its unrecorded start failed", job.id)

    def _take_unrecorded_start(self, job: JobRecord, record: RunRecord, now: float) -> None:
        """Record ``job`` as running since ``record``'s start, on the devices it names."""
        placement: dict[str, list[str]] = {}
        slots = sorted(spec_from_launch(job.job_id, record.launch).slots, key=lambda s: s.rank)
        for slot in slots:
            placement.setdefault(slot.node, []).append(slot.device)
        reason = (
            f"daemon restarted; its start #{job.restarts} had been made but not recorded: adopted"
        )
        log.warning("job %s: %s", job.id, reason)
        started = min(record.started or now, now)  # its run time counts from there
        self.store.transition(
            job.id, JobState.RUNNING, now, DecisionEntry(DecisionKind.RECOVERED, reason),
            placement=placement, pids=self.pid_records(slots, record.live_pids()), last_start=started,
            start_time=job.start_time or started, restarts=job.restarts + 1,
            batch={"replicas": sum(map(len, placement.values()))}, reason=reason,
        )  # fmt: skip

    async def _recover_job(self, job: JobRecord, record: RunRecord | None, now: float) -> bool:
        """Adopt the job's incarnation from its run file (on SSH nodes: from the exit
        records there); ``False`` when there is nothing to adopt (the caller queues the job
        again), or when its placement names a node the config no longer has and its
        replicas still run (they are stopped; one that ended meanwhile is taken as it
        ended)."""
        if record is None:
            remote = await self._recover_remote(job, now)
            if remote is not None:
                return remote
            # a daemon from before the supervisors ran the replicas as its own children
            await self._stop_orphans(job)
            return False
        gone = [name for name in job.placement if self.known_node(name) is None]
        if gone and not record.finished:
            # not adopted (the executor knows a group by its nodes), but never left running
            # beside its next start: stopped here, as a stop would (SIGTERM, then SIGKILL
            # after stop_grace_s)
            log.warning(
                "job %s: its node(s) %s are no longer in the config: its replicas are stopped"
                " and it is queued again", job.id, ", ".join(gone),
            )  # fmt: skip
            orphan = self._local.adopt(record)
            if orphan is not None and orphan.poll() is None:
                await orphan.stop(self.config.stop_grace_s)
            self._local.forget(job.job_id)
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
        self.store.record_decision(job.id, now, DecisionKind.RECOVERED, reason)
        if job.state == JobState.RESCALING:
            self._adopt_stopping(job.id, group, StopIntent.RESIZE)
        else:
            self.groups[job.id] = group
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

        spec = self.build_spec(job, Action(ActionKind.START, job.id, job.placement, None, ""))
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
            unread: list[str] = getattr(group, "unread_nodes", list)()
            if unread:
                reason = (
                    f"daemon restarted; node(s) {', '.join(unread)} do not answer: waiting for"
                    " the job's exit record there (it may have ended)"
                )
        log.info("job %s: %s", job.id, reason)
        self.store.record_decision(job.id, now, DecisionKind.RECOVERED, reason)
        if job.state == JobState.RESCALING:
            self._adopt_stopping(job.id, group, StopIntent.RESIZE)
        else:
            self.groups[job.id] = group
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
        result not yet taken in (a preempted job that exited 0 has finished, and a held one
        by :func:`~pollux_local.daemon.executor.exits.finished_by_ok`, as for a running
        daemon)."""
        if not name.isdigit():
            return
        job = self.store.get_job(int(name))
        if record.finished or not record.supervisor_alive():
            if not record.finished:
                record.kill_replicas()
            elif job is not None and record.exit_code == 0 and finished_by_ok(job):
                # as a running daemon takes it: a preempted or held (elastic or preemptible)
                # job that exited 0 has finished; left held, a release ran it again
                slots = spec_from_launch(name, record.launch).slots
                self._exits[job.id] = exit_columns(slots, record.exit_codes(), record.exit_code)
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

    def _requeue_recovered(self, job: JobRecord, now: float, seen: float) -> None:
        """Queue again a job recorded as running of which nothing is left to adopt (its
        supervisor gone without a result: a power cut, a kill of all), charged the run time
        from its start to ``seen``, when the daemon before was last known alive: no one saw
        it run longer.  Charged up to now, a daemon down for an hour charged the hour, and a
        job with a time limit that had run for seconds failed at its next start with ``time
        limit reached``."""
        if job.last_start is not None:
            elapsed = max(0.0, seen - job.last_start)
            self.store.update_job(
                job.id,
                attained_gpu_s=job.attained_gpu_s + elapsed * job.replicas,
                run_time_s=job.run_time_s + elapsed,
            )
        reason = "daemon restarted; resuming from checkpoint"
        self.store.transition(
            job.id, JobState.QUEUED, now, DecisionEntry(DecisionKind.RECOVERED, reason),
            placement={}, pids=[], last_start=None, reason=reason,
        )  # fmt: skip

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
        if _alive(procs[0]):  # still that process: its group is still the job's
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(procs[0].pid, signal.SIGKILL)
