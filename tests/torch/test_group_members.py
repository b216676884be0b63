"""Every replica of a process group proves it holds the incarnation's secret before anything
of the job's crosses the group (``torch.env.verify_members``).

A warm resize's order file names the new group's port and may be read by anyone; before rank
0 binds it, another user's process can take it, pose as rank 0, and send what the replicas
then unpickle (code run as the job's user) or take as their weights.  Here two real gloo
processes: with the same secret they form the group; a rank 0 without it (another user's
process at the port) is found out by rank 1, which stops with one line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

from pollux_local.launch.base import pick_master_port  # noqa: E402
from tests.paths import REPO_ROOT  # noqa: E402

JOIN = """
import sys
from pollux_local.api.launch import LaunchEnvironment
from pollux_local.errors import PolluxError
from pollux_local.torch.env import init_distributed
import os
env = LaunchEnvironment.from_environ(os.environ)
try:
    init_distributed(env)
except PolluxError as exc:
    print("REFUSED", exc)
    sys.exit(3)
print("JOINED", flush=True)
import torch.distributed as dist
# both leave together and close the group: a rank that exited with gloo's threads still
# running aborted now and then ("terminate called without an active exception", -6)
dist.barrier()
dist.destroy_process_group()
"""


def run_pair(secrets: tuple[str | None, str | None], tmp: Path) -> list[tuple[int, str]]:
    port = pick_master_port()
    procs = []
    for rank, secret in enumerate(secrets):
        env = dict(os.environ)
        env.update(
            OMP_NUM_THREADS="1", RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank),
            LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
            POLLUX_PG_TIMEOUT_S="30", POLLUX_DEVICE="cpu", PYTHONPATH=str(REPO_ROOT),
        )  # fmt: skip
        env.pop("POLLUX_JOB_SECRET", None)
        if secret is not None:
            env["POLLUX_JOB_SECRET"] = secret
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", JOIN],
                env=env,
                cwd=tmp,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )  # fmt: skip
        )
    results = []
    for proc in procs:
        out, _ = proc.communicate(timeout=90)
        results.append((proc.returncode, out))
    return results


@pytest.mark.timeout(180)
def test_replicas_with_the_secret_form_the_group(tmp_path: Path) -> None:
    results = run_pair(("s3cret", "s3cret"), tmp_path)
    assert [code for code, _ in results] == [0, 0], results
    assert all("JOINED" in out for _, out in results)


@pytest.mark.timeout(180)
def test_a_rank_0_without_the_secret_is_found_out(tmp_path: Path) -> None:
    impostor, victim = run_pair(("guessed", "s3cret"), tmp_path)
    assert victim[0] == 3, victim
    assert "REFUSED" in victim[1] and "does not hold the job's secret" in victim[1], victim
    assert "rank 0" in victim[1]


#: Both ranks hold the secret and form the group; then the bytes rank 0 broadcasts are
#: rewritten on their way, as a process relaying the group's connections does (review s69:
#: another user connected to the group's store, which has no authentication, swapped the
#: gloo addresses both ranks published for its own, relayed every byte between them, so that
#: the member tags passed, and rewrote the pickle of the order/state rank 0 broadcasts: rank
#: 1 ran its code).  Here the relay is stood in for by rank 0's own broadcast, patched.
TAMPERED = """
import os, sys
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from pollux_local.api.launch import LaunchEnvironment
from pollux_local.errors import PolluxError
from pollux_local.torch.env import init_distributed
from pollux_local.torch.resizing import broadcast_object
env = LaunchEnvironment.from_environ(os.environ)
init_distributed(env)
mark = sys.argv[1]
evil = b"cos\\nsystem\\n(S'touch " + mark.encode() + b"'\\ntR."
real = c10d.broadcast

def on_the_wire(tensor, *args, **kwargs):
    if env.rank == 0 and tensor.dtype == torch.uint8 and tensor.numel() >= len(evil):
        raw = bytearray(tensor.numpy().tobytes())
        at = raw.find(b"\\x80")  # a pickle's first byte (PROTO)
        if at >= 0 and len(raw) - at >= len(evil):
            raw[at:at + len(evil)] = evil
            tensor.copy_(torch.frombuffer(raw, dtype=torch.uint8))
    return real(tensor, *args, **kwargs)

c10d.broadcast = on_the_wire
dist.broadcast = on_the_wire
try:
    got = broadcast_object({"weights": "A" * 64} if env.rank == 0 else None, env)
except PolluxError as exc:
    print("REFUSED", exc, flush=True)
    got = None
print("GOT", repr(got)[:80], flush=True)
dist.barrier()
dist.destroy_process_group()
"""


@pytest.mark.timeout(180)
def test_a_payload_rewritten_between_the_ranks_is_never_unpickled(tmp_path: Path) -> None:
    mark = tmp_path / "ran"
    port = pick_master_port()
    procs = []
    for rank in range(2):
        env = dict(os.environ)
        env.update(
            OMP_NUM_THREADS="1", RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank),
            LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
            POLLUX_PG_TIMEOUT_S="30", POLLUX_DEVICE="cpu", PYTHONPATH=str(REPO_ROOT),
            POLLUX_JOB_SECRET="s3cret",
        )  # fmt: skip
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", TAMPERED, str(mark)],
                env=env,
                cwd=tmp_path,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    outs = [proc.communicate(timeout=90)[0] for proc in procs]
    assert not mark.exists(), outs  # rank 1 ran the rewritten pickle
    assert "REFUSED" in outs[1] and "secret" in outs[1], outs
