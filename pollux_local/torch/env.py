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

from pollux_local.errors import PolluxError

#: Process-group timeout used when ``POLLUX_PG_TIMEOUT_S`` is not set (a collective waiting on a
#: dead peer fails after this long instead of torch's default 30 minutes).
DEFAULT_PG_TIMEOUT_S = 120.0


def _int(env: Mapping[str, str], name: str, default: int | None) -> int | None:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise PolluxError(f"environment variable {name} must be an integer, got {raw!r}") from None


def _path(env: Mapping[str, str], name: str) -> Path | None:
    raw = env.get(name)
    return Path(raw) if raw else None


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

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> JobEnv:
        """Read the launch variables; a malformed value is a one-line ``PolluxError``."""
        env = os.environ if environ is None else environ
        world = _int(env, "WORLD_SIZE", 1) or 1
        rank = _int(env, "RANK", 0) or 0
        local_world = _int(env, "LOCAL_WORLD_SIZE", world) or world
        if world < 1:
            raise PolluxError(f"WORLD_SIZE must be at least 1, got {world}")
        if not 0 <= rank < world:
            raise PolluxError(f"RANK {rank} is outside 0..{world - 1}")
        nodes_default = max(1, -(-world // max(local_world, 1)))
        timeout_raw = env.get("POLLUX_PG_TIMEOUT_S")
        try:
            timeout = float(timeout_raw) if timeout_raw else DEFAULT_PG_TIMEOUT_S
        except ValueError:
            raise PolluxError(
                f"environment variable POLLUX_PG_TIMEOUT_S must be a number, got {timeout_raw!r}"
            ) from None
        device = env.get("POLLUX_DEVICE") or ("cuda" if torch.cuda.is_available() else "cpu")
        if device not in ("cpu", "cuda"):
            raise PolluxError(f"POLLUX_DEVICE must be 'cpu' or 'cuda', got {device!r}")
        local_batch = _int(env, "POLLUX_LOCAL_BATCH", None)
        accum = _int(env, "POLLUX_ACCUM_STEPS", None)
        if local_batch is not None and local_batch <= 0:
            raise PolluxError(f"POLLUX_LOCAL_BATCH must be positive, got {local_batch}")
        if accum is not None and accum <= 0:
            raise PolluxError(f"POLLUX_ACCUM_STEPS must be positive, got {accum}")
        return cls(
            rank=rank,
            world_size=world,
            local_rank=_int(env, "LOCAL_RANK", 0) or 0,
            local_world_size=local_world,
            node_rank=_int(env, "NODE_RANK", 0) or 0,
            master_addr=env.get("MASTER_ADDR") or None,
            master_port=_int(env, "MASTER_PORT", None),
            job_id=env.get("POLLUX_JOB_ID") or "local",
            restarts=_int(env, "POLLUX_RESTARTS", 0) or 0,
            job_dir=_path(env, "POLLUX_JOB_DIR"),
            checkpoint_dir=_path(env, "POLLUX_CHECKPOINT_DIR"),
            daemon_socket=env.get("POLLUX_DAEMON_SOCKET") or None,
            num_nodes=_int(env, "POLLUX_NUM_NODES", nodes_default) or nodes_default,
            local_batch=local_batch,
            accum_steps=accum,
            device=device,
            pg_timeout_s=timeout,
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
