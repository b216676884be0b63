"""The daemon SIGKILLed mid-operation: nothing acknowledged is lost or doubled, and running
work continues from its checkpoint after a restart."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest

from pollux_local.errors import PolluxError
from tests.daemon_process import DaemonFactory, DaemonProcess, wait_for

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
def start_daemon(daemon_factory: DaemonFactory) -> Callable[[], DaemonProcess]:
    """(Re)start a daemon on cpu:2 on the test's one state directory (stopped at teardown)."""
    state_dir = daemon_factory.root / "state"
    return lambda: daemon_factory(devices="cpu:2", interval=0.5, state_dir=state_dir)


def test_sigkill_during_a_burst_of_500_submits_loses_and_doubles_nothing(
    start_daemon: Callable[[], DaemonProcess], tmp_path: Path
) -> None:
    daemon = start_daemon()
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

        daemon = start_daemon()
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


def checkpoint_step(daemon: DaemonProcess, job_id: str) -> int:
    path = daemon.state_dir / "jobs" / job_id
    for candidate in path.rglob("state.json"):
        try:
            return int(json.loads(candidate.read_text())["step"])
        except (ValueError, KeyError, OSError):
            return -1
    return -1


def test_sigkill_while_running_and_during_a_stop_then_the_job_finishes(
    start_daemon: Callable[[], DaemonProcess], tmp_path: Path
) -> None:
    script = tmp_path / "job.py"
    script.write_text(JOB)
    daemon = start_daemon()
    try:
        job_id = str(
            daemon.client.request(
                "submit", argv=[sys.executable, str(script), "120"], workdir=str(tmp_path),
                name="survivor", max_gpus=1, elastic=True,
            )["id"]
        )  # fmt: skip
        state = lambda: daemon.client.request("show", id=job_id)["job"]["state"]  # noqa: E731
        wait_for(lambda: checkpoint_step(daemon, job_id) >= 10, 60, "the job to make progress")

        # 1. SIGKILL while the job runs.
        daemon.kill()
        before = checkpoint_step(daemon, job_id)
        daemon = start_daemon()
        wait_for(lambda: checkpoint_step(daemon, job_id) > before + 5, 60, "progress after restart")

        # 2. SIGKILL while a stop (checkpoint + exit 75) is in flight.
        daemon.client.request("hold", id=job_id)
        time.sleep(0.3)
        daemon.kill()
        daemon = start_daemon()
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


# Like JOB, but only rank 0 writes (the replicas of a multi-device incarnation share the
# checkpoint directory) and the stop after SIGTERM is slower, so that a rescale is in flight
# for a while.
RANKED_JOB = r"""
import json, os, signal, sys, time
rank = int(os.environ.get("RANK", "0"))
ckpt = os.path.join(os.environ["POLLUX_CHECKPOINT_DIR"], "state.json")
steps = int(sys.argv[1])
step = json.load(open(ckpt))["step"] if os.path.exists(ckpt) else 0
if rank == 0:
    with open(ckpt + ".log", "a") as fh:
        fh.write("start %d %s\n" % (step, os.environ.get("WORLD_SIZE", "1")))
stop = []
signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
def save():
    if rank == 0:
        with open(ckpt + ".tmp", "w") as fh:
            json.dump({"step": step}, fh)
        os.replace(ckpt + ".tmp", ckpt)
while step < steps:
    time.sleep(0.05)
    step += 1
    save()
    if stop:
        time.sleep(2.0)
        sys.exit(75)
sys.exit(0)
"""


def starts_of(daemon: DaemonProcess, job_id: str) -> list[tuple[int, int]]:
    """(first step, world size) of every incarnation of a RANKED_JOB."""
    return [
        (int(parts[1]), int(parts[2]))
        for log in (daemon.state_dir / "jobs" / job_id).rglob("state.json.log")
        for parts in (line.split() for line in log.read_text().splitlines())
    ]


