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

``--after ID[,ID...]`` starts the job once those jobs succeeded (``--after-any``: once they
ended, however); ``--array 0-9`` (or ``0-9:2``, ``1,4,7``, ``0-3,8``) makes one task per index
(``$POLLUX_ARRAY_INDEX``, ``$SLURM_ARRAY_TASK_ID``), at most ``--max-running N`` at once; a
job.toml's ``[sweep]`` makes one task per combination of its values; ``--time 2h`` stops the job
at that limit; ``--notify URL`` tells a destination when it ends (``--notify-on failure``: only
when it fails); ``--constraint nodes=box1,box2;type=a100`` keeps it to those nodes and that
device type.

The request is an ``api.Submit``; the daemon checks it again.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pollux_local.api.errors import PolluxError
from pollux_local.api.launch import LAUNCH_VARIABLES, POLLUX_PREFIX
from pollux_local.api.messages import ArrayTask, Submit, SubmitReply
from pollux_local.cli.common import client_for, json_parser, print_json, state_dir_parser
from pollux_local.cli.parsing import (
    check_notify_url,
    compress_indices,
    parse_array,
    parse_constraint,
    parse_job_ids,
    parse_time_limit,
)
from pollux_local.client import build_request
from pollux_local.jobspec import check_sweep_args, load_job_spec, substitute, sweep_grid
from pollux_local.sizes import SizeError, parse_size

#: Submit fields that ``--spec`` or an option may set, besides the command.
_OPTIONAL_INTS = ("max_gpus", "batch_size", "max_batch_size", "min_local_batch", "max_local_batch")
#: How a script shows that it uses the job library (read from its first bytes).
_USES_JOB_LIBRARY = re.compile(rb"pollux_local\.torch|\bElasticTrainer\b")
_SCAN_BYTES = 1 << 20
#: Program names that are a Python interpreter (``submit python train.py``).
_PYTHON_NAME = re.compile(r"^python(\d+(\.\d+)?)?$")
#: The longest job name the daemon takes (``api.messages.JobName``).
_MAX_NAME = 128
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def load_spec(path: str) -> dict[str, Any]:
    """A ``job.toml`` as submit fields (``pollux_local.jobspec`` reads and checks it)."""
    return load_job_spec(path).submit_fields()


def submitter_python(env: Mapping[str, str]) -> str:
    """The ``python`` the submitter's shell would run: ``$VIRTUAL_ENV/bin/python``, else
    ``$CONDA_PREFIX/bin/python``, else the first ``python3`` (or ``python``) on ``$PATH``.
    The path is kept as found, never resolved through symlinks (a venv's ``python`` is a
    symlink to its base interpreter, and only the link makes it the venv)."""
    for variable in ("VIRTUAL_ENV", "CONDA_PREFIX"):
        prefix = env.get(variable)
        if prefix:
            candidate = os.path.join(prefix, "bin", "python")
            if os.access(candidate, os.X_OK):
                return os.path.abspath(candidate)
    for name in ("python3", "python"):
        found = shutil.which(name, path=env.get("PATH", os.defpath))
        if found:
            return os.path.abspath(found)
    raise PolluxError("no python found on PATH (activate your environment, or pass --python)")


def _program(name: str, env: Mapping[str, str]) -> str:
    """An executable named on the command line: a path (kept as written, made absolute), or a
    program found on the submitter's ``PATH``."""
    if os.sep in name:
        path = Path(name).expanduser()
        if not path.exists():
            raise PolluxError(f"{name} does not exist")
        if path.is_dir():
            raise PolluxError(f"{name} is a directory")
        if not os.access(path, os.X_OK):
            raise PolluxError(f"{name} is neither a .py file nor executable")
        return os.path.abspath(path)
    found = shutil.which(name, path=env.get("PATH", os.defpath))
    if found is None:
        raise PolluxError(f"{name}: no such file, and no program of that name on PATH")
    return os.path.abspath(found)


def _script_path(script: str) -> Path:
    path = Path(script).expanduser()
    if not path.exists():
        raise PolluxError(f"script {script} does not exist")
    if path.is_dir():
        raise PolluxError(f"script {script} is a directory")
    return Path(os.path.abspath(path))


def uses_job_library(script: Path) -> bool:
    """Whether a Python script imports the job library (a look at its first MiB)."""
    try:
        with open(script, "rb") as handle:
            return bool(_USES_JOB_LIBRARY.search(handle.read(_SCAN_BYTES)))
    except OSError:
        return False


