"""A lab member's daemon in her own allocation, as a lab runs it on a cluster: not root, the
allocation's owner, serving her group (``allow_group``).  Another member's job runs as job
steps of her allocation, as her (Slurm starts a step's tasks as the allocation's owner), and
the member sees it as hers.  Real Unix users and the lab install (``tests/labinstall.py``)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
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
from tests.paths import job_checkpoint_dir

from .conftest import SlurmAllocation

pytestmark = pytest.mark.timeout(180)


@pytest.fixture()
def members(
    lab_install: LabInstall, slurm_bed: dict[str, object]
) -> Iterator[tuple[LabUser, LabUser]]:
    """Two users; the second in the first's group (the group her daemon serves)."""
    with two_users(lab_install, "pxsla", "pxslb") as (alice, bob):
        subprocess.run(["usermod", "-aG", alice.name, bob.name], check=True, timeout=30)
        yield alice, bob


@pytest.fixture()
def base() -> Iterator[Path]:
    """A scratch folder every user can reach (the pytest one is root's only)."""
    path = world_readable_tempdir("pollux-slurm-")
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def test_a_members_job_runs_in_her_allocation_as_her(
    lab_install: LabInstall, members: tuple[LabUser, LabUser], base: Path
) -> None:
    alice, bob = members
    home = base / "alice"
    home.mkdir(mode=0o755)
    os.chown(home, alice.uid, alice.gid)
    work = base / "work"
    work.mkdir(mode=0o1777)
    os.chmod(work, 0o1777)
    config = base / "pollux.toml"
    config.write_text(
        f'[scheduler]\npolicy = "fifo"\ninterval_s = 1\n[daemon]\nallow_group = "{alice.name}"\n'
        f'checkpoint_root = "{home / "ckpt"}"\nbackoff_s = 0.5\nstop_grace_s = 5\n'
    )
    config.chmod(0o644)
    made = alice.run(
        "salloc", "--no-shell", "-N2", "--ntasks-per-node=1", "--gres=gpu:testgpu:1",
        "--no-kill", "--job-name=pollux-tests", "--immediate=20", timeout_s=40,
    )  # fmt: skip
    match = re.search(r"Granted job allocation (\d+)", made.stderr)
    assert made.returncode == 0 and match, made.stderr
    slurm_job = match.group(1)
    daemon: LabDaemon | None = None
    try:
        owner = subprocess.run(
            ["squeue", "-h", "-j", slurm_job, "-o", "%u %N"],
            capture_output=True, text=True, timeout=20,
        ).stdout.split()  # fmt: skip
        assert owner[0] == alice.name
        state = home / "state"
        daemon = LabDaemon(
            lab_install, state, user=alice,
            argv=["env", f"SLURM_JOB_ID={slurm_job}", f"SLURM_JOB_NODELIST={owner[1]}",
                  str(lab_install.cli), "daemon", "--state-dir", str(state),
                  "--config", str(config)],
        ).start(timeout_s=60)  # fmt: skip
        submitted = bob.cli(
            "submit", "--state-dir", str(state), "--json", "--workdir", str(work), "--gpus", "2",
            "--", "/bin/sh", "-c",
            'echo "$(id -un) $(hostname) $SLURM_JOB_ID" > "$POLLUX_CHECKPOINT_DIR/rank-$RANK"',
        )  # fmt: skip
        assert submitted.returncode == 0, submitted.stderr
        job_id = str(json.loads(submitted.stdout)["id"])

        def final() -> dict[str, object] | None:
            assert daemon is not None
            shown = dict(daemon.client.request("show", id=job_id)["job"])
            return shown if shown["state"] in ("succeeded", "failed", "cancelled") else None

        shown = wait_until(final, 90, "the member's job to end")
        assert shown is not None and shown["state"] == "succeeded", (shown, daemon.output())
        assert shown["owner"] == bob.name
        ckpt = job_checkpoint_dir(home / "ckpt", state, job_id)
        lines = [(ckpt / f"rank-{rank}").read_text().split() for rank in (0, 1)]
        nodes = subprocess.run(
            ["scontrol", "show", "hostnames", owner[1]], capture_output=True, text=True,
            timeout=20,
        ).stdout.split()  # fmt: skip
        # both ranks ran as the allocation's owner, one per node, in her allocation
        assert lines == [[alice.name, nodes[0], slurm_job], [alice.name, nodes[1], slurm_job]]
        # the member sees her job as hers
        listed = bob.cli("status", "--state-dir", str(state), "--json")
        assert listed.returncode == 0 and job_id in listed.stdout, listed.stderr
    finally:
        if daemon is not None:
            daemon.stop()
        subprocess.run(["scancel", slurm_job], capture_output=True, timeout=20)


def test_a_root_daemon_in_an_allocation_refuses_to_run_a_users_job_as_root(
    lab_install: LabInstall,
    members: tuple[LabUser, LabUser],
    base: Path,
    allocation: SlurmAllocation,
) -> None:
    """Slurm would start the steps of root's allocation as root: a user's job fails at its
    start with one line saying so, and nothing of it runs."""
    _, bob = members
    work = base / "work"
    work.mkdir(mode=0o1777)
    os.chmod(work, 0o1777)
    state = base / "root-state"
    config = base / "root.toml"
    config.write_text('[scheduler]\npolicy = "fifo"\ninterval_s = 1\n')
    config.chmod(0o644)
    daemon = LabDaemon(
        lab_install, state,
        argv=["env", *(f"{k}={v}" for k, v in allocation.environ().items()),
              str(lab_install.cli), "daemon", "--state-dir", str(state), "--config", str(config)],
    ).start(timeout_s=60)  # fmt: skip
    try:
        marker = work / "ran"
        submitted = bob.cli(
            "submit", "--state-dir", str(state), "--json", "--workdir", str(work),
            "--", "/bin/touch", str(marker),
        )  # fmt: skip
        assert submitted.returncode == 0, submitted.stderr
        job_id = str(json.loads(submitted.stdout)["id"])

        def final() -> dict[str, object] | None:
            shown = dict(daemon.client.request("show", id=job_id)["job"])
            return shown if shown["state"] in ("succeeded", "failed") else None

        shown = wait_until(final, 60, "the job to end")
        assert shown is not None and shown["state"] == "failed", shown
        assert "will not run" in str(shown["reason"]) and bob.name in str(shown["reason"])
        assert not marker.exists()
    finally:
        daemon.stop()
