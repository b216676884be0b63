"""``pollux-local submit [OPTIONS] COMMAND [ARGS...]``: queue a training script.

Options come before the command; everything after it goes to the command, as with ``sbatch``
and ``pueue add``.  COMMAND is a ``.py`` script (run by the submitter's own Python: the active
venv or conda env, else the first ``python3`` on ``PATH``, or ``--python``), ``python SCRIPT``
spelled out, or any executable (a path, or a program on ``PATH``).

A script that uses the job library (``pollux_local.torch`` / ``ElasticTrainer``) is *elastic*:
the scheduler chooses its device count between ``--min-gpus`` and ``--max-gpus`` and resizes it
by checkpoint-restart.  Any other command is *rigid*: it runs on exactly ``--gpus`` devices
(default 1) with torchrun's environment, and is never stopped unless ``--preemptible``.
``--elastic`` / ``--rigid`` override the detection.

``--after ID[,ID...]`` starts the job once those jobs succeeded (``--after-any``: once they ended,
however; ``--after-one-of``: once one of them succeeded); ``--array 0-9`` (or ``0-9:2``, ``1,4,7``,
``0-3,8``) makes one task per index (``$POLLUX_ARRAY_INDEX``, ``$SLURM_ARRAY_TASK_ID``), at most
``--max-running N`` at once; a job.toml's ``[sweep]`` makes one task per combination of its values;
``--time 2h`` stops the job at that limit; ``--notify URL`` tells a destination when it ends
(``--notify-on failure``: only when it fails); ``--constraint nodes=box1,box2;type=a100`` keeps it
to those nodes and that device type.

The request is an ``api.Submit`` (``pollux_local.submission`` builds it); the daemon checks
it again.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from pollux_local.api.errors import PolluxError
from pollux_local.api.messages import Submit, SubmitReply
from pollux_local.cli.common import client_for, json_parser, print_json, state_dir_parser
from pollux_local.jobspec import load_job_spec
from pollux_local.parsing import (
    check_notify_url,
    compress_indices,
    earliest_start,
    parse_constraint,
    parse_job_ids,
    parse_time_limit,
)
from pollux_local.sizes import SizeError, parse_size
from pollux_local.submission import SubmitOptions, build_submit


def parse_env(pairs: list[str]) -> dict[str, str]:
    env: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise PolluxError(f"--env expects KEY=VALUE, got {pair!r}")
        env[key] = value
    return env


def size_option(value: str | None, option: str) -> int | None:
    """A size option's bytes (``6G``), ``None`` when not given; a bad one is one line naming
    ``option``."""
    if value is None:
        return None
    try:
        return parse_size(value)
    except SizeError as exc:
        raise PolluxError(f"{option}: {exc}") from None


def submit_options(args: argparse.Namespace) -> SubmitOptions:
    """The command line's options, parsed (each problem one line naming the option)."""
    after: list[str] = []
    after_any = after_one = False
    if args.after:
        after = parse_job_ids(args.after, "--after")
    elif args.after_any:
        after, after_any = parse_job_ids(args.after_any, "--after-any"), True
    elif args.after_one:
        after, after_one = parse_job_ids(args.after_one, "--after-one-of"), True
    gpu_memory = size_option(args.gpu_memory, "--gpu-memory")
    host_memory = size_option(args.mem, "--mem")
    begin_at = earliest_start(args.begin, args.delay, time.time())
    return SubmitOptions(
        command=[args.program, *args.args] if args.program else [],
        spec=load_job_spec(args.spec) if args.spec else None,
        name=args.name,
        gpus=args.gpus,
        min_gpus=args.min_gpus,
        max_gpus=args.max_gpus,
        elastic=args.elastic,
        preemptible=bool(args.preemptible),
        python=args.python,
        batch_size=args.batch_size,
        max_batch_size=args.max_batch_size,
        min_local_batch=args.min_local_batch,
        max_local_batch=args.max_local_batch,
        priority=args.priority,
        workdir=args.workdir,
        env=parse_env(args.env or []),
        hold=bool(args.hold),
        after=after,
        after_any=after_any,
        after_one=after_one,
        array=args.array,
        max_running=args.max_running,
        time_limit_s=parse_time_limit(args.time) if args.time is not None else None,
        notify=[check_notify_url(url) for url in args.notify or []],
        notify_on=args.notify_on,
        gpu_memory=gpu_memory,
        shared=bool(args.shared),
        stdin=bool(args.stdin),
        constraint=parse_constraint(args.constraint or []),
        retries=args.retries,
        begin_at=begin_at,
        group=args.group,
        account=args.account,
        host_memory=host_memory,
        cpus=args.cpus,
    )


