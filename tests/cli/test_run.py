"""``pollux-local run`` against a real daemon, as a user runs it (its own process): the job's
output on stdout, its state changes on stderr, its exit code as the command's; Ctrl-C
cancels the job."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from pollux_local import cli as cli_module
from pollux_local.api.messages import Cancel, Submit
from pollux_local.cli import main
from pollux_local.cli import run as run_module
from pollux_local.cli.run import Output
from tests.daemon_process import DaemonFactory, DaemonProcess, daemon_environ, wait_for

pytestmark = pytest.mark.timeout(120)

CONFIG = '[scheduler]\npolicy = "fifo"\ninterval_s = 0.5\n'


@pytest.fixture()
def daemon(daemon_factory: DaemonFactory) -> DaemonProcess:
    return daemon_factory(devices="cpu:1", config=CONFIG)


def run(daemon: DaemonProcess, tmp_path: Path, *argv: str) -> subprocess.Popen[str]:
    """``pollux-local run --workdir TMP ARGV`` against ``daemon``, started."""
    return subprocess.Popen(
        [sys.executable, "-m", "pollux_local", "run", "--state-dir", str(daemon.state_dir),
         "--workdir", str(tmp_path), *argv],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=daemon_environ(),
    )  # fmt: skip


def test_run_prints_the_output_and_exits_with_the_jobs_code(
    daemon: DaemonProcess, tmp_path: Path
) -> None:
    proc = run(daemon, tmp_path, "sh", "-c", "echo first line; echo second line; exit 5")
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 5, err
    assert out == "first line\nsecond line\n"  # the start's banner goes to stderr
    said = err.splitlines()
    assert any(" start #0: rank 0/1 on " in line for line in said), err
    assert said[0].startswith("submitted job ")
    job_id = said[0].split()[-1]
    assert any(line.startswith(f"job {job_id} running on ") for line in said), err
    assert said[-1].startswith(f"job {job_id} failed: replica exited with code 5"), err
    shown = daemon.client.request("show", id=job_id)["job"]
    assert (shown["state"], shown["exit_code"]) == ("failed", 5)


def test_run_of_a_job_that_succeeds_exits_0_after_waiting_in_the_queue(
    daemon: DaemonProcess, tmp_path: Path
) -> None:
    blocker = daemon.client.request("submit", argv=["sleep", "2"], workdir=str(tmp_path))["id"]
    wait_for(
        lambda: daemon.client.request("show", id=blocker)["job"]["state"] == "running",
        20,
        "the first job to hold the one device",
    )
    proc = run(daemon, tmp_path, "--name", "after", "echo", "done")
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert out == "done\n"
    said = err.splitlines()
    job_id = said[0].split()[-1]
    queued = [line for line in said if line.startswith(f"job {job_id} queued")]
    assert any(line.startswith(f"job {job_id} queued: ") for line in queued), err  # and why
    assert any(line.startswith(f"job {job_id} running on ") for line in said), err
    assert said[-1] == f"job {job_id} succeeded: finished"


def test_run_of_a_job_killed_by_a_signal_exits_128_plus_it(
    daemon: DaemonProcess, tmp_path: Path
) -> None:
    proc = run(daemon, tmp_path, "sh", "-c", "kill -KILL $$")
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGKILL, err


def test_ctrl_c_cancels_the_job_and_exits_130(daemon: DaemonProcess, tmp_path: Path) -> None:
    proc = run(daemon, tmp_path, "sh", "-c", "echo started; exec sleep 60")
    assert proc.stdout is not None
    while "started" not in (proc.stdout.readline() or "started"):
        pass
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 130, err
    job_id = err.splitlines()[0].split()[-1]
    assert f"job {job_id} cancelled (interrupted)" in err
    wait_for(
        lambda: daemon.client.request("show", id=job_id)["job"]["state"] == "cancelled",
        10,
        "the job to be cancelled",
    )


def test_run_refuses_an_array(daemon: DaemonProcess, tmp_path: Path) -> None:
    proc = run(daemon, tmp_path, "--array", "0-1", "true")
    _, err = proc.communicate(timeout=30)
    assert proc.returncode != 0
    assert err.strip() == (
        "pollux-local: error: run starts one job; an array or sweep makes several:"
        " submit, then wait"
    )
    assert daemon.client.request("status")["jobs"] == []


def test_the_banner_goes_to_stderr_however_the_log_arrives_in_pieces(
    capsys: pytest.CaptureFixture[str],
) -> None:
    output = Output()
    pieces = ["--- 2026-11-25 14:00:00 st", "art #1: rank 0/2 on box cuda:0\nepoch 1", " loss 0.5\n",
              "--- not a banner\n", "--", "- 2026-11-25 14:05:00 start #2: rank 0/1 on box cpu:0\n",
              "progress 50%"]  # fmt: skip
    for piece in pieces:
        output(piece)
    out, err = capsys.readouterr()
    assert out == "epoch 1 loss 0.5\n--- not a banner\nprogress 50%"
    assert err == (
        "--- 2026-11-25 14:00:00 start #1: rank 0/2 on box cuda:0\n"
        "--- 2026-11-25 14:05:00 start #2: rank 0/1 on box cpu:0\n"
    )
    output("--- 20")
    output.flush()
    out, err = capsys.readouterr()
    assert out == "--- 20"
    assert err == ""


def test_ctrl_c_while_the_submit_is_on_its_way_cancels_the_job_it_made(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The daemon stores the job, then Ctrl-C arrives before its reply is read: ``run`` says
    the job's id, cancels it and exits 130 (it used to exit 130 at once, the job left to run,
    its id never shown)."""
    calls: list[object] = []

    class Daemon:
        def call(self, request: object) -> object:
            calls.append(request)
            if isinstance(request, Submit):
                signal.raise_signal(signal.SIGINT)  # pressed while the submit was answered
                return SimpleNamespace(id="7", state="queued")
            return SimpleNamespace(ids=["7"])

    monkeypatch.setattr(run_module, "client_for", lambda args: Daemon())
    assert main(["run", "--state-dir", str(tmp_path), "--workdir", str(tmp_path), "true"]) == 130
    assert [type(call) for call in calls] == [Submit, Cancel]
    assert isinstance(calls[1], Cancel) and calls[1].ids == ["7"]
    assert capsys.readouterr().err.splitlines() == [
        "submitted job 7",
        "job 7 cancelled (interrupted)",
    ]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_ctrl_c_while_the_command_starts_exits_130_without_a_traceback(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Ctrl-C in the first fraction of a second (the commands' modules being imported) printed
    a KeyboardInterrupt traceback of some thirty lines."""

    def interrupted() -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(cli_module, "build_parser", interrupted)
    assert main(["run", "true"]) == 130
