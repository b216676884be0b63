"""A tiny deterministic training job: the test suite's and the overhead benchmark's workload.

``python -m pollux_local.torch.probe --out final.pt`` trains a two-layer perceptron on a
synthetic classification set (generated from ``--seed``, so every replica and every
incarnation sees the same data) with the elastic trainer, under any launch environment.
``--log-samples PREFIX`` makes each replica append, per micro-batch, the optimizer step and the
sample indices it trained on; ``--signal-at-step N`` makes rank 0 send itself SIGTERM after
step N (the other replicas learn of it through the trainer); ``--order-at-step N1,N2,...`` makes
rank 0 move ``$POLLUX_RESIZE_FILE.next<i>`` into place after step Ni (warm resize orders at
known steps).  ``--mode plain`` runs the same
model as an ordinary DDP loop (no pollux_local at all) for the overhead benchmark, and
``--time-steps N`` prints the mean step time of steps after warm-up as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset


def make_data(samples: int, features: int, classes: int, seed: int) -> TensorDataset:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, features, generator=gen)
    teacher = torch.randn(features, classes, generator=gen)
    y = (x @ teacher + 0.5 * torch.randn(samples, classes, generator=gen)).argmax(dim=1)
    return TensorDataset(x, y, torch.arange(samples))


def make_model(
    features: int, hidden: int, classes: int, seed: int, activation: str = "relu"
) -> torch.nn.Module:
    """A two-layer MLP; ``tanh`` makes it smooth: runs that differ in the last bits of a step
    (another summation order) stay that close, where a ReLU that flips for one sample parts
    them by a unit's gradient."""
    torch.manual_seed(seed)
    act = torch.nn.Tanh() if activation == "tanh" else torch.nn.ReLU()
    return torch.nn.Sequential(
        torch.nn.Linear(features, hidden), act, torch.nn.Linear(hidden, classes)
    )


class Quadratic(torch.nn.Module):
    """loss_i = |w - x_i|^2 / 2: per-example gradient w - x_i, so |G|^2 = |w - mean(x)|^2 and
    tr(S) is the summed variance of x, both known exactly from the data."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 0.5 * (self.w - x).square().sum(dim=1).mean()


def make_quadratic_data(samples: int, dim: int, offset: float, seed: int) -> TensorDataset:
    gen = torch.Generator().manual_seed(seed)
    x = offset + torch.randn(samples, dim, generator=gen)
    return TensorDataset(x, torch.zeros(samples), torch.arange(samples))


def quadratic_truth(data: TensorDataset, base_batch: int) -> tuple[float, float]:
    """(|G|^2, tr(S)/M0) of the quadratic task at w = 0, from the data themselves."""
    x = data.tensors[0].double()
    sqr = float(x.mean(dim=0).square().sum())
    var = float(x.var(dim=0, unbiased=False).sum()) / base_batch
    return sqr, var


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--samples", type=int, default=512)
    p.add_argument("--features", type=int, default=32)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--classes", type=int, default=4)
    p.add_argument("--activation", choices=("relu", "tanh"), default="relu")
    p.add_argument("--base-batch", type=int, default=32)
    p.add_argument("--max-batch", type=int, default=None)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--task",
        choices=("classify", "quadratic"),
        default="classify",
        help="quadratic: a fixed point (lr 0) with known gradient statistics",
    )
    p.add_argument("--dim", type=int, default=2000, help="quadratic task dimension")
    p.add_argument("--no-adapt", action="store_true", help="keep the starting (m, s)")
    p.add_argument("--stats-interval", type=int, default=8)
    p.add_argument(
        "--stats-budget", type=float, default=0.01, help="0: measure every --stats-interval steps"
    )
    p.add_argument("--out", type=Path, default=None, help="rank 0 saves the final model here")
    p.add_argument("--log-samples", type=Path, default=None)
    p.add_argument("--signal-at-step", type=int, default=None)
    p.add_argument("--order-at-step", type=lambda v: [int(n) for n in v.split(",")], default=[])
    p.add_argument("--mode", choices=("elastic", "plain", "ab"), default="elastic")
    p.add_argument("--blocks", type=int, default=30, help="--mode ab: alternating blocks")
    p.add_argument("--time-steps", type=int, default=0)
    p.add_argument(
        "--pause", type=float, default=0.0, help="seconds slept per sample of each micro-batch"
    )
    p.add_argument("--pause-while", type=Path, default=None, help="--pause only while it exists")
    return p.parse_args(argv)


def _timing(wall: list[float], cpu: list[float]) -> dict[str, float]:
    """Median wall-clock and process-CPU seconds per step, after 5 warm-up steps."""
    return {
        "median_step_s": statistics.median(wall[5:]),
        "median_step_cpu_s": statistics.median(cpu[5:]),
    }


def run_plain(args: argparse.Namespace) -> int:
    """The same training as an ordinary DDP loop, for the overhead comparison."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    data = make_data(args.samples, args.features, args.classes, args.seed)
    model = make_model(args.features, args.hidden, args.classes, args.seed)
    if world > 1:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        model = DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    local = args.base_batch // world
    x, y, _ = data.tensors
    times: list[float] = []
    cpu_times: list[float] = []
    step = 0
    t_last, c_last = time.perf_counter(), time.process_time()
    gen = torch.Generator().manual_seed(args.seed)
    while step < args.time_steps + 5:
        perm = torch.randperm(len(data), generator=gen)
        for start in range(0, len(data) - args.base_batch + 1, args.base_batch):
            idx = perm[start + rank * local : start + (rank + 1) * local]
            loss = F.cross_entropy(model(x[idx]), y[idx])
            torch.autograd.backward(loss)
            opt.step()
            opt.zero_grad(set_to_none=True)
            now, cpu = time.perf_counter(), time.process_time()
            times.append(now - t_last)
            cpu_times.append(cpu - c_last)
            t_last, c_last = now, cpu
            step += 1
            if step >= args.time_steps + 5:
                break
    if rank == 0:
        print(json.dumps(_timing(times, cpu_times)))
    if world > 1:
        dist.destroy_process_group()
    return 0


