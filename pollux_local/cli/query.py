"""``pollux-local status (ls) | show | logs | nodes``: reading the daemon's state."""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable

from pollux_local.api.errors import PolluxError
from pollux_local.api.messages import JobSummary, Logs, LogsReply, Nodes, Show
from pollux_local.api.states import JobState
from pollux_local.cli.common import (
    client_for,
    job_id,
    json_parser,
    print_json,
    state_dir_parser,
)
from pollux_local.cli.format import (
    batch,
    dependency,
    duration,
    fit_line,
    fmt,
    node_line,
    status_table,
    terminal_width,
    timestamp,
    where,
)
from pollux_local.cli.groups import group_name
from pollux_local.client import STATUS_PAGE, Client, job_list
from pollux_local.durations import format_duration
from pollux_local.untrusted import PartialEscape, printable


def _states(values: list[str] | None, active: bool) -> list[JobState] | None:
    """``--state`` (repeatable, or comma-separated) and ``--active`` as one list of states."""
    states: list[JobState] = []
    for value in values or []:
        for name in filter(None, (part.strip() for part in value.split(","))):
            try:
                states.append(JobState(name.lower()))
            except ValueError:
                known = ", ".join(state.value for state in JobState)
                raise PolluxError(f"--state: no state {name!r} (states: {known})") from None
    if active:
        states = [s for s in states if s.active] if states else [s for s in JobState if s.active]
        if not states:
            raise PolluxError("--active and --state name no state in common")
    return list(dict.fromkeys(states)) or None


def cmd_status(args: argparse.Namespace) -> int:
    """Jobs as :func:`~pollux_local.client.job_list` lists them: the daemon filters
    (``--user``, ``--group``, ``--state``, ``--active``); every active job and the finished
    ones of the last 24 h unless ``--all``; ``--limit N``: the newest N."""
    client = client_for(args)
    reply = job_list(
        client.call,
        user=args.user,
        group=args.group,
        states=_states(args.state, args.active),
        limit=args.limit,
        every=args.all,
    )
    jobs = list(reply.jobs)
    if args.json:
        print_json({"jobs": jobs, "more": reply.more, "hidden": reply.hidden})
        return 0
    width = terminal_width()
    print(status_table(jobs, expand=args.expand, width=width) if jobs else "no jobs")
    notes = []
    if reply.more:
        notes.append(f"{reply.more} older job(s) not shown (--limit N, --all)")
    if reply.hidden:
        notes.append(f"{reply.hidden} job(s) finished over 24 h ago not shown (--all)")
    if notes:
        print("; ".join(notes))
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    reply = client_for(args).call(Show(id=job_id(args.id)))
    if args.json:
        print_json(reply)
        return 0
    job = reply.job
    bounds = job.batch_bounds
    lines = [
        f"job {job.id}  {job.name}  ({job.owner})",
        f"  state       {job.state.value}" + (f"  — {job.reason}" if job.reason else ""),
        f"  command     {' '.join(job.argv)}",
        f"  workdir     {job.workdir}",
        f"  devices     {job.gpus} ({where(job.devices)}"
        + (f", {job.device_type}" if job.device_type else "")
        + f"), min {job.min_gpus}, max {fmt(job.max_gpus, empty='any')}",
        f"  batch       {batch(job)}  (base {fmt(bounds.batch_size)}, max "
        f"{fmt(bounds.max_batch_size, empty='any')}, local {fmt(bounds.min_local_batch)}.."
        f"{fmt(bounds.max_local_batch)})",
        f"  goodput     {fmt(job.goodput, '.1f')}  efficiency "
        f"{fmt(job.efficiency, '.2f')}  speedup {fmt(job.speedup, '.2f')}",
        f"  progress    {fmt(job.progress, '.1f')}  epoch {fmt(job.epoch)}  "
        f"metrics {job.metrics}  eta {duration(job.eta_s)}",
        f"  restarts    {job.restarts}  failures {job.failures}  retries"
        f" {job.retries_used}/{job.retries_allowed}",
        f"  resize cost {resize_cost(job.resize_cold_s, job.resizes_cold)} cold,"
        f" {resize_cost(job.resize_warm_s, job.resizes_warm)} warm",
        *begin_lines(job, time.time()),
        *exit_lines(job),
        *forecast_lines(job),
        f"  time limit  {format_duration(job.time_limit_s) if job.time_limit_s else 'none'}"
        + (f"  (ran {duration(job.run_time_s)})" if job.run_time_s else ""),
        f"  depends     {dependency(job)}",
        f"  constraint  {job.constraint.describe() if job.constraint else 'none'}",
        f"  group       {job.group or 'none'}",
        f"  account     {job.account or 'none'}",
        f"  submitted   {timestamp(job.submit_time)}  started {timestamp(job.start_time)}  "
        f"ended {timestamp(job.end_time)}",
        f"  job dir     {job.job_dir}",
    ]
    if job.stdin:
        lines.append(f"  input       --stdin: pollux-local send {job.id} TEXT")
    if job.array_id is not None:
        lines.insert(2, f"  array       {job.array_id}, task {fmt(job.array_index)}")
    lines.append("decisions:")
    for entry in reply.decisions:
        lines.append(f"  {timestamp(entry.time)}  {entry.kind:<10} {entry.reason}")
    # each line is one line: a newline in what a job controls is shown as an escape too,
    # and one wider than the terminal is wrapped behind the labels (``fit_line``)
    width = terminal_width()
    print(
        "\n".join(
            part for line in lines for part in fit_line(printable(line, newline=False), width)
        )
    )
    return 0


