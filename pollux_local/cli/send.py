"""``pollux-local send ID TEXT...``: send a line of input to a running job's rank 0.

A job submitted with ``--stdin`` has rank 0 read its stdin from the FIFO ``JOB_DIR/stdin``,
which rank 0's process makes (or reuses) as the job's user.  ``send`` asks the daemon where
the job stands (``show``: its owner, state, directory and where rank 0 runs), then writes to
the FIFO itself, as the caller: the root daemon never opens it.  The FIFO is opened without
following a symlink and without ever blocking (``O_WRONLY | O_NONBLOCK | O_NOFOLLOW``), and
written to only when it is a FIFO of the caller's own (root: of the job's owner).

``TEXT...`` is sent joined by spaces, with a newline; ``--file F`` sends F's bytes as they are
(``-``: this command's stdin).  Up to ``PIPE_BUF`` (4096) bytes go in one write, whole, never
mixed with what someone else sends at the same time; longer input is written in pieces as the
job reads them (it is given 10 seconds, :data:`SEND_WAIT_S`, to read each), and may
interleave with another sender's.  A job that is not reading its input (starting, restarting, ended) refuses
it at once; nothing is kept for a later incarnation.  Only a job whose rank 0 runs on the
daemon's machine can be reached.
"""

from __future__ import annotations

import argparse
import errno
import os
import pwd
import select
import stat
import sys
import time
from pathlib import Path

from pollux_local.api.errors import Conflict, PermissionDenied, PolluxError
from pollux_local.api.messages import JobDetail, Show
from pollux_local.api.states import PLACED_STATES
from pollux_local.cli.common import client_for, job_id, state_dir_parser
from pollux_local.launch.supervisor import STDIN_NAME

#: Bytes one write delivers whole (POSIX's least ``PIPE_BUF``, Linux's).
PIPE_BUF = getattr(select, "PIPE_BUF", 4096)
#: Seconds a job gets to read more of a long input before ``send`` gives up on the rest.
SEND_WAIT_S = 10.0


DESCRIPTION = """\
Send input to a running job submitted with --stdin: its rank 0 reads it as its stdin.

TEXT... is sent joined by spaces, with a newline; --file F sends F's bytes as they are
(-: this command's stdin).  Up to 4096 bytes arrive in one piece, never mixed with what
someone else sends at the same time; longer input is written as the job reads it.  A job
that is not reading its input now (starting, restarting) refuses it: nothing is kept for
later.  Only a job whose rank 0 runs on the daemon's machine can be reached."""


def user_name(uid: int) -> str | None:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return None


def input_fifo(job: JobDetail, caller_uid: int) -> Path:
    """Where ``job``'s input is sent, once the caller may send it and it reads it: one line
    (:class:`PolluxError`) when not."""
    if caller_uid != 0 and user_name(caller_uid) != job.owner:
        raise PermissionDenied(
            f"permission denied: job {job.id} runs as {job.owner}; only they (or root) may"
            " send it input"
        )
    if not job.stdin:
        raise Conflict(
            f"job {job.id} was not submitted with --stdin: it has no input to send to"
            " (submit it with --stdin)"
        )
    if job.state not in PLACED_STATES:
        raise Conflict(f"job {job.id} is not running ({job.state.value})")
    if job.rank0_local is False:
        node = next((pid.node for pid in job.pids if pid.rank == 0), None)
        where = f" on {node}" if node else " on another node"
        raise Conflict(
            f"job {job.id}'s rank 0 runs{where}: send reaches only jobs whose rank 0 runs on"
            " the daemon's machine"
        )
    return Path(job.job_dir) / STDIN_NAME


def owner_uid(job: JobDetail, caller_uid: int) -> int | None:
    """Whose the FIFO must be: the caller's, or for root the job's owner's (``None``: root,
    and the owner's name is not known here)."""
    if caller_uid != 0:
        return caller_uid
    try:
        return pwd.getpwnam(job.owner).pw_uid
    except KeyError:
        return None


