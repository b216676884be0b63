"""The guide's commands, run as a user would type them.

Every page of ``docs/guide/`` is one everyday task.  Each command line of its fenced ``bash``
and ``console`` blocks (extracted as the README's are, ``tests/docs/commands.py``) that runs
``pollux-local`` (also after ``sudo``) is run, in the page's order, against a real daemon of
the page's own: one node ``ws1`` with four A100-40GB GPUs as a fake NVML reports them
(``tests/fake_nvml.py``: no machine of the suite has a GPU), configured with :data:`BASE_CONFIG`
plus every TOML block the pages mark with ``<!-- daemon config -->``.  The commands run in a
workspace that holds each TOML block a page marks ``<!-- file: NAME -->`` and a stand-in for
every script the page names: it prints ``stand-in NAME ARGS`` and sleeps
:data:`STANDIN_SECONDS` (or what :data:`RUN_SECONDS` gives it).  Each command must exit 0 and
print something; a job the comment of a command line promises (``# job 4``) must be the one it
makes; the jobs a command names must exist; ``logs ID`` first waits until the job
has printed; ``run`` and ``logs`` must show the stand-in's line.  No job may end ``failed``.

Commands that write system files or run until stopped are parsed by the real parser and their
``--help`` must work (:data:`PARSE_ONLY`, exactly those of the pages).  Lines that run another
program (``systemctl``, ``journalctl``, ...) are not run, but their program must be one of
:data:`OTHER_PROGRAMS`, so that a misspelt ``pollux-local`` cannot slip past.  Every TOML block
loads with the reader it is for: ``[job]`` with the job-spec reader, a per-user
``notify.toml`` with its reader, any other with the daemon's config reader.  Every relative
link (and its ``#anchor``) of the guide, the README and ``docs/`` leads somewhere.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from pollux_local.cli import build_parser
from pollux_local.daemon.config import load_config
from pollux_local.daemon.notify_send import parse_user_file
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
from tests.fake_nvml import A100_40GB, BOX_VARIABLE, SHIM_DIR, FakeBox, fake_module
from tests.paths import REPO_ROOT

pytestmark = pytest.mark.timeout(420)

GUIDE = REPO_ROOT / "docs" / "guide"
PAGES = sorted(GUIDE.glob("*.md"))
#: The daemon every page's commands run against (with ``--interval 0.5``), before the pages'
#: own ``<!-- daemon config -->`` blocks.
BASE_CONFIG = '[daemon]\nstop_grace_s = 2\n\n[nodes.ws1]\ndevices = "cuda:0,1,2,3"\n'
#: How long a stand-in script runs, and the scripts that run longer (a job shown running).
STANDIN_SECONDS = 1.0
RUN_SECONDS = {"pretrain.py": 600.0}
#: Programs other than ``pollux-local`` the guide's command lines may run (not run here).
OTHER_PROGRAMS = {"systemctl", "journalctl", "sudoedit", "pip", "kill", "curl"}
#: ``pollux-local`` commands that write system files or run until stopped: parsed and
#: ``--help``-checked, not run.  Must be exactly the guide's such commands.
PARSE_ONLY = {
    "pollux-local daemon --config /etc/pollux-local/config.toml --state-dir /var/lib/pollux-local": (
        "runs until stopped, on system paths"
    ),
    "pollux-local service --system --write": "writes /etc/systemd/system/pollux-local.service",
    "pollux-local service --user --devices cuda:2,3 --write": (
        "writes the unit into the user's ~/.config/systemd/user"
    ),
}
FILE_MARK = re.compile(r"^<!-- file: ([\w.-]+) -->$")
CONFIG_MARK = re.compile(r"^<!-- daemon config -->$")
SCRIPT = re.compile(r"^(?:\./)?([\w-]+\.(?:py|sh))$")
#: How a job ended, in ``show --json`` and ``status --json`` (submit-and-watch.md).
EXIT_FIELDS = ("exit_code", "exit_signal", "replica_exits")
LINK = re.compile(r"\]\(([^)\s]+)\)")


def marked_blocks(text: str, mark: re.Pattern[str]) -> Iterator[tuple[str, str]]:
    """``(what the mark captured, block text)`` of every fenced block right after a line
    matching ``mark`` (an HTML comment, invisible on the rendered page)."""
    lines = text.splitlines()
    for index, line in enumerate(lines):
        found = mark.match(line.strip())
        if not found:
            continue
        assert lines[index + 1].startswith("```"), f"{line!r} is not followed by a block"
        end = next(i for i in range(index + 2, len(lines)) if lines[i].startswith("```"))
        name = found.group(1) if found.groups() else ""
        yield name, "\n".join(lines[index + 2 : end]) + "\n"


def argv_of(command: str) -> list[str]:
    """A command line's words, ``sudo`` left out."""
    words = shlex.split(command)
    return words[1:] if words[0] == "sudo" else words


def pollux_commands(text: str) -> list[str]:
    """The page's ``pollux-local`` command lines, in order, as ``shlex.join`` writes them."""
    return [shlex.join(argv_of(c)) for c in command_lines(text) if argv_of(c)[0] == "pollux-local"]