def resize_cost(median_s: float | None, count: int) -> str:
    """A measured resize downtime: ``2.6 s (median of 3)``, or ``not measured``."""
    if median_s is None:
        return "not measured"
    return f"{median_s:.1f} s (median of {count})"


def begin_lines(job: JobSummary, now: float) -> list[str]:
    """``show``'s earliest start (``--begin``, ``--delay``), local time and how far off."""
    if job.begin_at is None:
        return []
    off = math.ceil(job.begin_at - now)
    when = f"in {format_duration(off, exact=False, brief=True)}" if off > 0 else "passed"
    return [f"  begin       {timestamp(job.begin_at)}  ({when})"]


def exit_lines(job: JobSummary) -> list[str]:
    """``show``'s exit of the job's latest incarnation that ended: the job's code or signal,
    then each rank's (none before one ended)."""
    if job.exit_code is None and job.exit_signal is None and not job.replica_exits:
        return []

    def said(code: int | None, signal: int | None) -> str:
        return str(code) if code is not None else f"signal {signal}" if signal else "unknown"

    ranks = "; ".join(
        f"rank {r.rank} on {r.node}: {said(r.code, r.signal)}" for r in job.replica_exits
    )
    return [
        f"  exit        {said(job.exit_code, job.exit_signal)}" + (f"  ({ranks})" if ranks else "")
    ]


def forecast_lines(job: JobSummary) -> list[str]:
    """``show``'s forecast of a queued or running job: expected start and finish (the
    daemon's forecast, ``unknown`` without one; ``by ... at the latest`` where it is an upper
    bound: it rests on a job of unknown length run until its time limit)."""
    if job.state not in (JobState.QUEUED, JobState.RUNNING, JobState.RESCALING):
        return []

    def when(stamp: float | None, at_latest: bool) -> str:
        if not stamp:
            return "unknown"
        return f"by {timestamp(stamp)} at the latest" if at_latest else timestamp(stamp)

    start = (
        ""
        if job.state is not JobState.QUEUED
        else f"start {when(job.expected_start, job.expected_start_at_latest)}  "
    )
    finish = when(job.expected_finish, job.expected_finish_at_latest)
    devices = f"  on {job.expected_devices} device(s)" if job.expected_devices else ""
    return [f"  expected    {start}finish {finish}{devices}"]


def cmd_logs(args: argparse.Namespace) -> int:
    """A job's output.  On a terminal (or with ``--safe``) every control character but colours,
    newlines and tabs is shown as an escape (``untrusted.printable_log``): a job's output must
    not retitle, clear or move the cursor of the reader's terminal; piped (or with ``--raw``)
    it is written as the job wrote it, like ``cat``."""
    safe = sys.stdout.isatty() if args.safe is None else args.safe
    offset = -abs(args.tail) if args.tail else 0
    client, ident = client_for(args), job_id(args.id)
    state = print_log(
        client, ident, args.rank, offset=offset, safe=safe, follow=args.follow,
        on_poll=NotStarted(client, ident),
    )  # fmt: skip
    if not args.follow:
        return 0
    # `logs -f` ends with the job: its exit status says how the job ended
    return 0 if state is JobState.SUCCEEDED else 1


class NotStarted:
    """Says once on stderr, at the first look, that a job whose log is empty has not started
    yet, and why (``job 7 has not started: queued: waiting: ...``): ``logs`` of such a job
    printed nothing at all, and ``logs -f`` waited without a word."""

    def __init__(self, client: Client, ident: str) -> None:
        self.client, self.ident, self.looked = client, ident, False

    def __call__(self, reply: LogsReply) -> None:
        if self.looked:
            return
        self.looked = True
        if reply.size > 0 or reply.state not in (JobState.QUEUED, JobState.HELD):
            return
        job = self.client.call(Show(id=self.ident)).job
        if job.start_time is None:
            said = f": {job.reason}" if job.reason else ""
            line = f"job {self.ident} has not started: {job.state.value}{said}"
            sys.stderr.write(printable(line, newline=False) + "\n")
            sys.stderr.flush()


