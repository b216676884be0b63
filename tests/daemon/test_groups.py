"""Groups on a real daemon: an admin's group (``[groups.NAME]``) caps its jobs, a pause holds
its queued jobs back (running ones go on) and outlives a restart, ``SIGHUP`` changes its caps,
a user's own group is made, capped, refused deletion while a job is in it and deleted;
``status --group`` and ``show`` read the group; a job naming a group it may not use is refused
on every path (submit, release, restart); the config's ``[groups]`` keys are checked.

The tests run the CLI as the user running them, who owns the daemon (an admin to it); the
two-user rules (who may pause, join or change which group) are ``tests/abuse/test_groups.py``'s.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from pollux_local.daemon.config import load_config
from pollux_local.errors import PolluxError
from tests.daemon.test_operations import cli, reload
from tests.daemon_process import DaemonFactory, DaemonProcess, wait_for
from tests.paths import REPO_ROOT

pytestmark = pytest.mark.timeout(180)

CONFIG = """[scheduler]
policy = "fifo"
interval_s = 0.3

[daemon]
stop_grace_s = 2

[groups.gpu]
max_running = {running}
"""


def with_state_dir(daemon: DaemonProcess, args: tuple[str, ...]) -> list[str]:
    """``ARGS`` with ``--state-dir DIR`` after the command (``group``: its sub-command)."""
    at = 2 if args[0] == "group" else 1
    return [*args[:at], "--state-dir", str(daemon.state_dir), *args[at:]]


def run(daemon: DaemonProcess, *args: str) -> subprocess.CompletedProcess[str]:
    """``pollux-local ARGS`` on ``daemon``, which must succeed."""
    done = cli(*with_state_dir(daemon, args))
    assert done.returncode == 0, done.stderr
    return done


def refused(daemon: DaemonProcess, *args: str) -> str:
    """The one line a refused command printed."""
    done = cli(*with_state_dir(daemon, args))
    assert done.returncode != 0, done.stdout
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    return lines[0]


def submit(daemon: DaemonProcess, tmp_path: Path, *args: str) -> str:
    done = run(daemon, "submit", "--json", "--workdir", str(tmp_path), *args)
    return str(json.loads(done.stdout)["id"])


def job(daemon: DaemonProcess, job_id: str) -> dict[str, Any]:
    return dict(daemon.client.request("show", id=job_id)["job"])


def wait_state(daemon: DaemonProcess, job_id: str, *states: str) -> dict[str, Any]:
    return dict(
        wait_for(
            lambda: (found := job(daemon, job_id))["state"] in states and found,
            60,
            f"job {job_id} to be {'/'.join(states)}",
        )
    )


def wait_reason(daemon: DaemonProcess, job_id: str, reason: str) -> None:
    wait_for(lambda: job(daemon, job_id)["reason"] == reason, 30, f"job {job_id}: {reason!r}")


def groups(daemon: DaemonProcess) -> dict[str, dict[str, Any]]:
    listed = json.loads(run(daemon, "group", "list", "--json").stdout)["groups"]
    return {group["name"]: group for group in listed}


def test_an_admins_group_caps_its_jobs_and_status_and_show_read_it(
    daemon_factory: DaemonFactory, tmp_path: Path
) -> None:
    daemon = daemon_factory(devices="cpu:3", config=CONFIG.format(running=1))
    first = submit(daemon, tmp_path, "--group", "gpu", "--", "sleep", "60")
    second = submit(daemon, tmp_path, "--group", "gpu", "--", "sleep", "60")
    outside = submit(daemon, tmp_path, "--", "sleep", "60")
    wait_state(daemon, first, "running")
    wait_state(daemon, outside, "running")
    wait_reason(daemon, second, "waiting: group gpu has 1 jobs running, its max_running is 1")
    assert job(daemon, second)["state"] == "queued"
    listed = groups(daemon)["gpu"]
    assert listed["owner"] is None and listed["max_running"] == 1
    assert (listed["running"], listed["devices"], listed["queued"]) == (1, 1, 1)
    table = run(daemon, "group", "list").stdout
    assert "gpu" in table and "(admin)" in table and "1/1" in table
    in_group = json.loads(run(daemon, "status", "--group", "gpu", "--json").stdout)["jobs"]
    assert sorted(row["id"] for row in in_group) == [first, second]
    assert all(row["group"] == "gpu" for row in in_group)
    assert "  group       gpu" in run(daemon, "show", second).stdout
    assert "  group       none" in run(daemon, "show", outside).stdout
    run(daemon, "cancel", first)
    wait_state(daemon, second, "running")  # a place in the group freed
    run(daemon, "cancel", second, outside)


def test_a_pause_holds_queued_jobs_lets_running_ones_go_on_and_outlives_a_restart(
    daemon_factory: DaemonFactory, tmp_path: Path
) -> None:
    daemon = daemon_factory(devices="cpu:2", config=CONFIG.format(running=2))
    running = submit(daemon, tmp_path, "--group", "gpu", "--", "sleep", "60")
    wait_state(daemon, running, "running")
    said = run(daemon, "group", "pause", "gpu").stdout
    assert "group gpu paused" in said and "running ones go on" in said
    queued = submit(daemon, tmp_path, "--group", "gpu", "--", "sleep", "60")
    wait_reason(daemon, queued, "waiting: group gpu is paused")
    assert job(daemon, running)["state"] == "running"  # not stopped by the pause
    assert job(daemon, queued)["expected_start"] is None  # the forecast waits for a resume
    assert groups(daemon)["gpu"]["paused"] is True

    daemon.stop()
    daemon.start()
    wait_reason(daemon, queued, "waiting: group gpu is paused")
    assert groups(daemon)["gpu"]["paused"] is True
    run(daemon, "group", "resume", "gpu")
    wait_state(daemon, queued, "running")
    assert groups(daemon)["gpu"]["paused"] is False
    run(daemon, "cancel", running, queued)


def test_sighup_changes_an_admins_groups_caps_and_they_cannot_be_set_at_run_time(
    daemon_factory: DaemonFactory, tmp_path: Path
) -> None:
    daemon = daemon_factory(devices="cpu:3", config=CONFIG.format(running=1))
    first = submit(daemon, tmp_path, "--group", "gpu", "--", "sleep", "60")
    second = submit(daemon, tmp_path, "--group", "gpu", "--", "sleep", "60")
    wait_state(daemon, first, "running")
    wait_reason(daemon, second, "waiting: group gpu has 1 jobs running, its max_running is 1")
    line = refused(daemon, "group", "set", "gpu", "--max-running", "5")
    assert "group gpu is the admin's ([groups.gpu] in" in line and "only in that file" in line
    config = daemon.state_dir.parent / f"{daemon.state_dir.name}.toml"
    config.write_text(CONFIG.format(running=2))
    (changed,) = reload(daemon, "[groups]")
    assert "max_running 1" in changed and "max_running 2" in changed
    wait_state(daemon, second, "running")
    run(daemon, "cancel", first, second)


def test_a_users_own_group_is_made_capped_kept_while_used_and_deleted(
    daemon_factory: DaemonFactory, tmp_path: Path
) -> None:
    daemon = daemon_factory(devices="cpu:3", config=CONFIG.format(running=1))
    said = run(daemon, "group", "set", "mine", "--max-devices", "1").stdout
    assert said.startswith("group mine set: max devices 1, max running none")
    mine = groups(daemon)["mine"]
    assert mine["owner"] and mine["max_devices"] == 1 and mine["max_running"] is None
    first = submit(daemon, tmp_path, "--group", "mine", "--", "sleep", "60")
    second = submit(daemon, tmp_path, "--group", "mine", "--", "sleep", "60")
    wait_state(daemon, first, "running")
    wait_reason(
        daemon,
        second,
        "waiting: group mine's jobs hold 1 devices, this job needs 1 more, its max_devices is 1",
    )
    run(daemon, "group", "set", "mine", "--max-running", "2", "--max-devices", "none")
    assert (groups(daemon)["mine"]["max_devices"], groups(daemon)["mine"]["max_running"]) == (
        None,
        2,
    )
    wait_state(daemon, second, "running")
    line = refused(daemon, "group", "delete", "mine")
    assert line.endswith("group mine has 2 job(s) queued, held or running; it may be deleted"
                         " once they end")  # fmt: skip
    run(daemon, "cancel", first, second)
    wait_state(daemon, first, "cancelled")
    wait_state(daemon, second, "cancelled")
    assert "group mine deleted" in run(daemon, "group", "delete", "mine").stdout
    assert "mine" not in groups(daemon)
    assert "no group 'mine'" in refused(daemon, "group", "pause", "mine")


def test_a_job_naming_a_group_it_may_not_use_is_refused_on_every_path(
    daemon_factory: DaemonFactory, tmp_path: Path
) -> None:
    daemon = daemon_factory(devices="cpu:2", config=CONFIG.format(running=1))
    line = refused(daemon, "submit", "--workdir", str(tmp_path), "--group", "nope", "--", "true")
    assert "no group 'nope'" in line and "may use: gpu" in line
    run(daemon, "group", "set", "mine")
    ended = submit(daemon, tmp_path, "--group", "mine", "--", "true")
    wait_state(daemon, ended, "succeeded")
    run(daemon, "group", "delete", "mine")
    # the group a job already named is gone: its restart, release or edit leaves it (it was
    # refused, and no edit can change a job's group: a held job was stuck), where a group
    # newly named that does not exist is refused
    again = run(daemon, "restart", "--json", ended)
    assert job(daemon, str(json.loads(again.stdout)["id"]))["group"] is None
    in_gpu = submit(daemon, tmp_path, "--hold", "--group", "gpu", "--", "true")
    config = daemon.state_dir.parent / f"{daemon.state_dir.name}.toml"
    config.write_text(CONFIG.format(running=1).replace("[groups.gpu]\nmax_running = 1\n", ""))
    reload(daemon, "[groups]")
    line = refused(daemon, "submit", "--workdir", str(tmp_path), "--group", "gpu", "--", "true")
    assert "no group 'gpu'" in line and "may use: none" in line
    run(daemon, "release", in_gpu)
    assert job(daemon, in_gpu)["group"] is None


def test_the_configs_groups_are_checked(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    for text, said in (
        ("[groups.gpu]\nmax_device = 2\n", "unknown key 'max_device' in [groups.gpu]"),
        ("[groups.gpu]\nmax_running = 0\n", "max_running must be between 1 and"),
        ("[groups]\ngpu = 3\n", "[groups.gpu] must be a table"),
        ('[groups."a b"]\n', "a group's name is letters, digits and _.-"),
        ("[limits]\nuser_groups = -1\n", "user_groups must be between 0 and 1000"),
    ):
        path.write_text(text)
        with pytest.raises(PolluxError, match=said.replace("[", r"\[").replace("]", r"\]")):
            load_config(path, devices="cpu:1")
    path.write_text("[limits]\nuser_groups = 0\n[groups.gpu]\nmax_devices = 2\n[groups.cpu]\n")
    config = load_config(path, devices="cpu:1")
    assert config.user_groups == 0
    assert [(g.name, g.max_devices, g.max_running) for g in config.groups] == [
        ("gpu", 2, None),
        ("cpu", None, None),
    ]


def test_wait_group_waits_for_the_groups_active_jobs_only(
    daemon_factory: DaemonFactory, tmp_path: Path
) -> None:
    daemon = daemon_factory(devices="cpu:3", config=CONFIG.format(running=2))
    # the group's jobs wait for ``go``, made once the wait has had time to list them (on a
    # loaded machine the submissions alone can outlast a job that only sleeps)
    gate = "i=0; while [ ! -e go ] && [ $i -lt 600 ]; do sleep 0.1; i=$((i+1)); done; "
    fine = submit(daemon, tmp_path, "--group", "gpu", "--", "sh", "-c", gate + "sleep 1")
    failing = submit(daemon, tmp_path, "--group", "gpu", "--", "sh", "-c", gate + "exit 4")
    outside = submit(daemon, tmp_path, "--", "sleep", "60")
    argv = with_state_dir(daemon, ("wait", "--group", "gpu", "--json", "--interval", "0.2",
                                   "--timeout", "60"))  # fmt: skip
    waiting = subprocess.Popen(
        [sys.executable, "-m", "pollux_local", *argv], stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
    )  # fmt: skip
    time.sleep(5)
    (tmp_path / "go").touch()
    stdout, stderr = waiting.communicate(timeout=90)
    done = subprocess.CompletedProcess(argv, waiting.returncode, stdout, stderr)
    assert done.returncode == 1, done.stderr  # one of them failed
    ended = {row["id"]: row for row in json.loads(done.stdout)["jobs"]}
    assert set(ended) == {fine, failing}
    assert ended[fine]["state"] == "succeeded" and ended[failing]["exit_code"] == 4
    assert job(daemon, outside)["state"] == "running"  # not waited for
    line = refused(daemon, "wait", "--group", "nope")
    assert "wait --group nope: no such group (groups: gpu)" in line
    run(daemon, "cancel", outside)
