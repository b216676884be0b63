"""Reading a job's TOML spec from inside its ``train.py``, and the stated quality target.

Shape (the daemon reads the same file)::

    [job]
    name = "digits-cnn"
    script = "train.py"          # relative to this file
    args = []
    min_gpus = 1
    max_gpus = 4
    batch_size = 32              # M0
    max_batch_size = 512         # M_max
    min_local_batch = 8
    max_local_batch = 256
    priority = 0
    env = { OMP_NUM_THREADS = "1" }

    [target]
    metric = "test_accuracy"
    value = 0.97
    mode = "max"                 # or "min"
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pollux_local.errors import PolluxError
from pollux_local.tomlfile import read_toml


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


@dataclass(frozen=True)
class JobSpec:
    """The batch bounds and target of a job, as its TOML file states them."""

    name: str
    base_batch: int
    max_batch: int
    min_local: int
    max_local: int | None
    target: Target

    def trainer_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``ElasticTrainer`` (batch bounds)."""
        return {
            "base_batch": self.base_batch,
            "max_batch": self.max_batch,
            "min_local": self.min_local,
            "max_local": self.max_local,
        }


def _positive_int(table: dict[str, Any], key: str, where: Path, default: int | None) -> int | None:
    value = table.get(key, default)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise PolluxError(f"{where}: [job] {key} must be a positive integer, got {value!r}")
    return value


def load_job_spec(path: str | Path) -> JobSpec:
    """Read and check ``path`` (errors are one-line ``PolluxError`` naming the file)."""
    p = Path(path)
    data = read_toml(p, "job spec")
    job = data.get("job")
    target = data.get("target")
    if not isinstance(job, dict) or not isinstance(target, dict):
        raise PolluxError(f"{p}: needs a [job] and a [target] table")
    base = _positive_int(job, "batch_size", p, None)
    if base is None:
        raise PolluxError(f"{p}: [job] batch_size is required")
    max_batch = _positive_int(job, "max_batch_size", p, base) or base
    min_local = _positive_int(job, "min_local_batch", p, 1) or 1
    max_local = _positive_int(job, "max_local_batch", p, None)
    if max_batch < base:
        raise PolluxError(f"{p}: max_batch_size {max_batch} is below batch_size {base}")
    if max_local is not None and max_local < min_local:
        raise PolluxError(f"{p}: max_local_batch {max_local} is below min_local_batch {min_local}")
    mode = target.get("mode", "max")
    if mode not in ("max", "min"):
        raise PolluxError(f"{p}: [target] mode must be 'max' or 'min', got {mode!r}")
    metric, value = target.get("metric"), target.get("value")
    if not isinstance(metric, str) or not isinstance(value, int | float):
        raise PolluxError(f"{p}: [target] needs a metric name and a numeric value")
    return JobSpec(
        name=str(job.get("name", p.parent.name)),
        base_batch=base,
        max_batch=max_batch,
        min_local=min_local,
        max_local=max_local,
        target=Target(metric, float(value), mode),
    )
