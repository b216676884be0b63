"""A job's checkpoint directory must be its user's alone (``launch/userdirs.py``): a
directory or a link of theirs, in a directory no one else can swap it in."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pollux_local.launch.userdirs import foreign_directory, make_own_directory

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
