"""The host time a one-replica measuring step adds to an ordinary one.

    python benchmarks/measuring_step.py [--device cpu|cuda] [--features F --hidden H
                                         --batch B] [--blocks N] [--steps S]

Two ``ElasticTrainer``s of the probe MLP, one measuring the gradient statistics on every step
(``stats_interval=1``, no budget: every step goes through ``gradstats.SmallBatchGradNorm``'s
hooks and the read of the two norms), one never measuring, train in alternating blocks of
``--steps`` optimizer steps (which goes first alternates); on CUDA every step ends with
``torch.cuda.synchronize``, as in ``job_overhead.py``.  Printed: the median over ``--blocks``
pairs of blocks of (measuring step - ordinary step), per step, and the ordinary step's time.
On a small model this is host work (hooks, launches, one read), the part of
``job_overhead.py``'s measurement cost that the spacing cannot hide below its cap.  Compare
two trees by running it with ``PYTHONPATH`` at each, alternating.  The clock is the process's
CPU time on the CPU and the wall clock on CUDA.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--features", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=32)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--blocks", type=int, default=21)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=300)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    import torch
    from job_overhead import EpochBatches, probe_trainer, train_steps

    from pollux_local.torch.probe import make_data, make_model

    torch.set_num_threads(1)
    device = torch.device(args.device)
    on_gpu = device.type == "cuda"
    clock = time.perf_counter if on_gpu else time.process_time
    data = make_data(16384, args.features, 10, 0)

    def trainer(interval: int) -> Any:
        return probe_trainer(make_model(args.features, args.hidden, 10, 0), 0.01, args.batch,
                             interval, None)  # fmt: skip

    trainers = {"on": trainer(1), "off": trainer(10**9)}
    batches = {name: EpochBatches(t, data) for name, t in trainers.items()}
    synchronise = (lambda: torch.cuda.synchronize(device)) if on_gpu else None

    def steps(name: str, count: int) -> None:
        train_steps(trainers[name], batches[name], count, after=synchronise)

    for name in trainers:
        steps(name, args.warmup)
    extra: list[float] = []
    ordinary: list[float] = []
    for block in range(args.blocks):
        per_step: dict[str, float] = {}
        for name in ("on", "off") if block % 2 == 0 else ("off", "on"):
            start = clock()
            steps(name, args.steps)
            per_step[name] = (clock() - start) / args.steps
        extra.append(per_step["on"] - per_step["off"])
        ordinary.append(per_step["off"])
    result = {
        "device": args.device,
        "model": f"{args.features}-{args.hidden}-10, batch {args.batch}",
        "extra_per_measuring_step_us": round(statistics.median(extra) * 1e6, 1),
        "ordinary_step_us": round(statistics.median(ordinary) * 1e6, 1),
        "blocks": args.blocks,
    }
    if args.json:
        print(json.dumps(result))
    else:
        print(
            f"{result['device']} {result['model']}: a measuring step costs"
            f" {result['extra_per_measuring_step_us']:.0f} us more than an ordinary one"
            f" ({result['ordinary_step_us']:.0f} us; medians of {args.blocks} blocks)"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
