"""Terminal plots of a job's fitted models and of time series, drawn with plotext.

The curves come from the pure core: predicted throughput from
``pollux_local.core.throughput.predict_throughput`` and statistical efficiency from
``pollux_local.core.efficiency.efficiency``, both fed with what ``show`` returns (a typed
:class:`pollux_local.api.JobDetail`).  Rendering
returns ANSI text; plotext keeps one global figure, so rendering is serialised by a lock.
"""

from __future__ import annotations

import math
import re
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import msgspec
import numpy as np

from pollux_local.api.messages import JobDetail
from pollux_local.api.report import ProfileRow
from pollux_local.core.throughput import ThroughputParams
from pollux_local.core.types import BatchBounds, GradStats
from pollux_local.untrusted import printable

_PLOT_LOCK = threading.Lock()


@dataclass(frozen=True)
class Series:
    """One curve or point set: ``lines`` joins the points, else they are a scatter."""

    x: Sequence[float]
    y: Sequence[float]
    label: str | None = None
    lines: bool = True
    marker: str = "braille"


@dataclass(frozen=True)
class PlotSpec:
    """Everything needed to draw one plot; ``note`` replaces the plot when there is no data."""

    title: str
    series: tuple[Series, ...] = ()
    xlabel: str = ""
    ylabel: str = ""
    note: str | None = None
    xlog: bool = False
    integer_x: bool = False
    extra: dict[str, Any] = field(default_factory=dict)


def render(spec: PlotSpec, width: int, height: int) -> str:
    """Draw ``spec`` in ``width`` x ``height`` cells; ANSI-coloured text.  Its title, labels
    and note are made printable first (the result is read back as ANSI)."""
    spec = _printable_spec(spec)
    width = max(width, 16)
    height = max(height, 6)
    drawable = [s for s in spec.series if len(s.x) and len(s.x) == len(s.y)]
    if spec.note is not None or not drawable:
        note = spec.note or "no data yet"
        lines = [spec.title.center(width)[:width], ""]
        lines.extend(_wrap(note, width))
        return "\n".join(lines)
    import plotext

    labelled = [s for s in drawable if s.label]
    legend = _legend_line(drawable, width) if labelled else ""
    with _PLOT_LOCK:
        fig = plotext.figure
        fig.clear()
        fig.plot_size(width, height - (1 if legend else 0))
        fig.theme("simple")
        fig.legend(False)
        for series in drawable:
            xs = [float(v) for v in series.x]
            if spec.xlog:
                xs = [math.log2(v) if v > 0 else 0.0 for v in xs]
            sig = fig.signal(xs, [float(v) for v in series.y], marker=series.marker)
            if series.lines and len(xs) > 1:
                sig.lines()
            fig.draw(sig)
        if spec.xlog:
            lo = min(min(s.x) for s in drawable)
            hi = max(max(s.x) for s in drawable)
            ticks = _log2_ticks(float(lo), float(hi))
            if ticks:
                fig.ruler("x").ticks([math.log2(t) for t in ticks], [_short(t) for t in ticks])
        elif spec.integer_x:
            lo = int(min(min(s.x) for s in drawable))
            hi = int(max(max(s.x) for s in drawable))
            step = max(1, math.ceil((hi - lo + 1) / 8))
            fig.ruler("x").ticks([float(v) for v in range(lo, hi + 1, step)])
        fig.title(spec.title)
        if spec.xlabel:
            fig.label(spec.xlabel)
        plot = str(fig.build()).rstrip("\n")
    return f"{plot}\n{legend}" if legend else plot


def _printable_spec(spec: PlotSpec) -> PlotSpec:
    """``spec`` with no control character in the text it shows."""
    series = tuple(
        replace(s, label=printable(s.label, newline=False)) if s.label else s for s in spec.series
    )
    return replace(
        spec,
        title=printable(spec.title, newline=False),
        xlabel=printable(spec.xlabel, newline=False),
        ylabel=printable(spec.ylabel, newline=False),
        note=None if spec.note is None else printable(spec.note),
        series=series,
    )


#: Foreground colours (xterm-256 codes) plotext's "simple" theme gives successive signals.
_SIGNAL_COLOURS = (12, 10, 9, 14, 13, 11)


