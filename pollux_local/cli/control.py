"""``pollux-local cancel | hold | release | priority``: changing jobs."""

from __future__ import annotations

import argparse

from pollux_local.api.messages import Cancel, Hold, Release, SetPriority
from pollux_local.cli.common import (
    client_for,
    job_id,
    json_parser,
    print_json,
    state_dir_parser,
)


def cmd_cancel(args: argparse.Namespace) -> int:
    reply = client_for(args).call(Cancel(ids=[job_id(i) for i in args.ids]))
    if args.json:
        print_json(reply)
        return 0
    for cancelled in reply.cancelled:
        print(f"cancelled job {cancelled}")
    for entry in reply.skipped:
        print(f"job {entry.id} had already {entry.state.value}")
    return 0


def cmd_hold(args: argparse.Namespace) -> int:
    reply = client_for(args).call(Hold(id=job_id(args.id)))
    if args.json:
        print_json(reply)
    else:
        print(f"job {reply.id} is held")
    return 0


def cmd_release(args: argparse.Namespace) -> int:
    reply = client_for(args).call(Release(id=job_id(args.id)))
    if args.json:
        print_json(reply)
    else:
        print(f"job {reply.id} is queued again")
    return 0


def cmd_priority(args: argparse.Namespace) -> int:
    reply = client_for(args).call(SetPriority(id=job_id(args.id), priority=args.priority))
    if args.json:
        print_json(reply)
    else:
        print(f"job {reply.id} priority {reply.priority}")
    return 0


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    common, as_json = state_dir_parser(), json_parser()
    p = subparsers.add_parser("cancel", parents=[common, as_json], help="cancel jobs")
    p.add_argument("ids", nargs="+", metavar="ID", help="job ids")
    p.set_defaults(func=cmd_cancel)

    p = subparsers.add_parser("hold", parents=[common, as_json], help="stop scheduling a job")
    p.add_argument("id", help="the job's id")
    p.set_defaults(func=cmd_hold)

    p = subparsers.add_parser(
        "release", parents=[common, as_json], help="schedule a held job again"
    )
    p.add_argument("id", help="the job's id")
    p.set_defaults(func=cmd_release)

    p = subparsers.add_parser("priority", parents=[common, as_json], help="set a job's priority")
    p.add_argument("id", help="the job's id")
    p.add_argument("priority", type=int, help="the new priority (higher runs first)")
    p.set_defaults(func=cmd_priority)