def command_argv(
    command: list[str], env: Mapping[str, str], python: str | None
) -> tuple[list[str], Path | None]:
    """The job's argv and, when it runs a Python script, that script's path.

    ``train.py ARGS`` -> ``PYTHON -u /abs/train.py ARGS``; ``python3 train.py ARGS`` -> the
    named interpreter (found on PATH) with the script made absolute; anything else -> the
    program (path or PATH lookup) with its arguments as given.
    """
    first, rest = command[0], list(command[1:])
    if first.endswith(".py"):
        script = _script_path(first)
        interpreter = python or submitter_python(env)
        return [interpreter, "-u", str(script), *rest], script
    if _PYTHON_NAME.match(os.path.basename(first)):
        interpreter = python or _program(first, env)
        named: Path | None = None
        if rest and not rest[0].startswith("-") and rest[0].endswith(".py"):
            named = _script_path(rest[0])
            rest[0] = str(named)
        return [interpreter, *rest], named
    if python is not None:
        raise PolluxError("--python applies to Python scripts only")
    return [_program(first, env), *rest], None


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


def _python_option(value: str | None) -> str | None:
    if value is None:
        return None
    path = os.path.abspath(os.path.expanduser(value))  # absolute, symlinks kept
    if not os.access(path, os.X_OK) or os.path.isdir(path):
        raise PolluxError(f"--python {value}: not an executable file")
    return path


def build_submit_request(args: argparse.Namespace) -> Submit:
    spec: dict[str, Any] = load_spec(args.spec) if args.spec else {}
    if args.program:
        command = [args.program, *args.args]
        if spec and len(command) == 1:
            command += list(spec.get("args", []))
    elif "script" in spec:
        base = Path(args.spec).parent
        script = spec["script"]
        if not os.path.isabs(script) and not (base / script).exists() and Path(script).exists():
            base = Path(".")
        command = [str(base / script) if not os.path.isabs(script) else script]
        command += list(spec.get("args", []))
    elif args.spec:
        raise PolluxError(f"{args.spec}: job.script is missing (or give a COMMAND)")
    else:
        raise PolluxError("submit needs a COMMAND (e.g. train.py) or --spec job.toml")

    def pick(name: str) -> Any:
        value = getattr(args, name, None)
        return value if value is not None else spec.get(name)

    env = submitted_environment()
    env.update(spec.get("env", {}))
    env.update(parse_env(args.env or []))
    argv, script = command_argv(command, env, _python_option(args.python))
    if args.elastic is not None:
        elastic = bool(args.elastic)
    else:
        elastic = script is not None and uses_job_library(script)

    if args.gpus is not None:
        if args.min_gpus is not None or args.max_gpus is not None:
            raise PolluxError("--gpus N fixes the size: leave out --min-gpus and --max-gpus")
        min_gpus, max_gpus = args.gpus, args.gpus
    elif elastic:
        min_gpus, max_gpus = pick("min_gpus") or 1, pick("max_gpus")
    else:
        if args.min_gpus is not None or args.max_gpus is not None:
            raise PolluxError(
                "--min-gpus/--max-gpus are for elastic jobs (scripts using ElasticTrainer); "
                "give a rigid job its size with --gpus N (or pass --elastic)"
            )
        size = spec.get("min_gpus") or 1
        min_gpus, max_gpus = size, size
    if min_gpus < 1:
        raise PolluxError(f"the job needs at least 1 device, got {min_gpus}")
    if max_gpus is not None and max_gpus < min_gpus:
        raise PolluxError(f"--min-gpus {min_gpus} is greater than --max-gpus {max_gpus}")
    workdir = Path(args.workdir or spec.get("workdir") or os.getcwd()).expanduser().resolve()
    if not workdir.is_dir():
        raise PolluxError(f"workdir {workdir} is not a directory")
    fields: dict[str, Any] = {
        "argv": argv,
        "workdir": str(workdir),
        "env": env,
        "min_gpus": int(min_gpus),
        "priority": int(pick("priority") or 0),
        "elastic": elastic,
        "preemptible": bool(args.preemptible),
    }
    if max_gpus is not None:
        fields["max_gpus"] = int(max_gpus)
    for key in _OPTIONAL_INTS[1:]:
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
    fields.update(scheduling_fields(args, spec))
    fields.update(array_fields(args, spec, argv, len(command) - 1, fields.get("name")))
    request = build_request("submit", **fields)
    assert isinstance(request, Submit)
    return request


