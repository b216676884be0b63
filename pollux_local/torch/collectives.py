"""The trainer's collectives: what the replicas of a job compute and decide together.

* a measuring step's one all-reduce, which averages the gradients and carries, appended to
  them, each replica's local squared gradient norm and its control flags, so that every
  replica takes the same decisions (stop for a rescale, checkpoint now, the spacing of the
  next measuring steps, a warm resize's generation) at the same step;
* the broadcast of rank 0's batch configuration;
* leaving the process group, every replica at once.

With one replica nothing here communicates (the callers do not call the all-reduce).
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Agreement:
    """The decisions every replica takes at a measuring step.

    ``stop``: some replica was asked to stop (sum_k stop_k > 0); ``checkpoint``: rank 0 found
    a periodic checkpoint due; ``interval``: rank 0's spacing of the next measuring steps
    (``None`` when it proposed none); ``resize``: the generation of the warm resize order
    rank 0 saw (0: none).
    """

    stop: bool
    checkpoint: bool
    interval: int | None
    resize: int = 0


def average_and_agree(
    grads: Sequence[torch.Tensor],
    local_sq: torch.Tensor,
    *,
    stop: bool,
    checkpoint: bool,
    interval: int,
    replicas: int,
    device: torch.device,
    resize: int = 0,
) -> tuple[float, Agreement]:
    """One all-reduce of [g_1 .. g_n, |g_local|^2, stop, checkpoint, interval, resize] over K
    replicas.

    In place, each gradient becomes the replicas' average g = (1/K) sum_k g_k.  Returns the
    mean local squared norm (1/K) sum_k |g_k|^2 and the :class:`Agreement` of the summed
    flags.  ``checkpoint``, ``interval`` and ``resize`` are rank 0's to propose: the other
    replicas pass ``False`` and 0, so that the sums are rank 0's values.
    """
    control = torch.tensor(
        [float(stop), float(checkpoint), float(interval), float(resize)], device=device
    )
    flat = torch.cat(
        [g.reshape(-1) for g in grads] + [local_sq.reshape(1).to(grads[0]), control.to(grads[0])]
    )
    dist.all_reduce(flat)
    flat.div_(replicas)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()
    values = (float(v) * replicas for v in flat[offset:].tolist())
    mean_local, stops, checkpoints, proposed, generation = values
    mean_local /= replicas
    agreed = Agreement(
        stop=stops > 0,
        checkpoint=checkpoints > 0,
        interval=int(round(proposed)) if proposed >= 1 else None,
        resize=int(round(generation)),
    )
    return mean_local, agreed


def broadcast_pair(first: int, second: int, device: torch.device) -> tuple[int, int]:
    """Rank 0's two integers, on every replica."""
    buf = torch.tensor([first, second], dtype=torch.int64)
    if device.type == "cuda":
        buf = buf.to(device)
    dist.broadcast(buf, src=0)
    a, b = (int(v) for v in buf.tolist())
    return a, b


def barrier(replicas: int) -> None:
    """Wait for every replica (nothing to wait for with one)."""
    if replicas > 1:
        dist.barrier()


def leave_group(replicas: int, drop_wrapper: Callable[[], None]) -> None:
    """Leave the process group together, every replica at once.

    The DDP wrapper goes first (``drop_wrapper``: its reducer holds the group), while every
    replica is still connected; then the group.  Left to the interpreter's exit, that teardown
    ran after a peer had gone and could block the process for ever.
    """
    if replicas <= 1 or not dist.is_initialized():
        return
    dist.barrier()
    drop_wrapper()
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()
