"""The launch environment of one replica (``api.launch.LaunchEnvironment``, its device
resolved), and process-group set-up from it.

The daemon's launchers set the torchrun variables (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``LOCAL_WORLD_SIZE``, ``NODE_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``) and the ``POLLUX_*``
variables of ``docs/architecture.md``.  Without any of them (``python train.py``) the job is a
single process on one device, with no process group.
"""

from __future__ import annotations

import dataclasses
import datetime
import hmac
import os
from collections.abc import Mapping

import torch
import torch.distributed as dist

from pollux_local.api.errors import PolluxError
from pollux_local.api.launch import LaunchEnvironment, member_tag


def job_environment(environ: Mapping[str, str] | None = None) -> LaunchEnvironment:
    """This replica's launch environment (``api.launch.LaunchEnvironment``, the one read of
    the launch variables; a malformed value is a one-line ``PolluxError``), its device
    resolved: without ``POLLUX_DEVICE`` CUDA when torch sees one, else the CPU.  The declared
    slowdown applies to CPU devices only."""
    launch = LaunchEnvironment.from_environ(os.environ if environ is None else environ)
    device = launch.device or ("cuda" if torch.cuda.is_available() else "cpu")
    slowdown = launch.device_slowdown if device == "cpu" else None
    return dataclasses.replace(launch, device=device, device_slowdown=slowdown)


def torch_device(env: LaunchEnvironment) -> torch.device:
    """The device this replica computes on (``cuda:LOCAL_RANK`` or ``cpu``; no device named:
    the CPU), a shared job's memory cap applied to it (:func:`cap_gpu_memory`).

    The launcher sets ``CUDA_VISIBLE_DEVICES`` per replica, so the local rank is used only
    when more than one device is visible.
    """
    if env.device == "cuda":
        if not torch.cuda.is_available():
            raise PolluxError("POLLUX_DEVICE is 'cuda' but no CUDA device is visible")
        index = env.local_rank if torch.cuda.device_count() > env.local_rank else 0
        device = torch.device("cuda", index)
        cap_gpu_memory(env, device)
        return device
    return torch.device("cpu")


def cap_gpu_memory(env: LaunchEnvironment, device: torch.device) -> None:
    """A shared job's cap: its allocator may hold at most ``POLLUX_GPU_MEMORY_FRACTION`` of
    the device (``torch.cuda.set_per_process_memory_fraction``; an allocation past it raises
    ``torch.cuda.OutOfMemoryError`` in this job rather than starving its neighbours).  Called
    by :func:`torch_device`, before the job's first allocation; nothing without the variable.
    """
    if env.gpu_memory_fraction is not None and device.type == "cuda":
        torch.cuda.set_per_process_memory_fraction(env.gpu_memory_fraction, device)


def init_distributed(env: LaunchEnvironment) -> None:
    """Join the job's process group (gloo on CPU, NCCL on CUDA) when it has several replicas.

    A single-replica job gets no process group at all; every collective in this package is
    skipped in that case.
    """
    if not env.distributed or dist.is_initialized():
        return
    if env.master_addr is None or env.master_port is None:
        raise PolluxError("WORLD_SIZE > 1 needs MASTER_ADDR and MASTER_PORT to be set")
    backend = "nccl" if env.device == "cuda" else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(torch_device(env))
    dist.init_process_group(
        backend=backend,
        init_method=f"tcp://{env.master_addr}:{env.master_port}",
        rank=env.rank,
        world_size=env.world_size,
        timeout=datetime.timedelta(seconds=env.pg_timeout_s),
    )
    try:
        verify_members(env, torch_device(env) if backend == "nccl" else torch.device("cpu"))
    except BaseException:
        dist.destroy_process_group()
        raise


def verify_members(env: LaunchEnvironment, device: torch.device) -> None:
    """Every replica of the group just formed holds the incarnation's secret
    (``POLLUX_JOB_SECRET``): each sends its tag (``api.launch.member_tag``) to all, and each
    checks every other's, before anything of the job's crosses the group.  The group's
    address is known to others (a warm resize's order file may be read by anyone) and its
    port may be taken by another process before rank 0 binds it: that process, whoever it
    poses as, cannot make a tag, and the replicas stop here (:class:`PolluxError`) instead of
    taking its weights or unpickling what it sends.  A replica without a secret (started
    by hand) takes part and checks nothing."""
    if env.world_size <= 1:
        return
    address = f"{env.master_addr}:{env.master_port}"
    port = int(env.master_port or 0)
    # a replica without a secret sends zeros (every replica takes part: none waits alone)
    secret = env.job_secret
    mine = member_tag(secret, port, env.world_size, env.rank) if secret else bytes(32)
    sent = torch.tensor(list(mine), dtype=torch.uint8, device=device)
    got = [torch.empty_like(sent) for _ in range(env.world_size)]
    dist.all_gather(got, sent)
    if secret is None:
        return  # started by hand: nothing to check against
    for rank, tag in enumerate(got):
        expected = member_tag(secret, port, env.world_size, rank)
        if not hmac.compare_digest(bytes(tag.cpu().tolist()), expected):
            raise PolluxError(
                f"the process group at {address} has a rank {rank} that does not hold the"
                " job's secret: another process took its port; leaving it"
            )