def run_elastic(args: argparse.Namespace) -> int:
    from pollux_local.torch import ElasticTrainer

    t_imported = time.time()

    model: torch.nn.Module
    if args.task == "quadratic":
        data = make_quadratic_data(args.samples, args.dim, 0.2, args.seed)
        model = Quadratic(args.dim)
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
    else:
        data = make_data(args.samples, args.features, args.classes, args.seed)
        model = make_model(args.features, args.hidden, args.classes, args.seed, args.activation)
        opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    trainer = ElasticTrainer(
        model,
        opt,
        base_batch=args.base_batch,
        max_batch=args.max_batch,
        adapt=not args.no_adapt,
        stats_interval=args.stats_interval,
        stats_budget=args.stats_budget or None,
        report_interval_s=1.0,
    )
    start_mark = None
    phases: dict[str, float] = {}
    if os.environ.get("POLLUX_PROBE_T_START"):
        # restart-time measurement: seconds from the launcher's timestamp to the first step
        start_mark = float(os.environ["POLLUX_PROBE_T_START"])
        phases = {
            "imports_done": t_imported - start_mark,
            "trainer_ready": time.time() - start_mark,
        }
    loader = trainer.loader(data)
    log_file = None
    if args.log_samples is not None:
        path = Path(f"{args.log_samples}.rank{trainer.rank}.pid{os.getpid()}")
        log_file = path.open("a")
    times: list[float] = []
    cpu_times: list[float] = []
    t_last, c_last = time.perf_counter(), time.process_time()
    for epoch in trainer.epochs(args.epochs):
        for xb, yb, ib in loader:
            if log_file is not None:
                log_file.write(json.dumps([epoch, trainer.steps, ib.tolist()]) + "\n")
                log_file.flush()
            if args.task == "quadratic":
                loss = trainer.model(xb)
            else:
                loss = F.cross_entropy(trainer.model(xb), yb)
            if args.pause and (args.pause_while is None or args.pause_while.exists()):
                time.sleep(args.pause * len(xb))  # a slower model: its micro-batch's compute
            stepped = trainer.step(loss)
            if not stepped:
                continue
            now, cpu = time.perf_counter(), time.process_time()
            times.append(now - t_last)
            cpu_times.append(cpu - c_last)
            t_last, c_last = now, cpu
            if start_mark is not None and trainer.rank == 0:
                phases["first_step_after_s"] = time.time() - start_mark
                print(json.dumps(phases), flush=True)
                start_mark = None
            trainer.report_metrics(loss=loss.item())
            if trainer.steps == args.signal_at_step and trainer.rank == 0:
                os.kill(os.getpid(), signal.SIGTERM)
            if trainer.steps in args.order_at_step and trainer.rank == 0:
                order_file = os.environ["POLLUX_RESIZE_FILE"]
                nth = args.order_at_step.index(trainer.steps) + 1
                os.replace(f"{order_file}.next{nth}", order_file)
            if args.time_steps and len(times) >= args.time_steps + 5:
                break
        if args.time_steps and len(times) >= args.time_steps + 5:
            break
    if args.time_steps and trainer.rank == 0:
        print(json.dumps(_timing(times, cpu_times)))
    if args.out is not None and trainer.rank == 0:
        torch.save(
            {
                "model": trainer.module.state_dict(),
                "progress": trainer.progress,
                "steps": trainer.steps,
                "stats": trainer.grad_stats,
                "truth": quadratic_truth(data, args.base_batch)
                if args.task == "quadratic"
                else None,
            },
            args.out,
        )
    trainer.close()
    return 0


