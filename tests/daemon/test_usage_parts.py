"""``usage`` reads and sums the history a part at a time, the event loop turning between two
(a lab's history of 100,000 jobs took the daemon 4.5 s in one piece): the reply is the one a
single read gives."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from pollux_local.api.messages import Usage, UsageReply
from pollux_local.api.states import JobState
from pollux_local.daemon.context import Context
from pollux_local.daemon.handlers import usage
from pollux_local.daemon.state import StateStore
from tests.daemon.test_server_status import DAY, NOW, context, count_turns


def run(ctx: Context, request: Usage) -> UsageReply:
    return asyncio.run(usage.usage(ctx, request))


def test_usage_read_in_parts_is_usage_read_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = StateStore(tmp_path / "state.db")
    states = [JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED, JobState.QUEUED]
    rows = [
        (
            f"job-{i}", 1000 + i % 3, 1000 + i % 3, ("ann", "bob", "cy")[i % 3],
            states[i % 4].value, '{"argv": ["x"], "workdir": "/tmp", "min_gpus": 1}',
            NOW - 3 * DAY + i, NOW - (2 - i / 100) * DAY, NOW - 2.5 * DAY + 7 * i, 600.0 * (i % 5),
        )
        for i in range(50)
    ]  # fmt: skip
    store.db.executemany(
        "INSERT INTO jobs (name, owner_uid, owner_gid, owner_name, state, spec, submit_time,"
        " end_time, start_time, attained_gpu_s) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
        rows,
    )
    ctx = context(store)
    requests = [Usage(), Usage(user="bob"), Usage(since=NOW - 1.7 * DAY)]
    whole = [run(ctx, request) for request in requests]
    assert whole[0].total.jobs == 50 and len(whole[0].users) == 3
    assert 0 < whole[2].total.jobs < 50 and whole[0].total.device_hours > 0
    monkeypatch.setattr(usage, "READ_CHUNK", 4)
    turns = count_turns(monkeypatch)
    for request, expected in zip(requests, whole, strict=True):
        assert run(ctx, request) == expected, request
    assert turns[0] >= 50 // 4
    store.close()
