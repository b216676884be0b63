"""The ``pollux-local`` command line.

Each group of sub-commands lives in its own module that exposes ``register(subparsers)``; a
sub-command sets ``func`` (taking the parsed namespace, returning an exit code).  Errors the
user can fix are raised as :class:`~pollux_local.errors.PolluxError` and printed as one line.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from pollux_local import __version__
from pollux_local.api.errors import PolluxError
from pollux_local.api.states import ExitCode

#: Modules that contribute sub-commands, in help order.
COMMAND_MODULES = (
    "pollux_local.cli.jobs",
    "pollux_local.cli.simulate",
    "pollux_local.cli.tui",
    "pollux_local.cli.service",
    "pollux_local.cli.completion",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pollux-local",
        description="Goodput-optimising scheduler for shared multi-GPU workstations.",
    )
    parser.add_argument("--version", action="version", version=f"pollux-local {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    parser.set_defaults(available_commands=subparsers.choices)
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:  # a command group not installed in this build
            if exc.name != name:
                raise
            continue
        module.register(subparsers)
    return parser


def parse(parser: argparse.ArgumentParser, argv: Sequence[str]) -> argparse.Namespace:
    """``argv`` parsed, with the words as typed kept as ``typed``: argparse drops a ``--``
    that opens a REMAINDER, which ``edit`` needs to tell its new command from its options."""
    args = parser.parse_args(argv)
    args.typed = list(argv)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; Ctrl-C at any point of it, the start (the imports of the commands'
    modules) included, exits 130 without a traceback."""
    try:
        return _main(argv)
    except KeyboardInterrupt:
        return int(ExitCode.INTERRUPTED)


def _main(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    if argv is None:
        from pollux_local.cli.completion import autocomplete

        autocomplete(parser)  # a shell asking for completions: answered, then exits
    args = parse(parser, sys.argv[1:] if argv is None else argv)
    if args.command is None:
        if sys.stdout.isatty() and "tui" in args.available_commands:
            args = parser.parse_args(["tui"])
        else:
            parser.print_help()
            return 0
    try:
        return int(args.func(args) or 0)
    except PolluxError as exc:  # one line; it may quote what another user's job controls
        from pollux_local.untrusted import printable

        print(printable(f"pollux-local: error: {exc}", newline=False), file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        return int(ExitCode.INTERRUPTED)
    except BrokenPipeError:
        # the reader went away (`status | head`): not an error of ours; keep Python quiet
        import os

        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
