"""``pollux-local cancel | hold | release | priority | restart | edit``: changing jobs."""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

from msgspec import UNSET

from pollux_local.api.errors import PolluxError
from pollux_local.api.messages import (
    Cancel,
    Edit,
    Hold,
    Release,
    Restart,
    SetPriority,
    StateChangeReply,
)
from pollux_local.cli.common import (
    client_for,
    job_id,
    json_parser,
    print_json,
    state_dir_parser,
)
from pollux_local.cli.submit import print_submitted
from pollux_local.parsing import earliest_start, parse_job_ids, parse_time_limit
from pollux_local.submission import command_argv
from pollux_local.untrusted import printable

EDIT_USAGE = (
    "edit ID [--time D | --no-time] [--gpus N | --min-gpus N --max-gpus N] [--priority P]"
    " [--retries N] [--begin WHEN | --delay D] [-- COMMAND ...]"
)


def cmd_cancel(args: argparse.Namespace) -> int:
    arrays = parse_job_ids(args.arrays, "--array") if args.arrays else []
    if not args.ids and not arrays:
        raise PolluxError("cancel needs job ids or --array ID")
    reply = client_for(args).call(Cancel(ids=[job_id(i) for i in args.ids], arrays=arrays))
    if args.json:
        print_json(reply)
        return 0
    for cancelled in reply.cancelled:
        print(f"cancelled job {cancelled}")
    for entry in reply.skipped:
        print(f"job {entry.id} had already {entry.state.value}")
    return 0


def _one_or_all(args: argparse.Namespace, verb: str) -> dict[str, Any]:
    """The fields of a ``hold``/``release``: a job id, or ``--all`` (with ``--user``)."""
    if (args.id is None) == (not args.all):
        raise PolluxError(
            f"{verb}: give a job id or --all, not both" if args.all else f"{verb} needs ID or --all"
        )
    if args.user is not None and not args.all:
        raise PolluxError(f"{verb}: --user goes with --all")
    if args.id is not None:
        return {"id": job_id(args.id)}
    return {"all": True, "user": args.user}


def _print_changed(reply: StateChangeReply, args: argparse.Namespace, now: str, past: str,
                   waiting: str) -> None:  # fmt: skip
    """One line: the job ``now`` (held, queued again), or how many ``--all`` ``past``."""
    if args.json:
        print_json(reply)
        return
    if not args.all:
        print(f"job {reply.ids[0]} is {now}")
    elif reply.ids:
        print(f"{past} {len(reply.ids)} job(s): {', '.join(reply.ids)}")
    else:
        print(f"{past} no job" + ("" if reply.refused else f": none was {waiting}"))
    for ident, why in reply.refused.items():
        print(printable(f"job {ident} left as it was: {why}", newline=False))


def cmd_hold(args: argparse.Namespace) -> int:
    reply = client_for(args).call(Hold(**_one_or_all(args, "hold")))
    _print_changed(reply, args, "held", "held", "queued")
    return 0


def cmd_release(args: argparse.Namespace) -> int:
    reply = client_for(args).call(Release(**_one_or_all(args, "release")))
    _print_changed(reply, args, "queued again", "released", "held")
    return 0


def cmd_priority(args: argparse.Namespace) -> int:
    reply = client_for(args).call(SetPriority(id=job_id(args.id), priority=args.priority))
    if args.json:
        print_json(reply)
    else:
        print(f"job {reply.id} priority {reply.priority}")
    return 0


def cmd_restart(args: argparse.Namespace) -> int:
    old = job_id(args.id)
    reply = client_for(args).call(Restart(id=old, hold=args.hold))
    if args.json:
        print_submitted(reply, True)
    else:
        print(f"job {old} restarted as job {reply.id} ({reply.state.value})")
    return 0


def _gpu_count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected at least 1, got {value}")
    return value


def _upper_bound(text: str) -> int | None:
    """``--max-gpus N`` or ``any`` (no upper bound)."""
    return None if text.strip().lower() == "any" else _gpu_count(text)


def add_edit_options(p: argparse.ArgumentParser) -> None:
    limit = p.add_mutually_exclusive_group()
    limit.add_argument("--time", metavar="DURATION", help="the new time limit (30s, 10m, 2h...)")
    limit.add_argument(
        "--no-time", dest="no_time", action="store_true", default=None, help="remove the time limit"
    )
    p.add_argument("--gpus", type=_gpu_count, metavar="N", help="run on exactly N devices")
    p.add_argument(
        "--min-gpus", dest="min_gpus", type=_gpu_count, metavar="N", help="elastic: fewest devices"
    )
    p.add_argument(
        "--max-gpus",
        dest="max_gpus",
        type=_upper_bound,
        default=UNSET,
        metavar="N",
        help="elastic: most devices (any: no bound)",
    )
    p.add_argument("--priority", type=int, metavar="P", help="the new priority")
    p.add_argument(
        "--retries", type=int, metavar="N", help="restart it after a crash up to N times"
    )
    start = p.add_mutually_exclusive_group()
    start.add_argument(
        "--begin", metavar="WHEN", help="start no earlier than WHEN (as submit; now: at once)"
    )
    start.add_argument(
        "--delay", metavar="DURATION", help="start no earlier than DURATION from now"
    )


