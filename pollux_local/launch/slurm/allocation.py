"""The Slurm allocation a daemon runs in: its nodes, their addresses and GPUs, read with
Slurm's own tools (``scontrol show hostnames``, ``scontrol show job -d``, ``scontrol show
node``)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from pollux_local.errors import PolluxError

#: Runs a Slurm command and returns its stdout (raising ``PolluxError`` when it fails).
Runner = Callable[[Sequence[str]], str]

#: A node's GPUs in a job's detail: ``gpu:a100:4(IDX:0-3)`` or ``gpu:2(IDX:0-1)``.
_GPU_GRES = re.compile(r"^gpu(?::(?P<type>[A-Za-z0-9_.+-]+))?:(?P<count>\d+)")


def run_slurm(argv: Sequence[str]) -> str:
    """Run a Slurm client command; its stdout, or a one-line ``PolluxError``."""
    if shutil.which(argv[0]) is None:
        raise PolluxError(f"`{argv[0]}` not found: the Slurm launcher needs Slurm's client tools")
    try:
        proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        raise PolluxError(f"`{' '.join(argv)}` did not answer within 30 s") from None
    if proc.returncode != 0:
        said = " ".join((proc.stderr.strip() or proc.stdout.strip()).split())[:200]
        raise PolluxError(f"`{' '.join(argv)}` failed: {said or f'exit {proc.returncode}'}")
    return proc.stdout


@dataclass(frozen=True)
class SlurmNode:
    """One node of the allocation as the daemon schedules it: its devices are the GPUs the
    allocation holds there (``cuda:i``; ``gpu_type`` from the gres type, ``gpu:a100:4``) or,
    without GPUs, its allocated CPUs (``cpu:i``).  ``address`` is Slurm's ``NodeAddr`` (where
    rank 0 listens when a job spans nodes); ``memory`` the node's ``RealMemory`` in bytes."""

    name: str
    address: str
    gpus: int
    cpus: int
    gpu_type: str | None = None
    memory: int | None = None

    @property
    def devices(self) -> tuple[str, ...]:
        if self.gpus:
            return tuple(f"cuda:{i}" for i in range(self.gpus))
        return tuple(f"cpu:{i}" for i in range(self.cpus))


@dataclass(frozen=True)
class Allocation:
    """A Slurm job (``SLURM_JOB_ID``) and its nodes, in Slurm's order."""

    job_id: str
    nodes: tuple[SlurmNode, ...]


def in_allocation(env: Mapping[str, str] | None = None) -> bool:
    """Whether this process runs inside a Slurm allocation."""
    return bool((os.environ if env is None else env).get("SLURM_JOB_ID"))


def hostnames(nodelist: str, run: Runner = run_slurm) -> list[str]:
    """A Slurm node list (``gpu[01-03],big``) expanded by ``scontrol show hostnames``."""
    return [line.strip() for line in run(["scontrol", "show", "hostnames", nodelist]).split()]


def _count_ids(ids: str) -> int:
    """How many CPUs ``0-3,6`` names."""
    total = 0
    for part in ids.split(","):
        if not part:
            continue
        low, _, high = part.partition("-")
        total += int(high or low) - int(low) + 1
    return total


def _fields(line: str) -> dict[str, str]:
    return dict(part.split("=", 1) for part in line.split() if "=" in part)


def read_allocation(env: Mapping[str, str] | None = None, run: Runner = run_slurm) -> Allocation:
    """The allocation this process runs in (``SLURM_JOB_ID``): each node with the GPUs and
    CPUs the job holds there and the node's address."""
    env = os.environ if env is None else env
    job_id = env.get("SLURM_JOB_ID", "")
    if not job_id.isdigit():
        raise PolluxError(
            "the Slurm launcher runs inside an allocation: SLURM_JOB_ID is not set"
            " (start the daemon under salloc or in an sbatch script)"
        )
    detail = run(["scontrol", "show", "job", "-d", job_id])
    held: dict[str, tuple[int, int, str | None]] = {}
    for line in detail.splitlines():
        fields = _fields(line.strip())
        if not line.strip().startswith("Nodes=") or "CPU_IDs" not in fields:
            continue
        gpus, gpu_type = 0, None
        for gres in re.split(r",(?![^(]*\))", fields.get("GRES", "")):
            match = _GPU_GRES.match(gres)
            if match:
                gpus += int(match["count"])
                gpu_type = match["type"] or gpu_type
        cpus = _count_ids(fields["CPU_IDs"])
        for name in hostnames(fields["Nodes"], run):
            held[name] = (gpus, cpus, gpu_type)
    order = hostnames(env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or "", run)
    if not order:
        order = list(held)
    if not order or any(name not in held for name in order):
        raise PolluxError(f"cannot read the nodes of Slurm job {job_id} from `scontrol show job`")
    nodes = []
    for line in run(["scontrol", "show", "node", "-o", ",".join(order)]).splitlines():
        fields = _fields(line)
        node_name = fields.get("NodeName", "")
        if node_name not in held:
            continue
        gpus, cpus, gpu_type = held[node_name]
        memory = fields.get("RealMemory", "")
        nodes.append(
            SlurmNode(
                name=node_name,
                address=fields.get("NodeAddr") or node_name,
                gpus=gpus,
                cpus=max(cpus, 1),
                gpu_type=gpu_type,
                memory=int(memory) << 20 if memory.isdigit() and int(memory) > 1 else None,
            )
        )
    by_name = {node.name: node for node in nodes}
    missing = [name for name in order if name not in by_name]
    if missing:
        raise PolluxError(f"`scontrol show node` does not know {', '.join(missing)}")
    return Allocation(job_id=job_id, nodes=tuple(by_name[name] for name in order))


#: Slurm node states (``scontrol show node``'s ``State``) in which a node runs nothing more.
LOST_STATES = ("DOWN", "FAIL", "NOT_RESPONDING", "POWERED_DOWN", "POWER_DOWN", "REBOOT")


def node_state(name: str, run: Runner = run_slurm) -> str:
    """A node's ``State`` as ``scontrol show node`` gives it (``IDLE``, ``MIXED+DRAIN``...)."""
    for line in run(["scontrol", "show", "node", "-o", name]).splitlines():
        fields = _fields(line)
        if fields.get("NodeName") == name:
            return fields.get("State", "UNKNOWN")
    raise PolluxError(f"Slurm does not know node {name}")


def node_lost(state: str) -> bool:
    """Whether a node in ``state`` counts as lost (down, failed, not responding)."""
    parts = state.replace("*", "+NOT_RESPONDING").split("+")
    return any(part in LOST_STATES for part in parts)
