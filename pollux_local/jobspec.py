"""A job's ``job.toml``: the one reader and checker, for ``pollux-local submit`` and for the
job's own ``train.py`` (through ``pollux_local.torch``).  No torch here.

Shape::

    [job]
    name = "digits-cnn"
    script = "train.py"          # relative to this file
    args = []
    workdir = "."                # relative to this file (default: where submit runs)
    min_gpus = 1
    max_gpus = 4
    batch_size = 32              # M0
    max_batch_size = 512         # M_max
    min_local_batch = 8
    max_local_batch = 256
    priority = 0
    env = { OMP_NUM_THREADS = "1" }
    time = "2h"                  # time limit (30s, 10m, 2h, 1-00:00)
    after = [12, 13]             # start once these jobs succeeded (after_any: once they
    after_any = false            # ended; after_one: once one of them succeeded)
    after_one = false
    notify = ["ntfy://my-topic"] # told when the job ends
    notify_on = "end"            # or "failure"
    constraint = { nodes = ["box1"], type = "a100" }   # or "nodes=box1;type=a100"
    array = "0-9"                # an array of tasks (not with [sweep])
    max_running = 4              # at most 4 tasks of the array or sweep at once

    [target]                     # optional for submit; a job's train.py may require it
    metric = "test_accuracy"
    value = 0.97
    mode = "max"                 # or "min"

    [sweep]                      # a grid: one array task per combination, keys in order
    lr = [0.1, 0.01]
    seed = [1, 2, 3]             # with args = ["--lr", "{lr}", "--seed", "{seed}"]

The file is decoded strictly (msgspec) into :class:`JobTable`, whose fields are named as
``api.messages.Submit``'s (``time`` is the one spelled for people: ``time_limit_s`` once
parsed); the result, :class:`JobSpec`, uses the api's names and ``api.spec.Target``.  Every
problem is one ``PolluxError`` line naming the file and the key; an unknown key names the
closest known one, as the daemon config does (``tomlfile.check_keys``).  With a ``[sweep]``,
every ``{word}`` in the args must name a sweep key and every key must be used.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Annotated, Any

import msgspec

from pollux_local.api.spec import Constraint, Target
from pollux_local.durations import DurationError, parse_duration
from pollux_local.errors import PolluxError
from pollux_local.sizes import SizeError, parse_size
from pollux_local.tomlfile import check_keys, read_toml

__all__ = [
    "JobSpec",
    "JobTable",
    "Target",
    "TrainingSpec",
    "load_job_spec",
    "load_training_spec",
    "parse_constraint",
    "sweep_grid",
]

#: The most tasks a sweep may make (``api.Submit.array``).
MAX_SWEEP_TASKS = 10_000
_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
#: A sweep placeholder in an argument: ``{name}``.
PLACEHOLDER = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")
_WORD = re.compile(r"^[A-Za-z0-9_.:@+-]{1,128}$")
_POSITIVE = Annotated[int, msgspec.Meta(ge=1)]
_SCALAR = str | int | float


class JobTable(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """``[job]`` as written, decoded strictly; names as in ``api.messages.Submit``."""

    name: str | None = None
    script: str | None = None
    args: list[_SCALAR] = msgspec.field(default_factory=list)
    workdir: str | None = None
    min_gpus: _POSITIVE | None = None
    max_gpus: _POSITIVE | None = None
    batch_size: _POSITIVE | None = None
    max_batch_size: _POSITIVE | None = None
    min_local_batch: _POSITIVE | None = None
    max_local_batch: _POSITIVE | None = None
    priority: int | None = None
    env: dict[str, _SCALAR | bool] = msgspec.field(default_factory=dict)
    #: the time limit as people write it (``2h``); ``JobSpec.time_limit_s`` once parsed
    time: str | None = None
    after: list[int | str] = msgspec.field(default_factory=list)
    after_any: bool = False
    after_one: bool = False
    notify: list[str] = msgspec.field(default_factory=list)
    notify_on: str | None = None
    constraint: str | dict[str, Any] | None = None
    gpu_memory: str | int | None = None
    shared: bool = False
    stdin: bool = False
    array: str | None = None
    max_running: _POSITIVE | None = None


#: The keys ``[job]`` may hold.
JOB_KEYS = frozenset(JobTable.__struct_fields__)
#: What each key of ``[job]`` must be, for the one-line error a wrong value gets.
_EXPECTED = {
    "args": "a list of strings",
    "env": "a table",
    "after": "a list",
    "after_any": "true or false",
    "after_one": "true or false",
    "shared": "true or false",
    "stdin": "true or false",
    "notify": "a list",
    "priority": "an integer",
    "constraint": "a table or a string",
    "gpu_memory": "a size (6G, 512M) or a number of bytes",
    **{key: "a positive integer" for key in (
        "min_gpus", "max_gpus", "batch_size", "max_batch_size", "min_local_batch",
        "max_local_batch", "max_running")},
}  # fmt: skip
_TARGET_KEYS = frozenset({"metric", "value", "mode"})
_CONSTRAINT_KEYS = frozenset({"nodes", "type"})


@dataclass(frozen=True)
class TrainingSpec:
    """What a training script needs from its spec: batch bounds (named as ``ElasticTrainer``'s
    arguments) and the target it reports."""

    name: str
    base_batch: int
    max_batch: int
    min_local: int
    max_local: int | None
    target: Target

    def trainer_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``ElasticTrainer`` (the batch bounds)."""
        return {
            "base_batch": self.base_batch,
            "max_batch": self.max_batch,
            "min_local": self.min_local,
            "max_local": self.max_local,
        }


