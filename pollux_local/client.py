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
from pathlib import Path
from typing import Any, TypeVar, cast

import msgspec

from pollux_local.api import wire
from pollux_local.api.errors import Busy, DaemonUnavailable, InvalidRequest, ProtocolError
from pollux_local.api.messages import REQUEST_TYPES, Reply, Request

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