def build_submit_request(args: argparse.Namespace) -> Submit:
    """The ``submit`` request of a parsed command line (``submission.build_submit``)."""
    return build_submit(submit_options(args))


def print_submitted(reply: SubmitReply, as_json: bool) -> None:
    """``{"id": ..., "state": ...}`` for a job, ``{"id": ..., "ids": [...], "state": ...}``
    for an array (``id`` is the array's), or a line saying the same."""
    if as_json:
        out: dict[str, Any] = {"id": reply.id, "state": reply.state.value}
        if reply.ids:
            out["ids"] = list(reply.ids)
        print_json(out)
    elif reply.ids:
        span = compress_indices(int(i) for i in reply.ids)
        print(
            f"submitted array {reply.id}: {len(reply.ids)} tasks, jobs {span} ({reply.state.value})"
        )
    else:
        print(f"submitted job {reply.id} ({reply.state.value})")


def cmd_submit(args: argparse.Namespace) -> int:
    if args.dry_run:  # the same answer as `estimate`: nothing is queued
        from pollux_local.cli.estimate import cmd_estimate

        return cmd_estimate(args)
    reply = client_for(args).call(build_submit_request(args))
    print_submitted(reply, args.json)
    return 0


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "submit",
        parents=[state_dir_parser(), json_parser()],
        help="submit a training script or command",
        usage="%(prog)s [OPTIONS] COMMAND [ARGS...]",
        description=__doc__.split("\n\n", 1)[1].split("\n\nThe request")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="examples:\n"
        "  pollux-local submit train.py --lr 0.1\n"
        "  pollux-local submit --gpus 2 ddp_train.py --epochs 5\n"
        "  pollux-local submit --max-gpus 8 --batch-size 128 elastic_train.py\n"
        "  pollux-local submit --spec jobs/digits_cnn/job.toml\n"
        "  pollux-local submit --after 12 --time 2h evaluate.py\n"
        "  pollux-local submit --array 0-9 --max-running 2 train.py --fold-from-env\n"
        "  pollux-local submit --constraint type=a100 --notify ntfy://lab-runs train.py",
    )
    add_job_arguments(p)
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="queue nothing: say when the job would start and finish (as `estimate`)",
    )
    p.set_defaults(func=cmd_submit)


def add_job_arguments(p: argparse.ArgumentParser) -> None:
    """The command and every option of a job (``submit``'s, also ``run``'s): what
    :func:`build_submit_request` reads."""
    p.add_argument(
        "program", nargs="?", metavar="COMMAND", help="train.py, python ..., or a program"
    )
    p.add_argument("args", nargs=argparse.REMAINDER, metavar="ARGS", help="arguments for COMMAND")
    p.add_argument("--spec", help="a job.toml describing the job")
    p.add_argument("--name", help="the job's name (default: the script's file name)")
    p.add_argument("--gpus", type=int, help="run on exactly N devices (rigid jobs: default 1)")
    p.add_argument(
        "--min-gpus", type=int, dest="min_gpus", help="elastic jobs: fewest devices (default 1)"
    )
    p.add_argument(
        "--max-gpus", type=int, dest="max_gpus", help="elastic jobs: most devices (default any)"
    )
    kind = p.add_mutually_exclusive_group()
    kind.add_argument(
        "--elastic",
        dest="elastic",
        action="store_true",
        default=None,
        help="the script uses ElasticTrainer: let the scheduler resize it",
    )
    kind.add_argument(
        "--rigid",
        dest="elastic",
        action="store_false",
        help="run at a fixed size even if the script uses the job library",
    )
    p.add_argument(
        "--preemptible",
        action="store_true",
        help="a rigid job that may be stopped and queued again (it resumes on its own)",
    )
    p.add_argument(
        "--python",
        metavar="PATH",
        help="the interpreter for a .py script (default: your active venv/conda env, "
        "else python3 on PATH); used as given, symlinks not resolved",
    )
    p.add_argument("--batch-size", type=int, dest="batch_size", help="base batch size M0")
    p.add_argument(
        "--max-batch-size", type=int, dest="max_batch_size", help="largest total batch size"
    )
    p.add_argument(
        "--min-local-batch", type=int, dest="min_local_batch", help="smallest batch per replica"
    )
    p.add_argument(
        "--max-local-batch", type=int, dest="max_local_batch", help="largest batch per replica"
    )
    p.add_argument("--priority", type=int, help="higher runs first (default 0)")
    p.add_argument("--workdir", help="working directory (default: the current one)")
    p.add_argument("--env", action="append", metavar="K=V", help="extra environment variable")
    p.add_argument("--hold", action="store_true", help="submit held (start with `release`)")
    add_scheduling_options(p)


