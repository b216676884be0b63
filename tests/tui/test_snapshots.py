"""Snapshot tests of every screen with fixed data (pytest-textual-snapshot).

Update after an intended change with ``pytest tests/tui/test_snapshots.py --snapshot-update``
and look at the SVGs it writes.
"""

from __future__ import annotations

from typing import Any

import pytest

from pollux_local.tui.source import FixedSource, demo_data

pytestmark = pytest.mark.timeout(120)
SIZE = (120, 40)


def _app(make_app: Any, source: FixedSource | None = None) -> Any:
    return make_app(
        source or FixedSource(demo_data(n_jobs=12, n_nodes=3)), sync=True, refresh_s=3600
    )


def test_main_screen(snap_compare: Any, make_app: Any) -> None:
    assert snap_compare(_app(make_app), terminal_size=SIZE)


def test_main_screen_filtered_and_sorted(snap_compare: Any, make_app: Any) -> None:
    keys = ["slash", *"state:running", "enter", "s", "s", "s", "s", "s", "s", "S"]
    assert snap_compare(_app(make_app), press=keys, terminal_size=SIZE)


def test_job_detail_screen(snap_compare: Any, make_app: Any) -> None:
    assert snap_compare(_app(make_app), press=["down", "enter"], terminal_size=SIZE)


def test_log_screen(snap_compare: Any, make_app: Any) -> None:
    assert snap_compare(_app(make_app), press=["l"], terminal_size=SIZE)


def test_help_screen(snap_compare: Any, make_app: Any) -> None:
    assert snap_compare(_app(make_app), press=["question_mark"], terminal_size=SIZE)


def test_submit_form(snap_compare: Any, make_app: Any) -> None:
    assert snap_compare(_app(make_app), press=["n", *"train.py"], terminal_size=SIZE)


def test_cancel_confirmation(snap_compare: Any, make_app: Any) -> None:
    assert snap_compare(_app(make_app), press=["c"], terminal_size=SIZE)


def test_daemon_down(snap_compare: Any, make_app: Any) -> None:
    source = FixedSource(demo_data(n_jobs=12, n_nodes=3))
    source.down = True
    assert snap_compare(_app(make_app, source), terminal_size=SIZE)
