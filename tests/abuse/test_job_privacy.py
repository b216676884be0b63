"""What a job writes is as private as its submitter made it: the job's processes get the
umask of the shell that submitted it (not the root daemon's 0022), and the job's directory
(its logs and, by default, its checkpoints) is its user's alone; other users see the logs
through the daemon.  Before, ``jobs/ID`` was 0755 and every checkpoint 0644 under it: any
user could copy another's weights."""

from __future__ import annotations

import json

import pytest

from tests.abuse.lab import TERMINAL, Lab, cli, wait_state
from tests.labinstall import LabUser

pytestmark = [pytest.mark.timeout(120)]

#: the job: say its umask, write a checkpoint where the job library would
JOB = 'umask; echo weights > "$POLLUX_CHECKPOINT_DIR/model.pt"'


def submit_with_umask(user: LabUser, lab: Lab, daemon_dir: str, mask: str) -> str:
    done = user.run(
        "/bin/sh", "-c", f'umask {mask}; exec "$@"', "sh", user.lab.cli, "submit", "--json",
        "--state-dir", daemon_dir, "--workdir", str(lab.work), "/bin/sh", "-c", JOB,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return str(json.loads(done.stdout)["id"])


def test_a_job_gets_its_submitters_umask_and_its_directory_is_private(
    lab: Lab, alice: LabUser, bob: LabUser
) -> None:
    daemon = lab.daemon()
    private = submit_with_umask(alice, lab, str(daemon.state_dir), "077")
    assert wait_state(daemon, private, TERMINAL, 60)["state"] == "succeeded"
    job_dir = daemon.state_dir / "jobs" / private
    info = job_dir.stat()
    assert (info.st_uid, info.st_mode & 0o777) == (alice.uid, 0o700), oct(info.st_mode)
    checkpoint = job_dir / "checkpoint" / "model.pt"
    assert checkpoint.read_text() == "weights\n"
    assert checkpoint.stat().st_mode & 0o077 == 0, oct(checkpoint.stat().st_mode)
    stolen = bob.run("cat", str(checkpoint))
    assert stolen.returncode != 0 and "weights" not in stolen.stdout
    assert "0077" in cli(alice, daemon, "logs", private).stdout
    # bob still reads the log through the daemon (a shared machine is transparent)
    assert "0077" in cli(bob, daemon, "logs", private).stdout

    # the submitter's umask, whatever it is: not one fixed value
    shared = submit_with_umask(alice, lab, str(daemon.state_dir), "027")
    assert wait_state(daemon, shared, TERMINAL, 60)["state"] == "succeeded"
    assert "0027" in cli(alice, daemon, "logs", shared).stdout
    made = daemon.state_dir / "jobs" / shared / "checkpoint" / "model.pt"
    assert made.stat().st_mode & 0o777 == 0o640, oct(made.stat().st_mode)
