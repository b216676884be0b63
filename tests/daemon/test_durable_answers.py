"""What a request changed is on the disk before the daemon answers it: a real daemon's system
calls, traced (``strace``), show its write-ahead log fsynced after the request's writes and
before the reply is sent.  A power cut after an answer no longer undoes it (an edited command,
then the old one ran; a priority; a drained device, then used again; a paused group)."""

from __future__ import annotations

import re
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from pollux_local.client import Client
from tests.daemon_process import DaemonFactory, DaemonProcess, wait_for

pytestmark = [
    pytest.mark.timeout(180),
    pytest.mark.skipif(shutil.which("strace") is None, reason="needs strace"),
]

#: A function that runs a request under ``strace`` and returns the daemon's system calls.
Trace = Callable[[Callable[[], Any]], list[tuple[str, str]]]

_CALL = re.compile(r"^\d+\s+(?:\S+\s+)?(\w+)\((\d+)<([^>]*)>")


def _calls(text: str) -> list[tuple[str, str]]:
    """(system call, what its descriptor is) per traced line, in order."""
    found = []
    for line in text.splitlines():
        match = _CALL.match(line)
        if match is not None:
            found.append((match.group(1), match.group(3)))
    return found


@pytest.fixture()
def traced(daemon_factory: DaemonFactory, tmp_path: Path) -> Iterator[tuple[DaemonProcess, Trace]]:
    """A daemon (no pass for a minute: nothing of its own writes meanwhile) and a function that
    runs a request under ``strace`` and returns the daemon's system calls of it."""
    daemon = daemon_factory(devices="cpu:2", interval=60)

    def trace(request: Callable[[], Any]) -> list[tuple[str, str]]:
        log = tmp_path / f"strace-{time.monotonic_ns()}.txt"
        tracer = subprocess.Popen(
            ["strace", "-f", "-y", "-e", "trace=fsync,fdatasync,pwrite64,sendto,sendmsg,write",
             "-o", str(log), "-p", str(daemon.pid)],
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        try:
            # strace makes its output file, then attaches to each of the daemon's threads
            wait_for(log.exists, 10, "strace to start")
            time.sleep(1.0)
            request()
            time.sleep(0.3)
        finally:
            tracer.terminate()
            tracer.wait(timeout=10)
        return _calls(log.read_text())

    yield daemon, trace


def _synced_before_answer(calls: list[tuple[str, str]]) -> bool:
    """Whether the last write to the write-ahead log before the first reply on a socket is
    followed by an fsync of it before that reply."""
    reply = next(i for i, (_, fd) in enumerate(calls) if fd.startswith(("socket:", "UNIX")))
    writes = [
        i
        for i, (call, fd) in enumerate(calls[:reply])
        if call == "pwrite64" and fd.endswith("state.db-wal")
    ]
    assert writes, f"the request wrote nothing to the database: {calls}"
    return any(
        call in ("fsync", "fdatasync") and fd.endswith("state.db-wal")
        for call, fd in calls[writes[-1] + 1 : reply]
    )


def test_an_answered_change_is_on_the_disk_before_the_answer(
    traced: tuple[DaemonProcess, Trace],
) -> None:
    daemon, trace = traced
    client = Client.for_state_dir(daemon.state_dir)
    job = client.request("submit", argv=["/bin/true"], workdir="/tmp", hold=True)["id"]
    requests: dict[str, Callable[[], Any]] = {
        "edit of the command": lambda: client.request("edit", id=job, argv=["/bin/false"]),
        "priority": lambda: client.request("set_priority", id=job, priority=3),
        "drain": lambda: client.request("drain", target="cpu:1"),
        "group": lambda: client.request("set_group", name="night", max_running=1),
        "group's pause": lambda: client.request("pause_group", name="night"),
    }
    unsynced = [
        what for what, request in requests.items() if not _synced_before_answer(trace(request))
    ]
    assert not unsynced, f"answered before their change was on the disk: {unsynced}"
    # and they are there after a SIGKILL
    daemon.kill()
    daemon.start()
    shown = client.request("show", id=job)["job"]
    assert shown["argv"] == ["/bin/false"] and shown["priority"] == 3, shown
    assert client.request("nodes")["nodes"][0]["withheld"] == ["cpu:1"]
    [group] = client.request("groups")["groups"]
    assert group["name"] == "night" and group["paused"] and group["max_running"] == 1, group
