"""How well "when will my job run?" is answered: the start and finish forecast when a job is
submitted, against what then happened.

1. A real daemon on ``cpu:2`` (FIFO or goodput policy): one job of each kind runs first (the
   daemon learns each kind's length from it), then ``--jobs`` rigid ``sleep`` jobs of known
   lengths (1 or 2 devices) arrive at random; just before each submit the benchmark asks
   ``estimate`` for the very same request, and after the last job ended reads when each really
   started and ended.
2. The pass itself (``core.schedule.run_pass``) driving a simulated cluster of ``--devices``
   devices through ``--sim-jobs`` arrivals whose true lengths are their kind's length times
   log-normal noise (``--noise``, the sigma of log): at each arrival the forecast
   (``core.schedule.forecast``, knowing only the kinds' lengths) is recorded, and the run
   goes on with the true ones.
3. The time of one forecast of 1,000 queued jobs on 8 devices (goal: at most 100 ms).

For each job: |predicted start - actual start| relative to its actual wait, and |predicted
finish - actual finish| relative to its actual completion time (submit to end); a wait
shorter than one scheduling interval counts as one interval.  Goal: median at most 20%.

    python benchmarks/estimate_accuracy.py [--jobs 30] [--sim-jobs 400] [--policy fifo] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.daemon_runner import percentile, start_daemon, stop_daemon  # noqa: E402
from pollux_local.api.messages import Estimate, Show, Submit  # noqa: E402
from pollux_local.client import Client  # noqa: E402
from pollux_local.core.baselines import FifoPolicy  # noqa: E402
from pollux_local.core.policy import GoodputPolicy  # noqa: E402
from pollux_local.core.schedule import (  # noqa: E402
    ActionKind,
    JobInput,
    JobPhase,
    NodeInput,
    Snapshot,
    run_pass,
)
from pollux_local.core.schedule.forecast import forecast  # noqa: E402
from pollux_local.core.types import Policy  # noqa: E402

#: (seconds, devices) of the kinds of job the daemon run submits
DAEMON_KINDS = ((3.0, 1), (6.0, 1), (4.0, 2))
#: (seconds, devices) of the simulated kinds
SIM_KINDS = ((600.0, 1), (1800.0, 1), (3600.0, 2), (1200.0, 4), (7200.0, 1))


def errors(rows: list[dict[str, float]], floor_s: float) -> dict[str, float | int]:
    """Median and p90 of the relative errors of start (to the wait) and finish (to the
    completion time); jobs the forecast left unknown are counted apart."""
    start_err, finish_err, unknown = [], [], 0
    for row in rows:
        if row["pred_start"] is None or row["pred_finish"] is None:
            unknown += 1
            continue
        wait = max(row["start"] - row["submit"], floor_s)
        done = row["end"] - row["submit"]
        start_err.append(abs(row["pred_start"] - row["start"]) / wait)
        finish_err.append(abs(row["pred_finish"] - row["end"]) / done)
    return {
        "jobs": len(rows),
        "unknown": unknown,
        "start_median": statistics.median(start_err) if start_err else float("nan"),
        "start_p90": percentile(start_err, 0.9) if start_err else float("nan"),
        "finish_median": statistics.median(finish_err) if finish_err else float("nan"),
        "finish_p90": percentile(finish_err, 0.9) if finish_err else float("nan"),
        "mean_wait_s": statistics.mean(r["start"] - r["submit"] for r in rows),
    }


# --- 1. a real daemon ----------------------------------------------------------------------


def daemon_run(jobs: int, policy: str, gap_s: float, seed: int) -> list[dict[str, float]]:
    rng = np.random.default_rng(seed)
    with tempfile.TemporaryDirectory() as tmp:
        state = Path(tmp) / "state"
        state.mkdir(mode=0o700)
        daemon = start_daemon(state, policy=policy, interval_s=1.0)
        client = Client(state / "daemon.sock", timeout_s=60)
        try:

            def request(seconds: float, devices: int) -> Submit:
                return Submit(argv=["sleep", f"{seconds:g}"], workdir=tmp, min_gpus=devices)

            def ended(job_id: str) -> bool:
                return client.call(Show(id=job_id)).job.state.terminal

            for seconds, devices in DAEMON_KINDS:  # each kind's length, learned
                first = client.call(request(seconds, devices)).id
                while not ended(first):
                    time.sleep(0.2)
            guesses = []
            for _ in range(jobs):
                time.sleep(float(rng.exponential(gap_s)))
                seconds, devices = DAEMON_KINDS[int(rng.integers(len(DAEMON_KINDS)))]
                sub = request(seconds, devices)
                guess = client.call(Estimate(submit=sub)).jobs[0]
                job_id = client.call(sub).id
                guesses.append((job_id, time.time(), guess.start, guess.finish))
            for job_id, *_ in guesses:
                while not ended(job_id):
                    time.sleep(0.5)
            rows = []
            for job_id, submitted, start, finish in guesses:
                job = client.call(Show(id=job_id)).job
                assert job.start_time is not None and job.end_time is not None
                rows.append(
                    {
                        "submit": job.submit_time or submitted,
                        "start": job.start_time,
                        "end": job.end_time,
                        "pred_start": start,
                        "pred_finish": finish,
                    }
                )
            return rows  # type: ignore[return-value]
        finally:
            stop_daemon(daemon)


# --- 2. the pass driving a simulated cluster -------------------------------------------------


def sim_run(
    n_jobs: int, devices: int, noise: float, load: float, policy: Policy, seed: int
) -> list[dict[str, float]]:
    """Arrivals at rate ``load`` x capacity / mean work; rigid jobs; the pass decides at each
    arrival and end."""
    rng = np.random.default_rng(seed)
    nodes = [NodeInput(f"n{i}", tuple(f"gpu:{d}" for d in range(4))) for i in range(devices // 4)]
    mean_work = statistics.mean(s * d for s, d in SIM_KINDS)
    gap = mean_work / (load * devices)
    arrivals, t = [], 0.0
    for i in range(n_jobs):
        t += float(rng.exponential(gap))
        seconds, size = SIM_KINDS[int(rng.integers(len(SIM_KINDS)))]
        true = seconds * float(np.exp(rng.normal(0.0, noise)))
        arrivals.append((t, i + 1, seconds, size, true))
    jobs: dict[int, JobInput] = {}
    nominal: dict[int, float] = {}
    true_len: dict[int, float] = {}
    ends: dict[int, float] = {}
    rows: dict[int, dict[str, float]] = {}
    pending = list(arrivals)
    rng_pass = np.random.default_rng(seed)
    now = 0.0

    def remaining(at: float) -> dict[int, float | None]:
        out: dict[int, float | None] = {}
        for job in jobs.values():
            done = at - job.last_start if job.phase is JobPhase.RUNNING and job.last_start else 0.0
            out[job.id] = max(nominal[job.id] - done, 0.05 * nominal[job.id])
        return out

    while pending or jobs:
        next_arrival = pending[0][0] if pending else float("inf")
        next_end = min(ends.values(), default=float("inf"))
        now = min(next_arrival, next_end)
        for job_id in [j for j, e in ends.items() if e <= now]:
            del ends[job_id], jobs[job_id]
            rows[job_id]["end"] = now
        while pending and pending[0][0] <= now:
            at, job_id, seconds, size, true = pending.pop(0)
            jobs[job_id] = JobInput(
                id=job_id, submit_time=at, min_devices=size, elastic=False, owner="u"
            )
            nominal[job_id], true_len[job_id] = seconds, true
            found, _ = forecast(Snapshot(list(jobs.values()), nodes, now), policy, remaining(now))
            rows[job_id] = {
                "submit": at,
                "pred_start": found[job_id].start,  # type: ignore[dict-item]
                "pred_finish": found[job_id].finish,  # type: ignore[dict-item]
            }
        plan = run_pass(Snapshot(list(jobs.values()), nodes, now), policy, rng_pass)
        for action in plan.actions:
            if action.kind is ActionKind.START:
                jobs[action.job_id] = replace(
                    jobs[action.job_id],
                    phase=JobPhase.RUNNING,
                    allocation=action.allocation,
                    last_start=now,
                    restarts=1,
                )
                ends[action.job_id] = now + true_len[action.job_id]
                rows[action.job_id]["start"] = now
    return list(rows.values())


# --- 3. the cost of a forecast ---------------------------------------------------------------


def forecast_time(policy: Policy, queued: int = 1000, repeats: int = 5) -> float:
    nodes = [NodeInput("n", tuple(f"gpu:{i}" for i in range(8)))]
    jobs = [
        JobInput(id=i, submit_time=float(i), min_devices=1 + i % 2, elastic=False)
        for i in range(1, queued + 1)
    ]
    remaining: dict[int, float | None] = {job.id: 600.0 * (1 + job.id % 3) for job in jobs}
    snapshot = Snapshot(jobs, nodes, 0.0)
    forecast(snapshot, policy, remaining)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        forecast(snapshot, policy, remaining)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=30, help="jobs replayed into the daemon")
    parser.add_argument("--gap", type=float, default=2.0, help="mean seconds between them")
    parser.add_argument("--policy", default="fifo", choices=("fifo", "goodput"))
    parser.add_argument("--sim-jobs", type=int, default=400)
    parser.add_argument("--devices", type=int, default=16, help="simulated devices")
    parser.add_argument("--noise", type=float, default=0.2, help="sigma of log(true/nominal)")
    parser.add_argument("--load", type=float, default=0.9, help="offered load of the sim")
    parser.add_argument("--no-daemon", action="store_true", help="skip the real daemon run")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    policy: Policy = (
        FifoPolicy()
        if args.policy == "fifo"
        else GoodputPolicy(restart_cost_s=30.0, interval_s=60.0)
    )
    out: dict[str, object] = {"policy": args.policy}
    if not args.no_daemon:
        out["daemon"] = errors(daemon_run(args.jobs, args.policy, args.gap, args.seed), 1.0)
    out["simulated"] = errors(
        sim_run(args.sim_jobs, args.devices, args.noise, args.load, policy, args.seed), 60.0
    )
    out["forecast_1000_queued_ms"] = 1000 * forecast_time(policy)
    if args.json:
        print(json.dumps(out, indent=2))
        return
    for part in ("daemon", "simulated"):
        if part in out:
            r = out[part]
            assert isinstance(r, dict)
            print(
                f"{part}: {r['jobs']} jobs ({r['unknown']} unknown), mean wait "
                f"{r['mean_wait_s']:.1f} s; start error / wait: median {r['start_median']:.1%}, "
                f"p90 {r['start_p90']:.1%}; finish error / completion time: median "
                f"{r['finish_median']:.1%}, p90 {r['finish_p90']:.1%}"
            )
    print(f"forecast of 1,000 queued jobs: {out['forecast_1000_queued_ms']:.1f} ms")


if __name__ == "__main__":
    main()
