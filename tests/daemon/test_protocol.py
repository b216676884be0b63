"""The wire contract as the daemon speaks it (``api.wire``): framing, strict request decoding,
typed error replies, and a live daemon fed garbage."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import socket
import struct
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest
import pytest_asyncio

from pollux_local import api
from pollux_local.api import wire
from pollux_local.api.errors import (
    Conflict,
    DaemonUnavailable,
    InvalidRequest,
    NotFound,
    PermissionDenied,
    PolluxError,
    ProtocolError,
)
from pollux_local.api.states import JobState
from pollux_local.client import Client
from pollux_local.core.types import Decision
from pollux_local.daemon.config import DaemonConfig, NodeConfig
from pollux_local.daemon.reports import InvalidReport, read_report_file
from pollux_local.daemon.server import Daemon

pytestmark = pytest.mark.timeout(60)


class IdlePolicy:
    """Never runs anything: these tests only exercise the socket."""

    name = "idle"

    def decide(self, jobs, nodes, now, rng: np.random.Generator) -> Decision:  # type: ignore[no-untyped-def]
        return Decision(placements={j.id: (0,) * len(nodes) for j in jobs})


def body(message: Any) -> bytes:
    return json.dumps(message).encode()


def test_frame_round_trip() -> None:
    frame = wire.encode_request(api.Show(id="7"))
    (length,) = struct.unpack(">I", frame[:4])
    assert length == len(frame) - 4
    assert json.loads(frame[4:]) == {"v": 1, "type": "show", "id": "7"}
    assert wire.decode_request(frame[4:]) == api.Show(id="7")


DEEP = b'{"v": 1, "type": "status", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"


@pytest.mark.parametrize("raw", [b"\xff\xfe", b"[1, 2]", b"{not json", b"", b'"ping"', DEEP])
def test_bad_bodies_are_protocol_errors(raw: bytes) -> None:
    with pytest.raises(ProtocolError):
        wire.decode_request(raw)


@pytest.mark.parametrize(
    ("message", "fragment"),
    [
        ({"type": "ping"}, "version"),
        ({"v": 2, "type": "ping"}, "version"),
        ({"v": True, "type": "ping"}, "version"),
        ({"v": 1, "type": "launch_missiles"}, "unknown request type"),
        ({"v": 1, "type": ["ping"]}, "unknown request type"),
        ({"v": 1, "type": "show"}, "missing required field `id`"),
        ({"v": 1, "type": "show", "id": 3}, "$.id"),
        ({"v": 1, "type": "show", "id": "abc"}, "$.id"),
        ({"v": 1, "type": "cancel", "ids": "3"}, "$.ids"),
        ({"v": 1, "type": "submit", "argv": ["x"], "workdir": "/", "uid": 0}, "unknown field"),
        ({"v": 1, "type": "submit", "argv": ["x"], "workdir": "/", "min_gpus": True}, "min_gpus"),
        ({"v": 1, "type": "submit", "argv": ["x"], "workdir": "x"}, "$.workdir"),
        ({"v": 1, "type": "submit", "argv": [], "workdir": "/"}, "$.argv"),
        ({"v": 1, "type": "submit", "argv": ["x"], "workdir": "/", "min_gpus": 0}, "min_gpus"),
        # over-large integers are range errors, never overflows further in
        ({"v": 1, "type": "submit", "argv": ["x"], "workdir": "/", "min_gpus": 2**64}, "min_gpus"),
        ({"v": 1, "type": "set_priority", "id": "1", "priority": 10**30}, "$.priority"),
        ({"v": 1, "type": "logs", "id": "1", "offset": 2**70}, "$.offset"),
        ({"v": 1, "type": "report", "job_id": "1", "report": {"progress": "x"}}, "progress"),
        ({"v": 1, "type": "report", "job_id": "1", "report": {"oops": 1}}, "oops"),
    ],
)
def test_validation_names_the_problem_in_one_line(message: dict, fragment: str) -> None:
    with pytest.raises(InvalidRequest) as caught:
        wire.decode_request(body(message))
    assert fragment in str(caught.value)
    assert "\n" not in str(caught.value)
    assert caught.value.code == "invalid_request"


def test_identity_cannot_be_claimed_in_a_request() -> None:
    """There is no owner/uid field to forge: the schema rejects it."""
    for field in ("owner", "uid", "user"):
        with pytest.raises(InvalidRequest, match="unknown field"):
            wire.decode_request(body({"v": 1, "type": "cancel", "ids": ["1"], field: "root"}))


def test_error_replies_carry_the_code() -> None:
    reply = json.loads(wire.encode_error(NotFound("no job with id '4'"))[4:])
    assert reply == {"v": 1, "ok": False, "code": "not_found", "error": "no job with id '4'"}
    with pytest.raises(NotFound, match="no job"):
        wire.decode_reply(wire.encode_error(NotFound("no job"))[4:], api.ShowReply)


@pytest_asyncio.fixture
async def daemon(tmp_path: Path) -> AsyncIterator[Daemon]:
    config = DaemonConfig(nodes=(NodeConfig("n0", ("cpu:0", "cpu:1")),), interval_s=0.5)
    # a short path: Unix socket paths are limited to ~107 bytes
    state_dir = Path(os.environ.get("TMPDIR", "/tmp")) / f"plx-proto-{os.getpid()}-{id(tmp_path)}"
    daemon = Daemon(config, state_dir, policy=IdlePolicy())
    ready = asyncio.Event()
    task = asyncio.ensure_future(daemon.run(ready=ready.set))
    await asyncio.wait_for(ready.wait(), 10)
    yield daemon
    daemon.request_stop()
    await asyncio.wait_for(task, 10)
    import shutil

    shutil.rmtree(state_dir, ignore_errors=True)


async def _raw(path: Path, payload: bytes, read: bool = True) -> bytes:
    reader, writer = await asyncio.open_unix_connection(str(path))
    writer.write(payload)
    await writer.drain()
    data = b""
    if read:
        writer.write_eof()
        data = await asyncio.wait_for(reader.read(), 5)
    writer.close()
    return data


def _replies(data: bytes) -> list[dict[str, Any]]:
    """The reply frames in ``data``."""
    replies = []
    while data:
        (length,) = struct.unpack(">I", data[:4])
        replies.append(json.loads(data[4 : 4 + length]))
        data = data[4 + length :]
    return replies


async def _error(daemon: Daemon, payload: bytes) -> dict[str, Any]:
    """The one error reply the daemon sends to ``payload`` (a typed error, never internal)."""
    (reply,) = _replies(await _raw(daemon.socket_path, payload))
    assert reply["ok"] is False and reply["v"] == 1
    assert reply["code"] != "internal" and "internal error" not in reply["error"]
    assert "\n" not in reply["error"] and reply["error"]
    return reply


async def _ping(daemon: Daemon) -> dict:
    return await asyncio.to_thread(Client(daemon.socket_path).request, "ping")


@pytest.mark.asyncio
async def test_ping_and_peer_identity(daemon: Daemon) -> None:
    reply = await _ping(daemon)
    assert reply["pid"] == os.getpid()
    assert reply["you"]["uid"] == os.geteuid()
    assert reply["policy"] == "idle" and reply["devices"] == 2
    assert oct(daemon.socket_path.stat().st_mode & 0o777) == oct(0o666)


@pytest.mark.asyncio
async def test_garbage_truncated_and_huge_frames_do_not_crash(daemon: Daemon) -> None:
    huge = struct.pack(">I", wire.MAX_FRAME_BYTES + 1)
    reply = await _error(daemon, huge + b"x" * 16)
    assert "exceeds" in reply["error"] and reply["code"] == "protocol"
    reply = await _error(daemon, wire.frame(b"{not json}"))
    assert "not valid UTF-8 JSON" in reply["error"] and reply["code"] == "protocol"
    reply = await _error(daemon, struct.pack(">I", 1000) + b"{}")  # truncated, then EOF
    assert "truncated" in reply["error"]
    reply = await _error(daemon, b"\x00\x01")  # truncated header
    assert "truncated" in reply["error"]
    reply = await _error(daemon, wire.frame(DEEP))
    assert "too deeply" in reply["error"] and reply["code"] == "protocol"
    reply = await _error(daemon, wire.frame(body({"v": 1, "type": "nope"})))
    assert "unknown request type" in reply["error"] and reply["code"] == "invalid_request"
    assert (await _ping(daemon))["pid"] == os.getpid()


@pytest.mark.asyncio
@pytest.mark.parametrize(
    ("message", "fragment"),
    [
        ({"v": 1, "type": "status", "junk": 1}, "unknown field `junk`"),
        ({"v": 1, "type": "show", "id": 3}, "$.id"),
        ({"v": 1, "type": "set_priority", "id": "1", "priority": 10**40}, "$.priority"),
        ({"v": 1, "type": "logs", "id": "1", "max_bytes": -(2**80)}, "$.max_bytes"),
        ({"v": 1, "type": "submit", "argv": ["x"], "workdir": "/", "max_gpus": 2**63}, "max_gpus"),
        ({"v": 1, "type": "report", "job_id": "1", "report": {"epoch": 1.5}}, "epoch"),
    ],
)
async def test_bad_requests_are_one_line_typed_errors(
    daemon: Daemon, message: dict, fragment: str
) -> None:
    reply = await _error(daemon, wire.frame(body(message)))
    assert reply["code"] == "invalid_request" and fragment in reply["error"]


@pytest.mark.asyncio
async def test_a_connection_goes_on_after_a_refused_request(daemon: Daemon) -> None:
    payload = wire.frame(body({"v": 1, "type": "show", "id": 3})) + wire.encode_request(api.Ping())
    first, second = _replies(await _raw(daemon.socket_path, payload))
    assert first["ok"] is False and second["ok"] is True and second["pid"] == os.getpid()


@pytest.mark.asyncio
async def test_every_request_type_has_a_handler(daemon: Daemon) -> None:
    client = Client(daemon.socket_path)
    job = await asyncio.to_thread(
        client.call, api.Submit(argv=["true"], workdir="/", hold=True, name="h")
    )
    requests: dict[str, api.Request] = {
        "ping": api.Ping(),
        "submit": api.Submit(argv=["true"], workdir="/", hold=True),
        "status": api.Status(all=False),
        "show": api.Show(id=job.id),
        "logs": api.Logs(id=job.id),
        "cancel": api.Cancel(ids=[job.id]),
        "hold": api.Hold(id=job.id),
        "release": api.Release(id=job.id),
        "set_priority": api.SetPriority(id=job.id, priority=3),
        "nodes": api.Nodes(),
        "report": api.Report(job_id=job.id, report=api.JobReport(progress=1.0)),
        "edit": api.Edit(id=job.id, priority=-1),
        "usage": api.Usage(),
        "drain": api.Drain(target=daemon.config.nodes[0].name),
        "resume": api.Resume(target=daemon.config.nodes[0].name),
        "estimate": api.Estimate(submit=api.Submit(argv=["true"], workdir="/")),
        "set_group": api.SetGroup(name="mine", max_running=2),
        "groups": api.ListGroups(),
        "pause_group": api.PauseGroup(name="mine"),
        "resume_group": api.ResumeGroup(name="mine"),
        "delete_group": api.DeleteGroup(name="mine"),
    }
    assert set(requests) | {"restart"} == set(api.REQUEST_TYPES)
    for kind, request in requests.items():
        if kind == "cancel":
            continue  # last: it ends the job
        reply = await asyncio.to_thread(client.call, request)
        assert isinstance(reply, type(request).Reply), kind
    reply = await asyncio.to_thread(client.call, requests["cancel"])
    assert reply == api.CancelReply(cancelled=[job.id], skipped=[])
    # restart: only once the job ended
    again = await asyncio.to_thread(client.call, api.Restart(id=job.id, hold=True))
    assert isinstance(again, api.SubmitReply) and again.id != job.id


@pytest.mark.asyncio
async def test_an_array_task_is_restarted_only_while_no_task_of_its_index_is_active(
    daemon: Daemon,
) -> None:
    """A restart of an ended array task is refused while another task of the same array and
    index is queued, held or running (two tasks of one index, as submit refuses), naming it."""
    client = Client(daemon.socket_path)
    array = [api.ArrayTask(index=i) for i in (0, 1)]
    submit = api.Submit(argv=["true"], workdir="/", array=array, hold=True)
    ids = (await asyncio.to_thread(client.call, submit)).ids
    await asyncio.to_thread(client.call, api.Cancel(arrays=[ids[0]]))
    again = (await asyncio.to_thread(client.call, api.Restart(id=ids[1], hold=True))).id
    with pytest.raises(Conflict) as refused:  # the same ended task again
        await asyncio.to_thread(client.call, api.Restart(id=ids[1]))
    assert str(refused.value) == (
        f"job {ids[1]}: task 1 of array {ids[0]} is already held as job {again};"
        " restart it once that job ended"
    )
    assert (await asyncio.to_thread(client.call, api.Restart(id=ids[0], hold=True))).id
    # once the active one ended, the task may be restarted again (from any of its ends)
    await asyncio.to_thread(client.call, api.Cancel(ids=[again]))
    assert (await asyncio.to_thread(client.call, api.Restart(id=ids[1], hold=True))).id


@pytest.mark.asyncio
async def test_handlers_refuse_with_typed_errors(daemon: Daemon) -> None:
    client = Client(daemon.socket_path)
    job = await asyncio.to_thread(client.request, "submit", argv=["true"], workdir="/")
    with pytest.raises(Conflict, match=f"job {job['id']} is not held"):
        await asyncio.to_thread(client.request, "release", id=job["id"])
    # not started yet: every rank's log is empty
    assert (await asyncio.to_thread(client.request, "logs", id=job["id"], rank=3))["data"] == ""
    await asyncio.to_thread(client.request, "cancel", ids=[job["id"]])
    with pytest.raises(NotFound, match="has no log for rank 3"):
        await asyncio.to_thread(client.request, "logs", id=job["id"], rank=3)
    with pytest.raises(Conflict, match="has already cancelled"):
        await asyncio.to_thread(client.request, "hold", id=job["id"])
    checks = [
        ({"min_gpus": 2, "max_gpus": 1}, "min_gpus 2 is greater than max_gpus 1"),
        ({"min_gpus": 3}, "needs at least 3 device(s) but this daemon has 2"),
        ({"batch_size": 64, "max_batch_size": 8}, "max_batch_size 8 is below batch_size 64"),
        ({"max_batch_size": 8}, "max_batch_size needs batch_size"),
        ({"min_local_batch": 8, "max_local_batch": 4}, "is below min_local_batch 8"),
        ({"argv": [""]}, "the command is empty"),
    ]
    for fields, message in checks:
        request = {"argv": ["true"], "workdir": "/", **fields}
        with pytest.raises(InvalidRequest, match=message.replace("(", r"\(").replace(")", r"\)")):
            await asyncio.to_thread(client.request, "submit", **request)
    assert [j["id"] for j in (await asyncio.to_thread(client.request, "status"))["jobs"]] == [
        job["id"]
    ]


@pytest.mark.asyncio
async def test_a_report_file_off_the_schema_is_ignored_with_a_reason(
    daemon: Daemon, caplog: pytest.LogCaptureFixture
) -> None:
    client = Client(daemon.socket_path)
    job_id = (await asyncio.to_thread(client.request, "submit", argv=["x"], workdir="/"))["id"]
    job_dir = daemon.state_dir / "jobs" / job_id
    job_dir.mkdir(parents=True, exist_ok=True)
    (job_dir / "report.json").write_text(json.dumps({"version": 1, "progress": "lots"}))
    with caplog.at_level(logging.WARNING, logger="pollux_local.daemon"):
        take_reports_as_running(daemon, job_id)
    assert any(
        f"job {job_id}: ignoring its report" in r.getMessage() and "$.progress" in r.getMessage()
        for r in caplog.records
    ), caplog.text
    shown = await asyncio.to_thread(client.request, "show", id=job_id)
    assert shown["job"]["report"] is None and shown["job"]["progress"] is None
    (job_dir / "report.json").write_text(json.dumps({"version": 1, "progress": 5.0}))
    os.utime(job_dir / "report.json", ns=(1, 1))  # surely a new mtime, however coarse
    take_reports_as_running(daemon, job_id)
    shown = await asyncio.to_thread(client.request, "show", id=job_id)
    assert shown["job"]["progress"] == 5.0 and shown["job"]["report"]["progress"] == 5.0


def take_reports_as_running(daemon: Daemon, job_id: str) -> None:
    """The pass's look at the report files, with the (queued) job taken as running: a pass
    reads only running jobs' (``SchedulingLoop.refresh_reports``)."""
    assert daemon.store is not None and daemon.scheduler is not None
    job = daemon.store.get_job(int(job_id))
    assert job is not None
    daemon.scheduler.refresh_reports([dataclasses.replace(job, state=JobState.RUNNING)])


