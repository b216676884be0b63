"""The daemon SIGKILLed mid-operation: nothing acknowledged is lost or doubled, and running
work continues from its checkpoint after a restart."""

from __future__ import annotations

import json
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from pollux_local.errors import PolluxError
from tests.daemon_process import DaemonProcess

pytestmark = pytest.mark.timeout(180)

# A stand-in job: counts steps, checkpoints every step, checkpoints and exits 75 on SIGTERM
# (slowly, so that a stop is in flight for a while).
JOB = r"""
import json, os, signal, sys, time
ckpt = os.path.join(os.environ["POLLUX_CHECKPOINT_DIR"], "state.json")
steps = int(sys.argv[1])
step = json.load(open(ckpt))["step"] if os.path.exists(ckpt) else 0
with open(ckpt + ".log", "a") as fh:
    fh.write("start %d\n" % step)
stop = []
signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
def save():
    with open(ckpt + ".tmp", "w") as fh:
        json.dump({"step": step}, fh)
    os.replace(ckpt + ".tmp", ckpt)
while step < steps:
    time.sleep(0.05)
    step += 1
    save()
    if stop:
        time.sleep(1.0)
        sys.exit(75)
sys.exit(0)
"""


@pytest.fixture()
def state_dir(tmp_path: Path) -> Iterator[Path]:
    yield tmp_path / "state"


def start_daemon(state_dir: Path) -> DaemonProcess:
    return DaemonProcess(state_dir, "--devices", "cpu:2", "--interval", "0.5").start()


def test_sigkill_during_a_burst_of_500_submits_loses_and_doubles_nothing(
    state_dir: Path, tmp_path: Path
) -> None:
    daemon = start_daemon(state_dir)
    acknowledged: dict[str, str] = {}  # name -> id
    errors: list[str] = []

    def burst() -> None:
        for i in range(500):
            name = f"burst-{i:03d}"
            try:
                reply = daemon.client.request(
                    "submit", argv=["sleep", "1"], workdir=str(tmp_path), hold=True, name=name
                )
            except PolluxError as exc:
                errors.append(str(exc))
                return
            acknowledged[name] = str(reply["id"])

    try:
        submitter = threading.Thread(target=burst)
        submitter.start()
        while len(acknowledged) < 150 and submitter.is_alive():
            time.sleep(0.01)
        daemon.kill()
        submitter.join(60)
        assert errors, "the burst should have been cut by the kill"
        assert 150 <= len(acknowledged) < 500

        daemon = start_daemon(state_dir)
        jobs = daemon.client.request("status")["jobs"]
        names = Counter(job["name"] for job in jobs)
        for name, job_id in acknowledged.items():
            assert names[name] == 1, f"{name} present {names[name]} times"
            assert daemon.client.request("show", id=job_id)["job"]["name"] == name
        assert all(count == 1 for count in names.values())  # at most the in-flight one extra
        assert len(jobs) - len(acknowledged) <= 1
        # The daemon keeps working: the rest of the burst goes in.
        for i in range(len(jobs), 500):
            daemon.client.request(
                "submit", argv=["sleep", "1"], workdir=str(tmp_path), hold=True, name=f"after-{i}"
            )
        assert len(daemon.client.request("status")["jobs"]) == 500
    finally:
        daemon.stop()


def wait_for(predicate, timeout_s: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def checkpoint_step(daemon: DaemonProcess, job_id: str) -> int:
    path = daemon.state_dir / "jobs" / job_id
    for candidate in path.rglob("state.json"):
        try:
            return int(json.loads(candidate.read_text())["step"])
        except (ValueError, KeyError, OSError):
            return -1
    return -1


def test_sigkill_while_running_and_during_a_stop_then_the_job_finishes(
    state_dir: Path, tmp_path: Path
) -> None:
    script = tmp_path / "job.py"
    script.write_text(JOB)
    daemon = start_daemon(state_dir)
    try:
        job_id = str(
            daemon.client.request(
                "submit", argv=[sys.executable, str(script), "120"], workdir=str(tmp_path),
                name="survivor", max_gpus=1,
            )["id"]
        )  # fmt: skip
        state = lambda: daemon.client.request("show", id=job_id)["job"]["state"]  # noqa: E731
        wait_for(lambda: checkpoint_step(daemon, job_id) >= 10, 60, "the job to make progress")

        # 1. SIGKILL while the job runs.
        daemon.kill()
        before = checkpoint_step(daemon, job_id)
        daemon = start_daemon(state_dir)
        wait_for(lambda: checkpoint_step(daemon, job_id) > before + 5, 60, "progress after restart")

        # 2. SIGKILL while a stop (checkpoint + exit 75) is in flight.
        daemon.client.request("hold", id=job_id)
        time.sleep(0.3)
        daemon.kill()
        daemon = start_daemon(state_dir)
        assert state() == "held"
        daemon.client.request("release", id=job_id)

        wait_for(lambda: state() in ("succeeded", "failed", "cancelled"), 90, "the job to end")
        assert state() == "succeeded"
        assert checkpoint_step(daemon, job_id) == 120
        starts = [
            int(line.split()[1])
            for log in (daemon.state_dir / "jobs" / job_id).rglob("state.json.log")
            for line in log.read_text().splitlines()
        ]
        assert starts[0] == 0 and len(starts) >= 2
        assert all(b >= a for a, b in zip(starts, starts[1:], strict=False))  # never back to 0
        assert starts[-1] > 0
    finally:
        daemon.stop()
