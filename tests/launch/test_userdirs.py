"""A job's checkpoint directory must be its user's alone (``launch/userdirs.py``): a
directory or a link of theirs, in a directory no one else can swap it in."""

from __future__ import annotations

import asyncio
import os
import pwd
import secrets
import shutil
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest

from pollux_local.launch.userdirs import foreign_directory, make_own_directory
from tests.labinstall import world_readable_tempdir

OTHER = 54321  # a uid no file here belongs to


def test_own_directories_and_own_links_are_taken(tmp_path: Path) -> None:
    me = os.geteuid()
    own = tmp_path / "ckpt"
    assert make_own_directory(str(own)) is None and own.is_dir()
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    link = tmp_path / "linked"
    link.symlink_to(scratch)  # a link of the user's: where it leads is theirs to choose
    assert foreign_directory(str(link), me) is None
    plain = tmp_path / "file"
    plain.write_text("")
    assert "is not a directory" in (foreign_directory(str(plain), me) or "")


@pytest.mark.skipif(os.geteuid() != 0, reason="giving files to another uid needs root")
def test_what_another_user_put_there_is_refused(tmp_path: Path) -> None:
    me = os.geteuid()
    root = tmp_path / "shared"
    root.mkdir()
    root.chmod(0o1777)  # writable by all, sticky: no one may swap another's entry
    theirs = root / "42"
    theirs.mkdir()
    os.chown(theirs, OTHER, OTHER)
    assert f"belongs to uid {OTHER}" in (foreign_directory(str(theirs), me) or "")
    # a link another user made, to a directory of the job's user's: the link is theirs
    mine = tmp_path / "mine"
    mine.mkdir()
    planted = root / "43"
    planted.symlink_to(mine)
    os.lchown(planted, OTHER, OTHER)
    problem = foreign_directory(str(planted), me) or ""
    assert "a link belongs to uid" in problem, problem
    # the job's own directory in a root others may write to and that is not sticky: another
    # user could rename it away and put theirs in its place
    loose = tmp_path / "loose"
    loose.mkdir()
    os.chown(loose, OTHER, OTHER)
    loose.chmod(0o777)
    (loose / "44").mkdir()
    problem = foreign_directory(str(loose / "44"), me) or ""
    assert "may be changed by others" in problem and "chmod +t" in problem, problem
    loose.chmod(0o1777)
    assert foreign_directory(str(loose / "44"), me) is None


def test_the_module_checks_as_whoever_runs_it(tmp_path: Path) -> None:
    target = tmp_path / "a" / "b"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    done = subprocess.run(
        [sys.executable, "-s", "-m", "pollux_local.launch.userdirs", str(target)],
        capture_output=True, text=True, env=env,
    )  # fmt: skip
    assert done.returncode == 0 and target.is_dir(), done
    (tmp_path / "f").write_text("")
    done = subprocess.run(
        [sys.executable, "-s", "-m", "pollux_local.launch.userdirs", str(tmp_path / "f")],
        capture_output=True, text=True, env=env,
    )  # fmt: skip
    assert done.returncode == 1 and "cannot create" in done.stdout, done


#: The helper as the daemon starts it (``python -s -m pollux_local.launch.userdirs PATH UID
#: GID GROUPS``), made slow: it makes the directory 3 s after taking the user's ids.
SLOW_HELPER = r"""
import sys, time
import pollux_local.launch.userdirs as userdirs

made = userdirs.make_own_directory

def slowly(path):
    time.sleep(3)
    return made(path)

userdirs.make_own_directory = slowly
sys.exit(userdirs.main(sys.argv[1:]))
"""


@pytest.fixture()
def second_user() -> Iterator[pwd.struct_passwd]:
    """A Unix user made for the test, deleted after it."""
    if os.geteuid() != 0 or shutil.which("useradd") is None:
        pytest.skip("needs root and useradd (a second Unix user)")
    name = "pxud" + secrets.token_hex(3)
    subprocess.run(["useradd", "-M", "-s", "/bin/sh", name], check=True, capture_output=True)
    try:
        yield pwd.getpwnam(name)
    finally:
        subprocess.run(["userdel", name], capture_output=True)


def test_the_user_cannot_stop_the_daemons_helper_that_makes_their_directory(
    second_user: pwd.struct_passwd, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The daemon waits for the helper that makes an SSH job's checkpoint directory as its
    user, under the lock every pass takes.  Started as the user in every way, the user could
    stop it (``kill -STOP``) and hold every pass and request of everyone 30 s per job (review
    s61).  It now takes the user's effective ids alone: the directory is still the user's,
    made as them, but their signal does not reach it."""
    from pollux_local.daemon.executor import launchspec

    base = world_readable_tempdir("pollux-userdirs-")
    try:
        shared = base / "checkpoints"
        shared.mkdir()
        shared.chmod(0o1777)
        helper = (
            base / "slow_helper.py"
        )  # (readable by the user: an earlier version ran it as them)
        helper.write_text(SLOW_HELPER)
        python = base / "python"
        python.write_text(f'#!/bin/sh\nshift 3\nexec {sys.executable} -s {helper} "$@"\n')
        python.chmod(0o755)
        monkeypatch.setattr(launchspec.sys, "executable", str(python))
        target = shared / "7-abc"
        job = SimpleNamespace(owner_uid=second_user.pw_uid)

        async def make_and_stop() -> tuple[str | None, subprocess.CompletedProcess[str]]:
            making = asyncio.ensure_future(launchspec._make_as_owner(job, target))  # type: ignore[arg-type]
            pid = None
            for _ in range(200):
                await asyncio.sleep(0.02)
                pid = next(
                    (
                        p.pid
                        for p in psutil.Process().children()
                        if str(helper) in " ".join(p.cmdline())
                    ),
                    None,
                )
                if pid is not None:
                    break
            assert pid is not None, "the helper never started"
            for _ in range(200):  # until it works as the user (it then sleeps 3 s so)
                uids = psutil.Process(pid).uids()
                if uids.effective == second_user.pw_uid:
                    break
                await asyncio.sleep(0.01)
            assert uids.effective == second_user.pw_uid and uids.real == 0, uids
            stop = subprocess.run(
                ["runuser", "-u", second_user.pw_name, "--", "kill", "-STOP", str(pid)],
                capture_output=True, text=True,
            )  # fmt: skip
            return await asyncio.wait_for(making, 20), stop

        began = time.monotonic()
        problem, stop = asyncio.run(make_and_stop())
        assert stop.returncode != 0 and "not permitted" in stop.stderr, stop
        assert problem is None and time.monotonic() - began < 15
        made = target.lstat()
        assert stat.S_ISDIR(made.st_mode) and made.st_uid == second_user.pw_uid
    finally:
        shutil.rmtree(base, ignore_errors=True)