@dataclass(frozen=True)
class JobSpec:
    """A checked ``job.toml`` in the api's names; paths are absolute, resolved against the
    file's folder; ``None`` where the file says nothing."""

    path: Path
    name: str | None = None
    script: str | None = None
    args: tuple[str, ...] = ()
    workdir: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    min_gpus: int | None = None
    max_gpus: int | None = None
    priority: int | None = None
    batch_size: int | None = None
    max_batch_size: int | None = None
    min_local_batch: int | None = None
    max_local_batch: int | None = None
    target: Target | None = None
    time_limit_s: float | None = None
    after: tuple[str, ...] = ()
    after_any: bool = False
    after_one: bool = False
    notify: tuple[str, ...] = ()
    notify_on: str | None = None
    constraint: Constraint | None = None
    #: the array spec as text (``0-9%2``)
    array: str | None = None
    max_running: int | None = None
    #: the device memory the job uses (bytes) and whether it may share its device
    gpu_memory: int | None = None
    shared: bool = False
    #: rank 0 reads what ``pollux-local send`` sends (``--stdin``)
    stdin: bool = False
    #: ``[sweep]``: each key with its values (as text), in the order the file gives them
    sweep: tuple[tuple[str, tuple[str, ...]], ...] = ()

    def for_training(self) -> TrainingSpec:
        """The training view; ``batch_size`` and ``[target]`` are then required."""
        if self.batch_size is None:
            raise PolluxError(f"{self.path}: job.batch_size is required")
        if self.target is None:
            raise PolluxError(f"{self.path}: needs a [target] table")
        return TrainingSpec(
            name=self.name or self.path.resolve().parent.name,
            base_batch=self.batch_size,
            max_batch=self.max_batch_size or self.batch_size,
            min_local=self.min_local_batch or 1,
            max_local=self.max_local_batch,
            target=self.target,
        )

    def submit_fields(self) -> dict[str, Any]:
        """The spec as ``submit`` request fields (only what the file states; ``script`` and
        ``sweep`` too, which the CLI turns into the command and the array)."""
        out: dict[str, Any] = {"args": list(self.args), "env": dict(self.env)}
        for spec_field in fields(self):
            key = spec_field.name
            value = getattr(self, key)
            if key in ("path", "args", "env", "after", "after_any", "after_one", "notify", "sweep"):
                continue
            if key == "target":
                out[key] = msgspec.to_builtins(value) if value is not None else None
            elif key in ("shared", "stdin"):
                if value:
                    out[key] = True
            elif value is not None:
                out[key] = value
        if self.after:
            out["after"] = list(self.after)
            out["after_any"] = self.after_any
            out["after_one"] = self.after_one
        if self.notify:
            out["notify"] = list(self.notify)
        if self.sweep:
            out["sweep"] = {key: list(values) for key, values in self.sweep}
        return out


