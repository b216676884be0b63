"""Where the TUI gets its data: the daemon (:class:`DaemonSource`) or recorded replies
(:class:`FixedSource`).

Both answer ``call(request) -> reply`` with the typed messages of :mod:`pollux_local.api`
(``call(api.Status())`` returns an ``api.StatusReply``) and fail with the api's errors, told
apart by class: :class:`~pollux_local.api.DaemonUnavailable` when no daemon answers (the view
says the daemon is down and keeps retrying), any other
:class:`~pollux_local.api.PolluxError` when the daemon refused the request or its reply did
not validate (shown as an error).  The calls block, so the app makes them from worker threads.
This module does not import textual.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol, TypeVar, cast

import msgspec

from pollux_local.api import wire
from pollux_local.api.errors import (
    Conflict,
    DaemonUnavailable,
    InvalidRequest,
    NotFound,
    PolluxError,
)
from pollux_local.api.messages import (
    BatchBoundsView,
    Cancel,
    CancelReply,
    Hold,
    Identity,
    JobDetail,
    JobSummary,
    Logs,
    LogsReply,
    Nodes,
    NodesReply,
    Ping,
    PingReply,
    PriorityReply,
    Release,
    Reply,
    Request,
    SetPriority,
    Show,
    ShowReply,
    SkippedJob,
    StateChangeReply,
    Status,
    StatusReply,
    Submit,
    SubmitReply,
    Usage,
    UsageReply,
)
from pollux_local.api.states import PLACED_STATES, JobState
from pollux_local.client import Client
from pollux_local.tui.recording import Recording

R = TypeVar("R", bound=Reply)


class DataSource(Protocol):
    """Anything that answers the daemon's typed requests."""

    description: str

    def call(self, request: Request[R]) -> R: ...


class DaemonSource:
    """Talks to a running daemon through :class:`pollux_local.client.Client`.

    A connection per request, so that a daemon restart is picked up by the next refresh.
    """

    def __init__(
        self,
        socket_path: str | Path,
        client_factory: Callable[[Path], Client] | None = None,
        timeout_s: float = 10.0,
    ) -> None:
        self.socket_path = Path(socket_path)
        self.description = str(self.socket_path)
        self._client_factory = client_factory or (lambda path: Client(path, timeout_s=timeout_s))

    def call(self, request: Request[R]) -> R:
        try:
            return self._client_factory(self.socket_path).call(request)
        except OSError as exc:  # e.g. a socket path too long to connect to
            raise DaemonUnavailable(
                f"cannot reach the daemon at {self.socket_path}: {exc}"
            ) from exc


# --------------------------------------------------------------------------------------------
# Recorded replies
# --------------------------------------------------------------------------------------------

#: What ``FixedSource`` says its socket is (in the "daemon down" line).
FIXED_SOCKET = "/fixed/daemon.sock"
#: Who submits the jobs submitted to a ``FixedSource``.
FIXED_USER = Identity(uid=1000, name="you")


#: finished jobs a plain ``status`` still lists (the daemon's default window)
RECENT_WINDOW_S = 24 * 3600.0


