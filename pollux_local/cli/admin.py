"""``pollux-local drain | resume``: an admin withholds a node or a device from new jobs, and
gives it back.  Jobs already running there go on; the drained set outlives a daemon restart."""

from __future__ import annotations

import argparse
import re

from pollux_local.api.errors import PolluxError
from pollux_local.api.messages import Drain, DrainReply, Resume
from pollux_local.cli.common import client_for, json_parser, print_json, state_dir_parser

_TARGET = re.compile(r"^[A-Za-z0-9_.:@+-]{1,256}$")
TARGET_HELP = "a node (box2), a device of this machine (cuda:3) or a node's device (box2:cuda:3)"


def _target(verb: str, text: str) -> str:
    if not _TARGET.match(text):
        raise PolluxError(
            f"{verb}: {text!r} is not a node or device name (box2, cuda:3, box2:cuda:3)"
        )
    return text


def _print(reply: DrainReply, as_json: bool) -> None:
    if as_json:
        print_json(reply)
    elif reply.withheld:
        print(f"withheld from new jobs: {', '.join(reply.withheld)}")
    else:
        print("nothing is drained")


def cmd_drain(args: argparse.Namespace) -> int:
    _print(client_for(args).call(Drain(target=_target("drain", args.target))), args.json)
    return 0


def cmd_resume(args: argparse.Namespace) -> int:
    _print(client_for(args).call(Resume(target=_target("resume", args.target))), args.json)
    return 0


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    common, as_json = state_dir_parser(), json_parser()
    p = subparsers.add_parser(
        "drain",
        parents=[common, as_json],
        help="withhold a node or device from new jobs (admin)",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
    )
    p.add_argument("target", metavar="NODE|DEVICE", help=TARGET_HELP)
    p.set_defaults(func=cmd_drain)

    p = subparsers.add_parser(
        "resume",
        parents=[common, as_json],
        help="give a drained node or device back to the scheduler (admin)",
    )
    p.add_argument("target", metavar="NODE|DEVICE", help=TARGET_HELP)
    p.set_defaults(func=cmd_resume)
