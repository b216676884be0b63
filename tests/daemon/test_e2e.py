"""End to end on CPU devices: a real daemon process, real torch.distributed (gloo) replicas.

Covers: a live resize through a checkpoint with progress preserved, ``status --json`` and
``logs`` along the way, a daemon restart after SIGTERM and after SIGKILL with jobs queued and
running, and a crashing job retried with back-off until it fails with its reason shown.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from pollux_local.client import Client
from pollux_local.errors import PolluxError
from tests.daemon_process import DaemonFactory, activated_environ
from tests.paths import REPO_ROOT

pytestmark = pytest.mark.timeout(180)

STATES = {"queued", "running", "rescaling", "held", "succeeded", "failed", "cancelled"}

#: A tiny stand-in training script: gloo all-reduce per step, checkpoint on SIGTERM -> exit 75.
TRAIN = r"""
import json, os, signal, sys, time
stop = False
def on_term(*_):
    global stop
    stop = True
signal.signal(signal.SIGTERM, on_term)
from datetime import timedelta
from pathlib import Path
import torch
import torch.distributed as dist
total, pause = int(sys.argv[1]), float(sys.argv[2])
rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
if world > 1:
    timeout = timedelta(seconds=float(os.environ.get("POLLUX_PG_TIMEOUT_S", "30")))
    dist.init_process_group("gloo", timeout=timeout)
ckpt = Path(os.environ["POLLUX_CHECKPOINT_DIR"]) / "state.json"
state = json.loads(ckpt.read_text()) if ckpt.exists() else {"step": 0, "profile": {}}
step, profile = state["step"], state["profile"]
local_batch = int(os.environ.get("POLLUX_LOCAL_BATCH") or 32)
print(f"resume step={step} world={world} local_batch={local_batch}", flush=True)
times = []
def save():
    if rank != 0:
        return
    if times:
        mean = sum(times) / len(times)
        profile[f"{world}/{local_batch}"] = {"nodes": 1, "replicas": world,
            "local_batch": local_batch, "compute_s": pause, "step_s": max(mean, pause),
            "count": len(times)}
    tmp = ckpt.with_suffix(".tmp")
    tmp.write_text(json.dumps({"step": step, "profile": profile}))
    os.replace(tmp, ckpt)
    report = Path(os.environ["POLLUX_JOB_DIR"]) / "report.json"
    tmp = report.with_suffix(".tmp")
    tmp.write_text(json.dumps({"version": 1, "job_id": os.environ["POLLUX_JOB_ID"],
        "bounds": {"base_batch": 64, "max_batch": 512, "min_local": 8, "max_local": 256,
                   "accumulation": True},
        "profile": list(profile.values()), "grad_stats": {"sqr": 1.0, "var": 20.0},
        "progress": float(step), "metrics": {"step": step}}))
    os.replace(tmp, report)
first = True
while step < total:
    began = time.perf_counter()
    time.sleep(pause)
    flag = torch.tensor([1.0 if stop else 0.0])
    if world > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    step += 1
    times.append(time.perf_counter() - began)
    if first:
        print(f"first step at {time.time():.3f}", flush=True)
        first = False
    if flag.item() > 0:
        save()
        print(f"checkpoint step={step}", flush=True)
        sys.exit(75)
    if step % 5 == 0:
        save()
