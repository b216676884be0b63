#!/usr/bin/env python3
"""Daemon speed: submit and status round trips with 1,000 queued jobs, and the time from a
scheduling decision to a new job's first training step.

    python benchmarks/daemon_speed.py [--jobs 1000] [--policy goodput] [--json]

Starts its own daemon (``--devices cpu:2``) in a temporary state directory.  Goals: median
submit and status round trip <= 50 ms with 1,000 queued jobs.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from pollux_local.client import Client
from pollux_local.daemon.config import POLICIES, POLICY_ALIASES
from pollux_local.errors import PolluxError

FIRST_STEP = r"""
import time, torch
model = torch.nn.Linear(16, 4)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
loss = model(torch.randn(32, 16)).pow(2).mean()
loss.backward()
opt.step()
print(f"first step at {time.time():.6f}", flush=True)
"""


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def summary(values: list[float]) -> dict[str, float]:
    return {
        "median_ms": round(statistics.median(values) * 1e3, 2),
        "p95_ms": round(percentile(values, 0.95) * 1e3, 2),
        "max_ms": round(max(values) * 1e3, 2),
        "n": len(values),
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
    parser.add_argument("--first-step-runs", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    root = Path(tempfile.mkdtemp(prefix="plx-bench-"))
    state = root / "s"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    daemon = subprocess.Popen(
        [sys.executable, "-m", "pollux_local", "daemon", "--state-dir", str(state),
         "--devices", "cpu:2", "--interval", "2", "--policy", args.policy],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    client = Client(state / "daemon.sock")
    results: dict[str, Any] = {"jobs": args.jobs, "policy": args.policy}
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                client.request("ping")
                break
            except PolluxError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        submit = {
            "argv": ["/bin/sleep", "3600"],
            "workdir": str(root),
            "env": dict(os.environ),  # what the CLI sends: the submitter's environment
            "min_gpus": 1,
            "max_gpus": 1,
            "batch_size": 64,
        }
        submit_times = []
        for _ in range(args.jobs):
            began = time.perf_counter()
            client.request("submit", **submit)
            submit_times.append(time.perf_counter() - began)
        time.sleep(2.5)  # let a scheduling pass over all of them happen
        status_times = []
        for _ in range(50):
            began = time.perf_counter()
            reply = client.request("status")
            status_times.append(time.perf_counter() - began)
        states = [job["state"] for job in reply["jobs"]]
        results["submit"] = summary(submit_times)
        results["status"] = summary(status_times)
        results["queued"] = states.count("queued")
        results["running"] = states.count("running")
        began = time.perf_counter()
        cli = subprocess.run(
            [sys.executable, "-m", "pollux_local", "status", "--json", "--state-dir", str(state)],
            capture_output=True, env=env, timeout=60,
        )  # fmt: skip
        results["cli_status_wall_ms"] = round((time.perf_counter() - began) * 1e3, 1)
        assert cli.returncode == 0

        # decision -> first training step, on an otherwise idle daemon
        ids = [job["id"] for job in reply["jobs"]]
        client.timeout_s = 120
        client.request("cancel", ids=ids)
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
        results["decision_to_first_step_s"] = {
            "median": round(statistics.median(latencies), 3),
            "runs": [round(x, 3) for x in latencies],
        }
    finally:
        daemon.send_signal(signal.SIGTERM)
        try:
            daemon.wait(timeout=60)
        except subprocess.TimeoutExpired:
            daemon.kill()
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        print(f"{args.jobs} queued jobs, policy {args.policy}")
        for key in ("submit", "status"):
            s = results[key]
            print(
                f"  {key:<7} median {s['median_ms']} ms, p95 {s['p95_ms']} ms, max {s['max_ms']} ms"
            )
        print(f"  CLI `status --json` wall time {results['cli_status_wall_ms']} ms")
        d = results["decision_to_first_step_s"]
        print(f"  decision -> first training step: median {d['median']} s {d['runs']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