def sweep_grid(sweep: Sequence[tuple[str, Sequence[str]]]) -> list[dict[str, str]]:
    """Every combination of a sweep's values: the cartesian product with the first key
    varying slowest (``lr = [a, b]``, ``seed = [1, 2]`` -> a1, a2, b1, b2)."""
    keys = [key for key, _ in sweep]
    return [
        dict(zip(keys, combo, strict=True)) for combo in itertools.product(*(v for _, v in sweep))
    ]


def placeholders(args: Sequence[str]) -> list[str]:
    """The ``{name}`` placeholders in ``args``, in order of first use."""
    return list(dict.fromkeys(name for arg in args for name in PLACEHOLDER.findall(arg)))


def check_sweep_args(args: Sequence[str], keys: Sequence[str], where: str) -> None:
    """Every placeholder in ``args`` names a sweep key and every key is used (else two tasks
    would run the same command)."""
    used = placeholders(args)
    unknown = [name for name in used if name not in keys]
    if unknown:
        raise PolluxError(
            f"{where}: the args use {{{unknown[0]}}}, which [sweep] does not define"
            f" (sweep keys: {', '.join(keys)})"
        )
    unused = [key for key in keys if key not in used]
    if unused:
        raise PolluxError(
            f"{where}: [sweep] {unused[0]} is not used in the args (put {{{unused[0]}}} in one)"
        )


def substitute(args: Sequence[str], values: dict[str, str]) -> list[str]:
    """``args`` with each ``{name}`` replaced by ``values[name]`` (every name must be there)."""
    return [PLACEHOLDER.sub(lambda m: values[m.group(1)], arg) for arg in args]


def _decode_job(job: dict[str, Any], where: Path) -> JobTable:
    """``[job]`` as a :class:`JobTable`: an unknown key names the closest known one, a wrong
    value names its key and what it must be."""
    check_keys(job, JOB_KEYS, "job", where=str(where))
    try:
        return msgspec.convert(job, JobTable, strict=True)
    except msgspec.ValidationError as exc:
        match = re.search(r"at `\$\.([A-Za-z_]+)", str(exc))
        key = match.group(1) if match else "?"
        value = job.get(key)
        expected = _EXPECTED.get(key) or ("a string" if key in JOB_KEYS else "valid")
        got = f", got {value!r}" if isinstance(value, int | float) else ""
        raise PolluxError(f"{where}: job.{key} must be {expected}{got}") from None


def _read_target(data: dict[str, Any], where: Path) -> Target | None:
    target = data.get("target")
    if target is None:
        return None
    if not isinstance(target, dict):
        raise PolluxError(f"{where}: [target] must be a table")
    check_keys(target, _TARGET_KEYS, "target", where=str(where))
    mode = target.get("mode", "max")
    if mode not in ("max", "min"):
        raise PolluxError(f"{where}: [target] mode must be 'max' or 'min', got {mode!r}")
    metric, value = target.get("metric"), target.get("value")
    if not isinstance(metric, str) or not isinstance(value, int | float) or isinstance(value, bool):
        raise PolluxError(f"{where}: [target] needs a metric name and a numeric value")
    try:
        return Target(metric=metric, value=float(value), mode=mode)
    except msgspec.ValidationError as exc:
        raise PolluxError(f"{where}: [target]: {exc}") from None


def _read_time(job: JobTable, where: Path) -> float | None:
    if job.time is None:
        return None
    try:
        seconds = parse_duration(job.time)
    except DurationError as exc:
        raise PolluxError(f"{where}: job.time: {exc}") from None
    if not 1.0 <= seconds <= 366 * 86400.0:
        raise PolluxError(f"{where}: job.time {job.time!r} must be from 1s to 366 days")
    return seconds


