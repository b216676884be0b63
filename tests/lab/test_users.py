"""Per-user limits with real Unix users: one user at the cap waits while another user's jobs
still start (``[limits] max_devices_per_user``, ``max_running_per_user``).

As on a lab machine: the daemon runs as root from the lab install; two users made for this
module (removed at the end) submit through that install's ``pollux-local``."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.labinstall import (
    LabDaemon,
    LabInstall,
    LabUser,
    two_users,
    wait_until,
    world_readable_tempdir,
)

pytestmark = [pytest.mark.timeout(120)]


@pytest.fixture(scope="module")
def pair(lab_install: LabInstall) -> Iterator[tuple[LabUser, LabUser]]:
    with two_users(lab_install, "pxcap", "pxfree") as made:
        yield made


@pytest.fixture()
def base() -> Iterator[Path]:
    path = world_readable_tempdir("pollux-limits-")
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def start(lab_install: LabInstall, base: Path, limits: str) -> LabDaemon:
    config = base / "config.toml"
    config.write_text(
        '[scheduler]\npolicy = "fifo"\ninterval_s = 0.3\n\n[daemon]\nstop_grace_s = 2\n\n'
        f"[limits]\n{limits}\n"
    )
    config.chmod(0o644)
    return LabDaemon(
        lab_install, base / "state", "--config", str(config), "--devices", "cpu:4"
    ).start()


def submit(user: LabUser, daemon: LabDaemon, base: Path, *args: str) -> str:
    done = user.cli(
        "submit", "--state-dir", str(daemon.state_dir), "--json", "--workdir", str(base), *args
    )
    assert done.returncode == 0, done.stderr
    return str(json.loads(done.stdout)["id"])


def job(daemon: LabDaemon, job_id: str) -> dict[str, object]:
    return dict(daemon.client.request("show", id=job_id)["job"])


@pytest.mark.parametrize(
    ("limits", "words"),
    [
        ("max_devices_per_user = 2", "max_devices_per_user"),
        ("max_running_per_user = 2", "max_running_per_user"),
    ],
)
def test_a_user_at_the_cap_waits_while_another_users_jobs_start(
    lab_install: LabInstall,
    pair: tuple[LabUser, LabUser],
    base: Path,
    limits: str,
    words: str,
) -> None:
    capped, other = pair
    daemon = start(lab_install, base, limits)
    try:
        sleeper = base / "sleep.sh"
        sleeper.write_text("#!/bin/sh\nsleep 6\n")
        sleeper.chmod(0o755)
        mine = [submit(capped, daemon, base, str(sleeper)) for _ in range(3)]
        theirs = submit(other, daemon, base, str(sleeper))

        def settled() -> list[dict[str, object]] | None:
            jobs = [job(daemon, job_id) for job_id in [*mine, theirs]]
            running = [j for j in jobs if j["state"] == "running"]
            return jobs if len(running) == 3 else None

        jobs = wait_until(settled, 30, "three jobs running")
        assert jobs is not None
        states = {str(j["id"]): j["state"] for j in jobs}
        assert states[theirs] == "running"  # the other user's job started beside the cap
        assert sorted(states[j] for j in mine) == ["queued", "running", "running"]
        (waiting,) = [j for j in jobs if j["state"] == "queued"]
        assert words in str(waiting["reason"]) and capped.name in str(waiting["reason"])
        # a free device stays free rather than go past the cap
        nodes = daemon.client.request("nodes")["nodes"]
        assert len(nodes[0]["jobs"]) == 3
        # once one of the capped user's jobs ends, the waiting one starts
        wait_until(lambda: job(daemon, str(waiting["id"]))["state"] == "running", 30, "the third")
    finally:
        daemon.stop()


def test_another_user_cannot_edit_restart_cancel_an_array_or_drain(
    lab_install: LabInstall, pair: tuple[LabUser, LabUser], base: Path
) -> None:
    owner, other = pair
    daemon = start(lab_install, base, "max_priority = 0")
    try:
        quick = base / "quick.sh"
        quick.write_text("#!/bin/sh\nexit 0\n")
        quick.chmod(0o755)
        held = submit(owner, daemon, base, "--hold", str(quick))
        ran = submit(owner, daemon, base, str(quick))
        tasks = submit(owner, daemon, base, "--hold", "--array", "0-1", str(quick))
        wait_until(lambda: job(daemon, ran)["state"] == "succeeded", 30, "the job to end")
        state = ["--state-dir", str(daemon.state_dir)]
        attempts = {
            "edit": other.cli("edit", held, "--priority", "-1", *state),
            "edit command": other.cli("edit", held, *state, "--", "/bin/sh", "-c", "id"),
            "restart": other.cli("restart", ran, *state),
            "cancel --array": other.cli("cancel", "--array", tasks, *state),
            "drain": other.cli("drain", "cpu:0", *state),
        }
        for what, done in attempts.items():
            assert done.returncode != 0, what
            assert "permission denied" in done.stderr, (what, done.stderr)
            assert len(done.stderr.strip().splitlines()) == 1, (what, done.stderr)
        # nothing changed: the held job keeps its command and priority, no copy was made, the
        # array is still held and no device is drained
        shown = job(daemon, held)
        assert shown["argv"] == [str(quick)] and shown["priority"] == 0
        assert len(daemon.client.request("status")["jobs"]) == 4
        assert job(daemon, tasks)["state"] == "held"
        assert daemon.client.request("nodes")["nodes"][0]["withheld"] == []
        # the owner may
        done = owner.cli("edit", held, "--priority", "-1", *state)
        assert done.returncode == 0, done.stderr
        assert job(daemon, held)["priority"] == -1
    finally:
        daemon.stop()
