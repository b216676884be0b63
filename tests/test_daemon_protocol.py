"""Framing, request validation, and a live daemon fed garbage."""

from __future__ import annotations

import asyncio
import os
import socket
import struct
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import psutil
import pytest
import pytest_asyncio

from pollux_local.client import Client
from pollux_local.core.types import Decision
from pollux_local.daemon.config import DaemonConfig, NodeConfig
from pollux_local.daemon.protocol import (
    MAX_FRAME_BYTES,
    ProtocolError,
    decode_body,
    encode_frame,
    validate_request,
)
from pollux_local.daemon.server import Daemon
from pollux_local.errors import PolluxError

pytestmark = pytest.mark.timeout(60)


class IdlePolicy:
    """Never runs anything: these tests only exercise the socket."""

    name = "idle"

    def decide(self, jobs, nodes, now, rng: np.random.Generator) -> Decision:  # type: ignore[no-untyped-def]
        return Decision(placements={j.id: (0,) * len(nodes) for j in jobs})


def test_frame_round_trip() -> None:
    frame = encode_frame({"v": 1, "type": "ping"})
    (length,) = struct.unpack(">I", frame[:4])
    assert length == len(frame) - 4
    assert decode_body(frame[4:]) == {"v": 1, "type": "ping"}


@pytest.mark.parametrize("body", [b"\xff\xfe", b"[1, 2]", b"{not json", b""])
def test_bad_bodies_are_protocol_errors(body: bytes) -> None:
    with pytest.raises(ProtocolError):
        decode_body(body)


@pytest.mark.parametrize(
    ("message", "fragment"),
    [
        ({"type": "ping"}, "version"),
        ({"v": 2, "type": "ping"}, "version"),
        ({"v": 1, "type": "launch_missiles"}, "unknown request type"),
        ({"v": 1, "type": "show"}, "missing field 'id'"),
        ({"v": 1, "type": "show", "id": 3}, "must be a job id"),
        ({"v": 1, "type": "cancel", "ids": "3"}, "list of job ids"),
        ({"v": 1, "type": "submit", "argv": ["x"], "workdir": "/", "uid": 0}, "unexpected field"),
        ({"v": 1, "type": "submit", "argv": ["x"], "workdir": "/", "min_gpus": True}, "integer"),
    ],
)
def test_validation_names_the_problem(message: dict, fragment: str) -> None:
    with pytest.raises(ProtocolError, match=fragment):
        validate_request(message)


def test_identity_cannot_be_claimed_in_a_request() -> None:
    """There is no owner/uid field to forge: the schema rejects it."""
    for field in ("owner", "uid", "user"):
        with pytest.raises(ProtocolError, match="unexpected field"):
            validate_request({"v": 1, "type": "cancel", "ids": ["1"], field: "root"})


@pytest_asyncio.fixture
async def daemon(tmp_path: Path) -> AsyncIterator[Daemon]:
    config = DaemonConfig(nodes=(NodeConfig("n0", ("cpu:0", "cpu:1")),), interval_s=0.5)
    # a short path: Unix socket paths are limited to ~107 bytes
    state_dir = Path(os.environ.get("TMPDIR", "/tmp")) / f"plx-proto-{os.getpid()}-{id(tmp_path)}"
    daemon = Daemon(config, state_dir, policy=IdlePolicy())
    ready = asyncio.Event()
    task = asyncio.ensure_future(daemon.run(ready=ready.set))
    await asyncio.wait_for(ready.wait(), 10)
    yield daemon
    daemon.request_stop()
    await asyncio.wait_for(task, 10)
    import shutil

    shutil.rmtree(state_dir, ignore_errors=True)


async def _raw(path: Path, payload: bytes, read: bool = True) -> bytes:
    reader, writer = await asyncio.open_unix_connection(str(path))
    writer.write(payload)
    await writer.drain()
    data = b""
    if read:
        writer.write_eof()
        data = await asyncio.wait_for(reader.read(), 5)
    writer.close()
    return data


async def _ping(daemon: Daemon) -> dict:
    return await asyncio.to_thread(Client(daemon.socket_path).request, "ping")


@pytest.mark.asyncio
async def test_ping_and_peer_identity(daemon: Daemon) -> None:
    reply = await _ping(daemon)
    assert reply["pid"] == os.getpid()
    assert reply["you"]["uid"] == os.geteuid()
    assert oct(daemon.socket_path.stat().st_mode & 0o777) == oct(0o666)


@pytest.mark.asyncio
async def test_garbage_truncated_and_huge_frames_do_not_crash(daemon: Daemon) -> None:
    huge = struct.pack(">I", MAX_FRAME_BYTES + 1)
    reply = await _raw(daemon.socket_path, huge + b"x" * 16)
    assert b"exceeds" in reply
    reply = await _raw(daemon.socket_path, struct.pack(">I", 10) + b"{not json}")
    assert b"not valid UTF-8 JSON" in reply
    await _raw(daemon.socket_path, struct.pack(">I", 1000) + b"{}")  # truncated, then EOF
    await _raw(daemon.socket_path, b"\x00\x01")  # truncated header
    reply = await _raw(daemon.socket_path, encode_frame({"v": 1, "type": "nope"}))
    assert b"unknown request type" in reply
    assert (await _ping(daemon))["pid"] == os.getpid()


@pytest.mark.asyncio
async def test_bounded_fuzz_leaves_daemon_alive_without_memory_growth(daemon: Daemon) -> None:
    rng = np.random.default_rng(7)
    proc = psutil.Process()
    await _ping(daemon)

    async def one(i: int) -> None:
        kind = i % 4
        if kind == 0:
            payload = rng.bytes(int(rng.integers(1, 200)))
        elif kind == 1:
            payload = struct.pack(">I", int(rng.integers(0, 2**32))) + rng.bytes(8)
        elif kind == 2:
            payload = encode_frame({"v": 1, "type": "show", "id": str(i)})[
                : int(rng.integers(1, 20))
            ]
        else:
            payload = encode_frame({"v": 1, "type": "status", "junk": rng.bytes(4).hex()})
        await _raw(daemon.socket_path, payload)

    for i in range(100):  # warm-up so allocator pools are in place
        await one(i)
    before = proc.memory_info().rss
    for i in range(600):
        await one(i)
    grown = proc.memory_info().rss - before
    assert grown < 8 * 1024 * 1024, f"RSS grew by {grown} bytes over 600 bad frames"
    assert (await _ping(daemon))["pid"] == os.getpid()


@pytest.mark.asyncio
async def test_silent_connection_does_not_block_others(daemon: Daemon) -> None:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(str(daemon.socket_path))
    sock.sendall(b"\x00\x00")  # half a header, then silence
    try:
        assert (await _ping(daemon))["pid"] == os.getpid()
    finally:
        sock.close()


@pytest.mark.asyncio
async def test_unknown_job_is_one_clear_error(daemon: Daemon) -> None:
    client = Client(daemon.socket_path)
    with pytest.raises(PolluxError, match="no job with id '42'"):
        await asyncio.to_thread(client.request, "show", id="42")


def test_no_daemon_is_one_clear_error(tmp_path: Path) -> None:
    with pytest.raises(PolluxError, match="no daemon is running"):
        Client(tmp_path / "daemon.sock").request("ping")
