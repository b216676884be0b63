"""``pollux-local send``: which jobs it refuses (not the caller's, not ``--stdin``, not running,
rank 0 elsewhere), and what it refuses to write to at ``JOB_DIR/stdin`` (a symlink, a plain
file, a directory, another user's FIFO): each one line, nothing written; a FIFO nobody reads
(ENXIO) or one that is full (EAGAIN) is said so at once."""

from __future__ import annotations

import os
import pwd
import threading
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest

from pollux_local.api.errors import PolluxError
from pollux_local.api.messages import BatchBoundsView, JobDetail, ReplicaPid
from pollux_local.api.states import JobState
from pollux_local.cli.send import STDIN_NAME, input_fifo, owner_uid, send_to, write_all
from tests.cli.test_lab import summary

pytestmark = pytest.mark.timeout(60)

ME = os.getuid()


def detail(state: JobState = JobState.RUNNING, **fields: Any) -> JobDetail:
    base = summary("7", state, owner=pwd.getpwuid(ME).pw_name, stdin=True)
    values: dict[str, Any] = dict(
        argv=["sh"], workdir="/tmp", job_dir="/state/jobs/7", pids=[], report=None,
        noise_scale=None, model=None, history=[], rank0_local=True,
        batch_bounds=BatchBoundsView(
            batch_size=None, max_batch_size=None, min_local_batch=None, max_local_batch=None
        ),
    )  # fmt: skip
    values.update(fields)
    merged = {**msgspec.structs.asdict(base), **values}
    return JobDetail(**merged)


# --- the job -------------------------------------------------------------------------------------


def test_a_running_stdin_job_of_the_caller_is_sent_to() -> None:
    assert input_fifo(detail(), ME) == Path("/state/jobs/7") / STDIN_NAME
    assert input_fifo(detail(JobState.RESCALING), ME) == Path("/state/jobs/7/stdin")
    assert owner_uid(detail(), ME) == ME


def test_another_users_job_is_refused() -> None:
    job = detail(owner="someone-else")
    with pytest.raises(PolluxError, match="permission denied: job 7 runs as someone-else;"):
        input_fifo(job, ME if ME != 0 else 12345)
    if ME == 0:  # root may send to anyone's job: to the owner's own FIFO only
        assert input_fifo(detail(owner="root"), 0).name == STDIN_NAME
        assert owner_uid(detail(owner="root"), 0) == 0
        assert owner_uid(detail(owner="no-such-user-here"), 0) is None


def test_a_job_without_stdin_is_refused() -> None:
    with pytest.raises(PolluxError, match="job 7 was not submitted with --stdin"):
        input_fifo(detail(stdin=False), ME)


@pytest.mark.parametrize("state", [JobState.QUEUED, JobState.HELD, JobState.SUCCEEDED])
def test_a_job_not_running_is_refused(state: JobState) -> None:
    with pytest.raises(PolluxError, match=f"job 7 is not running \\({state.value}\\)"):
        input_fifo(detail(state, rank0_local=None), ME)


def test_a_job_whose_rank_0_runs_on_another_node_is_refused() -> None:
    job = detail(rank0_local=False, pids=[ReplicaPid(rank=0, pid=5, node="box2")])
    with pytest.raises(PolluxError, match="job 7's rank 0 runs on box2: send reaches only"):
        input_fifo(job, ME)


# --- the FIFO ------------------------------------------------------------------------------------


class Reader:
    """A process side of a FIFO: holds it open for reading (so that a writer's open works)
    and returns what came."""

    def __init__(self, path: Path) -> None:
        self.fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)

    def read(self) -> bytes:
        try:
            return os.read(self.fd, 1 << 20)
        except BlockingIOError:
            return b""

    def close(self) -> None:
        os.close(self.fd)


def test_text_reaches_a_fifo_that_is_read(tmp_path: Path) -> None:
    path = tmp_path / STDIN_NAME
    os.mkfifo(path, 0o600)
    reader = Reader(path)
    try:
        send_to(path, b"hello\n", "7", ME)
        send_to(path, b"again\n", "7", ME)
        assert reader.read() == b"hello\nagain\n"
    finally:
        reader.close()


def test_a_fifo_nobody_reads_or_none_at_all_is_not_reading(tmp_path: Path) -> None:
    path = tmp_path / STDIN_NAME
    with pytest.raises(PolluxError, match="job 7 is not reading its input now .*try again"):
        send_to(path, b"x\n", "7", ME)
    os.mkfifo(path, 0o600)
    with pytest.raises(PolluxError, match="job 7 is not reading its input now"):
        send_to(path, b"x\n", "7", ME)


