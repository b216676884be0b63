"""The scheduling loop: every ``interval_s``, or soon after something changed, one pass.

A pass (:meth:`SchedulingLoop.schedule_once`) reads the jobs' new ``report.json`` files, takes
a snapshot of the nodes, asks the pure pass (``core.schedule.run_pass``, through
``scheduler.plan_round``: models, admission, policy, devices and batch sizes) for a plan, has
the executor apply it, stores the plan's reasons of
the jobs left waiting and predictions of the jobs left running as they were, and samples each
running job's goodput and noise scale into its history.  Passes and the requests that change
jobs take the daemon's one mutex in turn.

A job's ``report.json`` is read through :mod:`.jobfiles` as the job's owner's plain file (a
symlink, FIFO or hard link there is skipped with one logged line, never read or waited on).  A
database write that fails during a pass (``sqlite3.Error``: a full disk, say) is logged and the
pass retried after a back-off that doubles from :data:`RETRY_FIRST_S` up to :data:`RETRY_S`
(wake-ups and time limits do not shorten it, so a full disk costs one pass and one log line
every few seconds); replica groups the store no longer records as placed are stopped first
(:meth:`SchedulingLoop.reconcile`), so that no process holds a device the store thinks is
free.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import sqlite3
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Protocol

import numpy as np
import psutil

from pollux_local.api.errors import InvalidRequest, LimitExceeded
from pollux_local.api.states import (
    PLACED_STATES,
    DecisionKind,
    JobState,
    StopIntent,
)
from pollux_local.core.schedule import Holding, Limits, NodeInput
from pollux_local.core.types import Policy
from pollux_local.daemon import gpus
from pollux_local.daemon.config import DaemonConfig, busy_gpus
from pollux_local.daemon.executor import Executor
from pollux_local.daemon.forecasting import Forecasts
from pollux_local.daemon.jobfiles import (
    job_dir_stat,
    job_file_exists,
    job_file_mtime,
    remove_job_dir,
)
from pollux_local.daemon.jobrules import check_job
from pollux_local.daemon.readmodel import MetricHistory, job_noise_scale
from pollux_local.daemon.reports import InvalidReport, read_job_report
from pollux_local.daemon.resizes import ResizeCosts, resizes_of
from pollux_local.daemon.scheduler import (
    AfterSummary,
    ModelCache,
    dependency_ids,
    group_limits,
    plan_round,
    resolve_dependencies,
    time_left_s,
)
from pollux_local.daemon.state import DecisionEntry, JobRecord, StateStore
from pollux_local.daemon.state.retention import PRUNE_BATCH
from pollux_local.daemon.statedir import note_alive
from pollux_local.durations import format_duration
from pollux_local.sizes import format_size
from pollux_local.untrusted import one_line

log = logging.getLogger("pollux_local.daemon")

#: A pass waits this long after being woken, so that a burst of submits makes one pass.
COALESCE_S = 0.02
#: The most of the daemon's processor time passes take over time, however often they are
#: woken: a pass that used t seconds of it is followed by none sooner than t * (1 / share - 1)
#: after it, and never later than ``interval_s`` (a user's loop of cheap changes, each waking
#: a pass over a queue of thousands, kept the daemon busy).  What a pass waits for (launches,
#: the mutex) is not counted.
PASS_SHARE = 1.0 / 3.0
#: The states whose jobs a pass looks at (held and finished jobs are left alone).
SCHEDULED_STATES = (JobState.QUEUED, JobState.RUNNING, JobState.RESCALING)
#: After a pass failed to write the database, the next one waits this long at first, twice as
#: long after each further failure, at most :data:`RETRY_S`.
RETRY_FIRST_S = 0.5
RETRY_S = 5.0
#: The least time between two warnings about one job's unusable ``report.json`` (a job
#: rewriting it many times a second must not fill the daemon's log).
REPORT_WARNING_INTERVAL_S = 60.0
#: How often ended jobs beyond each user's cap are looked for (``prune_ended``).
PRUNE_INTERVAL_S = 60.0
#: The longest one pass goes on removing ended jobs for (batch after full batch), how soon
#: the next pass removes more while some are left, and the most of the daemon's time removal
#: takes then (a removal that took t waits at least t / share).
PRUNE_BUDGET_S = 0.2
PRUNE_AGAIN_S = 1.0
PRUNE_SHARE = 0.2


def node_snapshot(
    config: DaemonConfig,
    executor: Executor,
    drained: Sequence[str] = (),
    placed: Sequence[JobRecord] = (),
    stopping: Sequence[Holding] = (),
) -> list[NodeInput]:
    """Every configured node as a pass sees it: up or down, its devices' type, (this
    machine's GPUs) which devices processes outside the scheduler are using, which are
    withheld from new jobs: reserved (``[devices] reserved``) or drained (``drained``:
    ``node`` or ``node:device``), unless a job holds them now (it keeps them), and which are
    still held by jobs whose processes are stopping (``stopping``, :func:`stopping_jobs`);
    while shared jobs run, the memory NVML reports free on this machine's GPUs."""
    busy: set[str] = set()
    if any(d.startswith("cuda") for n in config.nodes if n.is_local for d in n.devices):
        own: set[int] = set()
        for group in executor.groups.values():
            for pid in group.pids().values():
                own.add(pid)
                with contextlib.suppress(psutil.Error):
                    own.update(c.pid for c in psutil.Process(pid).children(recursive=True))
        busy = busy_gpus(own, config.busy_memory)
    free_memory: dict[str, int] = {}
    if any(job.spec.shared for job in placed):  # shared devices: what NVML says is free
        for node in config.nodes:
            if node.is_local:
                for device in node.devices:
                    kind, _, index = device.partition(":")
                    if kind == "cuda" and (free := gpus.free_memory(int(index))) is not None:
                        free_memory[device] = free
    closed = set(config.reserved) | set(drained)
    held = {(node, device) for job in placed for node, ds in job.placement.items() for device in ds}
    return [
        NodeInput(
            name=node.name,
            devices=node.devices,
            up=executor.nodes.is_up(node.name),
            busy=frozenset(busy.intersection(node.devices)) if node.is_local else frozenset(),
            device_type=node.device_type,
            memory=node.device_memory,
            slowdown=node.slowdown,
            free_memory=(
                {d: free_memory[d] for d in node.devices if d in free_memory}
                if node.is_local
                else {}
            ),
            withheld=frozenset(
                device
                for device in node.devices
                if (node.name in closed or f"{node.name}:{device}" in closed)
                and (node.name, device) not in held
            ),
            stopping={
                device: stop.job_id
                for stop in stopping
                for device in stop.devices.get(node.name, ())
            },
        )
        for node in config.nodes
    ]


