"""Terminal plots of a job's fitted models and of time series, drawn with plotext.

The curves come from the pure core: predicted throughput from
``pollux_local.core.throughput.predict_throughput`` and statistical efficiency from
``pollux_local.core.efficiency.efficiency``, both fed with what ``show`` returns.  Rendering
returns ANSI text; plotext keeps one global figure, so rendering is serialised by a lock.
"""

from __future__ import annotations

import math
import re
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pollux_local.core.types import BatchBounds, GradStats
from pollux_local.tui.view import as_number

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
    """Draw ``spec`` in ``width`` x ``height`` cells; ANSI-coloured text."""
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


def section(detail: Mapping[str, Any], key: str) -> Any:
    """``detail[key]``, else the same key inside the job's last ``report`` or its ``model``."""
    value = detail.get(key)
    if value is not None:
        return value
    for outer in ("report", "model"):
        inner = detail.get(outer)
        if isinstance(inner, Mapping) and inner.get(key) is not None:
            return inner.get(key)
    return None


def model_params(detail: Mapping[str, Any]) -> Any | None:
    """The job's fitted ``ThroughputParams`` from a ``show`` job, or ``None``."""
    from pollux_local.core.throughput import ThroughputParams

    raw: Any = None
    model = detail.get("model")
    if isinstance(model, Mapping):
        raw = model.get("params", model)
    for key in ("params", "throughput_params", "fitted_params"):
        if raw is None or not isinstance(raw, Mapping):
            raw = detail.get(key)
    if not isinstance(raw, Mapping):
        return None
    try:
        return ThroughputParams.from_dict(
            {k: float(v) for k, v in raw.items() if as_number(v) is not None}
        )
    except (KeyError, TypeError, ValueError):
        return None


def fit_from_profile(detail: Mapping[str, Any]) -> Any | None:
    """Fit ``ThroughputParams`` with the core's ``fit_points`` (the model alone, as ``show``
    reports it) from the job's profile, for daemons whose ``show`` carries the observations
    but not the fitted parameters.  Malformed rows are skipped."""
    from pollux_local.core.fitting import fit_points, points_from_rows
    from pollux_local.core.pool import Point, Times

    raw = section(detail, "profile")
    points: dict[Point, Times] = {}
    for item in raw if isinstance(raw, list) else []:
        try:
            points.update(points_from_rows([item]))
        except ValueError:
            continue
    try:
        return fit_points(points, correct=False).params
    except ValueError:
        return None


def grad_stats(detail: Mapping[str, Any]) -> GradStats | None:
    raw = section(detail, "grad_stats")
    if not isinstance(raw, Mapping):
        return None
    sqr, var = as_number(raw.get("sqr")), as_number(raw.get("var"))
    if sqr is None or var is None:
        return None
    return GradStats(sqr=sqr, var=var)


def batch_bounds(detail: Mapping[str, Any]) -> BatchBounds | None:
    raw = section(detail, "bounds")
    if not isinstance(raw, Mapping):
        spec = detail.get("batch_bounds")  # the submit-time names
        if not isinstance(spec, Mapping):
            return None
        raw = {
            "base_batch": spec.get("batch_size"),
            "max_batch": spec.get("max_batch_size"),
            "min_local": spec.get("min_local_batch"),
            "max_local": spec.get("max_local_batch"),
        }
    base, top = as_number(raw.get("base_batch")), as_number(raw.get("max_batch"))
    if base is None:
        return None
    try:
        return BatchBounds(
            base_batch=int(base),
            max_batch=int(top) if top is not None else int(base),
            min_local=int(as_number(raw.get("min_local")) or 1),
            max_local=int(v) if (v := as_number(raw.get("max_local"))) is not None else None,
            accumulation=bool(raw.get("accumulation", True)),
        )
    except ValueError:
        return None


