#!/usr/bin/env python3
"""Report flood: another user's ``status`` latency and the daemon's memory and CPU while one
user sends job reports as fast as the daemon takes them.

    sudo python benchmarks/report_flood.py [--seconds 10] [--repeats 3] [--rows 256]
                                           [--policy goodput] [--json]

Starts a daemon (``--devices cpu:2``, 0.5 s passes) in a temporary state directory.  Run as
root, the daemon is a lab's root daemon and the flooding user is ``nobody``: it submits a job
and, for ``--seconds``, sends ``report`` requests for it back to back on one connection, each
with ``--rows`` profile rows of configurations it never reported before.  Meanwhile root asks
for ``status`` every 20 ms (a new connection each, as the CLI does).  Each repeat gives the
status latency p50/p90, the daemon's RSS before, during (largest) and after (5 s later) and
its CPU (share of one core) before and after; the figures are the medians over the repeats.
Before them, a 2 s flood warms the daemon up (its first model fit imports the fitting code,
about 40 MB, once in its life) and a report of 100,000 rows (11 MB) is sent: the time to its
refusal and the RSS around it are given.  Goals:
status p90 <= 50 ms during the flood, RSS back within 30 MB of the baseline, CPU after the
flood as before it.  Run without root, the flooder is the same user (a personal daemon).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psutil

from pollux_local.client import Client

sys.path.insert(0, str(Path(__file__).resolve().parent))
from daemon_runner import RAW_CLIENT, percentile, start_daemon  # noqa: E402

#: The flooding user's side (stdlib only): submit a job, wait for a line on stdin, flood.
FLOODER = (
    RAW_CLIENT
    + r"""
def rows(start, n):
    return [{"nodes": 1, "replicas": 1 + m % 4, "local_batch": m, "compute_s": 1e-3 * m,
             "step_s": 1.2e-3 * m, "count": 5} for m in range(start, start + n)]

path, per = sys.argv[1], int(sys.argv[2])
sock = connect(path)
reply = call(sock, {"type": "submit", "argv": ["/bin/sleep", "3600"], "workdir": "/",
                    "min_gpus": 1, "max_gpus": 1, "batch_size": 32, "elastic": False,
                    "name": "flood"})
job_id = reply["id"]
print(json.dumps({"id": job_id}), flush=True)
start = 1
for line in sys.stdin:
    order = json.loads(line)
    if order["kind"] == "huge":
        began = time.monotonic()
        reply = call(connect(path), {"type": "report", "job_id": job_id,
                                     "report": {"profile": rows(1, 100_000)}})
        print(json.dumps({"seconds": time.monotonic() - began, "reply": reply}), flush=True)
        continue
    deadline = time.monotonic() + order["seconds"]
    sent = accepted = 0
    while time.monotonic() < deadline:
        report = {"profile": rows(start, per), "grad_stats": {"sqr": 1.0, "var": 4.0},
                  "bounds": {"base_batch": 32}, "progress": float(sent)}
        try:
            reply = call(sock, {"type": "report", "job_id": job_id, "report": report})
        except (OSError, ConnectionError):
            sock = connect(path)
            continue
        sent += 1
        start += per
        accepted += bool(reply.get("ok") and reply.get("accepted"))
    print(json.dumps({"sent": sent, "accepted": accepted}), flush=True)
"""
)


def wait_running(client: Client, job_id: str) -> None:
    deadline = time.monotonic() + 60
    while client.request("show", id=job_id)["job"]["state"] != "running":
        if time.monotonic() > deadline:
            raise RuntimeError(f"job {job_id} did not start")
        time.sleep(0.2)


def cpu_share(process: psutil.Process, seconds: float) -> float:
    """The daemon's CPU time over ``seconds``, as a share of one core."""
    before = process.cpu_times()
    time.sleep(seconds)
    after = process.cpu_times()
    return ((after.user - before.user) + (after.system - before.system)) / seconds


