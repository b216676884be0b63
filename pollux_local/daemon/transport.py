"""Transport: frames on the socket, who may connect and how much each may hold.

:class:`Connections` serves each connection as a sequence of frames (``api.wire``), each one
answered by ``respond`` (``dispatch.answer``).  At most ``[limits] connections_per_user``
(16) per user, checked first, then :data:`MAX_CONNECTIONS` in all (root and the daemon's own
user: neither cap; :class:`ConnectionBook`); a connection refused for either gets ``Busy``
(nothing of it read: the client tries again), and at most :data:`MAX_REFUSING` are answered
at once.  A frame may be up to ``wire.MAX_FRAME_BYTES`` (16 MiB: a
submit's environment, a long report) for anyone, because its type is only known once it is
read; what bounds memory is the budget of bytes in flight: the declared length of a frame over
:data:`FREE_FRAME_BYTES` is reserved from its user's budget (``[limits]
mib_in_flight_per_user``, 32 MiB) and from the daemon's (:data:`MAX_BYTES_IN_FLIGHT`) before
its body is read, and given back once it is answered; a frame that does not fit is refused
(``LimitExceeded``; its body read and dropped, never kept) and its connection closed.
Smaller frames are bounded by the connection caps, so a user whose budget is full may still
ask.  A frame's first byte must come within :data:`IDLE_TIMEOUT_S`, the rest of it within
:data:`FRAME_DEADLINE_S`; a reply the client does not read within :data:`REPLY_TIMEOUT_S`
closes the connection.  Bodies over :data:`SMALL_FRAME_BYTES` are read into an anonymous
mapping, returned to the system as soon as the request is answered.  Who connects is known
from the socket's peer credentials (``auth.peer_credentials``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import mmap
import time
from collections.abc import Awaitable, Callable, Iterator

from pollux_local.api import wire
from pollux_local.api.errors import (
    Busy,
    LimitExceeded,
    PermissionDenied,
    PolluxError,
    ProtocolError,
)
from pollux_local.daemon.auth import Peer, may_connect, peer_credentials, refusal
from pollux_local.daemon.context import Context

log = logging.getLogger("pollux_local.daemon")

#: A connection silent for this long between frames is closed (a stuck client holds nothing).
IDLE_TIMEOUT_S = 30.0
#: Once a frame's first byte came, the rest of it (header and body) must come within this.
FRAME_DEADLINE_S = 20.0
#: A reply the client does not take within this closes its connection.
REPLY_TIMEOUT_S = 30.0
#: A refused connection's request is read and dropped, this much and this long at most.
REFUSED_DRAIN_BYTES = 64 * 1024
REFUSED_DRAIN_S = 1.0
#: Connections served at once, all capped users together (root's and the daemon's user's are
#: not counted: an admin still gets in while others fill it).
MAX_CONNECTIONS = 256
#: Connections being refused at once (each answered with its one-line error, then drained for
#: at most :data:`REFUSED_DRAIN_S`); past it a refused connection is closed unanswered, so
#: that a user's flood of refused connections holds neither the served ones' slots nor more
#: than this many of the daemon's descriptors for long.
MAX_REFUSING = 32
#: ... and at most this many of one user's (one user's flood must not take the answers of
#: the others' refusals, which their clients try again on).
MAX_REFUSING_PER_USER = 4
#: Request bytes the daemon buffers at once, all users together.
MAX_BYTES_IN_FLIGHT = 256 * 1024 * 1024
#: Frames up to this size are not counted against the byte budgets (their memory is bounded by
#: the connection caps), so that a user whose budget large frames fill may still ping and ask.
FREE_FRAME_BYTES = 64 * 1024
#: Bodies larger than this are read into an anonymous mapping (unmapped once answered).
SMALL_FRAME_BYTES = 1024 * 1024
_CHUNK = 256 * 1024


# --- connections: who may hold how much --------------------------------------------------------


class ConnectionBook:
    """Connections open and request bytes in flight, per user and in all.  ``unlimited`` uids
    (root, the daemon's user) have no per-user connection cap; every user has a byte budget."""

    def __init__(
        self,
        per_user: int,
        per_user_bytes: int,
        total_bytes: int = MAX_BYTES_IN_FLIGHT,
        unlimited: frozenset[int] = frozenset(),
    ) -> None:
        self.per_user = per_user
        self.per_user_bytes = per_user_bytes
        self.total_bytes = total_bytes
        self.unlimited = unlimited
        self.connections: dict[int, int] = {}
        self.bytes: dict[int, int] = {}
        self.bytes_total = 0
        #: bytes of replies over :data:`FREE_FRAME_BYTES` each user has not taken yet
        self.replies: dict[int, int] = {}

    def open(self, uid: int) -> bool:
        """Count a new connection of ``uid``; False (not counted) when over its cap."""
        count = self.connections.get(uid, 0)
        if count >= self.per_user and uid not in self.unlimited:
            return False
        self.connections[uid] = count + 1
        return True

    def close(self, uid: int) -> None:
        count = self.connections.get(uid, 0) - 1
        if count > 0:
            self.connections[uid] = count
        else:
            self.connections.pop(uid, None)

    @contextlib.contextmanager
    def reserve(self, uid: int, name: str, nbytes: int) -> Iterator[None]:
        """Hold ``nbytes`` of ``uid``'s budget and the daemon's for the block
        (:class:`LimitExceeded` when either would be exceeded)."""
        held = self.bytes.get(uid, 0)
        if held + nbytes > self.per_user_bytes:
            raise LimitExceeded(
                f"{name} has {held} bytes of requests in flight; this {nbytes}-byte one would"
                f" pass the {self.per_user_bytes}-byte cap per user: try again later"
            )
        if self.bytes_total + nbytes > self.total_bytes:
            raise LimitExceeded("the daemon is busy reading other requests; try again later")
        self.bytes[uid] = held + nbytes
        self.bytes_total += nbytes
        try:
            yield
        finally:
            _give_back(self.bytes, uid, nbytes)
            self.bytes_total -= nbytes

    @contextlib.contextmanager
    def hold_reply(self, uid: int, nbytes: int) -> Iterator[None]:
        """Count ``nbytes`` of a reply to ``uid`` as theirs while it is being sent (never
        refused: it is computed already; :meth:`room_for_reply` refuses their next request
        instead)."""
        self.replies[uid] = self.replies.get(uid, 0) + nbytes
        try:
            yield
        finally:
            _give_back(self.replies, uid, nbytes)

    def room_for_reply(self, uid: int, name: str) -> None:
        """:class:`LimitExceeded` while the replies ``uid`` has not taken fill their byte
        budget (review s68: a reply the client does not read is kept for
        :data:`REPLY_TIMEOUT_S`, and a log of NULs is a 6 MiB one that anyone may ask for:
        16 connections held 208 MiB).  Checked in the user's turn, before anything of the
        request is done, so one user keeps at most their budget and one reply."""
        held = self.replies.get(uid, 0)
        if held and held >= self.per_user_bytes:
            raise LimitExceeded(
                f"{name} has {held} bytes of replies not yet read, the {self.per_user_bytes}"
                "-byte cap per user: read them (or close those connections) and try again"
            )


def _give_back(counts: dict[int, int], uid: int, nbytes: int) -> None:
    """Take ``nbytes`` off ``uid``'s count in ``counts``; a count that reaches 0 goes."""
    left = counts.get(uid, 0) - nbytes
    if left > 0:
        counts[uid] = left
    else:
        counts.pop(uid, None)


async def read_header(
    reader: asyncio.StreamReader, idle_s: float, frame_s: float
) -> tuple[int, float] | None:
    """A frame's declared length and the loop time by which all of it must have come
    (``None``: the stream ended cleanly between frames).  Its first byte must come within
    ``idle_s``; the rest of the frame, header and body, within ``frame_s`` of it."""
    async with asyncio.timeout(idle_s):
        first = await reader.read(1)
    if not first:
        return None
    deadline = asyncio.get_running_loop().time() + frame_s
    async with asyncio.timeout_at(deadline):
        try:
            rest = await reader.readexactly(wire.HEADER.size - 1)
        except asyncio.IncompleteReadError:
            raise ProtocolError("truncated frame header") from None
    (length,) = wire.HEADER.unpack(first + rest)
    wire.check_length(length)
    return length, deadline


async def discard(reader: asyncio.StreamReader, length: int) -> None:
    """Read and drop ``length`` bytes (a refused frame's body: the client that sent it whole
    then reads its error), keeping none of them."""
    while length > 0:
        chunk = await reader.read(min(_CHUNK, length))
        if not chunk:
            return
        length -= len(chunk)


async def read_body(reader: asyncio.StreamReader, length: int) -> bytes | mmap.mmap:
    """``length`` bytes of body: small ones as bytes, larger ones in an anonymous mapping
    (the caller closes it)."""
    if length <= SMALL_FRAME_BYTES:
        try:
            return await reader.readexactly(length)
        except asyncio.IncompleteReadError:
            raise ProtocolError(f"truncated frame: expected {length} bytes") from None
    buffer = mmap.mmap(-1, length)
    try:
        position = 0
        while position < length:
            chunk = await reader.read(min(_CHUNK, length - position))
            if not chunk:
                raise ProtocolError(f"truncated frame: expected {length} bytes")
            buffer[position : position + len(chunk)] = chunk
            position += len(chunk)
    except BaseException:
        buffer.close()
        raise
    return buffer


class Connections:
    """The connections of one daemon: counted, capped and served (``serve`` is the socket
    server's callback).  ``context_for`` gives a peer's handler context, ``respond`` answers
    one request frame, ``allow_group`` reads the config's ``allow_group`` as it is now."""

    def __init__(
        self,
        book: ConnectionBook,
        daemon_uid: int,
        context_for: Callable[[Peer], Context],
        respond: Callable[[Context, bytes | mmap.mmap], Awaitable[bytes]],
        allow_group: Callable[[], str | None],
    ) -> None:
        self.book = book
        self.daemon_uid = daemon_uid
        self.context_for = context_for
        self.respond = respond
        self.allow_group = allow_group
        #: connections served now, of the users with a per-user cap
        self.count = 0
        #: connections being refused now (:meth:`refuse`), in all and per user
        self.refusing = 0
        self.refusing_by: dict[int, int] = {}
        #: when each user's last refusal was logged (monotonic seconds)
        self.refusals: dict[int, float] = {}

    def note_refusal(self, peer: Peer, why: str) -> None:
        """Log a refused connection, at most once a minute per user (a flood stays short)."""
        now = time.monotonic()
        if now - self.refusals.get(peer.uid, -120.0) >= 60.0:
            self.refusals[peer.uid] = now
            log.warning(
                "refused a connection of %s (uid %d, pid %d): %s",
                peer.name,
                peer.uid,
                peer.pid,
                why,
            )

    @staticmethod
    async def send(writer: asyncio.StreamWriter, data: bytes) -> bool:
        """Write one frame; False (the connection aborted) when the client does not take it
        within :data:`REPLY_TIMEOUT_S`."""
        try:
            async with asyncio.timeout(REPLY_TIMEOUT_S):
                # a part at a time: a client that does not read holds one part in the
                # transport's buffer, not a second copy of the whole reply
                view = memoryview(data)
                for start in range(0, len(view), _CHUNK):
                    writer.write(view[start : start + _CHUNK])
                    await writer.drain()
            return True
        except (TimeoutError, ConnectionError, OSError):
            writer.transport.abort()
            return False

    async def refuse(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        error: PolluxError,
        uid: int,
    ) -> None:
        """Refuse a connection before reading its request: the error, then what the client
        sends is taken and dropped (at most :data:`REFUSED_DRAIN_BYTES`, for at most
        :data:`REFUSED_DRAIN_S`) so that its request does not meet a closed socket before it
        reads the error.  With :data:`MAX_REFUSING` already being refused, or
        :data:`MAX_REFUSING_PER_USER` of ``uid``'s, it is closed at once, unanswered."""
        mine = self.refusing_by.get(uid, 0)
        if self.refusing >= MAX_REFUSING or mine >= MAX_REFUSING_PER_USER:
            writer.transport.abort()
            return
        self.refusing += 1
        self.refusing_by[uid] = mine + 1
        try:
            if not await self.send(writer, wire.encode_error(error)):
                return
            with contextlib.suppress(TimeoutError, ConnectionError, OSError):
                writer.write_eof()
                async with asyncio.timeout(REFUSED_DRAIN_S):
                    left = REFUSED_DRAIN_BYTES
                    while left > 0 and (chunk := await reader.read(left)):
                        left -= len(chunk)
        finally:
            self.refusing -= 1
            left = self.refusing_by[uid] - 1
            if left:
                self.refusing_by[uid] = left
            else:
                del self.refusing_by[uid]

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Answer a connection's requests in order until it closes, goes silent, is refused
        (who it is, too many connections, too many bytes in flight) or sends a frame that
        breaks the framing: the refusal is answered as one typed error, then it is closed.
        Who connects is known first: a user over their own cap is refused without taking a
        place among the connections served (:data:`MAX_CONNECTIONS`), so one user's flood
        cannot keep the others out."""
        uid: int | None = None
        served = False
        try:
            try:
                peer = peer_credentials(writer.get_extra_info("socket"))
            except OSError:
                return
            if not may_connect(peer, self.daemon_uid, self.allow_group()):
                why = refusal(peer, self.daemon_uid, self.allow_group())
                self.note_refusal(peer, why)
                await self.refuse(reader, writer, PermissionDenied(why), peer.uid)
                return
            if not self.book.open(peer.uid):
                self.note_refusal(peer, "too many connections")
                error = Busy(
                    f"too many connections from {peer.name} (at most {self.book.per_user} at"
                    " once); close some and try again"
                )
                await self.refuse(reader, writer, error, peer.uid)
                return
            uid = peer.uid
            if peer.uid not in self.book.unlimited:
                if self.count >= MAX_CONNECTIONS:
                    self.note_refusal(peer, f"the daemon serves {MAX_CONNECTIONS} connections")
                    error = Busy("too many connections; try again")
                    await self.refuse(reader, writer, error, peer.uid)
                    return
                self.count += 1
                served = True
            ctx = self.context_for(peer)
            while True:
                try:
                    header = await read_header(reader, IDLE_TIMEOUT_S, FRAME_DEADLINE_S)
                    if header is None:
                        return
                    if not may_connect(peer, self.daemon_uid, self.allow_group()):
                        # a reload narrowed allow_group, or the user left the group (seen
                        # within auth.GROUP_CACHE_S): an open connection ends as a new one
                        # would be refused, at its next request
                        raise PermissionDenied(refusal(peer, self.daemon_uid, self.allow_group()))
                    length, deadline = header
                    counted = length if length > FREE_FRAME_BYTES else 0
                    with self.book.reserve(peer.uid, peer.name, counted):
                        async with asyncio.timeout_at(deadline):
                            body = await read_body(reader, length)
                        try:
                            reply = await self.respond(ctx, body)
                        finally:
                            if isinstance(body, mmap.mmap):
                                with contextlib.suppress(BufferError):
                                    body.close()
                            del body
                except LimitExceeded as exc:  # over a byte budget: its body is not kept
                    if await self.send(writer, wire.encode_error(exc)):
                        with contextlib.suppress(TimeoutError, ConnectionError, OSError):
                            async with asyncio.timeout_at(deadline):
                                await discard(reader, length)
                    return
                except PolluxError as exc:
                    await self.send(writer, wire.encode_error(exc))
                    return
                except (TimeoutError, ConnectionError):
                    return
                # counted as the user's until taken; not kept while the connection idles
                counted = len(reply) if len(reply) > FREE_FRAME_BYTES else 0
                with self.book.hold_reply(peer.uid, counted):
                    sent = await self.send(writer, reply)
                del reply
                if not sent:
                    return
        except (ConnectionError, OSError):
            pass
        finally:
            if served:
                self.count -= 1
            if uid is not None:
                self.book.close(uid)
            with contextlib.suppress(Exception):
                writer.close()
