"""The data sources: typed requests in, typed replies out, errors told apart by class."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import pytest

from pollux_local import api
from pollux_local.client import Client
from pollux_local.tui.recording import Recording
from pollux_local.tui.source import DaemonSource, FixedSource


def test_fixed_source_refuses_what_the_daemon_refuses(source: FixedSource) -> None:
    with pytest.raises(api.InvalidRequest, match="id"):
        source.call(api.Cancel(ids=["j001"]))  # ids are decimal digits
    with pytest.raises(api.InvalidRequest, match="max_bytes"):
        source.call(api.Logs(id="3", max_bytes=0))
    with pytest.raises(api.NotFound):
        source.call(api.Show(id="99"))


def test_fixed_source_answers_typed_copies(source: FixedSource) -> None:
    status = source.call(api.Status())
    assert isinstance(status, api.StatusReply) and len(status.jobs) == 7
    status.jobs[0].name = "changed by the caller"
    assert source.call(api.Status()).jobs[0].name != "changed by the caller"
    active = [api.JobState(s) for s in ("queued", "running", "rescaling", "held")]
    assert {j.state for j in source.call(api.Status(states=active)).jobs} == {
        "running",
        "held",
        "queued",
    }
    shown = source.call(api.Show(id="3"))
    assert isinstance(shown, api.ShowReply) and shown.job.model is not None


def test_fixed_source_logs_are_byte_ranges(source: FixedSource, recording: Recording) -> None:
    whole = recording.logs["3"]
    tail = source.call(api.Logs(id="3", offset=-100, max_bytes=50))
    assert tail.size == whole.size and tail.offset == whole.size - 50
    assert tail.data == whole.data.encode()[-100:-50].decode()
    first = source.call(api.Logs(id="3", offset=0, max_bytes=whole.size + 10))
    assert first.data == whole.data and first.offset == whole.size


def test_times_are_shifted_to_now(recording: Recording) -> None:
    now = recording.recorded_at + 1000.0
    shifted = FixedSource(recording, now=now)
    before = recording.status.jobs[0].submit_time
    assert shifted.call(api.Status()).jobs[0].submit_time == pytest.approx(before + 1000.0)
    decisions = shifted.call(api.Show(id="3")).decisions
    assert decisions[0].time == pytest.approx(recording.shows["3"].decisions[0].time + 1000.0)
    assert recording.status.jobs[0].submit_time == before  # the recording is untouched
    # a queued job's forecast moves with the rest (else it would start years from "now")
    (wide,) = [j for j in recording.status.jobs if j.state == "queued"]
    assert wide.expected_start is not None
    (moved,) = [j for j in shifted.call(api.Status()).jobs if j.id == wide.id]
    assert moved.expected_start == pytest.approx(wide.expected_start + 1000.0)


class FakeClient(Client):
    def __init__(self, error: Exception) -> None:
        super().__init__("/nonexistent")
        self.error = error

    def call(self, request: Any) -> Any:
        raise self.error


@pytest.mark.parametrize("error", [api.DaemonUnavailable("any words"), api.NotFound("no job 7")])
def test_daemon_source_passes_the_typed_errors_through(
    tmp_path: Path, error: api.PolluxError
) -> None:
    def client(_path: Path) -> Client:
        return FakeClient(error)

    source = DaemonSource(tmp_path / "daemon.sock", client)
    with pytest.raises(type(error), match=str(error)):
        source.call(api.Status())


def test_daemon_source_without_a_daemon_is_unavailable(tmp_path: Path) -> None:
    with pytest.raises(api.DaemonUnavailable):
        DaemonSource(tmp_path / "daemon.sock").call(api.Status())
    with pytest.raises(api.DaemonUnavailable):  # a socket path too long to connect to
        DaemonSource(tmp_path / ("x" * 200) / "daemon.sock").call(api.Status())


def test_replies_are_plain_api_structs(source: FixedSource) -> None:
    nodes = source.call(api.Nodes())
    data = msgspec.to_builtins(nodes)
    assert msgspec.convert(data, api.NodesReply, strict=True) == nodes