def _read_after(job: JobTable, where: Path) -> tuple[str, ...]:
    ids = []
    for item in job.after:
        text = str(item)
        if not text.isdigit() or len(text) > 15:
            raise PolluxError(f"{where}: job.after must list job ids, got {item!r}")
        ids.append(str(int(text)))
    for key in ("after_any", "after_one"):
        if getattr(job, key) and not ids:
            raise PolluxError(f"{where}: job.{key} needs job.after")
    if job.after_any and job.after_one:
        raise PolluxError(f"{where}: job.after_any and job.after_one cannot both be true")
    return tuple(dict.fromkeys(ids))


def _read_notify(job: JobTable, where: Path) -> tuple[tuple[str, ...], str | None]:
    if not all("://" in url for url in job.notify):
        raise PolluxError(f'{where}: job.notify must list URLs such as "ntfy://topic"')
    when = job.notify_on
    if when is not None and when not in ("end", "failure"):
        raise PolluxError(f"{where}: job.notify_on must be 'end' or 'failure', got {when!r}")
    return tuple(job.notify), when


def parse_constraint(values: Iterable[str], option: str) -> Constraint | None:
    """Constraints as text (``option`` names them in errors): ``KEY=VALUE`` pairs joined by
    ``;``, keys ``nodes`` (a comma-separated list of node names) and ``type`` (a device type):
    ``nodes=box1,box2``, ``type=a100``, ``nodes=box1;type=a100``.  ``None`` when nothing is
    given."""
    nodes: list[str] = []
    device_type: str | None = None
    given = False
    for value in values:
        for pair in filter(None, (p.strip() for p in value.split(";"))):
            key, sep, raw = pair.partition("=")
            key, raw = key.strip().lower(), raw.strip()
            if not sep or not raw:
                raise PolluxError(
                    f"{option} {pair!r}: expected KEY=VALUE (nodes=NAME[,NAME...] or type=TYPE)"
                )
            if key in ("nodes", "node"):
                for name in (n.strip() for n in raw.split(",")):
                    _check_word(name, "a node name", pair, option)
                    nodes.append(name)
            elif key in ("type", "device_type"):
                _check_word(raw, "a device type", pair, option)
                if device_type is not None and device_type != raw:
                    raise PolluxError(
                        f"{option}: two device types ({device_type}, {raw}); a job runs on one"
                    )
                device_type = raw
            else:
                raise PolluxError(
                    f"{option}: unknown key {key!r} (use nodes=NAME[,NAME...] or type=TYPE)"
                )
            given = True
    if not given:
        return None
    return Constraint(nodes=list(dict.fromkeys(nodes)), device_type=device_type)


def _check_word(word: str, what: str, pair: str, option: str) -> None:
    if not _WORD.match(word):
        raise PolluxError(f"{option} {pair!r}: {word!r} is not {what}")


def _read_constraint(job: JobTable, where: Path) -> Constraint | None:
    raw = job.constraint
    if raw is None:
        return None
    if isinstance(raw, str):
        return parse_constraint([raw], f"{where}: job.constraint")
    check_keys(raw, _CONSTRAINT_KEYS, "job.constraint", where=str(where))
    nodes, device_type = raw.get("nodes", []), raw.get("type")
    if isinstance(nodes, str):
        nodes = [nodes]
    if not isinstance(nodes, list) or not all(isinstance(n, str) and n for n in nodes):
        raise PolluxError(f"{where}: job.constraint.nodes must list node names")
    if device_type is not None and (not isinstance(device_type, str) or not device_type):
        raise PolluxError(f"{where}: job.constraint.type must be a device type")
    parts = [f"nodes={name}" for name in nodes]
    if device_type is not None:
        parts.append(f"type={device_type}")
    return parse_constraint(parts, f"{where}: job.constraint")


def _read_memory(job: JobTable, where: Path) -> int | None:
    if job.gpu_memory is None:
        return None
    try:
        return parse_size(job.gpu_memory)
    except SizeError as exc:
        raise PolluxError(f"{where}: job.gpu_memory: {exc}") from None


