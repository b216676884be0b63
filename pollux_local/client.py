"""Talking to the daemon from the CLI, the TUI and jobs: one typed request, one typed reply.

``Client(socket_path).call(api.Status())`` returns an ``api.StatusReply``.  A daemon that is not
there raises :class:`~pollux_local.api.DaemonUnavailable`; one that refuses the request raises
the typed error of its reply (``NotFound``, ``PermissionDenied``, ``InvalidRequest``, ...).
The client depends on :mod:`pollux_local.api` only, never on the daemon.
"""

from __future__ import annotations

import os
import random
import socket
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar, cast

import msgspec

from pollux_local.api import wire
from pollux_local.api.errors import Busy, DaemonUnavailable, InvalidRequest, ProtocolError
from pollux_local.api.messages import (
    REQUEST_TYPES,
    JobSummary,
    Reply,
    Request,
    Status,
    StatusReply,
)
from pollux_local.api.states import JobState

STATE_DIR_ENV = "POLLUX_LOCAL_STATE_DIR"
SOCKET_NAME = "daemon.sock"
#: A connection refused unread (``Busy``) is tried this often in all, the pauses between
#: doubling from this (each drawn from half to one and a half of it): about 6 s in all.
BUSY_TRIES = 7
BUSY_FIRST_PAUSE_S = 0.1

R = TypeVar("R", bound=Reply)


def default_state_dir() -> Path:
    """The platform's conventional per-user state directory for pollux-local."""
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Application Support" / "pollux-local"
    xdg = os.environ.get("XDG_STATE_HOME")
    base = Path(xdg) if xdg else Path.home() / ".local" / "state"
    return base / "pollux-local"


def resolve_state_dir(explicit: str | os.PathLike[str] | None = None) -> Path:
    """``--state-dir`` if given, else ``$POLLUX_LOCAL_STATE_DIR``, else :func:`default_state_dir`."""
    if explicit:
        return Path(explicit).expanduser().absolute()
    from_env = os.environ.get(STATE_DIR_ENV)
    if from_env:
        return Path(from_env).expanduser().absolute()
    return default_state_dir()


def socket_path_for(state_dir: Path) -> Path:
    return state_dir / SOCKET_NAME


def build_request(type: str, **fields: Any) -> Request[Any]:  # noqa: A002 - the protocol's word
    """The typed request ``type`` with ``fields``, validated as the daemon would."""
    cls = REQUEST_TYPES.get(type)
    if cls is None:
        raise InvalidRequest(f"unknown request type {type!r}")
    try:
        request: Request[Any] = msgspec.convert(fields, cls, strict=True)
    except msgspec.ValidationError as exc:
        raise InvalidRequest(f"{type}: {exc}") from None
    return request


class Client:
    """A synchronous client for the daemon's Unix socket (one connection per request)."""

    def __init__(self, socket_path: str | os.PathLike[str], timeout_s: float = 30.0) -> None:
        self.socket_path = Path(socket_path)
        self.timeout_s = timeout_s

    @classmethod
    def for_state_dir(cls, state_dir: str | os.PathLike[str] | None = None) -> Client:
        return cls(socket_path_for(resolve_state_dir(state_dir)))

    def call(self, request: Request[R]) -> R:
        """Send one typed request and return its typed reply (``type(request).Reply``).  A
        connection the daemon refused unread (:class:`Busy`: too many connections) is tried
        again after a pause, growing from :data:`BUSY_FIRST_PAUSE_S` to at most
        :data:`BUSY_TRIES` tries."""
        pause = BUSY_FIRST_PAUSE_S
        for _ in range(BUSY_TRIES - 1):
            try:
                return self._call_once(request)
            except Busy:
                time.sleep(pause * (0.5 + random.random()))
                pause *= 2.0
        return self._call_once(request)

    def _call_once(self, request: Request[R]) -> R:
        expected = cast(type[R], type(request).Reply)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout_s)
        try:
            try:
                sock.connect(str(self.socket_path))
            except (FileNotFoundError, ConnectionRefusedError):
                raise DaemonUnavailable(
                    f"no daemon is running at {self.socket_path} "
                    "(start one with `pollux-local daemon`, or pass the right --state-dir)"
                ) from None
            except PermissionError:
                raise DaemonUnavailable(
                    f"permission denied on the daemon socket {self.socket_path}"
                ) from None
            try:
                sock.sendall(wire.encode_request(request))
                body = wire.recv_frame(sock)
            except TimeoutError:
                raise DaemonUnavailable(
                    f"the daemon at {self.socket_path} did not answer within {self.timeout_s:g} s"
                ) from None
            except (ProtocolError, OSError) as exc:
                raise DaemonUnavailable(f"lost the connection to the daemon: {exc}") from None
        finally:
            sock.close()
        return wire.decode_reply(body, expected)

    def request(self, type: str, **fields: Any) -> dict[str, Any]:  # noqa: A002
        """Untyped convenience for scripts and tests: ``call(build_request(type, **fields))``
        with the reply as plain JSON-like data."""
        reply: Reply = self.call(build_request(type, **fields))
        return cast(dict[str, Any], msgspec.to_builtins(reply))


