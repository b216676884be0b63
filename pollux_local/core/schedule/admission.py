"""Admission: which queued jobs the policy may see this pass, and why each other one waits.

A queued job waits, before any policy looks at it, until its ``--begin`` time, while its
dependencies have not let it
start, while its array runs its ``--max-running`` tasks already, while its group is paused or
at one of its caps (``--group``), or while its owner is at a cap on running jobs or held
devices (a job still stopping counts, with its devices, in its owner's and its group's counts
until its processes are gone).  Pausing a group holds back its queued jobs only: its running
jobs go on.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from enum import Enum

from pollux_local.core.schedule.reasons import in_time
from pollux_local.core.schedule.snapshot import (
    AfterMode,
    Dependency,
    GroupLimit,
    Holding,
    JobInput,
    Limits,
    Outcome,
)


class Verdict(Enum):
    """What a job's dependencies say: it may start, it waits, or it fails."""

    READY = "ready"
    WAIT = "wait"
    FAIL = "fail"


def dependency_verdict(
    after: Sequence[Dependency], mode: AfterMode, pending: Sequence[int] = ()
) -> tuple[Verdict, str]:
    """Whether dependencies let a job start, with the reason when not (``mode``: what they
    must do, :class:`AfterMode`).  ``ALL_ENDED``: every job named must have ended, however;
    ``ALL_SUCCEEDED``: every one must have succeeded, and one that failed or was cancelled (or
    does not exist) fails this job; ``ONE_SUCCEEDED``: one that succeeded is enough, and the
    job fails once none is left that may.  ``pending``: the ids of further dependencies, not
    ended (``JobInput.after_pending``), that the job waits for too.  A caller may pass only
    the dependencies of ``after`` that decide (the first one not met; with ``ONE_SUCCEEDED``
    one that succeeded, else the first) and the pending ids behind them: the verdict is the
    same."""
    if mode is AfterMode.ONE_SUCCEEDED:
        return _one_succeeded(after, pending)
    for dep in after:
        outcome = dep.outcome
        if outcome is None:
            return Verdict.FAIL, f"dependency {dep.job_id} does not exist"
        if mode is AfterMode.ALL_ENDED:
            if outcome is Outcome.PENDING:
                return Verdict.WAIT, f"waiting: after job {dep.job_id} ({dep.state})"
            continue
        if outcome is Outcome.FAILED:
            return Verdict.FAIL, f"dependency {dep.job_id} failed"
        if outcome is Outcome.CANCELLED:
            return Verdict.FAIL, f"dependency {dep.job_id} was cancelled"
        if outcome is not Outcome.SUCCEEDED:
            return Verdict.WAIT, f"waiting: after job {dep.job_id} ({dep.state})"
    if pending:
        return Verdict.WAIT, f"waiting: after job {pending[0]}"
    return Verdict.READY, ""


_ONE_OF = "waiting: until one of its dependencies succeeds"


def _one_succeeded(after: Sequence[Dependency], pending: Sequence[int]) -> tuple[Verdict, str]:
    """:func:`dependency_verdict` with ``ONE_SUCCEEDED``: ready once one succeeded, waiting
    while one has not ended (the first named), failed when every one ended otherwise."""
    if not after and not pending:
        return Verdict.READY, ""
    if any(dep.outcome is Outcome.SUCCEEDED for dep in after):
        return Verdict.READY, ""
    waiting = [dep for dep in after if dep.outcome is Outcome.PENDING]
    if waiting:
        first = waiting[0]
        return Verdict.WAIT, f"{_ONE_OF} (job {first.job_id}: {first.state})"
    if pending:
        return Verdict.WAIT, f"{_ONE_OF} (job {pending[0]})"
    first = after[0]
    how = {
        None: "does not exist",
        Outcome.FAILED: "failed",
        Outcome.CANCELLED: "was cancelled",
    }.get(first.outcome, "ended")
    return Verdict.FAIL, f"no dependency succeeded (dependency {first.job_id} {how})"