def _sweep_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _read_sweep(data: dict[str, Any], where: Path) -> tuple[tuple[str, tuple[str, ...]], ...]:
    sweep = data.get("sweep")
    if sweep is None:
        return ()
    if not isinstance(sweep, dict) or not sweep:
        raise PolluxError(f"{where}: [sweep] must be a table of value lists")
    out = []
    size = 1
    for key, values in sweep.items():
        if not _KEY.match(key):
            raise PolluxError(f"{where}: [sweep] key {key!r} must be a name (letters, digits, _)")
        if not isinstance(values, list) or not values:
            raise PolluxError(f"{where}: sweep.{key} must be a non-empty list of values")
        if not all(isinstance(v, str | int | float | bool) for v in values):
            raise PolluxError(f"{where}: sweep.{key} must list strings or numbers")
        texts = tuple(_sweep_value(v) for v in values)
        if len(set(texts)) != len(texts):
            raise PolluxError(f"{where}: sweep.{key} lists a value twice")
        size *= len(texts)
        if size > MAX_SWEEP_TASKS:
            raise PolluxError(f"{where}: [sweep] makes more than {MAX_SWEEP_TASKS} tasks")
        out.append((key, texts))
    return tuple(out)


def _check_bounds(job: JobTable, where: Path) -> None:
    """Each upper bound at least its lower bound; ``max_batch_size`` only with ``batch_size``."""
    base, top = job.batch_size, job.max_batch_size
    if base is not None and top is not None and top < base:
        raise PolluxError(f"{where}: max_batch_size {top} is below batch_size {base}")
    if top is not None and base is None:
        raise PolluxError(f"{where}: max_batch_size needs batch_size")
    low, high = job.min_local_batch, job.max_local_batch
    if low is not None and high is not None and high < low:
        raise PolluxError(f"{where}: max_local_batch {high} is below min_local_batch {low}")
    low, high = job.min_gpus, job.max_gpus
    if low is not None and high is not None and high < low:
        raise PolluxError(f"{where}: max_gpus {high} is below min_gpus {low}")


def load_job_spec(path: str | Path) -> JobSpec:
    """Read and check ``path``: ``[job]`` (required), ``[target]`` and ``[sweep]``."""
    where = Path(path)
    data = read_toml(where, "job spec")
    raw = data.get("job")
    if not isinstance(raw, dict):
        raise PolluxError(f"{where}: has no [job] table")
    check_keys(data, ("job", "target", "sweep"), "", where=str(where))
    job = _decode_job(raw, where)
    _check_bounds(job, where)
    sweep = _read_sweep(data, where)
    if sweep and job.array is not None:
        raise PolluxError(f"{where}: job.array and [sweep] both make an array: keep one")
    args = tuple(str(arg) for arg in job.args)
    if sweep:
        check_sweep_args(args, [k for k, _ in sweep], str(where))
    notify, notify_on = _read_notify(job, where)
    folder = where.resolve().parent
    return JobSpec(
        path=where,
        name=job.name,
        script=str(folder / job.script) if job.script is not None else None,
        args=args,
        workdir=str(folder / job.workdir) if job.workdir is not None else None,
        env={str(k): str(v) for k, v in job.env.items()},
        min_gpus=job.min_gpus,
        max_gpus=job.max_gpus,
        priority=job.priority,
        batch_size=job.batch_size,
        max_batch_size=job.max_batch_size,
        min_local_batch=job.min_local_batch,
        max_local_batch=job.max_local_batch,
        target=_read_target(data, where),
        time_limit_s=_read_time(job, where),
        after=_read_after(job, where),
        after_any=job.after_any,
        after_one=job.after_one,
        notify=notify,
        notify_on=notify_on,
        constraint=_read_constraint(job, where),
        array=job.array,
        max_running=job.max_running,
        gpu_memory=_read_memory(job, where),
        shared=job.shared,
        stdin=job.stdin,
        sweep=sweep,
    )


def load_training_spec(path: str | Path) -> TrainingSpec:
    """``load_job_spec(path).for_training()``: for a job's own ``train.py``."""
    return load_job_spec(path).for_training()