save()
print(f"finished step={step}", flush=True)
"""


#: A job that does not use torch at all: prints, reports progress, exits 0.
QUICK = r"""
import json, os, sys
from pathlib import Path
print("quick job ran", sys.argv[1:], flush=True)
report = Path(os.environ["POLLUX_JOB_DIR"]) / "report.json"
report.write_text(json.dumps({"version": 1, "progress": 1.0}))
"""


class Daemon:
    """A real daemon on cpu:2 (from the shared factory, stopped at teardown) and CLI helpers
    that reach it as a user's shell does: ``POLLUX_LOCAL_STATE_DIR`` set, the submitter's venv
    active, in the job's folder (``root``)."""

    def __init__(self, daemons: DaemonFactory, config: str) -> None:
        self.root = daemons.root
        self.state_dir = self.root / "s"
        self.env = activated_environ(
            OMP_NUM_THREADS="1", POLLUX_LOCAL_STATE_DIR=str(self.state_dir)
        )
        self.process = daemons(
            devices="cpu:2", config=config, state_dir=self.state_dir, env=self.env,
            cwd=self.root, start=False,
        )  # fmt: skip

    def start(self) -> None:
        self.process.start(timeout_s=20)

    def stop(self, signum: int = signal.SIGTERM) -> None:
        """SIGTERM (waited for) or SIGKILL, as a crash would."""
        if signum == signal.SIGKILL:
            self.process.kill()
        else:
            self.process.stop()

    def cli(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(
            [sys.executable, "-m", "pollux_local", *args],
            env=self.env, cwd=self.root, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        if check:
            assert result.returncode == 0, result.stderr
        return result

    def submit(self, *args: str) -> str:
        out = self.cli("submit", "--json", *args).stdout
        return str(json.loads(out)["id"])

    def status(self) -> dict[str, dict[str, Any]]:
        jobs = json.loads(self.cli("status", "--json").stdout)["jobs"]
        for job in jobs:
            assert job["state"] in STATES
            assert {"id", "name", "state", "gpus", "batch_size"} <= set(job)
        return {job["id"]: job for job in jobs}

    def wait_for(self, what: Callable[[dict[str, dict[str, Any]]], bool], timeout: float,
                 seen: list[dict[str, dict[str, Any]]] | None = None) -> dict[str, dict[str, Any]]:  # fmt: skip
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            jobs = self.status()
            if seen is not None:
                seen.append(jobs)
            if what(jobs):
                return jobs
            time.sleep(0.25)
        raise AssertionError(f"timed out; last status: {json.dumps(jobs, indent=1)[:3000]}")


CONFIG = """
[scheduler]
policy = "goodput"
interval_s = 1
restart_cost_s = 1
[daemon]
stop_grace_s = 20
backoff_s = 0.2
max_retries = 2
pg_timeout_s = 30
"""


@pytest.fixture
def daemon(tmp_path: Path, daemon_factory: DaemonFactory) -> Daemon:
    (tmp_path / "train.py").write_text(TRAIN)
    (tmp_path / "quick.py").write_text(QUICK)
    d = Daemon(daemon_factory, CONFIG)
    d.start()
    return d


def daemon_show(daemon: Daemon, job_id: str) -> list[dict[str, Any]]:
    return list(json.loads(daemon.cli("show", job_id, "--json").stdout)["decisions"])


def resumes(log: str) -> list[tuple[int, int]]:
    return [(int(s), int(w)) for s, w in re.findall(r"resume step=(\d+) world=(\d+)", log)]


@pytest.mark.slow
def test_live_resize_through_checkpoint(daemon: Daemon) -> None:
    first = daemon.submit(
        "--elastic", "--max-gpus", "2", "--batch-size", "64", "train.py", "150", "0.05"
    )
    # alone, it gets both devices (at once, or once it has reported a profile)
    daemon.wait_for(lambda j: j[first]["gpus"] == 2 and (j[first]["progress"] or 0) >= 5, 90)
    second = daemon.submit(
        "--elastic", "--max-gpus", "2", "--batch-size", "64", "train.py", "30", "0.05"
    )
    final = daemon.wait_for(lambda j: all(x["state"] == "succeeded" for x in j.values()), 150)
    assert final[first]["progress"] == 150 and final[second]["progress"] == 30
    log = daemon.cli("logs", first).stdout
    runs = resumes(log)
    saved = [int(s) for s in re.findall(r"checkpoint step=(\d+)", log)]
    assert runs[0][0] == 0, log
    assert {world for _, world in runs} == {1, 2}, log
    # every incarnation resumed exactly where the previous one checkpointed
    assert [step for step, _ in runs[1:]] == saved[: len(runs) - 1], log
    assert "finished step=150" in log
    show = json.loads(daemon.cli("show", first, "--json").stdout)
    kinds = [d["kind"] for d in show["decisions"]]
    assert kinds[:2] == ["submitted", "start"] and kinds[-1] == "finished"
    assert show["job"]["restarts"] >= 1
    resizes = [d for d in show["decisions"] if d["kind"] == "resize"]
    # it gave a device up for the second job, in the very pass that started that one
    shrinks = [d for d in resizes if d["batch"]["replicas"] == 1]
    assert shrinks, show["decisions"]
    assert "efficiency" in shrinks[0]["reason"]  # decided from the job's fitted model
    second_start = next(d for d in daemon_show(daemon, second) if d["kind"] == "start")
    assert abs(shrinks[0]["time"] - second_start["time"]) < 1.0


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGKILL])
def test_daemon_restart_loses_nothing_and_resumes(daemon: Daemon, signum: int) -> None:
    running = daemon.submit(
        "--elastic", "--min-gpus", "2", "--max-gpus", "2", "train.py", "80", "0.05"
    )
    # a lower priority keeps it queued (with no service yet it would otherwise go first)
    queued = daemon.submit("--gpus", "2", "--priority", "-1", "quick.py", "q")
    held = daemon.submit("--hold", "quick.py", "h")
    daemon.wait_for(
        lambda j: (j[running]["progress"] or 0) >= 10 and j[queued]["state"] == "queued", 60
    )
    daemon.stop(signum)
    daemon.start()
    jobs = daemon.status()
    assert sorted(jobs) == sorted([running, queued, held])
    assert jobs[held]["state"] == "held"
    daemon.cli("release", held)
    final = daemon.wait_for(lambda j: all(x["state"] == "succeeded" for x in j.values()), 150)
    assert final[running]["progress"] == 80
    assert "quick job ran ['q']" in daemon.cli("logs", queued).stdout
    runs = resumes(daemon.cli("logs", running).stdout)
    # SIGTERM: the daemon stopped the job (checkpoint) and restarted it; SIGKILL: the job's
    # supervisor outlived the daemon, which adopted it (it may be resized later, or not)
    assert runs[0][0] == 0 and len(runs) >= (2 if signum == signal.SIGTERM else 1), runs
    assert len(runs) == 1 or runs[1][0] >= 10, runs
    decisions = json.loads(daemon.cli("show", running, "--json").stdout)["decisions"]
    kinds = [d["kind"] for d in decisions]
    assert ("recovered" if signum == signal.SIGKILL else "requeued") in kinds


