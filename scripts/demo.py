#!/usr/bin/env python3
"""The main demo: start a daemon on the embedded default (this machine's GPUs, or two CPU-backed
devices when it has none), submit every job in ``jobs/`` from its ``job.toml``, follow
``pollux-local status`` until they all finish, then stop the daemon.

    python scripts/demo.py [--state-dir DIR] [--devices cpu:2] [--interval 5] [--jobs jobs/a/job.toml ...]

Exit code 0 when every job succeeded (reached its quality target).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TERMINAL = {"succeeded", "failed", "cancelled"}


#: The CLI runs as if this interpreter's environment were activated, so that the jobs it submits
#: run under it (``submit`` takes the submitter's active venv).
CLI_ENV = {
    **os.environ,
    "VIRTUAL_ENV": sys.prefix,
    "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
}


def cli(state_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pollux_local", *args, "--state-dir", str(state_dir)],
        capture_output=True, text=True, cwd=REPO, timeout=120, env=CLI_ENV,
    )  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--state-dir", help="state directory (default: a fresh temporary one)")
    parser.add_argument("--devices", help="override the devices, e.g. cpu:2")
    parser.add_argument("--interval", type=float, default=5.0, help="scheduling interval (s)")
    parser.add_argument(
        "--restart-cost",
        type=float,
        default=8.0,
        help="seconds one resize costs a job (on this CPU: SIGTERM to first step ~6-8 s)",
    )
    parser.add_argument("--jobs", nargs="*", help="job.toml files (default: jobs/*/job.toml)")
    parser.add_argument("--timeout", type=float, default=1800.0, help="give up after (s)")
    args = parser.parse_args()

    state_dir = Path(args.state_dir or tempfile.mkdtemp(prefix="pollux-demo-")).absolute()
    specs = [Path(p) for p in args.jobs] if args.jobs else sorted(REPO.glob("jobs/*/job.toml"))
    if not specs:
        print("no jobs found under jobs/", file=sys.stderr)
        return 2
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    state_dir.mkdir(parents=True, exist_ok=True)
    config = state_dir.parent / f"{state_dir.name}-config.toml"
    config.write_text(
        f"[scheduler]\ninterval_s = {args.interval}\nrestart_cost_s = {args.restart_cost}\n"
    )
    command = [sys.executable, "-m", "pollux_local", "daemon", "--state-dir", str(state_dir),
               "--config", str(config), "--interval", str(args.interval)]  # fmt: skip
    if args.devices:
        command += ["--devices", args.devices]
    state_dir.parent.mkdir(parents=True, exist_ok=True)
    log_path = state_dir.parent / f"{state_dir.name}-daemon.out"
    print(f"state dir {state_dir}; daemon output in {log_path}")
    with open(log_path, "ab") as log:
        daemon = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    try:
        deadline = time.monotonic() + 30
        while cli(state_dir, "status").returncode != 0:
            if daemon.poll() is not None or time.monotonic() > deadline:
                print("the daemon did not start:\n" + log_path.read_text(), file=sys.stderr)
                return 1
            time.sleep(0.2)
        print(cli(state_dir, "nodes").stdout, end="")
        for spec in specs:
            result = cli(state_dir, "submit", "--spec", str(spec))
            print(result.stdout.strip() or result.stderr.strip(), f"<- {spec.relative_to(REPO)}")
        started = time.monotonic()
        last = ""
        while True:
            table = cli(state_dir, "status").stdout
            if table != last:
                print(f"\n[{time.monotonic() - started:6.1f} s]\n{table}", end="", flush=True)
                last = table
            jobs = json.loads(cli(state_dir, "status", "--json").stdout)["jobs"]
            if all(job["state"] in TERMINAL for job in jobs):
                break
            if time.monotonic() - started > args.timeout:
                print(f"\ngave up after {args.timeout:g} s", file=sys.stderr)
                return 1
            time.sleep(2.0)
        print(f"\nall jobs finished in {time.monotonic() - started:.1f} s")
        for job in jobs:
            tail = cli(state_dir, "logs", job["id"], "--tail", "400").stdout.strip().splitlines()
            print(f"  job {job['id']} {job['name']}: {job['state']}, restarts {job['restarts']}"
                  f" — {tail[-1] if tail else ''}")  # fmt: skip
        return 0 if all(job["state"] == "succeeded" for job in jobs) else 1
    finally:
        daemon.send_signal(signal.SIGTERM)
        try:
            daemon.wait(timeout=90)
        except subprocess.TimeoutExpired:
            daemon.kill()


if __name__ == "__main__":
    sys.exit(main())
