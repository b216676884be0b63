"""``pollux-local wait ID...``: block until the jobs end; exit 0 only if all succeeded."""

from __future__ import annotations

import argparse
import time
from typing import Any

from pollux_local.api.errors import PolluxError
from pollux_local.api.messages import JobSummary, Show
from pollux_local.api.states import JobState
from pollux_local.cli.common import (
    client_for,
    job_id,
    json_parser,
    print_json,
    state_dir_parser,
)
from pollux_local.untrusted import printable

#: Exit status of ``wait`` when a job ended other than succeeded, or the wait timed out.
NOT_ALL_SUCCEEDED = 1


def cmd_wait(args: argparse.Namespace) -> int:
    client = client_for(args)
    pending = [job_id(text) for text in args.ids]
    ended: dict[str, JobSummary] = {}
    deadline = None if args.timeout is None else time.monotonic() + args.timeout
    while pending:
        for ident in list(pending):
            job = client.call(Show(id=ident)).job
            if job.state.terminal:
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
            raise PolluxError(
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
    )
    p.add_argument("ids", nargs="+", metavar="ID", help="job ids")
    p.add_argument("--timeout", type=float, metavar="SECONDS", help="give up after this long")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between looks (1)")
    p.add_argument("-q", "--quiet", action="store_true", help="print nothing, only the exit code")
    p.set_defaults(func=cmd_wait)
