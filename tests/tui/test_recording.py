"""The recorded daemon replies behind the pilot and snapshot tests stay true to the daemon.

``fixtures/daemon_replies.json`` is what a real daemon answered (``record_replies.py``).  It
must decode strictly through the api reply types (as the client decodes), and a fresh
recording from today's daemon must have the same wire shape: a change to what the daemon sends
fails here, and the fix is to re-record (``python tests/tui/record_replies.py``) and look at
the snapshots.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from pollux_local import api
from pollux_local.tui.recording import Recording, load_recording, recording_from_data
from tests.tui.record_replies import FIXTURE, record, recording_shape

ROLES = {"succeeded", "failed", "running-a", "running-b", "held", "cancelled", "queued"}


def fixture_data() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(FIXTURE.read_text())
    return data


def test_the_fixture_decodes_strictly_with_every_state(recording: Recording) -> None:
    assert set(recording.roles) == ROLES
    states = {job.id: job.state for job in recording.status.jobs}
    for role, job_id in recording.roles.items():
        assert states[job_id] == role.split("-")[0]
    assert set(recording.shows) == set(states) == set(recording.logs)


def test_the_fixture_has_what_the_views_draw(recording: Recording) -> None:
    for role in ("running-a", "running-b"):
        shown = recording.shows[recording.roles[role]]
        job = shown.job
        assert job.goodput is not None and job.efficiency is not None and job.eta_s is not None
        assert job.model is not None and job.report is not None and job.report.profile
        assert job.report.grad_stats is not None and job.history and shown.decisions
        assert recording.logs[job.id].data
    assert recording.nodes.nodes and all(node.jobs for node in recording.nodes.nodes)


@pytest.mark.parametrize(
    "change",
    [
        "an unknown field in a job",
        "a missing field in a job",
        "a number where the daemon sends a string",
        "a state the daemon does not have",
        "an error reply instead of status",
    ],
)
def test_a_fixture_the_daemon_would_not_send_is_refused(change: str) -> None:
    data = copy.deepcopy(fixture_data())
    status = data["replies"]["status"]
    job = status["jobs"][0]
    if change == "an unknown field in a job":
        job["placement"] = job["devices"]  # an old spelling of "devices"
    elif change == "a missing field in a job":
        del job["gpus"]
    elif change == "a number where the daemon sends a string":
        job["id"] = int(job["id"])
    elif change == "a state the daemon does not have":
        job["state"] = "paused"
    else:
        data["replies"]["status"] = {"v": 1, "ok": False, "code": "internal", "error": "boom"}
    with pytest.raises(api.PolluxError):
        recording_from_data(data)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_real_daemon_still_sends_the_recorded_shape(tmp_path: Path) -> None:
    fresh = record(tmp_path)
    recording_from_data(fresh, "a fresh recording")  # validates, strictly
    was, now = recording_shape(fixture_data()), recording_shape(fresh)
    assert now == was, (
        "the daemon's replies changed shape since fixtures/daemon_replies.json was recorded:\n"
        f"  new: {sorted(now - was)}\n  gone: {sorted(was - now)}\n"
        "re-record with `python tests/tui/record_replies.py` and check the snapshots"
    )
    assert load_recording(FIXTURE).roles == recording_from_data(fresh).roles