#: Jobs one ``status`` request asks for (the daemon's default page).
STATUS_PAGE = 1000
#: The states of jobs that have not ended, and of those that have.
ACTIVE_STATES = tuple(state for state in JobState if state.active)
FINISHED_STATES = tuple(state for state in JobState if not state.active)


def status_pages(
    call: Callable[[Status], StatusReply], request: Status, rows: int | None = None
) -> StatusReply:
    """``request``'s pages, newest first, until ``rows`` jobs (``None``: every page), as one
    reply: the jobs oldest first, with ``more``, ``hidden`` and ``next_before_id`` of the
    last page read.  A page can hold fewer jobs than asked: the daemon ends one once its
    rows take ``wire.MAX_PAGE_BYTES``."""
    jobs: list[JobSummary] = []
    page = msgspec.structs.replace(request)
    while True:
        if rows is not None:
            page.limit = max(1, min(page.limit, rows - len(jobs)))
        reply = call(page)
        jobs[:0] = reply.jobs
        done = rows is not None and len(jobs) >= rows
        if done or not reply.more or not reply.next_before_id or not reply.jobs:
            return msgspec.structs.replace(reply, jobs=jobs)
        page = msgspec.structs.replace(page, before_id=reply.next_before_id)


def job_list(
    call: Callable[[Status], StatusReply],
    *,
    user: str | None = None,
    group: str | None = None,
    states: Sequence[JobState] | None = None,
    limit: int | None = None,
    every: bool = False,
) -> StatusReply:
    """What ``status`` and the terminal view list, oldest first.

    With ``limit``: the newest ``limit`` jobs that match (``every``: finished ones of any
    age too); ``every`` alone: all of them.  By default every active job that matches,
    however many, and the newest :data:`STATUS_PAGE` of those that finished in the last 24
    hours: a page of the newest jobs alone let one user's 1,000 held tasks push every other
    user's running job off everyone's list (review s60).  ``more`` and ``hidden`` then count
    finished jobs left out."""

    def ask(chosen: Sequence[JobState] | None, rows: int | None) -> StatusReply:
        request = Status(
            all=every,
            user=user,
            group=group,
            states=list(chosen) if chosen is not None else None,
            limit=min(rows or STATUS_PAGE, STATUS_PAGE),
        )
        return status_pages(call, request, rows)

    if every or limit is not None:
        return ask(states, limit)
    wanted = list(states) if states is not None else list(JobState)
    active = [state for state in wanted if state in ACTIVE_STATES]
    finished = [state for state in wanted if state in FINISHED_STATES]
    running = ask(active, None) if active else StatusReply(jobs=[])
    ended = ask(finished, STATUS_PAGE) if finished else StatusReply(jobs=[])
    # (a job that ended between the two requests is in both: its end is the newer)
    latest = {job.id: job for job in [*running.jobs, *ended.jobs]}
    jobs = sorted(latest.values(), key=lambda job: int(job.id))
    return msgspec.structs.replace(ended, jobs=jobs)
