"""``pollux-local run [OPTIONS] COMMAND [ARGS...]``: submit a job, print its output as it
runs and exit with its exit status, as ``srun`` does.

The options are ``submit``'s.  Rank 0's output goes to stdout as the job writes it (as ``logs
-f`` prints it); the job's state changes go to stderr (``job 12 queued: waiting: ...``,
``job 12 running on box:0,1``, ``job 12 failed: ...``), and so do the lines its log gets at
each start (``--- 2026-11-25 14:00:00 start #0: rank 0/2 on box cuda:0``).

Exit status: the job's exit code (0 when it succeeded); 128+N when signal N killed it; 1 when
it failed without an exit code of its own (a failed dependency, a launch that failed); 130
when it was cancelled.  Ctrl-C cancels the job (as ``srun`` does), then exits 130, also when
it comes while the submit is on its way (the daemon may have stored the job before it hears
of the interrupt).  An array or a sweep makes several jobs: ``submit`` them, then ``wait``."""

from __future__ import annotations

import argparse
import contextlib
import re
import signal
import sys
import time
from collections.abc import Iterator

from pollux_local.api.errors import PolluxError
from pollux_local.api.exits import shell_status
from pollux_local.api.messages import Cancel, LogsReply, Show
from pollux_local.api.states import DecisionKind, ExitCode, JobState
from pollux_local.cli.common import client_for, state_dir_parser
from pollux_local.cli.format import where
from pollux_local.cli.query import print_log
from pollux_local.cli.submit import add_job_arguments, build_submit_request
from pollux_local.client import Client
from pollux_local.untrusted import printable

#: Exit status of ``run`` when the job failed without an exit code, and when it was cancelled.
FAILED_WITHOUT_CODE = 1
CANCELLED = int(ExitCode.INTERRUPTED)
#: How long an ended job's exit is waited for when the end was stored before it (seconds).
EXIT_WAIT_S = 5.0


#: The line a launcher writes to a rank's log at each start (``launch/local.py``, ``ssh``).
BANNER = re.compile(r"--- \d{4}-\d\d-\d\d \d\d:\d\d:\d\d start #\d+: rank \d+/\d+ on .*\n")
#: What a banner begins with (a line that may be one is held until it ends).
BANNER_START = "--- "


def say(text: str) -> None:
    """One line on stderr (what the job controls made printable)."""
    sys.stderr.write(printable(text, newline=False) + "\n")
    sys.stderr.flush()


class Output:
    """The log's text, banners to stderr and the rest to stdout: a line that may be a banner
    is held until its end (any other text is written at once, a partial line too)."""

    def __init__(self) -> None:
        self.held = ""

    def __call__(self, text: str) -> None:
        text, self.held = self.held + text, ""
        while text:
            line, newline, rest = text.partition("\n")
            maybe = line[: len(BANNER_START)] == BANNER_START[: len(line)]
            if not newline and maybe:
                self.held = line  # the start of what may be a banner
                break
            whole = line + newline
            if maybe and BANNER.fullmatch(whole):
                sys.stderr.write(whole)
                sys.stderr.flush()
            else:
                sys.stdout.write(whole)
            text = rest
        sys.stdout.flush()

    def flush(self) -> None:
        """Write what is held (the log ended in the middle of a line)."""
        if self.held:
            sys.stdout.write(self.held)
            sys.stdout.flush()
            self.held = ""


class Watcher:
    """Reports on stderr what becomes of the job: each start (with its devices, from the
    job's decision log, so that a start between two looks is not missed), crash and
    re-queue, and its state when waiting, rescaling or ended (with the reason)."""

    #: decision-log lines worth a line of their own
    TOLD = (DecisionKind.CRASHED, DecisionKind.REQUEUED, DecisionKind.RECOVERED,
            DecisionKind.NODE_DOWN)  # fmt: skip

    def __init__(self, client: Client, ident: str) -> None:
        self.client, self.ident = client, ident
        self.said = ""
        self.seen: set[tuple[float, str, str]] = set()

    def __call__(self, reply: LogsReply) -> None:
        shown = self.client.call(Show(id=self.ident))
        for entry in shown.decisions:
            key = (entry.time, entry.kind, entry.reason)
            if key in self.seen:
                continue
            self.seen.add(key)
            if entry.kind in (DecisionKind.START, DecisionKind.RESIZE):
                self.say(f"job {self.ident} running on {where(entry.placement)}")
            elif entry.kind in self.TOLD:
                self.say(f"job {self.ident} {entry.kind}: {entry.reason}")
        job = shown.job
        if job.state not in (JobState.RUNNING,):
            said = f": {job.reason}" if job.reason else ""
            self.say(f"job {self.ident} {job.state.value}{said}")

    def say(self, line: str) -> None:
        if line != self.said:
            say(line)
            self.said = line


def exit_status(client: Client, ident: str, state: JobState) -> int:
    """``run``'s exit status for a job that ended in ``state`` (see the module's docstring).
    A failed job's exit is waited for a moment when its end was stored first (a time limit
    fails the job, then stops it)."""
    if state is JobState.SUCCEEDED:
        return 0
    if state is JobState.CANCELLED:
        return CANCELLED
    deadline = time.monotonic() + EXIT_WAIT_S
    while True:
        job = client.call(Show(id=ident)).job
        known = job.exit_code is not None or job.exit_signal is not None
        if known or job.start_time is None or time.monotonic() >= deadline:
            return shell_status(job.exit_code, job.exit_signal) or FAILED_WITHOUT_CODE
        time.sleep(0.5)


class Interrupts:
    """Whether Ctrl-C was pressed while :meth:`held`: a first SIGINT is noted, not raised (a
    submit the daemon may already have stored is not abandoned without its id); a second one
    raises ``KeyboardInterrupt`` as usual."""

    def __init__(self) -> None:
        self.pressed = False

    def _note(self, signum: int, frame: object) -> None:
        if self.pressed:
            raise KeyboardInterrupt
        self.pressed = True

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        previous = signal.signal(signal.SIGINT, self._note)
        try:
            yield
        finally:
            signal.signal(signal.SIGINT, previous)


def cmd_run(args: argparse.Namespace) -> int:
    request = build_submit_request(args)
    if request.array is not None:
        raise PolluxError("run starts one job; an array or sweep makes several: submit, then wait")
    client = client_for(args)
    interrupts = Interrupts()
    with interrupts.held():  # Ctrl-C from here on cancels the job the submit made
        reply = client.call(request)
        ident = reply.id
        say(f"submitted job {ident}")
    watcher, output = Watcher(client, ident), Output()
    try:
        if interrupts.pressed:
            raise KeyboardInterrupt
        state = print_log(
            client, ident, 0, safe=sys.stdout.isatty(), follow=True, on_poll=watcher, write=output
        )
        output.flush()
    except KeyboardInterrupt:
        client.call(Cancel(ids=[ident]))
        say(f"job {ident} cancelled (interrupted)")
        return CANCELLED
    return exit_status(client, ident, state)


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    doc = __doc__ or ""
    p = subparsers.add_parser(
        "run",
        parents=[state_dir_parser()],
        help="submit a job, print its output and exit with its code (as srun); Ctrl-C cancels it",
        usage="%(prog)s [OPTIONS] COMMAND [ARGS...]",
        description=doc.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n"
        "  pollux-local run train.py --epochs 1\n"
        "  pollux-local run --gpus 2 --time 1h ddp_train.py",
    )
    add_job_arguments(p)
    p.set_defaults(func=cmd_run)
