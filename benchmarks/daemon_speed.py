#!/usr/bin/env python3
"""Daemon speed: submit and status round trips with 1,000 queued jobs and with 10,000 jobs
in history, the daemon's memory before, during and after 200 abusive connections, and the time
from a scheduling decision to a new job's first training step.

    python benchmarks/daemon_speed.py [--jobs 1000] [--history 10000] [--policy goodput]
                                      [--first-step-runs 3] [--json]

Starts its own daemons (``--devices cpu:2``) in temporary state directories: one that gets
``--jobs`` submits (queued: one device each, two run), and one started on a database that
already holds ``--history`` jobs that finished two days ago (as a lab's daemon holds after
months; written straight into ``state.db`` before it starts).  Each figure is the median of
repeated round trips.  Goals: median submit and status round trip <= 50 ms in both cases;
the daemon's RSS back within 30 MB of its baseline after the abusive connections leave.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

from pollux_local.client import Client
from pollux_local.daemon.config import POLICIES, POLICY_ALIASES
from pollux_local.daemon.state import StateStore

sys.path.insert(0, str(Path(__file__).resolve().parent))
from daemon_runner import percentile, start_daemon, stop_daemon  # noqa: E402

#: 200 connections, each announcing a 16 MiB frame and sending 1 MiB of it, then silence.
FLOOD = r"""
import socket, sys
path, count, sent = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
socks = []
for _ in range(count):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(2)
    try:
        s.connect(path)
        s.sendall((16 * 1024 * 1024 - 1).to_bytes(4, "big") + b'{"v":1,"type":"status"'
                  + b" " * sent)
    except OSError:
        pass
    socks.append(s)
print("open", flush=True)
sys.stdin.readline()
for s in socks:
    s.close()