def add_scheduling_options(p: argparse.ArgumentParser) -> None:
    """Dependencies, arrays, time limit, notifications, constraints."""
    after = p.add_mutually_exclusive_group()
    after.add_argument(
        "--after",
        action="append",
        metavar="ID[,ID...]",
        help="start only after these jobs succeeded (one failing fails this job)",
    )
    after.add_argument(
        "--after-any",
        dest="after_any",
        action="append",
        metavar="ID[,ID...]",
        help="start only after these jobs ended, however they ended",
    )
    after.add_argument(
        "--after-one-of",
        dest="after_one",
        action="append",
        metavar="ID[,ID...]",
        help="start once one of these jobs succeeded (fails when none did)",
    )
    p.add_argument(
        "--array",
        metavar="SPEC",
        help="one task per index: 0-9, 0-9:2 (step), 1,4,7, 0-3,8; %%N: at most N at once"
        " (each task gets $POLLUX_ARRAY_INDEX and $SLURM_ARRAY_TASK_ID)",
    )
    p.add_argument(
        "--max-running",
        dest="max_running",
        type=int,
        metavar="N",
        help="an array or sweep: at most N of its tasks run at once",
    )
    p.add_argument(
        "--time",
        metavar="DURATION",
        help="time limit: 30s, 10m, 2h, 1h30m, 1-00:00 (then SIGTERM, SIGKILL, failed)",
    )
    p.add_argument(
        "--notify",
        action="append",
        metavar="URL",
        help="tell this destination when the job ends (ntfy://topic, mailto://you@host,"
        " json://host/path...; repeatable)",
    )
    p.add_argument(
        "--notify-on",
        dest="notify_on",
        choices=("end", "failure"),
        help="notify when the job ends (default) or only when it fails",
    )
    p.add_argument(
        "--gpu-memory",
        dest="gpu_memory",
        metavar="SIZE",
        help="the device memory the job uses (6G, 512M); with --shared it is packed by it",
    )
    p.add_argument(
        "--shared",
        action="store_true",
        help="a small rigid one-device job that may share its device with other shared jobs",
    )
    p.add_argument(
        "--stdin",
        action="store_true",
        help="rank 0 reads its input from a FIFO in the job's directory, which"
        " `pollux-local send ID TEXT` writes to (default: /dev/null)",
    )
    p.add_argument(
        "--constraint",
        action="append",
        metavar="KEY=VALUE",
        help="where it may run: nodes=box1,box2 and/or type=a100 (repeat, or join with ';')",
    )
    p.add_argument(
        "--retries",
        type=int,
        metavar="N",
        help="restart the job after a crash up to N times (default: 0 for a rigid job, the"
        " daemon's max_retries for an elastic one)",
    )
    p.add_argument(
        "--begin",
        metavar="WHEN",
        help="start no earlier than WHEN: 14:00, 2pm, +2h, now+30m, tomorrow, midnight,"
        " 2026-12-01T08:30",
    )
    p.add_argument("--delay", metavar="DURATION", help="start no earlier than DURATION from now")
    p.add_argument(
        "--group", metavar="NAME", help="queue it in group NAME (the group's caps and pause apply)"
    )
    p.add_argument(
        "--account",
        metavar="NAME",
        help="charge it to account NAME (one the daemon's [accounts.NAME] lets you use)",
    )
    p.add_argument(
        "--mem",
        metavar="SIZE",
        help="host memory the job may use (16G); over it, the job is killed (cgroups)",
    )
    p.add_argument(
        "--cpus", type=float, metavar="N", help="CPUs the job may use (8, 0.5), as a cgroup quota"
    )
