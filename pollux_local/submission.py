"""A ``submit`` request built from typed options and, optionally, a job file: the one builder
that ``pollux-local submit`` (``cli/submit.py``) and the TUI's submit form both call, neither
importing the other.

A new job option is a field of ``api.messages.Submit``, a field of :class:`SubmitOptions`
(with its line in :func:`build_submit`) and a widget in each front end.

COMMAND is a ``.py`` script (run by the submitter's own Python: the active venv or conda env,
else the first ``python3`` on ``PATH``, or ``python``), ``python SCRIPT`` spelled out, or any
executable.  A script that imports the job library is elastic (``elastic`` overrides the
detection); any other command is rigid and runs on exactly ``gpus`` devices (default 1).
The daemon checks the request again.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pollux_local.api.errors import PolluxError
from pollux_local.api.launch import without_launch_variables
from pollux_local.api.messages import ArrayTask, Submit, default_job_name, job_name
from pollux_local.api.spec import Constraint
from pollux_local.api.torchrun import PYTHON_NAME, torchrun_refusal
from pollux_local.client import build_request
from pollux_local.jobspec import JobSpec, check_sweep_args, substitute, sweep_grid
from pollux_local.parsing import parse_array

#: How a script shows that it uses the job library (read from its first bytes).
_USES_JOB_LIBRARY = re.compile(rb"pollux_local\.torch|\bElasticTrainer\b")
_SCAN_BYTES = 1 << 20


@dataclass(frozen=True)
class SubmitOptions:
    """What the submitter chose, already parsed; ``None`` (or empty) where they chose nothing,
    so the job file's value (if any) applies.  ``command`` is COMMAND and its arguments;
    ``array`` is an array spec as text (``0-9%2``); ``after`` with ``after_any`` and
    ``after_one``: the jobs to wait for and whether any end, or one success, will do."""

    command: Sequence[str] = ()
    spec: JobSpec | None = None
    name: str | None = None
    gpus: int | None = None
    min_gpus: int | None = None
    max_gpus: int | None = None
    elastic: bool | None = None
    preemptible: bool = False
    python: str | None = None
    batch_size: int | None = None
    max_batch_size: int | None = None
    min_local_batch: int | None = None
    max_local_batch: int | None = None
    priority: int | None = None
    workdir: str | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    hold: bool = False
    after: Sequence[str] = ()
    after_any: bool = False
    after_one: bool = False
    array: str | None = None
    max_running: int | None = None
    time_limit_s: float | None = None
    notify: Sequence[str] = ()
    notify_on: str | None = None
    gpu_memory: int | None = None
    shared: bool = False
    #: rank 0 reads what ``pollux-local send`` sends (``--stdin``)
    stdin: bool = False
    constraint: Constraint | None = None
    #: crash restarts (``--retries``), the earliest start (seconds since the epoch: ``--begin``,
    #: ``--delay``), the group (``--group``), the account (``--account``), host memory in bytes
    #: and CPUs (``--mem``, ``--cpus``)
    retries: int | None = None
    begin_at: float | None = None
    group: str | None = None
    account: str | None = None
    host_memory: int | None = None
    cpus: float | None = None


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
    if found is None and os.path.lexists(name):
        # as a shell, a bare name is looked up on PATH only; the file here is not run
        raise PolluxError(f"{name}: no program of that name on PATH (the file here: ./{name})")
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
    command: Sequence[str], env: Mapping[str, str], python: str | None
) -> tuple[list[str], Path | None]:
    """The job's argv and, when it runs a Python script, that script's path.

    ``train.py ARGS`` -> ``PYTHON -u /abs/train.py ARGS``; ``python3 train.py ARGS`` -> the
    named interpreter (found on PATH) with the script made absolute; anything else -> the
    program (path or PATH lookup) with its arguments as given.
    """
    refused = torchrun_refusal(command)  # the daemon's rule (``api.torchrun``)
    if refused is not None:
        raise PolluxError(refused)
    first, rest = command[0], list(command[1:])
    if first.endswith(".py"):
        script = _script_path(first)
        interpreter = python or submitter_python(env)
        return [interpreter, "-u", str(script), *rest], script
    if PYTHON_NAME.match(os.path.basename(first)):  # ``submit python train.py``
        interpreter = python or _program(first, env)
        named: Path | None = None
        if rest and not rest[0].startswith("-") and rest[0].endswith(".py"):
            named = _script_path(rest[0])
            rest[0] = str(named)
        return [interpreter, *rest], named
    if python is not None:
        raise PolluxError("--python applies to Python scripts only")
    return [_program(first, env), *rest], None


def submitted_environment(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The submitting shell's environment, less what describes its own launch."""
    return without_launch_variables(os.environ if environ is None else environ)


