"""Pure view logic of the TUI: rows of the jobs table, the device grid, cluster figures.

Everything here reads the daemon's response dictionaries and tolerates missing or ``None``
fields (shown as ``-``).  No textual import, no I/O.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

STATES = ("queued", "running", "rescaling", "held", "succeeded", "failed", "cancelled")
ACTIVE_STATES = frozenset({"running", "rescaling"})
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


def as_number(value: Any) -> float | None:
    """A finite float from a daemon field, or None (missing, non-numeric, bool, inf, nan)."""
    if isinstance(value, bool) or value is None:
        return None
    try:
        out = float(value)
    except (TypeError, ValueError):
        return None
    return out if math.isfinite(out) else None


def _int(value: Any) -> int | None:
    num = as_number(value)
    return None if num is None else int(num)


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
    """Seconds -> '45s', '12m', '3h05m', '2d04h'; None -> '-'."""
    if seconds is None or seconds < 0:
        return DASH
    s = int(round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s" if s < 600 else f"{s // 60}m"
    if s < 86400:
        return f"{s // 3600}h{(s % 3600) // 60:02d}m"
    return f"{s // 86400}d{(s % 86400) // 3600:02d}h"


def fmt_progress(value: float | None) -> str:
    """Progress in base-batch iterations: 1234.5 -> '1.2k it'."""
    if value is None:
        return DASH
    return f"{fmt_number(value, 1 if abs(value) >= 1000 else 0)} it"


def fmt_placement(placement: Any) -> str:
    """``{"ws1": ["cuda:0", "cuda:1"], "ws2": ["cuda:0"]}`` -> ``'ws1:0,1 ws2:0'``."""
    if not isinstance(placement, Mapping) or not placement:
        return DASH
    parts = []
    for node, devices in placement.items():
        if isinstance(devices, list | tuple):
            short = ",".join(str(d).split(":")[-1] for d in devices)
        else:
            short = str(devices)
        parts.append(f"{node}:{short}")
    return " ".join(parts)


def placement_count(placement: Any) -> int:
    if not isinstance(placement, Mapping):
        return 0
    total = 0
    for devices in placement.values():
        if isinstance(devices, list | tuple):
            total += len(devices)
        else:
            total += _int(devices) or 0
    return total


@dataclass(frozen=True)
class JobRow:
    """One line of the jobs table, already parsed (``None`` = unknown)."""

    id: str
    name: str
    owner: str
    state: str
    gpus: int
    where: str
    local_batch: int | None
    accum_steps: int | None
    replicas: int | None
    batch_size: int | None
    goodput: float | None
    efficiency: float | None
    speedup: float | None
    progress: float | None
    eta_s: float | None
    restarts: int | None
    priority: int | None

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
            DASH if self.restarts is None else str(self.restarts),
        )


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
    ("restarts", "Rst"),
)
SORT_KEYS = tuple(key for key, _ in COLUMNS)


def job_placement(job: Mapping[str, Any]) -> Any:
    """The job's ``{node: [devices]}`` (``placement``, or ``devices`` as the daemon sends it)."""
    placement = job.get("placement")
    if not isinstance(placement, Mapping):
        placement = job.get("devices")
    return placement


def job_row(job: Mapping[str, Any]) -> JobRow:
    """Parse one job of a ``status`` response."""
    placement = job_placement(job)
    gpus = _int(job.get("gpus"))
    if gpus is None:
        gpus = placement_count(placement)
    return JobRow(
        id=str(job.get("id", "?")),
        name=str(job.get("name") or job.get("id") or "?"),
        owner=str(job.get("owner") or DASH),
        state=str(job.get("state") or "unknown"),
        gpus=gpus,
        where=fmt_placement(placement),
        local_batch=_int(job.get("local_batch")),
        accum_steps=_int(job.get("accum_steps")),
        replicas=_int(job.get("replicas")),
        batch_size=_int(job.get("batch_size")),
        goodput=as_number(job.get("goodput")),
        efficiency=as_number(job.get("efficiency")),
        speedup=as_number(job.get("speedup")),
        progress=as_number(job.get("progress")),
        eta_s=as_number(job.get("eta_s")),
        restarts=_int(job.get("restarts")),
        priority=_int(job.get("priority")),
    )


def job_rows(status: Mapping[str, Any]) -> list[JobRow]:
    jobs = status.get("jobs")
    if not isinstance(jobs, list):
        return []
    return [job_row(job) for job in jobs if isinstance(job, Mapping)]


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


_EXTERNAL_WORDS = frozenset({"external", "busy_external", "foreign", "used", "other"})
_DOWN_WORDS = frozenset({"down", "unreachable", "offline", "lost"})


