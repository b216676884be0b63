"""`pollux-local service --write`: the unit is written through a temporary file in its
directory, which may be one another user can write to (root writing into a user's
directory): its mode is set through the descriptor, never by a path that could have been
swapped for a link to any file."""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path
from typing import Any

import pytest

from pollux_local.cli import service


def test_the_unit_is_written_0644(tmp_path: Path) -> None:
    path = tmp_path / "units" / "pollux-local.service"
    assert service.write_unit(path, "[Unit]\n")
    assert path.read_text() == "[Unit]\n"
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    assert not service.write_unit(path, "[Unit]\n")  # already holds it
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary left


def test_a_temporary_swapped_for_a_link_does_not_chmod_its_target(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The race of a user who owns the unit's directory: right after ``mkstemp`` the
    temporary's name is a link to a private file (of root's, when root writes the unit)."""
    secret = tmp_path / "secret"
    secret.write_text("private\n")
    secret.chmod(0o600)
    units = tmp_path / "units"
    units.mkdir()
    real_mkstemp = tempfile.mkstemp

    def swapped(*args: Any, **kwargs: Any) -> tuple[int, str]:
        fd, name = real_mkstemp(*args, **kwargs)
        os.unlink(name)
        os.symlink(secret, name)  # what a racing user in that directory does
        return fd, name

    monkeypatch.setattr(service.tempfile, "mkstemp", swapped)
    service.write_unit(units / "pollux-local.service", "[Unit]\n")
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    assert secret.read_text() == "private\n"