def scheduling_fields(args: argparse.Namespace, spec: dict[str, Any]) -> dict[str, Any]:
    """Dependencies, time limit, notifications and constraint: the options, else the spec's."""
    fields: dict[str, Any] = {}
    after, after_any = getattr(args, "after", None), getattr(args, "after_any", None)
    if after:
        fields["after"] = parse_job_ids(after, "--after")
    elif after_any:
        fields["after"], fields["after_any"] = parse_job_ids(after_any, "--after-any"), True
    elif spec.get("after"):
        fields["after"], fields["after_any"] = list(spec["after"]), bool(spec.get("after_any"))
    time_text = getattr(args, "time", None)
    if time_text is not None:
        fields["time_limit_s"] = parse_time_limit(time_text)
    elif spec.get("time_limit_s") is not None:
        fields["time_limit_s"] = float(spec["time_limit_s"])
    notify = getattr(args, "notify", None)
    if notify:
        fields["notify"] = [check_notify_url(url) for url in notify]
    elif spec.get("notify"):
        fields["notify"] = list(spec["notify"])
    notify_on = getattr(args, "notify_on", None) or spec.get("notify_on")
    if notify_on is not None:
        fields["notify_on"] = notify_on
    constraint = parse_constraint(getattr(args, "constraint", None) or [])
    if constraint is None:
        constraint = spec.get("constraint")
    if constraint is not None:
        fields["constraint"] = constraint
    memory = getattr(args, "gpu_memory", None)
    if memory is not None:
        try:
            fields["gpu_memory"] = parse_size(memory)
        except SizeError as exc:
            raise PolluxError(f"--gpu-memory: {exc}") from None
    elif spec.get("gpu_memory") is not None:
        fields["gpu_memory"] = int(spec["gpu_memory"])
    if getattr(args, "shared", False) or spec.get("shared"):
        fields["shared"] = True
    return fields


def array_fields(
    args: argparse.Namespace,
    spec: dict[str, Any],
    argv: list[str],
    own_args: int,
    name: str | None,
) -> dict[str, Any]:
    """``array`` (from ``--array`` or the spec's ``array``, or the spec's ``[sweep]``: the grid
    of its values substituted into the last ``own_args`` arguments of ``argv``, the command's
    own) and ``max_running``."""
    array_text, option = getattr(args, "array", None), "--array"
    if array_text is None and spec.get("array") is not None:
        array_text, option = spec["array"], "job.array"
    sweep: dict[str, list[str]] = spec.get("sweep") or {}
    if array_text is not None and sweep:
        raise PolluxError(f"{option} and the spec's [sweep] both make an array: keep one")
    cap: int | None = None
    tasks: list[ArrayTask] | None = None
    if array_text is not None:
        indices, cap = parse_array(array_text, option)
        tasks = [ArrayTask(index=index) for index in indices]
    elif sweep:
        tasks = sweep_tasks(sweep, argv, own_args, name, args.spec)
    max_running = getattr(args, "max_running", None)
    if max_running is not None and cap is not None:
        raise PolluxError(f"{option} {array_text!r} already caps the tasks running (%N)")
    if max_running is None:
        max_running = cap if cap is not None else spec.get("max_running")
    if max_running is not None and tasks is None:
        raise PolluxError("--max-running is for arrays: give --array SPEC or a [sweep]")
    fields: dict[str, Any] = {}
    if tasks is not None:
        fields["array"] = tasks
    if max_running is not None:
        if max_running < 1:
            raise PolluxError(f"--max-running must be at least 1, got {max_running}")
        fields["max_running"] = int(max_running)
    return fields


def sweep_tasks(
    sweep: dict[str, list[str]],
    argv: list[str],
    own_args: int,
    name: str | None,
    where: str,
) -> list[ArrayTask]:
    """One task per combination of the sweep's values (the first key varying slowest), its
    ``{key}`` placeholders substituted in the command's own arguments and its values in its
    name (``train.py[lr=0.1,seed=1]``)."""
    head, rest = argv[: len(argv) - own_args], argv[len(argv) - own_args :]
    check_sweep_args(rest, list(sweep), where)
    base = name or default_name(argv)
    tasks = []
    for index, values in enumerate(sweep_grid(list(sweep.items()))):
        label = ",".join(f"{key}={value}" for key, value in values.items())
        task_name: str | None = f"{base}[{label}]"
        if len(task_name or "") > _MAX_NAME or _CONTROL.search(task_name or ""):
            task_name = None  # the daemon names it base[index]
        tasks.append(
            ArrayTask(index=index, argv=[*head, *substitute(rest, values)], name=task_name)
        )
    return tasks


def default_name(argv: list[str]) -> str:
    """The name the daemon gives a job without one: its script's file name, else its program's."""
    program = os.path.basename(argv[0])
    if program.startswith("python"):
        for arg in argv[1:]:
            if not arg.startswith("-"):
                return os.path.basename(arg)
    return program


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
    p.set_defaults(func=cmd_submit)


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
        "--constraint",
        action="append",
        metavar="KEY=VALUE",
        help="where it may run: nodes=box1,box2 and/or type=a100 (repeat, or join with ';')",
    )
