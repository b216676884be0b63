"""Who is asking: identity from the socket's peer credentials, who may connect at all, and who
may change a job or raise a priority.

The caller's uid comes from ``SO_PEERCRED`` (the kernel's record of the connecting process),
never from a request field.

* **Who may connect** (:func:`may_connect`, :func:`socket_mode`): a daemon run by root serves
  every user of the machine (socket 0666); a daemon run by an ordinary user serves only that
  user (socket 0600), unless its config opens it to a group (``[daemon] allow_group``: socket
  0660 with that group, and a peer must be in it).  Root and the daemon's own user may always
  connect.  The socket's mode is what the kernel enforces; the peer check behind it refuses
  anyone else who reaches the socket anyway (a descriptor passed on, a mode changed by hand).
* **Admins** (:func:`is_admin`): root, the daemon's own user and members of the configured
  ``admin_group``.
* **Who owns a job** (:func:`is_owner`): the uid it was submitted under, *still* under the
  account name it was submitted as.  ``userdel`` frees a uid and ``useradd`` gives it to the
  next account made; that account is not the old owner, and inherits nothing (the old
  owner's queued jobs fail as an owner's who is gone: ``launchspec.owner_gone``).
* **Who may change a job** (:func:`may_modify`): its owner or an admin (cancel, hold,
  release, restart, its bounds, time, retries and priority).
* **Who may decide what a job runs, or read what it was given** (:func:`may_act_for`): its
  owner, root and the daemon's own user, who run every job anyway; not the members of the
  admin group, who manage the queue but must not run a command as another user (an edited
  command runs as the job's owner) or read their environment (tokens).  Everyone who may
  connect may read every job's other fields.
"""

from __future__ import annotations

import functools
import grp
import os
import pwd
import socket
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass

#: How long a group-membership answer is reused (NSS lookups may be slow; membership changes
#: are rare and take effect within this time).
GROUP_CACHE_S = 30.0
_group_cache: dict[tuple[int, str], tuple[float, bool]] = {}


@dataclass(frozen=True)
class Peer:
    pid: int
    uid: int
    gid: int

    @functools.cached_property
    def name(self) -> str:
        """The account name of ``uid`` (looked up once: a request may compare it with the
        owners of thousands of jobs)."""
        return user_name(self.uid)


def user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid{uid}"


def account(uid: int) -> pwd.struct_passwd | None:
    """``uid``'s entry in the user database; ``None`` when there is no such user.  NSS answers
    "no such user" also when the lookup could not be made (the daemon out of descriptors):
    that case raises the ``OSError`` of opening a descriptor instead, so that a job is never
    failed as its owner's for the daemon's own trouble."""
    try:
        return pwd.getpwuid(uid)
    except KeyError:
        os.close(os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC))  # EMFILE, ENFILE: not gone
        return None


def account_name(uid: int) -> str | None:
    """The name of ``uid``'s account in the user database, or ``None`` when there is none
    (:func:`account`: ``OSError`` when the database cannot be read).  The lookup
    :func:`owner_gone` makes unless given another (``Context.accounts``: tests fake users)."""
    entry = account(uid)
    return None if entry is None else entry.pw_name


def owner_gone(
    owner_uid: int, owner_name: str, accounts: Callable[[int], str | None] = account_name
) -> str | None:
    """Why the account that submitted a job as ``owner_name`` (uid ``owner_uid``) is no
    longer here, or ``None``: the uid has no account, or another account holds it now
    (``userdel`` freed it and ``useradd`` gave it out again: :func:`is_owner`'s rule).  Raises
    the ``OSError`` of :func:`account` when the user database cannot be read."""
    name = accounts(owner_uid)
    if name is None:
        return f"owner uid {owner_uid} no longer exists"
    if name != owner_name:
        return f"owner {owner_name} is gone: uid {owner_uid} now belongs to {name}"
    return None