def _device_entry(
    node: str,
    raw: Any,
    node_up: bool,
    holders: Mapping[tuple[str, str], str],
    external: frozenset[str] = frozenset(),
) -> DeviceCell:
    if isinstance(raw, Mapping):
        device = str(raw.get("id") or raw.get("device") or raw.get("name") or "?")
        job = raw.get("job") if raw.get("job") is not None else raw.get("job_id")
        job = None if job in (None, "") else str(job)
        word = str(raw.get("state") or raw.get("status") or "").lower()
        if raw.get("external") is True:
            word = "external"
        if raw.get("up") is False:
            word = "down"
    else:
        device, job, word = str(raw), None, ""
    if job is None:
        job = holders.get((node, device))
    if device in external:
        word = word or "external"
    if not node_up or word in _DOWN_WORDS:
        return DeviceCell(node, device, "down", job)
    if job is not None:
        return DeviceCell(node, device, "job", job)
    if word in _EXTERNAL_WORDS:
        return DeviceCell(node, device, "external")
    return DeviceCell(node, device, "free")


def device_holders(status: Mapping[str, Any]) -> dict[tuple[str, str], str]:
    """(node, device) -> job id, from the jobs' placements (for node lists without holders)."""
    holders: dict[tuple[str, str], str] = {}
    jobs = status.get("jobs")
    for job in jobs if isinstance(jobs, list) else []:
        if not isinstance(job, Mapping) or job.get("state") not in ACTIVE_STATES:
            continue
        placement = job_placement(job)
        if not isinstance(placement, Mapping):
            continue
        for node, devices in placement.items():
            if isinstance(devices, list | tuple):
                for dev in devices:
                    holders[(str(node), str(dev))] = str(job.get("id"))
    return holders


def node_cells(nodes: Mapping[str, Any], status: Mapping[str, Any]) -> list[NodeCells]:
    """Parse a ``nodes`` response into the device grid."""
    raw_nodes = nodes.get("nodes")
    holders = device_holders(status)
    out: list[NodeCells] = []
    if isinstance(raw_nodes, Mapping):  # {"ws1": {...}} form
        raw_nodes = [
            dict(v, name=k) if isinstance(v, Mapping) else {"name": k} for k, v in raw_nodes.items()
        ]
    for raw in raw_nodes if isinstance(raw_nodes, list) else []:
        if not isinstance(raw, Mapping):
            continue
        name = str(raw.get("name") or raw.get("node") or "?")
        up = raw.get("up", raw.get("reachable", True)) is not False
        state = str(raw.get("state") or "").lower()
        if state in _DOWN_WORDS:
            up = False
        devices = raw.get("devices")
        if isinstance(devices, int):
            devices = [f"dev:{i}" for i in range(devices)]
        node_holders = dict(holders)
        jobs_on_node = raw.get("jobs")  # {device: job id}, as the daemon sends it
        if isinstance(jobs_on_node, Mapping):
            node_holders.update({(name, str(d)): str(j) for d, j in jobs_on_node.items()})
        busy = raw.get("busy")  # devices used by processes outside the scheduler
        external = frozenset(str(d) for d in busy) if isinstance(busy, list) else frozenset()
        cells = tuple(
            _device_entry(name, d, up, node_holders, external)
            for d in (devices if isinstance(devices, list) else [])
        )
        out.append(NodeCells(name, up, cells))
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
    running = [r for r in rows if r.state in ACTIVE_STATES]
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
        queued=sum(1 for r in rows if r.state == "queued"),
        running=len(running),
        devices_up=devices_up,
        devices_busy=busy,
    )


def samples_from_history(history: Any) -> list[ClusterSample]:
    """Parse a ``cluster.history`` list (when the daemon sends one) into samples."""
    out: list[ClusterSample] = []
    for item in history if isinstance(history, list) else []:
        if not isinstance(item, Mapping):
            continue
        t = as_number(item.get("time"))
        if t is None:
            continue
        out.append(
            ClusterSample(
                time=t,
                utilisation=as_number(item.get("utilisation")),
                efficiency=as_number(item.get("efficiency")),
                goodput=as_number(item.get("goodput")) or 0.0,
                queued=_int(item.get("queued")) or 0,
                running=_int(item.get("running")) or 0,
                devices_up=_int(item.get("devices_up")) or 0,
                devices_busy=_int(item.get("devices_busy")) or 0,
            )
        )
    return out


# --------------------------------------------------------------------------------------------
# Logs
# --------------------------------------------------------------------------------------------

#: Log lines shown in the job detail / kept in the log view.
LOG_TAIL_LINES = 60
LOG_FOLLOW_LINES = 2000
LOG_TAIL_BYTES = 65536


def tail_fields(job_id: Any) -> dict[str, Any]:
    """A ``logs`` request for the last :data:`LOG_TAIL_BYTES` of rank 0's log."""
    return {"id": str(job_id), "offset": -LOG_TAIL_BYTES, "max_bytes": LOG_TAIL_BYTES}


def log_lines(reply: Mapping[str, Any]) -> list[str]:
    """The lines of a ``logs`` reply (a list under ``lines``, or text under text/data/log)."""
    lines = reply.get("lines")
    if isinstance(lines, list):
        return [str(line).rstrip("\n") for line in lines]
    for key in ("text", "data", "log", "content"):
        text = reply.get(key)
        if isinstance(text, str):
            out = text.splitlines()
            size, end = as_number(reply.get("size")), as_number(reply.get("offset"))
            if out and size is not None and end is not None and end - len(text.encode()) > 0:
                out = out[1:]  # the chunk starts mid-line
            return out
    return []
