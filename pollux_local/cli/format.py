"""Plain-text rendering of the daemon's typed replies for the terminal."""

from __future__ import annotations

import datetime
import re
from typing import Any

from pollux_local.api.messages import JobSummary

_CONTROL = re.compile(r"[\x00-\x09\x0b-\x1f\x7f-\x9f]")


def printable(text: str) -> str:
    """``text`` with every control character but the newline shown as an escape (``\\x1b``):
    what a job controls (its command line, its last log line as a failure reason) must not
    reach another user's terminal as escape sequences."""
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


def fmt(value: Any, spec: str = "", empty: str = "-") -> str:
    if value is None:
        return empty
    return format(value, spec) if spec else str(value)


def duration(seconds: float | None) -> str:
    """``1h05m``, ``4m07s``, ``12s``; ``-`` when unknown."""
    if seconds is None:
        return "-"
    seconds = int(seconds)
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    if seconds >= 60:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds}s"


def where(devices: dict[str, list[str]]) -> str:
    """``node:0,1 other:3``, or ``-`` when the job holds no device."""
    if not devices:
        return "-"
    return " ".join(
        f"{node}:{','.join(d.partition(':')[2] for d in devs)}" for node, devs in devices.items()
    )


def batch(job: JobSummary) -> str:
    """``m x s x K`` while running, else the total batch size."""
    if job.local_batch:
        return f"{job.local_batch}x{job.accum_steps or 1}x{job.replicas}"
    return fmt(job.batch_size)


def timestamp(stamp: float | None) -> str:
    if stamp is None:
        return "-"
    return datetime.datetime.fromtimestamp(stamp).strftime("%Y-%m-%d %H:%M:%S")


def status_table(jobs: list[JobSummary]) -> str:
    header = ("ID", "NAME", "OWNER", "STATE", "GPUS", "WHERE", "BATCH m×s×K", "GOODPUT", "EFF",
              "PROGRESS", "ETA")  # fmt: skip
    rows = [header]
    for job in jobs:
        rows.append(
            (
                job.id,
                job.name[:24],
                job.owner,
                job.state.value,
                str(job.gpus),
                where(job.devices),
                batch(job),
                fmt(job.goodput, ".1f"),
                fmt(job.efficiency, ".2f"),
                fmt(job.progress, ".0f"),
                duration(job.eta_s),
            )
        )
    rows = [tuple(printable(cell) for cell in row) for row in rows]  # type: ignore[misc]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=False)).rstrip() for row in rows
    )
