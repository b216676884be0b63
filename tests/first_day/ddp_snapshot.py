"""A plain PyTorch DDP training script of the kind the tutorials publish, written for torchrun.

Synthetic regression data; every epoch rank 0 saves ``snapshot.pt`` in the working directory
and a (re)start resumes from it.  Prints one line per start and per epoch, and a ``started``
marker file line per start (``starts.txt``), so that a test can count its incarnations.
"""

import argparse
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--pause", type=float, default=0.0, help="seconds to sleep per epoch")
    args = parser.parse_args()

    launched = dist.is_torchelastic_launched()
    if launched:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if launched else 0
    world = dist.get_world_size() if launched else 1
    print(f"start rank {rank} of {world} torchelastic={launched}", flush=True)
    if rank == 0:
        with open("starts.txt", "a") as marks:
            marks.write(f"world {world}\n")

    generator = torch.Generator().manual_seed(0)
    x = torch.randn(512, 8, generator=generator)
    y = x @ torch.arange(8, dtype=torch.float32) + 0.1 * torch.randn(512, generator=generator)
    data = TensorDataset(x, y)
    model = torch.nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    first_epoch = 0
    if os.path.exists("snapshot.pt"):
        snapshot = torch.load("snapshot.pt")
        model.load_state_dict(snapshot["model"])
        optimizer.load_state_dict(snapshot["optimizer"])
        first_epoch = snapshot["epoch"] + 1
    ddp = DistributedDataParallel(model) if launched else model
    sampler = DistributedSampler(data) if launched else None
    loader = DataLoader(data, batch_size=32, sampler=sampler, shuffle=sampler is None)
    for epoch in range(first_epoch, args.epochs):
        if sampler is not None:
            sampler.set_epoch(epoch)
        for xb, yb in loader:
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(ddp(xb).squeeze(1), yb)
            loss.backward()
            optimizer.step()
        if rank == 0:
            torch.save(
                {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch},
                "snapshot.pt",
            )
        print(f"epoch {epoch} rank {rank} loss {loss.item():.4f}", flush=True)
        if args.pause:
            import time

            time.sleep(args.pause)
    if launched:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
