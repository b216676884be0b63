"""The README's commands, run as a user would type them.

Every command line of the README's fenced ``bash`` and ``console`` blocks is extracted
(comments stripped; in ``console`` blocks only the ``$ `` lines).  The ``pollux-local``
commands run in README order against a real daemon started with the README's own daemon
command (plus a temporary ``--state-dir``), from a temporary copy of ``jobs/`` and
``examples/``, with ``POLLUX_LOCAL_STATE_DIR`` pointing at that daemon.  Each must exit 0 and
print what it is about: the job id a submit is expected to get, a job state, the log.

Commands that run until stopped, need a terminal or take minutes (the daemon, the TUI,
``logs -f``, whole-trace simulations) are parsed by the real argument parser and their
``--help`` must work; shell set-up, installs and the test suite are not run.  Both lists are
explicit and must match the README exactly, so a new README command cannot slip past.  The
README's TOML blocks are read with the daemon's config reader and the job-spec reader.
"""

from __future__ import annotations

import contextlib
import json
import re
import shlex
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from pollux_local.client import Client
from pollux_local.daemon.config import load_config
from pollux_local.errors import PolluxError
from pollux_local.jobspec import load_job_spec
from tests.daemon_process import DaemonFactory, activated_environ
from tests.docs.commands import (
    STATES,
    check_parses,
    cli,
    command_lines,
    fenced_blocks,
    wait_for_log,
)
from tests.paths import REPO_ROOT

pytestmark = pytest.mark.timeout(300)

README = REPO_ROOT / "README.md"

#: README command lines that are not ``pollux-local`` commands; none of them is run here.
NOT_RUN = {
    "bash scripts/demo": "installs, then trains three jobs to their targets (minutes)",
    "bash .ci/run": "installs system packages and runs the whole test suite",
    "bash scripts/install": "creates .venv (this test runs inside it)",
    ". .venv/bin/activate": "changes the user's shell",
    "python -m pytest -q --timeout=600 -n 2 --dist loadgroup": "the whole test suite, this file included",
    "export POLLUX_LOCAL_STATE_DIR=/var/lib/pollux-local": (
        "changes the user's shell; the test sets the variable to its own state dir"
    ),
}

#: ``pollux-local`` commands that run until stopped, need a terminal or take minutes:
#: parsed and ``--help``-checked, not run.  Must be exactly the README's such commands.
PARSE_ONLY = {
    "pollux-local daemon --devices cpu:2": "runs until stopped; the test starts it itself",
    "pollux-local daemon --config /etc/pollux-local/config.toml --state-dir /var/lib/pollux-local": (
        "runs until stopped, on system paths"
    ),
    "pollux-local logs -f 1": "follows the log until the job ends",
    "pollux-local wait 2 3": "blocks until the jobs end (minutes on two CPU devices)",
    "pollux-local tui": "interactive, needs a terminal",
    "pollux-local tui --demo": "interactive, needs a terminal",
    "pollux-local simulate ../shared/data/pollux-artifact/workloads/workload-1.csv": (
        "a 160-job trace: tens of seconds"
    ),
    "pollux-local simulate --policy tiresias --json "
    "../shared/data/pollux-artifact/workloads/workload-2.csv": "a whole trace: tens of seconds",
}


def long_running(argv: list[str]) -> bool:
    """Does this ``pollux-local`` command run until stopped, need a terminal or take minutes?"""
    command = argv[1] if len(argv) > 1 else "tui"  # plain ``pollux-local`` opens the TUI
    follows = command == "logs" and ("-f" in argv or "--follow" in argv)
    return command in ("daemon", "tui", "simulate", "wait") or follows


COMMANDS = command_lines(README.read_text())
CLI_COMMANDS = [c for c in COMMANDS if shlex.split(c)[0] == "pollux-local"]


def test_every_readme_command_is_run_or_listed() -> None:
    assert CLI_COMMANDS, "no pollux-local command found in the README"
    others = {c for c in COMMANDS if c not in CLI_COMMANDS}
    assert others == set(NOT_RUN), "README commands that are not pollux-local changed"
    parse_only = {c for c in CLI_COMMANDS if long_running(shlex.split(c))}
    assert parse_only == set(PARSE_ONLY), "README commands that are not run changed"


@pytest.mark.parametrize("command", sorted(PARSE_ONLY))
def test_long_running_commands_parse(command: str) -> None:
    check_parses(command)


