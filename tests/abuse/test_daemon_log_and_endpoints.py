"""What a user or a job writes that ends up in the daemon's log, and the Prometheus endpoint
anyone on the machine may connect to.

Each was a hole:

* a job's ``report.json`` with an unknown field named by escape sequences put them, raw, into
  ``daemon.log`` and the journal (an admin's ``tail -f`` retitled, cleared, a forged line), and
  a 700 KB field name a line: 179 MiB of log in 20 s on the state's disk.  Now every log line is
  escaped, a refused report is quoted in one short line, warned about once a minute per job,
  and ``daemon.log`` is moved aside at a size (one older file kept);
* 1,500 half-open scrapes took every descriptor the daemon had (its soft limit: 1,024): other
  users' jobs were recorded as failed and their owners as deleted.  Now the endpoint serves
  at most a few connections at once and closes the rest when accepted, the daemon raises its
  descriptor limit, and a user lookup that failed for want of a descriptor is not "no such
  user".
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import resource
import socket
import stat
import types
from pathlib import Path
from typing import Any

import pytest

from pollux_local.api.states import JobState
from pollux_local.daemon import auth, metrics
from pollux_local.daemon.loop import REPORT_WARNING_INTERVAL_S, SchedulingLoop
from pollux_local.daemon.readmodel import MetricHistory
from pollux_local.daemon.reports import MAX_REASON_CHARS, InvalidReport, parse_report
from pollux_local.daemon.server import raise_open_files_limit
from pollux_local.daemon.statedir import EscapedFormatter, LogFileHandler, open_private

pytestmark = pytest.mark.timeout(120)
HOSTILE = "\x1b]0;PWNED\x07\x1b[2J\x1b[1;31mFAKE: all jobs cancelled by admin\x1b[0m"


def record(message: str, *args: object) -> logging.LogRecord:
    return logging.LogRecord(
        "pollux_local.daemon", logging.WARNING, __file__, 1, message, args, None
    )


def test_a_log_line_quoting_a_job_shows_its_escapes_as_text() -> None:
    line = EscapedFormatter("%(levelname)s %(message)s").format(
        record("job %s: ignoring its report: %s", 7, HOSTILE + "\nsecond line")
    )
    assert "\x1b" not in line and "\x07" not in line
    assert "\\x1b]0;PWNED\\x07" in line
    assert line.endswith("\nsecond line")  # a traceback keeps its lines


def test_a_refused_report_is_quoted_in_one_short_line() -> None:
    huge = json.dumps({HOSTILE + "k" * 700_000: 1}).encode()
    with pytest.raises(InvalidReport) as caught:
        parse_report(huge)
    text = str(caught.value)
    assert len(text) <= MAX_REASON_CHARS, len(text)
    assert "\n" not in text and "\x1b" not in text and "\x07" not in text


def test_a_job_rewriting_a_bad_report_is_warned_about_once_a_minute(caplog: Any) -> None:
    now = [1000.0]
    loop = types.SimpleNamespace(clock=lambda: now[0], _report_warned={})
    with caplog.at_level(logging.WARNING, "pollux_local.daemon"):
        for _ in range(100):  # a job rewriting it 100 times within a second
            SchedulingLoop._warn_report(loop, 7, "ignoring its report: bad")  # type: ignore[arg-type]
            now[0] += 0.01
        SchedulingLoop._warn_report(loop, 8, "ignoring its report: bad")  # type: ignore[arg-type]
        now[0] += REPORT_WARNING_INTERVAL_S
        SchedulingLoop._warn_report(loop, 7, "ignoring its report: bad")  # type: ignore[arg-type]
    said = [r.getMessage() for r in caplog.records]
    assert said == ["job 7: ignoring its report: bad", "job 8: ignoring its report: bad",
                    "job 7: ignoring its report: bad"]  # fmt: skip


def test_what_is_remembered_of_reports_is_forgotten_with_the_job(tmp_path: Path) -> None:
    """A long-lived daemon keeps a report's mtime and last warning per scheduled job only."""
    loop = types.SimpleNamespace(
        clock=lambda: 1000.0,
        state_dir=tmp_path,
        _report_mtimes={7: 1.0, 8: 2.0},
        _report_warned={7: 900.0, 9: 950.0},
        metrics=MetricHistory(),  # its own test: tests/daemon/test_pass_work.py
    )
    running = types.SimpleNamespace(id=8, job_id="8", state=JobState.RUNNING, owner_uid=os.getuid())
    SchedulingLoop.refresh_reports(loop, [running])  # type: ignore[arg-type]
    assert set(loop._report_mtimes) <= {8} and set(loop._report_warned) <= {8}


