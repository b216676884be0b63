"""``pollux-local group list | set | delete | pause | resume``: groups of jobs with their own
caps (``submit --group NAME``).

An admin's group is a ``[groups.NAME]`` table of the daemon's config (any job may join it; an
admin pauses it); a user makes up to ``[limits] user_groups`` groups of their own (only their
jobs may join them).  Pausing a group keeps its queued jobs from starting; its running jobs go
on."""

from __future__ import annotations

import argparse
import re

from msgspec import UNSET

from pollux_local.api.messages import (
    DeleteGroup,
    GroupReply,
    GroupRow,
    ListGroups,
    PauseGroup,
    ResumeGroup,
    SetGroup,
)
from pollux_local.cli.common import client_for, json_parser, print_json, state_dir_parser
from pollux_local.cli.format import fmt, table

_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


def group_name(text: str) -> str:
    """A group's name as ``--group`` and ``group`` take it (letters, digits, ``_.-``)."""
    if not _NAME.match(text):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a group name (letters, digits and _.-, at most 64)"
        )
    return text


def cap(text: str) -> int | None:
    """``--max-devices`` / ``--max-running``: a whole number from 1, or ``none`` (no cap)."""
    if text.strip().lower() == "none":
        return None
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a whole number or 'none', got {text!r}"
        ) from None
    if not 1 <= value <= 1_000_000:
        raise argparse.ArgumentTypeError(f"expected 1 to 1000000 or 'none', got {value}")
    return value


def _used(held: int, most: int | None) -> str:
    return f"{held}/{fmt(most, empty='-')}"


def groups_table(groups: list[GroupRow]) -> str:
    """One line per group: its owner (``admin``: the config's), devices held and running jobs
    against its caps, queued jobs, and whether it is paused."""
    if not groups:
        return "no groups"
    rows = [["GROUP", "OWNER", "STATE", "DEVICES", "RUNNING", "QUEUED"]]
    for group in groups:
        rows.append(
            [
                group.name,
                group.owner if group.owner is not None else "(admin)",
                "paused" if group.paused else "open",
                _used(group.devices, group.max_devices),
                _used(group.running, group.max_running),
                str(group.queued),
            ]
        )
    return table(rows, numeric_from=3)


def _print(reply: GroupReply, as_json: bool, done: str) -> None:
    if as_json:
        print_json(reply)
        return
    group = reply.group
    print(
        f"group {group.name} {done}: max devices {fmt(group.max_devices, empty='none')}, max"
        f" running {fmt(group.max_running, empty='none')}"
        + (", paused (its queued jobs wait; running ones go on)" if group.paused else "")
    )


def cmd_list(args: argparse.Namespace) -> int:
    reply = client_for(args).call(ListGroups())
    if args.json:
        print_json(reply)
    else:
        print(groups_table(reply.groups))
    return 0


def cmd_set(args: argparse.Namespace) -> int:
    request = SetGroup(name=args.name, max_devices=args.max_devices, max_running=args.max_running)
    _print(client_for(args).call(request), args.json, "set")
    return 0


def cmd_delete(args: argparse.Namespace) -> int:
    _print(client_for(args).call(DeleteGroup(name=args.name)), args.json, "deleted")
    return 0


def cmd_pause(args: argparse.Namespace) -> int:
    _print(client_for(args).call(PauseGroup(name=args.name)), args.json, "paused")
    return 0


def cmd_resume(args: argparse.Namespace) -> int:
    _print(client_for(args).call(ResumeGroup(name=args.name)), args.json, "resumed")
    return 0


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    common, as_json = state_dir_parser(), json_parser()
    p = subparsers.add_parser(
        "group",
        help="groups of jobs with their own caps: list, set, delete, pause, resume",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
    )
    commands = p.add_subparsers(dest="group_command", metavar="COMMAND", required=True)

    q = commands.add_parser(
        "list", parents=[common, as_json], help="every group, its caps, jobs and pause"
    )
    q.set_defaults(func=cmd_list)

    q = commands.add_parser(
        "set",
        parents=[common, as_json],
        help="make one of your own groups, or change its caps",
        description="Make one of your own groups (only your jobs may join it), or change its"
        " caps; a cap not given is kept (a new group: none).",
    )
    q.add_argument("name", type=group_name, metavar="NAME")
    q.add_argument(
        "--max-devices",
        type=cap,
        default=UNSET,
        metavar="N",
        help="devices its jobs may hold at once ('none': no cap)",
    )
    q.add_argument(
        "--max-running",
        type=cap,
        default=UNSET,
        metavar="N",
        help="its jobs running at once ('none': no cap)",
    )
    q.set_defaults(func=cmd_set)

    for name, func, text in (
        ("delete", cmd_delete, "delete one of your groups (no job may be queued or running in it)"),
        ("pause", cmd_pause, "keep a group's queued jobs from starting (running ones go on)"),
        ("resume", cmd_resume, "let a paused group's queued jobs start again"),
    ):
        q = commands.add_parser(name, parents=[common, as_json], help=text)
        q.add_argument("name", type=group_name, metavar="NAME")
        q.set_defaults(func=func)
