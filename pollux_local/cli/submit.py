"""``pollux-local submit [OPTIONS] SCRIPT [ARGS...]``: queue a training script.

Options come before the script; everything after the script goes to the script.  The request
is an ``api.Submit``: the daemon checks it again, this side only resolves paths and reads
``--spec``.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from pollux_local.api.errors import PolluxError
from pollux_local.api.launch import LAUNCH_VARIABLES, POLLUX_PREFIX
from pollux_local.api.messages import Submit
from pollux_local.cli.common import client_for, json_parser, print_json, state_dir_parser
from pollux_local.client import build_request
from pollux_local.jobspec import load_job_spec

#: Submit fields that ``--spec`` or an option may set, besides the command.
_OPTIONAL_INTS = ("max_gpus", "batch_size", "max_batch_size", "min_local_batch", "max_local_batch")


def load_spec(path: str) -> dict[str, Any]:
    """A ``job.toml`` as submit fields (``pollux_local.jobspec`` reads and checks it)."""
    return load_job_spec(path).submit_fields()


def script_argv(script: str, args: list[str]) -> list[str]:
    """The command of a job: ``python -u SCRIPT ARGS`` for ``.py`` files, else the program."""
    path = Path(script).expanduser()
    if not path.exists():
        raise PolluxError(f"script {script} does not exist")
    if path.is_dir():
        raise PolluxError(f"script {script} is a directory")
    path = path.resolve()
    if path.suffix == ".py":
        return [sys.executable, "-u", str(path), *args]
    if not os.access(path, os.X_OK):
        raise PolluxError(f"script {script} is neither a .py file nor executable")
    return [str(path), *args]


def parse_env(pairs: list[str]) -> dict[str, str]:
    env: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise PolluxError(f"--env expects KEY=VALUE, got {pair!r}")
        env[key] = value
    return env


def submitted_environment() -> dict[str, str]:
    """The submitting shell's environment, less what describes its own launch."""
    return {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(POLLUX_PREFIX) and key not in LAUNCH_VARIABLES
    }


def build_submit_request(args: argparse.Namespace) -> Submit:
    spec: dict[str, Any] = load_spec(args.spec) if args.spec else {}
    if args.script:
        script, extra = args.script, list(args.args)
    elif "script" in spec:
        script, extra = spec["script"], list(spec.get("args", [])) + list(args.args)
    elif args.spec:
        raise PolluxError(f"{args.spec}: job.script is missing (or give a SCRIPT)")
    else:
        raise PolluxError("submit needs a SCRIPT or --spec job.toml")
    if args.script and spec:
        extra = list(args.args) or list(spec.get("args", []))

    def pick(name: str) -> Any:
        value = getattr(args, name, None)
        return value if value is not None else spec.get(name)

    min_gpus = pick("min_gpus") or 1
    max_gpus = pick("max_gpus")
    if min_gpus < 1:
        raise PolluxError(f"--min-gpus must be at least 1, got {min_gpus}")
    if max_gpus is not None and max_gpus < min_gpus:
        raise PolluxError(f"min gpus {min_gpus} is greater than max gpus {max_gpus}")
    workdir = Path(args.workdir or spec.get("workdir") or os.getcwd()).expanduser().resolve()
    if not workdir.is_dir():
        raise PolluxError(f"workdir {workdir} is not a directory")
    env = submitted_environment()
    env.update(spec.get("env", {}))
    env.update(parse_env(args.env or []))
    fields: dict[str, Any] = {
        "argv": script_argv(script, extra),
        "workdir": str(workdir),
        "env": env,
        "min_gpus": int(min_gpus),
        "priority": int(pick("priority") or 0),
    }
    for key in _OPTIONAL_INTS:
        value = pick(key)
        if value is not None:
            fields[key] = int(value)
    name = pick("name")
    if name:
        fields["name"] = str(name)
    if spec.get("target"):
        fields["target"] = spec["target"]
    if args.hold:
        fields["hold"] = True
    request = build_request("submit", **fields)
    assert isinstance(request, Submit)
    return request


def cmd_submit(args: argparse.Namespace) -> int:
    reply = client_for(args).call(build_submit_request(args))
    if args.json:
        print_json(reply)
    else:
        print(f"submitted job {reply.id} ({reply.state.value})")
    return 0


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "submit",
        parents=[state_dir_parser(), json_parser()],
        help="submit a training script",
        usage="%(prog)s [OPTIONS] SCRIPT [ARGS...]",
        description="Queue SCRIPT (a .py file or an executable); options go before SCRIPT, "
        "everything after it is passed to it.",
    )
    p.add_argument("script", nargs="?", help="the script (python file or executable)")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    p.add_argument("--spec", help="a job.toml describing the job")
    p.add_argument("--name", help="the job's name (default: the script's file name)")
    p.add_argument("--min-gpus", type=int, dest="min_gpus", help="fewest devices (default 1)")
    p.add_argument("--max-gpus", type=int, dest="max_gpus", help="most devices (default any)")
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
    p.set_defaults(func=cmd_submit)
