"""Becoming the job's user, in two steps, in a replica's child before it runs the job's command.

The child sets itself up as the user (its directories, its log, its working directory) and
then runs the command.  Were it the user in every way while it sets up, the user could stop
it there (``kill -STOP -1`` in a loop), and the supervisor, waiting for it to reach the
command, would wait with it, and the daemon with the supervisor.  So while it sets up, only
its *effective* ids are the user's (every file it makes or opens is checked and owned as the
user's), its real and saved user ids stay root's, which no signal of the user's reaches; right
before ``exec`` they become the user's too, and stay so.  Stdlib only: the supervisor and the
log copier import it.
"""

from __future__ import annotations

import os
from typing import Any

__all__ = ["IdentityError", "become_user_for_setup", "settle_ids"]


class IdentityError(Exception):
    """The child could not take the ids it needs (one line)."""


def become_user_for_setup(user: dict[str, Any] | None) -> None:
    """Take the job user's groups, gid and effective uid, keeping root as real and saved uid
    (``user``: ``{"uid", "gid", "groups"}``; nothing without it).  Only :func:`settle_ids`
    may follow before the job's command runs."""
    if not user:
        return
    uid, gid = int(user["uid"]), int(user["gid"])
    try:
        os.setgroups([int(g) for g in user.get("groups") or [gid]])
        os.setresgid(gid, gid, gid)
        if os.geteuid() == 0:
            os.setresuid(0, uid, 0)
        else:
            os.setresuid(uid, uid, uid)
    except OSError as exc:
        raise IdentityError(f"cannot become uid {uid}: {exc.strerror}") from None
    if os.geteuid() != uid:
        raise IdentityError(f"cannot become uid {uid}")


def settle_ids() -> None:
    """Make the real and saved user and group ids the effective ones, for good (what runs
    next is the user's alone, with no way back to root)."""
    euid, egid = os.geteuid(), os.getegid()
    try:
        os.setresgid(egid, egid, egid)
        os.setresuid(euid, euid, euid)
    except OSError as exc:
        raise IdentityError(f"cannot settle as uid {euid}: {exc.strerror}") from None
    if os.getresuid() != (euid, euid, euid) or os.getresgid() != (egid, egid, egid):
        raise IdentityError(f"cannot settle as uid {euid}")