def run_ab(args: argparse.Namespace) -> int:
    """Alternate blocks of ``--time-steps`` steps of a plain (DDP) loop and of the elastic
    trainer on identical models in this process, so that load on the machine hits both alike;
    print the median over blocks of the elastic/plain time ratio (wall and process CPU)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from pollux_local.torch import ElasticTrainer

    data = make_data(args.samples, args.features, args.classes, args.seed)
    x, y, _ = data.tensors
    model_e = make_model(args.features, args.hidden, args.classes, args.seed)
    opt_e = torch.optim.SGD(model_e.parameters(), lr=args.lr, momentum=0.9)
    trainer = ElasticTrainer(
        model_e,
        opt_e,
        base_batch=args.base_batch,
        adapt=False,
        stats_interval=args.stats_interval,
        report_interval_s=10.0,
    )
    world, rank = trainer.replicas, trainer.rank
    model_p: torch.nn.Module = make_model(args.features, args.hidden, args.classes, args.seed)
    if world > 1:
        model_p = DistributedDataParallel(model_p)
    opt_p = torch.optim.SGD(model_p.parameters(), lr=args.lr, momentum=0.9)
    loader = trainer.loader(data)
    batches = iter(loader)
    gen = torch.Generator().manual_seed(args.seed)
    perm = torch.randperm(len(data), generator=gen)
    local = args.base_batch // world
    cursor = 0

    def plain_steps(n: int) -> None:
        nonlocal cursor
        for _ in range(n):
            if cursor + args.base_batch > len(data):
                cursor = 0
            idx = perm[cursor + rank * local : cursor + (rank + 1) * local]
            cursor += args.base_batch
            loss = F.cross_entropy(model_p(x[idx]), y[idx])
            torch.autograd.backward(loss)
            opt_p.step()
            opt_p.zero_grad(set_to_none=True)

    def elastic_steps(n: int) -> None:
        nonlocal batches
        done = 0
        while done < n:
            try:
                xb, yb, _ = next(batches)
            except StopIteration:
                batches = iter(loader)
                continue
            if trainer.step(F.cross_entropy(trainer.model(xb), yb)):
                done += 1

    ratios_wall, ratios_cpu = [], []
    plain_steps(5)
    elastic_steps(5)
    for block in range(args.blocks):
        measured = {}
        # alternate which loop goes first: the second of a pair runs measurably differently
        order = (plain_steps, elastic_steps) if block % 2 == 0 else (elastic_steps, plain_steps)
        for fn in order:
            if world > 1:
                dist.barrier()
            t, c = time.perf_counter(), time.process_time()
            fn(args.time_steps)
            measured[fn] = (time.perf_counter() - t, time.process_time() - c)
        ratios_wall.append(measured[elastic_steps][0] / measured[plain_steps][0])
        ratios_cpu.append(measured[elastic_steps][1] / measured[plain_steps][1])
    if rank == 0:
        print(
            json.dumps(
                {
                    "overhead_wall_pct": 100 * (statistics.median(ratios_wall) - 1),
                    "overhead_cpu_pct": 100 * (statistics.median(ratios_cpu) - 1),
                }
            )
        )
    trainer.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.mode == "ab":
        return run_ab(args)
    if args.mode == "plain":
        return run_plain(args)
    return run_elastic(args)


if __name__ == "__main__":
    sys.exit(main())
