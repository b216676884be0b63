"""The jobs in jobs/ run alone and under the local launcher (shortened runs)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("sklearn")

from pollux_local.api.states import ExitCode  # noqa: E402
from pollux_local.launch.base import (  # noqa: E402
    LaunchSpec,
    ReplicaSlot,
    pick_master_port,
)
from pollux_local.launch.local import LocalLauncher  # noqa: E402
from pollux_local.torch import load_training_spec  # noqa: E402
from tests.paths import REPO_ROOT  # noqa: E402

JOBS = {
    "digits_cnn": ["--max-epochs", "1"],
    "tabular_mlp": ["--max-epochs", "1"],
    "char_transformer": ["--max-epochs", "1", "--max-samples", "256"],
}
FINAL = re.compile(r"^TARGET (REACHED|MISSED) metric=(\w+) value=([-0-9.]+)")


def _clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("POLLUX_")}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    path = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=path)
    return env


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", sorted(JOBS))
def test_job_runs_alone_and_states_its_target(name: str) -> None:
    spec = load_training_spec(REPO_ROOT / "jobs" / name / "job.toml")
    proc = subprocess.run(
        [sys.executable, str(REPO_ROOT / "jobs" / name / "train.py"), *JOBS[name]],
        env=_clean_env(),
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert proc.returncode in (0, 3), proc.stderr[-2000:]
    match = FINAL.match(proc.stdout.strip().splitlines()[-1])
    assert match, proc.stdout[-500:]
    assert match.group(2) == spec.target.metric
    reached = spec.target.reached(float(match.group(3)))
    assert (match.group(1) == "REACHED") == reached == (proc.returncode == 0)


def _spec(tmp: Path, replicas: int, restarts: int, epochs: int) -> LaunchSpec:
    env = _clean_env()
    env.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(pick_master_port()),
        POLLUX_JOB_ID="digits",
        POLLUX_RESTARTS=str(restarts),
        POLLUX_JOB_DIR=str(tmp / "job"),
        POLLUX_CHECKPOINT_DIR=str(tmp / "ckpt"),
        POLLUX_NUM_NODES="1",
        POLLUX_PG_TIMEOUT_S="30",
    )
    slots = [ReplicaSlot(r, "localhost", f"cpu:{r}", r, 0) for r in range(replicas)]
    return LaunchSpec(
        job_id="digits",
        argv=[
            sys.executable,
            str(REPO_ROOT / "jobs/digits_cnn/train.py"),
            "--max-epochs",
            str(epochs),
        ],
        workdir=REPO_ROOT,
        env=env,
        slots=slots,
        log_dir=tmp / f"logs{restarts}",
    )


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_job_under_the_launcher_rescales_and_finishes(tmp_path: Path) -> None:
    """Two replicas, stopped mid-training (exit 75), restarted on one replica, to the end.

    The stop is sent as soon as rank 0 logs its first finished epoch (the job needs at least
    two more to reach its target and end by itself), not on a periodic report: those come
    every 10 s, and on a fast machine the whole run can end before the first one.  The second
    run goes two epochs past the one the first was stopped in.
    """

    async def scenario() -> tuple[int, int, float]:
        launcher = LocalLauncher(run_dir=tmp_path / "run")
        group = await launcher.launch(_spec(tmp_path, 2, 0, 400))
        log = tmp_path / "logs0" / "rank0.log"
        deadline = time.monotonic() + 150
        while time.monotonic() < deadline and group.poll() is None:
            if re.search(r"^epoch \d+ ", log.read_text(), re.MULTILINE):
                break
            await asyncio.sleep(0.1)
        first = await group.stop(grace_s=60)
        at_stop = json.loads((tmp_path / "job" / "report.json").read_text())
        epochs = int(at_stop["epoch"]) + 2
        second = await (await launcher.launch(_spec(tmp_path, 1, 1, epochs))).wait()
        return first, second, float(at_stop["progress"])

    first, second, progress_at_stop = asyncio.run(scenario())
    assert first == ExitCode.RESCALE, (tmp_path / "logs0" / "rank0.log").read_text()[-2000:]
    assert progress_at_stop >= 10
    log = (tmp_path / "logs1" / "rank0.log").read_text()
    assert second in (0, 3), log[-3000:]
    assert FINAL.search(log.strip().splitlines()[-1]), log[-1000:]
    final = json.loads((tmp_path / "job" / "report.json").read_text())
    assert final["batch"]["replicas"] == 1
    assert final["progress"] > progress_at_stop
    assert final["profile"] and {r["replicas"] for r in final["profile"]} == {1, 2}
