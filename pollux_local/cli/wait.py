"""``pollux-local wait ID... | --all | --array ID | --group NAME``: block until the jobs end;
exit 0 only if all succeeded.

``--all`` waits for the caller's jobs that are active (queued, held, running) when the wait
starts; ``--array ID`` for every task of the array ``ID`` (its first task's id), whoever's;
``--group NAME`` for the jobs of the group that are active when the wait starts (an admin's
group: whoever's; a user's group: its owner's alone, as ``groups`` counts them).
They combine with ids and with each other: the wait is for every job named.  A wait for a few
ids looks at each job (``show``); one for a set found by ``--all``, ``--array`` or ``--group``
looks at the active jobs of their owners in one ``status`` page per round, and shows a job only
once it left them, for its final state and reason.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from pollux_local.api.errors import PolluxError
from pollux_local.api.messages import JobSummary, ListGroups, Ping, Show, Status
from pollux_local.api.states import JobState
from pollux_local.cli.common import (
    client_for,
    job_id,
    json_parser,
    print_json,
    state_dir_parser,
)
from pollux_local.cli.groups import group_name
from pollux_local.client import Client, status_pages
from pollux_local.parsing import parse_job_ids
from pollux_local.untrusted import printable

#: Exit status of ``wait`` when a job ended other than succeeded, or the wait timed out.
NOT_ALL_SUCCEEDED = 1


class TimedOut(PolluxError):
    """The wait gave up (``--timeout``): one line, and the exit status of a wait whose jobs
    did not all succeed."""

    exit_code = NOT_ALL_SUCCEEDED


#: The jobs one ``status`` request of the wait asks for.
PAGE = 10_000
#: The states of a job that has not ended.
ACTIVE = [state for state in JobState if state.active]


def _pages(client: Client, request: Status) -> list[JobSummary]:
    """Every job ``request`` matches, page after page."""
    return list(status_pages(client.call, request).jobs)


def _active(client: Client, user: str | None) -> list[JobSummary]:
    """The active jobs of ``user`` (``None``: everyone's)."""
    return _pages(client, Status(user=user, states=ACTIVE, limit=PAGE))


def _array_tasks(client: Client, array: str) -> tuple[list[str], str]:
    """The ids of every task of ``array`` and their owner."""
    first = client.call(Show(id=array)).job
    if first.array_id != first.id:
        raise PolluxError(f"wait --array {array}: job {array} is not an array (wait for its id)")
    tasks = _pages(client, Status(all=True, user=first.owner, limit=PAGE))
    return [job.id for job in tasks if job.array_id == array], first.owner


def _targets(client: Client, args: argparse.Namespace) -> tuple[list[str], set[str]]:
    """The ids to wait for, and the owners whose active jobs are listed each round (empty:
    each job is looked at alone)."""
    ids = [job_id(text) for text in args.ids]
    owners: set[str] = set()
    if args.all:
        me = client.call(Ping()).you.name
        ids += [job.id for job in _active(client, me)]
        owners.add(me)
    for array in parse_job_ids(args.arrays, "--array") if args.arrays else []:
        tasks, owner = _array_tasks(client, array)
        ids += tasks
        owners.add(owner)
    if args.group is not None:
        jobs = _group_jobs(client, args.group)
        ids += [job.id for job in jobs]
        owners.update(job.owner for job in jobs)
    return list(dict.fromkeys(ids)), owners


def _group_jobs(client: Client, group: str) -> list[JobSummary]:
    """The active jobs of ``group`` (a group that does not exist is refused)."""
    jobs = _pages(client, Status(group=group, states=ACTIVE, limit=PAGE))
    if not jobs:
        names = [row.name for row in client.call(ListGroups()).groups]
        if group not in names:
            known = ", ".join(names) or "none"
            raise PolluxError(f"wait --group {group}: no such group (groups: {known})")
    return jobs


def _ended(client: Client, pending: list[str], owners: set[str]) -> list[tuple[str, JobSummary]]:
    """The jobs of ``pending`` that ended, each as ``show`` has it."""
    if owners:
        still = {job.id for owner in owners for job in _active(client, owner)}
        candidates = [ident for ident in pending if ident not in still]
    else:
        candidates = pending
    found: list[tuple[str, JobSummary]] = []
    for ident in candidates:
        job = client.call(Show(id=ident)).job
        if job.state.terminal:
            found.append((ident, job))
    return found


def cmd_wait(args: argparse.Namespace) -> int:
    if not args.ids and not args.all and not args.arrays and args.group is None:
        raise PolluxError("wait needs job ids, --all, --array ID or --group NAME")
    client = client_for(args)
    pending, owners = _targets(client, args)
    if not pending and not args.json and not args.quiet:
        print("no job to wait for")
    ended: dict[str, JobSummary] = {}
    deadline = None if args.timeout is None else time.monotonic() + args.timeout
    while pending:
        for ident, job in _ended(client, pending, owners):
            ended[ident] = job
            pending.remove(ident)
            if not args.json and not args.quiet:
                said = f": {job.reason}" if job.reason else ""
                print(printable(f"job {ident} {job.state.value}{said}", newline=False))
        if not pending:
            break
        if deadline is not None and time.monotonic() >= deadline:
            if args.json:
                print_json({"jobs": _rows(ended), "pending": pending})
            raise TimedOut(
                f"timed out after {args.timeout:g} s waiting for job(s) {', '.join(pending)}"
            )
        time.sleep(args.interval)
    if args.json:
        print_json({"jobs": _rows(ended), "pending": []})
    ok = all(job.state is JobState.SUCCEEDED for job in ended.values())
    return 0 if ok else NOT_ALL_SUCCEEDED


def _rows(ended: dict[str, JobSummary]) -> list[dict[str, Any]]:
    """Each ended job: its state, reason and exit (the job's code or signal, and each rank's:
    ``api.exits``)."""
    return [
        {"id": i, "state": job.state.value, "reason": job.reason, "exit_code": job.exit_code,
         "exit_signal": job.exit_signal, "replica_exits": job.replica_exits}
        for i, job in ended.items()
    ]  # fmt: skip


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "wait",
        parents=[state_dir_parser(), json_parser()],
        help="wait until jobs end (exit 0 only if all succeeded)",
        usage="%(prog)s [ID ...] [--all] [--array ID[,ID...]] [--group NAME] [--timeout S]",
    )
    p.add_argument("ids", nargs="*", metavar="ID", help="job ids")
    p.add_argument(
        "--all", action="store_true", help="every job of yours that has not ended (when it starts)"
    )
    p.add_argument(
        "--array",
        dest="arrays",
        action="append",
        metavar="ID[,ID...]",
        help="every task of this array (its id is its first task's)",
    )
    p.add_argument(
        "--group",
        type=group_name,
        metavar="NAME",
        help="every job of this group that has not ended (when it starts)",
    )
    p.add_argument(
        "--timeout", type=float, metavar="SECONDS", help="give up after this long (exit 1)"
    )
    p.add_argument("--interval", type=float, default=1.0, help="seconds between looks (1)")
    p.add_argument("-q", "--quiet", action="store_true", help="print nothing, only the exit code")
    p.set_defaults(func=cmd_wait)
