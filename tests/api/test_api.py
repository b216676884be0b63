"""The typed contract (``pollux_local.api``): strict decoding with one-line errors naming the
field, round trips, error codes mapped to exception classes, the launch environment and the
job report."""

from __future__ import annotations

import json
import struct

import msgspec
import pytest

from pollux_local import api
from pollux_local.api import wire
from pollux_local.api.errors import error_for_code
from pollux_local.api.launch import LaunchEnvironment
from pollux_local.api.messages import REQUEST_TYPES


def body(**message: object) -> bytes:
    return json.dumps(message).encode()


def test_every_request_type_round_trips_through_a_frame() -> None:
    samples: list[api.Request] = [
        api.Ping(),
        api.Submit(argv=["python", "t.py"], workdir="/tmp", name="t", min_gpus=2),
        api.Status(all=False),
        api.Show(id="3"),
        api.Logs(id="3", rank=1, offset=-100),
        api.Cancel(ids=["1", "2"]),
        api.Hold(id="1"),
        api.Release(id="1"),
        api.SetPriority(id="1", priority=-5),
        api.Nodes(),
        api.Report(job_id="4", report=api.JobReport(progress=3.0, metrics={"loss": 0.5})),
        api.Restart(id="4"),
        api.Edit(id="4", min_gpus=2, time_limit_s=None),
        api.Usage(user="alice", since=0.0),
        api.Drain(target="box2:cuda:1"),
        api.Resume(target="box2"),
        api.Estimate(submit=api.Submit(argv=["sleep", "5"], workdir="/tmp", min_gpus=2)),
        api.ListGroups(),
        api.SetGroup(name="small", max_devices=2, max_running=None),
        api.DeleteGroup(name="small"),
        api.PauseGroup(name="small"),
        api.ResumeGroup(name="small"),
    ]
    assert {type(r) for r in samples} == set(REQUEST_TYPES.values())
    for request in samples:
        framed = wire.encode_request(request)
        (length,) = struct.unpack(">I", framed[:4])
        assert length == len(framed) - 4
        assert wire.decode_request(framed[4:]) == request


@pytest.mark.parametrize(
    ("message", "expected"),
    [
        ({"v": 1, "type": "nope"}, "unknown request type 'nope'"),
        ({"v": 2, "type": "ping"}, "unsupported protocol version 2"),
        ({"type": "ping"}, "unsupported protocol version None"),
        ({"v": 1, "type": "show"}, "missing required field `id`"),
        ({"v": 1, "type": "show", "id": "1", "extra": 1}, "unknown field `extra`"),
        ({"v": 1, "type": "show", "id": "abc"}, "$.id"),
        ({"v": 1, "type": "set_priority", "id": "1", "priority": "high"}, "$.priority"),
        ({"v": 1, "type": "set_priority", "id": "1", "priority": 10**6}, "$.priority"),
        ({"v": 1, "type": "submit", "argv": ["x"], "workdir": "/", "batch_size": 10**22},
         "$.batch_size"),
        ({"v": 1, "type": "submit", "argv": ["x"], "workdir": "/", "min_gpus": True},
         "$.min_gpus"),
        ({"v": 1, "type": "submit", "argv": ["x"], "workdir": "relative"}, "$.workdir"),
        ({"v": 1, "type": "submit", "argv": [], "workdir": "/"}, "$.argv"),
        ({"v": 1, "type": "submit", "argv": ["x"], "workdir": "/", "name": "a\x1b[31mred"},
         "$.name"),
        ({"v": 1, "type": "report", "job_id": "1", "report": {"profile": [{"nodes": 1}]}},
         "$.report.profile[0]"),
        # what execve cannot pass (it ended a node agent with a traceback nobody saw)
        ({"v": 1, "type": "submit", "argv": ["x"], "workdir": "/", "env": {"A=B": "1"}},
         "$.env"),
        ({"v": 1, "type": "submit", "argv": ["x"], "workdir": "/", "env": {"A": "1\x002"}},
         "$.env"),
        ({"v": 1, "type": "submit", "argv": ["x"], "workdir": "/", "env": {"": "1"}}, "$.env"),
        ({"v": 1, "type": "submit", "argv": ["x"], "workdir": "/", "umask": 0o1000}, "$.umask"),
    ],
)  # fmt: skip
def test_bad_requests_are_refused_with_one_line_naming_the_problem(
    message: dict[str, object], expected: str
) -> None:
    with pytest.raises(api.InvalidRequest) as info:
        wire.decode_request(body(**message))
    text = str(info.value)
    assert expected in text
    assert "\n" not in text and len(text) < 300


@pytest.mark.parametrize("raw", [b"", b"\xff\xfe", b"[1, 2]", b"null", b'{"v": 1,'])
def test_garbage_bodies_are_protocol_errors(raw: bytes) -> None:
    with pytest.raises(api.ProtocolError):
        wire.decode_request(raw)


