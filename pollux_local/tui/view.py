"""Pure view logic of the TUI: rows of the jobs table, the device grid, cluster figures, logs.

Everything here reads the typed replies of :mod:`pollux_local.api` (``JobSummary``,
``NodeRow``, ``LogsReply``), already validated by the client; a value the daemon may leave
unknown (``None``) is shown as ``-``.  No textual import, no I/O.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pollux_local.api.messages import (
    JobSummary,
    Logs,
    LogsReply,
    NodeRow,
    StatusReply,
    UsageReply,
)
from pollux_local.api.states import PLACED_STATES, JobState
from pollux_local.durations import format_duration

#: Job states in their sort order.
STATES = tuple(state.value for state in JobState)
DASH = "-"

#: Colours given to jobs on the device grid (cycled by a stable hash of the job id).
JOB_COLOURS = (
    "#1f77b4",
    "#ff7f0e",
    "#2ca02c",
    "#d62728",
    "#9467bd",
    "#8c564b",
    "#e377c2",
    "#17becf",
    "#bcbd22",
    "#7f7f7f",
    "#aec7e8",
    "#ffbb78",
)
FREE_COLOUR = "#3a3a3a"
EXTERNAL_COLOUR = "#806000"
DOWN_COLOUR = "#5a0000"


def job_colour(job_id: str) -> str:
    """A colour for ``job_id`` that does not change between refreshes."""
    return JOB_COLOURS[zlib.crc32(job_id.encode()) % len(JOB_COLOURS)]


def fmt_number(value: float | None, digits: int = 1) -> str:
    """Compact number: 1234.5 -> '1.2k', None -> '-'."""
    if value is None:
        return DASH
    magnitude = abs(value)
    for limit, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if magnitude >= limit:
            return f"{value / limit:.{digits}f}{suffix}"
    return f"{value:.{digits}f}"


def fmt_duration(seconds: float | None) -> str:
    """Seconds as a column shows them (``durations.format_duration``, brief): '45s', '4m07s',
    '12m', '3h05m', '2d04h'; None or negative -> '-'."""
    known = seconds is not None and seconds >= 0
    return format_duration(seconds if known else None, exact=False, brief=True, unknown=DASH)


def fmt_progress(value: float | None) -> str:
    """Progress in base-batch iterations: 1234.5 -> '1.2k it'."""
    if value is None:
        return DASH
    return f"{fmt_number(value, 1 if abs(value) >= 1000 else 0)} it"


def fmt_placement(placement: Mapping[str, Sequence[str]]) -> str:
    """``{"ws1": ["cuda:0", "cuda:1"], "ws2": ["cuda:0"]}`` -> ``'ws1:0,1 ws2:0'``."""
    if not placement:
        return DASH
    return " ".join(
        f"{node}:{','.join(device.split(':')[-1] for device in devices)}"
        for node, devices in placement.items()
    )


@dataclass(frozen=True)
class JobRow:
    """One line of the jobs table (``None`` = unknown)."""

    id: str
    name: str
    owner: str
    state: str
    gpus: int
    where: str
    local_batch: int | None
    accum_steps: int | None
    replicas: int
    batch_size: int | None
    goodput: float | None
    efficiency: float | None
    speedup: float | None
    progress: float | None
    eta_s: float | None
    restarts: int
    priority: int
    #: a queued job: seconds to its expected start from the daemon's forecast (``None``:
    #: unknown), and its expected finish in seconds from now; ``*_at_latest``: that figure is
    #: an upper bound (it rests on a job of unknown length run until its time limit)
    start_in_s: float | None = None
    finish_in_s: float | None = None
    start_at_latest: bool = False
    finish_at_latest: bool = False
    #: why it waits (or how it ended)
    reason: str = ""

    @property
    def batch_text(self) -> str:
        """'m×s×K = M' when the split is known, else 'M'."""
        if self.local_batch and self.accum_steps and self.replicas:
            total = self.local_batch * self.accum_steps * self.replicas
            return f"{self.local_batch}×{self.accum_steps}×{self.replicas}={total}"
        return DASH if self.batch_size is None else str(self.batch_size)

    def cells(self) -> tuple[str, ...]:
        """The table cells in :data:`COLUMNS` order."""
        return (
            self.id,
            self.name,
            self.owner,
            self.state,
            f"{self.gpus} {self.where}" if self.gpus else DASH,
            self.batch_text,
            fmt_number(self.goodput),
            DASH if self.efficiency is None else f"{self.efficiency:.2f}",
            DASH if self.speedup is None else f"{self.speedup:.2f}x",
            fmt_progress(self.progress),
            fmt_duration(self.eta_s),
            self.start_text,
            str(self.restarts),
        )

    @property
    def waiting_text(self) -> str | None:
        """What a waiting (or failed) job's line shows in place of the figures it does not
        have: its reason (``None`` for other jobs, and one without a reason)."""
        return self.reason if self.state in WAITING_STATES and self.reason else None

    @property
    def start_text(self) -> str:
        """A queued job's expected start: ``now``, ``4m07s``, ``≤4m07s`` (at the latest: an
        upper bound) or ``?`` (unknown); ``-`` for other jobs."""
        if self.state != JobState.QUEUED.value:
            return DASH
        if self.start_in_s is None:
            return "?"
        if self.start_in_s < 1:
            return "now"
        return ("≤" if self.start_at_latest else "") + fmt_duration(self.start_in_s)

    @property
    def start_phrase(self) -> str:
        """The same in words: ``now``, ``in 4m07s``, ``within 4m07s`` (at the latest) or
        ``?``; ``-`` for a job that is not queued."""
        text = self.start_text
        if self.start_in_s is None or text in ("now", DASH):
            return text
        return f"{'within' if self.start_at_latest else 'in'} {fmt_duration(self.start_in_s)}"

    @property
    def finish_text(self) -> str:
        """Its expected finish: ``in 4m07s``, ``within 4m07s`` (at the latest: an upper
        bound) or ``?`` (unknown)."""
        if self.finish_in_s is None:
            return "?"
        return f"{'within' if self.finish_at_latest else 'in'} {fmt_duration(self.finish_in_s)}"


#: (key, header) of each column of the jobs table; the key is also the sort key's name.
COLUMNS: tuple[tuple[str, str], ...] = (
    ("id", "ID"),
    ("name", "Name"),
    ("owner", "Owner"),
    ("state", "State"),
    ("gpus", "Devices"),
    ("batch", "Batch m×s×K"),
    ("goodput", "Goodput"),
    ("efficiency", "Eff"),
    ("speedup", "Speedup"),
    ("progress", "Progress"),
    ("eta", "ETA"),
    ("start", "Start"),
    ("restarts", "Rst"),
)
#: The states whose reason the table shows, across the figures columns (from
#: :data:`SPAN_FROM` to :data:`SPAN_TO`): why it waits, why it failed.
WAITING_STATES = frozenset({"queued", "held", "failed"})
SPAN_FROM, SPAN_TO = "gpus", "eta"
SORT_KEYS = tuple(key for key, _ in COLUMNS)


def job_row(job: JobSummary, now: float | None = None) -> JobRow:
    """One job of ``status`` (or the job of ``show``) as a table row; ``now``: the time its
    expected start and finish are counted from (``None``: they are left unknown)."""
    queued = job.state is JobState.QUEUED and now is not None
    start = job.expected_start if queued else None
    finish = job.expected_finish if now is not None else None
    return JobRow(
        id=job.id,
        name=job.name,
        owner=job.owner,
        state=job.state.value,
        gpus=job.gpus,
        where=fmt_placement(job.devices),
        local_batch=job.local_batch,
        accum_steps=job.accum_steps,
        replicas=job.replicas,
        batch_size=job.batch_size,
        goodput=job.goodput,
        efficiency=job.efficiency,
        speedup=job.speedup,
        progress=job.progress,
        eta_s=job.eta_s,
        restarts=job.restarts,
        priority=job.priority,
        start_in_s=None if start is None or now is None else max(0.0, start - now),
        finish_in_s=None if finish is None or now is None else max(0.0, finish - now),
        start_at_latest=start is not None and job.expected_start_at_latest,
        finish_at_latest=finish is not None and job.expected_finish_at_latest,
        reason=job.reason,
    )


def job_rows(status: StatusReply, now: float | None = None) -> list[JobRow]:
    return [job_row(job, now) for job in status.jobs]


def _id_key(job_id: str) -> tuple[int, str]:
    digits = "".join(ch for ch in job_id if ch.isdigit())
    return (int(digits) if digits else -1, job_id)


def sort_rows(rows: Sequence[JobRow], key: str, reverse: bool = False) -> list[JobRow]:
    """Sort by a column key; unknown values always go last."""
    if key not in SORT_KEYS:
        raise ValueError(f"unknown sort key {key!r}")
    getters: dict[str, Any] = {
        "id": lambda r: _id_key(r.id),
        "name": lambda r: r.name.lower(),
        "owner": lambda r: r.owner.lower(),
        "state": lambda r: STATES.index(r.state) if r.state in STATES else len(STATES),
        "gpus": lambda r: r.gpus,
        "batch": lambda r: r.batch_size,
        "goodput": lambda r: r.goodput,
        "efficiency": lambda r: r.efficiency,
        "speedup": lambda r: r.speedup,
        "progress": lambda r: r.progress,
        "eta": lambda r: r.eta_s,
        "start": lambda r: r.start_in_s,
        "restarts": lambda r: r.restarts,
    }
    getter = getters[key]
    known = [r for r in rows if getter(r) is not None]
    unknown = [r for r in rows if getter(r) is None]
    known.sort(key=lambda r: (getter(r), _id_key(r.id)), reverse=reverse)
    return known + unknown


@dataclass(frozen=True)
class JobFilter:
    """``owner:alice state:running,queued word`` — all given parts must match."""

    owners: frozenset[str] = frozenset()
    states: frozenset[str] = frozenset()
    words: tuple[str, ...] = ()

    @classmethod
    def parse(cls, text: str) -> JobFilter:
        owners: set[str] = set()
        states: set[str] = set()
        words: list[str] = []
        for token in text.split():
            name, sep, value = token.partition(":")
            if sep and name.lower() in ("owner", "o", "user"):
                owners.update(v for v in value.split(",") if v)
            elif sep and name.lower() in ("state", "s"):
                states.update(v.lower() for v in value.split(",") if v)
            else:
                words.append(token.lower())
        return cls(frozenset(owners), frozenset(states), tuple(words))

    @property
    def empty(self) -> bool:
        return not (self.owners or self.states or self.words)

    def matches(self, row: JobRow) -> bool:
        if self.owners and row.owner not in self.owners:
            return False
        if self.states and row.state not in self.states:
            return False
        haystack = f"{row.id} {row.name} {row.owner} {row.state}".lower()
        return all(word in haystack for word in self.words)

    def describe(self) -> str:
        parts = []
        if self.owners:
            parts.append("owner:" + ",".join(sorted(self.owners)))
        if self.states:
            parts.append("state:" + ",".join(sorted(self.states)))
        parts.extend(self.words)
        return " ".join(parts)


def filter_rows(rows: Iterable[JobRow], flt: JobFilter) -> list[JobRow]:
    return [row for row in rows if flt.matches(row)]


# --------------------------------------------------------------------------------------------
# Device grid
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DeviceCell:
    """One device: ``status`` is ``job`` (held by ``job``), ``free``, ``external`` or ``down``."""

    node: str
    device: str
    status: str
    job: str | None = None


@dataclass(frozen=True)
class NodeCells:
    name: str
    up: bool
    devices: tuple[DeviceCell, ...] = field(default_factory=tuple)
    #: its devices' type (``cpu``, ``a100-40gb``...)
    device_type: str = ""


def node_cells(nodes: Sequence[NodeRow]) -> list[NodeCells]:
    """The device grid from ``nodes``: each node's devices, the job holding each (``jobs``),
    those busy outside the scheduler (``busy``); every device of a node that is down is down."""
    out: list[NodeCells] = []
    for node in nodes:
        busy = frozenset(node.busy)
        cells = []
        for device in node.devices:
            job = node.jobs.get(device)
            if not node.up:
                cell = DeviceCell(node.name, device, "down", job)
            elif job is not None:
                cell = DeviceCell(node.name, device, "job", job)
            elif device in busy:
                cell = DeviceCell(node.name, device, "external")
            else:
                cell = DeviceCell(node.name, device, "free")
            cells.append(cell)
        out.append(NodeCells(node.name, node.up, tuple(cells), node.device_type))
    return out


# --------------------------------------------------------------------------------------------
# Cluster-wide figures
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ClusterSample:
    """Cluster-wide figures at one instant.

    utilisation = devices held by jobs / devices up; efficiency = device-weighted mean
    statistical efficiency of running jobs; goodput = sum of running jobs' goodput.
    """

    time: float
    utilisation: float | None
    efficiency: float | None
    goodput: float
    queued: int
    running: int
    devices_up: int
    devices_busy: int


def cluster_sample(rows: Sequence[JobRow], cells: Sequence[NodeCells], now: float) -> ClusterSample:
    devices_up = sum(1 for n in cells for d in n.devices if d.status != "down")
    busy = sum(1 for n in cells for d in n.devices if d.status == "job")
    running = [r for r in rows if r.state in PLACED_STATES]
    if not cells:  # no node list: fall back on the jobs' own counts
        busy = sum(r.gpus for r in running)
    weight = sum(max(r.gpus, 1) for r in running if r.efficiency is not None)
    eff = (
        sum(max(r.gpus, 1) * (r.efficiency or 0.0) for r in running if r.efficiency is not None)
        / weight
        if weight
        else None
    )
    return ClusterSample(
        time=now,
        utilisation=(busy / devices_up) if devices_up else None,
        efficiency=eff,
        goodput=sum(r.goodput or 0.0 for r in running),
        queued=sum(1 for r in rows if r.state == JobState.QUEUED),
        running=len(running),
        devices_up=devices_up,
        devices_busy=busy,
    )


def _clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[: max(0, width - 1)] + "…"


def usage_lines(usage: UsageReply | None, width: int) -> list[str]:
    """The cluster panel's accounting: device-hours in all (by device type) and jobs run, then
    each user's device-hours, most first; ``-`` when the daemon gave none."""
    if usage is None:
        return [_clip("device-hours -", width)]
    total = usage.total
    types = ", ".join(f"{kind} {hours:.2f}" for kind, hours in total.by_type.items())
    head = f"device-hours {total.device_hours:.2f}" + (f" ({types})" if types else "")
    head += f" · {total.jobs} job{'s' if total.jobs != 1 else ''} run"
    users = " · ".join(f"{row.user} {row.device_hours:.2f}" for row in usage.users)
    return [_clip(head, width), _clip(f"by user: {users or 'none yet'}", width)]


# --------------------------------------------------------------------------------------------
# Logs
# --------------------------------------------------------------------------------------------

#: Log lines shown in the job detail / kept in the log view.
LOG_TAIL_LINES = 60
LOG_FOLLOW_LINES = 2000
LOG_TAIL_BYTES = 65536


def tail_request(job_id: str) -> Logs:
    """A ``logs`` request for the last :data:`LOG_TAIL_BYTES` of rank 0's log."""
    return Logs(id=job_id, offset=-LOG_TAIL_BYTES, max_bytes=LOG_TAIL_BYTES)


def log_lines(reply: LogsReply) -> list[str]:
    """The whole lines of a ``logs`` reply: ``data`` ends at byte ``offset`` of the log, so a
    chunk that starts after byte 0 may start in the middle of a line, which is dropped."""
    lines = reply.data.splitlines()
    if lines and reply.offset - len(reply.data.encode()) > 0:
        lines = lines[1:]
    return lines
