"""Plain-text rendering of the daemon's typed replies for the terminal."""

from __future__ import annotations

import datetime
import os
import re
import shutil
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pollux_local.api.messages import JobSummary, NodeRow
from pollux_local.api.states import JobState
from pollux_local.durations import format_duration
from pollux_local.parsing import compress_indices
from pollux_local.untrusted import cells, cells_at_most, printable, wrap_cells


def fmt(value: Any, spec: str = "", empty: str = "-") -> str:
    if value is None:
        return empty
    return format(value, spec) if spec else str(value)


def duration(seconds: float | None) -> str:
    """An elapsed or expected time in tables: ``1h05m``, ``4m07s``, ``12s``; ``-`` when
    unknown (``durations.format_duration``, not exact)."""
    return format_duration(seconds, exact=False)


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


def table(rows: Sequence[Sequence[str]], numeric_from: int | None = None) -> str:
    """Rows as aligned columns (two spaces apart); columns from ``numeric_from`` on are
    right-aligned.  Control characters, newlines included, are escaped (:func:`printable`)."""
    shown = [[printable(cell, newline=False) for cell in row] for row in rows]
    widths = [max(cells(row[i]) for row in shown) for i in range(len(shown[0]))]

    def align(i: int, cell: str) -> str:
        pad = " " * (widths[i] - cells(cell))  # by terminal columns (wide characters take 2)
        return pad + cell if numeric_from is not None and i >= numeric_from else cell + pad

    return "\n".join("  ".join(align(i, c) for i, c in enumerate(row)).rstrip() for row in shown)


#: The order states are counted in on an array's line.
STATE_ORDER = (JobState.RUNNING, JobState.RESCALING, JobState.QUEUED, JobState.HELD,
               JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED)  # fmt: skip
_INDEX_SUFFIX = re.compile(r"\[[^\[\]]*\]$")
#: How far a note too wide for its row is indented on the lines under the row.
NOTE_INDENT = "    "


@dataclass(frozen=True)
class ArrayGroup:
    """The tasks of one array that a status page lists (``array_id`` is its first task's id)."""

    array_id: str
    tasks: tuple[JobSummary, ...]

    @property
    def label(self) -> str:
        """``12[0-5]``: the array's id and the indices of the tasks listed."""
        indices = [t.array_index for t in self.tasks if t.array_index is not None]
        return f"{self.array_id}[{compress_indices(indices)}]"

    @property
    def name(self) -> str:
        """The tasks' name without its ``[index]`` (or sweep values) suffix."""
        return _INDEX_SUFFIX.sub("", self.tasks[0].name) or self.tasks[0].name

    def counts(self) -> str:
        """``2 running, 3 queued, 1 succeeded``."""
        states = [task.state for task in self.tasks]
        return ", ".join(f"{states.count(s)} {s.value}" for s in STATE_ORDER if s in states)


def group_arrays(jobs: Sequence[JobSummary]) -> list[JobSummary | ArrayGroup]:
    """The jobs with each array's tasks gathered into one :class:`ArrayGroup`, placed where
    its first listed task is."""
    tasks: dict[str, list[JobSummary]] = {}
    for job in jobs:
        if job.array_id is not None:
            tasks.setdefault(job.array_id, []).append(job)
    out: list[JobSummary | ArrayGroup] = []
    for job in jobs:
        if job.array_id is None:
            out.append(job)
        elif tasks[job.array_id][0] is job:
            out.append(ArrayGroup(job.array_id, tuple(tasks[job.array_id])))
    return out


def note(job: JobSummary) -> str:
    """What a status line says beside the figures: why a job waits or ended, or a running
    job's time limit."""
    if job.state in (JobState.RUNNING, JobState.RESCALING):
        text = f"limit {format_duration(job.time_limit_s)}" if job.time_limit_s else ""
    elif job.state in (JobState.SUCCEEDED, JobState.CANCELLED):
        text = ""
    else:
        text = job.reason
    return text


def expected_start(job: JobSummary, now: float) -> str:
    """A queued job's expected start from the daemon's forecast: ``now``, ``in 12m05s``,
    ``within 12m05s`` (an upper bound: it waits behind a job of unknown length run until its
    time limit), or ``?`` when unknown; ``-`` for a job that is not queued."""
    if job.state is not JobState.QUEUED:
        return "-"
    if job.expected_start is None:
        return "?"
    wait = job.expected_start - now
    if wait < 1:
        return "now"
    return f"{'within' if job.expected_start_at_latest else 'in'} {duration(wait)}"


def _merged_devices(tasks: Sequence[JobSummary]) -> dict[str, list[str]]:
    merged: dict[str, list[str]] = {}
    for task in tasks:
        for node, devices in task.devices.items():
            merged.setdefault(node, []).extend(devices)
    return merged


