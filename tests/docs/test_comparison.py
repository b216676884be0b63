"""docs/comparison.md is kept true: every ``pollux-local`` command and option it names exists
in the CLI, every ``[section] key`` it names is a key the config accepts, and the count at its
top (how many of the features another tool offers pollux-local has) is the table's."""

from __future__ import annotations

import argparse
import re
import shlex

from pollux_local.cli import build_parser
from pollux_local.daemon.config import KNOWN_KEYS
from tests.paths import REPO_ROOT

PAGE = REPO_ROOT / "docs" / "comparison.md"


def table_rows() -> list[list[str]]:
    """The cells of the feature table (the one whose header starts ``| Feature |``)."""
    rows: list[list[str]] = []
    inside = False
    for line in PAGE.read_text().splitlines():
        if line.startswith("| Feature |"):
            inside = True
        elif not line.startswith("|"):
            inside = False
        elif inside and not line.startswith("|---"):
            rows.append([cell.strip() for cell in line.strip("|").split("|")])
    return rows


def subcommands(
    parser: argparse.ArgumentParser | None = None,
) -> dict[str, argparse.ArgumentParser]:
    """The sub-commands of ``parser`` (default: the CLI's), by name; empty when it has none."""
    for action in (parser or build_parser())._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def command_parser(argv: list[str]) -> tuple[argparse.ArgumentParser, list[str]]:
    """The parser of the (sub-)command ``argv`` names (``pollux-local group set NAME``: the
    parser of ``group set``) and the words after that command."""
    commands = subcommands()
    assert commands, "the CLI has no sub-commands"
    assert argv[1] in commands, f"{shlex.join(argv)!r}: no command {argv[1]!r}"
    parser, rest = commands[argv[1]], argv[2:]
    nested = subcommands(parser)
    while nested and rest and not rest[0].startswith("-"):
        assert rest[0] in nested, f"{shlex.join(argv)!r}: no command {argv[1]} {rest[0]!r}"
        parser, rest = nested[rest[0]], rest[1:]
        nested = subcommands(parser)
    return parser, rest


def test_every_command_and_option_named_exists() -> None:
    named = 0
    for row in table_rows():
        ours = row[1]
        for snippet in re.findall(r"`(pollux-local [^`]+)`", ours):
            parser, words = command_parser(shlex.split(snippet))
            options = {option for action in parser._actions for option in action.option_strings}
            for word in words:
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


def offers(cell: str) -> bool:
    """Does a cell say the tool offers the feature, fully or in part ("—" says it does not)?"""
    return not cell.startswith("—")


def fully(cell: str) -> bool:
    return offers(cell) and not cell.startswith("partly")


def test_every_row_has_a_cell_per_tool() -> None:
    rows = table_rows()
    assert len(rows) >= 30
    for row in rows:
        assert len(row) == 6, row
        assert all(row), f"an empty cell in {row[0]!r}"
    assert len({row[0] for row in rows}) == len(rows), "a feature named twice"


def test_the_count_at_the_top_is_the_tables() -> None:
    """ "pollux-local has N of the M features below that at least one of the other four tools
    offers": M counts the rows where another tool's cell is not "—", N those of them where
    pollux-local's cell is neither "—" nor "partly"."""
    rows = table_rows()
    others_offer = [row for row in rows if any(offers(cell) for cell in row[2:])]
    ours = [row for row in others_offer if fully(row[1])]
    lacking = [row[0] for row in others_offer if not offers(row[1])]
    match = re.search(
        r"pollux-local has (\d+) of the (\d+) features below that at least one of the other"
        r" four tools offers",
        " ".join(PAGE.read_text().split()),
    )
    assert match, "the count sentence is missing from the top of the page"
    assert (int(match.group(1)), int(match.group(2))) == (len(ours), len(others_offer)), (
        f"the table says {len(ours)} of {len(others_offer)}; lacking: {lacking}"
    )
    written = re.search(r"the (\w+) it lacks (?:is|are) marked", PAGE.read_text())
    words = {1: "one", 2: "two", 3: "three", 4: "four", 5: "five", 6: "six"}
    assert written and written.group(1) == words.get(len(others_offer) - len(ours)), lacking
