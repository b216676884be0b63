"""``pollux-local send`` against a real daemon, as a user runs it (its own process): a job
submitted with ``--stdin`` reads the lines sent to it and prints them in its log; a job without
``--stdin``, or one that has ended, is refused in one line."""

from __future__ import annotations

import stat
import subprocess
import sys
from pathlib import Path

import pytest

from tests.daemon_process import DaemonFactory, DaemonProcess, daemon_environ, wait_for

pytestmark = pytest.mark.timeout(120)

CONFIG = '[scheduler]\npolicy = "fifo"\ninterval_s = 0.5\n'

#: Reads two lines from its stdin, prints them, and exits.
READS_TWO = 'read a; read b; echo "first: $a"; echo "second: $b"'


def cli(daemon: DaemonProcess, *argv: str) -> subprocess.CompletedProcess[str]:
    """``pollux-local COMMAND --state-dir S ARGS...`` run as its own process."""
    command, *rest = argv
    return subprocess.run(
        [sys.executable, "-m", "pollux_local", command, "--state-dir", str(daemon.state_dir),
         *rest],
        capture_output=True, text=True, env=daemon_environ(), timeout=60,
    )  # fmt: skip


def submitted(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("submitted job "), result.stdout
    return result.stdout.split()[2]


def state_of(daemon: DaemonProcess, job_id: str) -> str:
    return str(daemon.client.request("show", id=job_id)["job"]["state"])


@pytest.fixture()
def daemon(daemon_factory: DaemonFactory) -> DaemonProcess:
    return daemon_factory(devices="cpu:1", config=CONFIG)


def test_send_delivers_lines_to_a_stdin_job_and_refuses_the_others(
    daemon: DaemonProcess, tmp_path: Path
) -> None:
    job = submitted(
        cli(daemon, "submit", "--workdir", str(tmp_path), "--stdin", "sh", "-c", READS_TWO)
    )
    assert daemon.client.request("show", id=job)["job"]["stdin"] is True
    shown = cli(daemon, "show", job).stdout
    assert f"  input       --stdin: pollux-local send {job} TEXT\n" in shown, shown
    wait_for(lambda: state_of(daemon, job) == "running", 60, f"job {job} to run")
    fifo = Path(daemon.client.request("show", id=job)["job"]["job_dir"]) / "stdin"

    def sent(*argv: str) -> bool:
        result = cli(daemon, "send", job, *argv)
        if result.returncode == 0:
            return True
        assert "is not reading its input now" in result.stderr, result.stderr  # starting
        return False

    wait_for(lambda: sent("hello", "world"), 30, "the first line to be taken")
    info = fifo.lstat()
    assert stat.S_ISFIFO(info.st_mode) and stat.S_IMODE(info.st_mode) == 0o600
    lines = tmp_path / "lines.txt"
    lines.write_text("the second line\n")
    assert sent("--file", str(lines))
    wait_for(lambda: state_of(daemon, job) == "succeeded", 60, f"job {job} to succeed")
    log = daemon.client.request("logs", id=job)["data"]
    assert "first: hello world\nsecond: the second line\n" in log, log

    ended = cli(daemon, "send", job, "too late")
    assert ended.returncode != 0
    assert ended.stderr.strip() == f"pollux-local: error: job {job} is not running (succeeded)"

    plain = submitted(cli(daemon, "submit", "--workdir", str(tmp_path), "--hold", "sleep", "30"))
    refused = cli(daemon, "send", plain, "anyone there?")
    assert refused.returncode != 0
    assert refused.stderr.strip() == (
        f"pollux-local: error: job {plain} was not submitted with --stdin: it has no input to"
        " send to (submit it with --stdin)"
    )
    missing = cli(daemon, "send", "999", "hello")
    assert missing.returncode != 0 and "999" in missing.stderr
    assert len(missing.stderr.strip().splitlines()) == 1
