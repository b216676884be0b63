"""Giving a chosen pid to a new process (root: ``/proc/sys/kernel/ns_last_pid``), to test that
a process group id given out again is never signalled as the old group's."""

from __future__ import annotations

import subprocess


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
