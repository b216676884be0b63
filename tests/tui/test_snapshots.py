"""Snapshot tests of every screen with a real daemon's recorded replies (pytest-textual-snapshot).

The data is ``fixtures/daemon_replies.json`` (``record_replies.py``), its times shifted to a
fixed "now".  Update after an intended change with
``pytest tests/tui/test_snapshots.py --snapshot-update`` and look at the SVGs it writes.
"""

from __future__ import annotations

from typing import Any

import pytest

from pollux_local.tui.source import FixedSource

pytestmark = pytest.mark.timeout(120)
SIZE = (120, 40)
#: From the first row (job 1) to the running job "steady-a" (job 3).
TO_RUNNING_JOB = ["down", "down"]


def _app(make_app: Any, source: FixedSource) -> Any:
    return make_app(source, sync=True, refresh_s=3600)


def test_main_screen(snap_compare: Any, make_app: Any, source: FixedSource) -> None:
    assert snap_compare(_app(make_app, source), terminal_size=SIZE)


def test_main_screen_filtered_and_sorted(
    snap_compare: Any, make_app: Any, source: FixedSource
) -> None:
    keys = ["slash", *"state:running,queued", "enter", "s", "s", "s", "s", "s", "s", "S"]
    assert snap_compare(_app(make_app, source), press=keys, terminal_size=SIZE)


def test_job_detail_screen(snap_compare: Any, make_app: Any, source: FixedSource) -> None:
    keys = [*TO_RUNNING_JOB, "enter"]
    assert snap_compare(_app(make_app, source), press=keys, terminal_size=SIZE)


def test_log_screen(snap_compare: Any, make_app: Any, source: FixedSource) -> None:
    keys = [*TO_RUNNING_JOB, "l"]
    assert snap_compare(_app(make_app, source), press=keys, terminal_size=SIZE)


def test_help_screen(snap_compare: Any, make_app: Any, source: FixedSource) -> None:
    assert snap_compare(_app(make_app, source), press=["question_mark"], terminal_size=SIZE)


def test_submit_form(snap_compare: Any, make_app: Any, source: FixedSource) -> None:
    assert snap_compare(_app(make_app, source), press=["n", *"train.py"], terminal_size=SIZE)


def test_cancel_confirmation(snap_compare: Any, make_app: Any, source: FixedSource) -> None:
    keys = [*TO_RUNNING_JOB, "c"]
    assert snap_compare(_app(make_app, source), press=keys, terminal_size=SIZE)


def test_daemon_down(snap_compare: Any, make_app: Any, source: FixedSource) -> None:
    source.down = True
    assert snap_compare(_app(make_app, source), terminal_size=SIZE)
