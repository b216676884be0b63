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

    [target]                     # optional for submit; a job's train.py may require it
    metric = "test_accuracy"
    value = 0.97
    mode = "max"                 # or "min"

Every problem is one ``PolluxError`` line naming the file and the key.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pollux_local.errors import PolluxError
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
}
_POSITIVE = ("min_gpus", "max_gpus", "batch_size", "max_batch_size", "min_local_batch",
             "max_local_batch")  # fmt: skip


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
        ):
            if value is not None:
                fields[key] = value
        fields["target"] = self.target.as_dict() if self.target else None
        return fields


_TYPE_NAMES = {str: "a string", list: "a list", int: "an integer", dict: "a table"}


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
    )


def load_training_spec(path: str | Path) -> TrainingSpec:
    """``load_job_spec(path).for_training()``: for a job's own ``train.py``."""
    return load_job_spec(path).for_training()
