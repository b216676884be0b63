"""What the daemon benchmarks share: a daemon of the working tree on ``cpu:2`` in a state
directory of their own, a percentile, and a stdlib client for another user's scripts."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from pollux_local.client import Client
from pollux_local.errors import PolluxError

#: A stdlib-only client of the daemon's socket (4-byte big-endian length, then JSON), the
#: head of the scripts another user (``nobody``) runs with the system's interpreter.
RAW_CLIENT = r"""
import json, socket, sys, threading, time

def connect(path):
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(120)
    sock.connect(path)
    return sock

def recv(sock, n):
    data = bytearray()
    while len(data) < n:
        chunk = sock.recv(min(n - len(data), 1 << 20))
        if not chunk:
            raise ConnectionError("closed")
        data += chunk
    return bytes(data)

def call(sock, message):
    body = json.dumps({"v": 1, **message}).encode()
    sock.sendall(len(body).to_bytes(4, "big") + body)
    return json.loads(recv(sock, int.from_bytes(recv(sock, 4), "big")))
"""


def percentile(values: list[float], q: float) -> float:
    """The value at quantile ``q`` of ``values`` (nearest rank)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def start_daemon(
    state: Path,
    *,
    policy: str,
    interval_s: float,
    env: dict[str, str] | None = None,
    config: Path | None = None,
    devices: str | None = "cpu:2",
) -> subprocess.Popen[bytes]:
    """``pollux-local daemon`` on ``devices`` of this machine (``None``: only the nodes of
    ``config``) in ``state`` (with ``config``), once it answers a ping."""
    extra = ["--config", str(config)] if config is not None else []
    if devices is not None:
        extra += ["--devices", devices]
    daemon = subprocess.Popen(
        [sys.executable, "-m", "pollux_local", "daemon", "--state-dir", str(state),
         "--interval", f"{interval_s:g}", "--policy", policy, *extra],
        env=env or {**os.environ, "OMP_NUM_THREADS": "1"},
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    client = Client(state / "daemon.sock")
    deadline = time.monotonic() + 60
    while True:
        try:
            client.request("ping")
            return daemon
        except PolluxError:
            if time.monotonic() > deadline or daemon.poll() is not None:
                raise
            time.sleep(0.1)


def stop_daemon(daemon: subprocess.Popen[bytes]) -> None:
    """SIGTERM, then SIGKILL after a minute."""
    daemon.send_signal(signal.SIGTERM)
    try:
        daemon.wait(timeout=60)
    except subprocess.TimeoutExpired:
        daemon.kill()