@pytest.mark.asyncio
async def test_bounded_fuzz_leaves_daemon_alive_without_memory_growth(daemon: Daemon) -> None:
    rng = np.random.default_rng(7)
    proc = psutil.Process()
    await _ping(daemon)

    async def one(i: int) -> None:
        kind = i % 4
        if kind == 0:
            payload = rng.bytes(int(rng.integers(1, 200)))
        elif kind == 1:
            payload = struct.pack(">I", int(rng.integers(0, 2**32))) + rng.bytes(8)
        elif kind == 2:
            payload = wire.encode_request(api.Show(id=str(i)))[: int(rng.integers(1, 20))]
        else:
            payload = wire.frame(body({"v": 1, "type": "status", "junk": rng.bytes(4).hex()}))
        await _raw(daemon.socket_path, payload)

    for i in range(100):  # warm-up so allocator pools are in place
        await one(i)
    before = proc.memory_info().rss
    for i in range(600):
        await one(i)
    grown = proc.memory_info().rss - before
    assert grown < 8 * 1024 * 1024, f"RSS grew by {grown} bytes over 600 bad frames"
    assert (await _ping(daemon))["pid"] == os.getpid()


@pytest.mark.asyncio
async def test_silent_connection_does_not_block_others(daemon: Daemon) -> None:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(str(daemon.socket_path))
    sock.sendall(b"\x00\x00")  # half a header, then silence
    try:
        assert (await _ping(daemon))["pid"] == os.getpid()
    finally:
        sock.close()