print("closed", flush=True)
"""

FIRST_STEP = r"""
import time, torch
model = torch.nn.Linear(16, 4)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
loss = model(torch.randn(32, 16)).pow(2).mean()
loss.backward()
opt.step()
print(f"first step at {time.time():.6f}", flush=True)
"""


def summary(values: list[float]) -> dict[str, float]:
    return {
        "median_ms": round(statistics.median(values) * 1e3, 2),
        "p95_ms": round(percentile(values, 0.95) * 1e3, 2),
        "max_ms": round(max(values) * 1e3, 2),
        "n": len(values),
    }


def timed(call: Any, count: int) -> list[float]:
    times = []
    for _ in range(count):
        began = time.perf_counter()
        call()
        times.append(time.perf_counter() - began)
    return times


def write_history(state: Path, count: int, now: float) -> None:
    """``count`` jobs that finished two days ago, straight into a new ``state.db``."""
    state.mkdir(parents=True)
    (state / "jobs").mkdir()
    store = StateStore(state / "state.db")
    spec = json.dumps({"argv": ["/bin/true"], "workdir": "/", "min_gpus": 1, "max_gpus": 1})
    rows = [
        (f"old-{i}", 1000 + i % 7, 1000, f"user{i % 7}", ("succeeded", "failed", "cancelled")[i % 3],
         spec, now - 3 * 86400 + i, now - 2 * 86400)
        for i in range(count)
    ]  # fmt: skip
    store.db.execute("BEGIN")
    store.db.executemany(
        "INSERT INTO jobs (name, owner_uid, owner_gid, owner_name, state, spec, submit_time,"
        " end_time) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
        rows,
    )
    store.db.execute("COMMIT")
    store.close()


def abuse(state: Path, pid: int, client: Client) -> dict[str, float]:
    """The daemon's RSS (MB) before, during and after 200 connections that each announce a
    16 MiB frame, send 1 MiB of it and wait; 'after' is the first reading within 30 MB of the
    baseline in 10 s (else the last)."""
    process = psutil.Process(pid)
    for _ in range(20):
        client.request("status")
    mb = 1e6
    before = process.memory_info().rss
    flood = subprocess.Popen(
        [sys.executable, "-c", FLOOD, str(state / "daemon.sock"), "200", str(1 << 20)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert flood.stdin is not None and flood.stdout is not None
    flood.stdout.readline()
    during = process.memory_info().rss
    began = time.perf_counter()
    client.request("status")
    status_during = time.perf_counter() - began
    flood.stdin.write("\n")
    flood.stdin.flush()
    flood.stdout.readline()
    flood.wait(10)
    deadline = time.monotonic() + 10
    while True:
        client.request("status")
        after = process.memory_info().rss
        if after - before < 30 * mb or time.monotonic() > deadline:
            break
        time.sleep(0.25)
    return {
        "rss_before_mb": round(before / mb, 1),
        "rss_during_mb": round(during / mb, 1),
        "rss_after_mb": round(after / mb, 1),
        "status_during_ms": round(status_during * 1e3, 1),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=1000)
    parser.add_argument(
        "--policy",
        type=lambda name: POLICY_ALIASES.get(name, name),  # the daemon CLI takes "goodput"
        choices=POLICIES,
        default="goodput",
        help="allocation policy (pollux: another name for goodput)",
    )
    parser.add_argument("--history", type=int, default=10_000)
    parser.add_argument("--repeats", type=int, default=50, help="status round trips timed")
    parser.add_argument("--first-step-runs", type=int, default=3, help="0: skip (needs torch)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    root = Path(tempfile.mkdtemp(prefix="plx-bench-"))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    submit = {
        "argv": ["/bin/sleep", "3600"],
        "workdir": str(root),
        "env": dict(os.environ),  # what the CLI sends: the submitter's environment
        "min_gpus": 1,
        "max_gpus": 1,
        "batch_size": 64,
    }
    results: dict[str, Any] = {"jobs": args.jobs, "history": args.history, "policy": args.policy}

    # 1. --jobs queued jobs
    state = root / "queued"
    daemon = start_daemon(state, policy=args.policy, interval_s=2, env=env)
    client = Client(state / "daemon.sock")
    try:
        submit_times = timed(lambda: client.request("submit", **submit), args.jobs)
        time.sleep(2.5)  # let a scheduling pass over all of them happen
        status_times = timed(lambda: client.request("status"), args.repeats)
        reply = client.request("status")
        states = [job["state"] for job in reply["jobs"]]
        results["queued_jobs"] = {
            "submit": summary(submit_times),
            "status": summary(status_times),
            "queued": states.count("queued"),
            "running": states.count("running"),
        }
        began = time.perf_counter()
        cli = subprocess.run(
            [sys.executable, "-m", "pollux_local", "status", "--json", "--state-dir", str(state)],
            capture_output=True, env=env, timeout=60,
        )  # fmt: skip
        results["cli_status_wall_ms"] = round((time.perf_counter() - began) * 1e3, 1)
        assert cli.returncode == 0
        results["abuse"] = abuse(state, daemon.pid, client)

        # decision -> first training step, on an otherwise idle daemon
        client.timeout_s = 120
        client.request("cancel", ids=[job["id"] for job in reply["jobs"]])
        script = root / "first_step.py"
        script.write_text(FIRST_STEP)
        latencies = []
        for _ in range(args.first_step_runs):
            job_id = client.request(
                "submit", argv=[sys.executable, str(script)], workdir=str(root), env=env,
                batch_size=32, max_gpus=1,
            )["id"]  # fmt: skip
            deadline = time.monotonic() + 120
            while client.request("show", id=job_id)["job"]["state"] not in ("succeeded", "failed"):
                if time.monotonic() > deadline:
                    job = client.request("show", id=job_id)["job"]
                    raise RuntimeError(f"first-step job stuck: {job['state']}: {job['reason']}")
                time.sleep(0.1)
            shown = client.request("show", id=job_id)
            decided = next(d["time"] for d in shown["decisions"] if d["kind"] == "start")
            log = client.request("logs", id=job_id)["data"]
            match = re.search(r"first step at ([0-9.]+)", log)
            if match is None:
                raise RuntimeError(f"no first step in the log: {log[-300:]}")
            latencies.append(float(match.group(1)) - decided)
        if latencies:
            results["decision_to_first_step_s"] = {
                "median": round(statistics.median(latencies), 3),
                "runs": [round(x, 3) for x in latencies],
            }
    finally:
        stop_daemon(daemon)

    # 2. --history finished jobs (ended two days ago) in the database
    state = root / "history"
    write_history(state, args.history, time.time())
    daemon = start_daemon(state, policy=args.policy, interval_s=2, env=env)
    client = Client(state / "daemon.sock", timeout_s=60)
    try:
        submit_times = timed(lambda: client.request("submit", **submit), 100)
        status_times = timed(lambda: client.request("status"), args.repeats)
        page_times = timed(lambda: client.request("status", all=True, limit=100), args.repeats)
        reply = client.request("status")
        results["history_jobs"] = {
            "submit": summary(submit_times),
            "status": summary(status_times),
            "status_all_page_of_100": summary(page_times),
            "shown": len(reply["jobs"]),
            "hidden": reply["hidden"],
        }
    finally:
        stop_daemon(daemon)

    if args.json:
        print(json.dumps(results, indent=2))
        return 0
    print(f"policy {args.policy}")
    for key, title in (
        ("queued_jobs", f"{args.jobs} queued jobs"),
        ("history_jobs", f"{args.history} finished jobs in history"),
    ):
        print(title)
        for name, s in results[key].items():
            if isinstance(s, dict):
                print(
                    f"  {name:<24} median {s['median_ms']} ms, p95 {s['p95_ms']} ms,"
                    f" max {s['max_ms']} ms (n={s['n']})"
                )
    print(f"  CLI `status --json` wall time {results['cli_status_wall_ms']} ms")
    a = results["abuse"]
    print(
        f"RSS before / during / after 200 partial 16 MiB frames: {a['rss_before_mb']} /"
        f" {a['rss_during_mb']} / {a['rss_after_mb']} MB (a status during it:"
        f" {a['status_during_ms']} ms)"
    )
    if "decision_to_first_step_s" in results:
        d = results["decision_to_first_step_s"]
        print(f"decision -> first training step: median {d['median']} s {d['runs']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
