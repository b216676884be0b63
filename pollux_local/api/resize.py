"""A warm resize order: what the launcher tells the running replicas of an elastic job so
that they change their replica count in place (``torch/resizing.py``).

The launcher writes the order as JSON, atomically, to the file named by
``POLLUX_RESIZE_FILE`` (a file of the launcher's, readable by the job: a daemon never writes
into a job's directory); rank 0 reads it at a step agreement and every replica acts on it at
the same step.  The replicas named in ``ranks`` stay and are renumbered (old rank
``ranks[i]`` becomes rank i; without ``ranks``, those below ``kept``, by default
``world_size``, stay and keep their rank); the others leave with exit code 0, and joiners
take the ranks after the stayers (a move: some replicas leave while others join, on other
nodes; rank 0 itself may leave, the lowest rank that stays taking its place).  Joining
replicas are started with the new ``WORLD_SIZE``, ``MASTER_PORT`` and ``POLLUX_RESIZE_JOIN``
= ``generation``, announce themselves ready (:func:`ready_name`: a file they create in their
job directory), and receive the training state by broadcast from the new rank 0.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from pollux_local.api.errors import PolluxError

RESIZE_VERSION = 1
#: Largest order file read (an order is a few hundred bytes).
MAX_ORDER_BYTES = 4096

Positive = Annotated[int, msgspec.Meta(ge=1, le=2**31)]
Rank = Annotated[int, msgspec.Meta(ge=0, le=2**31)]
Port = Annotated[int, msgspec.Meta(ge=1, le=65535)]


class ResizeOrder(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Resize to ``world_size`` replicas, forming the new process group at
    ``master_addr:master_port``; ``generation`` counts the orders of one incarnation (an
    order not newer than the last one acted on is ignored).  ``local_batch`` and
    ``accum_steps`` are the scheduler's (m, s) at the new size (``None``: the job chooses).
    ``kept``: how many of the running replicas stay, the lowest ranks (``None``: those below
    ``world_size``); ``ranks``: the running replicas that stay, by rank, in their new order
    (``None``: as ``kept`` says); ``num_nodes``: the nodes the new group spans (``None``: as
    before)."""

    generation: Positive
    world_size: Positive
    master_addr: str
    master_port: Port
    local_batch: Positive | None = None
    accum_steps: Positive | None = None
    version: int = RESIZE_VERSION
    kept: Positive | None = None
    num_nodes: Positive | None = None
    ranks: tuple[Rank, ...] | None = None

    def new_rank(self, rank: int) -> int | None:
        """The rank in the new group of the running replica of ``rank`` (``None``: it
        leaves)."""
        if self.ranks is not None:
            return self.ranks.index(rank) if rank in self.ranks else None
        return rank if rank < (self.kept if self.kept is not None else self.world_size) else None

    def stays(self, rank: int) -> bool:
        """Whether the running replica of ``rank`` is one of the new group's."""
        return self.new_rank(rank) is not None


def encode_order(order: ResizeOrder) -> bytes:
    """The order's JSON."""
    return msgspec.json.encode(order)


def decode_order(data: bytes) -> ResizeOrder:
    """An order read back; a malformed one is a one-line ``PolluxError``."""
    if len(data) > MAX_ORDER_BYTES:
        raise PolluxError(f"resize order is over {MAX_ORDER_BYTES} bytes")
    try:
        order = msgspec.json.decode(data, type=ResizeOrder)
    except msgspec.ValidationError as exc:
        raise PolluxError(f"bad resize order: {exc}") from None
    except msgspec.DecodeError:
        raise PolluxError("bad resize order: not JSON") from None
    if order.version != RESIZE_VERSION:
        raise PolluxError(f"resize order version {order.version} is not {RESIZE_VERSION}")
    if order.kept is not None and order.kept > order.world_size:
        raise PolluxError(f"bad resize order: keeps {order.kept} of {order.world_size} replicas")
    if order.ranks is not None:
        if not order.ranks or len(order.ranks) > order.world_size:
            raise PolluxError(
                f"bad resize order: keeps {len(order.ranks)} of {order.world_size} replicas"
            )
        if len(set(order.ranks)) != len(order.ranks):
            raise PolluxError("bad resize order: a rank kept twice")
        if order.kept is not None and order.kept != len(order.ranks):
            raise PolluxError("bad resize order: kept and ranks disagree")
    return order


def ready_name(generation: int, rank: int) -> str:
    """The file a joining replica of ``generation`` creates in its job directory once it is
    about to rendezvous."""
    return f"resize-ready-{generation}-{rank}"
