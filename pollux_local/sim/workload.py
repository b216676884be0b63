"""Workload traces: ``name,time,application,num_replicas,batch_size`` per job.

``time`` is the submission time in seconds; ``num_replicas``/``batch_size`` are the tuned static
configuration the baselines use (a goodput policy ignores them).
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path

from pollux_local.errors import PolluxError

COLUMNS = ("name", "time", "application", "num_replicas", "batch_size")


@dataclass(frozen=True)
class WorkloadJob:
    """One submitted job of a trace."""

    name: str
    time: float
    application: str
    num_replicas: int
    batch_size: int


def _positive_int(text: str, what: str, where: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise PolluxError(f"{where}: {what} {text!r} is not an integer") from None
    if value <= 0:
        raise PolluxError(f"{where}: {what} must be positive, got {value}")
    return value


def read_workload(path: Path) -> list[WorkloadJob]:
    """Read and validate a workload CSV; jobs come back sorted by submission time."""
    try:
        handle = path.open(newline="")
    except OSError as exc:
        raise PolluxError(f"cannot read workload {path}: {exc.strerror or exc}") from exc
    with handle:
        reader = csv.reader(handle)
        header = next(reader, None)
        if header is None:
            raise PolluxError(f"{path}: empty workload file")
        header = [h.strip() for h in header]
        missing = [c for c in COLUMNS if c not in header]
        if missing:
            raise PolluxError(f"{path}: missing column(s) {', '.join(missing)}")
        index = {c: header.index(c) for c in COLUMNS}
        jobs: list[WorkloadJob] = []
        seen: set[str] = set()
        for line_no, row in enumerate(reader, start=2):
            if not row or all(not cell.strip() for cell in row):
                continue
            where = f"{path}:{line_no}"
            if len(row) != len(header):
                raise PolluxError(
                    f"{where}: malformed row: expected {len(header)} fields, got {len(row)}"
                )
            name = row[index["name"]].strip()
            if not name:
                raise PolluxError(f"{where}: empty job name")
            if name in seen:
                raise PolluxError(f"{where}: duplicate job name {name!r}")
            seen.add(name)
            try:
                time = float(row[index["time"]])
            except ValueError:
                raise PolluxError(
                    f"{where}: submission time {row[index['time']]!r} is not a number"
                ) from None
            if not time >= 0:
                raise PolluxError(f"{where}: submission time must be >= 0, got {time}")
            application = row[index["application"]].strip()
            if not application:
                raise PolluxError(f"{where}: empty application")
            jobs.append(
                WorkloadJob(
                    name=name,
                    time=time,
                    application=application,
                    num_replicas=_positive_int(row[index["num_replicas"]], "num_replicas", where),
                    batch_size=_positive_int(row[index["batch_size"]], "batch_size", where),
                )
            )
    if not jobs:
        raise PolluxError(f"{path}: no jobs in workload")
    jobs.sort(key=lambda j: j.time)
    return jobs
