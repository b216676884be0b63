"""Warm resizes through a real daemon (``[scheduler] warm_resize``): an elastic job on two CPU
devices is shrunk when other jobs come and grown back when they end, in place (its replicas
are never restarted), several times, and ends with the weights of an uninterrupted
one-replica run of the same steps.

The job's total batch is fixed (base = max = 32), so every step averages the gradient of the
same 32 samples whether one replica computes it or two do (16 each, averaged by an
all-reduce): the runs differ only in the order of floating-point reductions, which is the
tolerance of the comparison (:data:`REDUCTION_ORDER_TOLERANCE`).  The model is smooth (tanh):
with the probe's ReLU, 4 of 10 such runs ended 6e-4 apart in the first layer.  Logged step by
step, those runs stayed at the level of summation order (a sum of the first layer's weights
within 1e-7 to 6e-6 of the reference, with no jump at any resize) until one step, 1,100 steps
after the last resize, where they jumped 30-fold at once: a ReLU whose input for one sample
sat at 0 went the other way, and that unit's gradient parted the runs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from pollux_local import api
from tests.daemon_process import DaemonFactory, DaemonProcess, wait_for
from tests.paths import REPO_ROOT
from tests.torch.test_distributed import step_sequence

torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.timeout(420), pytest.mark.slow]

#: The largest difference of any weight between the resized run and the reference: each step's
#: gradient is the same mean computed in another order (one replica, or two and gloo's sum).
REDUCTION_ORDER_TOLERANCE = 1e-4
#: seconds slept per sample of a micro-batch: two replicas step twice as fast as one
PAUSE_PER_SAMPLE = "0.002"
PROBE = ["-m", "pollux_local.torch.probe", "--base-batch", "32", "--max-batch", "32"]
PROBE += ["--no-adapt", "--samples", "2048", "--pause", PAUSE_PER_SAMPLE, "--activation", "tanh"]


@pytest.fixture()
def daemon(daemon_factory: DaemonFactory) -> DaemonProcess:
    return daemon_factory(
        devices="cpu:2",
        config="[scheduler]\ninterval_s = 1\nrestart_cost_s = 2\nwarm_resize = true\n"
        "warm_timeout_s = 90\n",
        interval=1,
    )


def submit(
    daemon: DaemonProcess, workdir: Path, args: list[str], name: str, program: list[str] = PROBE
) -> str:
    """An elastic job of one or two devices at a fixed total batch of 32: ``program`` (the
    probe) with ``args``."""
    return daemon.client.call(
        api.Submit(
            argv=[sys.executable, *program, *args],
            workdir=str(workdir),
            elastic=True,
            min_gpus=1,
            max_gpus=2,
            batch_size=32,
            max_batch_size=32,
            name=name,
            env={"PYTHONPATH": str(REPO_ROOT)},
        )
    ).id


def submit_sleeper(daemon: DaemonProcess, workdir: Path, name: str) -> str:
    """A rigid one-device job that only sleeps: it takes a device from the elastic job
    without taking the CPU its replicas are measured on."""
    return daemon.client.call(api.Submit(argv=["sleep", "4"], workdir=str(workdir), name=name)).id


def show(daemon: DaemonProcess, job_id: str) -> api.ShowReply:
    return daemon.client.call(api.Show(id=job_id))


def replicas(daemon: DaemonProcess, job_id: str) -> int:
    job = show(daemon, job_id).job
    if job.state.value in ("failed", "cancelled"):
        raise AssertionError(f"job {job_id} {job.state.value}: {job.reason}\n{daemon.output()}")
    return sum(len(d) for d in job.devices.values()) if job.state.value == "running" else 0


def waiting(daemon: DaemonProcess, job_id: str, predicate: Any, timeout_s: float, what: str) -> Any:
    """``wait_for``, failing with the job's decisions and the daemon's log."""
    try:
        return wait_for(predicate, timeout_s, what)
    except AssertionError as exc:
        reply = show(daemon, job_id)
        lines = [f"{d.kind}: {d.reason} {d.placement} {d.batch}" for d in reply.decisions]
        report = reply.job.report
        batch = report.batch if report is not None else None
        raise AssertionError(
            f"{exc}\n{reply.job.state.value} {reply.job.reason}\n"
            f"report: progress {report.progress if report else None} batch {batch}\n"
            + "\n".join(lines)
            + "\n"
            + daemon.output()[-4000:]
        ) from None


def resized_in_place(daemon: DaemonProcess, job: str, done: Any, at_least: int) -> api.ShowReply:
    """The job succeeded, was resized in place ``at_least`` times and never by a restart
    (nor did a resize in place fall back to one); its ``show``."""
    reply = show(daemon, job)
    decisions = [(d.kind, d.reason) for d in reply.decisions]
    assert done.state.value == "succeeded", (done.reason, decisions)
    in_place = [r for kind, r in decisions if kind == "resize" and r.endswith("(in place)")]
    fell_back = [r for kind, r in decisions if "(in place:" in r]
    assert len(in_place) >= at_least and not fell_back, decisions
    assert done.restarts == 0, decisions  # started once, never restarted
    return reply


def test_a_job_resized_in_place_several_times_ends_with_the_uninterrupted_weights(
    daemon: DaemonProcess, tmp_path: Path
) -> None:
    out = tmp_path / "resized.pt"
    slow = tmp_path / "slow"  # the job is paced while it exists
    slow.touch()
    epochs = ["--epochs", "24"]
    job = submit(
        daemon,
        tmp_path,
        [
            *epochs,
            "--out",
            str(out),
            "--pause-while",
            str(slow),
            "--log-samples",
            str(tmp_path / "resized"),
        ],
        "resized",
    )
    waiting(
        daemon,
        job,
        lambda: replicas(daemon, job) == 2 and show(daemon, job).job.report is not None,
        120,
        "the job to run on both devices",
    )
    for cycle in range(2):
        other = submit_sleeper(daemon, tmp_path, f"other{cycle}")
        waiting(daemon, job, lambda: replicas(daemon, job) == 1, 60, f"a shrink (cycle {cycle})")
        wait_for(
            lambda o=other: show(daemon, o).job.state.value == "succeeded",  # type: ignore[misc]
            120,
            f"the other job {cycle} to end",
        )
        waiting(daemon, job, lambda: replicas(daemon, job) == 2, 60, f"a grow (cycle {cycle})")
    slow.unlink()  # the rest of its steps at full speed
    done = wait_for(
        lambda: (j := show(daemon, job).job).state.value in ("succeeded", "failed") and j,
        240,
        "the job to end",
    )
    reply = resized_in_place(daemon, job, done, at_least=4)
    # rank 1 was started as a joiner at each grow (its log's banners), never by a restart
    joined = daemon.client.call(api.Logs(id=job, rank=1, offset=-(1 << 20), max_bytes=1 << 20))
    assert joined.data.count("joined at resize") >= 2, joined.data[-3000:]
    assert "start #1" not in joined.data
    # every warm resize's downtime was measured (from the order to the first step after)
    assert reply.job.resizes_warm >= 4 and reply.job.resize_warm_s is not None, reply.job

    reference = tmp_path / "reference.pt"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("POLLUX_", "RANK", "WORLD"))}
    env.update(OMP_NUM_THREADS="1", POLLUX_LOCAL_BATCH="32", PYTHONPATH=str(REPO_ROOT))
    subprocess.run(
        [sys.executable, *PROBE, *epochs, "--pause", "0", "--out", str(reference), "--log-samples", str(tmp_path / "reference")],
        env=env, cwd=tmp_path, check=True, timeout=240,
    )  # fmt: skip
    resized: dict[str, Any] = torch.load(out, weights_only=False)
    uninterrupted: dict[str, Any] = torch.load(reference, weights_only=False)
    assert resized["steps"] == uninterrupted["steps"] == 24 * 2048 // 32
    # the same samples at every step (the loader's position carried through every resize)
    assert step_sequence(tmp_path / "resized") == step_sequence(tmp_path / "reference")
    difference = max(
        float((resized["model"][k] - uninterrupted["model"][k]).abs().max())
        for k in uninterrupted["model"]
    )
    assert difference < REDUCTION_ORDER_TOLERANCE, difference


#: A job that says it acts on resize orders but never sees them (it watches another file) and
#: whose joiners fail at once.
DEAF_JOB = """\
import os, runpy, sys
os.environ["POLLUX_RESIZE_FILE"] = os.path.join(os.environ["POLLUX_JOB_DIR"], "no-order-here")
if os.environ.get("POLLUX_RESIZE_JOIN"):
    sys.exit(3)
