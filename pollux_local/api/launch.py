"""The launch environment: what the daemon's launchers give every replica, and what the job
library reads back.  One definition for both sides (``LaunchEnvironment``).

Besides the torchrun variables (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
``NODE_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``) a replica gets:

=========================  ===============================================================
``POLLUX_JOB_ID``          the job's id
``POLLUX_RESTARTS``        how many times the job was (re)started before this incarnation
``POLLUX_JOB_DIR``         the job's directory (report, logs)
``POLLUX_CHECKPOINT_DIR``  where the job checkpoints (shared by every node it spans)
``POLLUX_DAEMON_SOCKET``   the daemon's socket, when the job can reach it
``POLLUX_NUM_NODES``       nodes spanned by this incarnation
``POLLUX_LOCAL_BATCH``     the scheduler's local batch m (absent: the job chooses)
``POLLUX_ACCUM_STEPS``     the scheduler's accumulation steps s (absent: the job chooses)
``POLLUX_DEVICE``          ``cpu`` or ``cuda``
``POLLUX_PG_TIMEOUT_S``    process-group timeout in seconds (no collective hangs unbounded)
``POLLUX_RESIZE_FILE``     where the launcher writes warm resize orders (``api/resize.py``)
``POLLUX_RESIZE_JOIN``     a replica joining a warm resize: the order's generation
``POLLUX_JOB_SECRET``      the incarnation's secret (random, the job's processes alone see
                           it): every replica of a process group proves it holds it before
                           anything of the job's crosses the group (:func:`member_tag`), so
                           that a process that took the group's port is found out
=========================  ===============================================================

A shared job (``submit --shared``) on a GPU also gets ``POLLUX_GPU_MEMORY_FRACTION``, its
declared memory over the device's, at which the job library caps its allocator
(``torch.cuda.set_per_process_memory_fraction``), and ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT``
(``0=<MiB>M``: its declared memory on the one device it sees), which the CUDA driver
enforces on any process while an MPS control daemon runs.

Every replica also gets the rest of torchrun's contract (``GROUP_RANK``, ``ROLE_RANK``,
``ROLE_NAME``, ``ROLE_WORLD_SIZE``, ``GROUP_WORLD_SIZE``, ``TORCHELASTIC_RUN_ID``,
``TORCHELASTIC_RESTART_COUNT``, ``TORCHELASTIC_MAX_RESTARTS``, ``TORCHELASTIC_USE_AGENT_STORE``),
so that ``torch.distributed.is_torchelastic_launched()`` is true and a script written for
``torchrun`` runs unchanged (:func:`replica_environ`).

Without any of them (``python train.py``) a job is one process on one device.
"""

from __future__ import annotations

import hashlib
import hmac
import math
from collections.abc import Mapping
from dataclasses import dataclass

from pollux_local.api.errors import PolluxError

#: Process-group timeout when ``POLLUX_PG_TIMEOUT_S`` is not set (torch's own is 30 minutes).
DEFAULT_PG_TIMEOUT_S = 120.0

#: The torchrun variables that depend on the rank (set per replica by the launcher).
PER_RANK_VARIABLES = (
    "RANK",
    "LOCAL_RANK",
    "NODE_RANK",
    "GROUP_RANK",
    "ROLE_RANK",
    "LOCAL_WORLD_SIZE",
    "CUDA_VISIBLE_DEVICES",
    "POLLUX_DEVICE",
)
#: Variables that describe one job's launch and must never leak from a submitting shell into
#: another job's environment.
LAUNCH_VARIABLES = frozenset(
    {
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "NODE_RANK",
        "GROUP_RANK",
        "MASTER_ADDR",
        "MASTER_PORT",
        "CUDA_VISIBLE_DEVICES",
        "ROLE_RANK",
        "ROLE_NAME",
        "ROLE_WORLD_SIZE",
        "GROUP_WORLD_SIZE",
        "TORCHELASTIC_RUN_ID",
        "TORCHELASTIC_RESTART_COUNT",
        "TORCHELASTIC_MAX_RESTARTS",
        "TORCHELASTIC_USE_AGENT_STORE",
        "TORCHELASTIC_ERROR_FILE",
        "SLURM_ARRAY_JOB_ID",
        "SLURM_ARRAY_TASK_ID",
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT",
    }
)
#: Prefix of the variables this contract owns.
POLLUX_PREFIX = "POLLUX_"


