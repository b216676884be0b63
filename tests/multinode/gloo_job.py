"""A small data-parallel training job for the multi-node tests (torch.distributed, gloo).

Follows the launch contract of docs/architecture.md: torchrun variables, a process group with
``POLLUX_PG_TIMEOUT_S``, a checkpoint in ``POLLUX_CHECKPOINT_DIR`` (rank 0, atomic), SIGTERM ->
checkpoint and exit 75.  Appends one JSON line per incarnation to ``$POLLUX_CHECKPOINT_DIR/
incarnations.jsonl`` (hosts, world size, first step) and writes ``done.json`` at the end.

    python gloo_job.py --steps 200 --step-sleep 0.02
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import socket
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

RESCALE_EXIT_CODE = 75


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--step-sleep", type=float, default=0.02)
    parser.add_argument("--checkpoint-every", type=int, default=10)
    args = parser.parse_args()

    torch.set_num_threads(1)
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    ckpt_dir = Path(os.environ.get("POLLUX_CHECKPOINT_DIR", "."))
    ckpt = ckpt_dir / "model.pt"
    stop = {"requested": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.update(requested=True))

    if world > 1:
        timeout = float(os.environ.get("POLLUX_PG_TIMEOUT_S", "20"))
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout))

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    optimiser = torch.optim.SGD(model.parameters(), lr=0.05)
    step = 0
    if ckpt.exists():
        state = torch.load(ckpt)
        model.load_state_dict(state["model"])
        optimiser.load_state_dict(state["optimiser"])
        step = int(state["step"])

    hosts = [socket.gethostname()]
    if world > 1:
        gathered: list[str | None] = [None] * world
        dist.all_gather_object(gathered, socket.gethostname())
        hosts = [h or "?" for h in gathered]
    if rank == 0:
        with open(ckpt_dir / "incarnations.jsonl", "a") as fh:
            fh.write(json.dumps({"start_step": step, "world": world, "hosts": hosts}) + "\n")
    print(f"rank {rank}/{world} on {socket.gethostname()} starts at step {step}", flush=True)

    def save() -> None:
        if rank != 0:
            return
        tmp = ckpt.with_suffix(".tmp")
        torch.save(
            {"model": model.state_dict(), "optimiser": optimiser.state_dict(), "step": step}, tmp
        )
        os.replace(tmp, ckpt)

    generator = torch.Generator().manual_seed(1234 + rank)
    target_w = torch.linspace(-1, 1, 16)
    while step < args.steps:
        x = torch.randn(32, 16, generator=generator)
        y = (x @ target_w).unsqueeze(1)
        loss = torch.nn.functional.mse_loss(model(x), y)
        optimiser.zero_grad()
        loss.backward()
        flag = torch.tensor([1.0 if stop["requested"] else 0.0])
        if world > 1:
            for p in model.parameters():
                assert p.grad is not None
                dist.all_reduce(p.grad)
                p.grad /= world
            dist.all_reduce(flag)
        optimiser.step()
        step += 1
        if step % args.checkpoint_every == 0:
            save()
        if flag.item() > 0:
            # Decided together: a SIGTERM arriving from here on (a peer's flag can come first)
            # must not kill the exit at interpreter shutdown, where the handler is gone.
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            save()
            print(f"rank {rank}: checkpointed at step {step} for a rescale", flush=True)
            if world > 1:
                # Leave the group together: a rank exiting while its peer still holds the
                # connection can make the peer's gloo threads abort (exit 134).
                dist.barrier()
                dist.destroy_process_group()
            return RESCALE_EXIT_CODE
        if step % 20 == 0:
            print(f"rank {rank} step {step} loss {loss.item():.4f}", flush=True)
        time.sleep(args.step_sleep)

    save()
    if rank == 0:
        (ckpt_dir / "done.json").write_text(
            json.dumps({"step": step, "loss": loss.item(), "hosts": hosts})
        )
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()
    print(f"rank {rank} finished at step {step}", flush=True)
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # The group has been left and the checkpoint written.  torch's native threads can still
    # abort the interpreter's own teardown ("terminate called without an active exception",
    # exit 134: 2 runs in about 200 of this job here); these tests are of the launcher.
    os._exit(code)
