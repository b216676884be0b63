"""A directory a job's processes are to use as theirs (its checkpoint directory), made and
checked as theirs.

A job's checkpoint directory is chosen by the daemon (``jobs/ID/checkpoint``, or
``[daemon] checkpoint_root``/ID); where the daemon cannot make it (a root others may write to,
a network file system that squashes root), the job's user makes it, and ``mkdir -p`` takes
whatever is already there.  Another user who put something there first (job ids are
sequential and visible) would read the job's checkpoints and hand it theirs to load, code
included.  So the directory, once made, must be the user's: a directory of theirs, or a link
of theirs (where it leads is theirs to choose), in a directory others cannot swap it in (not
writable by others, or sticky).  The check runs as the job's user: the replica's child does
it itself; for SSH nodes the daemon runs this module as the user (``python -m
pollux_local.launch.userdirs PATH UID GID GROUPS``: the user's effective ids, root's real
and saved uid), since root may not see into a file system that squashes it.  Stdlib only: the supervisor imports it.
"""

from __future__ import annotations

import os
import stat
import sys

from pollux_local.launch.identity import IdentityError, become_user_for_setup, user_of_args

__all__ = ["foreign_directory", "make_own_directory"]


def foreign_directory(path: str, uid: int) -> str | None:
    """Why ``path`` is not a directory of user ``uid`` that only they can swap, or ``None``."""
    try:
        entry = os.lstat(path)
    except OSError as exc:
        return f"cannot check {path}: {exc.strerror}"
    if entry.st_uid != uid:
        what = "a link" if stat.S_ISLNK(entry.st_mode) else "it"
        return f"{path}: {what} belongs to uid {entry.st_uid}, not to the job's user (uid {uid})"
    if stat.S_ISLNK(entry.st_mode):
        try:
            entry = os.stat(path)
        except OSError as exc:
            return f"cannot check {path}: {exc.strerror}"
    if not stat.S_ISDIR(entry.st_mode):
        return f"{path} is not a directory"
    parent = os.path.dirname(os.path.abspath(path))
    try:
        above = os.lstat(parent)
    except OSError as exc:
        return f"cannot check {parent}: {exc.strerror}"
    if above.st_mode & 0o022 and not above.st_mode & stat.S_ISVTX and above.st_uid != uid:
        return (
            f"{parent} may be changed by others (writable, not sticky): another user could swap"
            f" {os.path.basename(path)} there; make it sticky (chmod +t)"
        )
    return None


def make_own_directory(path: str) -> str | None:
    """``mkdir -p PATH`` as the caller, then :func:`foreign_directory` for the caller's uid:
    why it cannot be used, or ``None``."""
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        return f"cannot create {path}: {exc.strerror}"
    return foreign_directory(path, os.geteuid())


def main(argv: list[str]) -> int:
    """``python -m pollux_local.launch.userdirs PATH [UID GID GROUP,...]``: 0, or 1 with why
    on stdout.  Given a user, it takes their groups, gid and effective uid alone first
    (``identity.become_user_for_setup``): what it makes and checks is the user's, while root
    stays its real and saved uid, so that the user, whose path it makes, cannot stop it (the
    daemon waits for it under the lock every pass takes: review s61 stopped it 30 s per
    job)."""
    if len(argv) not in (1, 4):
        sys.stdout.write("usage: python -m pollux_local.launch.userdirs PATH [UID GID GROUPS]\n")
        return 2
    if len(argv) == 4:
        try:
            become_user_for_setup(user_of_args(argv[1], argv[2], argv[3]))
        except (ValueError, IdentityError) as exc:
            sys.stdout.write(f"{exc}\n")
            return 1
    problem = make_own_directory(argv[0])
    if problem is not None:
        sys.stdout.write(problem + "\n")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