def test_a_full_fifo_is_said_so_at_once(tmp_path: Path) -> None:
    path = tmp_path / STDIN_NAME
    os.mkfifo(path, 0o600)
    reader = Reader(path)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
        try:
            while True:  # fill it
                os.write(fd, b"x" * 4096)
        except BlockingIOError:
            pass
        finally:
            os.close(fd)
        started = time.monotonic()
        with pytest.raises(PolluxError, match="job 7 has not read what was sent before"):
            send_to(path, b"more\n", "7", ME)
        assert time.monotonic() - started < 2
    finally:
        reader.close()


def test_long_input_goes_as_the_job_reads_it_and_stops_when_it_does_not(tmp_path: Path) -> None:
    path = tmp_path / STDIN_NAME
    os.mkfifo(path, 0o600)
    reader = Reader(path)
    data = bytes(range(256)) * 2048  # 512 KiB: more than a pipe holds
    got = bytearray()
    done = threading.Event()

    def drain() -> None:
        while len(got) < len(data) and not done.is_set():
            chunk = reader.read()
            got.extend(chunk)
            if not chunk:
                time.sleep(0.01)

    thread = threading.Thread(target=drain)
    thread.start()
    try:
        send_to(path, data, "7", ME)
        thread.join(20)
        assert bytes(got) == data
        fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)  # now nobody drains it
        try:
            with pytest.raises(PolluxError, match="job 7 read [0-9]+ of 524288 bytes"):
                write_all(fd, data, "7", wait_s=0.3)
        finally:
            os.close(fd)
    finally:
        done.set()
        thread.join(20)
        reader.close()


@pytest.mark.parametrize("kind", ["symlink", "regular", "directory", "others-fifo"])
def test_anything_but_the_callers_fifo_is_refused_and_left_alone(tmp_path: Path, kind: str) -> None:
    path = tmp_path / STDIN_NAME
    target = tmp_path / "target"  # a FIFO with a reader: what a symlink might point at
    os.mkfifo(target, 0o600)
    reader = Reader(target)
    try:
        if kind == "symlink":
            path.symlink_to(target)
            match = "it is a symlink"
        elif kind == "regular":
            path.write_text("keep me\n")
            match = "it is not a FIFO"
        elif kind == "directory":
            path.mkdir()
            match = "it is not a FIFO"
        else:
            if ME != 0:
                pytest.skip("needs root (a FIFO of another user)")
            os.mkfifo(path, 0o666)
            os.chown(path, 54321, 54321)
            reader.close()
            reader = Reader(path)
            match = "it belongs to uid 54321, not uid 0"
        with pytest.raises(PolluxError, match=f"refusing {path}: {match}"):
            send_to(path, b"secret\n", "7", ME)
        assert reader.read() == b""
        if kind == "regular":
            assert path.read_text() == "keep me\n"
    finally:
        reader.close()


def test_root_writes_only_to_the_owners_fifo(tmp_path: Path) -> None:
    if ME != 0:
        pytest.skip("needs root")
    path = tmp_path / STDIN_NAME
    os.mkfifo(path, 0o600)  # root's, where the owner's (uid 54321) should be
    reader = Reader(path)
    try:
        with pytest.raises(PolluxError, match="it belongs to uid 0, not uid 54321"):
            send_to(path, b"x\n", "7", 54321)
        os.chown(path, 54321, 54321)
        send_to(path, b"x\n", "7", 54321)
        assert reader.read() == b"x\n"
    finally:
        reader.close()


@pytest.mark.parametrize("kind", ["symlink", "regular"])
def test_a_swap_after_the_first_look_is_caught_by_the_open(
    tmp_path: Path, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What was looked at first may be swapped before the open: the open (no symlink
    followed) and the descriptor's ``fstat`` still refuse it."""
    path = tmp_path / STDIN_NAME
    target = tmp_path / "target"
    os.mkfifo(target, 0o600)
    reader = Reader(target)
    fifo_stat = os.lstat(target)
    try:
        if kind == "symlink":
            path.symlink_to(target)
            match = "it is a symlink"
        else:
            path.write_text("keep me\n")
            match = "it is not a FIFO"
        monkeypatch.setattr(os, "lstat", lambda _path: fifo_stat)  # a FIFO when looked at
        with pytest.raises(PolluxError, match=f"refusing {path}: {match}"):
            send_to(path, b"secret\n", "7", ME)
        monkeypatch.undo()
        assert reader.read() == b""
        if kind == "regular":
            assert path.read_text() == "keep me\n"
    finally:
        reader.close()
