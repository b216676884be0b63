"""``wait --all`` and ``wait --array ID`` on a real daemon (cpu:2, a pass a second): they wait
for every job named (the caller's active jobs when the wait starts; every task of an array),
exit 0 only when all succeeded (else 1, as ``wait ID`` does) and ``--json`` gives each job's
final state; a job that ended before the wait is not waited for."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from pollux_local.cli import main
from pollux_local.cli import wait as wait_module
from tests.daemon.test_e2e import CONFIG, Daemon
from tests.daemon_process import DaemonFactory

pytestmark = pytest.mark.timeout(180)

#: Sleeps a moment, then exits with the code given (a task of an array: 3 for index 2); with a
#: third argument it first waits (60 s at most) for a file ``go`` beside it.
JOB = """
import os, sys, time
gate = os.path.join(os.path.dirname(os.path.abspath(__file__)), "go")
deadline = time.time() + 60
while len(sys.argv) > 3 and not os.path.exists(gate) and time.time() < deadline:
    time.sleep(0.1)
time.sleep(float(sys.argv[1]))
index = os.environ.get("POLLUX_ARRAY_INDEX")
sys.exit(3 if index == "2" else int(sys.argv[2]))
"""


@pytest.fixture
def daemon(tmp_path: Path, daemon_factory: DaemonFactory) -> Daemon:
    (tmp_path / "job.py").write_text(JOB)
    d = Daemon(daemon_factory, CONFIG)
    d.start()
    return d


def wait(daemon: Daemon, *args: str) -> subprocess.CompletedProcess[str]:
    return daemon.cli("wait", "--interval", "0.2", "--timeout", "90", *args, check=False)


def rows(done: subprocess.CompletedProcess[str]) -> dict[str, dict[str, Any]]:
    return {row["id"]: row for row in json.loads(done.stdout)["jobs"]}


def test_wait_all_waits_for_every_active_job_of_mine_and_fails_if_one_failed(
    daemon: Daemon,
) -> None:
    early = daemon.submit("job.py", "0", "5")
    daemon.wait_for(lambda j: j[early]["state"] == "failed", 30)  # ended before the wait
    # the jobs wait for ``go``, made once the wait has had time to list them (on a loaded
    # machine the submissions alone can take longer than a job that only sleeps)
    fine = [daemon.submit("job.py", "1", "0", "gated") for _ in range(2)]
    crash = daemon.submit("job.py", "0.5", "4", "gated")
    held = daemon.submit("--hold", "job.py", "0", "0", "gated")
    daemon.cli("release", held)
    waiting = subprocess.Popen(
        [sys.executable, "-m", "pollux_local", "wait", "--interval", "0.2", "--timeout", "90",
         "--all", "--json"],
        env=daemon.env, cwd=daemon.root, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    time.sleep(5)
    (daemon.root / "go").touch()
    stdout, stderr = waiting.communicate(timeout=120)
    done = subprocess.CompletedProcess(waiting.args, waiting.returncode, stdout, stderr)
    assert done.returncode == 1, done.stderr
    found = rows(done)
    assert set(found) == {*fine, crash, held}, found  # not the job that ended before
    assert [found[i]["state"] for i in fine] == ["succeeded", "succeeded"]
    assert found[held]["state"] == "succeeded"
    assert found[crash]["state"] == "failed" and "code 4" in found[crash]["reason"]
    assert json.loads(done.stdout)["pending"] == []

    nothing = wait(daemon, "--all")
    assert nothing.returncode == 0 and nothing.stdout.strip() == "no job to wait for"
    ok = daemon.submit("job.py", "0.5", "0")
    done = wait(daemon, "--all")
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip().startswith(f"job {ok} succeeded")


def test_wait_array_waits_for_every_task(daemon: Daemon) -> None:
    good = daemon.submit("--array", "0-1", "job.py", "0.5", "0")
    done = wait(daemon, "--array", good)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 2 and all("succeeded" in line for line in lines), lines

    bad = daemon.submit("--array", "0-3", "job.py", "0.5", "0")  # task 2 exits 3
    other = daemon.submit("job.py", "30", "0")  # not a task: not waited for
    done = wait(daemon, "--array", bad, "--json")
    assert done.returncode == 1, done.stderr
    found = rows(done)
    assert len(found) == 4 and other not in found, found
    failed = [row for row in found.values() if row["state"] == "failed"]
    assert len(failed) == 1 and "code 3" in failed[0]["reason"], found
    assert sum(row["state"] == "succeeded" for row in found.values()) == 3

    refused = wait(daemon, "--array", other)
    assert refused.returncode == 2
    [line] = refused.stderr.strip().splitlines()
    assert f"job {other} is not an array" in line, line
    refused = wait(daemon)
    assert refused.returncode == 2 and "--all" in refused.stderr
    daemon.cli("cancel", other)


def test_a_wait_that_times_out_exits_1_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--timeout`` gives up with exit 1, as the guide says and as a wait whose jobs did not
    all succeed (it was 2, a usage error's code, so a script could not tell it from a typo)."""
    monkeypatch.setattr(wait_module, "client_for", lambda args: None)
    monkeypatch.setattr(wait_module, "_targets", lambda client, args: (["5"], {}))
    monkeypatch.setattr(wait_module, "_ended", lambda client, pending, owners: [])
    assert main(["wait", "--state-dir", str(tmp_path), "--timeout", "0", "5"]) == 1
    assert capsys.readouterr().err == (
        "pollux-local: error: timed out after 0 s waiting for job(s) 5\n"
    )