def profile_points(detail: Mapping[str, Any]) -> list[tuple[int, int, int, float]]:
    """(nodes, replicas, m, observed examples/s of a synchronising step) per profile point."""
    out = []
    raw = section(detail, "profile")
    for item in raw if isinstance(raw, list) else []:
        if not isinstance(item, Mapping):
            continue
        k, m, step = (
            as_number(item.get("replicas")),
            as_number(item.get("local_batch")),
            as_number(item.get("step_s")),
        )
        if k is None or m is None or step is None or step <= 0:
            continue
        n = as_number(item.get("nodes")) or 1.0
        out.append((int(n), int(k), int(m), k * m / step))
    return out


# --------------------------------------------------------------------------------------------
# The job detail plots
# --------------------------------------------------------------------------------------------


def throughput_plot(detail: Mapping[str, Any], max_devices: int, devices_per_node: int) -> PlotSpec:
    """Predicted examples/s vs device count at the job's micro-batch (s = 1), observed points."""
    title = "throughput vs devices"
    try:
        params = model_params(detail)
        from pollux_local.core.throughput import predict_throughput
    except ImportError as exc:
        return PlotSpec(title, note=f"throughput model unavailable: {exc}")
    points = profile_points(detail)
    if params is None:
        params = fit_from_profile(detail)
        if params is not None:
            title = "throughput vs devices (fit of profile)"
    if params is None:
        return PlotSpec(title, note="no fitted model yet (the job has not reported a profile)")
    local = as_number(detail.get("local_batch"))
    if local is None:
        bounds = batch_bounds(detail)
        local = float(points[-1][2]) if points else float(bounds.base_batch if bounds else 1)
    per_node = max(devices_per_node, 1)
    top = max([max_devices, 2] + [p[1] for p in points])
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


def efficiency_plot(detail: Mapping[str, Any]) -> PlotSpec:
    """Statistical efficiency vs total batch M at the job's current noise scale."""
    title = "efficiency vs batch size"
    stats, bounds = grad_stats(detail), batch_bounds(detail)
    if stats is None or bounds is None:
        return PlotSpec(title, note="no gradient statistics yet")
    try:
        from pollux_local.core.efficiency import efficiency
    except ImportError as exc:
        return PlotSpec(title, note=f"efficiency model unavailable: {exc}")
    top = max(bounds.max_batch, bounds.base_batch * 2)
    batches = np.unique(np.geomspace(bounds.base_batch, top, 40).round())
    eff = np.asarray(efficiency(stats, bounds.base_batch, batches), dtype=float)
    series = [Series(batches.tolist(), eff.tolist(), "efficiency")]
    current = as_number(detail.get("batch_size"))
    if current is not None and current >= bounds.base_batch:
        now = float(np.asarray(efficiency(stats, bounds.base_batch, np.array([current])))[0])
        series.append(Series([current], [now], f"now M={int(current)}", lines=False, marker="o"))
    return PlotSpec(title, tuple(series), xlabel="batch size M", xlog=True)


def history_plot(detail: Mapping[str, Any]) -> PlotSpec:
    """Goodput and noise scale over the job's history (each scaled to its own maximum)."""
    title = "goodput & noise scale over time"
    history = section(detail, "history")
    rows = [h for h in history if isinstance(h, Mapping)] if isinstance(history, list) else []
    times = [as_number(h.get("time")) for h in rows]
    if not rows or any(t is None for t in times):
        return PlotSpec(title, note="no history yet")
    start = min(t for t in times if t is not None)
    minutes = [((t or start) - start) / 60.0 for t in times]
    series = []
    for key, label in (("goodput", "goodput"), ("noise_scale", "noise scale")):
        values = [as_number(h.get(key)) for h in rows]
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


def noise_scale(detail: Mapping[str, Any]) -> float | None:
    """The job's gradient noise scale: as sent, else from its grad stats with the core."""
    value = as_number(detail.get("noise_scale"))
    if value is not None:
        return value
    stats, bounds = grad_stats(detail), batch_bounds(detail)
    if stats is None or bounds is None:
        return None
    from pollux_local.core.efficiency import noise_scale as core_noise_scale

    try:
        return as_number(core_noise_scale(stats, bounds.base_batch))
    except (ValueError, ZeroDivisionError):
        return None


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
