"""The job detail plots take their curves from the pure core and draw in the terminal."""

from __future__ import annotations

import msgspec
import numpy as np

from pollux_local.api.messages import JobDetail
from pollux_local.core.efficiency import efficiency
from pollux_local.core.throughput import ThroughputParams, predict_throughput
from pollux_local.core.types import GradStats
from pollux_local.tui import plots
from pollux_local.tui.recording import Recording


def running(recording: Recording) -> JobDetail:
    return recording.shows[recording.roles["running-a"]].job


def test_throughput_curve_is_the_core_prediction(recording: Recording) -> None:
    detail = running(recording)
    assert detail.model is not None and detail.report is not None
    assert detail.local_batch is not None
    spec = plots.throughput_plot(detail, max_devices=8, devices_per_node=4)
    assert spec.note is None
    model, observed = spec.series
    params = ThroughputParams.from_dict(detail.model.params)
    ks = np.asarray(model.x)
    expected = predict_throughput(params, np.ceil(ks / 4), ks, detail.local_batch, 1)
    np.testing.assert_allclose(model.y, expected)
    assert list(ks) == list(range(1, 9))
    # observed points: replicas * m / step time of each profile entry
    first = detail.report.profile[0]
    assert observed.x[0] == first.replicas
    assert abs(observed.y[0] - first.replicas * first.local_batch / first.step_s) < 1e-9


def test_efficiency_curve_is_the_core_efficiency(recording: Recording) -> None:
    detail = running(recording)
    assert detail.report is not None and detail.report.grad_stats is not None
    assert detail.report.bounds is not None
    spec = plots.efficiency_plot(detail)
    curve = spec.series[0]
    stats = GradStats(sqr=detail.report.grad_stats.sqr, var=detail.report.grad_stats.var)
    base = detail.report.bounds.base_batch
    np.testing.assert_allclose(curve.y, efficiency(stats, base, np.asarray(curve.x)))
    assert curve.x[0] == base and curve.y[0] == 1.0
    assert all(a >= b for a, b in zip(curve.y, curve.y[1:], strict=False))


def test_a_profile_without_a_model_is_fitted(recording: Recording) -> None:
    detail = msgspec.structs.replace(running(recording), model=None)
    spec = plots.throughput_plot(detail, 4, 4)
    assert spec.title == "throughput vs devices (fit of profile)" and spec.series


def test_missing_model_gives_a_note_not_a_crash(recording: Recording) -> None:
    detail = msgspec.structs.replace(running(recording), model=None, report=None, history=[])
    spec = plots.throughput_plot(detail, 4, 4)
    assert spec.note and "no fitted model" in spec.note
    bare = msgspec.structs.replace(
        detail, batch_bounds=msgspec.structs.replace(detail.batch_bounds, batch_size=None)
    )
    assert "no gradient statistics" in (plots.efficiency_plot(bare).note or "")
    assert "no history" in (plots.history_plot(detail).note or "")
    text = plots.render(spec, 40, 10)
    assert "throughput vs devices" in text and "no fitted model" in text


def test_render_draws_axes_title_and_legend(recording: Recording) -> None:
    text = plots.render(plots.throughput_plot(running(recording), 8, 4), 50, 14)
    plain = plots.re.sub(r"\x1b\[[0-9;]*m", "", text)
    lines = plain.splitlines()
    assert len(lines) == 14
    assert "throughput vs devices" in lines[0]
    assert "observed" in lines[-1] and "model m=" in lines[-1]
    assert any("┤" in line for line in lines)  # y-axis ticks were drawn


def test_a_reported_point_beyond_the_cluster_does_not_stretch_the_axis(
    recording: Recording,
) -> None:
    """A job's report is its own word: a profile row on two million replicas (the report allows
    up to 2**40) made another user's TUI build and draw an axis of that many devices, frozen
    for most of a minute at each refresh.  The axis spans the cluster's devices and the points
    the job measured, at most ``MAX_PLOT_DEVICES``."""
    detail = running(recording)
    assert detail.report is not None and detail.report.profile
    first = detail.report.profile[0]
    hostile = [*detail.report.profile, msgspec.structs.replace(first, replicas=2_097_152)]
    detail = msgspec.structs.replace(
        detail, report=msgspec.structs.replace(detail.report, profile=hostile)
    )
    spec = plots.throughput_plot(detail, max_devices=8, devices_per_node=4)
    model, observed = spec.series
    assert len(model.x) <= plots.MAX_PLOT_DEVICES
    assert max(observed.x) <= plots.MAX_PLOT_DEVICES  # the two million left out
    assert "throughput vs devices" in plots.render(spec, 50, 14)
    # a point the job measured on more devices than are up now (a node down) is kept
    wider = [*hostile[:-1], msgspec.structs.replace(first, replicas=12)]
    detail = msgspec.structs.replace(
        detail, report=msgspec.structs.replace(detail.report, profile=wider)
    )
    model, observed = plots.throughput_plot(detail, max_devices=8, devices_per_node=4).series
    assert list(model.x) == list(range(1, 13)) and 12 in observed.x
