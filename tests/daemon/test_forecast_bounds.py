"""A forecast that rests on a worst case, through the daemon: a running job whose kind never
finished, under a time limit, is forecast to end at its limit at the latest; ``status``,
``show`` and ``estimate`` (the handlers, on a daemon without processes) carry the marks, which
cross the wire strictly typed and default to unmarked in a reply that lacks them."""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgspec
import pytest

from pollux_local.api import wire
from pollux_local.api.errors import ProtocolError
from pollux_local.api.messages import (
    Estimate,
    EstimateReply,
    Show,
    ShowReply,
    Status,
    StatusReply,
    Submit,
)
from pollux_local.core.baselines import FifoPolicy
from pollux_local.daemon.handlers import query
from pollux_local.daemon.handlers.estimate import estimate
from tests.scheduler_harness import Harness


def test_status_show_and_estimate_mark_what_rests_on_a_time_limit(tmp_path: Path) -> None:
    async def scenario() -> tuple[StatusReply, ShowReply, EstimateReply]:
        harness = Harness(tmp_path, [1], FifoPolicy())
        # a first job of its kind (none finished: its length is unknown), limited to 1 h
        first = harness.submit(argv=["new.py"], time_limit_s=3600.0)
        await harness.tick()
        assert harness.job(first).state == "running"
        harness.submit(argv=["other.py"], time_limit_s=1800.0)  # queued behind it, 30 min
        await harness.tick(600.0)
        ctx = harness.context(forecasts=harness.loop.forecasts)
        status = await query.status(ctx, Status())
        shown = query.show(ctx, Show(id=str(first)))
        guess = await estimate(ctx, Estimate(submit=Submit(argv=["third.py"], workdir="/")))
        return status, shown, guess

    status, shown, guess = asyncio.run(scenario())
    first, second = status.jobs
    start = first.start_time
    assert start is not None
    # the first job: its start a fact, its finish its limit at the latest
    assert first.expected_finish == pytest.approx(start + 3600.0)
    assert first.expected_finish_at_latest and not first.expected_start_at_latest
    assert shown.job.expected_finish_at_latest
    # the queued job: starts when the first ends at worst, and runs its own limit at worst
    assert second.expected_start == pytest.approx(start + 3600.0)
    assert second.expected_start_at_latest and second.expected_finish_at_latest
    assert second.expected_finish == pytest.approx(start + 5400.0)
    # estimate: a job with no limit behind both starts at their worst-case ends, a bound, and
    # its own finish is unknown (its length is, and nothing bounds it)
    (job,) = guess.jobs
    assert job.start == pytest.approx(start + 5400.0) and job.start_at_latest
    assert job.finish is None and not job.finish_at_latest and job.length_s is None

    # the marks cross the wire, strictly typed; a reply without them reads unmarked
    body = wire.encode_reply(status)[4:]
    again = wire.decode_reply(body, StatusReply)
    assert again.jobs[1].expected_start_at_latest and not again.jobs[0].expected_start_at_latest
    fields = msgspec.json.decode(body)
    fields["jobs"][1]["expected_start_at_latest"] = 1
    with pytest.raises(ProtocolError, match="expected_start_at_latest"):
        wire.decode_reply(msgspec.json.encode(fields), StatusReply)
    for job_fields in fields["jobs"]:
        del job_fields["expected_start_at_latest"], job_fields["expected_finish_at_latest"]
    old = wire.decode_reply(msgspec.json.encode(fields), StatusReply)
    assert not any(j.expected_start_at_latest or j.expected_finish_at_latest for j in old.jobs)
    estimated = msgspec.json.decode(wire.encode_reply(guess)[4:])
    assert estimated["jobs"][0]["start_at_latest"] is True
    estimated["jobs"][0]["finish_at_latest"] = "no"
    with pytest.raises(ProtocolError, match="finish_at_latest"):
        wire.decode_reply(msgspec.json.encode(estimated), EstimateReply)
