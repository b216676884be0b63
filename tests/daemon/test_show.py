"""What ``show`` gives the TUI's job detail: the job's latest report, its fitted throughput
model and a bounded, persisted history of goodput and noise-scale samples, from a real daemon
with a job that reports as the job library does (schema version 1)."""

from __future__ import annotations

import math
import sys
from collections.abc import Iterator
from dataclasses import fields
from pathlib import Path
from typing import Any

import msgspec
import pytest

from pollux_local.api import JobDetail, JobReport
from pollux_local.core.throughput import ThroughputParams, fit_throughput
from pollux_local.daemon.state import StateStore
from pollux_local.tui import plots
from tests.daemon_process import DaemonProcess, wait_for

pytestmark = pytest.mark.timeout(90)

# Reports a fixed two-point profile and gradient statistics whose variance grows each report;
# runs until told to stop (a file), checkpoints nothing, exits 75 on SIGTERM.
JOB = r"""
import json, os, signal, sys, time
signal.signal(signal.SIGTERM, lambda *_: sys.exit(75))
job_dir = os.environ["POLLUX_JOB_DIR"]
stop_file = sys.argv[1]
i = 0
while not os.path.exists(stop_file):
    i += 1
    report = {"version": 1, "job_id": os.environ["POLLUX_JOB_ID"], "time": time.time(),
              "bounds": {"base_batch": 64, "max_batch": 1024, "min_local": 16,
                         "max_local": 256, "accumulation": True},
              "profile": [{"nodes": 1, "replicas": 1, "local_batch": 32, "compute_s": 0.02,
                           "step_s": 0.021, "count": 40},
                          {"nodes": 1, "replicas": 1, "local_batch": 64, "compute_s": 0.035,
                           "step_s": 0.036, "count": 40}],
              "grad_stats": {"sqr": 2.0, "var": 10.0 + i},
              "progress": float(i), "epoch": 0,
              "batch": {"local_batch": 64, "accum_steps": 1, "replicas": 1},
              "metrics": {"loss": 1.0 / i}}
    tmp = os.path.join(job_dir, "report.json.tmp")
    with open(tmp, "w") as fh:
        json.dump(report, fh)
    os.replace(tmp, os.path.join(job_dir, "report.json"))
    time.sleep(0.2)
"""


@pytest.fixture()
def daemon(tmp_path: Path) -> Iterator[DaemonProcess]:
    process = DaemonProcess(tmp_path / "state", "--devices", "cpu:2", "--interval", "0.3")
    process.start()
    try:
        yield process
    finally:
        process.stop()


def show(daemon: DaemonProcess, job_id: str) -> dict[str, Any]:
    return dict(daemon.client.request("show", id=job_id)["job"])


def test_show_carries_report_model_and_history_and_the_tui_plots_draw_from_it(
    daemon: DaemonProcess, tmp_path: Path
) -> None:
    script = tmp_path / "job.py"
    script.write_text(JOB)
    stop_file = tmp_path / "stop"
    job_id = str(
        daemon.client.request(
            "submit", argv=[sys.executable, str(script), str(stop_file)], workdir=str(tmp_path),
            name="reporter", max_gpus=1, batch_size=64, elastic=True,
        )["id"]
    )  # fmt: skip
    before = show(daemon, job_id)
    assert before["model"] is None and before["history"] == []

    detail = wait_for(
        lambda: (d := show(daemon, job_id)) and len(d["history"]) >= 4 and d, 40, "4 samples"
    )
    report = detail["report"]
    assert report["version"] == 1 and report["job_id"] == job_id
    assert set(report) >= {"profile", "grad_stats", "bounds", "progress"}

    # The fitted parameters are the core's fit of the reported profile.
    params = detail["model"]["params"]
    assert set(params) == {f.name for f in fields(ThroughputParams)}
    profile = report["profile"]
    expected = fit_throughput(
        *[[float(p[key]) for p in profile]
          for key in ("nodes", "replicas", "local_batch", "compute_s", "step_s")]
    ).to_dict()  # fmt: skip
    assert params == pytest.approx(expected, rel=1e-9)
    assert detail["model"]["profile_points"] == 2

    # phi = M0 * var / sqr from the latest report.
    stats = report["grad_stats"]
    assert detail["noise_scale"] == pytest.approx(64 * stats["var"] / stats["sqr"])

    history = detail["history"]
    times = [h["time"] for h in history]
    assert times == sorted(times) and len(set(times)) == len(times)
    noise = [h["noise_scale"] for h in history]
    assert all(n is not None and n >= 64 * 11 / 2 for n in noise)  # var = 10 + i, i >= 1
    assert noise[-1] > noise[0]  # the job's variance grows; the samples follow it
    goodputs = [h["goodput"] for h in history if h["goodput"] is not None]
    assert goodputs and all(g > 0 and math.isfinite(g) for g in goodputs)

    # The TUI's job-detail plots draw from this reply, typed (not from a client-side refit).
    typed = msgspec.convert(detail, JobDetail)
    assert plots.model_params(typed) == ThroughputParams.from_dict(params)
    for spec in (
        plots.throughput_plot(typed, max_devices=2, devices_per_node=2),
        plots.efficiency_plot(typed),
        plots.history_plot(typed),
    ):
        assert spec.series and not spec.note, spec

    # The history is persisted: a daemon restart keeps it.
    stop_file.write_text("")
    wait_for(lambda: show(daemon, job_id)["state"] == "succeeded", 30, "the job to finish")
    kept = show(daemon, job_id)["history"]
    daemon.stop()
    daemon.start()
    assert show(daemon, job_id)["history"] == kept
    # the report as the job wrote it, every field of the schema present (unset ones null)
    written = (daemon.state_dir / "jobs" / job_id / "report.json").read_bytes()
    assert show(daemon, job_id)["report"] == msgspec.to_builtins(
        msgspec.json.decode(written, type=JobReport)
    )


def test_history_is_bounded_per_job(tmp_path: Path) -> None:
    store = StateStore(tmp_path / "state.db")
    try:
        for i in range(12):
            store.add_history(1, float(i), float(i), None, limit=5)
            store.add_history(2, float(i), None, float(-i), limit=100)
        assert [h["time"] for h in store.history(1)] == [7.0, 8.0, 9.0, 10.0, 11.0]
        assert [h["goodput"] for h in store.history(1)] == [7.0, 8.0, 9.0, 10.0, 11.0]
        assert len(store.history(2)) == 12 and store.history(2)[-1]["noise_scale"] == -11.0
        assert store.history(3) == []
    finally:
        store.close()