def peer_credentials(sock: socket.socket) -> Peer:
    """``SO_PEERCRED`` of a connected Unix socket: the client's pid, uid and gid."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", raw)
    return Peer(pid=pid, uid=uid, gid=gid)


def _lookup_group(uid: int, group: str) -> bool:
    try:
        entry = grp.getgrnam(group)
        user = pwd.getpwuid(uid)
    except KeyError:
        return False
    if entry.gr_gid == user.pw_gid or user.pw_name in entry.gr_mem:
        return True
    try:
        return entry.gr_gid in os.getgrouplist(user.pw_name, user.pw_gid)
    except (KeyError, OSError):
        return False


def in_group(uid: int, group: str) -> bool:
    """Is the user ``uid`` a member of ``group`` in the user and group databases (its primary
    group, or a supplementary one)?  Not by the peer's effective gid: a process that took the
    group as its gid (``sg``, ``newgrp``) before its user was removed from it keeps that gid,
    and would keep the group's rights.  (Answers are cached for :data:`GROUP_CACHE_S`.)"""
    key = (uid, group)
    now = time.monotonic()
    cached = _group_cache.get(key)
    if cached is not None and now - cached[0] < GROUP_CACHE_S:
        return cached[1]
    answer = _lookup_group(uid, group)
    if len(_group_cache) > 4096:
        _group_cache.clear()
    _group_cache[key] = (now, answer)
    return answer


def is_admin(peer: Peer, admin_group: str | None, daemon_uid: int) -> bool:
    """Root, the daemon's own user, or a member of ``admin_group``."""
    if peer.uid in (0, daemon_uid):
        return True
    return admin_group is not None and in_group(peer.uid, admin_group)


def is_owner(peer: Peer, owner_uid: int, owner_name: str) -> bool:
    """Is ``peer`` a job's owner: its uid, and that uid's account still the one named
    ``owner_name`` (a uid freed by ``userdel`` and given to a new account is not)?"""
    return peer.uid == owner_uid and peer.name == owner_name


def may_modify(
    peer: Peer, owner_uid: int, owner_name: str, admin_group: str | None, daemon_uid: int
) -> bool:
    """May ``peer`` cancel, hold, release, restart or re-prioritise a job owned by
    ``owner_uid`` (``owner_name``)?  Its owner or an admin."""
    return is_owner(peer, owner_uid, owner_name) or is_admin(peer, admin_group, daemon_uid)


def may_act_for(peer: Peer, owner_uid: int, owner_name: str, daemon_uid: int) -> bool:
    """May ``peer`` choose the command a job runs as its owner, or read its environment?
    Its owner, root or the daemon's own user; not the admin group."""
    return peer.uid in (0, daemon_uid) or is_owner(peer, owner_uid, owner_name)


def may_connect(peer: Peer, daemon_uid: int, allow_group: str | None) -> bool:
    """May ``peer`` use the daemon at all?  Root and the daemon's user always; with
    ``allow_group`` the members of that group; otherwise everyone when the daemon runs as root
    and nobody else when it runs as an ordinary user."""
    if peer.uid in (0, daemon_uid):
        return True
    if allow_group is not None:
        return in_group(peer.uid, allow_group)
    return daemon_uid == 0


def socket_mode(daemon_uid: int, allow_group: str | None) -> int:
    """The socket's mode: 0660 (with ``allow_group`` as its group) when the config names a
    group, else 0666 for a root daemon (identity from SO_PEERCRED) and 0600 for a user's."""
    if allow_group is not None:
        return 0o660
    return 0o666 if daemon_uid == 0 else 0o600


def refusal(peer: Peer, daemon_uid: int, allow_group: str | None) -> str:
    """The one line a peer that may not connect is told."""
    owner = user_name(daemon_uid)
    if allow_group is not None:
        return (
            f"permission denied: this daemon serves its user {owner} and the group"
            f" {allow_group}; {peer.name} is in neither"
        )
    return (
        f"permission denied: this daemon runs as {owner} and serves only that user"
        f" (its config may open it to a group with [daemon] allow_group)"
    )
