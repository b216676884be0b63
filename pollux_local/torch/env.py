"""The launch environment of one replica, and process-group set-up from it.

The daemon's launchers set the torchrun variables (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``LOCAL_WORLD_SIZE``, ``NODE_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``) and the ``POLLUX_*``
variables of ``docs/architecture.md``.  Without any of them (``python train.py``) the job is a
single process on one device, with no process group.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from pollux_local.api.errors import PolluxError
from pollux_local.api.launch import DEFAULT_PG_TIMEOUT_S, LaunchEnvironment


@dataclass(frozen=True)
class JobEnv:
    """Where this replica stands in its job, as the launcher described it."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    node_rank: int = 0
    master_addr: str | None = None
    master_port: int | None = None
    job_id: str = "local"
    restarts: int = 0
    job_dir: Path | None = None
    checkpoint_dir: Path | None = None
    daemon_socket: str | None = None
    num_nodes: int = 1
    local_batch: int | None = None
    accum_steps: int | None = None
    device: str = "cpu"
    pg_timeout_s: float = DEFAULT_PG_TIMEOUT_S
    device_type: str | None = None
    device_slowdown: float | None = None

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> JobEnv:
        """Read the launch variables (the contract of ``pollux_local.api.launch``); a malformed
        value is a one-line ``PolluxError``.  Without ``POLLUX_DEVICE`` the device is CUDA when
        torch sees one."""
        launch = LaunchEnvironment.from_environ(os.environ if environ is None else environ)
        device = launch.device or ("cuda" if torch.cuda.is_available() else "cpu")
        return cls(
            rank=launch.rank,
            world_size=launch.world_size,
            local_rank=launch.local_rank,
            local_world_size=launch.local_world_size,
            node_rank=launch.node_rank,
            master_addr=launch.master_addr,
            master_port=launch.master_port,
            job_id=launch.job_id,
            restarts=launch.restarts,
            job_dir=Path(launch.job_dir) if launch.job_dir else None,
            checkpoint_dir=Path(launch.checkpoint_dir) if launch.checkpoint_dir else None,
            daemon_socket=launch.daemon_socket,
            num_nodes=launch.num_nodes,
            local_batch=launch.local_batch,
            accum_steps=launch.accum_steps,
            device=device,
            pg_timeout_s=launch.pg_timeout_s,
            device_type=launch.device_type,
            device_slowdown=launch.device_slowdown if device == "cpu" else None,
        )

    @property
    def distributed(self) -> bool:
        """True when this incarnation has more than one replica."""
        return self.world_size > 1

    def torch_device(self) -> torch.device:
        """The device this replica computes on (``cuda:LOCAL_RANK`` or ``cpu``).

        The launcher sets ``CUDA_VISIBLE_DEVICES`` per replica, so the local rank is used only
        when more than one device is visible.
        """
        if self.device == "cuda":
            if not torch.cuda.is_available():
                raise PolluxError("POLLUX_DEVICE is 'cuda' but no CUDA device is visible")
            index = self.local_rank if torch.cuda.device_count() > self.local_rank else 0
            return torch.device("cuda", index)
        return torch.device("cpu")


def init_distributed(env: JobEnv) -> None:
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
        torch.cuda.set_device(env.torch_device())
    dist.init_process_group(
        backend=backend,
        init_method=f"tcp://{env.master_addr}:{env.master_port}",
        rank=env.rank,
        world_size=env.world_size,
        timeout=datetime.timedelta(seconds=env.pg_timeout_s),
    )
