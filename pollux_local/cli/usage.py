"""``pollux-local usage [--user U] [--by account] [--since DATE] [--json]``: accounting from
the job history.

Device-hours held (devices allocated x time, in all and by device type), device-hours used
(held hours weighed by the statistical efficiency of the batch each job ran at, from its
latest report; "-" when no job reported one), the median wait from submit to first start, and
the jobs run, succeeded, failed and cancelled, per user or (``--by account``) per account the
jobs were charged to (``submit --account``), most device-hours first, and in total.  A job
counts when it ran and is still active or ended in the period; ``--since``
takes a date (``2026-11-01``), an ISO date and time, or a time ago (``7d``, ``30d``,
``12h``)."""

from __future__ import annotations

import argparse
import time

from pollux_local.api.messages import DeviceUsage, Usage, UsageReply
from pollux_local.cli.common import client_for, json_parser, print_json, state_dir_parser
from pollux_local.cli.format import duration, table, timestamp
from pollux_local.parsing import parse_since
from pollux_local.untrusted import printable


def hours(value: float) -> str:
    """Device-hours with two decimals (``0.00`` stays visible as used-but-little)."""
    return f"{value:.2f}"


def used(row: DeviceUsage) -> str:
    """Device-hours used, with the held hours they were measured on when those are not all
    (``-``: nothing measured)."""
    if row.used_device_hours is None:
        return "-"
    if row.measured_device_hours < row.device_hours * (1 - 1e-9):
        return f"{hours(row.used_device_hours)} of {hours(row.measured_device_hours)}"
    return hours(row.used_device_hours)


def usage_table(reply: UsageReply) -> str:
    """One row per user (or account) and the total: device-hours held, then by type, used,
    the median wait, then the job counts."""
    types = sorted({kind for row in [*reply.users, reply.total] for kind in row.by_type})
    by_account = any(row.account is not None for row in reply.users)
    header = ("ACCOUNT" if by_account else "USER", "DEVICE-HOURS", *(f"{t} h" for t in types),
              "USED h", "MEDIAN WAIT", "JOBS", "SUCCEEDED", "FAILED", "CANCELLED",
              "RUNNING")  # fmt: skip

    def line(row: DeviceUsage, name: str) -> tuple[str, ...]:
        return (
            name,
            hours(row.device_hours),
            *(hours(row.by_type.get(t, 0.0)) for t in types),
            used(row),
            duration(row.median_wait_s),
            str(row.jobs),
            str(row.succeeded),
            str(row.failed),
            str(row.cancelled),
            str(row.running),
        )

    def name(row: DeviceUsage) -> str:
        if row.account is None:
            return row.user
        return row.account or "(none)"

    rows = [header, *(line(row, name(row)) for row in reply.users), line(reply.total, "total")]
    return table(rows, numeric_from=1)


def cmd_usage(args: argparse.Namespace) -> int:
    since = parse_since(args.since, time.time()) if args.since else None
    reply = client_for(args).call(Usage(user=args.user, since=since, by=args.by))
    if args.json:
        print_json(reply)
        return 0
    period = f"since {timestamp(reply.since)}" if reply.since is not None else "all history"
    who = f"user {args.user}, " if args.user else ""
    print(printable(f"usage ({who}{period})"))
    if not reply.users:
        print("no job ran in this period")
        return 0
    print(printable(usage_table(reply)))
    return 0


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "usage",
        parents=[state_dir_parser(), json_parser()],
        help="device-hours held and used, waits and jobs per user, from the job history",
        description=__doc__.split("\n\n", 1)[1] if __doc__ else None,
    )
    p.add_argument("--user", metavar="NAME", help="only this user")
    p.add_argument(
        "--by",
        choices=("user", "account"),
        default="user",
        help="one row per user (the default) or per account the jobs were charged to",
    )
    p.add_argument(
        "--since",
        metavar="DATE",
        help="the start of the period: 2026-11-01, 2026-11-01T08:30, or a time ago (7d, 12h);"
        " default: all history",
    )
    p.set_defaults(func=cmd_usage)
