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
    after = [12, 13]             # start once these jobs succeeded (after_any: once they ended)
    after_any = false
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

Every problem is one ``PolluxError`` line naming the file and the key.  With a ``[sweep]``,
every ``{word}`` in the args must name a sweep key and every key must be used.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pollux_local.api.spec import Constraint
from pollux_local.durations import DurationError, parse_duration
from pollux_local.errors import PolluxError
from pollux_local.sizes import SizeError, parse_size
from pollux_local.tomlfile import read_toml

#: The keys ``[job]`` may hold and their TOML types.
JOB_KEYS: dict[str, type] = {
    "name": str,
    "script": str,
    "args": list,
    "workdir": str,
    "min_gpus": int,
    "max_gpus": int,
    "batch_size": int,
    "max_batch_size": int,
    "min_local_batch": int,
    "max_local_batch": int,
    "priority": int,
    "env": dict,
    "time": str,
    "after": list,
    "after_any": bool,
    "notify": list,
    "notify_on": str,
    "constraint": object,
    "gpu_memory": object,
    "shared": bool,
    "array": str,
    "max_running": int,
}
_POSITIVE = ("min_gpus", "max_gpus", "batch_size", "max_batch_size", "min_local_batch",
             "max_local_batch", "max_running")  # fmt: skip
#: The most tasks a sweep may make (``api.Submit.array``).
MAX_SWEEP_TASKS = 10_000
_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
#: A sweep placeholder in an argument: ``{name}``.
PLACEHOLDER = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")
_WORD = re.compile(r"^[A-Za-z0-9_.:@+-]{1,128}$")


@dataclass(frozen=True)
class Target:
    """The quality a job promises to reach: ``metric`` at least (``max``) or at most (``min``)
    ``value``."""

    metric: str
    value: float
    mode: str = "max"

    def reached(self, measured: float) -> bool:
        return measured >= self.value if self.mode == "max" else measured <= self.value

    def final_line(self, measured: float) -> str:
        """``TARGET REACHED metric=… value=…`` or ``TARGET MISSED metric=… value=… target=…``."""
        if self.reached(measured):
            return f"TARGET REACHED metric={self.metric} value={measured:.4f}"
        sign = ">=" if self.mode == "max" else "<="
        return (
            f"TARGET MISSED metric={self.metric} value={measured:.4f} target={sign}{self.value:g}"
        )

    def as_dict(self) -> dict[str, Any]:
        return {"metric": self.metric, "value": self.value, "mode": self.mode}


@dataclass(frozen=True)
class TrainingSpec:
    """What a training script needs from its spec: batch bounds and the target it reports."""

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
    """A checked ``job.toml``; paths are absolute, resolved against the file's folder; ``None``
    where the file says nothing."""

    path: Path
    name: str | None = None
    script: str | None = None
    args: tuple[str, ...] = ()
    workdir: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    min_gpus: int | None = None
    max_gpus: int | None = None
    priority: int | None = None
    base_batch: int | None = None
    max_batch: int | None = None
    min_local: int | None = None
    max_local: int | None = None
    target: Target | None = None
    time_limit_s: float | None = None
    after: tuple[str, ...] = ()
    after_any: bool = False
    notify: tuple[str, ...] = ()
    notify_on: str | None = None
    constraint: Constraint | None = None
    array: str | None = None
    max_running: int | None = None
    #: the device memory the job uses (bytes) and whether it may share its device
    gpu_memory: int | None = None
    shared: bool = False
    #: ``[sweep]``: each key with its values (as text), in the order the file gives them
    sweep: tuple[tuple[str, tuple[str, ...]], ...] = ()

    def for_training(self) -> TrainingSpec:
        """The training view; ``batch_size`` and ``[target]`` are then required."""
        if self.base_batch is None:
            raise PolluxError(f"{self.path}: job.batch_size is required")
        if self.target is None:
            raise PolluxError(f"{self.path}: needs a [target] table")
        return TrainingSpec(
            name=self.name or self.path.resolve().parent.name,
            base_batch=self.base_batch,
            max_batch=self.max_batch or self.base_batch,
            min_local=self.min_local or 1,
            max_local=self.max_local,
            target=self.target,
        )

    def submit_fields(self) -> dict[str, Any]:
        """The spec as ``submit`` request fields (only what the file states)."""
        fields: dict[str, Any] = {"args": list(self.args), "env": dict(self.env)}
        for key, value in (
            ("name", self.name),
            ("script", self.script),
            ("workdir", self.workdir),
            ("min_gpus", self.min_gpus),
            ("max_gpus", self.max_gpus),
            ("priority", self.priority),
            ("batch_size", self.base_batch),
            ("max_batch_size", self.max_batch),
            ("min_local_batch", self.min_local),
            ("max_local_batch", self.max_local),
            ("time_limit_s", self.time_limit_s),
            ("notify_on", self.notify_on),
            ("constraint", self.constraint),
            ("array", self.array),
            ("max_running", self.max_running),
            ("gpu_memory", self.gpu_memory),
        ):
            if value is not None:
                fields[key] = value
        if self.shared:
            fields["shared"] = True
        if self.after:
            fields["after"] = list(self.after)
            fields["after_any"] = self.after_any
        if self.notify:
            fields["notify"] = list(self.notify)
        if self.sweep:
            fields["sweep"] = {key: list(values) for key, values in self.sweep}
        fields["target"] = self.target.as_dict() if self.target else None
        return fields


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


