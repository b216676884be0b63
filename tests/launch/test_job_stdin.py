"""A job's input (``submit --stdin``): rank 0's child makes or reuses the FIFO ``JOB_DIR/stdin``
as the job's user and reads it as its stdin (``supervisor.open_stdin_fifo``); anything but a
FIFO of the job's user there is refused, never used; the other ranks read ``/dev/null``."""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import os
import pwd
import stat
import time
from pathlib import Path

import pytest

from pollux_local.daemon.jobfiles import make_owned_dir
from pollux_local.errors import PolluxError
from pollux_local.launch.local import LocalLauncher
from pollux_local.launch.supervisor import STDIN_NAME, SetupFailed, open_stdin_fifo
from tests.launch.test_supervisor import lab_dir, make_spec, other_user

pytestmark = pytest.mark.timeout(60)

__all__ = ["lab_dir", "other_user"]  # fixtures, used by name

#: Rank 0 prints the two lines it reads; rank 1 says whether it read anything at all.
READER = (
    'if [ "$RANK" = 0 ]; then read a; read b; echo "got $a|$b"; '
    'else if read c; then echo "rank1 read $c"; else echo "rank1 eof"; fi; fi'
)


def send(path: Path, text: str) -> None:
    """What ``pollux-local send`` does, in short: a write that never blocks."""
    fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def wait_for_text(path: Path, text: str, timeout_s: float = 20.0) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists() and text in (found := path.read_text()):
            return found
        time.sleep(0.05)
    raise AssertionError(f"{path} never showed {text!r}")


# --- the open and its checks -----------------------------------------------------------------


def test_the_fifo_is_made_private_then_reused(tmp_path: Path) -> None:
    path = tmp_path / STDIN_NAME
    fd = open_stdin_fifo(str(path), os.geteuid())
    try:
        info = path.lstat()
        assert stat.S_ISFIFO(info.st_mode) and stat.S_IMODE(info.st_mode) == 0o600
        assert os.get_inheritable(fd) is False
        send(path, "one\n")
        assert os.read(fd, 100) == b"one\n"
    finally:
        os.close(fd)
    path.chmod(0o644)  # an earlier incarnation's, opened up meanwhile: reused, closed again
    fd = open_stdin_fifo(str(path), os.geteuid())
    try:
        assert stat.S_IMODE(path.lstat().st_mode) == 0o600
        assert os.get_blocking(fd)  # the job's reads block until something comes
    finally:
        os.close(fd)


@pytest.mark.parametrize("kind", ["symlink", "regular", "directory", "others-fifo"])
def test_anything_but_the_users_fifo_is_refused(tmp_path: Path, kind: str) -> None:
    path = tmp_path / STDIN_NAME
    precious = tmp_path / "precious"
    precious.write_text("keep me\n")
    if kind == "symlink":
        path.symlink_to(precious)
        match = "is a symlink"
    elif kind == "regular":
        path.write_text("hello\n")
        match = "is not a FIFO"
    elif kind == "directory":
        path.mkdir()
        match = "cannot open input FIFO"
    else:
        os.mkfifo(path, 0o600)
        if os.geteuid() != 0:
            pytest.skip("needs root (a FIFO of another user)")
        os.chown(path, 54321, 54321, follow_symlinks=False)
        match = "belongs to uid 54321, not the job's user"
    with pytest.raises(SetupFailed, match=match):
        open_stdin_fifo(str(path), os.geteuid())
    assert precious.read_text() == "keep me\n"
    if kind == "others-fifo":
        assert path.lstat().st_uid == 54321  # left as it was


# --- through the supervisor ------------------------------------------------------------------


@pytest.mark.asyncio
async def test_rank_0_reads_what_is_sent_and_the_others_read_dev_null(tmp_path: Path) -> None:
    job_dir = tmp_path / "job"
    spec = dataclasses.replace(
        make_spec(job_dir, ["sh", "-c", READER], tmp_path, replicas=2), stdin=True
    )
    group = await LocalLauncher(run_dir=tmp_path / "run").launch(spec)
    fifo = job_dir / STDIN_NAME
    assert stat.S_ISFIFO(fifo.lstat().st_mode)
    wait_for_text(job_dir / "rank1.log", "rank1 eof")
    send(fifo, "first\n")
    send(fifo, "second\n")
    assert await asyncio.wait_for(group.wait(), 20) == 0
    assert "got first|second" in (job_dir / "rank0.log").read_text()
    # nobody reads it now: a sender is told at once (ENXIO), nothing is queued for later
    with pytest.raises(OSError) as caught:
        send(fifo, "lost?\n")
    assert caught.value.errno == errno.ENXIO


