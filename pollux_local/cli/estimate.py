"""``pollux-local estimate [SUBMIT OPTIONS] COMMAND [ARGS...]`` (and ``submit --dry-run``):
when would this job run if it were submitted now.

The daemon checks the request as it checks a submit, adds the job to its live state and replays
the scheduling pass forward (``daemon/forecasting.py``); nothing is queued.  The answer: the
expected start and finish, on how many devices of which type, what the job waits for, and the
running time expected of it (its kind's typical length: the median of its owner's finished
jobs running the same command; unknown when none finished).  A job of unknown length with a
time limit (``--time``) is counted running until its limit, the worst case: a start or finish
resting on that says "by 19:04:05 at the latest", an upper bound, not an expectation.
"""

from __future__ import annotations

import argparse
import datetime

from pollux_local.api.messages import Estimate, EstimateReply, JobForecast
from pollux_local.cli.common import client_for, print_json
from pollux_local.cli.format import duration
from pollux_local.cli.submit import build_submit_request
from pollux_local.untrusted import printable


def _when(stamp: float | None, now: float, at_latest: bool = False) -> str:
    """``now``, ``in 4m07s (19:04:05)``, ``by 19:04:05 at the latest (in 4m07s)`` (an upper
    bound) or ``unknown``."""
    if stamp is None:
        return "unknown"
    if stamp - now < 1:
        return "now"
    clock = datetime.datetime.fromtimestamp(stamp).strftime("%H:%M:%S")
    if at_latest:
        return f"by {clock} at the latest (in {duration(stamp - now)})"
    return f"in {duration(stamp - now)} ({clock})"


def forecast_line(job: JobForecast, now: float) -> str:
    """One job's forecast as one line."""
    devices = f"{job.devices} device{'s' if job.devices != 1 else ''}"
    if job.device_type:
        devices += f" ({job.device_type})"
    if job.length_s is not None:
        length = f"expected to run {duration(job.length_s)}"
    elif job.start is not None and job.finish is not None and job.finish_at_latest:
        # no length known, a finish all the same: the job is replayed until its time limit
        length = f"runs at most {duration(job.finish - job.start)} (its time limit)"
    else:
        length = "expected to run unknown"
    parts = [
        f"{job.name}: starts {_when(job.start, now, job.start_at_latest)}",
        f"finishes {_when(job.finish, now, job.finish_at_latest)}",
        f"on {devices}",
        length,
    ]
    line = ", ".join(parts)
    return line + (f"; {job.waiting}" if job.waiting else "")


def print_estimate(reply: EstimateReply, as_json: bool) -> None:
    if as_json:
        print_json(reply)
        return
    for job in reply.jobs:
        print(printable(forecast_line(job, reply.now), newline=False))


def cmd_estimate(args: argparse.Namespace) -> int:
    reply = client_for(args).call(Estimate(submit=build_submit_request(args)))
    print_estimate(reply, args.json)
    return 0


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """``estimate`` takes exactly ``submit``'s options (registered before it)."""
    submit = subparsers.choices["submit"]
    p = subparsers.add_parser(
        "estimate",
        parents=[submit],
        add_help=False,
        help="when would a job run if submitted now (nothing is queued)",
        usage="%(prog)s [SUBMIT OPTIONS] COMMAND [ARGS...]",
        description=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="example:\n  pollux-local estimate --gpus 2 train.py --epochs 5",
    )
    p.set_defaults(func=cmd_estimate, dry_run=False)
