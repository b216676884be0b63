"""Exit codes as data, on a real daemon: a job's exit code (or the signal that killed it) and
each rank's, in ``show --json``, ``status --json`` and ``wait --json``; recorded after a
daemon restart too; and ``usage``'s median wait and device-hours used against held."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

import pytest

from pollux_local.cli import main
from tests.cli.test_lab import cli, cli_json
from tests.daemon.test_recovery import (
    TERMINAL,
    WAITER,
    config,
    run_file,
    show,
    start_daemon,
    state,
    submit,
)
from tests.daemon_process import DaemonFactory, DaemonProcess, wait_for

pytestmark = pytest.mark.timeout(180)

CONFIG = '[scheduler]\npolicy = "fifo"\ninterval_s = 0.5\n\n[daemon]\nbackoff_s = 0.2\n'


@pytest.fixture()
def daemon(daemon_factory: DaemonFactory) -> DaemonProcess:
    return daemon_factory(devices="cpu:2", config=CONFIG)


def waited(capsys: pytest.CaptureFixture[str], daemon: DaemonProcess, *ids: str) -> Any:
    """``wait --json IDS`` (its exit status is 1 unless all succeeded): its JSON."""
    main(["wait", "--state-dir", str(daemon.state_dir), "--json", "--timeout", "60", *ids])
    return json.loads(capsys.readouterr().out)


def test_a_job_exiting_3_carries_3_for_the_job_and_each_rank(
    capsys: pytest.CaptureFixture[str], daemon: DaemonProcess, tmp_path: Path
) -> None:
    # both ranks exit 3 themselves: each ignores the stop its supervisor sends the other
    # once one has failed, and waits for the other to be there
    script = (
        'trap "" TERM; touch "ready$RANK"; while [ ! -e ready0 ] || [ ! -e ready1 ]; do'
        " sleep 0.05; done; exit 3"
    )
    job_id = cli_json(capsys, daemon, "submit", "--gpus", "2", "--retries", "0", "--workdir",
                      str(tmp_path), "sh", "-c", script)["id"]  # fmt: skip
    node = cli_json(capsys, daemon, "nodes")["nodes"][0]["name"]
    ranks = [
        {"rank": 0, "node": node, "code": 3, "signal": None},
        {"rank": 1, "node": node, "code": 3, "signal": None},
    ]

    ended = waited(capsys, daemon, job_id)["jobs"]
    assert [(j["id"], j["state"]) for j in ended] == [(job_id, "failed")]
    assert (ended[0]["exit_code"], ended[0]["exit_signal"]) == (3, None)
    assert ended[0]["replica_exits"] == ranks
    shown = cli_json(capsys, daemon, "show", job_id)["job"]
    assert (shown["exit_code"], shown["exit_signal"], shown["replica_exits"]) == (3, None, ranks)
    listed = {j["id"]: j for j in cli_json(capsys, daemon, "status")["jobs"]}[job_id]
    assert (listed["exit_code"], listed["exit_signal"], listed["replica_exits"]) == (3, None, ranks)
    text = cli(capsys, daemon, "show", job_id)
    assert f"exit        3  (rank 0 on {node}: 3; rank 1 on {node}: 3)" in text

    fine = cli_json(capsys, daemon, "submit", "--workdir", str(tmp_path), "true")["id"]
    assert waited(capsys, daemon, fine)["jobs"][0]["exit_code"] == 0
    assert cli_json(capsys, daemon, "show", fine)["job"]["replica_exits"][0]["code"] == 0


def test_a_rank_killed_by_sigkill_records_the_signal(
    capsys: pytest.CaptureFixture[str], daemon: DaemonProcess, tmp_path: Path
) -> None:
    script = 'if [ "$RANK" = 1 ]; then kill -KILL $$; fi; exec sleep 60'
    job_id = cli_json(capsys, daemon, "submit", "--gpus", "2", "--retries", "0", "--workdir",
                      str(tmp_path), "sh", "-c", script)["id"]  # fmt: skip
    job = waited(capsys, daemon, job_id)["jobs"][0]
    assert job["state"] == "failed"
    # the job's exit is its first failing rank's: rank 1, killed by SIGKILL (9), no code
    assert (job["exit_code"], job["exit_signal"]) == (None, 9)
    by_rank = {r["rank"]: r for r in job["replica_exits"]}
    assert (by_rank[1]["code"], by_rank[1]["signal"]) == (None, 9)
    # rank 0 was stopped by its supervisor once its peer failed (SIGTERM)
    assert (by_rank[0]["code"], by_rank[0]["signal"]) == (None, 15)
    shown = cli_json(capsys, daemon, "show", job_id)["job"]
    assert shown["replica_exits"] == job["replica_exits"] and shown["exit_signal"] == 9


@pytest.mark.parametrize("ends_while_down", [False, True], ids=["adopted-running", "ended-down"])
def test_the_exit_is_recorded_after_a_daemon_restart(
    tmp_path: Path, daemon_factory: DaemonFactory, ends_while_down: bool
) -> None:
    conf = config(tmp_path)
    daemon = start_daemon(daemon_factory, tmp_path / "state", conf)
    job_id = submit(daemon, ["sh", "-c", WAITER, "waiter", str(tmp_path), "4"], tmp_path, retries=0)
    wait_for(lambda: (tmp_path / "pid").exists(), 20, "the job to run")
    wait_for(lambda: state(daemon, job_id) == "running", 20, "the daemon to record its start")
    daemon.kill()
    if ends_while_down:
        (tmp_path / "go").touch()
        wait_for(lambda: (run_file(daemon, job_id) or {}).get("state") == "ended", 10, "its end")

    daemon = start_daemon(daemon_factory, tmp_path / "state", conf)
    if not ends_while_down:
        assert state(daemon, job_id) == "running"  # adopted, still running
        (tmp_path / "go").touch()
    wait_for(lambda: state(daemon, job_id) in TERMINAL, 20, "the job to end")
    job = show(daemon, job_id)["job"]
    assert job["state"] == "failed"
    assert (job["exit_code"], job["exit_signal"]) == (4, None)
    assert [(r["rank"], r["code"], r["signal"]) for r in job["replica_exits"]] == [(0, 4, None)]


REPORTER = """
printf '{"version": 1, "job_id": "%s", "bounds": {"base_batch": 32},
 "grad_stats": {"sqr": 1.0, "var": %s}, "batch": {"local_batch": %s, "accum_steps": 1,
 "replicas": 1}}' "$POLLUX_JOB_ID" "$1" "$2" > "$POLLUX_JOB_DIR/report.tmp"
