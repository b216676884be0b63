"""Files in a job's directory that the job did not write: the root daemon reads (``logs``, a
failure's last line) and writes (an SSH job's local log) only files of the user the job runs as.

* A root-only 0600 file that the job's owner moves into the job's directory (a file root left
  in the owner's home, say) is not shown by ``logs``, to its owner or anyone.
* The local log of a rank on an SSH node is created by the daemon and given to the job's user;
  an existing file of another owner in its place (root's) is never appended to, and the log is
  cut at ``[limits] max_log_size`` with one note, as a local replica's log is.
"""

from __future__ import annotations

import asyncio
import os
import secrets
from pathlib import Path

import pytest

from pollux_local.launch.base import LaunchSpec, ReplicaSlot
from pollux_local.launch.logcap import truncation_note
from pollux_local.launch.ssh import SshReplicaGroup
from tests.abuse.lab import TERMINAL, Lab, cli, submit, wait_state
from tests.labinstall import LabUser, one_line, wait_until

pytestmark = [pytest.mark.timeout(90)]


def test_logs_refuses_a_root_only_file_moved_into_the_job_directory(
    lab: Lab, alice: LabUser, bob: LabUser
) -> None:
    daemon = lab.daemon()
    job_id = submit(alice, daemon, lab, "--name", "mover", "/bin/sh", "-c", "echo hello")
    wait_state(daemon, job_id, TERMINAL, 30)
    log = daemon.state_dir / "jobs" / job_id / "rank0.log"
    assert "hello" in cli(alice, daemon, "logs", job_id).stdout

    # root leaves a 0600 file in alice's home; alice, who owns the home, may rename it
    secret = "ROOTONLY-" + secrets.token_hex(8)
    left = alice.home / "root-left-this"
    left.write_text(secret + "\n")
    left.chmod(0o600)
    assert left.stat().st_uid == 0
    moved = alice.run("mv", "-f", str(left), str(log))
    assert moved.returncode == 0, moved.stderr
    assert log.stat().st_uid == 0 and log.read_text().startswith(secret)

    for user in (alice, bob):
        done = cli(user, daemon, "logs", job_id)
        assert secret not in done.stdout + done.stderr, "a root-only file was shown"
        assert done.returncode != 0, f"logs of a root-owned file was not refused: {done.stdout!r}"
        line = one_line(done.stderr)
        assert "belongs to uid 0" in line and "rank 0 log" in line, line
    # root's own request is refused the same way: the daemon reads only the job's files
    with pytest.raises(Exception, match="belongs to uid 0") as refused:
        daemon.client.request("logs", id=job_id)
    assert secret not in str(refused.value)


def _ssh_group(log_dir: Path, uid: int, max_log_bytes: int | None = None) -> SshReplicaGroup:
    spec = LaunchSpec(
        job_id="7",
        argv=["/bin/true"],
        workdir=log_dir,
        env={},
        slots=[ReplicaSlot(rank=0, node="n1", device="cpu:0", local_rank=0, node_rank=0)],
        log_dir=log_dir,
        run_as="someone",
        run_as_uid=uid,
    )
    return SshReplicaGroup(spec, [], {0: log_dir / "rank0.log"}, 1.0, max_log_bytes)


def test_an_ssh_ranks_local_log_is_the_jobs_users_and_never_root_file(
    lab: Lab, alice: LabUser
) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root: the daemon writes the log of another user's job")
    job_dir = lab.base / "ssh-job"
    job_dir.mkdir()
    os.chown(job_dir, alice.uid, alice.gid)

    async def write(data: bytes) -> None:
        _ssh_group(job_dir, alice.uid)._append_log("n1", 0, data)

    asyncio.run(write(b"first line\n"))
    log = job_dir / "rank0.log"
    info = log.stat()
    assert (info.st_uid, info.st_gid) == (alice.uid, alice.gid), "the log is not the job user's"
    assert log.read_bytes() == b"first line\n"

    # a root-owned file put in its place is left alone, not appended to
    log.unlink()
    log.write_text("root's\n")
    os.chown(log, 0, 0)
    asyncio.run(write(b"more output\n"))
    assert log.read_text() == "root's\n"


def test_an_ssh_ranks_local_log_is_cut_at_the_log_limit(lab: Lab, alice: LabUser) -> None:
    # the daemon itself writes a remote rank's output into the state disk: the same
    # [limits] max_log_size holds there as for a local replica's log
    job_dir = lab.base / "ssh-capped"
    job_dir.mkdir()
    os.chown(job_dir, alice.uid, alice.gid)

    async def flood() -> None:
        group = _ssh_group(job_dir, alice.uid, max_log_bytes=1000)
        for _ in range(50):
            group._append_log("n1", 0, b"x" * 99 + b"\n")

    asyncio.run(flood())
    data = (job_dir / "rank0.log").read_bytes()
    assert data.startswith(b"x" * 99 + b"\n")
    assert data.endswith(truncation_note(1000)), data[-120:]
    assert len(data) == 1000 + len(truncation_note(1000))


def test_a_removed_jobs_directory_goes_as_its_owner(lab: Lab, alice: LabUser) -> None:
    """Ended jobs beyond ``[limits] max_ended_per_user`` lose their record and then their
    directory: what is in it is removed as the job's owner, never as root.  A link alice left
    there to a root-only file removes the link, not the file; a directory of root's that she
    could not empty stays, with a line in the daemon's log; the kept job's directory stays."""
    daemon = lab.daemon(extra_toml="[limits]\nmax_ended_per_user = 1\n")
    secret = lab.secret_file("kept-secret", "ROOT")
    script = (
        f'ln -s {secret} "$POLLUX_JOB_DIR/link";'
        ' mkdir "$POLLUX_JOB_DIR/d" && echo x > "$POLLUX_JOB_DIR/d/f"'
    )
    ids = [submit(alice, daemon, lab, "--name", f"j{i}", "/bin/sh", "-c", script) for i in range(3)]
    for job_id in ids:
        wait_state(daemon, job_id, TERMINAL, 30)
    jobs_dir = daemon.state_dir / "jobs"
    assert all((jobs_dir / i / "link").is_symlink() for i in ids)
    rooted = jobs_dir / ids[1] / "roots"
    rooted.mkdir(mode=0o755)
    (rooted / "keep").write_text("root's")  # root's, in a directory alice cannot write
    daemon.stop()
    daemon.start()  # its first pass prunes the two oldest, then their directories go

    def gone() -> bool:
        return not (jobs_dir / ids[0]).exists() and not (jobs_dir / ids[1] / "d").exists()

    wait_until(gone, 30, "the removed jobs' directories to go")
    assert (rooted / "keep").read_text() == "root's"  # removed as alice: not root's file
    assert sorted(p.name for p in (jobs_dir / ids[1]).iterdir()) == ["roots"]
    assert secret.read_text() == "ROOT"  # the link went, not what it named
    assert (jobs_dir / ids[2] / "link").is_symlink()  # the kept job's directory is untouched
    wait_until(lambda: f"removed job {ids[1]}'s directory" in daemon.output(), 10, "the line")