def promised_ids(text: str) -> list[str | None]:
    """For each of :func:`pollux_commands`, the job id its comment says a ``submit``, ``run``
    or ``restart`` makes (``# job 4``, ``# jobs 24-43``, ``# job 1 again, as job 8``: the last
    id named before a colon), else ``None``."""
    promised: list[str | None] = []
    for language, lines in fenced_blocks(text):
        if language not in ("bash", "console"):
            continue
        for line in lines:
            code, _, comment = line.partition("  #")
            words = shlex.split(code.strip().removeprefix("$ "), comments=True)
            if not words or argv_of(shlex.join(words))[0] != "pollux-local":
                continue
            named = re.findall(r"\bjobs? (\d+)", comment.split(":")[0])
            makes = argv_of(shlex.join(words))[1:2] in (["submit"], ["run"], ["restart"])
            promised.append(named[-1] if named and makes else None)
    return promised


def made_id(argv: list[str], out: str, err: str) -> str | None:
    """The (first) job id a ``submit``, ``run`` or ``restart`` says it made."""
    if "--json" in argv:
        return str(json.loads(out)["id"])
    pattern = r"\bas job (\d+)" if argv[1] == "restart" else r"\bjobs? (\d+)"
    found = re.search(pattern, out if argv[1] != "run" else err)
    return found.group(1) if found else None


def not_run(argv: list[str]) -> bool:
    """Does this ``pollux-local`` command write system files or run until stopped?"""
    command = argv[1] if len(argv) > 1 else "tui"
    return command in ("daemon", "tui", "simulate") or (command == "service" and "--write" in argv)


def daemon_config() -> str:
    """:data:`BASE_CONFIG` and every page's ``<!-- daemon config -->`` block."""
    blocks = [block for page in PAGES for _, block in marked_blocks(page.read_text(), CONFIG_MARK)]
    return "\n".join([BASE_CONFIG, *blocks])


def test_the_guide_has_a_page_per_task() -> None:
    names = {page.stem for page in PAGES}
    assert names == {"submit-and-watch", "sweeps", "dependencies", "limits", "sharing", "admin"}
    for page in PAGES:
        assert len(pollux_commands(page.read_text())) >= 3, f"{page.name} runs (almost) nothing"


def test_every_command_is_run_parsed_or_another_program() -> None:
    parse_only = set()
    for page in PAGES:
        for command in command_lines(page.read_text()):
            argv = argv_of(command)
            if argv[0] == "pollux-local":
                if not_run(argv):
                    parse_only.add(shlex.join(argv))
            else:
                program = Path(argv[0]).name
                assert program in OTHER_PROGRAMS, f"{page.name}: {command!r} runs {program!r}"
    assert parse_only == set(PARSE_ONLY), "the guide's commands that are not run changed"


@pytest.mark.parametrize("command", sorted(PARSE_ONLY))
def test_commands_not_run_parse(command: str) -> None:
    check_parses(command)


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.stem)
def test_toml_blocks_load(page: Path, tmp_path: Path) -> None:
    blocks = [lines for language, lines in fenced_blocks(page.read_text()) if language == "toml"]
    for index, lines in enumerate(blocks):
        path = tmp_path / f"block{index}.toml"
        path.write_text("\n".join(lines) + "\n")
        if "[job]" in lines:
            assert load_job_spec(path).script is not None
        elif any(line.startswith("urls = ") for line in lines):
            urls, _ = parse_user_file(path.read_bytes(), str(path))
            assert urls
        else:  # a GPU machine's config: its GPUs are not this machine's to check
            assert load_config(path, force=True).nodes


