"""Talking to the daemon from the CLI, the TUI and jobs: one request, one reply.

``Client(socket_path).request("status")`` returns the reply's fields; a daemon that is not
running, or one that answers ``ok: false``, raises :class:`~pollux_local.errors.PolluxError`
with a one-line message.
"""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path
from typing import Any

from pollux_local.daemon.protocol import PROTOCOL_VERSION, ProtocolError, encode_frame, recv_frame
from pollux_local.errors import PolluxError

STATE_DIR_ENV = "POLLUX_LOCAL_STATE_DIR"
SOCKET_NAME = "daemon.sock"


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


class Client:
    """A synchronous client for the daemon's Unix socket (one connection per request)."""

    def __init__(self, socket_path: str | os.PathLike[str], timeout_s: float = 30.0) -> None:
        self.socket_path = Path(socket_path)
        self.timeout_s = timeout_s

    @classmethod
    def for_state_dir(cls, state_dir: str | os.PathLike[str] | None = None) -> Client:
        return cls(socket_path_for(resolve_state_dir(state_dir)))

    def request(self, type: str, **fields: Any) -> dict[str, Any]:  # noqa: A002 - protocol word
        """Send ``{"v": 1, "type": type, **fields}`` and return the reply (``ok`` is true)."""
        message = {"v": PROTOCOL_VERSION, "type": type, **fields}
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout_s)
        try:
            try:
                sock.connect(str(self.socket_path))
            except (FileNotFoundError, ConnectionRefusedError):
                raise PolluxError(
                    f"no daemon is running at {self.socket_path} "
                    "(start one with `pollux-local daemon`, or pass the right --state-dir)"
                ) from None
            except PermissionError:
                raise PolluxError(
                    f"permission denied on the daemon socket {self.socket_path}"
                ) from None
            try:
                sock.sendall(encode_frame(message))
                reply = recv_frame(sock)
            except TimeoutError:
                raise PolluxError(
                    f"the daemon at {self.socket_path} did not answer within {self.timeout_s:g} s"
                ) from None
            except (ProtocolError, OSError) as exc:
                raise PolluxError(f"lost the connection to the daemon: {exc}") from None
        finally:
            sock.close()
        if not reply.get("ok"):
            raise PolluxError(str(reply.get("error") or "the daemon refused the request"))
        return {k: v for k, v in reply.items() if k not in ("v", "ok")}
