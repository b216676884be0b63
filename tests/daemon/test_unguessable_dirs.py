"""Names another user could make first: the SSH control directory of a daemon whose state dir
path is long, and a job's checkpoint directory under a shared ``checkpoint_root``.  Neither
may be one that a user who makes it first can take (and so stop the daemon's SSH, or fail
every job of every user)."""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
import tempfile
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from pollux_local.daemon.executor import launchspec
from pollux_local.daemon.executor.launchspec import (
    CHECKPOINT_KEY,
    checkpoint_dir_under,
    ssh_control_dir,
)

OTHER = 54321


def _private(path: Path) -> bool:
    info = path.lstat()
    return stat.S_ISDIR(info.st_mode) and info.st_uid == os.geteuid() and not info.st_mode & 0o077


def _squat(path: Path) -> None:
    """What another user does first: the directory, open to all (theirs, where we are root)."""
    path.mkdir()
    path.chmod(0o777)
    if os.geteuid() == 0:
        os.chown(path, OTHER, OTHER)


def test_a_long_state_dirs_ssh_control_dir_cannot_be_taken_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state_dir = tmp_path / ("s" * 100)
    assert len(str(state_dir / "ssh")) + 42 > 104  # too long for ssh's socket path
    digest = hashlib.sha1(str(state_dir).encode()).hexdigest()[:12]
    # the name the daemon used to take in /tmp, which any user could make first
    squatted = Path(tempfile.gettempdir()) / f"pollux-ssh-{os.geteuid()}-{digest}"
    _squat(squatted)
    made: list[Path] = []
    try:
        control = ssh_control_dir(state_dir)
        made.append(control)
        assert control != squatted and _private(control)
        assert len(str(control)) + 42 <= 104
        assert ssh_control_dir(state_dir) == control  # the same for the daemon's life

        # no private runtime directory to use (a user's daemon without one): a fresh name
        monkeypatch.setattr(launchspec, "_only_writable_by_me", lambda path: False)
        fallback = ssh_control_dir(state_dir)
        made.append(fallback)
        assert fallback != squatted and _private(fallback)
        assert fallback.name.startswith(f"pollux-ssh-{os.geteuid()}-")
        assert len(str(fallback)) + 42 <= 104
        assert ssh_control_dir(state_dir) == fallback
    finally:
        squatted.rmdir()
        for path in made:
            shutil.rmtree(path, ignore_errors=True)


def _job(job_id: int, owner_uid: int) -> Any:
    return SimpleNamespace(id=job_id, job_id=str(job_id), owner_uid=owner_uid)


def test_a_checkpoint_dir_made_first_by_another_user_is_not_the_jobs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "ckpt"
    root.mkdir()
    root.chmod(0o1777)  # shared: every user may make entries
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    owner = 4242
    _squat(root / "7")  # the next id, made first by another user

    chosen = checkpoint_dir_under(root, _job(7, owner), state_dir)
    assert chosen.parent == root and chosen != root / "7"
    assert chosen.name.startswith("7-") and len(chosen.name) == len("7-") + 16
    key = state_dir / CHECKPOINT_KEY
    info = key.lstat()
    assert stat.S_ISREG(info.st_mode) and stat.S_IMODE(info.st_mode) == 0o600
    assert [p.name for p in state_dir.iterdir()] == [CHECKPOINT_KEY]  # no temporary left

    # the same at the job's every restart, and after the daemon's (its key read again)
    assert checkpoint_dir_under(root, _job(7, owner), state_dir) == chosen
    monkeypatch.setattr(launchspec, "_checkpoint_keys", {})
    assert checkpoint_dir_under(root, _job(7, owner), state_dir) == chosen
    # another job's, or another daemon's (another key), is another
    assert checkpoint_dir_under(root, _job(8, owner), state_dir) != chosen
    other_state = tmp_path / "other"
    other_state.mkdir()
    assert checkpoint_dir_under(root, _job(7, owner), other_state) != chosen


@pytest.mark.skipif(os.geteuid() != 0, reason="a directory of the job's user: needs root")
def test_a_jobs_own_checkpoint_dir_of_the_old_name_is_kept(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    root.mkdir()
    root.chmod(0o1777)
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    owner = 4242
    (root / "9").mkdir()
    os.chown(root / "9", owner, owner)  # made before the new naming: checkpoints inside
    assert checkpoint_dir_under(root, _job(9, owner), state_dir) == root / "9"


def test_a_key_that_is_not_the_daemons_private_file_is_refused(tmp_path: Path) -> None:
    from pollux_local.errors import PolluxError

    state_dir = tmp_path / "state"
    state_dir.mkdir()
    secret = tmp_path / "elsewhere"
    secret.write_bytes(b"x" * 32)
    (state_dir / CHECKPOINT_KEY).symlink_to(secret)
    with pytest.raises(PolluxError):
        checkpoint_dir_under(tmp_path, _job(1, 1), state_dir)
    (state_dir / CHECKPOINT_KEY).unlink()
    (state_dir / CHECKPOINT_KEY).write_bytes(b"x" * 32)
    (state_dir / CHECKPOINT_KEY).chmod(0o644)
    with pytest.raises(PolluxError):
        checkpoint_dir_under(tmp_path, _job(1, 1), state_dir)


def test_job_ids_that_start_again_get_checkpoint_dirs_of_new_names(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--reset-state`` (or a state database removed by hand) starts job ids at 1 again:
    the names a key made for the old jobs must not come back, or new job 1 is given old job
    1's checkpoint directory under ``checkpoint_root`` (review s64: root's own, made by the
    daemon, was chowned to the new job's user with its checkpoints in it; another user's
    failed the job; the same user's was resumed from)."""
    from pollux_local.daemon.state import open_state

    root = tmp_path / "ckpt"
    root.mkdir()
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    open_state(state_dir).close()
    old = checkpoint_dir_under(root, _job(1, 0), state_dir)

    # a damaged database set aside by --reset-state: the key goes aside with it
    (state_dir / "state.db").write_bytes(b"not a database" * 100)
    monkeypatch.setattr(launchspec, "_checkpoint_keys", {})
    store = open_state(state_dir, reset=True)
    assert store.set_aside_to is not None
    store.close()
    assert (store.set_aside_to / CHECKPOINT_KEY).is_file()
    after_reset = checkpoint_dir_under(root, _job(1, 4242), state_dir)
    assert after_reset != old

    # the database and jobs/ removed by hand: a new database, a new key
    for entry in state_dir.iterdir():
        if entry.name.startswith("state.db"):
            entry.unlink()
    monkeypatch.setattr(launchspec, "_checkpoint_keys", {})
    open_state(state_dir).close()
    fresh = checkpoint_dir_under(root, _job(1, 4242), state_dir)
    assert fresh not in (old, after_reset)

    # a database that is there keeps its key (every job's name stays the same)
    monkeypatch.setattr(launchspec, "_checkpoint_keys", {})
    open_state(state_dir).close()
    assert checkpoint_dir_under(root, _job(1, 4242), state_dir) == fresh