def open_fifo(path: Path, ident: str, expected_uid: int | None) -> int:
    """``path`` opened for writing without blocking or following a symlink; refused (one
    line) unless it is a FIFO of ``expected_uid`` that a process reads.  What is there is
    looked at first, so that nothing but a FIFO is opened at all (a device, say, by root);
    the descriptor's ``fstat`` is what decides."""
    try:
        found = os.lstat(path)
    except FileNotFoundError:
        raise Conflict(not_reading(ident)) from None  # none made yet: the job is starting
    except OSError as exc:
        raise PolluxError(f"cannot look at {path}: {exc.strerror}") from None
    if stat.S_ISLNK(found.st_mode):
        raise PermissionDenied(f"refusing {path}: it is a symlink")
    if not stat.S_ISFIFO(found.st_mode):
        raise PermissionDenied(f"refusing {path}: it is not a FIFO")
    flags = os.O_WRONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_NOCTTY | os.O_CLOEXEC
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        if exc.errno in (errno.ENXIO, errno.ENOENT):  # no reader, or none made yet
            raise Conflict(not_reading(ident)) from None
        if exc.errno == errno.ELOOP:
            raise PermissionDenied(f"refusing {path}: it is a symlink") from None
        if exc.errno == errno.EISDIR:
            raise PermissionDenied(f"refusing {path}: it is not a FIFO") from None
        raise PolluxError(f"cannot open {path}: {exc.strerror}") from None
    info = os.fstat(fd)
    problem = None
    if not stat.S_ISFIFO(info.st_mode):
        problem = f"refusing {path}: it is not a FIFO"
    elif expected_uid is not None and info.st_uid != expected_uid:
        problem = f"refusing {path}: it belongs to uid {info.st_uid}, not uid {expected_uid}"
    if problem is not None:
        os.close(fd)
        raise PermissionDenied(problem)
    return fd


def not_reading(ident: str) -> str:
    return f"job {ident} is not reading its input now (it is starting or restarting); try again"


def write_all(fd: int, data: bytes, ident: str, wait_s: float = SEND_WAIT_S) -> None:
    """``data`` written to the FIFO ``fd`` (non-blocking): at once when it fits (up to
    :data:`PIPE_BUF` bytes in one piece), else as the job reads, waiting ``wait_s`` at most
    for each piece; one line when the job reads nothing."""
    sent = 0
    while sent < len(data):
        try:
            sent += os.write(fd, data[sent:])
            continue
        except BlockingIOError:
            if sent == 0:
                raise Conflict(
                    f"job {ident} has not read what was sent before (its input is full);"
                    " try again later"
                ) from None
        except BrokenPipeError:
            raise Conflict(not_reading(ident)) from None
        poller = select.poll()
        poller.register(fd, select.POLLOUT)
        deadline = time.monotonic() + wait_s
        while not poller.poll(max(0, int((deadline - time.monotonic()) * 1000))):
            if time.monotonic() >= deadline:
                raise Conflict(
                    f"job {ident} read {sent} of {len(data)} bytes and nothing more within"
                    f" {wait_s:g} s: the rest was not sent"
                )


def send_to(path: Path, data: bytes, ident: str, expected_uid: int | None) -> None:
    """Open the job's input FIFO (:func:`open_fifo`), write ``data`` (:func:`write_all`),
    close it."""
    fd = open_fifo(path, ident, expected_uid)
    try:
        write_all(fd, data, ident)
    finally:
        os.close(fd)


def input_bytes(args: argparse.Namespace) -> bytes:
    """What to send: ``TEXT...`` joined by spaces with a newline, or ``--file``'s bytes."""
    if args.file is None:
        if not args.text:
            raise PolluxError("send: give the TEXT to send, or --file F")
        return (" ".join(args.text) + "\n").encode()
    if args.text:
        raise PolluxError("send: give TEXT or --file, not both")
    if args.file == "-":
        return sys.stdin.buffer.read()
    try:
        return Path(args.file).read_bytes()
    except OSError as exc:
        raise PolluxError(f"send: cannot read {args.file}: {exc.strerror}") from None


def cmd_send(args: argparse.Namespace) -> int:
    data = input_bytes(args)
    job = client_for(args).call(Show(id=job_id(args.id))).job
    caller = os.getuid()
    path = input_fifo(job, caller)
    if data:
        send_to(path, data, job.id, owner_uid(job, caller))
    return 0


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "send",
        parents=[state_dir_parser()],
        help="send a line of input to a running --stdin job",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n"
        "  pollux-local send 12 yes\n"
        "  pollux-local send 12 --file answers.txt\n"
        "  pollux-local send 12 -- --not-an-option",
    )
    p.add_argument("id", help="the job's id")
    p.add_argument("text", nargs="*", metavar="TEXT", help="the line to send")
    p.add_argument("--file", metavar="F", help="send F's bytes as they are (-: stdin)")
    p.set_defaults(func=cmd_send)
