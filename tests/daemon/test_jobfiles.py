"""The daemon's reads of job-directory files refuse what a hostile job may leave there."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from pollux_local.daemon.jobfiles import (
    UnsafeJobFile,
    read_job_file,
    read_whole_job_file,
)

UID = os.geteuid()


@pytest.fixture
def job_dir(tmp_path: Path) -> Path:
    path = tmp_path / "jobs" / "7"
    path.mkdir(parents=True)
    (path / "rank0.log").write_bytes(b"0123456789")
    return path


def test_a_plain_file_is_read_in_pieces(job_dir: Path) -> None:
    assert read_job_file(job_dir, "rank0.log", UID) == (b"0123456789", 0, 10)
    assert read_job_file(job_dir, "rank0.log", UID, offset=-3) == (b"789", 7, 10)
    assert read_job_file(job_dir, "rank0.log", UID, offset=4, max_bytes=2) == (b"45", 4, 10)
    assert read_job_file(job_dir, "rank0.log", UID, offset=99) == (b"", 10, 10)


def test_a_symlink_in_place_of_a_log_is_refused(job_dir: Path, tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_text("root's secret\n")
    (job_dir / "rank0.log").unlink()
    (job_dir / "rank0.log").symlink_to(secret)
    with pytest.raises(UnsafeJobFile, match="symlink"):
        read_job_file(job_dir, "rank0.log", UID)


def test_a_symlinked_job_directory_is_refused(job_dir: Path, tmp_path: Path) -> None:
    other = tmp_path / "elsewhere"
    other.mkdir()
    (other / "report.json").write_text("{}")
    link = job_dir.parent / "8"
    link.symlink_to(other)
    with pytest.raises(UnsafeJobFile, match="not a directory"):
        read_whole_job_file(link, "report.json", UID)


def test_a_fifo_does_not_block_the_reader(job_dir: Path) -> None:
    os.mkfifo(job_dir / "report.json")
    with pytest.raises(UnsafeJobFile, match="not a regular file"):
        read_whole_job_file(job_dir, "report.json", UID)


def test_a_hard_link_is_refused(job_dir: Path) -> None:
    os.link(job_dir / "rank0.log", job_dir / "report.json")
    with pytest.raises(UnsafeJobFile, match="links"):
        read_whole_job_file(job_dir, "report.json", UID)


def test_an_oversized_report_is_refused(job_dir: Path) -> None:
    (job_dir / "report.json").write_bytes(b" " * 2048)
    with pytest.raises(UnsafeJobFile, match="at most 1024"):
        read_whole_job_file(job_dir, "report.json", UID, max_bytes=1024)


def test_names_cannot_leave_the_directory(job_dir: Path) -> None:
    for name in ("../7/rank0.log", "..", ""):
        with pytest.raises(UnsafeJobFile):
            read_job_file(job_dir, name, UID)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to own files as another uid")
def test_a_file_of_another_user_is_refused(job_dir: Path) -> None:
    os.chown(job_dir, 54321, 54321)
    os.chown(job_dir / "rank0.log", 12345, 12345)
    with pytest.raises(UnsafeJobFile, match="uid 12345"):
        read_job_file(job_dir, "rank0.log", 54321)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to own files as another uid")
def test_a_file_of_the_root_daemon_in_a_users_job_directory_is_refused(job_dir: Path) -> None:
    # the job runs as 54321: a root-owned file there was put there, not written by the job
    os.chown(job_dir, 54321, 54321)
    assert (job_dir / "rank0.log").stat().st_uid == 0
    with pytest.raises(UnsafeJobFile, match="uid 0"):
        read_job_file(job_dir, "rank0.log", 54321)
    with pytest.raises(UnsafeJobFile, match="uid 0"):
        read_job_file(job_dir.parent, "7", 54321)  # nor a directory the job's user does not own


@pytest.fixture
def mounted(job_dir: Path):  # type: ignore[no-untyped-def]
    """Mount with ``mount(8)`` (root only), unmounted after the test."""
    if os.geteuid() != 0:
        pytest.skip("mounting needs root")
    made: list[Path] = []

    def mount(*args: str) -> None:
        import subprocess

        done = subprocess.run(["mount", *args], capture_output=True, text=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount here: {done.stderr.strip()}")
        made.append(Path(args[-1]))

    yield mount
    import subprocess

    for target in reversed(made):
        subprocess.run(["umount", "-l", str(target)], check=False)


def test_a_file_system_mounted_on_a_job_directory_or_file_is_never_entered(
    job_dir: Path, tmp_path: Path, mounted
) -> None:  # type: ignore[no-untyped-def]
    """A user's FUSE mount over their job's directory (where ``user_allow_other`` allows it)
    could leave each read unanswered and the daemon with it: a mount point is refused, its
    file system never asked anything (review s63).  Shown with a tmpfs and a bind mount, as
    root; before the fix each read below went through to the mounted file."""
    planted = tmp_path / "planted.json"
    planted.write_text('{"epoch": 3}')
    (job_dir / "report.json").write_text("{}")
    mounted("--bind", str(planted), str(job_dir / "report.json"))
    with pytest.raises(UnsafeJobFile, match="report.json is a mount point"):
        read_whole_job_file(job_dir, "report.json", UID)
    from pollux_local.daemon.jobfiles import job_dir_stat, job_file_exists, job_file_mtime

    assert job_file_mtime(job_dir, "report.json", UID) is None
    assert job_file_exists(job_dir, "report.json", UID)
    assert read_job_file(job_dir, "rank0.log", UID)[0] == b"0123456789"  # the rest is read

    over = job_dir.parent / "9"
    over.mkdir()
    mounted("-t", "tmpfs", "-o", "size=1m", "tmpfs", str(over))
    (over / "rank0.log").write_text("inside the mount\n")
    with pytest.raises(UnsafeJobFile, match="9 is a mount point"):
        read_job_file(over, "rank0.log", UID)
    assert job_file_mtime(over, "rank0.log", UID) is None
    with pytest.raises(UnsafeJobFile, match="mount point"):
        job_dir_stat(job_dir.parent, "9")
    assert job_dir_stat(job_dir.parent, "7").st_ino == os.lstat(job_dir).st_ino
    with pytest.raises(FileNotFoundError):
        job_dir_stat(job_dir.parent, "10")
    # without openat2 (a kernel before 5.6): another file system is found once opened
    import pollux_local.daemon.jobfiles as jobfiles

    mounted_as = jobfiles._have_openat2
    jobfiles._have_openat2 = False
    try:
        with pytest.raises(UnsafeJobFile, match="9 is a mount point"):
            read_job_file(over, "rank0.log", UID)
        assert read_job_file(job_dir, "rank0.log", UID)[0] == b"0123456789"
    finally:
        jobfiles._have_openat2 = mounted_as


def test_a_legacy_checkpoint_dir_under_a_symlinked_checkpoint_root_is_still_found(
    tmp_path: Path,
) -> None:
    """``checkpoint_dir_under`` keeps a ``ROOT/<id>`` of the job's user; a ``checkpoint_root``
    given as a symlink (``/scratch -> /mnt/big/scratch``) was followed by ``lstat``, and
    ``job_dir_stat`` refused it as "not a directory (a symlink?)", so the job was given a new
    directory and lost its checkpoints (review s67)."""
    from pollux_local.daemon.jobfiles import job_dir_stat

    (tmp_path / "real" / "5").mkdir(parents=True)
    (tmp_path / "root").symlink_to("real")
    info = job_dir_stat(tmp_path / "root", "5")
    assert stat.S_ISDIR(info.st_mode) and info.st_uid == os.geteuid()
