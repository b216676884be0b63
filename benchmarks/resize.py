"""Warm vs cold resize downtime of the example jobs in ``jobs/`` on CPU devices.

    python benchmarks/resize.py [--rounds 2] [--pairs 5] [--jobs tabular_mlp ...]

For each job, ``--rounds`` rounds; each round runs the job twice, one after the other (which
goes first alternates): once resized warm (``torch/resizing.py``: an order file, joiners
started beforehand, a new gloo group formed in place), once cold (every replica SIGTERMed,
checkpointed, exit 75, restarted at the new size: what the daemon does today).  Each run grows
1 -> 2 replicas and shrinks 2 -> 1 ``--pairs`` times, so that each figure is the median of
rounds x pairs resizes.
Downtime is rank 0's time from the end of the last optimizer step at the old size to the end
of the first one at the new size (so it includes one step of compute).  Printed: the median
(and min-max) over the rounds, per job, direction and path, and warm / cold.

This script launches the replicas itself, as the local launcher would (the launch
environment of ``api/launch.py``); ``--replica SCRIPT ARGS...`` is its replica wrapper, which
records the end time of each optimizer step and keeps the job training past its target.
"""

from __future__ import annotations

import argparse
import os
import runpy
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
JOBS = ("tabular_mlp", "digits_cnn", "char_transformer")
#: optimizer steps each run makes at a size before it is resized
STEPS_AT_SIZE = 12


def replica_main(argv: list[str]) -> None:
    """Run a job script, recording ``time replicas`` at the end of each optimizer step (rank
    0) in ``$BENCH_STEPS``, its target never reached (it trains until stopped)."""
    from pollux_local.api.spec import Target
    from pollux_local.torch.measuring import MeasuringSchedule

    path = os.environ["BENCH_STEPS"]
    rank0 = os.environ.get("RANK", "0") == "0"
    end_step = MeasuringSchedule.end_step

    def timed(self: MeasuringSchedule) -> None:
        end_step(self)
        if rank0:
            with open(path, "a") as fh:
                fh.write(f"{time.time():.6f} {self.replicas}\n")

    MeasuringSchedule.end_step = timed  # type: ignore[method-assign]
    Target.reached = lambda self, measured: False  # type: ignore[method-assign]
    sys.argv = argv
    runpy.run_path(argv[0], run_name="__main__")


class Run:
    """One run of a job: its replicas, launched as the local launcher does."""

    def __init__(self, job: str, tmp: Path, warm: bool) -> None:
        self.job = job
        self.tmp = tmp
        self.warm = warm
        self.steps_file = tmp / "steps"
        self.order_file = tmp / "resize.json"
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        self.generation = 0
        self.world = 0
        self.port = 0

    def spawn(self, rank: int, world: int, port: int, **extra: str) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("POLLUX_", "RANK"))}
        env.update(
            OMP_NUM_THREADS="1",
            RANK=str(rank),
            WORLD_SIZE=str(world),
            LOCAL_RANK=str(rank),
            LOCAL_WORLD_SIZE=str(world),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            POLLUX_JOB_ID=f"bench-{self.job}",
            POLLUX_JOB_DIR=str(self.tmp),
            POLLUX_CHECKPOINT_DIR=str(self.tmp / "ckpt"),
            POLLUX_PG_TIMEOUT_S="60",
            POLLUX_DEVICE="cpu",
            POLLUX_RESIZE_FILE=str(self.order_file),
            BENCH_STEPS=str(self.steps_file),
            PYTHONPATH=str(REPO),
        )
        env.update(extra)
        script = REPO / "jobs" / self.job / "train.py"
        log = (self.tmp / f"rank{rank}.log").open("ab")
        self.procs[rank] = subprocess.Popen(
            [sys.executable, __file__, "--replica", str(script), "--max-epochs", "100000"],
            env=env,
            cwd=script.parent,
            stdout=log,
            stderr=log,
        )

    def start(self, world: int) -> None:
        from pollux_local.launch.base import pick_master_port

        self.world, self.port = world, pick_master_port()
        for rank in range(world):
            self.spawn(rank, world, self.port)

    def steps(self) -> list[tuple[float, int]]:
        try:
            lines = self.steps_file.read_text().splitlines()
        except FileNotFoundError:
            return []
        return [(float(t), int(k)) for t, k in (line.split() for line in lines if line)]

    def wait_steps(self, replicas: int, count: int, timeout: float = 300.0) -> None:
        deadline = time.monotonic() + timeout
        while sum(1 for _, k in self.steps() if k == replicas) < count:
            for rank, proc in self.procs.items():
                if proc.poll() not in (None, 0, 75):
                    tail = (self.tmp / f"rank{rank}.log").read_text()[-2000:]
                    raise RuntimeError(f"{self.job} rank {rank} failed:\n{tail}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.job}: no steps at {replicas} replicas")
            time.sleep(0.01)

    def resize(self, new: int) -> float:
        """Resize to ``new`` replicas; the downtime (s)."""
        from pollux_local.api.resize import ResizeOrder
        from pollux_local.launch.base import pick_master_port
        from pollux_local.launch.warm import joiners_ready, write_order

        old = self.world
        seen = sum(1 for _, k in self.steps() if k == new)
        port = pick_master_port()
        if self.warm:
            self.generation += 1
            joiners = range(old, new)
            for rank in joiners:
                self.spawn(rank, new, port, POLLUX_RESIZE_JOIN=str(self.generation))
            while not joiners_ready(self.tmp, self.generation, joiners):
                time.sleep(0.005)
            order = ResizeOrder(
                generation=self.generation,
                world_size=new,
                master_addr="127.0.0.1",
                master_port=port,
            )
            write_order(self.order_file, order)
            for rank in range(new, old):  # leavers exit 0
                if self.procs.pop(rank).wait(timeout=120) != 0:
                    raise RuntimeError(f"{self.job}: leaving rank {rank} did not exit 0")
        else:
            for proc in self.procs.values():
                proc.send_signal(signal.SIGTERM)
            for rank, proc in self.procs.items():
                if proc.wait(timeout=120) != 75:
                    raise RuntimeError(f"{self.job}: rank {rank} did not checkpoint (exit 75)")
            self.procs.clear()
            for rank in range(new):
                self.spawn(rank, new, port)
        self.world, self.port = new, port
        self.wait_steps(new, seen + 1)
        steps = self.steps()
        first = [i for i, (_, k) in enumerate(steps) if k == new][seen]
        return steps[first][0] - steps[first - 1][0]

    def stop(self) -> None:
        for proc in self.procs.values():
            proc.kill()
        for proc in self.procs.values():
            proc.wait()


