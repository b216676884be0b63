"""The pure view logic over the typed replies: rows, sorting, filtering, the grid, logs."""

from __future__ import annotations

import msgspec

from pollux_local import api
from pollux_local.api.messages import NodeRow
from pollux_local.durations import format_duration
from pollux_local.tui.demo import demo_recording
from pollux_local.tui.recording import Recording
from pollux_local.tui.view import (
    JobFilter,
    cluster_sample,
    fmt_duration,
    fmt_placement,
    job_row,
    job_rows,
    log_lines,
    node_cells,
    sort_rows,
)


def test_rows_of_the_recorded_jobs(recording: Recording) -> None:
    rows = {r.id: r for r in job_rows(recording.status)}
    running = rows[recording.roles["running-a"]]
    assert running.state == "running" and running.gpus == 1 and running.where == "vm:0"
    assert running.batch_text == "64×1×1=64"
    cells = running.cells()
    assert cells[4] == "1 vm:0" and cells[6] != "-" and cells[10] != "-"
    queued = rows[recording.roles["queued"]]
    assert queued.batch_text == "16" and queued.cells()[4] == "-" and queued.cells()[6] == "-"


def test_placement_and_duration_formatting() -> None:
    assert fmt_placement({"ws1": ["cuda:0", "cuda:1"], "ws2": ["cuda:3"]}) == "ws1:0,1 ws2:3"
    assert fmt_placement({}) == "-"
    assert fmt_duration(42) == "42s"
    assert fmt_duration(3 * 3600 + 5 * 60) == "3h05m"
    assert fmt_duration(None) == "-" and fmt_duration(-3) == "-"
    # the one formatter's brief form: no seconds from ten minutes on
    assert fmt_duration(725) == "12m" == format_duration(725, exact=False, brief=True)


def test_sort_puts_unknown_last_and_reverses(recording: Recording) -> None:
    rows = job_rows(recording.status)
    by_goodput = [r.id for r in sort_rows(rows, "goodput")]
    known = [r.id for r in rows if r.goodput is not None]
    assert sorted(by_goodput[: len(known)]) == sorted(known)
    assert sort_rows(rows, "goodput", reverse=True)[0].goodput == max(
        r.goodput for r in rows if r.goodput is not None
    )
    assert [r.state for r in sort_rows(rows, "state")][0] == "queued"


def test_filter_by_owner_state_and_words() -> None:
    rows = job_rows(demo_recording(n_jobs=30, seed=3).status)
    flt = JobFilter.parse("owner:alice state:running,queued")
    kept = [r for r in rows if flt.matches(r)]
    assert kept, "the sample data has running/queued jobs of alice"
    assert all(r.owner == "alice" and r.state in ("running", "queued") for r in kept)
    assert len(kept) < len(rows)
    assert JobFilter.parse("bert").matches(next(r for r in rows if r.name.startswith("bert")))
    assert not JobFilter.parse("bert").matches(next(r for r in rows if "resnet" in r.name))
    assert JobFilter.parse("").empty


def node(name: str, **fields: object) -> NodeRow:
    base = {"name": name, "host": name, "local": False, "up": True, "error": None,
            "devices": ["cuda:0", "cuda:1"], "busy": [], "jobs": {}, "load": None}  # fmt: skip
    return msgspec.convert({**base, **fields}, NodeRow, strict=True)


def test_grid_from_the_nodes_reply(recording: Recording) -> None:
    nodes = [
        node("ws1", jobs={"cuda:1": "4"}),
        node("ws2", up=False, error="ssh: timed out", jobs={"cuda:0": "5"}),
        node("ws3", busy=["cuda:0"]),
    ]
    cells = node_cells(nodes)
    flat = {(c.node, c.device): (c.status, c.job) for n in cells for c in n.devices}
    assert flat[("ws1", "cuda:0")] == ("free", None)
    assert flat[("ws1", "cuda:1")] == ("job", "4")
    assert flat[("ws2", "cuda:0")] == ("down", "5")
    assert flat[("ws2", "cuda:1")] == ("down", None)
    assert flat[("ws3", "cuda:0")] == ("external", None)
    status = api.StatusReply(jobs=[j for j in recording.status.jobs if j.id == "4"])
    sample = cluster_sample(job_rows(status), cells, now=0.0)
    assert sample.devices_up == 4 and sample.devices_busy == 1
    assert sample.utilisation == 0.25


def test_recorded_grid(recording: Recording) -> None:
    (only,) = node_cells(recording.nodes.nodes)
    assert only.up and [(c.device, c.status) for c in only.devices] == [
        ("cpu:0", "job"),
        ("cpu:1", "job"),
    ]


def test_log_lines_drop_a_partial_first_line() -> None:
    whole = api.LogsReply(data="a\nb\nc\n", offset=6, size=6, state=api.JobState.RUNNING)
    assert log_lines(whole) == ["a", "b", "c"]
    tail = api.LogsReply(data="b\nc\n", offset=106, size=106, state=api.JobState.RUNNING)
    assert log_lines(tail) == ["c"]


def test_demo_data_validates_as_the_daemons_replies() -> None:
    demo = demo_recording(n_jobs=12, n_nodes=4, devices_per_node=8, seed=5)
    assert len(demo.status.jobs) == 12 and len(demo.shows) == 12
    cells = node_cells(demo.nodes.nodes)
    statuses = {c.status for n in cells for c in n.devices}
    assert statuses == {"job", "free", "external", "down"}
    assert job_row(demo.shows["1"].job).id == "1"


def test_a_forecast_at_the_latest_reads_as_a_bound(recording: Recording) -> None:
    """A queued job whose forecast rests on a job of unknown length run until its time limit:
    its start in the table is ``≤4m05s``, its screen says ``within``; an expectation reads
    as before."""
    from pollux_local.tui.screens.job_detail import summary_text

    now = 1_000_000.0
    queued = next(j for j in recording.status.jobs if j.state is api.JobState.QUEUED)
    plain = msgspec.structs.replace(queued, expected_start=now + 245, expected_finish=now + 845)
    bound = msgspec.structs.replace(
        plain, expected_start_at_latest=True, expected_finish_at_latest=True
    )
    row, expected = job_row(bound, now), job_row(plain, now)
    assert row.start_text == "≤4m05s" and row.cells()[11] == "≤4m05s"
    assert expected.start_text == "4m05s"
    text = str(summary_text(row, None))
    assert "expected start within 4m05s   finish within 14m\n" in text
    assert "expected start in 4m05s   finish in 14m\n" in str(summary_text(expected, None))
