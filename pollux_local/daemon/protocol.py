"""The client <-> daemon wire protocol: length-framed JSON over a Unix socket.

A frame is a 4-byte big-endian length ``n`` followed by ``n`` bytes of UTF-8 JSON holding one
object (``n`` <= :data:`MAX_FRAME_BYTES`).  Requests are ``{"v": 1, "type": T, ...}``; replies
``{"v": 1, "ok": true, ...}`` or ``{"v": 1, "ok": false, "error": "one line"}``.
"""

from __future__ import annotations

import asyncio
import json
import socket
import struct
from collections.abc import Callable, Mapping
from typing import Any

PROTOCOL_VERSION = 1
MAX_FRAME_BYTES = 16 * 1024 * 1024
_HEADER = struct.Struct(">I")


class ProtocolError(Exception):
    """A frame or request that does not follow the protocol (reported back as one line)."""


def encode_frame(message: Mapping[str, Any]) -> bytes:
    """Serialise one message as a length-prefixed frame."""
    body = json.dumps(message, separators=(",", ":"), default=str).encode()
    if len(body) > MAX_FRAME_BYTES:
        raise ProtocolError(
            f"message of {len(body)} bytes exceeds the {MAX_FRAME_BYTES}-byte limit"
        )
    return _HEADER.pack(len(body)) + body


def decode_body(body: bytes) -> dict[str, Any]:
    """Parse a frame body; it must be a JSON object."""
    try:
        message = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ProtocolError(f"frame is not valid UTF-8 JSON ({exc.__class__.__name__})") from None
    if not isinstance(message, dict):
        raise ProtocolError("frame must hold a JSON object")
    return message


def _check_length(length: int) -> None:
    if length > MAX_FRAME_BYTES:
        raise ProtocolError(f"frame length {length} exceeds the {MAX_FRAME_BYTES}-byte limit")


async def read_frame(reader: asyncio.StreamReader, timeout_s: float) -> dict[str, Any] | None:
    """Read one frame; ``None`` on a clean end of stream before a header.

    Raises :class:`ProtocolError` on a truncated frame, an oversize length or bad JSON and
    :class:`TimeoutError` when the peer is silent for ``timeout_s``.
    """
    try:
        header = await asyncio.wait_for(reader.readexactly(_HEADER.size), timeout_s)
    except asyncio.IncompleteReadError as exc:
        if not exc.partial:
            return None
        raise ProtocolError("truncated frame header") from None
    (length,) = _HEADER.unpack(header)
    _check_length(length)
    try:
        body = await asyncio.wait_for(reader.readexactly(length), timeout_s)
    except asyncio.IncompleteReadError:
        raise ProtocolError(f"truncated frame: expected {length} bytes") from None
    return decode_body(body)


def _recv_exact(sock: socket.socket, count: int) -> bytes:
    chunks: list[bytes] = []
    remaining = count
    while remaining:
        chunk = sock.recv(min(remaining, 1 << 20))
        if not chunk:
            raise ProtocolError("connection closed in the middle of a reply")
        chunks.append(chunk)
        remaining -= len(chunk)
    return b"".join(chunks)


def recv_frame(sock: socket.socket) -> dict[str, Any]:
    """Blocking read of one frame from a connected socket (the client side)."""
    (length,) = _HEADER.unpack(_recv_exact(sock, _HEADER.size))
    _check_length(length)
    return decode_body(_recv_exact(sock, length))


# --- request validation --------------------------------------------------------------------

_Check = Callable[[Any], bool]


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_opt_int(value: Any) -> bool:
    return value is None or _is_int(value)


def _is_str(value: Any) -> bool:
    return isinstance(value, str)


def _is_opt_str(value: Any) -> bool:
    return value is None or isinstance(value, str)


def _is_str_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(item, str) for item in value)


def _is_str_map(value: Any) -> bool:
    return isinstance(value, dict) and all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    )


def _is_opt_dict(value: Any) -> bool:
    return value is None or isinstance(value, dict)


def _is_bool(value: Any) -> bool:
    return isinstance(value, bool)


def _is_dict(value: Any) -> bool:
    return isinstance(value, dict)


#: request type -> {field: (required, check, description)}
REQUEST_FIELDS: dict[str, dict[str, tuple[bool, _Check, str]]] = {
    "ping": {},
    "submit": {
        "argv": (True, _is_str_list, "a list of strings"),
        "workdir": (True, _is_str, "a path"),
        "name": (False, _is_opt_str, "a string"),
        "env": (False, _is_str_map, "a string-to-string map"),
        "min_gpus": (False, _is_int, "an integer"),
        "max_gpus": (False, _is_opt_int, "an integer"),
        "batch_size": (False, _is_opt_int, "an integer"),
        "max_batch_size": (False, _is_opt_int, "an integer"),
        "min_local_batch": (False, _is_opt_int, "an integer"),
        "max_local_batch": (False, _is_opt_int, "an integer"),
        "priority": (False, _is_int, "an integer"),
        "target": (False, _is_opt_dict, "an object"),
        "hold": (False, _is_bool, "true or false"),
    },
    "status": {"all": (False, _is_bool, "true or false")},
    "show": {"id": (True, _is_str, "a job id")},
    "logs": {
        "id": (True, _is_str, "a job id"),
        "rank": (False, _is_int, "an integer"),
        "offset": (False, _is_int, "an integer"),
        "max_bytes": (False, _is_int, "an integer"),
    },
    "cancel": {"ids": (True, _is_str_list, "a list of job ids")},
    "hold": {"id": (True, _is_str, "a job id")},
    "release": {"id": (True, _is_str, "a job id")},
    "set_priority": {"id": (True, _is_str, "a job id"), "priority": (True, _is_int, "an integer")},
    "nodes": {},
    "report": {"job_id": (True, _is_str, "a job id"), "report": (True, _is_dict, "an object")},
}


def validate_request(message: Mapping[str, Any]) -> tuple[str, dict[str, Any]]:
    """Check a request's version, type and fields; return ``(type, fields)``."""
    version = message.get("v")
    if version != PROTOCOL_VERSION:
        raise ProtocolError(
            f"unsupported protocol version {version!r} (this daemon speaks {PROTOCOL_VERSION})"
        )
    kind = message.get("type")
    if not isinstance(kind, str) or kind not in REQUEST_FIELDS:
        raise ProtocolError(f"unknown request type {kind!r}")
    schema = REQUEST_FIELDS[kind]
    fields = {k: v for k, v in message.items() if k not in ("v", "type")}
    for name in fields:
        if name not in schema:
            raise ProtocolError(f"{kind}: unexpected field {name!r}")
    for name, (required, check, description) in schema.items():
        if name not in fields:
            if required:
                raise ProtocolError(f"{kind}: missing field {name!r}")
            continue
        if not check(fields[name]):
            raise ProtocolError(f"{kind}: field {name!r} must be {description}")
    return kind, fields


def ok_reply(**fields: Any) -> dict[str, Any]:
    return {"v": PROTOCOL_VERSION, "ok": True, **fields}


def error_reply(message: str) -> dict[str, Any]:
    return {"v": PROTOCOL_VERSION, "ok": False, "error": " ".join(str(message).split())}