def test_a_waiting_jobs_report_file_is_never_read_by_a_pass(tmp_path: Path) -> None:
    """A queued job has no replica to write a report: a user who rewrites its
    ``report.json`` (a large file failing the schema late, its mtime bumped before every
    pass) makes no pass read it, whatever the number of such jobs; a running job's is read."""
    read: list[int] = []
    loop = types.SimpleNamespace(
        clock=lambda: 1000.0, state_dir=tmp_path, _report_mtimes={}, _report_warned={},
        _warn_report=lambda job_id, what: read.append(job_id), metrics=MetricHistory(),
    )  # fmt: skip
    jobs = []
    for job_id, job_state in ((1, JobState.QUEUED), (2, JobState.QUEUED), (3, JobState.RUNNING)):
        directory = tmp_path / "jobs" / str(job_id)
        directory.mkdir(parents=True)
        (directory / "report.json").write_text('{"v": 1, "bad": ' + "1" * 100_000 + "}")
        jobs.append(types.SimpleNamespace(
            id=job_id, job_id=str(job_id), state=job_state, owner_uid=os.getuid(),
        ))  # fmt: skip
    for mtime in range(3):  # pass after pass, each file changed again
        for job in jobs:
            os.utime(tmp_path / "jobs" / job.job_id / "report.json", (mtime, mtime))
        SchedulingLoop.refresh_reports(loop, jobs)  # type: ignore[arg-type]
    assert read == [3, 3, 3]  # the running job's, once per version; the queued ones never
    assert set(loop._report_mtimes) == {3}


def test_the_daemon_log_is_moved_aside_at_its_size(tmp_path: Path) -> None:
    path = tmp_path / "daemon.log"
    stream = os.fdopen(open_private(path, os.O_WRONLY | os.O_APPEND), "a", encoding="utf-8")
    handler = LogFileHandler(stream, path, max_bytes=10_000)
    handler.setFormatter(EscapedFormatter("%(message)s"))
    for i in range(2000):  # about 200 kB of lines
        handler.emit(record("line %s %s", i, "x" * 90))
    handler.close()
    older = path.with_name("daemon.log.1")
    assert older.exists()
    for kept in (path, older):
        info = os.lstat(kept)
        assert stat.S_ISREG(info.st_mode) and stat.S_IMODE(info.st_mode) == 0o600
        assert info.st_size <= 10_000 + 200, info.st_size
    assert path.read_text().splitlines()[-1].startswith("line 1999 ")  # the newest lines


def test_half_open_scrapes_do_not_take_the_daemons_descriptors() -> None:
    pytest.importorskip("prometheus_client")

    def snapshot() -> metrics.DaemonSnapshot:
        return metrics.DaemonSnapshot(nodes=(), jobs_by_state={}, running=(), passes=1)

    def descriptors() -> int:
        return len(os.listdir("/proc/self/fd"))

    async def main() -> tuple[int, int, int, bytes]:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = int(probe.getsockname()[1])
        endpoint = await metrics.PrometheusEndpoint.start(f"127.0.0.1:{port}", snapshot)
        assert endpoint is not None
        before = descriptors()
        clients = []
        for _ in range(60):  # each sends half a request head and waits
            client = socket.create_connection(("127.0.0.1", port))
            client.sendall(b"GET /metrics HTTP/1.1\r\n")
            clients.append(client)
            await asyncio.sleep(0.005)
        await asyncio.sleep(0.3)
        held = descriptors() - before - len(clients)  # the daemon's side of them
        serving = endpoint.serving
        await asyncio.sleep(metrics.REQUEST_TIMEOUT_S + 0.5)  # the silent ones dropped
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(), 10)
        writer.close()
        for client in clients:
            client.close()
        await endpoint.close()
        return held, serving, len(clients), answer

    held, serving, sent, answer = asyncio.run(main())
    assert serving <= metrics.MAX_CONNECTIONS
    assert held <= metrics.MAX_CONNECTIONS + 2, f"{held} descriptors for {sent} half-open scrapes"
    assert answer.startswith(b"HTTP/1.1 200 OK"), answer[:80]


def test_the_daemon_raises_its_descriptor_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(1024, hard), hard))
        now = raise_open_files_limit()
        wanted = 65536 if hard == resource.RLIM_INFINITY else min(hard, 65536)
        assert now == wanted == resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_lookup_without_a_descriptor_left_is_not_a_deleted_user() -> None:
    assert auth.account(os.getuid()) is not None
    unused = 2**31 - 7
    assert auth.account(unused) is None  # no such user
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    opened: list[int] = []
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, hard))
        with pytest.raises(OSError):
            while True:  # take every descriptor this process may have
                opened.append(os.open(os.devnull, os.O_RDONLY))
        with pytest.raises(OSError):
            auth.account(unused)
    finally:
        for fd in opened:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_rotation_that_failed_is_tried_again(tmp_path: Path, monkeypatch: Any) -> None:
    from pollux_local.api.errors import PolluxError
    from pollux_local.daemon import statedir

    path = tmp_path / "daemon.log"
    stream = os.fdopen(open_private(path, os.O_WRONLY | os.O_APPEND), "a", encoding="utf-8")
    handler = LogFileHandler(stream, path, max_bytes=1000)
    handler.setFormatter(EscapedFormatter("%(message)s"))
    real = statedir.open_private
    failures = [1]

    def out_of_descriptors(*args: Any) -> int:
        if failures:
            failures.pop()
            raise PolluxError("cannot open daemon.log: Too many open files")
        return real(*args)

    monkeypatch.setattr(statedir, "open_private", out_of_descriptors)
    for i in range(40):  # the first rotation fails after moving the file; the next one opens
        handler.emit(record("line %s %s", i, "x" * 90))
    handler.close()
    assert path.exists() and path.stat().st_size <= 1000 + 200
    assert path.read_text().splitlines()[-1].startswith("line 39 ")
