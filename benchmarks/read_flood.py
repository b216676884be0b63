#!/usr/bin/env python3
"""Read flood: another user's ``status`` latency and submit->running time while one user
floods the daemon with large reads.

    sudo python benchmarks/read_flood.py [--seconds 30] [--repeats 3] [--connections 4]
                                         [--flood status|cancel|small|wake] [--interval 0.5]
                                         [--history 10000] [--pythonpath PATH] [--json]

Starts a daemon (``--devices cpu:2``, 0.5 s passes, policy goodput) in a temporary state
directory.  Run as root, the daemon is a lab's root daemon and the flooding user is
``nobody``: it first makes ``--history`` ended jobs (held arrays of 1000 tasks, each cancelled
at once), then, each repeat, asks ``status --all`` with ``limit=10000`` back to back on
``--connections`` connections for ``--seconds``.  Meanwhile root asks ``status`` (``limit=10``)
every 100 ms, a new connection each as the CLI does, and halfway through submits a 1-GPU
``/bin/sleep 3600`` and times it to ``running``.  Each repeat gives the status p50/p90/max,
the number of status samples, the pages the flooder was served (in all and per second) and
the submit->running time; the figures are the medians over the repeats.  A baseline with no
flood (3 s of the same probe, one submit) comes first.  ``--pythonpath`` runs the daemon with
``PYTHONPATH=PATH`` (say a worktree of an older commit; run the benchmark from outside the
repository, as ``-m`` puts the working directory first on the daemon's path).  Run without
root, the flooder is the same user (a personal daemon).  ``--flood cancel`` floods with
``cancel`` requests naming every ended job it made (10,000 ids, each read, then skipped)
instead of ``status`` pages; ``--flood small`` with pairs of small requests (a held array of
100 tasks, then a ``cancel`` of its 100 ids), each pair counted as a page; ``--flood wake``
first queues 999 jobs to start in a year and holds one, then changes that one's priority
back and forth (each change wakes a scheduling pass over the 1,000; try ``--interval 60``,
a lab's default), each change counted as a page.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from pollux_local.client import Client

sys.path.insert(0, str(Path(__file__).resolve().parent))
from daemon_runner import RAW_CLIENT, percentile, start_daemon, stop_daemon  # noqa: E402

#: The flooding user's side (stdlib only): make history, say ready, then flood on each line.
FLOODER = (
    RAW_CLIENT
    + r"""
import itertools
path, history, connections, kind = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
ids = []
sock = connect(path)
made = 0
while made < history:
    n = min(1000, history - made)
    reply = call(sock, {"type": "submit", "argv": ["/bin/true"], "workdir": "/", "hold": True,
                        "array": [{"index": i} for i in range(n)]})
    if not reply.get("ok", True) or "ids" not in reply:
        sys.exit(f"submit failed: {reply}")
    call(sock, {"type": "cancel", "arrays": [reply["ids"][0]]})
    ids += reply["ids"]
    made += n
sock.close()
print(json.dumps({"history": made}), flush=True)

if kind == "wake":  # 999 jobs queued to start in a year, one held job to re-prioritise
    sock = connect(path)
    call(sock, {"type": "submit", "argv": ["/bin/true"], "workdir": "/",
                "begin_at": time.time() + 3e7, "array": [{"index": i} for i in range(999)]})
    poke = call(sock, {"type": "submit", "argv": ["/bin/true"], "workdir": "/", "hold": True})
    sock.close()
    priorities = itertools.cycle([{"type": "set_priority", "id": poke["id"], "priority": p}
                                  for p in (0, -1)])

if kind == "status":
    request = {"type": "status", "all": True, "limit": 10000}
elif kind == "cancel":  # the ended jobs it made: each is skipped, after being read
    request = {"type": "cancel", "ids": [str(i) for i in ids[:10000]]}
else:  # "small": a held 100-task array, then a cancel of its 100 ids
    request = {"type": "submit", "argv": ["/bin/true"], "workdir": "/", "hold": True,
               "array": [{"index": i} for i in range(100)]}

def small(sock):
    reply = call(sock, request)
    if reply.get("ok", True) and "ids" in reply:
        reply = call(sock, {"type": "cancel", "ids": reply["ids"]})
    return reply

def flood(deadline, counts, i):
    sock = connect(path)
    while time.monotonic() < deadline:
        try:
            if kind == "wake":
                reply = call(sock, next(priorities))
            else:
                reply = small(sock) if kind == "small" else call(sock, request)
        except (OSError, ConnectionError):
            counts[i][1] += 1
            sock = connect(path)
            continue
        served = "jobs" in reply or "skipped" in reply or (kind == "wake" and "priority" in reply)
        counts[i][0 if reply.get("ok", True) and served else 1] += 1
    sock.close()

