"""A daemon run as root reads only a config no other user can change: the file, where a link
leads, and every directory above them (a sticky one's entries only their owners replace)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from pollux_local.daemon.config import changeable_by_others, load_config
from pollux_local.errors import PolluxError

OTHER = 54321


def config_in(directory: Path) -> Path:
    directory.mkdir(mode=0o755)
    path = directory / "config.toml"
    path.write_text('[scheduler]\npolicy = "fifo"\n')
    path.chmod(0o644)
    return path


@pytest.mark.skipif(os.geteuid() != 0, reason="the check is a root daemon's")
def test_a_root_daemon_refuses_a_config_others_can_change(tmp_path: Path) -> None:
    base = tmp_path / "etc"
    base.mkdir(mode=0o755)
    path = config_in(base / "pollux-local")
    assert load_config(path).policy == "fifo"  # root's own, 0644 in 0755 directories

    path.chmod(0o666)
    with pytest.raises(PolluxError) as caught:
        load_config(path)
    line = str(caught.value)
    assert "writable by every user" in line and str(path) in line and "\n" not in line
    path.chmod(0o644)

    path.parent.chmod(0o775)
    os.chown(path.parent, 0, OTHER)  # a group that is not root's may write there
    assert f"writable by group {OTHER}" in (changeable_by_others(path) or "")
    path.parent.chmod(0o755)

    os.chown(path, OTHER, OTHER)  # another user's file
    assert f"belongs to uid {OTHER}" in (changeable_by_others(path) or "")
    os.chown(path, 0, 0)

    # a link to a file in a directory another user owns: where it leads is theirs
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o755)
    os.chown(theirs, OTHER, OTHER)
    (theirs / "config.toml").write_text("")
    link = base / "linked.toml"
    link.symlink_to(theirs / "config.toml")
    assert f"{theirs} belongs to uid {OTHER}" in (changeable_by_others(link) or "")

    # a sticky directory others may write to (/tmp): its root-owned entries stay root's
    sticky = tmp_path / "sticky"
    sticky.mkdir()
    sticky.chmod(0o1777)
    assert changeable_by_others(config_in(sticky / "conf")) is None


@pytest.mark.skipif(os.geteuid() != 0, reason="the check is a root daemon's")
def test_a_root_daemon_says_when_others_can_change_its_code(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pollux_local.daemon import server

    loose = tmp_path / "venv" / "bin"
    loose.mkdir(parents=True)
    (tmp_path / "venv").chmod(0o777)
    python = loose / "python"
    python.write_text("")
    monkeypatch.setattr(server.sys, "executable", str(python))
    (line,) = server.warn_of_changeable_code()
    assert f"interpreter {python}" in line and "writable by every user" in line


@pytest.mark.skipif(os.geteuid() != 0, reason="the check is a root daemon's")
def test_a_link_on_the_way_in_another_users_directory_is_refused(tmp_path: Path) -> None:
    """``config.toml -> THEIRS/link2 -> root's real.toml``: the first link and the file it
    finally reaches are root's, but the link between is in a directory of another user's,
    who could point it anywhere once it was checked."""
    etc = tmp_path / "etc"
    real = config_in(etc)  # root's, 0644, in a 0755 directory of root's
    theirs = tmp_path / "usershared"
    theirs.mkdir(mode=0o755)
    os.chown(theirs, OTHER, OTHER)
    link2 = theirs / "link2"
    link2.symlink_to(real)
    os.lchown(link2, OTHER, OTHER)
    config = etc / "chained.toml"
    config.symlink_to(link2)
    line = changeable_by_others(config) or ""
    assert f"{theirs} belongs to uid {OTHER}" in line, line
    with pytest.raises(PolluxError) as caught:
        load_config(config)
    assert f"{theirs} belongs to uid {OTHER}" in str(caught.value)

    # relative links and `..` are followed as the kernel does: each directory passed checked
    (etc / "sub").mkdir(mode=0o755)
    relative = etc / "sub" / "relative.toml"
    relative.symlink_to("../../usershared/link2")
    assert f"{theirs} belongs to uid {OTHER}" in (changeable_by_others(relative) or "")
    fine = etc / "sub" / "fine.toml"
    fine.symlink_to("../config.toml")
    assert changeable_by_others(fine) is None
    assert load_config(fine).policy == "fifo"


@pytest.mark.skipif(os.geteuid() != 0, reason="the check is a root daemon's")
def test_the_config_is_read_from_the_file_checked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Checked, then read again by its path, a config could be another file by then: it is
    opened once and ``fstat`` must show the file the check reached."""
    from pollux_local.daemon import config as config_module

    etc = tmp_path / "etc"
    real = config_in(etc)
    other = etc / "other.toml"
    other.write_text('[scheduler]\npolicy = "goodput"\n')
    link = etc / "linked.toml"
    link.symlink_to(real)
    walk = config_module._walk_unchangeable

    def then_swapped(path: Path) -> Any:
        checked = walk(path)
        link.unlink()
        link.symlink_to(other)  # repointed between the check and the read
        return checked

    monkeypatch.setattr(config_module, "_walk_unchangeable", then_swapped)
    with pytest.raises(PolluxError) as caught:
        load_config(link)
    assert "changed while it was checked" in str(caught.value)

    monkeypatch.setattr(config_module, "_walk_unchangeable", walk)
    fifo = etc / "fifo.toml"
    os.mkfifo(fifo, 0o644)
    with pytest.raises(PolluxError) as caught:  # never waited on
        load_config(fifo)
    assert "not a regular file" in str(caught.value)


def test_a_fuse_config_letting_users_mount_for_root_is_said_once_at_the_start(
    tmp_path: Path,
) -> None:
    """``user_allow_other`` lets a user mount a FUSE file system over their job's directory
    that root may enter and that never answers (review s63): the daemon says so; a commented
    line, another option or no file says nothing."""
    from pollux_local.daemon import server

    conf = tmp_path / "fuse.conf"
    assert server.warn_of_fuse_for_others(conf) is None  # no file
    conf.write_text("# user_allow_other\nmount_max = 1000\n")
    assert server.warn_of_fuse_for_others(conf) is None
    conf.write_text("mount_max = 1000\n  user_allow_other   # for sshfs\n")
    line = server.warn_of_fuse_for_others(conf) or ""
    assert f"{conf} enables user_allow_other" in line and "job's directory" in line