def stopping_jobs(store: StateStore, executor: Executor) -> list[Holding]:
    """The jobs whose processes still hold devices though the store no longer counts them as
    placed (cancelled, held, preempted, at their time limit: the stop was sent, the exit has
    not come): the one account of what they hold, read by admission's per-user caps, the
    policy's node views and ``nodes`` alike.  A job being resized is counted by its
    placement, as before."""
    found: list[Holding] = []
    for job_id, devices in sorted(executor.still_stopping().items()):
        job = store.get_job(job_id)
        if job is not None and job.state in PLACED_STATES:
            continue
        owner = job.owner_name if job is not None else ""
        group = job.spec.group if job is not None else None
        array = job.spec.array_id if job is not None else None
        found.append(
            Holding(job_id=job_id, owner=owner, devices=devices, group=group, array_id=array)
        )
    return found


def _error_line(exc: sqlite3.Error) -> str:
    """A failed write as one log line (a full disk says so itself)."""
    text = " ".join(str(exc).split())
    return text if text.startswith("state disk full") else f"database error ({text})"


class Announcer(Protocol):
    """What announces job ends (``notify.Notifier``)."""

    async def announce_pending(self) -> int: ...


class SchedulingLoop:
    """Runs passes until cancelled; :meth:`wake` asks for one soon."""

    def __init__(
        self,
        *,
        store: StateStore,
        executor: Executor,
        config: DaemonConfig,
        state_dir: Path,
        policy: Policy,
        models: ModelCache,
        metrics: MetricHistory,
        mutex: asyncio.Lock,
        wake_event: asyncio.Event,
        clock: Callable[[], float],
        rng: np.random.Generator,
    ) -> None:
        self.store = store
        self.executor = executor
        self.config = config
        self.state_dir = state_dir
        self.policy = policy
        self.models = models
        self.metrics = metrics
        self.mutex = mutex
        self.clock = clock
        self.rng = rng
        self._wake = wake_event
        #: the config the queued jobs in ``_kept_by`` were found to keep (``hold_refused``)
        self._rules_of: DaemonConfig | None = None
        self._kept_by: set[int] = set()
        self._report_mtimes: dict[int, float] = {}
        #: when each job's unusable report was last warned about
        self._report_warned: dict[int, float] = {}
        self._last_sample: dict[int, float] = {}
        #: when ended jobs beyond the cap are next looked for (monotonic seconds)
        self._next_prune = 0.0
        #: ended jobs beyond the cap may be left: the next pass comes within PRUNE_AGAIN_S
        self.prune_soon = False
        #: the ids of removed jobs whose directories are still to be removed, by the owner of
        #: the directory, each owner's in order, and the task removing each owner's
        self._dirs_to_remove: dict[int, deque[int]] = {}
        self._dir_removers: dict[int, asyncio.Task[None]] = {}
        self._swept = False
        self.ticks = 0
        #: database writes that failed in passes (each logged; the pass was retried)
        self.write_failures = 0
        #: the current back-off after failed writes (0: the last pass wrote)
        self.retry_s = 0.0
        self._stopped = False
        #: announces job ends after each pass (``notify.Notifier``; ``None``: nobody)
        self.notifier: Announcer | None = None
        #: every queued and running job's expected start and finish, after each pass
        self.forecasts = Forecasts(metrics=metrics)

    def wake(self) -> None:
        self._wake.set()

    def prune_ended(self) -> None:
        """Every :data:`PRUNE_INTERVAL_S` at most: each user's ended jobs beyond ``[limits]
        max_ended_per_user`` (or past the newest that keep ``max_ended_stored_per_user``
        bytes) are removed (``state.retention``), a batch at a time for at most
        :data:`PRUNE_BUDGET_S`; while a batch comes back full (more may be left: users make
        ended jobs faster than one batch a minute) the next pass prunes again, soon."""
        now = time.monotonic()
        if now < self._next_prune:
            return
        self._next_prune = now + PRUNE_INTERVAL_S  # a failing removal costs a pass a minute
        removed: list[int] = []
        try:
            self.store.prune_ended(
                self.config.max_ended_per_user,
                budget_s=PRUNE_BUDGET_S,
                into=removed,
                live=self.executor.with_processes(),  # a job whose processes are not gone stays
                keep_bytes_per_user=self.config.max_ended_stored_per_user,
            )
        finally:
            # more may be left after full batches: again soon, but no more than a share of
            # the daemon's time, whatever one removal cost
            spent = time.monotonic() - now
            self.prune_soon = bool(removed) and len(removed) % PRUNE_BATCH == 0
            if self.prune_soon:
                self._next_prune = now + spent + max(PRUNE_AGAIN_S, spent / PRUNE_SHARE)
            self._removed_dirs(removed)

    def _removed_dirs(self, removed: list[int]) -> None:
        """Log the jobs removed and queue their directories for removal (as their owners)."""
        if removed:
            log.info(
                "removed %d ended job(s) beyond %d or %s per user ([limits]"
                " max_ended_per_user, max_ended_stored_per_user): %s%s",
                len(removed), self.config.max_ended_per_user,
                format_size(self.config.max_ended_stored_per_user),
                ", ".join(map(str, removed[:10])), " …" if len(removed) > 10 else "",
            )  # fmt: skip
        if not self._swept:  # once: those an earlier daemon removed and left the directory of
            self._swept = True
            removed = list(dict.fromkeys([*self.store.removed_ids(self._job_dir_ids()), *removed]))
        jobs_dir = self.state_dir / "jobs"
        for job_id in removed:
            try:
                owner = job_dir_stat(jobs_dir, str(job_id)).st_uid
            except OSError:
                continue  # none (a job that never started), or it went
            self._dirs_to_remove.setdefault(owner, deque()).append(job_id)
            task = self._dir_removers.get(owner)
            if task is None or task.done():
                self._dir_removers[owner] = asyncio.ensure_future(self._remove_dirs(owner))

    def _job_dir_ids(self) -> list[int]:
        """The ids ``jobs/`` has a directory for."""
        with contextlib.suppress(OSError), os.scandir(self.state_dir / "jobs") as entries:
            return sorted(int(e.name) for e in entries if e.name.isdigit() and e.name.isascii())
        return []

    async def _remove_dirs(self, owner: int) -> None:
        """The directories of ``owner``'s removed jobs, one at a time
        (``jobfiles.remove_job_dir``: what is inside removed as them, off the event loop);
        each owner's by a task of its own, so that one who stops their removal (it runs as
        them) holds up only theirs."""
        jobs_dir = self.state_dir / "jobs"
        queue = self._dirs_to_remove.get(owner, deque())
        while queue and not self._stopped:
            job_id = queue.popleft()
            problem = await remove_job_dir(jobs_dir, job_id)
            if problem is not None:
                log.warning("removed job %d's directory: %s", job_id, problem)
        if not queue:
            self._dirs_to_remove.pop(owner, None)

    async def run(self) -> None:
        """Pass after pass, each after ``interval_s`` or a wake-up; a failing pass is logged
        and the next one runs as usual; none after :meth:`stop`."""
        wait_s = self.config.interval_s
        rest_until = 0.0  # no pass before (monotonic seconds): PASS_SHARE
        while not self._stopped:
            if self.retry_s > 0:  # backing off: no wake-up shortens it
                await asyncio.sleep(wait_s)
            else:
                await self._woken(wait_s)
            await asyncio.sleep(max(COALESCE_S, rest_until - time.monotonic()))
            if self._stopped:
                return  # the daemon stops (and holds the mutex a pass would wait for)
            self._wake.clear()
            wait_s = self.config.interval_s
            began, began_cpu = time.monotonic(), time.process_time()
            try:
                await self.schedule_once()
                self.retry_s = 0.0
            except asyncio.CancelledError:
                raise
            except sqlite3.Error as exc:
                self.write_failures += 1
                self.retry_s = min(RETRY_S, max(RETRY_FIRST_S, 2 * self.retry_s))
                log.error("scheduling pass: %s; retrying in %g s", _error_line(exc), self.retry_s)
                wait_s = self.retry_s
                continue
            except Exception:
                log.exception("scheduling pass failed")
            finally:
                ended = time.monotonic()
                spent = min(ended - began, time.process_time() - began_cpu)
                rest = min(spent * (1.0 / PASS_SHARE - 1.0), self.config.interval_s)
                rest_until = ended + rest
            deadline = self.next_time_limit()
            if deadline is not None:
                wait_s = max(0.05, min(wait_s, deadline - self.clock()))
            if self.prune_soon:
                wait_s = min(wait_s, PRUNE_AGAIN_S)

    def hold_refused(self, jobs: list[JobRecord], now: float) -> list[JobRecord]:
        """``jobs`` less the queued ones that the config in use refuses
        (:func:`~pollux_local.daemon.jobrules.check_job`, the rules a submit, an edit and a
        release keep), which are held with the one-line reason: a reload, or a restart of the
        daemon, tightened a limit since they were queued (``max_time``, ``max_mem``, ...), and
        they must not start with what they asked then.  Each job is checked once per config."""
        if self._rules_of is not self.config:
            self._rules_of, self._kept_by = self.config, set()
        kept = self._kept_by
        kept.intersection_update(job.id for job in jobs if job.state is JobState.QUEUED)
        refused: set[int] = set()
        for job in jobs:
            if job.state is not JobState.QUEUED or job.id in kept:
                continue
            # its environment counts too, measured once per environment, not per job: a
            # 999-task array sharing one of 200,000 variables took 66 ms a task here
            env_bytes = self.store.stored_environment(job.id).exec_bytes
            try:
                check_job(job.spec, self.config, env_bytes=env_bytes)
            except (InvalidRequest, LimitExceeded) as exc:
                why = one_line(str(exc))
                reason = f"held by the daemon: {why} (the config changed since it was queued)"
                self.store.transition(
                    job.id, JobState.HELD, now, DecisionEntry(DecisionKind.HELD, reason),
                    reason=reason, admin_hold=False,
                )  # fmt: skip
                refused.add(job.id)
            else:
                kept.add(job.id)
        return [job for job in jobs if job.id not in refused] if refused else jobs

    def stop(self) -> None:
        """No pass after the one under way (if any): the daemon is stopping (the directories
        still to be removed are looked for again at the next start)."""
        self._stopped = True
        for task in self._dir_removers.values():
            task.cancel()

    async def _woken(self, timeout_s: float) -> None:
        """Until a wake-up or ``timeout_s``.  Not ``asyncio.wait_for``: on Python 3.11 it
        returns, swallowing the cancellation, when the wake-up comes in the same turn as a
        cancel, and the cancelled loop ran on into a pass that waited for the mutex the
        stopping daemon held (a daemon that never stopped)."""
        woken = asyncio.ensure_future(self._wake.wait())
        try:
            await asyncio.wait({woken}, timeout=timeout_s)
        finally:
            woken.cancel()

    async def schedule_once(self) -> None:
        """One pass: reports -> models -> policy -> plan -> executor."""
        async with self.mutex:
            await self.executor.check_nodes(background=True)
            await self.executor.record_unrecorded()  # ends a full disk kept from the store
            await self.reconcile()
            self.prune_ended()
            now = self.clock()
            note_alive(self.state_dir, now)  # read by the next start's recovery
            await self.enforce_time_limits(now)
            states, dependencies = await self.resolve_dependencies(now)
            jobs = self.hold_refused(self.store.jobs(SCHEDULED_STATES), now)
            self.refresh_reports(jobs)
            stopping = stopping_jobs(self.store, self.executor)
            nodes = node_snapshot(self.config, self.executor, self.store.withheld(), jobs, stopping)
            limits = Limits(
                max_devices_per_user=self.config.max_devices_per_user,
                max_running_per_user=self.config.max_running_per_user,
                share_slowdown=self.config.share_slowdown,
                groups=group_limits(self.config.groups, self.store.group_rows()),
                max_jobs_per_device=self.config.max_jobs_per_device,
            )
            if not jobs:
                self.forecasts.update(
                    self.policy, [], nodes, self.models, limits, now, states=states,
                    stopping=stopping,
                )  # fmt: skip
                await self.announce()
                return
            costs = resizes_of(self.store).costs_of(job.id for job in jobs)
            plan = await asyncio.to_thread(
                plan_round, self.policy, jobs, nodes, self.models, now, self.rng, limits,
                states=states, dependencies=dependencies, stopping=stopping,
                resize_costs=costs,
            )  # fmt: skip
            self.ticks += 1
            await self.executor.apply(plan)
            # why waiting jobs wait, and the figures of jobs left running as they were
            for job_id, reason in plan.reasons.items():
                self.store.update_job(job_id, reason=reason)
            for job_id, prediction in plan.predictions.items():
                self.store.update_job(job_id, prediction=prediction)
            self.sample_history(self.clock())
            await self.forecast(jobs, nodes, limits, now, states, stopping, dependencies, costs)
            await self.announce()

    async def forecast(
        self,
        jobs: list[JobRecord],
        nodes: list[NodeInput],
        limits: Limits,
        now: float,
        states: dict[int, JobState],
        stopping: Sequence[Holding],
        dependencies: dict[int, AfterSummary] | None = None,
        resize_costs: Mapping[int, ResizeCosts] | None = None,
    ) -> None:
        """Every queued and running job's expected start and finish (``forecasting``); a
        failing forecast is logged and leaves the jobs without one."""
        try:
            self.forecasts.durations.refresh(self.store)
            await asyncio.to_thread(
                self.forecasts.update, self.policy, jobs, nodes, self.models, limits, now,
                states=states, dependencies=dependencies, stopping=stopping,
                resize_costs=resize_costs,
            )  # fmt: skip
        except sqlite3.Error:
            raise
        except Exception:
            log.exception("forecast failed")
            self.forecasts.latest = {}

    async def announce(self) -> None:
        """Have the notifier announce the job ends recorded since the last pass."""
        if self.notifier is not None:
            await self.notifier.announce_pending()

    async def resolve_dependencies(
        self, now: float
    ) -> tuple[dict[int, JobState], dict[int, AfterSummary]]:
        """Fail the queued and held jobs whose dependencies failed (``dependency N failed``),
        and their dependents in turn, in this pass; returns the states of every job depended
        on and each other job's dependencies summarised from them (``AfterSummary``, for
        admission and the forecast: computed once a pass).  The scans run in a worker thread
        (``scheduler.resolve_dependencies``: a thousand jobs naming a thousand ids each cost
        a fraction of a second there), the store's reads and writes here."""
        waiting = [
            job for job in self.store.jobs([JobState.QUEUED, JobState.HELD]) if job.spec.after
        ]
        if not waiting:
            return {}, {}
        wanted, parsed = await asyncio.to_thread(dependency_ids, waiting)
        states = self.store.states_of(wanted)
        summaries, failures = await asyncio.to_thread(resolve_dependencies, waiting, states, parsed)
        for job, why in failures:
            self.store.transition(
                job.id, JobState.FAILED, now, DecisionEntry(DecisionKind.FAILED, why),
                end_time=now, reason=why,
            )  # fmt: skip
            job.state = JobState.FAILED
        return states, summaries

    def next_time_limit(self) -> float | None:
        """When the earliest time limit of a running job falls (``None``: none has one)."""
        deadlines = [
            self.clock() + left
            for job in self.store.jobs(PLACED_STATES)
            if (left := time_left_s(job, self.clock())) is not None
        ]
        return min(deadlines, default=None)

    async def enforce_time_limits(self, now: float) -> None:
        """Stop every running job that reached its time limit: it gets SIGTERM (an elastic job
        checkpoints), SIGKILL after ``stop_grace_s``, and ends failed with the reason
        ``time limit 10m reached``."""
        for job in self.store.jobs(PLACED_STATES):
            left = time_left_s(job, now)
            if left is None or left > 0:
                continue
            limit = job.spec.time_limit_s or 0.0
            await self.executor.end_at_time_limit(
                job.id, f"time limit {format_duration(limit)} reached"
            )

    async def reconcile(self) -> None:
        """Make the executor and the store agree again (the caller holds the mutex): stop the
        replica groups of jobs the store does not record as placed (a start whose record was
        not written), and queue again the jobs recorded as placed that no group or watcher
        runs (a stop or an exit whose record was not written), so that no process holds
        devices the store counts as free, and no record holds devices no process uses."""
        placed = set(self.store.ids_with_state(list(PLACED_STATES)))
        for job_id, group in list(self.executor.groups.items()):
            if job_id in placed:
                continue
            log.warning("job %s: stopping replicas the database does not record", job_id)
            if job_id not in self.executor.watchers:
                # its start failed before its exit was watched: watch it, so that the stop's
                # end is handled (its devices released) like any other
                watch = self.executor._watch(job_id, group)
                self.executor.watchers[job_id] = asyncio.ensure_future(watch)
            await self.executor.stop_job(job_id, StopIntent.RECONCILE)
        for job_id in sorted(placed - self.executor.with_processes()):
            reason = "its replicas are gone; back in the queue"
            if self.store.requeue_if_placed(job_id, reason, self.clock()):
                log.warning("job %s: recorded as running without replicas: queued again", job_id)

    def refresh_reports(self, jobs: list[JobRecord]) -> None:
        """Take in the ``report.json`` files of the running jobs written since the last pass
        (a waiting job has no replica to write one: its last incarnation's report was taken at
        its end, and a file its user rewrites while it waits is not read).  A report that does
        not follow the schema, or a file that is not the job's owner's plain file, is ignored
        (once per version of the file, with a logged reason); the job keeps its previous one.
        What is remembered per job is forgotten once the job no longer runs."""
        placed = {job.id for job in jobs if job.state in PLACED_STATES}
        for remembered in (self._report_mtimes, self._report_warned):
            for job_id in [key for key in remembered if key not in placed]:
                del remembered[job_id]
        self.metrics.keep_only(placed)
        for job in jobs:
            if job.state not in PLACED_STATES:
                continue
            directory = self.state_dir / "jobs" / job.job_id
            path = directory / "report.json"
            mtime = job_file_mtime(directory, "report.json", job.owner_uid)
            if mtime is None:
                there = job_file_exists(directory, "report.json", job.owner_uid)
                if there and self._report_mtimes.get(job.id) != -1.0:
                    self._report_mtimes[job.id] = -1.0
                    self._warn_report(job.id, f"ignoring {path}: not a regular file")
                continue
            if self._report_mtimes.get(job.id) == mtime:
                continue
            try:
                report = read_job_report(directory, job)
            except InvalidReport as exc:
                self._report_mtimes[job.id] = mtime
                self._warn_report(job.id, f"ignoring its report {path}: {exc}")
                continue
            if report is None:
                continue
            self._report_mtimes[job.id] = mtime
            self.store.update_job(job.id, report=report)
            job.report = report
            self.metrics.note(job, report, self.clock())
            resizes_of(self.store).reported(job.id, report, self.clock())

    def _warn_report(self, job_id: int, what: str) -> None:
        """Log that job ``job_id``'s report was not taken, at most once every
        :data:`REPORT_WARNING_INTERVAL_S` per job (the job keeps its previous report)."""
        now = self.clock()
        last = self._report_warned.get(job_id)
        if last is not None and now - last < REPORT_WARNING_INTERVAL_S:
            return
        self._report_warned[job_id] = now
        log.warning("job %s: %s", job_id, what)

    def sample_history(self, now: float) -> None:
        """One (goodput, noise scale) sample per running job, at most one per half interval
        (bursts of passes do not flood it); the store keeps the newest HISTORY_LIMIT."""
        spacing = 0.5 * self.config.interval_s
        running = self.store.jobs([JobState.RUNNING])
        live = {job.id for job in running}
        self._last_sample = {k: v for k, v in self._last_sample.items() if k in live}
        for job in running:
            if now - self._last_sample.get(job.id, -math.inf) < spacing:
                continue
            goodput = job.prediction.get("goodput")
            noise = job_noise_scale(job)
            if goodput is None and noise is None:
                continue
            self.store.add_history(job.id, now, goodput, noise)
            self._last_sample[job.id] = now
