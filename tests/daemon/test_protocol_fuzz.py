"""Bounded fuzz of the daemon's socket protocol against a real daemon process."""

from __future__ import annotations

import json
import socket
import struct
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest

from pollux_local.api.wire import MAX_FRAME_BYTES, frame
from tests.daemon_process import DaemonFactory, DaemonProcess

pytestmark = pytest.mark.timeout(120)


def encode_frame(message: dict[str, Any]) -> bytes:
    """Any JSON object as a frame, bypassing the typed encoder (the fuzz sends junk)."""
    return frame(json.dumps(message).encode())


@pytest.fixture()
def daemon(daemon_factory: DaemonFactory) -> DaemonProcess:
    return daemon_factory(devices="cpu:2", interval=30)


def send_raw(path: Path, payload: bytes, close_write: bool = True) -> bytes:
    """Send bytes, half-close, read whatever comes back within 5 s."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(5)
        sock.connect(str(path))
        try:
            sock.sendall(payload)
            if not close_write:  # leave abruptly mid-conversation
                return b""
            sock.shutdown(socket.SHUT_WR)
            chunks = []
            while True:
                chunk = sock.recv(65536)
                if not chunk:
                    break
                chunks.append(chunk)
        except (BrokenPipeError, ConnectionResetError, TimeoutError):
            return b""
    return b"".join(chunks)


def fuzz_payload(rng: np.random.Generator, i: int) -> bytes:
    kind = i % 8
    if kind == 0:  # random bytes
        return rng.bytes(int(rng.integers(0, 300)))
    if kind == 1:  # huge or random length prefix, little body
        length = int(rng.choice([MAX_FRAME_BYTES + 1, 2**32 - 1, int(rng.integers(0, 2**32))]))
        return struct.pack(">I", length) + rng.bytes(int(rng.integers(0, 64)))
    if kind == 2:  # a valid frame cut short
        frame = encode_frame({"v": 1, "type": "submit", "argv": ["x"] * 20, "workdir": "/tmp"})
        return frame[: int(rng.integers(0, len(frame)))]
    if kind == 3:  # valid JSON that is not an object, or not UTF-8
        body = rng.choice([b"[1,2,3]", b'"s"', b"null", b"\xff\xfe{}", b"{" * 5000])
        return struct.pack(">I", len(body)) + body
    if kind == 4:  # an object with wrong field types
        message = {"v": 1, "type": "cancel", "ids": {"a": [1, 2]}, "extra": "y" * 1000}
        return encode_frame(message)
    if kind == 5:  # unknown type / version
        return encode_frame({"v": int(rng.integers(-5, 5)), "type": rng.bytes(6).hex()})
    if kind == 6:  # deep nesting
        body = json.dumps({"v": 1, "type": "status", "x": [[[[[[[[1]]]]]]]] * 50}).encode()
        return struct.pack(">I", len(body)) + body
    # several frames in one write, the last truncated
    good = encode_frame({"v": 1, "type": "ping"})
    return good * 3 + good[:-2]


def test_fuzzed_frames_neither_crash_nor_grow_the_daemon(daemon: DaemonProcess) -> None:
    rng = np.random.default_rng(20240611)
    sock_path = daemon.state_dir / "daemon.sock"
    process = psutil.Process(daemon.pid)
    for i in range(200):  # warm-up: allocator pools, caches
        send_raw(sock_path, fuzz_payload(rng, i))
    before = process.memory_info().rss
    replies = 0
    for i in range(1600):
        reply = send_raw(sock_path, fuzz_payload(rng, i), close_write=bool(i % 5))
        replies += bool(reply)
    after = process.memory_info().rss
    assert daemon.proc is not None and daemon.proc.poll() is None, daemon.output()
    assert daemon.client.request("ping")["pid"] == daemon.pid
    assert after - before < 16 * 1024 * 1024, f"RSS grew {(after - before) / 2**20:.1f} MiB"
    assert replies > 700  # most bad frames got an error reply, not a silent drop


def test_huge_length_is_refused_without_reading_the_body(daemon: DaemonProcess) -> None:
    sock_path = daemon.state_dir / "daemon.sock"
    process = psutil.Process(daemon.pid)
    before = process.memory_info().rss
    for _ in range(20):
        reply = send_raw(sock_path, struct.pack(">I", 2**32 - 1) + b"{" * 1024)
        assert b"exceeds" in reply
    assert process.memory_info().rss - before < 8 * 1024 * 1024
    assert daemon.client.request("ping")["pid"] == daemon.pid


def test_many_idle_connections_do_not_block_a_client(daemon: DaemonProcess) -> None:
    sock_path = daemon.state_dir / "daemon.sock"
    idle = []
    try:
        for _ in range(50):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.connect(str(sock_path))
            sock.sendall(b"\x00\x00")  # half a header, then silence
            idle.append(sock)
        assert daemon.client.request("ping")["pid"] == daemon.pid
    finally:
        for sock in idle:
            sock.close()
