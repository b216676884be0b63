"""What the admin reads when the daemon's own place is wrong: one line naming the problem,
never a traceback."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from tests.daemon_process import DaemonFactory
from tests.labinstall import world_readable_tempdir

pytestmark = pytest.mark.timeout(60)


def test_a_directory_at_the_socket_path_is_one_line(
    tmp_path: Path, daemon_factory: DaemonFactory
) -> None:
    state = tmp_path / "state"
    state.mkdir(mode=0o755)
    (state / "daemon.sock").mkdir()
    with pytest.raises(RuntimeError) as info:
        daemon_factory(devices="cpu:1", state_dir=state, timeout_s=20)
    text = str(info.value)
    assert "cannot listen on" in text and "a directory is in the way" in text, text
    assert "Traceback" not in text


@pytest.mark.skipif(os.geteuid() != 0, reason="a socket open to others is a root daemon's")
@pytest.mark.parametrize(("mode", "warned"), [(0o700, True), (0o755, False)])
def test_a_socket_no_user_can_reach_is_warned_about(
    daemon_factory: DaemonFactory, mode: int, warned: bool
) -> None:
    base = world_readable_tempdir("pollux-reach-")
    try:
        state = base / "state"
        state.mkdir()
        state.chmod(mode)
        daemon = daemon_factory(devices="cpu:1", state_dir=state)
        said = "users cannot reach the socket" in (state / "daemon.log").read_text()
        assert said is warned
        daemon.stop()
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_a_config_path_that_is_a_directory_is_one_line(tmp_path: Path) -> None:
    from pollux_local.daemon.config import load_config
    from pollux_local.errors import PolluxError

    folder = tmp_path / "config.toml"
    folder.mkdir()
    with pytest.raises(PolluxError, match="not a regular file") as info:
        load_config(folder)
    assert "Errno" not in str(info.value)


def test_each_migration_of_the_state_database_is_logged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    import logging
    import sqlite3

    from pollux_local.daemon.state import SCHEMA_VERSION, StateStore

    StateStore(tmp_path / "state.db").close()
    db = sqlite3.connect(tmp_path / "state.db")
    with db:
        db.execute("UPDATE meta SET value = ? WHERE key = 'schema_version'", (SCHEMA_VERSION - 1,))
    db.close()
    with caplog.at_level(logging.INFO, logger="pollux_local.daemon"):
        StateStore(tmp_path / "state.db").close()
    said = [r.getMessage() for r in caplog.records if "schema" in r.getMessage()]
    assert said and f"-> {SCHEMA_VERSION}" in said[-1], said