def _legend_line(series: Sequence[Series], width: int) -> str:
    """One line naming each series in its plot colour (plotext's in-plot legend hides data)."""
    parts = []
    for index, item in enumerate(series):
        if not item.label:
            continue
        colour = _SIGNAL_COLOURS[index % len(_SIGNAL_COLOURS)]
        mark = "━" if item.lines else item.marker[:1]
        parts.append(f"\x1b[38;5;{colour}m{mark}\x1b[0m {item.label}")
    line = "  ".join(parts)
    visible = len(re.sub(r"\x1b\[[0-9;]*m", "", line))
    pad = max(0, (width - visible) // 2)
    return " " * pad + line


def _wrap(text: str, width: int) -> list[str]:
    words = text.split()
    lines: list[str] = []
    current = ""
    for word in words:
        if current and len(current) + 1 + len(word) > width:
            lines.append(current)
            current = word
        else:
            current = f"{current} {word}" if current else word
    if current:
        lines.append(current)
    return lines


def _short(value: float) -> str:
    if value >= 1000:
        return f"{value / 1000:g}k"
    return f"{value:g}"


def _log2_ticks(lo: float, hi: float, most: int = 6) -> list[float]:
    if lo <= 0 or hi <= lo:
        return []
    first, last = math.ceil(math.log2(lo)), math.floor(math.log2(hi))
    powers = list(range(first, last + 1))
    step = max(1, math.ceil(len(powers) / most))
    return [float(2**p) for p in powers[::step]]


# --------------------------------------------------------------------------------------------
# Reading ``show``
# --------------------------------------------------------------------------------------------


def model_params(detail: JobDetail) -> ThroughputParams | None:
    """The job's fitted ``ThroughputParams`` (``model.params``), or ``None`` before it has one
    (or when the daemon's model has parameters this view does not know)."""
    if detail.model is None:
        return None
    try:
        return ThroughputParams.from_dict(detail.model.params)
    except (KeyError, TypeError, ValueError):
        return None


def _profile(detail: JobDetail) -> list[ProfileRow]:
    return list(detail.report.profile) if detail.report is not None else []


def fit_from_profile(detail: JobDetail) -> ThroughputParams | None:
    """Fit ``ThroughputParams`` with the core's ``fit_points`` (the model alone, as ``show``
    reports it) from the profile of the job's report, for a job whose ``show`` carries the
    observations but no fitted model yet."""
    from pollux_local.core.fitting import fit_points, points_from_rows

    try:
        points = points_from_rows(msgspec.structs.asdict(row) for row in _profile(detail))
        return fit_points(points, correct=False).params
    except ValueError:
        return None


def grad_stats(detail: JobDetail) -> GradStats | None:
    """The gradient statistics of the job's last report."""
    stats = detail.report.grad_stats if detail.report is not None else None
    return None if stats is None else GradStats(sqr=stats.sqr, var=stats.var)


def batch_bounds(detail: JobDetail) -> BatchBounds | None:
    """The batch bounds the job runs under: its report's, else those it was submitted with
    (``batch_bounds``, when they name a base batch)."""
    try:
        reported = detail.report.bounds if detail.report is not None else None
        if reported is not None:
            return BatchBounds(
                base_batch=reported.base_batch,
                max_batch=reported.max_batch or reported.base_batch,
                min_local=reported.min_local or 1,
                max_local=reported.max_local,
                accumulation=reported.accumulation,
            )
        submitted = detail.batch_bounds
        if submitted.batch_size is None:
            return None
        return BatchBounds(
            base_batch=submitted.batch_size,
            max_batch=submitted.max_batch_size or submitted.batch_size,
            min_local=submitted.min_local_batch or 1,
            max_local=submitted.max_local_batch,
        )
    except ValueError:  # bounds the core refuses (max below base): no efficiency curve
        return None


def profile_points(detail: JobDetail) -> list[tuple[int, int, int, float]]:
    """(nodes, replicas, m, observed examples/s of a synchronising step) per profile point."""
    return [
        (row.nodes, row.replicas, row.local_batch, row.replicas * row.local_batch / row.step_s)
        for row in _profile(detail)
    ]


# --------------------------------------------------------------------------------------------
# The job detail plots
# --------------------------------------------------------------------------------------------


#: The most devices a throughput plot's axis spans (what a job reports beyond is left out).
MAX_PLOT_DEVICES = 1024


def throughput_plot(detail: JobDetail, max_devices: int, devices_per_node: int) -> PlotSpec:
    """Predicted examples/s vs device count at the job's micro-batch (s = 1), observed points."""
    from pollux_local.core.throughput import predict_throughput

    title = "throughput vs devices"
    points = profile_points(detail)
    params = model_params(detail)
    if params is None:
        params = fit_from_profile(detail)
        if params is not None:
            title = "throughput vs devices (fit of profile)"
    if params is None:
        return PlotSpec(title, note="no fitted model yet (the job has not reported a profile)")
    local: float
    if detail.local_batch is not None:
        local = float(detail.local_batch)
    else:
        bounds = batch_bounds(detail)
        local = float(points[-1][2]) if points else float(bounds.base_batch if bounds else 1)
    per_node = max(devices_per_node, 1)
    # the axis spans the devices there are and those the job ran on (a node down now), at
    # most MAX_PLOT_DEVICES: a point the job reports beyond (its report is its own word) is
    # left out, not allowed to stretch the axis to millions of devices
    top = min(max([max_devices, 2] + [p[1] for p in points]), MAX_PLOT_DEVICES)
    points = [p for p in points if 1 <= p[1] <= top]
    ks = np.arange(1, top + 1)
    nodes = np.ceil(ks / per_node)
    predicted = predict_throughput(params, nodes, ks, np.full(ks.shape, local), 1)
    series = [
        Series(ks.tolist(), np.asarray(predicted, dtype=float).tolist(), f"model m={int(local)}")
    ]
    if points:
        series.append(
            Series(
                [p[1] for p in points], [p[3] for p in points], "observed", lines=False, marker="x"
            )
        )
    return PlotSpec(title, tuple(series), xlabel="devices", ylabel="examples/s", integer_x=True)


def efficiency_plot(detail: JobDetail) -> PlotSpec:
    """Statistical efficiency vs total batch M at the job's current noise scale."""
    from pollux_local.core.efficiency import efficiency

    title = "efficiency vs batch size"
    stats, bounds = grad_stats(detail), batch_bounds(detail)
    if stats is None or bounds is None:
        return PlotSpec(title, note="no gradient statistics yet")
    top = max(bounds.max_batch, bounds.base_batch * 2)
    batches = np.unique(np.geomspace(bounds.base_batch, top, 40).round())
    eff = np.asarray(efficiency(stats, bounds.base_batch, batches), dtype=float)
    series = [Series(batches.tolist(), eff.tolist(), "efficiency")]
    current = detail.batch_size
    if current is not None and current >= bounds.base_batch:
        now = float(np.asarray(efficiency(stats, bounds.base_batch, np.array([current])))[0])
        series.append(Series([current], [now], f"now M={current}", lines=False, marker="o"))
    return PlotSpec(title, tuple(series), xlabel="batch size M", xlog=True)


def history_plot(detail: JobDetail) -> PlotSpec:
    """Goodput and noise scale over the job's history (each scaled to its own maximum)."""
    title = "goodput & noise scale over time"
    history = detail.history
    if not history:
        return PlotSpec(title, note="no history yet")
    start = min(h.time for h in history)
    minutes = [(h.time - start) / 60.0 for h in history]
    series = []
    for values, label in (
        ([h.goodput for h in history], "goodput"),
        ([h.noise_scale for h in history], "noise scale"),
    ):
        pairs = [(x, v) for x, v in zip(minutes, values, strict=True) if v is not None]
        if not pairs:
            continue
        top = max(v for _, v in pairs) or 1.0
        series.append(
            Series([x for x, _ in pairs], [v / top for _, v in pairs], f"{label} (max {top:.4g})")
        )
    if not series:
        return PlotSpec(title, note="no history yet")
    return PlotSpec(title, tuple(series), xlabel="minutes", ylabel="fraction of max")


def cluster_plot(
    times: Sequence[float],
    goodput: Sequence[float],
    efficiency: Sequence[float | None],
    utilisation: Sequence[float | None],
) -> PlotSpec:
    """Cluster goodput (scaled to its max), efficiency and utilisation over time."""
    title = "cluster over time"
    if len(times) < 2:
        return PlotSpec(title, note="collecting samples…")
    start = times[0]
    minutes = [(t - start) / 60.0 for t in times]
    series = []
    top = max(goodput) or 1.0
    series.append(Series(minutes, [g / top for g in goodput], f"goodput (max {top:.4g})"))
    for values, label in ((efficiency, "efficiency"), (utilisation, "utilisation")):
        pairs = [(x, v) for x, v in zip(minutes, values, strict=True) if v is not None]
        if pairs:
            series.append(Series([x for x, _ in pairs], [v for _, v in pairs], label))
    return PlotSpec(title, tuple(series), xlabel="minutes")
