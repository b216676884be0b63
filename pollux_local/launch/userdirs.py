"""A directory a job's processes are to use as theirs (its checkpoint directory), checked as
theirs.

A job's checkpoint directory is chosen by the daemon (``jobs/ID/checkpoint``, or
``[daemon] checkpoint_root``/ID); where the daemon cannot make it (a root others may write to,
a network file system that squashes root), the job's user makes it, and ``mkdir -p`` takes a
directory already there.  Another user who put one there first (job ids are sequential and
visible) would read the job's checkpoints and hand it theirs to load, code included.  So the
directory, once made, must be a directory of the job's user (a link to one of theirs is
theirs to make).  Stdlib only: the supervisor imports it.
"""

from __future__ import annotations

import os
import stat

__all__ = ["foreign_directory"]


def foreign_directory(path: str, uid: int) -> str | None:
    """Why ``path`` is not a directory of user ``uid`` (links followed), or ``None``."""
    try:
        info = os.stat(path)
    except OSError as exc:
        return f"cannot check {path}: {exc.strerror}"
    if not stat.S_ISDIR(info.st_mode):
        return f"{path} is not a directory"
    if info.st_uid != uid:
        return f"{path} belongs to uid {info.st_uid}, not to the job's user (uid {uid})"
    return None
