"""What a request handler may use: :class:`Context`, one per connection."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from pollux_local.api.errors import NotFound, PermissionDenied
from pollux_local.daemon.auth import (
    Peer,
    account_name,
    is_admin,
    may_act_for,
    may_modify,
    user_name,
)
from pollux_local.daemon.config import DaemonConfig
from pollux_local.daemon.executor import Executor
from pollux_local.daemon.forecasting import Forecasts
from pollux_local.daemon.pacing import LoopShare, Uncharged, UserPacer, give_way
from pollux_local.daemon.readmodel import MetricHistory
from pollux_local.daemon.scheduler import ModelCache
from pollux_local.daemon.state import JobRecord, StateStore

#: Jobs :meth:`Context.jobs_in_parts` reads between two turns of the event loop.
JOBS_AT_ONCE = 500


@dataclass(frozen=True)
class Context:
    """The daemon's parts as a handler sees them, and who is asking (``peer``, from the
    socket's credentials).  ``mutex`` is held by a scheduling pass; a handler that stops or
    restarts jobs takes it too.  ``wake`` asks for a scheduling pass soon."""

    peer: Peer
    store: StateStore
    executor: Executor
    config: DaemonConfig
    state_dir: Path
    clock: Callable[[], float]
    models: ModelCache
    metrics: MetricHistory
    mutex: asyncio.Lock | Uncharged
    wake: Callable[[], None]
    #: the daemon's own uid (it may change every job, as root may)
    daemon_uid: int
    policy_name: str
    #: the scheduling loop's forecasts (``None``: no loop runs)
    forecasts: Forecasts | None = None
    #: ``estimate``'s pacing per user (``None``: unpaced, in tests of one handler)
    estimate_pacer: UserPacer | None = None
    #: the requests' turns per user (``dispatch.in_turns``; ``None``: unpaced, in tests of one
    #: handler)
    read_share: LoopShare | None = None
    #: raises ``LimitExceeded`` while the replies the peer has not read fill their byte
    #: budget (``transport.ConnectionBook.room_for_reply``; ``None``: not checked)
    room_for_reply: Callable[[], None] | None = None
    #: the user database: a uid's account name now, ``None`` when it has none
    #: (``auth.account_name``; a test's fake users)
    accounts: Callable[[int], str | None] = account_name

    def job(self, job_id: str) -> JobRecord:
        """The job with this id (:class:`NotFound` when there is none)."""
        job = self.store.get_job(int(job_id)) if job_id.strip().isdigit() else None
        if job is None:
            raise NotFound(f"no job with id {job_id!r}")
        return job

    def job_without_env(self, job_id: str) -> JobRecord:
        """The job with this id without its environment (:class:`NotFound` when there is
        none): what changing its state needs (an environment of 200,000 variables took 13 ms
        a job to load)."""
        found = self.store.jobs_by_id([int(job_id)]) if job_id.strip().isdigit() else []
        if not found:
            raise NotFound(f"no job with id {job_id!r}")
        return found[0]

    def jobs(self, job_ids: Sequence[str]) -> list[JobRecord]:
        """The jobs with these ids, each once, in the order first named, without their
        environments (:class:`NotFound` for the first id no job has).  One query for them all:
        a request naming one job many times costs what naming it once does."""
        for job_id in job_ids:
            if not job_id.strip().isdigit():
                raise NotFound(f"no job with id {job_id!r}")
        wanted = list(dict.fromkeys(int(job_id) for job_id in job_ids))
        found = {job.id: job for job in self.store.jobs_by_id(sorted(wanted))}
        for number in wanted:
            if number not in found:
                raise NotFound(f"no job with id {str(number)!r}")
        return [found[number] for number in wanted]

    async def jobs_in_parts(self, job_ids: Sequence[str]) -> list[JobRecord]:
        """:meth:`jobs`, read :data:`JOBS_AT_ONCE` ids at a time, the event loop serving the
        others between two (``pacing.give_way``): a request may name 10,000 jobs."""
        wanted = list(dict.fromkeys(job_ids))
        found: list[JobRecord] = []
        for start in range(0, len(wanted), JOBS_AT_ONCE):
            if start:
                await give_way()
            found += self.jobs(wanted[start : start + JOBS_AT_ONCE])
        return list({job.id: job for job in found}.values())  # "7" and "07" name one job

    def is_admin(self) -> bool:
        """Is the caller root, the daemon's user or a member of the admin group?"""
        return is_admin(self.peer, self.config.admin_group, self.daemon_uid)

    def require_priority(self, priority: int, current: int | None = None) -> None:
        """:class:`PermissionDenied` unless the caller may give a job ``priority``: anyone up
        to ``[limits] max_priority`` (default 0), an admin any; lowering a job's priority
        (at most ``current``) never needs an admin."""
        limit = self.config.max_priority
        if priority <= limit or (current is not None and priority <= current):
            return
        if self.is_admin():
            return
        names = list(dict.fromkeys(["root", user_name(self.daemon_uid)]))
        if self.config.admin_group:
            names.append(f"the group {self.config.admin_group}")
        admins = ", ".join(names[:-1]) + (" or " if len(names) > 1 else "") + names[-1]
        raise PermissionDenied(
            f"permission denied: priority {priority} is above {limit}, the highest a user who"
            f" is not an admin may give; ask an admin ({admins})"
        )

    def may_modify(self, job: JobRecord) -> bool:
        """May the caller change the job (its owner, root, the daemon's user or an admin)?"""
        return may_modify(
            self.peer, job.owner_uid, job.owner_name, self.config.admin_group, self.daemon_uid
        )

    def may_act_for(self, job: JobRecord) -> bool:
        """May the caller choose what the job runs as its owner, or read its environment
        (its owner, root or the daemon's user: ``auth.may_act_for``)?"""
        return may_act_for(self.peer, job.owner_uid, job.owner_name, self.daemon_uid)

    def require_acting_for(self, job: JobRecord, what: str) -> None:
        """:class:`PermissionDenied` unless the caller may act for the job's owner."""
        if not self.may_act_for(job):
            raise PermissionDenied(
                f"permission denied: job {job.id} runs as {job.owner_name}; only they (or"
                f" root) may {what}: an admin may hold, cancel or re-prioritise it"
            )

    def require_owner(self, job: JobRecord, verb: str) -> None:
        """:class:`PermissionDenied` unless the caller may ``verb`` the job."""
        if not self.may_modify(job):
            raise PermissionDenied(
                f"permission denied: job {job.id} belongs to {job.owner_name}; "
                f"only its owner or an admin may {verb} it"
            )

    def job_dir(self, job: JobRecord) -> Path:
        return self.state_dir / "jobs" / job.job_id
