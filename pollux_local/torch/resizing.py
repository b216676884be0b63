"""Warm resizes: an elastic job changes its replica count without restarting the replicas
that stay (the launcher's order is ``api.resize.ResizeOrder``).

* rank 0 watches the order file (:class:`ResizeWatch`); with several replicas its newest
  generation rides on the measuring step's all-reduce (``collectives.py``) so that every
  replica acts at the same step, and the order itself is broadcast from rank 0;
* at that step the replicas leave the old process group together; those whose rank is not
  below the new world size exit 0; the others form the new group at the order's address;
* rank 0's checkpoint payload (``stopping.build_payload``) is broadcast to every replica of
  the new group, and every replica loads it as a restarted one would load rank 0's
  checkpoint: the result is the same as a checkpoint-restart at that step;
* a replica started to join (``POLLUX_RESIZE_JOIN``) announces itself ready
  (:func:`announce_ready`) and takes the payload in place of a checkpoint.

Should the new group not form (a joiner that never comes), rank 0 writes the payload it
holds as a checkpoint and the replicas exit with ``ExitCode.RESCALE``: the launcher falls
back to a checkpoint-restart.
"""

from __future__ import annotations

import contextlib
import hmac
import os
import pickle
import re
from typing import Any

import torch
import torch.distributed as dist

from pollux_local.api.errors import PolluxError
from pollux_local.api.launch import LaunchEnvironment, payload_tag
from pollux_local.api.resize import MAX_ORDER_BYTES, ResizeOrder, decode_order, ready_name


class ResizeWatch:
    """The newest order in the order file newer than the generation acted on last."""

    def __init__(self, path: str | None, generation: int = 0) -> None:
        self.path = path
        self.generation = generation
        self._seen: tuple[int, int, int] | None = None
        self._order: ResizeOrder | None = None

    def pending(self) -> ResizeOrder | None:
        """The order waiting to be acted on (``None``: none); a malformed file is ignored."""
        if self.path is None:
            return None
        try:
            info = os.stat(self.path)
        except OSError:
            return None
        key = (info.st_ino, info.st_mtime_ns, info.st_size)
        if key != self._seen:
            self._seen = key
            self._order = _read(self.path)
        order = self._order
        return order if order is not None and order.generation > self.generation else None

    def done(self, generation: int) -> None:
        """Orders up to ``generation`` are acted on."""
        self.generation = max(self.generation, generation)


def _read(path: str) -> ResizeOrder | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        return decode_order(os.read(fd, MAX_ORDER_BYTES + 1))
    except (OSError, PolluxError):
        return None
    finally:
        os.close(fd)


def announce_ready(job_dir: str | None, generation: int, rank: int) -> None:
    """A joiner is about to rendezvous: create its ready file in the job directory (best
    effort), and remove the ready files this rank left at earlier orders."""
    if job_dir is None:
        return
    stale = re.compile(r"resize-ready-(\d+)-" + str(rank))
    with contextlib.suppress(OSError), os.scandir(job_dir) as entries:
        for entry in entries:
            found = stale.fullmatch(entry.name)
            if found is not None and int(found.group(1)) < generation:
                with contextlib.suppress(OSError):
                    os.unlink(entry.path)
    with contextlib.suppress(OSError):
        fd = os.open(
            os.path.join(job_dir, ready_name(generation, rank)),
            os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
            0o644,
        )
        os.close(fd)


#: Bytes of the tag that follows a broadcast payload (``api.launch.payload_tag``).
TAG_BYTES = 32


def broadcast_object(value: Any, env: LaunchEnvironment) -> Any:
    """Rank 0's ``value`` on every replica of the current group (``env``'s; as is with one
    replica): pickled by rank 0 and sent with its tag under the incarnation's secret
    (``api.launch.payload_tag``), which every other replica checks before it unpickles
    anything (:class:`PolluxError` when it does not match).  The group's members proved
    they hold the secret (``env.verify_members``), but its bytes go over connections that
    whoever reached its unauthenticated store may have put themselves in the middle of
    (review s69: another user relayed them, the member tags passed, and rank 1 unpickled
    the code that user wrote into rank 0's broadcast).  A replica without a secret (started
    by hand) checks nothing, as there."""
    if env.world_size <= 1:
        return value
    port, world, secret = int(env.master_port or 0), env.world_size, env.job_secret
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if dist.get_backend() == "nccl"
        else torch.device("cpu")
    )
    sending = dist.get_rank() == 0
    data = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL) if sending else b""
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    dist.broadcast(size, src=0)
    length = int(size.item())
    if length < 0:
        raise PolluxError("rank 0 broadcast a payload of a negative length")
    if sending:
        framed = bytearray(length + TAG_BYTES)  # one copy of the payload, however large
        framed[:length] = data
        framed[length:] = payload_tag(secret, port, world, data) if secret else bytes(TAG_BYTES)
        wire = torch.frombuffer(framed, dtype=torch.uint8).to(device)
    else:
        wire = torch.empty(length + TAG_BYTES, dtype=torch.uint8, device=device)
    dist.broadcast(wire, src=0)
    if sending:
        return value
    raw = memoryview(wire.cpu().numpy().data).cast("B")  # no copy of a large payload
    body, tag = raw[:length], bytes(raw[length:])
    if secret and not hmac.compare_digest(tag, payload_tag(secret, port, world, body)):
        raise PolluxError(
            f"what rank 0 of the process group at {env.master_addr}:{port} broadcast does not"
            " carry the job's secret: something between the replicas changed it; not"
            " unpickled"
        )
    return pickle.loads(body)


__all__ = ["ResizeWatch", "announce_ready", "broadcast_object"]
