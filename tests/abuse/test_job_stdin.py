"""A ``--stdin`` job's input FIFO (``JOB_DIR/stdin``) with two real users and a root daemon:
only the job's user and root may write to it, and root's ``send`` writes to nothing but a FIFO
of the job's owner, whatever the owner puts at that name (a link to a root-only file, a file,
another FIFO)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.abuse.lab import Lab, cli, file_facts, submit, wait_state
from tests.labinstall import LabDaemon, LabUser, one_line, wait_until

pytestmark = [pytest.mark.timeout(120)]

READER = 'while IFS= read -r line; do echo "got: $line"; done'


def fifo_of(daemon: LabDaemon, job_id: str) -> Path:
    path = daemon.state_dir / "jobs" / job_id / "stdin"
    wait_until(path.is_fifo, 30, f"job {job_id}'s input FIFO")
    return path


def root_send(
    lab: Lab, daemon: LabDaemon, job_id: str, text: str
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(lab.install.cli), "send", "--state-dir", str(daemon.state_dir), job_id, text],
        capture_output=True, text=True, timeout=60, cwd="/",
    )  # fmt: skip


def test_another_user_cannot_reach_a_jobs_input_and_roots_send_writes_only_the_owners_fifo(
    lab: Lab, alice: LabUser, bob: LabUser
) -> None:
    daemon = lab.daemon(devices="cpu:2")
    ajob = submit(alice, daemon, lab, "--stdin", "--name", "reads", "/bin/sh", "-c", READER)
    wait_state(daemon, ajob, ("running",), 30)
    fifo = fifo_of(daemon, ajob)
    info = fifo.lstat()
    assert (info.st_uid, info.st_mode & 0o777) == (alice.uid, 0o600)
    log = daemon.state_dir / "jobs" / ajob / "rank0.log"

    # bob: refused by send, and by the kernel when he opens the FIFO himself
    refused = cli(bob, daemon, "send", ajob, "FROM-BOB")
    assert refused.returncode != 0
    assert "only they (or root) may send it input" in one_line(refused.stderr)
    opened = bob.python(
        "import os, sys\ntry:\n    os.open(sys.argv[1], os.O_WRONLY | os.O_NONBLOCK)\n"
        "except OSError as exc:\n    print(exc.errno)\nelse:\n    print('opened')",
        str(fifo),
    )
    assert opened.stdout.strip() == "13", opened  # EACCES: the job's directory is alice's
    # alice and root reach it
    assert cli(alice, daemon, "send", ajob, "FROM-ALICE").returncode == 0
    sent = root_send(lab, daemon, ajob, "FROM-ROOT")
    assert sent.returncode == 0, sent.stderr
    wait_until(lambda: "got: FROM-ROOT" in log.read_text(), 20, "root's line in alice's log")
    assert "got: FROM-ALICE" in log.read_text() and "FROM-BOB" not in log.read_text()

    # bob's own job: whatever he puts at its FIFO's name, root's send opens no file, and
    # writes to no FIFO but one of bob's that is read
    bjob = submit(bob, daemon, lab, "--stdin", "--name", "plants", "/bin/sh", "-c", "sleep 120")
    wait_state(daemon, bjob, ("running",), 30)
    bfifo = fifo_of(daemon, bjob)
    secret = lab.secret_file("shadow", "ROOT-ONLY\n")
    before = file_facts(secret)
    plants = {
        "symlink": (f"ln -s {secret} {bfifo}", "it is a symlink"),
        "file": (f"echo keep > {bfifo}", "it is not a FIFO"),
        "directory": (f"mkdir {bfifo}", "it is not a FIFO"),
        "unread FIFO": (f"mkfifo -m 666 {bfifo}", "is not reading its input now"),
    }
    for what, (plant, said) in plants.items():
        done = bob.run("/bin/sh", "-c", f"rm -rf {bfifo} && {plant}")
        assert done.returncode == 0, done.stderr
        sent = root_send(lab, daemon, bjob, "FROM-ROOT")
        assert sent.returncode != 0, what
        assert said in one_line(sent.stderr), (what, sent.stderr)
        assert file_facts(secret) == before
    assert (bfifo.parent / "stdin").lstat().st_uid == bob.uid
    cli(alice, daemon, "cancel", ajob)
    cli(bob, daemon, "cancel", bjob)