def test_error_replies_carry_a_code_that_maps_back_to_the_class() -> None:
    for cls in (api.NotFound, api.PermissionDenied, api.Conflict, api.InvalidRequest):
        framed = wire.encode_error(cls("job 7:\n  went   away"))
        with pytest.raises(cls) as info:
            wire.decode_reply(framed[4:], api.StatusReply)
        assert str(info.value) == "job 7: went away"
    assert error_for_code("something-newer") is api.PolluxError
    assert issubclass(api.InvalidRequest, api.ProtocolError)
    assert all(issubclass(c, api.PolluxError) for c in (api.DaemonUnavailable, api.NotFound))


def test_a_reply_of_the_wrong_shape_is_refused() -> None:
    framed = wire.encode_reply(api.SubmitReply(id="1", state=api.JobState.QUEUED))
    assert wire.decode_reply(framed[4:], api.SubmitReply).state is api.JobState.QUEUED
    with pytest.raises(api.ProtocolError, match="unexpected reply"):
        wire.decode_reply(framed[4:], api.StatusReply)
    bad = body(v=1, ok=True, id="1", state="sleeping")
    with pytest.raises(api.ProtocolError):
        wire.decode_reply(bad, api.SubmitReply)


def test_oversize_frames_are_refused_before_reading_them() -> None:
    with pytest.raises(api.ProtocolError, match="exceeds"):
        wire.check_length(wire.MAX_FRAME_BYTES + 1)
    with pytest.raises(api.ProtocolError, match="exceeds"):
        wire.frame(b"x" * (wire.MAX_FRAME_BYTES + 1))


def test_job_states_partition_into_active_and_terminal() -> None:
    states = set(api.JobState)
    assert states == api.ACTIVE_STATES | api.TERMINAL_STATES
    assert not api.ACTIVE_STATES & api.TERMINAL_STATES
    assert api.JobState("held").active and api.JobState("failed").terminal
    assert api.ExitCode.RESCALE == 75


def test_launch_environment_round_trips_and_rejects_malformed_values() -> None:
    launch = LaunchEnvironment(
        rank=1, world_size=4, local_rank=1, local_world_size=2, node_rank=0,
        master_addr="10.0.0.1", master_port=29500, job_id="12", restarts=2,
        job_dir="/state/jobs/12", checkpoint_dir="/ckpt/12", daemon_socket="/s.sock",
        num_nodes=2, local_batch=32, accum_steps=2, device="cpu", pg_timeout_s=20.0,
    )  # fmt: skip
    assert LaunchEnvironment.from_environ(launch.to_environ()) == launch
    assert "RANK" not in launch.common_environ()
    assert LaunchEnvironment.from_environ({}) == LaunchEnvironment()
    for env, word in (
        ({"WORLD_SIZE": "x"}, "WORLD_SIZE"),
        ({"WORLD_SIZE": "2", "RANK": "2"}, "RANK"),
        ({"POLLUX_DEVICE": "tpu"}, "POLLUX_DEVICE"),
        ({"POLLUX_LOCAL_BATCH": "0"}, "POLLUX_LOCAL_BATCH"),
        ({"POLLUX_PG_TIMEOUT_S": "nan"}, "POLLUX_PG_TIMEOUT_S"),
    ):
        with pytest.raises(api.PolluxError, match=word):
            LaunchEnvironment.from_environ(env)


def test_job_report_schema_is_strict_but_every_field_is_optional() -> None:
    assert msgspec.convert({}, api.JobReport, strict=True) == api.JobReport()
    report = msgspec.convert(
        {
            "version": 1,
            "job_id": "3",
            "time": 1.0,
            "bounds": {"base_batch": 128, "max_batch": 4096, "min_local": 32,
                       "max_local": 1024, "accumulation": True},
            "profile": [{"nodes": 1, "replicas": 2, "local_batch": 64, "compute_s": 0.05,
                         "step_s": 0.07, "count": 30}],
            "grad_stats": {"sqr": 1.9, "var": 1.6},
            "progress": 1234.5, "epoch": 3, "epochs": 90,
            "batch": {"local_batch": 64, "accum_steps": 1, "replicas": 2},
            "metrics": {"loss": 0.41},
        },
        api.JobReport,
        strict=True,
    )  # fmt: skip
    assert report.profile[0].replicas == 2 and report.bounds is not None
    for bad in ({"version": 99}, {"profile": [{"nodes": 0}]}, {"progress": -1}, {"x": 1}):
        with pytest.raises(msgspec.ValidationError):
            msgspec.convert(bad, api.JobReport, strict=True)


def _row(local_batch: int, count: int = 1) -> dict[str, object]:
    return {"nodes": 1, "replicas": 1, "local_batch": local_batch, "compute_s": 0.1,
            "step_s": 0.1, "count": count}  # fmt: skip


