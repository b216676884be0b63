"""``pollux-local completion bash|zsh|fish``: print the shell code that completes commands,
options and job ids (``argcomplete``).

    eval "$(pollux-local completion bash)"                 # in ~/.bashrc
    pollux-local completion fish > ~/.config/fish/completions/pollux-local.fish
"""

from __future__ import annotations

import argparse
from typing import Any

SHELLS = ("bash", "zsh", "fish")


def job_ids(prefix: str, parsed_args: argparse.Namespace, **_: Any) -> list[str]:
    """Completion of a job id: the ids of the jobs the daemon knows (nothing if it is down)."""
    from pollux_local.api.errors import PolluxError
    from pollux_local.api.messages import Status
    from pollux_local.cli.common import client_for

    try:
        reply = client_for(parsed_args).call(Status())
    except (PolluxError, OSError):
        return []
    return [job.id for job in reply.jobs if job.id.startswith(prefix)]


def cmd_completion(args: argparse.Namespace) -> int:
    from argcomplete.shell_integration import shellcode

    print(shellcode(["pollux-local"], shell=args.shell), end="")
    return 0


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "completion",
        help="print shell completion code (bash, zsh or fish)",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument("shell", choices=SHELLS, help="the shell to complete in")
    p.set_defaults(func=cmd_completion)


def autocomplete(parser: argparse.ArgumentParser) -> None:
    """Answer a completion request from the shell (and exit), when this run is one; mark the
    job-id arguments so that they complete from the daemon's jobs."""
    import os

    if "_ARGCOMPLETE" not in os.environ:
        return
    import argcomplete

    for action in _id_actions(parser):
        action.completer = job_ids  # type: ignore[attr-defined]
    argcomplete.autocomplete(parser)


def _id_actions(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    found: list[argparse.Action] = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found.extend(_id_actions(sub))
        elif action.dest in ("id", "ids", "arrays"):
            found.append(action)
    return found