def test_sigkill_during_a_rescale_decided_by_the_policy(
    start_daemon: Callable[[], DaemonProcess], tmp_path: Path
) -> None:
    """Job A runs alone on both devices; job B arrives and the goodput policy shrinks A.  The
    daemon is SIGKILLed while A is checkpoint-stopping for that rescale; after a restart both
    jobs run to the end, A from its checkpoint, and each job exists exactly once."""
    script = tmp_path / "job.py"
    script.write_text(RANKED_JOB)
    daemon = start_daemon()
    try:
        submit = lambda name, steps: str(  # noqa: E731
            daemon.client.request(
                "submit", argv=[sys.executable, str(script), str(steps)], workdir=str(tmp_path),
                name=name, max_gpus=2, elastic=True,
            )["id"]
        )  # fmt: skip
        jobs = lambda: {j["id"]: j for j in daemon.client.request("status")["jobs"]}  # noqa: E731
        first = submit("shrunk", 160)
        wait_for(lambda: jobs()[first]["gpus"] == 2, 30, "A to run on both devices")
        wait_for(lambda: checkpoint_step(daemon, first) >= 10, 30, "A to make progress")
        second = submit("newcomer", 40)
        seen: list[str] = []

        def rescaling() -> bool:
            seen.append(jobs()[first]["state"])
            return seen[-1] == "rescaling"

        deadline = time.monotonic() + 30
        while not rescaling():
            assert time.monotonic() < deadline, f"A was never rescaled: {seen[-20:]}"
            time.sleep(0.02)
        decided = [d for d in daemon.client.request("show", id=first)["decisions"]]
        daemon.kill()
        at_kill = checkpoint_step(daemon, first)
        assert at_kill >= 10

        daemon = start_daemon()
        final = None
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            final = jobs()
            if all(j["state"] in ("succeeded", "failed", "cancelled") for j in final.values()):
                break
            time.sleep(0.2)
        assert final is not None
        assert {j["state"] for j in final.values()} == {"succeeded"}, final
        names = Counter(j["name"] for j in final.values())
        assert names == Counter({"shrunk": 1, "newcomer": 1})
        assert checkpoint_step(daemon, first) == 160 and checkpoint_step(daemon, second) == 40

        runs = starts_of(daemon, first)
        assert runs[0] == (0, 2), runs  # alone: both devices
        assert len(runs) >= 2 and all(step > 0 for step, _ in runs[1:]), runs  # never from 0
        assert all(b[0] >= a[0] for a, b in zip(runs, runs[1:], strict=False)), runs
        assert runs[1][0] >= at_kill - 1, (runs, at_kill)  # resumed where the stop saved
        assert starts_of(daemon, second)[0][0] == 0
        kinds = [d["kind"] for d in daemon.client.request("show", id=first)["decisions"]]
        assert "recovered" in kinds, kinds
        assert decided and decided[-1]["kind"] == "start", decided  # the kill came mid-resize
    finally:
        daemon.stop()


def test_a_power_cut_charges_a_job_no_run_time_for_the_time_the_daemon_was_down(
    start_daemon: Callable[[], DaemonProcess], tmp_path: Path
) -> None:
    """A power cut (the daemon, the job's supervisor and its replicas SIGKILLed at once) and
    a daemon back 12 s later: the job, queued again, is charged the seconds it ran, not the
    time the daemon was down.  It was charged up to the restart, and a job with a 10 s limit
    that had run for a second failed at its next start with ``time limit 10s reached``."""
    daemon = start_daemon()
    try:
        job_id = str(
            daemon.client.request(
                "submit", argv=["/bin/sleep", "300"], workdir=str(tmp_path), time_limit_s=10
            )["id"]
        )
        show = lambda: daemon.client.request("show", id=job_id)["job"]  # noqa: E731
        wait_for(lambda: show()["state"] == "running", 30, "the job to start")
        time.sleep(1.0)
        run = json.loads((daemon.state_dir / "run" / f"{job_id}.json").read_text())
        daemon.kill()
        for pid in [run["supervisor"]["pid"], *(replica["pid"] for replica in run["replicas"])]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(12.0)
        daemon = start_daemon()
        wait_for(lambda: show()["restarts"] >= 1, 30, "the job to start again")
        job = show()
        assert job["state"] == "running", job
        assert job["run_time_s"] < 8.0, job  # about 2 s before the cut, and since the restart
        decisions = daemon.client.request("show", id=job_id).get("decisions", [])
        assert not any("time limit" in str(line.get("reason")) for line in decisions), decisions
        daemon.client.request("cancel", ids=[job_id])
    finally:
        daemon.stop()


def test_a_power_cut_while_a_finished_job_is_cleaned_up_does_not_run_it_again(
    start_daemon: Callable[[], DaemonProcess], tmp_path: Path
) -> None:
    """A job's only rank exits 0 leaving a child that holds its output, so its supervisor
    drains the log for a second before its clean-up; a power cut there (the daemon and the
    supervisor SIGKILLed): the job has finished and is not run again.  The supervisor wrote
    the result only after its clean-up, so nothing was recorded and the job ran twice."""
    marker = tmp_path / "runs"
    daemon = start_daemon()
    try:
        command = f"echo run >> {marker}; sleep 30 & exit 0"
        job_id = str(
            daemon.client.request("submit", argv=["/bin/sh", "-c", command], workdir="/tmp")["id"]
        )
        wait_for(marker.exists, 30, "the job to run")
        time.sleep(0.3)  # the rank has exited; the supervisor waits for its log
        run = json.loads((daemon.state_dir / "run" / f"{job_id}.json").read_text())
        daemon.kill()
        for pid in [run["supervisor"]["pid"], *(replica["pid"] for replica in run["replicas"])]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        daemon = start_daemon()
        show = lambda: daemon.client.request("show", id=job_id)["job"]  # noqa: E731
        wait_for(lambda: show()["state"] in ("succeeded", "failed"), 30, "the job's end")
        time.sleep(1.0)  # a second run would have begun by now
        assert show()["state"] == "succeeded", show()
        assert marker.read_text().count("run") == 1
    finally:
        daemon.stop()