def test_crash_is_retried_with_backoff_then_fails_with_reason(daemon: Daemon) -> None:
    crash = daemon.root / "crash.py"
    crash.write_text("import sys\nprint('boom: bad input shape', flush=True)\nsys.exit(3)\n")
    job = daemon.submit("--gpus", "1", "--retries", "2", "crash.py")  # a rigid job: asked
    final = daemon.wait_for(lambda j: j[job]["state"] == "failed", 60)
    reason = final[job]["reason"]
    assert "code 3" in reason and "boom: bad input shape" in reason and "2 restart" in reason
    decisions = json.loads(daemon.cli("show", job, "--json").stdout)["decisions"]
    crashes = [d for d in decisions if d["kind"] == "crashed"]
    assert (
        len(crashes) == 2
        and "in 0.2 s" in crashes[0]["reason"]
        and "in 0.4 s" in crashes[1]["reason"]
    )
    assert daemon.cli("logs", job).stdout.count("boom") == 3


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_real_jobs_from_jobs_dir(tmp_path: Path, daemon_factory: DaemonFactory) -> None:
    """The example jobs (the job library, real models): both reach their quality target, and
    the policy moves the first one live when the second arrives."""
    specs = {
        name: REPO_ROOT / "jobs" / name / "job.toml" for name in ("char_transformer", "digits_cnn")
    }
    if not all(path.exists() for path in specs.values()):
        pytest.skip("example jobs not present")
    d = Daemon(daemon_factory, CONFIG)
    d.start()
    first = d.submit("--spec", str(specs["char_transformer"]), "--max-gpus", "2")
    d.wait_for(lambda j: j[first]["gpus"] == 2 and (j[first]["progress"] or 0) > 0, 240)
    second = d.submit("--spec", str(specs["digits_cnn"]), "--max-gpus", "2")
    seen: list[dict[str, dict[str, Any]]] = []
    d.wait_for(lambda j: j[first]["gpus"] == 1 and j[second]["state"] == "running", 240, seen)
    final = d.wait_for(
        lambda j: all(x["state"] in ("succeeded", "failed") for x in j.values()), 600
    )
    for job_id in (first, second):
        log = d.cli("logs", job_id).stdout
        assert final[job_id]["state"] == "succeeded", log[-2000:]
        assert "TARGET REACHED" in log
    decisions = json.loads(d.cli("show", first, "--json").stdout)["decisions"]
    assert "resize" in [x["kind"] for x in decisions]


def test_sigkill_during_a_burst_of_submits_loses_no_acknowledged_job(
    tmp_path: Path, daemon_factory: DaemonFactory
) -> None:
    import threading

    (tmp_path / "quick.py").write_text(QUICK)
    d = Daemon(daemon_factory, CONFIG)
    d.start()
    client = Client(d.state_dir / "daemon.sock", timeout_s=10)
    acknowledged: list[str] = []
    failures: list[str] = []

    def burst() -> None:
        for i in range(500):
            try:
                reply = client.request(
                    "submit", argv=[sys.executable, "quick.py", str(i)], workdir=str(tmp_path),
                    hold=True,
                )  # fmt: skip
                acknowledged.append(reply["id"])
            except PolluxError as exc:
                failures.append(str(exc))

    thread = threading.Thread(target=burst)
    thread.start()
    while len(acknowledged) < 150:
        time.sleep(0.005)
    d.stop(signal.SIGKILL)
    thread.join(timeout=60)
    assert failures, "the daemon was killed mid-burst, so some submits must have failed"
    d.start()
    ids = [job["id"] for job in json.loads(d.cli("status", "--json").stdout)["jobs"]]
    assert len(ids) == len(set(ids))
    assert set(acknowledged) <= set(ids)
    assert len(ids) - len(acknowledged) <= 1  # at most the one in flight at the kill
    new = d.submit("--hold", "quick.py")
    assert int(new) > max(int(i) for i in ids)


@pytest.mark.parametrize(
    ("source", "cause"),
    [
        ("import torch\ntorch.zeros(1).cuda()\n", "asks for CUDA but this job was given CPU devices"),
        ("import no_such_module_here\n", "a module is missing from the job's Python environment"),
        ("import argparse\nargparse.ArgumentParser().parse_args()\n", "refused its arguments"),
    ],
)  # fmt: skip
def test_a_job_that_cannot_start_fails_at_once_naming_the_cause(
    daemon: Daemon, source: str, cause: str
) -> None:
    (daemon.root / "doomed.py").write_text(source)
    job = daemon.submit("doomed.py", "--unexpected")
    final = daemon.wait_for(lambda j: j[job]["state"] == "failed", 60)
    assert cause in final[job]["reason"] and "not retried" in final[job]["reason"]
    decisions = json.loads(daemon.cli("show", job, "--json").stdout)["decisions"]
    assert not [d for d in decisions if d["kind"] == "crashed"]  # no back-off, no retry
