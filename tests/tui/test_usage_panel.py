"""The cluster panel's accounting: device-hours per user from the daemon's ``usage`` reply.

The recording holds a real daemon's four jobs that ran (steady-a on two devices, then one;
the others on one), all root's, on CPU devices: about 54 device-seconds in all.
"""

from __future__ import annotations

from typing import Any

import pytest
from textual.widgets import Static

from pollux_local import api
from pollux_local.tui.app import USAGE_REFRESH_S
from pollux_local.tui.recording import Recording
from pollux_local.tui.source import FixedSource
from pollux_local.tui.view import usage_lines

SIZE = (120, 40)


def row(user: str, hours: float, jobs: int) -> api.DeviceUsage:
    return api.DeviceUsage(user=user, device_hours=hours, by_type={"a100": hours}, jobs=jobs,
                           succeeded=jobs, failed=0, cancelled=0, running=0)  # fmt: skip


def test_usage_lines() -> None:
    reply = api.UsageReply(
        users=[row("ada", 12.5, 3), row("bo", 0.25, 1)], total=row("*", 12.75, 4), since=None
    )
    assert usage_lines(reply, 80) == [
        "device-hours 12.75 (a100 12.75) · 4 jobs run",
        "by user: ada 12.50 · bo 0.25",
    ]
    narrow = usage_lines(reply, 20)
    assert narrow == ["device-hours 12.75 …", "by user: ada 12.50 …"]
    assert usage_lines(None, 80) == ["device-hours -"]
    empty = api.UsageReply(users=[], total=row("*", 0.0, 0), since=None)
    assert usage_lines(empty, 80)[1] == "by user: none yet"


def test_the_recording_holds_a_usage_consistent_with_its_jobs(recording: Recording) -> None:
    usage = recording.usage
    assert usage is not None and [u.user for u in usage.users] == ["root"]
    ran = [j for j in recording.status.jobs if j.start_time is not None]
    assert usage.total.jobs == len(ran) == 4
    assert usage.total.running == sum(j.state == "running" for j in ran)
    # every job ran on at least one device for its run time, steady-a on two for a while
    at_least = sum(j.run_time_s for j in ran) / 3600
    assert at_least < usage.total.device_hours < 2 * at_least
    assert usage.total.by_type == {"cpu": pytest.approx(usage.total.device_hours)}


def test_fixed_source_serves_usage_per_user(source: FixedSource) -> None:
    everyone = source.call(api.Usage())
    assert everyone.users[0].user == "root" and everyone.total.user == "*"
    mine = source.call(api.Usage(user="root"))
    assert mine.total.device_hours == everyone.users[0].device_hours
    nobody = source.call(api.Usage(user="nobody"))
    assert nobody.users == [] and nobody.total.jobs == 0 and nobody.total.device_hours == 0.0


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_the_cluster_panel_shows_usage_and_asks_for_it_seldom(
    source: FixedSource, make_app: Any
) -> None:
    now = [source.now]
    app = make_app(source, sync=True, clock=lambda: now[0])
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause()
        text = str(app.screen.query_one("#cluster-figures", Static).render())
        assert sum(isinstance(call, api.Usage) for call in source.calls) == 1
        usage = source.call(api.Usage())  # the recorded figures, as the panel must show them
        hours = f"{usage.total.device_hours:.2f}"
        assert f"device-hours {hours} (cpu {hours}) · {usage.total.jobs} jobs run" in text
        assert f"by user: root {usage.users[0].device_hours:.2f}" in text
        source.calls.clear()
        app.refresh_data()
        await pilot.pause()
        assert sum(isinstance(call, api.Usage) for call in source.calls) == 0  # not yet again
        now[0] += USAGE_REFRESH_S + 1
        app.refresh_data()
        await pilot.pause()
        assert sum(isinstance(call, api.Usage) for call in source.calls) == 1


@pytest.mark.asyncio
@pytest.mark.timeout(60)
async def test_a_daemon_without_usage_leaves_it_unknown(
    recording: Recording, make_app: Any
) -> None:
    older = recording.copy()
    older.usage = None  # a recording (or daemon) from before accounting
    source = FixedSource(older)
    app = make_app(source, sync=True)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause()
        text = str(app.screen.query_one("#cluster-figures", Static).render())
        assert "device-hours -" in text and "running 2 · queue 1" in text
        assert app.last_error is None and app.connected