@pytest.mark.asyncio
async def test_without_stdin_rank_0_reads_dev_null_and_no_fifo_is_made(tmp_path: Path) -> None:
    job_dir = tmp_path / "job"
    spec = make_spec(job_dir, ["sh", "-c", READER.replace('"$RANK" = 0', '"$RANK" = 9')], tmp_path)
    group = await LocalLauncher(run_dir=tmp_path / "run").launch(spec)
    assert await asyncio.wait_for(group.wait(), 20) == 0
    assert "rank1 eof" in (job_dir / "rank0.log").read_text()
    assert not (job_dir / STDIN_NAME).exists()


@pytest.mark.asyncio
async def test_a_later_incarnation_reuses_the_fifo(tmp_path: Path) -> None:
    job_dir = tmp_path / "job"
    launcher = LocalLauncher(run_dir=tmp_path / "run")
    for text in ("a", "b"):
        spec = dataclasses.replace(
            make_spec(job_dir, ["sh", "-c", 'read x; echo "read $x"'], tmp_path), stdin=True
        )
        group = await launcher.launch(spec)
        send(job_dir / STDIN_NAME, f"{text}\n")
        assert await asyncio.wait_for(group.wait(), 20) == 0
    log = (job_dir / "rank0.log").read_text()
    assert "read a" in log and "read b" in log


@pytest.mark.asyncio
async def test_a_symlink_at_the_fifos_place_fails_the_launch(tmp_path: Path) -> None:
    job_dir = tmp_path / "job"
    job_dir.mkdir()
    precious = tmp_path / "precious"
    precious.write_text("keep me\n")
    (job_dir / STDIN_NAME).symlink_to(precious)
    spec = dataclasses.replace(make_spec(job_dir, ["sh", "-c", "cat"], tmp_path), stdin=True)
    with pytest.raises(PolluxError, match="input FIFO .* is a symlink"):
        await LocalLauncher(run_dir=tmp_path / "run").launch(spec)
    assert precious.read_text() == "keep me\n"
    assert "is a symlink" in (job_dir / "rank0.log").read_text()


# --- as the job's user (root only) -------------------------------------------------------------


@pytest.mark.asyncio
async def test_the_fifo_is_the_users_and_roots_is_refused(
    other_user: pwd.struct_passwd, lab_dir: Path
) -> None:
    uid, gid = other_user.pw_uid, other_user.pw_gid
    job_dir = make_owned_dir(lab_dir / "jobs", "7", uid, gid)
    spec = dataclasses.replace(
        make_spec(job_dir, ["sh", "-c", 'read x; echo "read $x"'], Path("/tmp"), run_as_uid=uid),
        stdin=True,
    )
    launcher = LocalLauncher(run_dir=lab_dir / "run")
    group = await launcher.launch(spec)
    info = (job_dir / STDIN_NAME).lstat()
    assert (info.st_uid, info.st_gid) == (uid, gid)
    assert stat.S_ISFIFO(info.st_mode) and stat.S_IMODE(info.st_mode) == 0o600
    send(job_dir / STDIN_NAME, "hi\n")
    assert await asyncio.wait_for(group.wait(), 20) == 0
    assert "read hi" in (job_dir / "rank0.log").read_text()
    # a FIFO of another user's (root's) in its place is not the job's input
    (job_dir / STDIN_NAME).unlink()
    os.mkfifo(job_dir / STDIN_NAME, 0o600)
    with pytest.raises(PolluxError, match="cannot open input FIFO .*: Permission denied"):
        await launcher.launch(spec)
    (job_dir / STDIN_NAME).chmod(0o666)  # one the user could open: refused all the same
    with pytest.raises(PolluxError, match="belongs to uid 0, not the job's user"):
        await launcher.launch(spec)
    assert (job_dir / STDIN_NAME).lstat().st_uid == 0
