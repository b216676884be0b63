"""docs/comparison.md is kept true: every ``pollux-local`` command and option it names exists
in the CLI, and every ``[section] key`` it names is a key the config accepts."""

from __future__ import annotations

import argparse
import re
import shlex

from pollux_local.cli import build_parser
from pollux_local.daemon.config import KNOWN_KEYS
from tests.paths import REPO_ROOT

PAGE = REPO_ROOT / "docs" / "comparison.md"


def table_rows() -> list[list[str]]:
    rows = []
    for line in PAGE.read_text().splitlines():
        if line.startswith("|") and not line.startswith("|---"):
            rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return rows[1:]  # the header


def subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    raise AssertionError("the CLI has no sub-commands")


def test_every_command_and_option_named_exists() -> None:
    commands = subcommands()
    named = 0
    for row in table_rows():
        ours = row[1]
        for snippet in re.findall(r"`(pollux-local [^`]+)`", ours):
            argv = shlex.split(snippet)
            assert argv[1] in commands, f"{snippet!r}: no command {argv[1]!r}"
            options = {
                option for action in commands[argv[1]]._actions for option in action.option_strings
            }
            for word in argv[2:]:
                if word.startswith("--"):
                    assert word.split("=")[0] in options, f"{snippet!r}: no option {word!r}"
            named += 1
    assert named >= 15


def test_every_config_key_named_exists() -> None:
    checked = 0
    for row in table_rows():
        for section, keys in re.findall(r"`\[(\w+)\] ([^`]+)`", row[1]):
            first = keys.split("=")[0].strip()
            assert first in KNOWN_KEYS[section], f"[{section}] {first}"
            checked += 1
            for other in re.findall(r"`(\w+)`", row[1].split(f"[{section}]", 1)[1]):
                assert other in KNOWN_KEYS[section], f"[{section}] {other}"
    assert checked >= 4


def test_pollux_local_has_every_feature_it_lists() -> None:
    for row in table_rows():
        assert row[1] not in ("—", "", "no"), row[0]
        assert len(row) == 6, row