def without_launch_variables(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` less what describes a launch (:data:`LAUNCH_VARIABLES` and every ``POLLUX_*``):
    what a submitting shell, or a job's stored environment, may give the job; the daemon sets
    the rest for each start (a raw request's ``POLLUX_RESIZE_JOIN`` would make a replica wait
    for a resize nobody ordered)."""
    return {
        key: value
        for key, value in env.items()
        if not key.startswith(POLLUX_PREFIX) and key not in LAUNCH_VARIABLES
    }


def _int(env: Mapping[str, str], name: str, default: int | None) -> int | None:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise PolluxError(f"environment variable {name} must be an integer, got {raw!r}") from None


def _positive(env: Mapping[str, str], name: str) -> float | None:
    raw = env.get(name)
    if not raw:
        return None
    try:
        value = float(raw)
    except ValueError:
        raise PolluxError(f"environment variable {name} must be a number, got {raw!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise PolluxError(f"{name} must be a positive number, got {raw!r}")
    return value


@dataclass(frozen=True)
class LaunchEnvironment:
    """Where one replica stands in its job.

    Attributes mirror the variables above; ``rank``/``local_rank``/``node_rank`` are per
    replica, the rest common to the incarnation.
    """

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    node_rank: int = 0
    master_addr: str | None = None
    master_port: int | None = None
    job_id: str = "local"
    restarts: int = 0
    job_dir: str | None = None
    checkpoint_dir: str | None = None
    daemon_socket: str | None = None
    num_nodes: int = 1
    local_batch: int | None = None
    accum_steps: int | None = None
    #: ``cpu`` or ``cuda``; ``None`` when not set (the job library then looks for CUDA)
    device: str | None = None
    pg_timeout_s: float = DEFAULT_PG_TIMEOUT_S
    #: the array this job is a task of (its first task's id) and its index there
    array_id: str | None = None
    array_index: int | None = None
    #: the job's time limit in seconds (``None``: none)
    time_limit_s: float | None = None
    #: the type of the devices this incarnation runs on (``None``: untyped)
    device_type: str | None = None
    #: CPU-backed test devices only: how many times slower than plain CPU they are declared
    #: to be (``[nodes.NAME] slowdown``); the job library stretches each micro-batch by it
    device_slowdown: float | None = None
    #: a shared job on a GPU: its declared memory (bytes) and that over the device's memory
    gpu_memory_limit: int | None = None
    gpu_memory_fraction: float | None = None
    #: warm resizes (``api/resize.py``): the order file, and the generation a joiner joins at
    resize_file: str | None = None
    resize_join: int | None = None
    #: the incarnation's secret (``POLLUX_JOB_SECRET``; ``None``: started by hand)
    job_secret: str | None = None

    @property
    def distributed(self) -> bool:
        """True when this incarnation has more than one replica."""
        return self.world_size > 1

    def common_environ(self) -> dict[str, str]:
        """The variables common to every replica of the incarnation (no per-rank ones)."""
        env = {
            "WORLD_SIZE": str(self.world_size),
            "POLLUX_JOB_ID": self.job_id,
            "POLLUX_RESTARTS": str(self.restarts),
            "POLLUX_NUM_NODES": str(self.num_nodes),
            "POLLUX_PG_TIMEOUT_S": f"{self.pg_timeout_s:g}",
        }
        optional = {
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": self.master_port,
            "POLLUX_JOB_DIR": self.job_dir,
            "POLLUX_CHECKPOINT_DIR": self.checkpoint_dir,
            "POLLUX_DAEMON_SOCKET": self.daemon_socket,
            "POLLUX_LOCAL_BATCH": self.local_batch,
            "POLLUX_ACCUM_STEPS": self.accum_steps,
            "POLLUX_DEVICE": self.device,
            "POLLUX_ARRAY_ID": self.array_id,
            "POLLUX_ARRAY_INDEX": self.array_index,
            # for scripts written for Slurm arrays
            "SLURM_ARRAY_JOB_ID": self.array_id,
            "SLURM_ARRAY_TASK_ID": self.array_index,
            "POLLUX_TIME_LIMIT_S": None if self.time_limit_s is None else f"{self.time_limit_s:g}",
            "POLLUX_DEVICE_TYPE": self.device_type,
            "POLLUX_RESIZE_FILE": self.resize_file,
            "POLLUX_RESIZE_JOIN": self.resize_join,
            "POLLUX_JOB_SECRET": self.job_secret,
            "POLLUX_DEVICE_SLOWDOWN": (
                None if self.device_slowdown is None else f"{self.device_slowdown:g}"
            ),
            "POLLUX_GPU_MEMORY_FRACTION": (
                None if self.gpu_memory_fraction is None else f"{self.gpu_memory_fraction:.6g}"
            ),
            # the one device a shared job sees is its device 0
            "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": (
                None if self.gpu_memory_limit is None else f"0={self.gpu_memory_limit >> 20}M"
            ),
        }
        env.update({name: str(value) for name, value in optional.items() if value is not None})
        return env

    def to_environ(self) -> dict[str, str]:
        """Every variable of this replica (the common ones plus its ranks)."""
        return replica_environ(
            self.common_environ(),
            rank=self.rank,
            local_rank=self.local_rank,
            node_rank=self.node_rank,
            local_world_size=self.local_world_size,
            device=self.device or "cpu",
            device_index=None,
        )

    @classmethod
    def from_environ(cls, env: Mapping[str, str]) -> LaunchEnvironment:
        """Read the variables back; a malformed value is a one-line ``PolluxError``."""
        world = _int(env, "WORLD_SIZE", 1)
        rank = _int(env, "RANK", 0)
        assert world is not None and rank is not None
        if world < 1:
            raise PolluxError(f"WORLD_SIZE must be at least 1, got {world}")
        if not 0 <= rank < world:
            raise PolluxError(f"RANK {rank} is outside 0..{world - 1}")
        local_world = _int(env, "LOCAL_WORLD_SIZE", world) or world
        nodes_default = max(1, -(-world // max(local_world, 1)))
        timeout_raw = env.get("POLLUX_PG_TIMEOUT_S")
        try:
            timeout = float(timeout_raw) if timeout_raw else DEFAULT_PG_TIMEOUT_S
        except ValueError:
            raise PolluxError(
                f"environment variable POLLUX_PG_TIMEOUT_S must be a number, got {timeout_raw!r}"
            ) from None
        if not math.isfinite(timeout) or timeout <= 0:
            raise PolluxError(f"POLLUX_PG_TIMEOUT_S must be a positive number, got {timeout_raw!r}")
        device = env.get("POLLUX_DEVICE") or None
        if device not in (None, "cpu", "cuda"):
            raise PolluxError(f"POLLUX_DEVICE must be 'cpu' or 'cuda', got {device!r}")
        local_batch = _int(env, "POLLUX_LOCAL_BATCH", None)
        accum = _int(env, "POLLUX_ACCUM_STEPS", None)
        if local_batch is not None and local_batch <= 0:
            raise PolluxError(f"POLLUX_LOCAL_BATCH must be positive, got {local_batch}")
        if accum is not None and accum <= 0:
            raise PolluxError(f"POLLUX_ACCUM_STEPS must be positive, got {accum}")
        fraction = _positive(env, "POLLUX_GPU_MEMORY_FRACTION")
        if fraction is not None and fraction > 1:
            raise PolluxError(f"POLLUX_GPU_MEMORY_FRACTION must be at most 1, got {fraction:g}")
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
            job_dir=env.get("POLLUX_JOB_DIR") or None,
            checkpoint_dir=env.get("POLLUX_CHECKPOINT_DIR") or None,
            daemon_socket=env.get("POLLUX_DAEMON_SOCKET") or None,
            num_nodes=_int(env, "POLLUX_NUM_NODES", nodes_default) or nodes_default,
            local_batch=local_batch,
            accum_steps=accum,
            device=device,
            pg_timeout_s=timeout,
            array_id=env.get("POLLUX_ARRAY_ID") or None,
            array_index=_int(env, "POLLUX_ARRAY_INDEX", None),
            time_limit_s=_positive(env, "POLLUX_TIME_LIMIT_S"),
            device_type=env.get("POLLUX_DEVICE_TYPE") or None,
            device_slowdown=_positive(env, "POLLUX_DEVICE_SLOWDOWN"),
            gpu_memory_fraction=fraction,
            resize_file=env.get("POLLUX_RESIZE_FILE") or None,
            resize_join=_int(env, "POLLUX_RESIZE_JOIN", None),
            job_secret=env.get("POLLUX_JOB_SECRET") or None,
        )


def member_tag(secret: str, port: int, world_size: int, rank: int) -> bytes:
    """What rank ``rank`` of the process group meeting at ``port`` with ``world_size``
    replicas sends to prove that it holds the incarnation's secret:
    HMAC-SHA256(secret, "port|world|rank").  Another process cannot make it for any rank,
    nor reuse one seen at another group or rank."""
    message = f"{int(port)}|{int(world_size)}|{int(rank)}".encode()
    return hmac.new(secret.encode(), message, hashlib.sha256).digest()


def payload_tag(secret: str, port: int, world_size: int, data: bytes | memoryview) -> bytes:
    """What rank 0 of the process group meeting at ``port`` with ``world_size`` replicas
    sends with ``data`` it broadcasts (a pickled order or training state), so that every
    replica checks that the bytes are rank 0's before it unpickles them:
    HMAC-SHA256(secret, "payload|port|world|" + data).  The member tags
    (:func:`member_tag`) prove who formed the group, not who carries its bytes: a process
    that relayed the group's connections passed them and rewrote what rank 0 sent (review
    s69)."""
    tag = hmac.new(secret.encode(), f"payload|{int(port)}|{int(world_size)}|".encode(), "sha256")
    tag.update(data)
    return tag.digest()


def replica_environ(
    common: Mapping[str, str],
    *,
    rank: int,
    local_rank: int,
    node_rank: int,
    local_world_size: int,
    device: str,
    device_index: str | None,
) -> dict[str, str]:
    """The environment of one replica: ``common`` (the job's environment and this contract's
    common variables, ``WORLD_SIZE`` and ``POLLUX_JOB_ID`` among them) plus its ranks and the
    rest of torchrun's variables.  ``device`` is ``cpu`` or ``cuda``; for ``cuda``,
    ``device_index`` becomes ``CUDA_VISIBLE_DEVICES`` (never set for CPU devices).

    One role (``default``) per job, so ``ROLE_RANK`` = ``RANK`` and ``GROUP_RANK`` =
    ``NODE_RANK``; ``TORCHELASTIC_RUN_ID`` is ``pollux-<job id>`` and the restart count the
    job's (re)starts.
    """
    env = {k: v for k, v in common.items() if k not in PER_RANK_VARIABLES}
    world = env.get("WORLD_SIZE", "1")
    env.update(
        RANK=str(rank),
        LOCAL_RANK=str(local_rank),
        NODE_RANK=str(node_rank),
        GROUP_RANK=str(node_rank),
        ROLE_RANK=str(rank),
        ROLE_NAME="default",
        LOCAL_WORLD_SIZE=str(local_world_size),
        WORLD_SIZE=world,
        ROLE_WORLD_SIZE=world,
        GROUP_WORLD_SIZE=env.get("POLLUX_NUM_NODES", "1"),
        TORCHELASTIC_RUN_ID=f"pollux-{env.get('POLLUX_JOB_ID', 'local')}",
        TORCHELASTIC_RESTART_COUNT=env.get("POLLUX_RESTARTS", "0"),
        TORCHELASTIC_MAX_RESTARTS="0",
        # no agent-side store: a script's env:// rendezvous starts its own on MASTER_PORT
        TORCHELASTIC_USE_AGENT_STORE="False",
        POLLUX_DEVICE=device,
    )
    if device == "cuda" and device_index is not None:
        env["CUDA_VISIBLE_DEVICES"] = device_index
    return env
