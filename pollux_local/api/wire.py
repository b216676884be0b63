"""Framing and strict (de)coding of the messages in :mod:`pollux_local.api.messages`.

A frame is a 4-byte big-endian length ``n`` followed by ``n`` bytes of UTF-8 JSON holding one
object, ``n <= MAX_FRAME_BYTES``.  Both ends use these functions: the daemon
(:func:`read_frame`, :func:`decode_request`, :func:`encode_reply`, :func:`encode_error`) and the
client (:func:`encode_request`, :func:`recv_frame`, :func:`decode_reply`).
"""

from __future__ import annotations

import asyncio
import socket
import struct
from typing import Any, TypeVar

import msgspec

from pollux_local.api.errors import InvalidRequest, PolluxError, ProtocolError, error_for_code
from pollux_local.api.messages import PROTOCOL_VERSION, REQUEST_TYPES, Reply, Request

MAX_FRAME_BYTES = 16 * 1024 * 1024
#: The most bytes the rows of one page of a paged reply (``status``) take: half a frame, so
#: that the page, whatever its jobs hold, always fits in one.
MAX_PAGE_BYTES = MAX_FRAME_BYTES // 2
HEADER = struct.Struct(">I")

R = TypeVar("R", bound=Reply)

_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder()


def frame(body: bytes) -> bytes:
    """Prefix ``body`` with its length; refuse bodies over the limit."""
    if len(body) > MAX_FRAME_BYTES:
        raise ProtocolError(
            f"message of {len(body)} bytes exceeds the {MAX_FRAME_BYTES}-byte limit"
        )
    return HEADER.pack(len(body)) + body


def encoded_size(message: msgspec.Struct) -> int:
    """The bytes of ``message``'s JSON in a frame."""
    return len(_encoder.encode(message))


def check_length(length: int, limit: int = MAX_FRAME_BYTES) -> None:
    if length > limit:
        raise ProtocolError(f"frame length {length} exceeds the {limit}-byte limit")


def decode_object(body: bytes) -> dict[str, Any]:
    """A frame body as a JSON object (``ProtocolError`` otherwise)."""
    try:
        message = _decoder.decode(body)
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"frame is not valid UTF-8 JSON ({exc})") from None
    except RecursionError:
        raise ProtocolError("frame nests JSON too deeply") from None
    if not isinstance(message, dict):
        raise ProtocolError("frame must hold a JSON object")
    return message


# --- requests ------------------------------------------------------------------------------


def encode_request(request: Request[Any]) -> bytes:
    """A request as a frame."""
    return frame(_encoder.encode(request))


def decode_request(body: bytes) -> Request[Any]:
    """Parse and strictly validate one request frame body.

    Raises :class:`ProtocolError` for a body that is not a JSON object and
    :class:`InvalidRequest` (naming the request type and field) for anything else wrong.
    """
    message = decode_object(body)
    version = message.get("v")
    if version != PROTOCOL_VERSION or isinstance(version, bool):
        raise InvalidRequest(
            f"unsupported protocol version {version!r} (this daemon speaks {PROTOCOL_VERSION})"
        )
    kind = message.get("type")
    cls = REQUEST_TYPES.get(kind) if isinstance(kind, str) else None
    if cls is None:
        shown = kind if isinstance(kind, str) and len(kind) <= 40 else type(kind).__name__
        raise InvalidRequest(f"unknown request type {shown!r}")
    try:
        request: Request[Any] = msgspec.convert(message, cls, strict=True)
    except msgspec.ValidationError as exc:
        raise InvalidRequest(f"{kind}: {exc}") from None
    return request


# --- replies -------------------------------------------------------------------------------


def encode_reply(reply: Reply) -> bytes:
    """``{"v": 1, "ok": true, ...reply}`` as a frame."""
    fields = msgspec.to_builtins(reply)
    return frame(_encoder.encode({"v": PROTOCOL_VERSION, "ok": True, **fields}))


def encode_error(error: PolluxError) -> bytes:
    """``{"v": 1, "ok": false, "code": ..., "error": "one line"}`` as a frame."""
    message = " ".join(str(error).split()) or error.__class__.__name__
    return frame(
        _encoder.encode(
            {"v": PROTOCOL_VERSION, "ok": False, "code": error.code, "error": message[:2000]}
        )
    )


def decode_reply(body: bytes, reply_type: type[R]) -> R:
    """A reply body as ``reply_type``; an error reply raises its typed exception."""
    message = decode_object(body)
    if message.get("ok") is not True:
        raise error_for_code(message.get("code"))(
            str(message.get("error") or "the daemon refused the request")
        )
    fields = {k: v for k, v in message.items() if k not in ("v", "ok")}
    try:
        return msgspec.convert(fields, reply_type, strict=True)
    except msgspec.ValidationError as exc:
        raise ProtocolError(f"unexpected reply from the daemon ({exc})") from None


# --- transport -----------------------------------------------------------------------------


async def read_frame(
    reader: asyncio.StreamReader, timeout_s: float, limit: int = MAX_FRAME_BYTES
) -> bytes | None:
    """Read one frame body; ``None`` on a clean end of stream before a header.

    The whole frame (header and body) must arrive within ``timeout_s``.  Raises
    :class:`ProtocolError` on a truncated frame or an oversize length and
    :class:`TimeoutError` when the frame does not arrive in time.
    """
    async with asyncio.timeout(timeout_s):
        try:
            header = await reader.readexactly(HEADER.size)
        except asyncio.IncompleteReadError as exc:
            if not exc.partial:
                return None
            raise ProtocolError("truncated frame header") from None
        (length,) = HEADER.unpack(header)
        check_length(length, limit)
        try:
            return await reader.readexactly(length)
        except asyncio.IncompleteReadError:
            raise ProtocolError(f"truncated frame: expected {length} bytes") from None


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


def recv_frame(sock: socket.socket) -> bytes:
    """Blocking read of one frame body from a connected socket (the client side)."""
    (length,) = HEADER.unpack(_recv_exact(sock, HEADER.size))
    check_length(length)
    return _recv_exact(sock, length)