_TYPE_NAMES = {
    str: "a string",
    list: "a list",
    int: "an integer",
    dict: "a table",
    bool: "true or false",
    object: "a value",
}


def _check_types(job: dict[str, Any], where: Path) -> None:
    for key, value in job.items():
        expected = JOB_KEYS.get(key)
        if expected is None:
            raise PolluxError(f"{where}: unknown key job.{key}")
        if not isinstance(value, expected) or (expected is int and isinstance(value, bool)):
            raise PolluxError(f"{where}: job.{key} must be {_TYPE_NAMES[expected]}")
    for key in _POSITIVE:
        if key in job and job[key] <= 0:
            raise PolluxError(f"{where}: job.{key} must be a positive integer, got {job[key]}")
    if not all(isinstance(arg, str | int | float) for arg in job.get("args", [])):
        raise PolluxError(f"{where}: job.args must be a list of strings")


def _read_target(data: dict[str, Any], where: Path) -> Target | None:
    target = data.get("target")
    if target is None:
        return None
    if not isinstance(target, dict):
        raise PolluxError(f"{where}: [target] must be a table")
    mode = target.get("mode", "max")
    if mode not in ("max", "min"):
        raise PolluxError(f"{where}: [target] mode must be 'max' or 'min', got {mode!r}")
    metric, value = target.get("metric"), target.get("value")
    if not isinstance(metric, str) or not isinstance(value, int | float) or isinstance(value, bool):
        raise PolluxError(f"{where}: [target] needs a metric name and a numeric value")
    return Target(metric, float(value), mode)


def _read_time(job: dict[str, Any], where: Path) -> float | None:
    text = job.get("time")
    if text is None:
        return None
    try:
        seconds = parse_duration(text)
    except DurationError as exc:
        raise PolluxError(f"{where}: job.time: {exc}") from None
    if not 1.0 <= seconds <= 366 * 86400.0:
        raise PolluxError(f"{where}: job.time {text!r} must be from 1s to 366 days")
    return seconds


def _read_after(job: dict[str, Any], where: Path) -> tuple[str, ...]:
    ids = []
    for item in job.get("after", []):
        text = str(item) if isinstance(item, int | str) and not isinstance(item, bool) else ""
        if not text.isdigit() or len(text) > 15:
            raise PolluxError(f"{where}: job.after must list job ids, got {item!r}")
        ids.append(str(int(text)))
    if job.get("after_any") and not ids:
        raise PolluxError(f"{where}: job.after_any needs job.after")
    return tuple(dict.fromkeys(ids))


