"""What the docs' command tests share: the fenced blocks of a Markdown page, the command lines
of its ``bash``/``console`` blocks, how to run ``pollux-local``, and waiting for a job's log.
``tests/docs/test_readme.py`` runs the README's commands with them, ``tests/docs/test_guide.py``
the guide's."""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from pollux_local.cli import build_parser
from pollux_local.client import Client
from pollux_local.errors import PolluxError
from tests.daemon_process import wait_for

#: The states a job may be in, as ``status`` and ``show`` print them.
STATES = ("queued", "running", "rescaling", "held", "succeeded", "failed", "cancelled")


def fenced_blocks(text: str) -> list[tuple[str, list[str]]]:
    """``(language, lines)`` of every fenced block, in order."""
    blocks: list[tuple[str, list[str]]] = []
    current: list[str] | None = None
    for line in text.splitlines():
        if line.strip().startswith("```"):
            if current is None:
                current = []
                blocks.append((line.strip()[3:].strip().lower(), current))
            else:
                current = None
        elif current is not None:
            current.append(line)
    return blocks


def command_lines(text: str) -> list[str]:
    """Every command line of the ``bash``/``console`` blocks, comments and a trailing ``&``
    stripped, as ``shlex.join`` writes it."""
    commands: list[str] = []
    for language, lines in fenced_blocks(text):
        if language not in ("bash", "console"):
            continue
        pending = ""
        for line in lines:
            line = line.strip()
            if language == "console":
                if not (pending or line.startswith("$ ")):
                    continue  # output
                line = line.removeprefix("> " if pending else "$ ")
            if line.endswith("\\"):
                pending += line[:-1] + " "
                continue
            words = shlex.split(pending + line, comments=True)
            pending = ""
            if words and words[-1] == "&":
                words.pop()
            if words:
                commands.append(shlex.join(words))
    return commands


def cli() -> list[str]:
    """How to run ``pollux-local``: the installed script beside this interpreter, if any."""
    script = Path(sys.executable).with_name("pollux-local")
    return [str(script)] if script.exists() else [sys.executable, "-m", "pollux_local"]


def wait_for_log(client: Client, job_id: str) -> None:
    """Wait until the job has started and rank 0 has printed a line of its own (the launcher
    writes ``--- `` lines)."""
    last: list[object] = []

    def has_log() -> bool:
        try:
            reply = client.request("logs", id=job_id, offset=0)
        except PolluxError as exc:
            last[:] = [exc]
            return False
        last[:] = [reply["state"], reply["data"][-200:]]
        return any(not line.startswith("--- ") for line in reply["data"].splitlines())

    try:
        wait_for(has_log, 60, f"job {job_id} to write its log")
    except AssertionError as exc:
        raise AssertionError(f"{exc} (last answer: {last})") from None


def check_parses(command: str) -> None:
    """A command that is not run: the real parser takes it, and its sub-command's ``--help``
    works and names it."""
    argv = shlex.split(command)
    try:
        build_parser().parse_args(argv[1:])
    except SystemExit as exc:
        pytest.fail(f"{command!r} does not parse (exit {exc.code})")
    done = subprocess.run([*cli(), argv[1], "--help"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert f"pollux-local {argv[1]}" in done.stdout