def _python_option(value: str | None) -> str | None:
    if value is None:
        return None
    path = os.path.abspath(os.path.expanduser(value))  # absolute, symlinks kept
    if not os.access(path, os.X_OK) or os.path.isdir(path):
        raise PolluxError(f"--python {value}: not an executable file")
    return path


def _command(options: SubmitOptions) -> list[str]:
    """COMMAND and its arguments: the options', else the job file's script and args (a
    command without arguments takes the file's)."""
    spec = options.spec
    if options.command:
        command = list(options.command)
        if spec is not None and len(command) == 1:
            command += list(spec.args)
        return command
    if spec is not None and spec.script is not None:
        return [spec.script, *spec.args]
    if spec is not None:
        raise PolluxError(f"{spec.path}: job.script is missing (or give a COMMAND)")
    raise PolluxError("submit needs a COMMAND (e.g. train.py) or --spec job.toml")


def _pick(options: SubmitOptions, name: str) -> Any:
    """The option ``name``, else the job file's field of the same (api) name."""
    value = getattr(options, name)
    if value is None and options.spec is not None:
        return getattr(options.spec, name)
    return value


def _size(options: SubmitOptions, elastic: bool) -> tuple[int, int | None]:
    """(min_gpus, max_gpus): ``gpus`` fixes both; an elastic job's bounds; a rigid job's one
    size."""
    spec = options.spec
    if options.gpus is not None:
        if options.min_gpus is not None or options.max_gpus is not None:
            raise PolluxError("--gpus N fixes the size: leave out --min-gpus and --max-gpus")
        min_gpus, max_gpus = options.gpus, options.gpus
    elif elastic:
        min_gpus, max_gpus = _pick(options, "min_gpus") or 1, _pick(options, "max_gpus")
    else:
        if options.min_gpus is not None or options.max_gpus is not None:
            raise PolluxError(
                "--min-gpus/--max-gpus are for elastic jobs (scripts using ElasticTrainer); "
                "give a rigid job its size with --gpus N (or pass --elastic)"
            )
        size = (spec.min_gpus if spec is not None else None) or 1
        if spec is not None and spec.max_gpus is not None and spec.max_gpus != size:
            raise PolluxError(
                f"{spec.path}: job.max_gpus is for elastic jobs (scripts using ElasticTrainer); "
                f"a rigid job runs on exactly job.min_gpus devices ({size}): set min_gpus = N "
                "without max_gpus (or pass --gpus N, or --elastic)"
            )
        min_gpus, max_gpus = size, size
    if min_gpus < 1:
        raise PolluxError(f"the job needs at least 1 device, got {min_gpus}")
    if max_gpus is not None and max_gpus < min_gpus:
        raise PolluxError(f"--min-gpus {min_gpus} is greater than --max-gpus {max_gpus}")
    return int(min_gpus), None if max_gpus is None else int(max_gpus)


def current_umask() -> int:
    """This process's file-mode creation mask (``/proc/self/status``; else set and put back)."""
    try:
        with open("/proc/self/status", encoding="ascii", errors="replace") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8) & 0o777
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o077)
    os.umask(mask)
    return mask & 0o777