@pytest.mark.parametrize(
    ("report", "field"),
    [
        ({"profile": [_row(m) for m in range(1, 258)]}, "$.report.profile"),
        ({"memory": [{"device_type": "t4", "local_batch": m, "peak_bytes": 1,
                      "total_bytes": 2} for m in range(1, 258)]}, "$.report.memory"),
        ({"metrics": {f"m{i}": 1.0 for i in range(65)}}, "$.report.metrics"),
        ({"metrics": {"x" * 65: 1.0}}, "$.report.metrics"),
        ({"metrics": {"loss": 1e301}}, "$.report.metrics"),
        ({"grad_stats": {"sqr": 1e301, "var": 1.0}}, "$.report.grad_stats.sqr"),
        ({"grad_stats": {"sqr": 1.0, "var": -1.0}}, "$.report.grad_stats.var"),
        ({"progress": 1e19}, "$.report.progress"),
        ({"time": -5.0}, "$.report.time"),
        ({"eta_s": 1e300}, "$.report.eta_s"),
        ({"job_id": "7" * 33}, "$.report.job_id"),
        ({"profile": [{**_row(8), "step_s": 1e10}]}, "$.report.profile[0].step_s"),
        # batch sizes as a submit takes them: the pass's candidates are int32 (2^40 once
        # launched a job at batch -1646287629)
        ({"bounds": {"base_batch": 1, "max_batch": 2**40}}, "$.report.bounds.max_batch"),
        ({"bounds": {"base_batch": 2**31}}, "$.report.bounds.base_batch"),
        ({"profile": [_row(2**31)]}, "$.report.profile[0].local_batch"),
    ],
)  # fmt: skip
def test_a_report_over_its_bounds_is_refused_in_one_line_naming_the_field(
    report: dict[str, object], field: str
) -> None:
    with pytest.raises(api.InvalidRequest) as info:
        wire.decode_request(body(v=1, type="report", job_id="1", report=report))
    text = str(info.value)
    assert field in text and "\n" not in text


def test_a_report_with_a_number_that_is_not_finite_is_refused() -> None:
    # JSON has no NaN or infinity: a number too large for a float is refused with the frame
    with pytest.raises(api.ProtocolError, match="out of range"):
        wire.decode_request(b'{"v": 1, "type": "report", "job_id": "1",'
                            b' "report": {"metrics": {"loss": 1e999}}}')  # fmt: skip
    # and a report made in Python with them is refused by the ranges, naming the field
    for bad, field in (
        ({"metrics": {"loss": float("nan")}}, "$.metrics"),
        ({"grad_stats": {"sqr": float("inf"), "var": 1.0}}, "$.grad_stats.sqr"),
        ({"eta_s": float("nan")}, "$.eta_s"),
    ):
        with pytest.raises(msgspec.ValidationError, match=field.replace("$", r"\$")):
            msgspec.convert(bad, api.JobReport, strict=True)


def test_a_report_at_its_bounds_is_taken() -> None:
    from pollux_local.api.report import MAX_METRICS, MAX_NAME_CHARS, MAX_PROFILE_ROWS

    report = {
        "profile": [_row(m) for m in range(1, MAX_PROFILE_ROWS + 1)],
        "metrics": {f"{i:0{MAX_NAME_CHARS}d}": float(i) for i in range(MAX_METRICS)},
        "grad_stats": {"sqr": 1e300, "var": 0.0},
    }
    request = wire.decode_request(body(v=1, type="report", job_id="1", report=report))
    assert isinstance(request, api.Report) and len(request.report.profile) == MAX_PROFILE_ROWS


def test_the_job_side_cuts_a_report_to_its_bounds() -> None:
    """The job library sends the most-timed rows and finite metrics, so that an honest job
    with more measurements than a report holds is never refused."""
    from pollux_local.api.report import (
        MAX_METRICS,
        MAX_PROFILE_ROWS,
        JobReport,
        ProfileRow,
        bounded_report,
    )

    rows = [ProfileRow(nodes=1, replicas=1, local_batch=m, compute_s=0.1, step_s=0.1, count=m)
            for m in range(1, MAX_PROFILE_ROWS + 51)]  # fmt: skip
    metrics = {f"m{i}": float(i) for i in range(MAX_METRICS + 5)}
    metrics |= {"m0": float("nan"), "m1": float("inf"), "y" * 80: 1.0}
    cut = bounded_report(JobReport(profile=rows, metrics=metrics))
    assert [row.local_batch for row in cut.profile] == list(range(51, MAX_PROFILE_ROWS + 51))
    assert len(cut.metrics) == MAX_METRICS and cut.metrics["m0"] is None
    assert cut.metrics["m1"] is None and "y" * 80 not in cut.metrics
    # what it sends passes the daemon's decoding
    framed = wire.encode_request(api.Report(job_id="1", report=cut))
    assert wire.decode_request(framed[4:]) == api.Report(job_id="1", report=cut)
    within = JobReport(profile=rows[:3], metrics={"loss": 0.5})
    assert bounded_report(within) is within
