"""On a real NVIDIA GPU: NVML discovery against what CUDA reports, a GPU kept busy by a process
the scheduler did not start, a shared job's memory cap, and a daemon that schedules the GPU it
discovered and runs a job of ``jobs/`` there to its quality target."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from pollux_local.daemon import gpus
from tests.daemon_process import DaemonFactory, DaemonProcess, activated_environ, wait_for
from tests.paths import REPO_ROOT

torch = pytest.importorskip("torch")

GIB = 1 << 30


def _pythonpath() -> str:
    """This checkout first, then what the caller's ``PYTHONPATH`` already holds."""
    return os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))


def _child(code: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code)],
        env={**os.environ, "PYTHONPATH": _pythonpath(), **(env or {})},
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip


def test_nvml_describes_the_gpus_cuda_sees() -> None:
    found = gpus.discover()
    assert [g.index for g in found] == list(range(torch.cuda.device_count()))
    for gpu in found:
        props = torch.cuda.get_device_properties(gpu.index)
        assert abs(gpu.total_bytes - props.total_memory) <= 0.02 * props.total_memory
        assert 0 < gpu.free_bytes <= gpu.total_bytes
        assert gpu.device_type not in ("gpu", "cpu"), gpu.name
        model = gpu.device_type.split("-")[0]
        assert model in gpu.name.lower().replace(" ", "").replace("-", ""), (gpu.name, model)
        assert gpu.uuid.startswith("GPU-"), gpu.uuid


def test_a_process_outside_the_scheduler_makes_its_gpu_busy() -> None:
    before = gpus.free_memory(0)
    assert before is not None
    hog = _child(
        """
        import sys, torch
        block = torch.empty(3 << 30, dtype=torch.uint8, device="cuda:0")
        torch.cuda.synchronize()
        print("ready", flush=True)
        sys.stdin.read()
        """
    )
    try:
        assert hog.stdout is not None and hog.stdout.readline().strip() == "ready"
        during = gpus.free_memory(0)
        assert during is not None and before - during >= 3 * GIB
        busy = gpus.processes_outside({os.getpid()}, gpus.DEFAULT_BUSY_BYTES)
        assert 0 in busy, f"NVML listed no process on GPU 0 ({busy})"
        assert not gpus.processes_outside({os.getpid(), *busy[0]}, gpus.DEFAULT_BUSY_BYTES)
        assert 0 not in gpus.processes_outside({os.getpid()}, 8 * GIB)  # under the threshold
    finally:
        hog.communicate(timeout=60)
    wait_for(lambda: (gpus.free_memory(0) or 0) > before - GIB, 30, "the memory to be freed")


def test_a_shared_jobs_memory_fraction_caps_its_allocator() -> None:
    probe = _child(
        """
        import torch
        from pollux_local.torch import job_environment, torch_device
        device = torch_device(job_environment())
        total = torch.cuda.get_device_properties(device).total_memory
        small = torch.empty(int(0.02 * total), dtype=torch.uint8, device=device)
        try:
            torch.empty(int(0.10 * total), dtype=torch.uint8, device=device)
        except torch.cuda.OutOfMemoryError:
            print("capped")
        else:
            print("not capped")
        """,
        {"POLLUX_DEVICE": "cuda", "POLLUX_GPU_MEMORY_FRACTION": "0.05"},
    )
    out, err = probe.communicate(timeout=120)
    assert probe.returncode == 0, err[-2000:]
    assert out.strip() == "capped"


def test_the_trainer_reports_its_peak_memory_read_once_per_run_of_steps() -> None:
    """On CUDA the job library reports the allocator's peak per local batch, read for a run
    of steps together (``torch/memory.py``), not after every step: over 150 steps of one
    local batch and a report, at most ``150 / READ_EVERY + 2`` reads, and the peak lies
    between what the model and a batch hold and the device's size."""
    probe = _child(
        """
        import torch
        import torch.nn.functional as F
        from pollux_local.torch import ElasticTrainer
        from pollux_local.torch.memory import READ_EVERY
        reads = []
        real = torch.cuda.max_memory_allocated
        torch.cuda.max_memory_allocated = lambda device=None: reads.append(1) or real(device)
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(),
                                    torch.nn.Linear(1024, 10))
        trainer = ElasticTrainer(model, torch.optim.SGD(model.parameters(), lr=0.01),
                                 base_batch=64, adapt=False, checkpoint_dir=None,
                                 report_interval_s=1e9, handle_sigterm=False)
        data = torch.utils.data.TensorDataset(torch.randn(64 * 150, 256),
                                              torch.randint(0, 10, (64 * 150,)))
        loader = trainer.loader(data)
        for _ in trainer.epochs(1):
            for x, y in loader:
                trainer.step(F.cross_entropy(trainer.model(x.to(trainer.device)),
                                             y.to(trainer.device)))
        during = len(reads)
        (point,) = trainer.build_report().memory
        print(trainer.steps, during, len(reads), READ_EVERY, point.local_batch,
              point.peak_bytes, point.total_bytes)
        """,
        {"POLLUX_DEVICE": "cuda"},
    )
    out, err = probe.communicate(timeout=300)
    assert probe.returncode == 0, err[-2000:]
    steps, during, total, every, local, peak, device_bytes = (int(w) for w in out.split())
    assert steps == 150 and local == 64
    assert during <= steps // every + 1 and total <= during + 1, out
    weights = (256 * 1024 + 1024 + 1024 * 10 + 10) * 4
    assert 2 * weights < peak < device_bytes, out