def test_the_daemon_config_loads_on_the_fake_gpus(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", fake_module(FakeBox.of(*[A100_40GB] * 4)))
    path = tmp_path / "daemon.toml"
    path.write_text(daemon_config())
    config = load_config(path)
    assert [(node.name, node.device_type) for node in config.nodes] == [("ws1", "a100-40gb")]


def resolves(source: Path, target: str) -> bool:
    """Does the link ``target`` of the page ``source`` lead to a file (and its ``#anchor`` to a
    heading of it, as GitHub names headings)?"""
    path_text, _, anchor = target.partition("#")
    path = (source.parent / path_text).resolve() if path_text else source
    if not path.exists():
        return False
    if not anchor or path.suffix != ".md":
        return True
    slugs = set()
    for line in path.read_text().splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            slugs.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return anchor in slugs


def test_every_relative_link_leads_somewhere() -> None:
    pages = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").rglob("*.md"))]
    broken = []
    for page in pages:
        for target in LINK.findall(page.read_text()):
            if re.match(r"^[a-z]+:", target):
                continue  # https:, mailto:, ...
            if not resolves(page, target):
                broken.append(f"{page.relative_to(REPO_ROOT)}: {target}")
    assert not broken, broken


def write_workspace(page: str, workspace: Path) -> None:
    """The page's ``<!-- file: NAME -->`` blocks, and a stand-in for every script it names."""
    workspace.mkdir()
    scripts = set()
    for name, block in marked_blocks(page, FILE_MARK):
        (workspace / name).write_text(block)
        scripts.update(re.findall(r'^script = "([\w.-]+)"', block, re.MULTILINE))
    for command in pollux_commands(page):
        scripts.update(m.group(1) for word in shlex.split(command) if (m := SCRIPT.match(word)))
    for name in scripts:
        seconds = RUN_SECONDS.get(name, STANDIN_SECONDS)
        path = workspace / name
        if name.endswith(".py"):
            path.write_text(
                "import sys, time\n"
                f"print('stand-in', {name!r}, *sys.argv[1:], flush=True)\n"
                f"time.sleep({seconds})\n"
            )
        else:
            path.write_text(f'#!/bin/sh\necho stand-in {name} "$@"\nsleep {seconds:g}\n')
            path.chmod(0o755)


def named_jobs(argv: list[str]) -> list[str]:
    """The job ids a command names as its arguments (not ``--array ID``)."""
    try:
        args = build_parser().parse_args(argv[1:])
    except SystemExit:
        return []  # the command itself reports what it does not know
    single = getattr(args, "id", None)
    many = getattr(args, "ids", None) or []
    return [str(single)] * (single is not None) + [str(i) for i in many]


def check_output(argv: list[str], out: str) -> None:
    """The key facts of one command's output (not its exact format)."""
    command, as_json = argv[1], "--json" in argv
    data = json.loads(out) if as_json else None
    if command == "submit":
        assert data["id"] if data is not None else re.search(r"\b(job|array) \d+", out), out
    elif command in ("status", "ls"):
        if data is not None:
            assert all(job["state"] in STATES for job in data["jobs"])
            assert all(set(EXIT_FIELDS) <= set(job) for job in data["jobs"])
        else:
            assert re.search(rf"\b({'|'.join(STATES)})\b", out) or "no jobs" in out, out
    elif command == "show":
        job_id = next(word for word in argv[2:] if word.isdigit())
        assert str(data["job"]["id"]) == job_id if data is not None else f"job {job_id}" in out
        if data is not None:  # the fields the guide documents
            assert set(EXIT_FIELDS) | {"retries_used", "retries_allowed"} <= set(data["job"])
    elif command == "wait" and data is not None:  # the stand-ins exit 0, each rank too
        assert data["jobs"] and not data["pending"], data
        for job in data["jobs"]:
            assert (job["state"], job["exit_code"], job["exit_signal"]) == ("succeeded", 0, None)
            assert [rank["code"] for rank in job["replica_exits"]] == [0], job
    elif command in ("run", "logs"):
        assert "stand-in" in out, out


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.stem)
def test_guide_commands_run(page: Path, tmp_path: Path, daemon_factory: DaemonFactory) -> None:
    text = page.read_text()
    workspace = tmp_path / "work"
    write_workspace(text, workspace)
    box_file = FakeBox.of(*[A100_40GB] * 4).write(tmp_path / "box.json")
    daemon = daemon_factory(
        config=daemon_config(),
        interval=0.5,
        env={"PYTHONPATH": f"{SHIM_DIR}{os.pathsep}{REPO_ROOT}", BOX_VARIABLE: str(box_file)},
    )
    client = daemon.client
    env = activated_environ(POLLUX_LOCAL_STATE_DIR=str(daemon.state_dir), OMP_NUM_THREADS="1")
    commands = pollux_commands(text)
    promised = promised_ids(text)
    assert len(promised) == len(commands)
    try:
        for command, promise in zip(commands, promised, strict=True):
            if command in PARSE_ONLY:
                continue
            argv = shlex.split(command)
            for job_id in named_jobs(argv):
                try:
                    client.request("show", id=job_id)
                except PolluxError as exc:
                    pytest.fail(f"{page.name}: {command!r} names job {job_id}: {exc}")
            if argv[1] == "logs" and not {"-f", "--follow"} & set(argv):
                wait_for_log(client, named_jobs(argv)[0])
            done = subprocess.run(
                [*cli(), *argv[1:]], cwd=workspace, env=env, capture_output=True, text=True,
                timeout=180,
            )  # fmt: skip
            assert done.returncode == 0, (
                f"{page.name}: {command!r} exited {done.returncode}: {done.stderr[-2000:]}"
            )
            assert (done.stdout + done.stderr).strip(), f"{page.name}: {command!r} printed nothing"
            check_output(argv, done.stdout)
            if promise is not None:
                got = made_id(argv, done.stdout, done.stderr)
                assert got == promise, f"{page.name}: {command!r} made job {got}, not {promise}"
        jobs = client.request("status", all=True)["jobs"]
        failed = [(job["id"], job["reason"]) for job in jobs if job["state"] == "failed"]
        assert not failed, f"{page.name}: jobs failed: {failed}; daemon log: {daemon.output()}"
    finally:
        with contextlib.suppress(PolluxError):
            active = [
                job["id"]
                for job in client.request("status", all=True)["jobs"]
                if job["state"] not in ("succeeded", "failed", "cancelled")
            ]
            if active:
                client.request("cancel", ids=active)
