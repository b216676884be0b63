#!/usr/bin/env python3
"""State growth: what a 100-task array carrying ~1 MB of environment costs the daemon, and
what another user waits meanwhile.

    sudo python benchmarks/state_growth.py [--tasks 100] [--env-mb 1] [--repeats 3]
                                           [--python PATH] [--json]

Each repeat starts a daemon (``--devices cpu:2``, 1 s passes) on a new temporary state
directory, then submits one array of ``--tasks`` tasks (``/bin/sleep``: two run, the rest stay
queued) whose request carries ``--env-mb`` MB of environment, while another user (``nobody``
when run as root) asks for ``status`` in a loop, from before the submit until three passes
after it.  Reported: the state database's growth (pages after a checkpoint), the daemon's RSS
before, after the array and after it is cancelled, and the other user's ``status`` round trip
(p50, p90); the table shows the median of the repeats.  Goals: growth <= 2 MB, p90 <= 50 ms,
RSS back within 30 MB of its baseline once the array is cancelled.  Run on demand (not in CI).
"""

from __future__ import annotations

import argparse
import json
import os
import pwd
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

from pollux_local.client import Client

sys.path.insert(0, str(Path(__file__).resolve().parent))
from daemon_runner import percentile, start_daemon, stop_daemon  # noqa: E402

#: Another user's status loop: round trips (seconds) until a line arrives on stdin.
PROBER = r"""
import json, select, sys, time
from pollux_local.client import Client
client = Client(sys.argv[1], timeout_s=60)
times = []
print("ready", flush=True)
while not select.select([sys.stdin], [], [], 0)[0]:
    began = time.perf_counter()
    client.request("status")
    times.append(time.perf_counter() - began)
    time.sleep(0.02)
print(json.dumps(times), flush=True)
"""


def state_bytes(state: Path) -> int:
    """The database's pages after a checkpoint."""
    db = sqlite3.connect(state / "state.db", timeout=30)
    try:
        db.execute("PRAGMA wal_checkpoint(PASSIVE)")
        pages = int(db.execute("PRAGMA page_count").fetchone()[0])
        return pages * int(db.execute("PRAGMA page_size").fetchone()[0])
    finally:
        db.close()


def prober(sock: Path, python: str) -> subprocess.Popen[str]:
    """The status loop, as ``nobody`` when this runs as root and ``python`` (with
    pollux-local) is one ``nobody`` may run; else as this user."""
    other: dict[str, Any] = {}
    if os.geteuid() == 0:
        nobody = pwd.getpwnam("nobody")
        other = {"user": nobody.pw_uid, "group": nobody.pw_gid, "extra_groups": []}
    try:
        proc = subprocess.Popen(
            [python, "-c", PROBER, str(sock)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd="/", **other,
        )  # fmt: skip
    except PermissionError:
        print(f"(nobody may not run {python}: status asked as this user)", file=sys.stderr)
        return prober_as_self(sock, python)
    assert proc.stdout is not None
    if proc.stdout.readline().strip() != "ready":
        print(f"(nobody cannot use {python}: status asked as this user)", file=sys.stderr)
        return prober_as_self(sock, python)
    return proc


def prober_as_self(sock: Path, python: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [python, "-c", PROBER, str(sock)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        text=True, cwd="/",
    )  # fmt: skip
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


def one_run(root: Path, tasks: int, env_bytes: int, python: str) -> dict[str, float]:
    state = root / f"state-{time.monotonic_ns()}"
    daemon = start_daemon(state, policy="fifo", interval_s=1)
    client = Client(state / "daemon.sock", timeout_s=120)
    rss = psutil.Process(daemon.pid)
    try:
        time.sleep(2.0)  # a few passes: the baseline
        base_bytes, base_rss = state_bytes(state), rss.memory_info().rss
        per_var = 100_000
        env = {f"BIG{i}": chr(97 + i % 26) * per_var for i in range(max(1, env_bytes // per_var))}
        probe = prober(state / "daemon.sock", python)
        began = time.perf_counter()
        reply = client.request(
            "submit", argv=["/bin/sleep", "3600"], workdir="/", env=env,
            array=[{"index": i} for i in range(tasks)],
        )  # fmt: skip
        submit_s = time.perf_counter() - began
        time.sleep(3.0)  # three passes over the queued tasks
        assert probe.stdin is not None and probe.stdout is not None
        probe.stdin.write("stop\n")
        probe.stdin.flush()
        times = json.loads(probe.stdout.readline())
        probe.wait(30)
        grown = state_bytes(state) - base_bytes
        array_rss = rss.memory_info().rss
        client.request("cancel", arrays=[reply["id"]])
        time.sleep(3.0)
        after_rss = rss.memory_info().rss
    finally:
        stop_daemon(daemon)
    return {
        "growth_mb": grown / 1e6,
        "submit_s": submit_s,
        "status_p50_ms": percentile(times, 0.5) * 1e3,
        "status_p90_ms": percentile(times, 0.9) * 1e3,
        "status_count": float(len(times)),
        "rss_base_mb": base_rss / 1e6,
        "rss_array_mb": array_rss / 1e6,
        "rss_after_mb": after_rss / 1e6,
        "rss_back_mb": (after_rss - base_rss) / 1e6,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=int, default=100)
    parser.add_argument("--env-mb", type=float, default=1.0, help="environment size (MB)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--python",
        default=sys.executable,
        help="the interpreter the other user runs (one with pollux-local that it may execute)",
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="plx-growth-"))
    root.chmod(0o755)  # the other user reaches the socket
    runs = [
        one_run(root, args.tasks, int(args.env_mb * 1e6), args.python) for _ in range(args.repeats)
    ]
    medians = {key: statistics.median(run[key] for run in runs) for key in runs[0]}
    if args.json:
        print(json.dumps({"runs": runs, "median": medians}, indent=2))
        return 0
    goals = {
        "growth_mb": ("<= 2", medians["growth_mb"] <= 2.0),
        "status_p90_ms": ("<= 50", medians["status_p90_ms"] <= 50.0),
        "rss_back_mb": ("<= 30", medians["rss_back_mb"] <= 30.0),
    }
    print(f"{args.tasks}-task array, {args.env_mb:g} MB environment, median of {args.repeats}")
    print(f"{'figure':<16}{'median':>10}  goal")
    for key, value in medians.items():
        goal, met = goals.get(key, ("", True))
        mark = "" if not goal else ("  ok" if met else "  MISSED")
        print(f"{key:<16}{value:>10.2f}  {goal}{mark}")
    return 0 if all(met for _, met in goals.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
