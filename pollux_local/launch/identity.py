"""Becoming the job's user, in two steps, in a replica's child before it runs the job's command.

The child sets itself up as the user (its directories, its log, its working directory) and
then runs the command.  Were it the user in every way while it sets up, the user could stop
it there (``kill -STOP -1`` in a loop), and the supervisor, waiting for it to reach the
command, would wait with it, and the daemon with the supervisor.  So while it sets up, only
its *effective* ids are the user's (every file it makes or opens is checked and owned as the
user's), its real and saved user ids stay root's, which no signal of the user's reaches; right
before ``exec`` they become the user's too, and stay so.

A child of the daemon also possesses the daemon's session keyring (systemd gives a service one
of its own), and with it every key another job of any user put there (a Kerberos
``KEYRING:session`` cache, AFS tokens): a child that becomes a user joins a new, empty session
keyring of that user's once it is theirs in every way (:func:`settle_ids`; until then the
user can neither signal nor trace it).  Stdlib only: the supervisor and the
log copier import it.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
import sys
from collections.abc import Sequence
from typing import Any

__all__ = [
    "IdentityError",
    "as_user_argv",
    "become_user_for_setup",
    "id_args",
    "keyctl_number",
    "leave_shared_keyring",
    "settle_ids",
    "user_of_args",
]

#: ``keyctl(2)``'s system call number, by ``uname -m``.
KEYCTL_NUMBERS = {
    "x86_64": 250,
    "aarch64": 219,
    "riscv64": 219,
    "ppc64le": 271,
    "ppc64": 271,
    "s390x": 280,
    "i686": 288,
    "i386": 288,
    "armv7l": 311,
}
#: ``keyctl(KEYCTL_JOIN_SESSION_KEYRING, NULL)``: join a new anonymous session keyring.
KEYCTL_JOIN_SESSION_KEYRING = 1


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


def keyctl_number() -> int | None:
    """``keyctl(2)``'s system call number on this machine (``None``: not known here)."""
    return KEYCTL_NUMBERS.get(os.uname().machine)


def leave_shared_keyring() -> None:
    """Join a new, empty session keyring, the caller's (called once every id is the user's:
    :func:`settle_ids`): the daemon's, inherited, holds what other jobs put there.  Where there are no keyrings (``ENOSYS``; ``EPERM`` from a filter that refuses
    ``keyctl``, as container runtimes' default one does) there is none to share: nothing to
    do.  A machine whose system call number is not known is left as it is."""
    number = keyctl_number()
    if number is None:
        return
    libc = ctypes.CDLL(None, use_errno=True)
    joined = libc.syscall(
        ctypes.c_long(number), ctypes.c_long(KEYCTL_JOIN_SESSION_KEYRING), ctypes.c_void_p(None)
    )
    if joined == -1:
        code = ctypes.get_errno()
        if code not in (errno.ENOSYS, errno.EPERM):
            raise IdentityError(f"cannot leave the daemon's session keyring: {os.strerror(code)}")


def settle_ids() -> None:
    """Make the real and saved user and group ids the effective ones, for good (what runs
    next is the user's alone, with no way back to root); a process that so leaves root for
    another user also leaves the daemon's session keyring (:func:`leave_shared_keyring`)."""
    euid, egid = os.geteuid(), os.getegid()
    switching = os.getuid() == 0 and euid != 0
    try:
        os.setresgid(egid, egid, egid)
        os.setresuid(euid, euid, euid)
    except OSError as exc:
        raise IdentityError(f"cannot settle as uid {euid}: {exc.strerror}") from None
    if os.getresuid() != (euid, euid, euid) or os.getresgid() != (egid, egid, egid):
        raise IdentityError(f"cannot settle as uid {euid}")
    if switching:
        leave_shared_keyring()


def as_user_argv(uid: int, gid: int, groups: Sequence[int], argv: Sequence[str]) -> list[str]:
    """A command that runs ``argv`` as user ``uid`` (gid ``gid``, supplementary ``groups``),
    started by root: this module's source run with the daemon's interpreter (isolated, no
    site) takes the user's ids (:func:`become_user_for_setup`), settles them, leaving the
    daemon's session keyring (:func:`settle_ids`), then ``exec``s ``argv``.  What the daemon
    runs as a user outside a job (a notification, the removal of a job's directory) so
    holds nothing of the daemon's: started with ``subprocess``'s ``user=`` it kept the
    daemon's keyring, where any code of the user's it ran (or that the user put in it by
    ``ptrace``) read and planted other users' keys (review s62)."""
    return [
        sys.executable,
        "-I",
        "-S",
        "-c",
        _own_source(),
        *id_args(uid, gid, groups),
        "--",
        *argv,
    ]


def id_args(uid: int, gid: int, groups: Sequence[int]) -> list[str]:
    """A user's ids as the helpers that take them read them (``UID GID G1,G2,...``:
    :func:`user_of_args`)."""
    return [str(int(uid)), str(int(gid)), ",".join(str(int(g)) for g in groups)]


def user_of_args(uid: str, gid: str, groups: str) -> dict[str, Any]:
    """:func:`id_args` read back, as :func:`become_user_for_setup` takes a user (no groups:
    the gid alone); ``ValueError`` for what is not whole numbers."""
    members = [int(g) for g in groups.split(",") if g] or [int(gid)]
    return {"uid": int(uid), "gid": int(gid), "groups": members}


@functools.lru_cache(maxsize=1)
def _own_source() -> str:
    """This module's source, read once (:func:`as_user_argv` runs it)."""
    with open(__file__, encoding="utf-8") as fh:
        return fh.read()


def main(args: Sequence[str]) -> int:
    """``UID GID GROUPS -- ARGV...`` (:func:`as_user_argv`): 127 with one line on stderr
    when it cannot."""
    try:
        uid, gid, groups, dashes, *argv = args
        if dashes != "--" or not argv:
            raise ValueError
        become_user_for_setup(user_of_args(uid, gid, groups))
        settle_ids()
        os.execvp(argv[0], argv)
    except ValueError:
        sys.stderr.write("usage: UID GID GROUPS -- ARGV...\n")
    except IdentityError as exc:
        sys.stderr.write(f"{exc}\n")
    except OSError as exc:
        sys.stderr.write(f"cannot run {argv[0]}: {exc.strerror}\n")
    return 127


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
