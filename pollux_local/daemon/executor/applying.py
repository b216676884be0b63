"""Applying plans: stops sent without waiting, starts on free devices (or as soon as they
are), and the requests that stop a job (cancel, hold, a time limit, a daemon shutdown)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import re
import sqlite3
from collections.abc import Awaitable
from typing import Any

import psutil

from pollux_local.api.states import PLACED_STATES, DecisionKind, JobState, StopIntent
from pollux_local.daemon.config import busy_gpus
from pollux_local.daemon.executor.base import Device, allocation_devices, log
from pollux_local.daemon.executor.launchspec import owner_gone, prepare_dirs
from pollux_local.daemon.executor.warm import InPlace, Warm
from pollux_local.daemon.failures import permanent_cause
from pollux_local.daemon.resizes import resizes_of
from pollux_local.daemon.scheduler import Action, ActionKind, Allocation, Plan
from pollux_local.daemon.state import DecisionEntry, JobRecord
from pollux_local.errors import PolluxError
from pollux_local.launch.base import (
    LaunchSpec,
    NoFreePort,
    ReplicaGroup,
)
from pollux_local.untrusted import one_line

#: At a daemon shutdown, how long past ``stop_grace_s`` the stops are waited for.
SHUTDOWN_MARGIN_S = 15.0


class Applying(Warm):
    """A plan's actions, and stops asked for by requests."""

    # --- applying a plan ---------------------------------------------------------------------

    async def apply(self, plan: Plan) -> None:
        """Send the plan's stops (without waiting for them), then start on the new
        allocations: at once where the devices are free, else as soon as they are.  A job
        whose action fails is failed (or left running) with a one-line reason; the other
        actions go on."""
        now = self.clock()
        self._deferred = {}  # the newest plan decides what waits
        # a job resizing in place is left alone until it is done (the next pass sees it)
        actions = [action for action in plan.actions if action.job_id not in self._warming]
        claimed = [
            (action.job_id, device)
            for action in actions
            if action.kind in (ActionKind.START, ActionKind.RESIZE)
            for device in allocation_devices(action.allocation)
        ]
        warm: list[InPlace] = []
        for action in actions:
            others = {device for job_id, device in claimed if job_id != action.job_id}
            if (in_place := self._warm_action(action, others)) is not None:
                warm.append(in_place)
        warm_ids = {in_place.action.job_id for in_place in warm}
        actions = [action for action in actions if action.job_id not in warm_ids]
        for in_place in warm:
            self._start_warm(in_place)
        for action in actions:
            if action.kind in (ActionKind.STOP, ActionKind.RESIZE):
                await self._guarded(action.job_id, "stop", self._stop_for(action, now))
        shared = {job_id for job_id, _ in claimed if self._is_shared(job_id)}
        for action in actions:
            if action.kind is ActionKind.RESIZE and action.job_id in self._resize:
                continue  # restarts at its new size once its old incarnation has ended
            if action.kind in (ActionKind.START, ActionKind.RESIZE):
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
        if action.kind is ActionKind.RESIZE:
            self.store.transition(job_id, JobState.RESCALING, now, None)
            if group is not None:
                record = self.store.get_job(job_id)
                resizes_of(self.store).begin(job_id, now, record.report if record else None)
                self._resize[job_id] = action
                self._begin_stop(job_id, group, StopIntent.RESIZE)
            return
        if group is not None:
            self._begin_stop(job_id, group, StopIntent.PREEMPT)
        self.store.transition(
            job_id, JobState.QUEUED, now, DecisionEntry(DecisionKind.STOP, action.reason),
            reason=action.reason,
        )  # fmt: skip

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

    # --- devices held by groups that are running or stopping ---------------------------------

    def _held(self) -> dict[Device, int]:
        """Devices of running and stopping groups, and those of waiting resizes -> job id."""
        held: dict[Device, int] = {}
        for groups in (self.groups, self.stopping):
            for job_id, group in groups.items():
                for slot in group.spec.slots:
                    held[(slot.node, slot.device)] = job_id
        for job_id, action in self._resize.items():
            for device in allocation_devices(action.allocation):
                held.setdefault(device, job_id)
        return held

    def _is_shared(self, job_id: int) -> bool:
        """Whether ``job_id`` is a shared job (its spec; never its environment, up to 4 MB,
        read for every holder of every device a shared start looks at: review s69)."""
        found = self.store.jobs_by_id([job_id])
        return bool(found) and found[0].spec.shared

    def _shared_only(self, held: dict[Device, int]) -> set[Device]:
        """The held devices whose every holder is a shared job (another shared job may
        join them)."""
        holders: dict[Device, set[int]] = {}
        for groups in (self.groups, self.stopping):
            for job_id, group in groups.items():
                for slot in group.spec.slots:
                    holders.setdefault((slot.node, slot.device), set()).add(job_id)
        for job_id, action in self._resize.items():
            for device in allocation_devices(action.allocation):
                holders.setdefault(device, set()).add(job_id)
        return {
            device
            for device, ids in holders.items()
            if device in held and all(self._is_shared(job_id) for job_id in ids)
        }

    def with_processes(self) -> set[int]:
        """The jobs whose processes are not known to be gone: running, stopping, watched for
        their end, or ended with the end not yet recorded."""
        return {*self.groups, *self.stopping, *self.watchers, *self.unrecorded}

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
                holders = sorted(
                    {held[d] for d in allocation_devices(action.allocation) if d in held}
                )
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
                for device in allocation_devices(waiting.allocation)
            }
            await self._guarded(job_id, "start", self._start_when_free(action, claimed))

    # --- starting ------------------------------------------------------------------------------

    def _setup_failed(self, job: JobRecord, spec: LaunchSpec, why: str, now: float) -> None:
        """The launcher could not set the replicas up (its one line; this machine's
        supervisor says ``rank R: why``).  Taken as a replica's failed setup is on SSH
        nodes and under Slurm, where it is that replica's exit: the job fails at once when
        no retry can help (``failures.permanent_cause`` of the line: a working directory it
        cannot enter, a command that cannot run), else it is a crash, with its back-off and
        retries (a replica that took over 30 s to set up on a slow file system may not next
        time).  Review s62: this machine failed every such start for good."""
        line = re.sub(r"^rank \d+: ", "", why)
        on_cpu = all(slot.device.startswith("cpu") for slot in spec.slots)
        self._crashed(job, f"could not start: {why}", permanent_cause(line, on_cpu), now)

    async def start_job(self, job: JobRecord, action: Action) -> None:
        now = self.clock()
        gone = owner_gone(job)
        if gone is not None:
            self._fail(job.id, gone)
            return
        nodes = [self.config.node(name) for name in action.allocation]
        launchers = {id(self.launcher_for(node)) for node in nodes}
        launching = False
        try:
            if len(launchers) != 1:
                raise PolluxError("a job cannot span this machine and remote nodes at once")
            launcher = self.launcher_for(nodes[0])
            spec = self.build_spec(job, action)
            await prepare_dirs(
                job, spec, self.config, self.state_dir, local=launcher is self._local
            )
            launching = True
            group = await launcher.launch(spec)
        except NoFreePort as exc:  # not the job's fault: it waits and is planned again
            log.warning("job %s: not started: %s", job.id, exc)
            self.store.update_job(job.id, reason=f"waiting: {one_line(exc)}; tried again")
            return
        except (PolluxError, OSError) as exc:
            if launching:
                self._setup_failed(job, spec, one_line(exc), now)
            else:
                self._fail(job.id, f"could not start: {one_line(exc)}")
            return
        self.groups[job.id] = group
        # watched at once: should recording the start fail, its exit is still handled
        self.watchers[job.id] = asyncio.ensure_future(self._watch(job.id, group))
        self._noted_down = {key for key in self._noted_down if key[0] != job.id}
        current = self.store.get_job(job.id)
        if current is None or current.state not in (JobState.QUEUED, JobState.RESCALING):
            # cancelled or held while it started (a start made outside the daemon's lock,
            # after a resize's checkpoint or once its devices were released): stopped now,
            # not left running until the next pass (review s66)
            held = current is not None and current.state == JobState.HELD
            log.info("job %s: %s while it started; stopped", job.id, "held" if held else "ended")
            await self.stop_job(job.id, StopIntent.HOLD if held else StopIntent.CANCEL)
            return
        pids = self.pid_records(spec.slots, group.pids())
        batch = action.batch
        self.store.transition(
            job.id,
            JobState.RUNNING,
            now,
            DecisionEntry(
                DecisionKind(action.kind.value),
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
            ),
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
        resizes_of(self.store).launched(
            job.id, now, resizing=job.state == JobState.RESCALING, report=job.report
        )

    # --- stopping ------------------------------------------------------------------------------

    async def stop_job(self, job_id: int, intent: StopIntent) -> None:
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

    # --- cancel / hold ----------------------------------------------------------------------

    async def cancel(self, job_id: int) -> None:
        """Cancel a job: recorded at once, its replicas stopped in the background."""
        now = self.clock()
        self.store.transition(
            job_id, JobState.CANCELLED, now,
            DecisionEntry(DecisionKind.CANCELLED, "cancelled by request"),
            end_time=now, reason="cancelled",
        )  # fmt: skip
        await self.stop_job(job_id, StopIntent.CANCEL)

    async def end_at_time_limit(self, job_id: int, reason: str) -> None:
        """A job reached its time limit: recorded as failed with ``reason`` at once, its
        replicas stopped in the background (SIGTERM, a checkpoint for an elastic job; SIGKILL
        after ``stop_grace_s``)."""
        now = self.clock()
        self.store.transition(
            job_id, JobState.FAILED, now, DecisionEntry(DecisionKind.FAILED, reason),
            end_time=now, reason=reason,
        )  # fmt: skip
        await self.stop_job(job_id, StopIntent.TIME_LIMIT)

    async def hold(self, job_id: int) -> None:
        """Hold a job: recorded at once, its replicas stopped (checkpoint) in the background."""
        now = self.clock()
        self.store.transition(
            job_id, JobState.HELD, now, DecisionEntry(DecisionKind.HELD, "held by request"),
            reason="held",
        )  # fmt: skip
        await self.stop_job(job_id, StopIntent.HOLD)

    async def shutdown(self) -> None:
        """Daemon stopping: checkpoint-stop every running job and queue it again (recorded
        first: a daemon killed before the stop ends leaves the job queued, not failed by its
        SIGTERM); wait (up to ``stop_grace_s`` and a margin) for those stops and the ones
        already under way.  A job that may not be stopped (rigid, not ``--preemptible``) on
        this machine is left running under its supervisor, as after a crash, and adopted at
        the next start (an upgrade ran such a job again from its start).  What has not ended
        by then is left to its supervisor and adopted at the next start."""
        self._closing = True
        for task in list(self._checking.values()):
            task.cancel()
        self._deferred.clear()
        now = self.clock()
        kept: list[int] = []
        for job_id, group in list(self.groups.items()):
            job = self.store.get_job(job_id)
            if job is not None and self._runs_on_at_shutdown(job):
                kept.append(job_id)
                continue
            if job is not None and job.state in PLACED_STATES:
                reason = "daemon stopped; will resume from checkpoint"
                with contextlib.suppress(sqlite3.Error):  # else queued once its exit comes
                    self.store.transition(
                        job_id, JobState.QUEUED, now, DecisionEntry(DecisionKind.REQUEUED, reason),
                        reason=reason,
                    )  # fmt: skip
            self._begin_stop(job_id, group, StopIntent.SHUTDOWN)
        if kept:
            log.info(
                "job(s) %s may not be stopped (rigid, not --preemptible): left running under"
                " their supervisors; the next start adopts them", kept,
            )  # fmt: skip
        watchers = [task for job_id, task in self.watchers.items() if job_id not in kept]
        if watchers:
            await asyncio.wait(watchers, timeout=self.config.stop_grace_s + SHUTDOWN_MARGIN_S)
        left = sorted(self.stopping)
        if left:
            log.warning("job(s) %s still stopping at shutdown; left to their supervisors", left)
        else:
            await self.close_shared_connections()

    def _runs_on_at_shutdown(self, job: JobRecord) -> bool:
        """Whether a shutdown leaves ``job`` running: it may not be stopped (rigid, not
        preemptible) and runs under a supervisor on this machine, which outlives the daemon
        (an SSH node's agent stops what it runs once the daemon's session ends)."""
        if job.spec.elastic or job.spec.preemptible or not job.placement:
            return False
        nodes = [self.known_node(name) for name in job.placement]
        return all(node is not None and self.launcher_for(node) is self._local for node in nodes)