@pytest.mark.asyncio
async def test_unknown_job_is_one_clear_error(daemon: Daemon) -> None:
    client = Client(daemon.socket_path)
    with pytest.raises(NotFound, match="no job with id '42'"):
        await asyncio.to_thread(client.request, "show", id="42")


def test_no_daemon_is_one_clear_error(tmp_path: Path) -> None:
    with pytest.raises(DaemonUnavailable, match="no daemon is running"):
        Client(tmp_path / "daemon.sock").request("ping")
    assert issubclass(DaemonUnavailable, PolluxError)


@pytest.mark.asyncio
async def test_unsafe_job_files_are_refused_in_one_line_and_never_read(
    daemon: Daemon, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    client = Client(daemon.socket_path)
    job_id = (await asyncio.to_thread(client.request, "submit", argv=["x"], workdir="/"))["id"]
    job_dir = daemon.state_dir / "jobs" / job_id
    job_dir.mkdir(parents=True, exist_ok=True)
    secret = tmp_path / "secret"
    secret.write_text("TOP-SECRET\n")
    (job_dir / "rank0.log").symlink_to(secret)
    os.mkfifo(job_dir / "rank1.log")
    os.link(secret, job_dir / "rank2.log")
    for rank, problem in ((0, "symlink"), (1, "not a regular file"), (2, "2 links")):
        for offset in (0, -100):
            with pytest.raises(PermissionDenied) as caught:
                await asyncio.to_thread(client.request, "logs", id=job_id, rank=rank, offset=offset)
            line = str(caught.value)
            assert problem in line and f"job {job_id}" in line and "TOP-SECRET" not in line
            assert "\n" not in line
    # a FIFO or a symlink as report.json: skipped with one logged line, the pass not blocked
    os.mkfifo(job_dir / "report.json")
    with caplog.at_level(logging.WARNING, logger="pollux_local.daemon"):
        take_reports_as_running(daemon, job_id)  # not waited on (the test's timeout: 60 s)
    assert f"job {job_id}: ignoring" in caplog.text
    (job_dir / "report.json").unlink()
    (job_dir / "report.json").symlink_to(secret)
    take_reports_as_running(daemon, job_id)
    await asyncio.wait_for(daemon.schedule_once(), 5)
    with pytest.raises(InvalidReport, match="symlink"):
        read_report_file(job_dir / "report.json")
    shown = await asyncio.to_thread(client.request, "show", id=job_id)
    assert shown["job"]["report"] is None and "TOP-SECRET" not in json.dumps(shown)
    assert (await _ping(daemon))["pid"] == os.getpid()