def gpu_daemon(
    tmp_path: Path, daemon_factory: DaemonFactory
) -> tuple[DaemonProcess, Callable[..., str]]:
    """A daemon on this machine's GPUs (found through NVML: no ``--devices``), and the CLI as
    its user's shell runs it (its stdout; a failing command fails the test)."""
    env = activated_environ(POLLUX_LOCAL_STATE_DIR=str(tmp_path / "state"))
    daemon = daemon_factory(
        config="[scheduler]\ninterval_s = 1\n", env=env, cwd=tmp_path, timeout_s=60
    )

    def cli(*args: str) -> str:
        done = subprocess.run(
            [sys.executable, "-m", "pollux_local", *args],
            env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        return done.stdout

    return daemon, cli


@pytest.mark.timeout(600)
def test_a_daemon_schedules_the_discovered_gpu_and_runs_a_job_there(
    tmp_path: Path, daemon_factory: DaemonFactory
) -> None:
    daemon, cli = gpu_daemon(tmp_path, daemon_factory)
    found = gpus.discover()
    nodes = cli("nodes")
    assert "cuda:0" in nodes and found[0].device_type in nodes, nodes
    job = json.loads(cli("submit", "--json", "--spec", str(REPO_ROOT / "jobs/digits_cnn/job.toml")))
    job_id = str(job["id"])

    def finished() -> dict[str, object] | None:
        jobs = {str(j["id"]): j for j in json.loads(cli("status", "--json"))["jobs"]}
        one = jobs[job_id]
        return one if one["state"] in ("succeeded", "failed", "cancelled") else None

    started = time.monotonic()
    final = wait_for(finished, 540, f"job {job_id} to finish")
    log = cli("logs", job_id)
    assert final["state"] == "succeeded", (final, log[-3000:], daemon.output())
    assert "TARGET REACHED" in log
    shown = json.loads(cli("show", job_id, "--json"))
    text = json.dumps(shown)
    assert found[0].device_type in text, text[:3000]
    print(f"job {job_id} on {found[0].name}: {time.monotonic() - started:.1f} s")


SHARED_JOB = """
import json, os, sys, time
from pathlib import Path
import torch
from pollux_local.torch import job_environment, torch_device

env = job_environment()
device = torch_device(env)
total = torch.cuda.get_device_properties(device).total_memory
held = torch.empty(1 << 30, dtype=torch.uint8, device=device)
try:
    torch.empty(int(1.5 * env.gpu_memory_fraction * total), dtype=torch.uint8, device=device)
    capped = False
except torch.cuda.OutOfMemoryError:
    capped = True
name = sys.argv[1]
Path(f"{name}.json").write_text(json.dumps({
    "fraction": env.gpu_memory_fraction, "capped": capped,
    "visible": os.environ.get("CUDA_VISIBLE_DEVICES"), "total": total,
}))
while not Path("go").exists():
    time.sleep(0.1)
"""


@pytest.mark.timeout(300)
def test_two_shared_jobs_run_together_on_one_gpu_each_held_to_its_memory(
    tmp_path: Path, daemon_factory: DaemonFactory
) -> None:
    _, cli = gpu_daemon(tmp_path, daemon_factory)
    (tmp_path / "shared.py").write_text(SHARED_JOB)
    ids = [
        str(json.loads(cli("submit", "--json", "--rigid", "--shared", "--gpu-memory", "8G", "shared.py", name))["id"])
        for name in ("a", "b")
    ]  # fmt: skip

    def both_ready() -> bool:
        return all((tmp_path / f"{name}.json").exists() for name in ("a", "b"))

    wait_for(both_ready, 200, "both shared jobs to start on the GPU")
    jobs = {str(j["id"]): j for j in json.loads(cli("status", "--json"))["jobs"]}
    assert [jobs[i]["state"] for i in ids] == ["running", "running"], jobs
    (tmp_path / "go").touch()

    def ended() -> list[str] | None:
        now = {str(j["id"]): j["state"] for j in json.loads(cli("status", "--json"))["jobs"]}
        states = [now[i] for i in ids]
        return states if all(s in ("succeeded", "failed", "cancelled") for s in states) else None

    assert wait_for(ended, 60, "both shared jobs to end") == ["succeeded", "succeeded"]
    for name in ("a", "b"):
        seen = json.loads((tmp_path / f"{name}.json").read_text())
        assert seen["fraction"] == pytest.approx(8 * GIB / seen["total"], rel=0.02), seen
        assert seen["capped"], seen
        assert seen["visible"] == "0", seen