sys.argv[0] = "probe"
runpy.run_module("pollux_local.torch.probe", run_name="__main__")
"""


def test_a_resize_that_cannot_be_done_in_place_falls_back_to_a_restart(
    daemon_factory: DaemonFactory, tmp_path: Path
) -> None:
    daemon = daemon_factory(
        devices="cpu:2",
        config="[scheduler]\ninterval_s = 1\nrestart_cost_s = 2\nwarm_resize = true\n"
        "warm_timeout_s = 3\n",
        interval=1,
    )
    script = tmp_path / "deaf.py"
    script.write_text(DEAF_JOB)
    out = tmp_path / "final.pt"
    slow = tmp_path / "slow"
    slow.touch()
    # long enough that growing back pays even when a busy machine made the restart slow (the
    # policy weighs each job's measured restart cost against its remaining work)
    args = [*PROBE[2:], "--epochs", "40", "--out", str(out), "--pause-while", str(slow)]
    job = submit(daemon, tmp_path, args, "deaf", program=[str(script)])
    waiting(
        daemon, job,
        lambda: replicas(daemon, job) == 2 and show(daemon, job).job.report is not None,
        120, "the job to run on both devices",
    )  # fmt: skip
    other = submit_sleeper(daemon, tmp_path, "other")
    waiting(daemon, job, lambda: replicas(daemon, job) == 1, 90, "a shrink")
    wait_for(lambda: show(daemon, other).job.state.value == "succeeded", 120, "the other job")
    waiting(
        daemon, job,
        lambda: any("joining rank 1 exited" in d.reason for d in show(daemon, job).decisions),
        120, "a grow that falls back",
    )  # fmt: skip
    slow.unlink()
    done = waiting(
        daemon, job,
        lambda: (j := show(daemon, job).job).state.value in ("succeeded", "failed") and j,
        300, "the job to end",
    )  # fmt: skip
    reasons = [d.reason for d in show(daemon, job).decisions]
    assert done.state.value == "succeeded", (done.reason, reasons)
    # the shrink's order was ignored and the grow's joiner failed: both restarted instead
    assert any("(in place: the leaving replicas did not exit" in r for r in reasons), reasons
    assert any("(in place: joining rank 1 exited with 3 first)" in r for r in reasons), reasons
    assert done.restarts >= 2 and done.resizes_cold >= 1, done
    assert torch.load(out, weights_only=False)["steps"] == 40 * 2048 // 32