def test_toml_blocks_load(tmp_path: Path) -> None:
    blocks = [lines for language, lines in fenced_blocks(README.read_text()) if language == "toml"]
    assert blocks, "no TOML block in the README"
    for index, lines in enumerate(blocks):
        path = tmp_path / f"block{index}.toml"
        path.write_text("\n".join(lines) + "\n")
        if "[job]" in lines:
            spec = load_job_spec(path)
            assert spec.script is not None
        else:
            config = load_config(path, force=True)  # a GPU machine's: not this one's GPUs
            assert config.nodes


@dataclass
class Session:
    """What the README's commands have done so far."""

    client: Client
    submitted: int = 0


def job_ids(argv: list[str]) -> list[str]:
    """The job ids a command names (positional numbers after the sub-command)."""
    if argv[1] == "priority":
        return argv[2:3]
    if argv[1] in ("show", "logs", "hold", "release", "cancel"):
        return [word for word in argv[2:] if word.isdigit()]
    return []


def check_output(session: Session, argv: list[str], out: str) -> None:
    """Assert the key facts of one command's output (not its exact format)."""
    command, as_json = argv[1], "--json" in argv
    data = json.loads(out) if as_json else None
    states = re.compile(rf"\b({'|'.join(STATES)})\b")
    if command == "estimate" or (command == "submit" and "--dry-run" in argv):
        # nothing queued: a forecast of a job on two devices
        if data is not None:
            assert data["jobs"][0]["devices"] == 2
        else:
            assert "starts " in out and "finishes " in out and "2 devices" in out
    elif command == "submit":
        session.submitted += 1
        match = re.search(r"\bjob (\d+)", out)
        got = str(data["id"]) if data is not None else match and match.group(1)
        assert got == str(session.submitted), f"README order makes this job {session.submitted}"
    elif command in ("status", "ls"):
        if data is not None:
            assert all(job["state"] in STATES for job in data["jobs"])
        else:
            assert states.search(out) or "no jobs" in out
    elif command == "show":
        if data is not None:
            assert str(data["job"]["id"]) == argv[2]
        else:
            assert f"job {argv[2]}" in out and states.search(out)
    elif command == "hold":
        assert "held" in out
    elif command == "release":
        assert "queued" in out
    elif command == "priority":
        assert f"priority {argv[3]}" in out
    elif command == "cancel":
        assert "cancelled" in out or "already" in out
        assert all(re.search(rf"\bjob {job_id}\b", out) for job_id in argv[2:])
    elif command == "nodes":
        assert data["nodes"] if data is not None else "device" in out
    elif command == "--version":
        assert re.search(r"\d+\.\d+", out)
    else:
        assert out.strip()


def test_readme_commands_run(tmp_path: Path, daemon_factory: DaemonFactory) -> None:
    workspace = tmp_path / "work"
    for folder in ("jobs", "examples"):
        shutil.copytree(
            REPO_ROOT / folder, workspace / folder, ignore=shutil.ignore_patterns("__pycache__")
        )
    state_dir = tmp_path / "state"
    daemon_lines = [c for c in CLI_COMMANDS if shlex.split(c)[1:2] == ["daemon"]]
    daemon = daemon_factory(*shlex.split(daemon_lines[0])[2:], state_dir=state_dir)
    session = Session(client=daemon.client)
    env = activated_environ(POLLUX_LOCAL_STATE_DIR=str(state_dir), OMP_NUM_THREADS="1")
    try:
        for command in CLI_COMMANDS:
            argv = shlex.split(command)
            if command in PARSE_ONLY:
                continue
            for job_id in job_ids(argv):
                assert int(job_id) <= session.submitted, f"{command!r}: job {job_id} not submitted"
            if argv[1] == "logs":
                wait_for_log(session.client, argv[2])
            done = subprocess.run(
                [*cli(), *argv[1:]], cwd=workspace, env=env, capture_output=True, text=True,
                timeout=60,
            )  # fmt: skip
            assert done.returncode == 0, f"{command!r} exited {done.returncode}: {done.stderr}"
            assert done.stdout.strip(), f"{command!r} printed nothing"
            check_output(session, argv, done.stdout)
        assert session.submitted, "the README submits no job"
        jobs = session.client.request("status")["jobs"]
        broken = [
            (job["id"], job["state"]) for job in jobs if job["state"] == "failed" or job["failures"]
        ]
        assert not broken, f"README jobs crashed: {broken}; daemon log: {daemon.output()}"
    finally:
        with contextlib.suppress(PolluxError):
            active = [
                job["id"]
                for job in session.client.request("status")["jobs"]
                if job["state"] not in ("succeeded", "failed", "cancelled")
            ]
            if active:
                session.client.request("cancel", ids=active)
        daemon.stop()