def edit_request(args: argparse.Namespace) -> Edit:
    """The ``Edit`` request: options given before or after the id, the new command after
    ``--`` (resolved as ``submit`` resolves one)."""
    rest: list[str] = list(args.rest or [])
    command: list[str] = []
    if getattr(args, "typed", []).count("--") > rest.count("--"):
        rest, command = [], rest  # ``edit ID -- COMMAND``: argparse dropped that ``--``
    elif "--" in rest:
        cut = rest.index("--")
        rest, command = rest[:cut], rest[cut + 1 :]
    if rest:
        # the same options as before the id, the common ones (--state-dir, --json) included
        late = argparse.ArgumentParser(
            prog="pollux-local edit",
            usage=EDIT_USAGE,
            add_help=False,
            parents=[state_dir_parser(), json_parser()],
        )
        add_edit_options(late)
        for action in late._actions:
            action.default = argparse.SUPPRESS  # only what is given here is set
        given, unknown = late.parse_known_args(rest)
        if unknown:
            raise PolluxError(
                f"edit: unexpected {' '.join(unknown)!r}; give a new command after --"
                f" ({EDIT_USAGE})"
            )
        for key, value in vars(given).items():
            setattr(args, key, value)
    fields: dict[str, Any] = {}
    if args.time is not None and args.no_time:
        raise PolluxError("edit: --time and --no-time contradict each other")
    if args.time is not None:
        fields["time_limit_s"] = parse_time_limit(args.time)
    elif args.no_time:
        fields["time_limit_s"] = None
    if args.gpus is not None:
        if args.min_gpus is not None or args.max_gpus is not UNSET:
            raise PolluxError("edit: --gpus N fixes the size: leave out --min-gpus and --max-gpus")
        fields["min_gpus"] = fields["max_gpus"] = args.gpus
    else:
        if args.min_gpus is not None:
            fields["min_gpus"] = args.min_gpus
        if args.max_gpus is not UNSET:
            fields["max_gpus"] = args.max_gpus
    if args.priority is not None:
        fields["priority"] = args.priority
    if args.retries is not None:
        fields["retries"] = args.retries
    begin_at = earliest_start(args.begin, args.delay, time.time(), "edit")
    if begin_at is not None:
        fields["begin_at"] = begin_at
    if command:
        fields["argv"], _ = command_argv(command, os.environ, None)
    if not fields:
        raise PolluxError(f"edit: nothing to change ({EDIT_USAGE})")
    return Edit(id=job_id(args.id), **fields)


def cmd_edit(args: argparse.Namespace) -> int:
    request = edit_request(args)
    reply = client_for(args).call(request)
    if args.json:
        print_json(reply)
    else:
        changed = [
            name
            for name in (
                "argv", "min_gpus", "max_gpus", "time_limit_s", "priority", "retries", "begin_at"
            )
            if getattr(request, name) is not UNSET
        ]  # fmt: skip
        words = {"argv": "command", "time_limit_s": "time limit", "begin_at": "earliest start"}
        print(f"job {reply.id} edited ({', '.join(words.get(n, n) for n in changed)}),"
              f" {reply.state.value}")  # fmt: skip
    return 0


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    common, as_json = state_dir_parser(), json_parser()
    p = subparsers.add_parser(
        "cancel",
        parents=[common, as_json],
        help="cancel jobs (or every task of an array)",
        usage="%(prog)s [--array ID[,ID...]] [ID ...]",
    )
    p.add_argument("ids", nargs="*", metavar="ID", help="job ids")
    p.add_argument(
        "--array",
        dest="arrays",
        action="append",
        metavar="ID[,ID...]",
        help="every task of this array (its id is its first task's)",
    )
    p.set_defaults(func=cmd_cancel)

    p = subparsers.add_parser(
        "hold",
        parents=[common, as_json],
        help="stop scheduling a job, or all your queued jobs (--all)",
        usage="%(prog)s ID | --all [--user NAME]",
    )
    p.add_argument("id", nargs="?", help="the job's id")
    p.add_argument(
        "--all", action="store_true", help="every queued job of yours (running ones keep running)"
    )
    p.add_argument("--user", metavar="NAME", help="admins, with --all: NAME's jobs, not yours")
    p.set_defaults(func=cmd_hold)

    p = subparsers.add_parser(
        "release",
        parents=[common, as_json],
        help="schedule a held job again, or all your held jobs (--all)",
        usage="%(prog)s ID | --all [--user NAME]",
    )
    p.add_argument("id", nargs="?", help="the job's id")
    p.add_argument("--all", action="store_true", help="every held job of yours")
    p.add_argument("--user", metavar="NAME", help="admins, with --all: NAME's jobs, not yours")
    p.set_defaults(func=cmd_release)

    p = subparsers.add_parser("priority", parents=[common, as_json], help="set a job's priority")
    p.add_argument("id", help="the job's id")
    p.add_argument("priority", type=int, help="the new priority (higher runs first)")
    p.set_defaults(func=cmd_priority)

    p = subparsers.add_parser(
        "restart",
        parents=[common, as_json],
        help="submit a job that ended again (same command and options, new id)",
    )
    p.add_argument("id", help="the job's id")
    p.add_argument("--hold", action="store_true", help="submit it held")
    p.set_defaults(func=cmd_restart)

    p = subparsers.add_parser(
        "edit",
        parents=[common, as_json],
        help="change a queued or held job (command, devices, time limit, priority, retries,"
        " earliest start)",
        usage=f"%(prog)s {EDIT_USAGE.removeprefix('edit ')}",
        epilog="examples:\n"
        "  pollux-local edit 12 --time 4h\n"
        "  pollux-local edit 12 --gpus 2 --priority 5\n"
        "  pollux-local edit 12 --retries 3 --begin 22:00\n"
        "  pollux-local edit 12 -- train.py --lr 0.05",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_edit_options(p)
    p.add_argument("id", help="the job's id")
    p.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    p.set_defaults(func=cmd_edit)
