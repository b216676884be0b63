"""How long the TUI takes to render with many jobs (goal: <= 50 ms with 200 jobs).

Runs the app headless (Textual's test driver) on canned data — 200 jobs on 16 nodes x 4
devices by default — and times, over ``--repeat`` rounds:

* ``update``: a refresh's work on the UI thread (parse the replies, fill the jobs table, the
  device grid, the cluster figures and plot) — before each round every running job's goodput,
  efficiency, progress and ETA change, as they do between two real refreshes;
* ``frame``: compositing the whole main screen (every widget rendered to segments);
* ``update+frame``: both, i.e. what one refresh costs before the terminal receives it;
* ``detail``: filling the job detail screen (three plots through the core, decisions, log).

Usage: ``python benchmarks/tui_render.py [--jobs 200] [--nodes 16] [--devices 4] [--json]``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pollux_local.tui.app import PolluxApp  # noqa: E402
from pollux_local.tui.demo import demo_recording  # noqa: E402
from pollux_local.tui.screens.job_detail import JobScreen  # noqa: E402
from pollux_local.tui.source import FixedSource  # noqa: E402


def _stats(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    p95 = ordered[min(len(ordered) - 1, int(round(0.95 * (len(ordered) - 1))))]
    return {
        "median_ms": round(1e3 * statistics.median(ordered), 2),
        "p95_ms": round(1e3 * p95, 2),
        "max_ms": round(1e3 * ordered[-1], 2),
    }


async def measure(jobs: int, nodes: int, devices: int, repeat: int) -> dict[str, Any]:
    source = FixedSource(demo_recording(n_jobs=jobs, n_nodes=nodes, devices_per_node=devices))
    app = PolluxApp(source, sync=True, refresh_s=3600)
    update: list[float] = []
    frame: list[float] = []
    both: list[float] = []
    detail: list[float] = []
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.pause()
        assert app.query_one("#jobs").row_count == jobs  # type: ignore[attr-defined]
        compositor = app.screen._compositor
        rng = random.Random(0)
        for _ in range(repeat):
            for job in source.status.jobs:
                if job.state == "running":
                    job.goodput = round((job.goodput or 0.0) * rng.uniform(0.95, 1.05), 1)
                    job.progress = round((job.progress or 0.0) + rng.uniform(5, 50), 1)
                    job.eta_s = max(0.0, (job.eta_s or 0.0) - rng.randrange(1, 30))
            replies = app._load()  # in the app this runs in a worker thread
            t0 = time.perf_counter()
            app._loaded(replies)
            t1 = time.perf_counter()
            compositor.render_update(full=True)
            t2 = time.perf_counter()
            update.append(t1 - t0)
            frame.append(t2 - t1)
            both.append(t2 - t0)
            await pilot.pause()
        running = next(r.id for r in app.rows if r.state == "running")
        await app.push_screen(JobScreen(running))
        await pilot.pause()
        screen = app.screen
        assert isinstance(screen, JobScreen)
        for _ in range(repeat):
            t0 = time.perf_counter()
            screen.show_detail(screen.log_lines)
            screen._compositor.render_update(full=True)
            detail.append(time.perf_counter() - t0)
            await pilot.pause()
    return {
        "jobs": jobs,
        "devices": nodes * devices,
        "repeat": repeat,
        "update": _stats(update),
        "frame": _stats(frame),
        "update+frame": _stats(both),
        "detail": _stats(detail),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=200)
    parser.add_argument("--nodes", type=int, default=16)
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=30)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    result = asyncio.run(measure(args.jobs, args.nodes, args.devices, args.repeat))
    if args.json:
        print(json.dumps(result))
        return 0
    print(
        f"TUI render, {result['jobs']} jobs, {result['devices']} devices, 120x40, {args.repeat} rounds"
    )
    for key in ("update", "frame", "update+frame", "detail"):
        s = result[key]
        print(
            f"  {key:<13} median {s['median_ms']:7.2f} ms   p95 {s['p95_ms']:7.2f} ms"
            f"   max {s['max_ms']:7.2f} ms"
        )
    verdict = "meets" if result["update+frame"]["median_ms"] <= 50 else "MISSES"
    print(f"  goal <= 50 ms per refresh with 200 jobs: {verdict}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