def one_run(job: str, warm: bool, pairs: int) -> tuple[list[float], list[float]]:
    """Grow 1 -> 2 then shrink 2 -> 1, ``pairs`` times; the downtimes of each."""
    grows: list[float] = []
    shrinks: list[float] = []
    with tempfile.TemporaryDirectory(prefix="resize-bench-") as tmp:
        run = Run(job, Path(tmp), warm)
        try:
            run.start(1)
            for _ in range(pairs):
                run.wait_steps(1, sum(1 for _, k in run.steps() if k == 1) + STEPS_AT_SIZE)
                grows.append(run.resize(2))
                run.wait_steps(2, sum(1 for _, k in run.steps() if k == 2) + STEPS_AT_SIZE)
                shrinks.append(run.resize(1))
            return grows, shrinks
        finally:
            run.stop()


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--replica":
        replica_main(sys.argv[2:])
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--jobs", nargs="+", default=list(JOBS), choices=JOBS)
    args = parser.parse_args()
    print(
        f"{args.rounds} rounds x {args.pairs} resizes each way, warm and cold runs interleaved;"
        f" {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}",
        flush=True,
    )
    results: dict[tuple[str, str, str], list[float]] = {}
    for job in args.jobs:
        for round_no in range(args.rounds):
            for warm in (round_no % 2 == 0, round_no % 2 == 1):  # alternate who goes first
                grows, shrinks = one_run(job, warm, args.pairs)
                path = "warm" if warm else "cold"
                results.setdefault((job, "1->2", path), []).extend(grows)
                results.setdefault((job, "2->1", path), []).extend(shrinks)
                print(
                    f"  {job} {path}: grow {' '.join(f'{t:.2f}' for t in grows)} s;"
                    f" shrink {' '.join(f'{t:.2f}' for t in shrinks)} s",
                    flush=True,
                )
    print()
    print(
        f"{'job':18} {'resize':6} {'warm median (min-max)':>24} {'cold median (min-max)':>24}"
        f" {'warm/cold':>9}"
    )
    for job in args.jobs:
        for direction in ("1->2", "2->1"):
            warm_t, cold_t = results[(job, direction, "warm")], results[(job, direction, "cold")]
            w, c = statistics.median(warm_t), statistics.median(cold_t)
            print(
                f"{job:18} {direction:6} {w:9.3f} s ({min(warm_t):.2f}-{max(warm_t):.2f})"
                f" {c:9.3f} s ({min(cold_t):.2f}-{max(cold_t):.2f}) {w / c:9.2f}"
            )


if __name__ == "__main__":
    main()
