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