for line in sys.stdin:
    deadline = time.monotonic() + json.loads(line)["seconds"]
    counts = [[0, 0] for _ in range(connections)]
    threads = [threading.Thread(target=flood, args=(deadline, counts, i))
               for i in range(connections)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    print(json.dumps({"pages": sum(c[0] for c in counts),
                      "errors": sum(c[1] for c in counts)}), flush=True)
"""
)


def submit_to_running(client: Client) -> float:
    """Seconds from submitting a 1-GPU ``/bin/sleep 3600`` to its ``running``; cancelled."""
    began = time.perf_counter()
    job_id = client.request(
        "submit", argv=["/bin/sleep", "3600"], workdir="/", min_gpus=1, max_gpus=1,
        elastic=False, name="probe",
    )["id"]  # fmt: skip
    try:
        while client.request("show", id=job_id)["job"]["state"] != "running":
            if time.perf_counter() - began > 300:
                raise RuntimeError(f"job {job_id} did not start")
            time.sleep(0.05)
        return time.perf_counter() - began
    finally:
        client.request("cancel", ids=[job_id])


def probe(client: Client, seconds: float, submit_at: float) -> dict[str, Any]:
    """``status`` (limit 10) every 100 ms for ``seconds``, and one submit->running at
    ``submit_at`` seconds."""
    latencies: list[float] = []
    started: list[float] = []
    end = time.monotonic() + seconds

    def submit() -> None:
        time.sleep(submit_at)
        started.append(submit_to_running(client))

    submitter = threading.Thread(target=submit)
    submitter.start()
    while time.monotonic() < end:
        began = time.perf_counter()
        Client(client.socket_path, timeout_s=60).request("status", limit=10)
        latencies.append(time.perf_counter() - began)
        time.sleep(0.1)
    submitter.join()
    return {
        "status_p50_ms": round(statistics.median(latencies) * 1e3, 2),
        "status_p90_ms": round(percentile(latencies, 0.9) * 1e3, 2),
        "status_max_ms": round(max(latencies) * 1e3, 2),
        "status_samples": len(latencies),
        "submit_to_running_s": round(started[0], 3),
    }


def one_repeat(client: Client, flooder: subprocess.Popen[str], seconds: float) -> dict[str, Any]:
    assert flooder.stdin is not None and flooder.stdout is not None
    flooder.stdin.write(json.dumps({"seconds": seconds}) + "\n")
    flooder.stdin.flush()
    result = probe(client, seconds, seconds / 2)
    served = json.loads(flooder.stdout.readline())
    return {
        **result,
        "pages": served["pages"],
        "pages_per_s": round(served["pages"] / seconds, 2),
        "flood_errors": served["errors"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=30.0, help="length of each flood")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--connections", type=int, default=4, help="the flooder's connections")
    parser.add_argument("--history", type=int, default=10000, help="ended jobs to make first")
    parser.add_argument("--pythonpath", help="PYTHONPATH for the daemon (code to benchmark)")
    parser.add_argument(
        "--flood", choices=["status", "cancel", "small", "wake"], default="status",
        help="status --all --limit 10000, a cancel naming every ended job it made, pairs of"
        " a held 100-task array and a cancel of its ids, or set_priority of a held job over"
        " 999 queued ones (each wakes a pass)",
    )  # fmt: skip
    parser.add_argument("--interval", type=float, default=0.5, help="the daemon's interval_s")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    root = Path(tempfile.mkdtemp(prefix="plx-readflood-"))
    root.chmod(0o755)
    state = root / "state"
    env = None
    if args.pythonpath:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": args.pythonpath}
    daemon = start_daemon(state, policy="goodput", interval_s=args.interval, env=env)
    client = Client(state / "daemon.sock", timeout_s=60)
    as_nobody: dict[str, Any] = {}
    python = sys.executable
    if os.geteuid() == 0:
        as_nobody = {"user": 65534, "group": 65534, "extra_groups": []}
        # stdlib only: the system's interpreter, which nobody may run (a venv under /root not)
        python = shutil.which("python3", path="/usr/bin:/bin") or python
    flooder = subprocess.Popen(
        [python, "-c", FLOODER, str(state / "daemon.sock"), str(args.history),
         str(args.connections), args.flood],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd="/", **as_nobody,
    )  # fmt: skip
    assert flooder.stdout is not None
    results: dict[str, Any] = {
        "flooder": "nobody" if as_nobody else "the same user",
        "flood": args.flood,
        "seconds": args.seconds,
        "connections": args.connections,
        "pythonpath": args.pythonpath,
    }
    try:
        began = time.monotonic()
        ready = flooder.stdout.readline()
        if not ready:
            raise RuntimeError("the flooder failed while making history")
        results["history"] = json.loads(ready)["history"]
        results["history_s"] = round(time.monotonic() - began, 1)
        results["baseline"] = probe(client, 3.0, 0.5)
        runs = [one_repeat(client, flooder, args.seconds) for _ in range(args.repeats)]
        results["runs"] = runs
        results["median"] = {
            key: round(statistics.median(run[key] for run in runs), 3) for key in runs[0]
        }
    finally:
        flooder.kill()
        flooder.wait()
        stop_daemon(daemon)
        shutil.rmtree(root, ignore_errors=True)
    if args.json:
        print(json.dumps(results, indent=2))
        return 0
    b, m = results["baseline"], results["median"]
    print(f"flooder: {results['flooder']}, {args.connections} connections, {args.seconds:g} s, "
          f"{results['history']} ended jobs (made in {results['history_s']} s)")  # fmt: skip
    print(f"baseline status: p50 {b['status_p50_ms']} ms, p90 {b['status_p90_ms']} ms, "
          f"max {b['status_max_ms']} ms; submit->running {b['submit_to_running_s']} s")  # fmt: skip
    print(f"during the flood (median of {args.repeats}): status p50 {m['status_p50_ms']} ms, "
          f"p90 {m['status_p90_ms']} ms, max {m['status_max_ms']} ms "
          f"({m['status_samples']:g} samples); submit->running {m['submit_to_running_s']} s")  # fmt: skip
    print(f"pages served to the flooder: {m['pages']:g} ({m['pages_per_s']} per s), "
          f"errors {m['flood_errors']:g}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