def admit(
    candidates: Sequence[JobInput],
    limits: Limits,
    holdings: Sequence[Holding] = (),
    now: float = 0.0,
) -> tuple[list[JobInput], dict[int, str]]:
    """The candidates the policy may see (by id), and why each other one waits.  Running jobs
    always stay; queued ones are admitted by priority, then submission."""
    placed = [job for job in candidates if job.phase.placed]
    array_running: dict[str, int] = {}
    user_running: dict[str, int] = {}
    user_devices: dict[str, int] = {}
    user_stopping: dict[str, list[int]] = {}
    groups = GroupCounts(limits.groups)
    for stop in holdings:
        if stop.array_id is not None:
            array_running[stop.array_id] = array_running.get(stop.array_id, 0) + 1
        user_running[stop.owner] = user_running.get(stop.owner, 0) + 1
        user_devices[stop.owner] = user_devices.get(stop.owner, 0) + stop.count
        user_stopping.setdefault(stop.owner, []).append(stop.job_id)
        groups.add(stop.group, stop.count, stopping=stop.job_id)
    for job in placed:
        if job.array_id is not None:
            array_running[job.array_id] = array_running.get(job.array_id, 0) + 1
        user_running[job.owner] = user_running.get(job.owner, 0) + 1
        user_devices[job.owner] = user_devices.get(job.owner, 0) + max(job.replicas, job.needs)
        groups.add(job.group, max(job.replicas, job.needs))
    admitted = list(placed)
    waiting: dict[int, str] = {}
    queued = [job for job in candidates if not job.phase.placed]
    for job in sorted(queued, key=lambda j: (-j.priority, j.id)):
        if job.begin_at is not None and job.begin_at > now:
            waiting[job.id] = f"waiting: --begin, in {in_time(job.begin_at - now)}"
            continue
        verdict, why = dependency_verdict(job.after, job.after_mode, job.after_pending)
        if verdict is not Verdict.READY:
            waiting[job.id] = why if verdict is Verdict.WAIT else f"waiting: {why}"
            continue
        array, cap = job.array_id, job.array_max_running
        if array is not None and cap is not None and array_running.get(array, 0) >= cap:
            waiting[job.id] = (
                f"waiting: array {array} has {array_running.get(array, 0)} tasks running,"
                f" its --max-running is {cap}"
            )
            continue
        held_by_group = groups.holds_back(job)
        if held_by_group:
            waiting[job.id] = held_by_group
            continue
        user = job.owner
        stopping = user_stopping.get(user)
        still = f" (job(s) {', '.join(map(str, stopping))} still stopping)" if stopping else ""
        running_cap = limits.max_running_per_user
        if running_cap is not None and user_running.get(user, 0) >= running_cap:
            waiting[job.id] = (
                f"waiting: {user} has {user_running.get(user, 0)} jobs running{still}, the most"
                f" a user may ([limits] max_running_per_user = {running_cap})"
            )
            continue
        device_cap = limits.max_devices_per_user
        needs = job.needs
        if device_cap is not None and user_devices.get(user, 0) + needs > device_cap:
            waiting[job.id] = (
                f"waiting: {user}'s jobs hold {user_devices.get(user, 0)} devices{still}, this job"
                f" needs {needs} more, a user may hold {device_cap} ([limits]"
                " max_devices_per_user)"
            )
            continue
        if array is not None:
            array_running[array] = array_running.get(array, 0) + 1
        user_running[user] = user_running.get(user, 0) + 1
        user_devices[user] = user_devices.get(user, 0) + needs
        groups.add(job.group, needs)
        admitted.append(job)
    admitted.sort(key=lambda j: j.id)
    return admitted, waiting


class GroupCounts:
    """What each group's jobs hold while admission goes down the queue: jobs running and
    devices (stopping jobs' included, and those of the jobs admitted so far)."""

    def __init__(self, limits: Mapping[str, GroupLimit]) -> None:
        self.limits = limits
        self.running: dict[str, int] = {}
        self.devices: dict[str, int] = {}
        self.stopping: dict[str, list[int]] = {}

    def add(self, group: str | None, devices: int, stopping: int | None = None) -> None:
        """Count one job of ``group`` holding ``devices`` (``stopping``: the id of a job still
        stopping)."""
        if group is None or group not in self.limits:
            return
        self.running[group] = self.running.get(group, 0) + 1
        self.devices[group] = self.devices.get(group, 0) + devices
        if stopping is not None:
            self.stopping.setdefault(group, []).append(stopping)

    def holds_back(self, job: JobInput) -> str:
        """Why ``job``'s group keeps it from starting now ("": it does not)."""
        group = job.group
        limit = self.limits.get(group) if group is not None else None
        if group is None or limit is None:
            return ""
        if limit.paused:
            return f"waiting: group {group} is paused"
        stopping = self.stopping.get(group)
        still = f" (job(s) {', '.join(map(str, stopping))} still stopping)" if stopping else ""
        running = self.running.get(group, 0)
        if limit.max_running is not None and running >= limit.max_running:
            return (
                f"waiting: group {group} has {running} jobs running{still}, its max_running"
                f" is {limit.max_running}"
            )
        held = self.devices.get(group, 0)
        if limit.max_devices is not None and held + job.needs > limit.max_devices:
            return (
                f"waiting: group {group}'s jobs hold {held} devices{still}, this job needs"
                f" {job.needs} more, its max_devices is {limit.max_devices}"
            )
        return ""
