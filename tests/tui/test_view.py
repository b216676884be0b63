"""The pure view logic: parsing replies that may lack fields, sorting, filtering, the grid."""

from __future__ import annotations

from pollux_local.tui.source import demo_data
from pollux_local.tui.view import (
    JobFilter,
    cluster_sample,
    fmt_duration,
    fmt_placement,
    job_row,
    job_rows,
    node_cells,
    sort_rows,
)


def test_job_row_tolerates_missing_and_bad_fields() -> None:
    row = job_row({"id": 7, "goodput": "nan", "efficiency": None, "restarts": "x"})
    assert row.id == "7"
    assert row.name == "7"
    assert row.goodput is None and row.efficiency is None and row.restarts is None
    cells = row.cells()
    assert cells[0] == "7"
    assert cells[6] == "-"  # goodput


def test_batch_text_shows_m_s_k() -> None:
    row = job_row(
        {"id": "a", "local_batch": 64, "accum_steps": 2, "replicas": 3, "batch_size": 384}
    )
    assert row.batch_text == "64×2×3=384"
    assert job_row({"id": "b", "batch_size": 128}).batch_text == "128"


def test_placement_and_duration_formatting() -> None:
    assert fmt_placement({"ws1": ["cuda:0", "cuda:1"], "ws2": ["cuda:3"]}) == "ws1:0,1 ws2:3"
    assert fmt_placement({}) == "-"
    assert fmt_duration(42) == "42s"
    assert fmt_duration(3 * 3600 + 5 * 60) == "3h05m"
    assert fmt_duration(None) == "-"


def test_sort_puts_unknown_last_and_reverses() -> None:
    rows = [job_row({"id": i, "goodput": g}) for i, g in ((1, 5.0), (2, None), (3, 9.0))]
    assert [r.id for r in sort_rows(rows, "goodput")] == ["1", "3", "2"]
    assert [r.id for r in sort_rows(rows, "goodput", reverse=True)] == ["3", "1", "2"]


def test_filter_by_owner_state_and_words() -> None:
    rows = job_rows(demo_data(n_jobs=30, seed=3)["status"])
    flt = JobFilter.parse("owner:alice state:running,queued")
    kept = [r for r in rows if flt.matches(r)]
    assert kept, "the sample data has running/queued jobs of alice"
    assert all(r.owner == "alice" and r.state in ("running", "queued") for r in kept)
    assert len(kept) < len(rows)
    assert JobFilter.parse("bert").matches(job_row({"id": 1, "name": "bert-1"}))
    assert not JobFilter.parse("bert").matches(job_row({"id": 1, "name": "resnet"}))
    assert JobFilter.parse("").empty


def test_grid_from_node_list_and_placements() -> None:
    status = {"jobs": [{"id": 4, "state": "running", "placement": {"ws1": ["cpu:1"]}}]}
    nodes = {
        "nodes": [
            {"name": "ws1", "devices": ["cpu:0", "cpu:1"]},
            {"name": "ws2", "up": False, "devices": [{"id": "cpu:0"}]},
            {"name": "ws3", "devices": [{"id": "cuda:0", "state": "external"}]},
        ]
    }
    cells = node_cells(nodes, status)
    flat = {(c.node, c.device): (c.status, c.job) for n in cells for c in n.devices}
    assert flat[("ws1", "cpu:0")] == ("free", None)
    assert flat[("ws1", "cpu:1")] == ("job", "4")
    assert flat[("ws2", "cpu:0")][0] == "down"
    assert flat[("ws3", "cuda:0")] == ("external", None)
    sample = cluster_sample(job_rows(status), cells, now=0.0)
    assert sample.devices_up == 3 and sample.devices_busy == 1
    assert abs((sample.utilisation or 0) - 1 / 3) < 1e-9


def test_node_list_garbage_is_ignored() -> None:
    assert node_cells({"nodes": "nonsense"}, {}) == []
    assert node_cells({}, {"jobs": None}) == []