def one_repeat(
    client: Client, process: psutil.Process, flooder: subprocess.Popen[str], seconds: float
) -> dict[str, Any]:
    assert flooder.stdin is not None and flooder.stdout is not None
    mb = 1e6
    rss_before = process.memory_info().rss
    cpu_before = cpu_share(process, 3.0)
    latencies: list[float] = []
    peak = [process.memory_info().rss]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            began = time.perf_counter()
            Client(client.socket_path, timeout_s=30).request("status")
            latencies.append(time.perf_counter() - began)
            peak.append(process.memory_info().rss)
            time.sleep(0.02)

    sampler = threading.Thread(target=sample)
    flooder.stdin.write(json.dumps({"kind": "flood", "seconds": seconds}) + "\n")
    flooder.stdin.flush()
    sampler.start()
    sent = json.loads(flooder.stdout.readline())
    done.set()
    sampler.join()
    time.sleep(5.0)
    rss_after = process.memory_info().rss
    cpu_after = cpu_share(process, 3.0)
    return {
        "reports_sent": sent["sent"],
        "reports_accepted": sent["accepted"],
        "reports_per_s": round(sent["sent"] / seconds, 1),
        "status_p50_ms": round(statistics.median(latencies) * 1e3, 2),
        "status_p90_ms": round(percentile(latencies, 0.9) * 1e3, 2),
        "status_max_ms": round(max(latencies) * 1e3, 2),
        "status_samples": len(latencies),
        "rss_before_mb": round(rss_before / mb, 1),
        "rss_during_mb": round(max(peak) / mb, 1),
        "rss_after_mb": round(rss_after / mb, 1),
        "cpu_before": round(cpu_before, 3),
        "cpu_after": round(cpu_after, 3),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=10.0, help="length of each flood")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rows", type=int, default=256, help="profile rows per report")
    parser.add_argument("--policy", default="goodput")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    root = Path(tempfile.mkdtemp(prefix="plx-flood-"))
    root.chmod(0o755)
    state = root / "state"
    daemon = start_daemon(state, policy=args.policy, interval_s=0.5)
    client = Client(state / "daemon.sock", timeout_s=60)
    process = psutil.Process(daemon.pid)
    as_nobody: dict[str, Any] = {}
    python = sys.executable
    if os.geteuid() == 0:
        as_nobody = {"user": 65534, "group": 65534, "extra_groups": []}
        # the flooder needs only the standard library: the system's interpreter, which
        # nobody may run (a virtual environment under /root may not be)
        python = shutil.which("python3", path="/usr/bin:/bin") or python
    flooder = subprocess.Popen(
        [python, "-c", FLOODER, str(state / "daemon.sock"), str(args.rows)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd="/", **as_nobody,
    )  # fmt: skip
    assert flooder.stdin is not None and flooder.stdout is not None
    results: dict[str, Any] = {
        "flooder": "nobody" if as_nobody else "the same user",
        "seconds": args.seconds,
        "rows_per_report": args.rows,
        "policy": args.policy,
    }
    try:
        flood_job = json.loads(flooder.stdout.readline())["id"]
        quiet = client.request(
            "submit", argv=["/bin/sleep", "3600"], workdir="/", min_gpus=1, max_gpus=1,
            elastic=False, name="quiet",
        )["id"]  # fmt: skip
        wait_running(client, flood_job)
        wait_running(client, quiet)
        # warm-up, not counted: the first model fitted imports the fitting code (scipy,
        # about 40 MB), once in a daemon's life, whoever reports first
        flooder.stdin.write(json.dumps({"kind": "flood", "seconds": 2.0}) + "\n")
        flooder.stdin.flush()
        flooder.stdout.readline()
        time.sleep(3.0)
        rss_before = process.memory_info().rss
        flooder.stdin.write(json.dumps({"kind": "huge"}) + "\n")
        flooder.stdin.flush()
        huge = json.loads(flooder.stdout.readline())
        time.sleep(5.0)
        results["huge_report"] = {
            "refused": huge["reply"].get("ok") is False,
            "seconds": round(huge["seconds"], 3),
            "reply": huge["reply"].get("error", huge["reply"]),
            "rss_before_mb": round(rss_before / 1e6, 1),
            "rss_after_mb": round(process.memory_info().rss / 1e6, 1),
        }
        runs = [one_repeat(client, process, flooder, args.seconds) for _ in range(args.repeats)]
        results["runs"] = runs
        results["median"] = {
            key: round(statistics.median(run[key] for run in runs), 3) for key in runs[0]
        }
        model = client.request("show", id=flood_job)["job"]["model"]
        results["flooder_model_points"] = None if model is None else model["fitted_points"]
    finally:
        flooder.kill()
        flooder.wait()
        daemon.send_signal(signal.SIGTERM)
        try:
            daemon.wait(timeout=60)
        except subprocess.TimeoutExpired:
            daemon.kill()
        subprocess.run(["rm", "-rf", str(root)], check=False)
    if args.json:
        print(json.dumps(results, indent=2))
        return 0
    m = results["median"]
    print(f"flooder: {results['flooder']}, {args.rows} rows per report, {args.seconds:g} s")
    huge = results["huge_report"]
    print(f"100,000-row report: refused={huge['refused']} in {huge['seconds']} s "
          f"({huge['reply']}); RSS {huge['rss_before_mb']} -> {huge['rss_after_mb']} MB")  # fmt: skip
    print(f"reports sent per s (median): {m['reports_per_s']}, accepted: {m['reports_accepted']}")
    print(f"status during the flood: p50 {m['status_p50_ms']} ms, p90 {m['status_p90_ms']} ms "
          f"(goal p90 <= 50 ms)")  # fmt: skip
    print(f"RSS: before {m['rss_before_mb']} MB, during {m['rss_during_mb']} MB, after "
          f"{m['rss_after_mb']} MB (goal: after within 30 MB of before)")  # fmt: skip
    print(f"daemon CPU (share of a core): before {m['cpu_before']}, after {m['cpu_after']}")
    print(f"points the flooder's model is fitted to: {results['flooder_model_points']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