def terminal_width() -> int | None:
    """The width to fit tables to: ``$COLUMNS`` when set, else the terminal's; ``None``
    (no limit) when the output is not a terminal (piped, redirected)."""
    columns = os.environ.get("COLUMNS", "")
    if columns.isdigit() and int(columns) > 0:
        return int(columns)
    if not sys.stdout.isatty():
        return None
    return shutil.get_terminal_size().columns


#: Where the lines of a ``show`` line that is too wide go on: past the labels' column.
SHOW_INDENT = " " * 14


def fit_line(line: str, width: int | None, indent: str = SHOW_INDENT) -> list[str]:
    """``line`` (one line, escaped) within ``width`` columns (``None``: any): as it is when it
    fits (:func:`cells_at_most`), else wrapped, its first line keeping the line's own leading
    spaces and the others behind ``indent``, so that no text the job controls starts a line
    where it could pass for another field (the terminal's own wrap would put it at column 0)."""
    if width is None or cells_at_most(line) <= width:
        return [line]
    body = line.lstrip(" ")
    lines = wrap_cells(body, width, indent)
    lines[0] = line[: len(line) - len(body)] + lines[0][len(indent) :]
    return lines


def table_with_notes(rows: Sequence[Sequence[str]], width: int | None) -> str:
    """Rows (the first a header) whose last cell is a note, as :func:`table` aligns them: a
    note that fits in ``width`` (``None``: any) stays on its row, a longer one is wrapped onto indented lines
    of its own under the row, whole, never cut."""
    lines = table([row[:-1] for row in rows]).splitlines()
    body = max(cells(line) for line in lines)
    out = []
    for index, (line, row) in enumerate(zip(lines, rows, strict=True)):
        text = printable(row[-1], newline=False)
        pad = body - cells(line)
        # the most the row and its note can take on a terminal (``cells_at_most``)
        most = cells_at_most(line) + pad + 2 + cells_at_most(text)
        if not text:
            out.append(line)
        elif index == 0 or width is None or most <= width:  # 0: the header
            out.append(f"{line}{' ' * pad}  {text}")
        else:
            out.append(line)
            out.extend(wrap_cells(text, max(width, len(NOTE_INDENT) + 20), NOTE_INDENT))
    return "\n".join(out)


def status_table(jobs: list[JobSummary], expand: bool = False, width: int | None = None) -> str:
    """The ``status`` table; each array on one line (its tasks counted by state) unless
    ``expand``.  Notes (why a job waits or ended) are whole: on the row when it fits in
    ``width`` (``None``: no limit), else wrapped under it (:func:`table_with_notes`)."""
    header = ("ID", "NAME", "OWNER", "STATE", "GPUS", "WHERE", "BATCH m×s×K", "GOODPUT", "EFF",
              "PROGRESS", "ETA", "START", "NOTE")  # fmt: skip
    rows: list[tuple[str, ...]] = [header]
    now = time.time()
    for item in jobs if expand else group_arrays(jobs):
        if isinstance(item, ArrayGroup):
            goodputs = [t.goodput for t in item.tasks if t.goodput is not None]
            etas = [t.eta_s for t in item.tasks if t.eta_s is not None and t.state.active]
            waiting = next(
                (t for t in item.tasks if t.state in (JobState.QUEUED, JobState.HELD) and t.reason),
                None,
            )
            rows.append(
                (
                    item.label,
                    item.name[:24],
                    item.tasks[0].owner,
                    item.counts(),
                    str(sum(t.gpus for t in item.tasks)),
                    where(_merged_devices(item.tasks)),
                    "-",
                    fmt(sum(goodputs) if goodputs else None, ".1f"),
                    "-",
                    "-",
                    duration(max(etas) if etas else None),
                    expected_start(waiting, now) if waiting is not None else "-",
                    note(waiting) if waiting is not None else "",
                )
            )
            continue
        job = item
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
                expected_start(job, now),
                note(job),
            )
        )
    return table_with_notes(rows, width)


def dependency(job: JobSummary) -> str:
    """``after 12, 13 (all succeeded)``, ``after any end of 12`` or ``after one of 12, 13
    succeeded``; ``-`` without any."""
    if not job.after:
        return "-"
    ids = ", ".join(job.after)
    if job.after_one:
        return f"after one of {ids} succeeded"
    return f"after any end of {ids}" if job.after_any else f"after {ids} (all succeeded)"


def node_line(node: NodeRow) -> str:
    """One node of ``nodes``: health, type, devices, load and who holds what."""
    status = "up" if node.up else f"DOWN ({node.error or 'unreachable'})"
    if node.drained:
        status += ", drained"
    used = ", ".join(f"{d}→job {j}" for d, j in sorted(node.jobs.items())) or "idle"
    return (
        f"{node.name} ({node.host}): {status}, {len(node.devices)} {node.device_type} device(s)"
        f" [{', '.join(node.devices)}], load/cpu {fmt(node.load, '.2f')}; {used}"
    )