def print_log(
    client: Client,
    ident: str,
    rank: int,
    *,
    offset: int = 0,
    safe: bool,
    follow: bool,
    on_poll: Callable[[LogsReply], None] | None = None,
    write: Callable[[str], None] | None = None,
) -> JobState:
    """Write rank ``rank``'s log of job ``ident`` from ``offset`` (escaped when ``safe``) to
    stdout, or through ``write``; with ``follow``, until the job has ended (``on_poll`` sees
    each reply that caught up with the log, before the next look).  Returns the job's state
    at the end."""
    out = write or _to_stdout
    stream = PartialEscape() if safe else None
    while True:
        reply = client.call(Logs(id=ident, rank=rank, offset=offset))
        if reply.data:
            out(stream.feed(reply.data) if stream else reply.data)
        offset = reply.offset
        if reply.offset < reply.size:
            continue
        if stream:
            out(stream.flush())
        if on_poll is not None:
            on_poll(reply)
        if not follow or reply.state.terminal:
            return reply.state
        time.sleep(0.5)


def _to_stdout(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def cmd_nodes(args: argparse.Namespace) -> int:
    reply = client_for(args).call(Nodes())
    if args.json:
        print_json(reply)
        return 0
    for node in reply.nodes:
        print(printable(node_line(node), newline=False))
        if node.busy:
            print(printable(f"  busy outside the scheduler: {', '.join(node.busy)}", newline=False))
        if node.withheld:
            print(printable(f"  withheld from new jobs: {', '.join(node.withheld)}", newline=False))
        if node.stopping:
            held = ", ".join(f"{d}→job {node.jobs.get(d, '?')}" for d in node.stopping)
            print(printable(f"  stopping, held until their processes are gone: {held}"))
    return 0


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if not 1 <= value <= 10_000:
        raise argparse.ArgumentTypeError(f"expected 1 to 10000, got {value}")
    return value


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    common, as_json = state_dir_parser(), json_parser()
    p = subparsers.add_parser("status", aliases=["ls"], parents=[common, as_json], help="list jobs")
    p.add_argument("--active", action="store_true", help="only jobs not finished")
    p.add_argument(
        "--all", action="store_true", help="finished jobs of any age (default: the last 24 h)"
    )
    p.add_argument("--user", metavar="NAME", help="only this user's jobs")
    p.add_argument("--group", type=group_name, metavar="NAME", help="only this group's jobs")
    p.add_argument(
        "--state",
        action="append",
        metavar="STATE",
        help="only jobs in this state (repeat, or comma-separated: running,queued)",
    )
    p.add_argument(
        "--limit",
        type=_positive,
        metavar="N",
        help=(
            "the newest N jobs (default: every active job and the newest"
            f" {STATUS_PAGE} that finished in the last 24 h; --all alone: every job)"
        ),
    )
    p.add_argument(
        "--expand",
        "-e",
        action="store_true",
        help="list each task of an array (default: one line per array)",
    )
    p.set_defaults(func=cmd_status)

    p = subparsers.add_parser("show", parents=[common, as_json], help="one job in detail")
    p.add_argument("id", help="the job's id")
    p.set_defaults(func=cmd_show)

    p = subparsers.add_parser("logs", parents=[common], help="a job's output")
    p.add_argument("id", help="the job's id")
    p.add_argument(
        "-f",
        "--follow",
        action="store_true",
        help="keep printing until the job ends; exit 0 only if it succeeded",
    )
    p.add_argument("--rank", type=int, default=0, help="which replica (default 0)")
    p.add_argument("--tail", type=int, metavar="BYTES", help="start this many bytes from the end")
    shown = p.add_mutually_exclusive_group()
    shown.add_argument(
        "--safe",
        action="store_true",
        default=None,
        help="show control characters as escapes (\\x1b), colours aside"
        " (the default when the output is a terminal)",
    )
    shown.add_argument(
        "--raw",
        dest="safe",
        action="store_false",
        help="write the output as the job wrote it (the default when piped)",
    )
    p.set_defaults(func=cmd_logs)

    p = subparsers.add_parser("nodes", parents=[common, as_json], help="nodes and devices")
    p.set_defaults(func=cmd_nodes)