class FixedSource:
    """Serves recorded replies (:class:`~pollux_local.tui.recording.Recording`): tests,
    screenshots, benchmarks and ``pollux-local tui --demo``.

    Every request is kept in ``calls`` and checked as the daemon checks it (encoded, then
    decoded with :func:`pollux_local.api.wire.decode_request`), so a request the daemon would
    refuse is refused here too (:class:`~pollux_local.api.InvalidRequest`); every reply goes
    through :func:`~pollux_local.api.wire.decode_reply` as the client's does.  Actions
    (``cancel``, ``hold``, ``release``, ``set_priority``, ``submit``) change the served data as
    the daemon would, so that the next refresh shows them; ``logs`` serves byte ranges of the
    recorded log (:meth:`append_log` adds to it); ``usage`` serves the recorded accounting (its
    period whatever the request asks, only the user asked for when one is).  ``down`` makes
    every request raise
    :class:`~pollux_local.api.DaemonUnavailable`; ``fail`` maps a request class to the error it
    is refused with.  With ``now``, the recording's times are shifted so it was taken ``now``.
    """

    def __init__(
        self,
        recording: Recording,
        *,
        now: float | None = None,
        description: str = "fixed data",
    ) -> None:
        data = recording.shifted(now) if now is not None else recording.copy()
        self.recording = data
        self.status: StatusReply = data.status
        #: the recording's "now": finished jobs within a day of it are recent, as in the daemon
        self.now = now if now is not None else data.recorded_at
        self.nodes: NodesReply = data.nodes
        self.usage: UsageReply | None = data.usage
        self.shows: dict[str, ShowReply] = data.shows
        self.logs: dict[str, bytes] = {k: v.data.encode() for k, v in data.logs.items()}
        self.description = description
        self.calls: list[Request[Any]] = []
        self.down = False
        self.fail: dict[type[Request[Any]], PolluxError] = {}
        self._lock = threading.Lock()

    # -- the source

    def call(self, request: Request[R]) -> R:
        with self._lock:
            self.calls.append(request)
            if self.down:
                raise DaemonUnavailable(f"no daemon is running at {FIXED_SOCKET}")
            checked = wire.decode_request(msgspec.json.encode(request))
            error = self.fail.get(type(request))
            if error is not None:
                raise error
            reply = self._answer(checked)
            body = wire.encode_reply(reply)[wire.HEADER.size :]
        return cast(R, wire.decode_reply(body, type(request).Reply))

    def append_log(self, job_id: str, text: str) -> None:
        """Append ``text`` to rank 0's log of ``job_id`` (as a running job would)."""
        with self._lock:
            self.logs[job_id] = self.logs.get(job_id, b"") + text.encode()

    def job(self, job_id: str) -> JobSummary:
        """The served ``status`` row of ``job_id``."""
        for job in self.status.jobs:
            if job.id == job_id:
                return job
        raise NotFound(f"no job with id {job_id}")

    # -- answers

    def _answer(self, request: Request[Any]) -> Reply:
        match request:
            case Ping():
                return PingReply(
                    version=request.v,
                    pid=0,
                    state_dir=str(Path(FIXED_SOCKET).parent),
                    devices=sum(len(node.devices) for node in self.nodes.nodes),
                    policy="recorded",
                    you=FIXED_USER,
                )
            case Status(all=every, user=user, states=states):
                recent = self.now - RECENT_WINDOW_S
                jobs = [
                    j
                    for j in self.status.jobs
                    if (every or j.state.active or (j.end_time or 0.0) >= recent)
                    and (user is None or j.owner == user)
                    and (states is None or j.state in states)
                ]
                return StatusReply(jobs=jobs)
            case Nodes():
                return self.nodes
            case Show(id=job_id):
                return self._show(job_id)
            case Logs():
                return self._logs(request)
            case Cancel(ids=ids):
                jobs = [self.job(job_id) for job_id in ids]
                cancelled, skipped = [], []
                for job in jobs:
                    if job.state.terminal:
                        skipped.append(SkippedJob(id=job.id, state=job.state))
                    else:
                        self._stop(job, JobState.CANCELLED, "cancelled")
                        cancelled.append(job.id)
                return CancelReply(cancelled=cancelled, skipped=skipped)
            case Hold(id=str() as job_id):
                job = self.job(job_id)
                if job.state.terminal:
                    raise Conflict(f"job {job_id} has already {job.state}")
                self._stop(job, JobState.HELD, "held")
                return StateChangeReply(state=job.state, ids=[job_id])
            case Release(id=str() as job_id):
                job = self.job(job_id)
                if job.state != JobState.HELD:
                    raise Conflict(f"job {job_id} is not held (it is {job.state})")
                job.state, job.reason = JobState.QUEUED, "released"
                return StateChangeReply(state=job.state, ids=[job_id])
            case SetPriority(id=job_id, priority=priority):
                self.job(job_id).priority = priority
                return PriorityReply(id=job_id, priority=priority)
            case Submit():
                return self._submit(request)
            case Usage(user=user):
                return self._usage(user)
        raise InvalidRequest(f"fixed data does not answer {type(request).__name__} requests")

    def _usage(self, user: str | None) -> UsageReply:
        if self.usage is None:
            raise InvalidRequest("this recording has no usage reply")
        if user is None:
            return self.usage
        rows = [row for row in self.usage.users if row.user == user]
        total = rows[0] if rows else msgspec.structs.replace(
            self.usage.total, device_hours=0.0, by_type={}, jobs=0, succeeded=0, failed=0,
            cancelled=0, running=0,
        )  # fmt: skip
        return UsageReply(users=rows, total=msgspec.structs.replace(total, user="*"),
                          since=self.usage.since)  # fmt: skip

    def _stop(self, job: JobSummary, state: JobState, reason: str) -> None:
        """``job`` leaves its devices and becomes ``state``."""
        if job.state in PLACED_STATES:
            for node in self.nodes.nodes:
                node.jobs = {d: j for d, j in node.jobs.items() if j != job.id}
        job.state, job.reason = state, reason
        if state.terminal:
            job.end_time = self.now
        job.devices, job.nodes, job.gpus, job.replicas = {}, [], 0, 0
        job.local_batch = job.accum_steps = None
        job.goodput = job.efficiency = job.speedup = job.eta_s = None

    def _show(self, job_id: str) -> ShowReply:
        job = self.job(job_id)
        summary = {name: getattr(job, name) for name in JobSummary.__struct_fields__}
        shown = self.shows.get(job_id)
        if shown is None:  # submitted here: nothing known about it but its row
            detail = JobDetail(
                **summary,
                argv=[],
                workdir="/",
                batch_bounds=BatchBoundsView(
                    batch_size=job.batch_size,
                    max_batch_size=None,
                    min_local_batch=None,
                    max_local_batch=None,
                ),
                job_dir=f"{Path(FIXED_SOCKET).parent}/jobs/{job_id}",
                pids=[],
                report=None,
                noise_scale=None,
                model=None,
                history=[],
            )
            return ShowReply(job=detail, decisions=[])
        return ShowReply(
            job=msgspec.structs.replace(shown.job, **summary), decisions=shown.decisions
        )

    def _logs(self, request: Logs) -> LogsReply:
        job = self.job(request.id)
        data = self.logs.get(request.id, b"") if request.rank == 0 else b""
        size = len(data)
        start = max(0, size + request.offset) if request.offset < 0 else min(request.offset, size)
        chunk = data[start : start + request.max_bytes]
        return LogsReply(
            data=chunk.decode(errors="replace"),
            offset=start + len(chunk),
            size=size,
            state=job.state,
        )

    def _submit(self, request: Submit) -> SubmitReply:
        job_id = str(max((int(j.id) for j in self.status.jobs), default=0) + 1)
        state = JobState.HELD if request.hold else JobState.QUEUED
        script = next((Path(a).name for a in request.argv if a.endswith(".py")), request.argv[0])
        self.status.jobs.append(
            JobSummary(
                id=job_id,
                name=request.name or Path(script).stem or script,
                owner=FIXED_USER.name,
                state=state,
                gpus=0,
                devices={},
                nodes=[],
                batch_size=request.batch_size,
                local_batch=None,
                accum_steps=None,
                replicas=0,
                goodput=None,
                efficiency=None,
                speedup=None,
                progress=None,
                epoch=None,
                metrics={},
                eta_s=None,
                min_gpus=request.min_gpus,
                max_gpus=request.max_gpus,
                priority=request.priority,
                restarts=0,
                failures=0,
                submit_time=self.recording.recorded_at,
                start_time=None,
                end_time=None,
                run_time_s=0.0,
                reason="",
                target=request.target,
                elastic=request.elastic,
                preemptible=request.preemptible,
            )
        )
        return SubmitReply(id=job_id, state=state)
