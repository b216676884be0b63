"""What the daemon benchmarks share: a daemon of the working tree on ``cpu:2`` in a state
directory of their own, and a percentile."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from pollux_local.client import Client
from pollux_local.errors import PolluxError


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
