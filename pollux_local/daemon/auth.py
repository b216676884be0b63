"""Who is asking: identity from the socket's peer credentials, and who may change a job.

The caller's uid comes from ``SO_PEERCRED`` (the kernel's record of the connecting process),
never from a request field.  Everyone may read every job; only its owner, root, the daemon's
own user or a member of the configured admin group may cancel, hold, release or re-prioritise.
"""

from __future__ import annotations

import grp
import os
import pwd
import socket
import struct
from dataclasses import dataclass


@dataclass(frozen=True)
class Peer:
    pid: int
    uid: int
    gid: int

    @property
    def name(self) -> str:
        return user_name(self.uid)


def user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid{uid}"


def peer_credentials(sock: socket.socket) -> Peer:
    """``SO_PEERCRED`` of a connected Unix socket: the client's pid, uid and gid."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", raw)
    return Peer(pid=pid, uid=uid, gid=gid)


def in_group(uid: int, gid: int, group: str) -> bool:
    """Is the user (primary gid ``gid``) a member of ``group``?"""
    try:
        entry = grp.getgrnam(group)
    except KeyError:
        return False
    if entry.gr_gid == gid:
        return True
    name = user_name(uid)
    if name in entry.gr_mem:
        return True
    try:
        return entry.gr_gid in os.getgrouplist(name, gid)
    except (KeyError, OSError):
        return False


def may_modify(peer: Peer, owner_uid: int, admin_group: str | None, daemon_uid: int) -> bool:
    """May ``peer`` cancel, hold, release or re-prioritise a job owned by ``owner_uid``?"""
    if peer.uid in (0, owner_uid, daemon_uid):
        return True
    return admin_group is not None and in_group(peer.uid, peer.gid, admin_group)
