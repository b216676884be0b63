"""Stopping jobs and relaunches, with two real Unix users against a real root daemon.

* a: a plain script that always exits 75 (the rescale code) asks to be relaunched at once, for
  ever: it is a crash like any other (the back-off, ``max_retries``), and the job ends failed
  with one line saying why;
* b: with ``[limits] max_devices_per_user = 1``, a cancelled job that ignores SIGTERM keeps
  its device for the stop grace: its owner's next job waits until its processes are gone,
  ``nodes`` shows the device held by the stopping job meanwhile (to both users, text and
  ``--json``), and the other user's job still starts on the other device (the cap is per
  user).
"""

from __future__ import annotations

import json
import time

import pytest

from tests.abuse.lab import Lab, cli, decisions, is_alive, job, submit, wait_state
from tests.labinstall import LabDaemon, LabUser, wait_until

pytestmark = [pytest.mark.timeout(240)]


def devices_of(daemon: LabDaemon, job_id: str) -> list[str]:
    return [d for ds in job(daemon, job_id)["devices"].values() for d in ds]


def test_a_script_always_exiting_75_is_retried_with_back_off_then_fails(
    lab: Lab, alice: LabUser
) -> None:
    runs = lab.work / "a-runs"
    script = lab.script("always75.sh", f"date +%s.%N >> {runs}\nexit 75\n")
    daemon = lab.daemon(max_retries=2, backoff_s=1)
    job_id = submit(alice, daemon, lab, "--name", "loop75", "--retries", "2", str(script))
    ended = wait_state(daemon, job_id, ("failed", "succeeded", "cancelled"), 90)
    time.sleep(2)  # a relaunch the daemon should not make would show here
    starts = [float(line) for line in runs.read_text().split()]
    assert len(starts) == 3, f"ran {len(starts)} times; max_retries = 2 allows 3"
    assert ended["state"] == "failed"
    reason = ended["reason"]
    assert "\n" not in reason
    assert reason.startswith("exited 75 (the rescale code) but no rescale was asked"), reason
    assert "gave up after 2 restart(s)" in reason
    # the back-off: 1 s, then 2 s (backoff_s * 2^(failures - 1))
    gaps = [later - earlier for earlier, later in zip(starts, starts[1:], strict=False)]
    assert gaps[0] >= 1.0 and gaps[1] >= 2.0, gaps
    assert decisions(daemon, job_id).count("crashed") == 2


def test_b_a_cancelled_job_holds_its_device_until_its_processes_are_gone(
    lab: Lab, alice: LabUser, bob: LabUser
) -> None:
    pidfile = lab.work / "b-stubborn"
    stubborn = lab.script("stubborn.sh", f"trap '' TERM\necho $$ > {pidfile}\nsleep 600\n")
    sleeper = lab.script("sleeper.sh", "exec sleep 600\n")
    daemon = lab.daemon(
        devices="cpu:2", extra_toml="[limits]\nmax_devices_per_user = 1\n", stop_grace_s=10
    )
    first = submit(alice, daemon, lab, "--name", "stubborn", str(stubborn))
    wait_state(daemon, first, ("running",), 30)
    wait_until(lambda: pidfile.exists() and pidfile.read_text().strip(), 20, "the job's pid")
    pid = int(pidfile.read_text())
    (device,) = devices_of(daemon, first)
    second = submit(alice, daemon, lab, "--name", "next", str(sleeper))
    time.sleep(1.5)  # a few passes: alice is at her cap
    assert job(daemon, second)["state"] == "queued"

    cancelled = cli(alice, daemon, "cancel", first)
    assert cancelled.returncode == 0, cancelled.stderr
    assert job(daemon, first)["state"] == "cancelled"
    assert is_alive(pid)
    bobs = submit(bob, daemon, lab, "--name", "bobs", str(sleeper))
    wait_state(daemon, bobs, ("running",), 8)  # the other device, while alice's job stops
    assert is_alive(pid) and devices_of(daemon, bobs) != [device]

    shown = 0
    while is_alive(pid):
        state = job(daemon, second)
        assert state["state"] == "queued", (
            f"alice's next job started ({state['reason']}) while her cancelled job's processes"
            " still hold its device"
        )
        if shown < 1:
            for user in (alice, bob):
                text = cli(user, daemon, "nodes")
                assert text.returncode == 0, text.stderr
                assert f"{device}→job {first}" in text.stdout, text.stdout
                assert "stopping" in text.stdout and "processes are gone" in text.stdout
                raw = cli(user, daemon, "nodes", "--json")
                assert raw.returncode == 0, raw.stderr
                (row,) = json.loads(raw.stdout)["nodes"]
                assert row["jobs"].get(device) == first and row["stopping"] == [device], row
            shown += 1
        time.sleep(0.3)
    assert shown, "the cancelled job's processes were gone before they could be looked at"
    wait_state(daemon, second, ("running",), 30)
    assert devices_of(daemon, second) == [device] and not is_alive(pid)
    rows = json.loads(cli(bob, daemon, "nodes", "--json").stdout)["nodes"]
    assert rows[0]["stopping"] == [] and first not in rows[0]["jobs"].values()
