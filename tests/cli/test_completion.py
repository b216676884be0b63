"""Shell completion: the code each shell needs, and answers to completion requests (commands,
options, and job ids from the daemon)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.daemon_process import DaemonFactory


def complete(line: str, tmp_path: Path, **env: str) -> list[str]:
    """What the shell would offer for ``line`` (argcomplete's protocol, answer in a file)."""
    out = tmp_path / "answer"
    result = subprocess.run(
        [sys.executable, "-c", "import sys, pollux_local.cli as c; sys.exit(c.main())"],
        env={**os.environ, **env, "_ARGCOMPLETE": "1", "_ARGCOMPLETE_IFS": "\n",
             "COMP_LINE": line, "COMP_POINT": str(len(line)),
             "_ARGCOMPLETE_STDOUT_FILENAME": str(out)},
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return [word.strip() for word in out.read_text().split("\n") if word.strip()]


@pytest.mark.parametrize("shell", ["bash", "zsh", "fish"])
def test_completion_code_for_each_shell(shell: str) -> None:
    from pollux_local.cli import main

    assert main(["completion", shell]) == 0


def test_commands_and_options_complete(tmp_path: Path) -> None:
    assert complete("pollux-local sub", tmp_path) == ["submit"]
    assert set(complete("pollux-local submit --max-", tmp_path)) == {
        "--max-gpus", "--max-batch-size", "--max-local-batch", "--max-running",
    }  # fmt: skip
    assert set(complete("pollux-local submit --after", tmp_path)) == {
        "--after",
        "--after-any",
        "--after-one-of",
    }
    assert set(complete("pollux-local submit --notify", tmp_path)) == {"--notify", "--notify-on"}
    assert complete("pollux-local submit --notify-on ", tmp_path) == ["end", "failure"]
    assert {"usage", "drain", "restart"} <= set(complete("pollux-local ", tmp_path))
    assert "--no-time" in complete("pollux-local edit --no", tmp_path)
    assert "--since" in complete("pollux-local usage --s", tmp_path)


def test_job_ids_complete_from_the_daemon(tmp_path: Path, daemon_factory: DaemonFactory) -> None:
    daemon = daemon_factory(devices="cpu:1", interval=30)
    try:
        for _ in range(12):
            daemon.client.request("submit", argv=["sleep", "1"], workdir="/tmp", hold=True)
        state = str(daemon.state_dir)
        assert complete("pollux-local show 1", tmp_path, POLLUX_LOCAL_STATE_DIR=state) == [
            "1", "10", "11", "12",
        ]  # fmt: skip
        assert complete("pollux-local cancel 3 ", tmp_path, POLLUX_LOCAL_STATE_DIR=state)
        assert complete("pollux-local cancel --array 1", tmp_path, POLLUX_LOCAL_STATE_DIR=state)[
            :2
        ] == ["1", "10"]
        assert complete("pollux-local restart 1", tmp_path, POLLUX_LOCAL_STATE_DIR=state)[:2] == [
            "1", "10",
        ]  # fmt: skip
        assert complete("pollux-local edit 1", tmp_path, POLLUX_LOCAL_STATE_DIR=state)[:2] == [
            "1", "10",
        ]  # fmt: skip
    finally:
        daemon.stop()
    # no daemon: no ids, and no error either
    offered = complete("pollux-local show ", tmp_path, POLLUX_LOCAL_STATE_DIR=str(tmp_path))
    assert not [word for word in offered if word.isdigit()] and "--json" in offered
