"""A replica's log through the copier (``launch/logcap.py``): cut at its size limit with one
note, and paused while its disk has too little room, so that a job's output never takes the
room the state database needs."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from pollux_local.launch import logcap


def copy(
    tmp_path: Path, chunks: list[bytes], limit: int, keep_free: int = 0, pause_s: float = 0.0
) -> bytes:
    """Feed ``chunks`` through a pipe to :func:`logcap.copy_capped` (``pause_s`` apart: one
    read each); the log it wrote."""
    log = tmp_path / "rank0.log"
    log_fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    read_end, write_end = os.pipe()
    copier = threading.Thread(target=logcap.copy_capped, args=(read_end, log_fd, limit, keep_free))
    copier.start()
    for chunk in chunks:
        os.write(write_end, chunk)
        threading.Event().wait(pause_s)
    os.close(write_end)
    copier.join(10)
    os.close(read_end)
    os.close(log_fd)
    return log.read_bytes()


def test_a_log_is_cut_at_its_limit_with_one_note(tmp_path: Path) -> None:
    data = copy(tmp_path, [b"x" * 100] * 30, limit=1000)
    assert data == b"x" * 1000 + logcap.truncation_note(1000)


@pytest.fixture
def disk(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """The free bytes the copier sees, one value per chunk it copies (then the last)."""
    free: list[int] = []

    def free_bytes(fd: int) -> int:
        return free.pop(0) if len(free) > 1 else free[0]

    monkeypatch.setattr(logcap, "free_bytes", free_bytes)
    monkeypatch.setattr(logcap, "floor_of", lambda fd, keep_free: keep_free)
    yield free


def test_a_log_pauses_while_its_disk_is_short_and_says_what_it_dropped(
    tmp_path: Path, disk: list[int]
) -> None:
    # plenty, plenty, short (under 1000 free), short, room again (twice the floor), room
    disk[:] = [10_000, 10_000, 900, 1500, 5000, 5000]
    chunks = [bytes([65 + i]) * 100 for i in range(6)]
    expected = (
        b"A" * 100 + b"B" * 100 + logcap.disk_note(1000)
        + logcap.resumed_note(200) + b"E" * 100 + b"F" * 100
    )  # fmt: skip
    assert copy(tmp_path, chunks, limit=1 << 20, keep_free=1000, pause_s=0.05) == expected


def test_the_floor_is_at_most_a_tenth_of_the_disk(tmp_path: Path) -> None:
    fd = os.open(tmp_path, os.O_RDONLY)
    try:
        info = os.fstatvfs(fd)
        tenth = info.f_blocks * info.f_frsize // 10
        assert logcap.floor_of(fd, 1 << 60) == tenth
        assert logcap.floor_of(fd, 4096) == min(4096, tenth)
    finally:
        os.close(fd)
