"""Correctness of pollux_local.torch with real multi-process gloo on CPU.

Each test starts the probe job (``pollux_local.torch.probe``) as 1 or 2 real processes with the
launch environment of docs/architecture.md, and compares final models, sample sequences and
gradient statistics.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from pollux_local.api.states import ExitCode  # noqa: E402
from pollux_local.launch.base import pick_master_port  # noqa: E402
from tests.paths import REPO_ROOT  # noqa: E402

PROBE = [sys.executable, "-m", "pollux_local.torch.probe"]


def run_job(
    replicas: int,
    args: list[str],
    tmp: Path,
    *,
    local_batch: int | None = None,
    accum_steps: int | None = None,
    checkpoint_dir: Path | None = None,
    timeout: float = 90.0,
) -> list[int]:
    """Run the probe on ``replicas`` processes; return their exit codes (rank order)."""
    port = pick_master_port()
    procs = []
    errs: list[Path] = []
    tmp.mkdir(parents=True, exist_ok=True)
    for rank in range(replicas):
        env = dict(os.environ)
        env.update(
            OMP_NUM_THREADS="1",
            RANK=str(rank),
            WORLD_SIZE=str(replicas),
            LOCAL_RANK=str(rank),
            LOCAL_WORLD_SIZE=str(replicas),
            NODE_RANK="0",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            POLLUX_JOB_ID="probe",
            POLLUX_JOB_DIR=str(tmp / "job"),
            POLLUX_PG_TIMEOUT_S="30",
            POLLUX_DEVICE="cpu",
            PYTHONPATH=str(REPO_ROOT),
            PYTHONFAULTHANDLER="1",  # SIGABRT on a hang prints every thread's stack
        )
        if local_batch is not None:
            env["POLLUX_LOCAL_BATCH"] = str(local_batch)
        if accum_steps is not None:
            env["POLLUX_ACCUM_STEPS"] = str(accum_steps)
        if checkpoint_dir is not None:
            env["POLLUX_CHECKPOINT_DIR"] = str(checkpoint_dir)
        # stderr goes to a file, not a pipe: an unread pipe that fills blocks its rank inside
        # a collective and hangs the other one.
        err_path = tmp / f"rank{rank}-{port}.err"
        with open(err_path, "w") as err_file:
            procs.append(
                subprocess.Popen(PROBE + args, env=env, cwd=REPO_ROOT, stderr=err_file, text=True)
            )
        errs.append(err_path)
    codes = []
    for p, err_path in zip(procs, errs, strict=True):
        try:
            p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:  # stacks first (faulthandler), then make sure they are gone
                q.send_signal(signal.SIGABRT)
            for q in procs:
                try:
                    q.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    q.kill()
            for path in errs:
                print(f"--- {path.name}", path.read_text()[-6000:], sep="\n", file=sys.stderr)
            raise
        if p.returncode not in (0, ExitCode.RESCALE):
            print(err_path.read_text(), file=sys.stderr)
        codes.append(p.returncode)
    return codes


def load_model(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, weights_only=False)["model"]


def max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def step_sequence(prefix: Path) -> dict[tuple[int, int], list[int]]:
    """(epoch, step) -> sorted sample indices of that step, over every replica and incarnation."""
    steps: dict[tuple[int, int], list[int]] = defaultdict(list)
    for path in prefix.parent.glob(prefix.name + ".rank*"):
        for line in path.read_text().splitlines():
            epoch, step, indices = json.loads(line)
            steps[(epoch, step)].extend(indices)
    return {k: sorted(v) for k, v in steps.items()}


COMMON = ["--samples", "256", "--base-batch", "16", "--epochs", "2", "--no-adapt"]


@pytest.mark.timeout(120)
def test_two_replicas_equal_one_replica_with_double_batch(tmp_path: Path) -> None:
    assert run_job(1, COMMON + ["--out", str(tmp_path / "k1.pt")], tmp_path, local_batch=16) == [0]
    assert run_job(
        1, COMMON + ["--out", str(tmp_path / "acc.pt")], tmp_path, local_batch=8, accum_steps=2
    ) == [0]
    assert run_job(2, COMMON + ["--out", str(tmp_path / "k2.pt")], tmp_path, local_batch=8) == [
        0,
        0,
    ]
    one = load_model(tmp_path / "k1.pt")
    two = load_model(tmp_path / "k2.pt")
    acc = load_model(tmp_path / "acc.pt")
    start = torch.load(tmp_path / "k1.pt", weights_only=False)
    assert start["steps"] == 2 * 256 // 16
    assert max_difference(one, two) < 1e-5
    assert max_difference(one, acc) < 1e-5


@pytest.mark.timeout(150)
def test_sigterm_then_resume_at_other_scale_matches_uninterrupted(tmp_path: Path) -> None:
    total_steps = 2 * 256 // 16
    stop_at = random.randrange(2, total_steps - 3)
    ref = tmp_path / "ref"
    ref.mkdir()
    assert run_job(
        1,
        COMMON + ["--out", str(ref / "final.pt"), "--log-samples", str(ref / "samples")],
        ref,
        local_batch=16,
    ) == [0]

    run = tmp_path / "run"
    ckpt = run / "ckpt"
    run.mkdir()
    args = COMMON + ["--out", str(run / "final.pt"), "--log-samples", str(run / "samples")]
    # two replicas agree on a stop at measuring steps: measure every other step here
    args += ["--stats-interval", "2", "--stats-budget", "0"]
    codes = run_job(
        2, args + ["--signal-at-step", str(stop_at)], run, local_batch=8, checkpoint_dir=ckpt
    )
    assert codes == [ExitCode.RESCALE, ExitCode.RESCALE], f"stop at step {stop_at}"
    assert not (run / "final.pt").exists()
    assert list(ckpt.glob("ckpt-*.pt")), "no checkpoint written on SIGTERM"
    assert run_job(1, args, run, local_batch=16, checkpoint_dir=ckpt) == [0]

    expected = step_sequence(ref / "samples")
    got = step_sequence(run / "samples")
    assert got == expected, f"sample sequence differs after a stop at step {stop_at}"
    for epoch in range(2):
        seen = [i for (e, _), idx in got.items() if e == epoch for i in idx]
        assert sorted(seen) == list(range(256))
    diff = max_difference(load_model(ref / "final.pt"), load_model(run / "final.pt"))
    assert diff < 1e-5, f"final model differs by {diff} after a stop at step {stop_at}"


@pytest.mark.timeout(150)
@pytest.mark.parametrize("replicas", [1, 2])
def test_noise_scale_estimator_recovers_known_statistics(tmp_path: Path, replicas: int) -> None:
    out = tmp_path / "q.pt"
    args = ["--task", "quadratic", "--samples", "2048", "--dim", "2000", "--base-batch", "32"]
    args += ["--epochs", "1", "--no-adapt", "--stats-interval", "1", "--stats-budget", "0"]
    args += ["--out", str(out)]
    assert run_job(replicas, args, tmp_path) == [0] * replicas
    result = torch.load(out, weights_only=False)
    stats, (sqr, var) = result["stats"], result["truth"]
    assert abs(stats.sqr - sqr) / sqr < 0.10, (stats, sqr, var)
    assert abs(stats.var - var) / var < 0.10, (stats, sqr, var)