def _read_notify(job: dict[str, Any], where: Path) -> tuple[tuple[str, ...], str | None]:
    urls = job.get("notify", [])
    if not all(isinstance(url, str) and "://" in url for url in urls):
        raise PolluxError(f'{where}: job.notify must list URLs such as "ntfy://topic"')
    when = job.get("notify_on")
    if when is not None and when not in ("end", "failure"):
        raise PolluxError(f"{where}: job.notify_on must be 'end' or 'failure', got {when!r}")
    return tuple(urls), when


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


def _read_constraint(job: dict[str, Any], where: Path) -> Constraint | None:
    raw = job.get("constraint")
    if raw is None:
        return None
    if isinstance(raw, str):
        return parse_constraint([raw], f"{where}: job.constraint")
    if not isinstance(raw, dict):
        raise PolluxError(f"{where}: job.constraint must be a table or a string")
    unknown = sorted(set(raw) - {"nodes", "type"})
    if unknown:
        raise PolluxError(f"{where}: unknown key job.constraint.{unknown[0]} (nodes, type)")
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


def load_job_spec(path: str | Path) -> JobSpec:
    """Read and check ``path``: ``[job]`` (required) and ``[target]`` (optional)."""
    where = Path(path)
    data = read_toml(where, "job spec")
    job = data.get("job")
    if not isinstance(job, dict):
        raise PolluxError(f"{where}: has no [job] table")
    _check_types(job, where)
    base = job.get("batch_size")
    max_batch = job.get("max_batch_size")
    if base is not None and max_batch is not None and max_batch < base:
        raise PolluxError(f"{where}: max_batch_size {max_batch} is below batch_size {base}")
    if max_batch is not None and base is None:
        raise PolluxError(f"{where}: max_batch_size needs batch_size")
    min_local, max_local = job.get("min_local_batch"), job.get("max_local_batch")
    if min_local is not None and max_local is not None and max_local < min_local:
        raise PolluxError(
            f"{where}: max_local_batch {max_local} is below min_local_batch {min_local}"
        )
    min_gpus, max_gpus = job.get("min_gpus"), job.get("max_gpus")
    if min_gpus is not None and max_gpus is not None and max_gpus < min_gpus:
        raise PolluxError(f"{where}: max_gpus {max_gpus} is below min_gpus {min_gpus}")
    sweep = _read_sweep(data, where)
    if sweep and "array" in job:
        raise PolluxError(f"{where}: job.array and [sweep] both make an array: keep one")
    if sweep:
        check_sweep_args(
            [str(arg) for arg in job.get("args", [])], [k for k, _ in sweep], str(where)
        )
    notify, notify_on = _read_notify(job, where)
    folder = where.resolve().parent
    return JobSpec(
        path=where,
        name=job.get("name"),
        script=str(folder / job["script"]) if "script" in job else None,
        args=tuple(str(arg) for arg in job.get("args", [])),
        workdir=str(folder / job["workdir"]) if "workdir" in job else None,
        env={str(k): str(v) for k, v in job.get("env", {}).items()},
        min_gpus=min_gpus,
        max_gpus=max_gpus,
        priority=job.get("priority"),
        base_batch=base,
        max_batch=max_batch,
        min_local=min_local,
        max_local=max_local,
        target=_read_target(data, where),
        time_limit_s=_read_time(job, where),
        after=_read_after(job, where),
        after_any=bool(job.get("after_any", False)),
        notify=notify,
        notify_on=notify_on,
        constraint=_read_constraint(job, where),
        array=job.get("array"),
        max_running=job.get("max_running"),
        gpu_memory=_read_memory(job, where),
        shared=bool(job.get("shared", False)),
        sweep=sweep,
    )


def _read_memory(job: dict[str, Any], where: Path) -> int | None:
    value = job.get("gpu_memory")
    if value is None:
        return None
    try:
        return parse_size(value)
    except SizeError as exc:
        raise PolluxError(f"{where}: job.gpu_memory: {exc}") from None


def load_training_spec(path: str | Path) -> TrainingSpec:
    """``load_job_spec(path).for_training()``: for a job's own ``train.py``."""
    return load_job_spec(path).for_training()