def build_submit(options: SubmitOptions, environ: Mapping[str, str] | None = None) -> Submit:
    """The ``submit`` request for ``options`` (over the job file's values) in the submitter's
    environment ``environ`` (default: this process's)."""
    spec = options.spec
    command = _command(options)
    env = submitted_environment(environ)
    if spec is not None:
        env.update(spec.env)
    env.update(options.env)
    argv, script = command_argv(command, env, _python_option(options.python))
    if options.elastic is not None:
        elastic = options.elastic
    else:
        elastic = script is not None and uses_job_library(script)
    min_gpus, max_gpus = _size(options, elastic)
    workdir_text = options.workdir or (spec.workdir if spec is not None else None) or os.getcwd()
    workdir = Path(workdir_text).expanduser().resolve()
    if not workdir.is_dir():
        raise PolluxError(f"workdir {workdir} is not a directory")
    fields: dict[str, Any] = {
        "argv": argv,
        "workdir": str(workdir),
        "env": env,
        "umask": current_umask(),  # the job's files are as private as the submitter's
        "min_gpus": min_gpus,
        "priority": int(_pick(options, "priority") or 0),
        "elastic": elastic,
        "preemptible": options.preemptible,
    }
    if max_gpus is not None:
        fields["max_gpus"] = max_gpus
    for key in ("batch_size", "max_batch_size", "min_local_batch", "max_local_batch"):
        value = _pick(options, key)
        if value is not None:
            fields[key] = int(value)
    name = _pick(options, "name")
    if name:
        fields["name"] = str(name)
    if spec is not None and spec.target is not None:
        fields["target"] = spec.target
    if options.hold:
        fields["hold"] = True
    fields.update(_scheduling_fields(options))
    fields.update(_array_fields(options, argv, len(command) - 1, fields.get("name")))
    request = build_request("submit", **fields)
    assert isinstance(request, Submit)
    return request


def _scheduling_fields(options: SubmitOptions) -> dict[str, Any]:
    """Dependencies, time limit, notifications, memory, sharing and constraint: the options',
    else the job file's."""
    spec = options.spec
    fields: dict[str, Any] = {}
    if options.after:
        fields["after"] = list(options.after)
        fields["after_any"], fields["after_one"] = options.after_any, options.after_one
    elif spec is not None and spec.after:
        fields["after"] = list(spec.after)
        fields["after_any"], fields["after_one"] = spec.after_any, spec.after_one
    time_limit = _pick(options, "time_limit_s")
    if time_limit is not None:
        fields["time_limit_s"] = float(time_limit)
    if options.notify:
        fields["notify"] = list(options.notify)
    elif spec is not None and spec.notify:
        fields["notify"] = list(spec.notify)
    notify_on = options.notify_on or (spec.notify_on if spec is not None else None)
    if notify_on is not None:
        fields["notify_on"] = notify_on
    constraint = _pick(options, "constraint")
    if constraint is not None:
        fields["constraint"] = constraint
    memory = _pick(options, "gpu_memory")
    if memory is not None:
        fields["gpu_memory"] = int(memory)
    if options.shared or (spec is not None and spec.shared):
        fields["shared"] = True
    if options.stdin or (spec is not None and spec.stdin):
        fields["stdin"] = True
    for key in ("retries", "begin_at", "group", "account", "host_memory", "cpus"):
        value = getattr(options, key)
        if value is not None:
            fields[key] = value
    return fields


def _array_fields(
    options: SubmitOptions, argv: list[str], own_args: int, name: str | None
) -> dict[str, Any]:
    """``array`` (from the option or the job file's ``array``, or the file's ``[sweep]``: the
    grid of its values substituted into the last ``own_args`` arguments of ``argv``, the
    command's own) and ``max_running``."""
    spec = options.spec
    array_text, option = options.array, "--array"
    if array_text is None and spec is not None and spec.array is not None:
        array_text, option = spec.array, "job.array"
    sweep = dict(spec.sweep) if spec is not None else {}
    if array_text is not None and sweep:
        raise PolluxError(f"{option} and the spec's [sweep] both make an array: keep one")
    cap: int | None = None
    tasks: list[ArrayTask] | None = None
    if array_text is not None:
        indices, cap = parse_array(array_text, option)
        tasks = [ArrayTask(index=index) for index in indices]
    elif sweep and spec is not None:
        tasks = sweep_tasks(sweep, argv, own_args, name, str(spec.path))
    max_running = options.max_running
    if max_running is not None and cap is not None:
        raise PolluxError(f"{option} {array_text!r} already caps the tasks running (%N)")
    if max_running is None:
        max_running = cap if cap is not None else (spec.max_running if spec else None)
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
    sweep: Mapping[str, Sequence[str]],
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
    base = name or default_job_name(argv)
    tasks = []
    for index, values in enumerate(sweep_grid(list(sweep.items()))):
        label = ",".join(f"{key}={value}" for key, value in values.items())
        wanted = f"{base}[{label}]"
        # a name the daemon would not take: the daemon names the task base[index]
        task_name = wanted if job_name(wanted) == wanted else None
        tasks.append(
            ArrayTask(index=index, argv=[*head, *substitute(rest, values)], name=task_name)
        )
    return tasks
