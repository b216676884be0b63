"""Processes as tests see them through ``/proc`` (the test bed's namespaces share this
machine's), and giving a chosen pid to a new process (root: ``/proc/sys/kernel/ns_last_pid``),
to test that a process group id given out again is never signalled as the old group's."""

from __future__ import annotations

import subprocess
from pathlib import Path


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (not a zombie)."""
    try:
        data = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return False
    return data[data.rindex(b")") + 2 :].split()[0] != b"Z"


def parent_of(pid: int) -> int:
    """The parent of ``pid`` (on an SSH test node, a replica's parent is its node's agent)."""
    data = Path(f"/proc/{pid}/stat").read_bytes()
    return int(data[data.rindex(b")") + 2 :].split()[1])


def take_pid(pid: int, tries: int = 20) -> subprocess.Popen[bytes] | None:
    """A new session leader (``sleep 60``) whose pid, and so its group's id, is ``pid``;
    ``None`` when other processes took that pid first ``tries`` times.  ``OSError`` where
    the next pid cannot be chosen (a read-only ``/proc/sys``)."""
    for _ in range(tries):
        with open("/proc/sys/kernel/ns_last_pid", "w") as fh:
            fh.write(str(pid - 1))
        candidate = subprocess.Popen(["sleep", "60"], start_new_session=True)
        if candidate.pid == pid:
            return candidate
        candidate.kill()
        candidate.wait()
    return None