mv "$POLLUX_JOB_DIR/report.tmp" "$POLLUX_JOB_DIR/report.json"
sleep "$3"
exit "$4"
"""


def test_usage_gives_the_median_wait_and_device_hours_used_against_held(
    capsys: pytest.CaptureFixture[str], daemon: DaemonProcess, tmp_path: Path
) -> None:
    def submit_job(*argv: str) -> str:
        return str(cli_json(capsys, daemon, "submit", "--retries", "0", "--workdir",
                            str(tmp_path), *argv)["id"])  # fmt: skip

    # var 1 at base batch 32: phi = 32; a batch of 64 has E = (32 + 32) / (32 + 64) = 2/3,
    # a batch of 32 (the base) E = 1; a plain script reports nothing (held, not measured)
    measured = submit_job("--gpus", "2", "sh", "-c", REPORTER, "r", "1.0", "64", "1.5", "0")
    base = submit_job("sh", "-c", REPORTER, "r", "1.0", "32", "1", "3")
    plain = submit_job("sleep", "1")
    ids = [measured, base, plain]
    jobs = {j["id"]: j for j in waited(capsys, daemon, *ids)["jobs"]}
    assert [jobs[i]["state"] for i in ids] == ["succeeded", "failed", "succeeded"]

    shown = {i: cli_json(capsys, daemon, "show", i)["job"] for i in ids}
    devices = {measured: 2, base: 1, plain: 1}
    held = {i: shown[i]["run_time_s"] * devices[i] / 3600 for i in ids}
    waits = [shown[i]["start_time"] - shown[i]["submit_time"] for i in ids]
    assert all(wait >= 0 for wait in waits) and all(held[i] > 0 for i in ids)

    usage = cli_json(capsys, daemon, "usage")
    assert len(usage["users"]) == 1
    me = usage["users"][0]
    assert me["jobs"] == 3 and (me["succeeded"], me["failed"], me["cancelled"]) == (2, 1, 0)
    assert me["device_hours"] == pytest.approx(sum(held.values()), rel=1e-6)
    assert me["median_wait_s"] == pytest.approx(statistics.median(waits), abs=1e-6)
    assert me["measured_device_hours"] == pytest.approx(held[measured] + held[base], rel=1e-6)
    assert me["used_device_hours"] == pytest.approx(held[measured] * 2 / 3 + held[base], rel=1e-6)
    assert usage["total"]["used_device_hours"] == pytest.approx(me["used_device_hours"])

    table = cli(capsys, daemon, "usage").splitlines()
    assert table[1].split()[:8] == ["USER", "DEVICE-HOURS", "cpu", "h", "USED", "h", "MEDIAN",
                                    "WAIT"]  # fmt: skip
    row = table[2].split()
    used = f"{me['used_device_hours']:.2f}"
    assert row[3:6] == [used, "of", f"{me['measured_device_hours']:.2f}"]


def test_usage_says_dash_when_no_job_reported(
    capsys: pytest.CaptureFixture[str], daemon: DaemonProcess, tmp_path: Path
) -> None:
    job_id = cli_json(capsys, daemon, "submit", "--workdir", str(tmp_path), "true")["id"]
    waited(capsys, daemon, job_id)
    me = cli_json(capsys, daemon, "usage")["users"][0]
    assert me["used_device_hours"] is None and me["measured_device_hours"] == 0
    assert cli(capsys, daemon, "usage").splitlines()[2].split()[3] == "-"
