"""A daemon SIGKILLed while a job runs on an SSH node of the namespace test bed, then restarted:
nothing finished runs twice, nothing runs doubled.

(a) the job finishes on its node while the daemon is down (it ignores the SIGTERM the node's
supervisor sends once the daemon is gone, and ends within that supervisor's grace): the
restarted daemon reads the node's exit record, records the job as succeeded and never runs it
again; (b) the job is still running when the daemon restarts: the restarted daemon waits for
its end (its node stops it) before running it again, never two at once.  Runs are counted in
a marker file the job appends to.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.daemon_process import DaemonFactory, DaemonProcess, wait_for

from .testbed import Testbed

pytestmark = pytest.mark.timeout(180)


def one_node_config(bed: Testbed, root: Path) -> str:
    host = bed.hosts[0]
    options = ", ".join(json.dumps(o) for o in bed.ssh_options())
    return (
        "\n".join(
            [
                "[scheduler]",
                'policy = "fifo"',
                "interval_s = 0.5",
                "[daemon]",
                f'checkpoint_root = "{root / "ckpt"}"',
                "node_retry_s = 3",
                "backoff_s = 0.5",
                f'[nodes."{host.name}"]',
                f'host = "{host.name}"',
                'devices = "cpu:1"',
                f'address = "{host.address}"',
                f"ssh_options = [{options}]",
                'python = "/usr/bin/python3"',
                f'workdir = "{root / ("work-" + host.name)}"',
            ]
        )
        + "\n"
    )


@pytest.fixture()
def config(testbed: Testbed, tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "config.toml"
    path.write_text(one_node_config(testbed, tmp_path))
    yield path


@pytest.fixture()
def start(config: Path, daemon_factory: DaemonFactory) -> Callable[[], DaemonProcess]:
    """(Re)start a daemon on the test bed's config, on the test's one state directory; every
    one is stopped before the test bed goes."""
    state_dir = daemon_factory.root / "state"
    return lambda: daemon_factory(config=config, state_dir=state_dir, timeout_s=60)


def submit(daemon: DaemonProcess, workdir: Path, script: str) -> str:
    reply = daemon.client.request(
        "submit",
        argv=["/bin/sh", "-c", script],
        workdir=str(workdir),
        env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": "/root"},
        min_gpus=1,
        max_gpus=1,
        name="marker",
        elastic=False,
    )
    return str(reply["id"])


def job(daemon: DaemonProcess, job_id: str) -> dict[str, Any]:
    return dict(daemon.client.request("show", id=job_id)["job"])


def lines(path: Path) -> list[str]:
    return path.read_text().split("\n")[:-1] if path.exists() else []


def succeeded_once(daemon: DaemonProcess, job_id: str, marker: Path) -> None:
    """The recovered daemon takes ``job_id`` as succeeded and does not run it again (its
    ``marker`` holds one run, a few seconds on)."""
    shown = wait_for(
        lambda: (j := job(daemon, job_id))["state"] in ("succeeded", "failed") and j,
        60,
        "the job's end",
    )
    assert shown["state"] == "succeeded", shown["reason"]
    time.sleep(3.0)  # a second run would have begun by now
    assert lines(marker) == ["run"]
    assert job(daemon, job_id)["state"] == "succeeded"


def test_a_job_that_finished_while_the_daemon_was_down_is_not_run_again(
    tmp_path: Path, start: Callable[[], DaemonProcess]
) -> None:
    marker, done = tmp_path / "runs", tmp_path / "done"
    daemon = start()
    try:
        job_id = submit(
            daemon, tmp_path, f"trap '' TERM; echo run >> {marker}; sleep 4; echo x >> {done}"
        )
        wait_for(lambda: job(daemon, job_id)["state"] == "running" and lines(marker), 60, "a run")
        daemon.kill()
        wait_for(lambda: lines(done), 30, "the job to finish on its node")
        time.sleep(1.0)
        daemon = start()
        succeeded_once(daemon, job_id, marker)
        kinds = [d["kind"] for d in daemon.client.request("show", id=job_id)["decisions"]]
        assert "recovered" in kinds
    finally:
        daemon.stop()


def test_a_job_still_running_at_the_restart_is_not_run_twice_at_once(
    testbed: Testbed, tmp_path: Path, start: Callable[[], DaemonProcess]
) -> None:
    marker = tmp_path / "runs"
    daemon = start()
    try:
        job_id = submit(daemon, tmp_path, f"trap '' TERM; echo $$ >> {marker}; sleep 300")
        wait_for(lambda: job(daemon, job_id)["state"] == "running" and lines(marker), 60, "a run")
        daemon.kill()
        daemon = start()  # at once: the node still runs the first one
        first = int(lines(marker)[0])
        host = testbed.hosts[0]
        # its node stops it (SIGKILL after its grace: it ignores SIGTERM); only then may the
        # restarted daemon run the job again
        wait_for(lambda: len(lines(marker)) >= 2, 90, "the job to run again")
        assert testbed.ssh(host, f"kill -0 {first}").returncode != 0, "the job runs twice at once"
        assert len(lines(marker)) == 2
        daemon.client.request("cancel", ids=[job_id])
    finally:
        daemon.stop()


def test_a_power_cut_while_a_finished_job_is_cleaned_up_on_its_node_does_not_run_it_again(
    tmp_path: Path, start: Callable[[], DaemonProcess]
) -> None:
    """A job's only rank exits 0 leaving a child behind; its node's agent writes the rank's
    exit, then cleans up (kills the child, ends its fence) before it writes its end.  A
    power cut there (the daemon and the agent SIGKILLed; the agent is stopped the moment
    the record holds the exit, so that the cut falls in that window): the job has finished,
    is recorded so and is not run again, and what it left on the node is killed.  The
    agent's end was the only result a restarted daemon took: it waited for ever on a record
    whose agent was gone (the job held its devices), or queued the job again."""
    marker = tmp_path / "runs"
    daemon = start()
    try:
        job_id = submit(daemon, tmp_path, f"echo run >> {marker}; sleep 30 & exit 0")

        def exited() -> dict[str, Any] | None:
            """The record once it holds every rank's exit, its agent stopped there."""
            for path in tmp_path.glob(f"work-*/run/*/{job_id}@*.json"):
                try:
                    record = json.loads(path.read_text())
                except (OSError, ValueError):
                    continue
                replicas = record.get("replicas") or []
                if replicas and all(r.get("exit_code") is not None for r in replicas):
                    os.kill(int(record["agent_pid"]), signal.SIGSTOP)
                    return dict(json.loads(path.read_text()))
            return None

        deadline = time.monotonic() + 60
        record = exited()
        while record is None and time.monotonic() < deadline:
            time.sleep(0.005)
            record = exited()
        assert record is not None, "the rank's exit was never recorded"
        assert record["state"] != "ended", "the agent ended before it could be stopped"
        daemon.kill()
        os.kill(int(record["agent_pid"]), signal.SIGKILL)
        left = [
            int(p.name)
            for p in Path("/proc").iterdir()
            if p.name.isdigit() and _cmdline(p) == ["sleep", "30"] and _in(p, tmp_path)
        ]
        daemon = start()
        succeeded_once(daemon, job_id, marker)
        # what it left is ended with its agent's fence (a node where none can be made says
        # so: nothing there tells what a replica started once its agent is gone)
        if "no fence for the job's processes" not in daemon.output():
            still = [pid for pid in left if _in(Path(f"/proc/{pid}"), tmp_path)]
            assert not still, f"what the job left runs on: {still}"
    finally:
        daemon.stop()


def _cmdline(proc: Path) -> list[str]:
    try:
        return (proc / "cmdline").read_bytes().decode(errors="replace").split("\0")[:-1]
    except OSError:
        return []


def _in(proc: Path, directory: Path) -> bool:
    try:
        return os.readlink(proc / "cwd") == str(directory)
    except OSError:
        return False
