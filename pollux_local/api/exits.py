"""How a job's replicas ended, as data: :class:`ReplicaExit` per rank, and the conversions
between a launcher's raw exit status and the (code, signal) pair the replies carry.

The convention: a process that exited has ``code`` 0-255 and ``signal`` ``None``; a process
killed by signal N has ``code`` ``None`` and ``signal`` N (never the shell's 128+N, which
cannot be told apart from a program's own exit 128+N); both ``None``: its end is not known
(its supervisor was killed before it recorded it).  Only ``pollux-local run`` turns a signal
into the shell's 128+N, as its own exit status (:func:`shell_status`).  One exception: a rank
on an SSH node is reported by the node's agent (``launch/node_agent.py``) with the shell's
128+N already, so there a death by signal N is recorded as code 128+N."""

from __future__ import annotations

from typing import Annotated

import msgspec

#: A process's exit code (0-255).
Code = Annotated[int, msgspec.Meta(ge=0, le=255)]
#: A signal's number.
Signal = Annotated[int, msgspec.Meta(ge=1, le=128)]


class ReplicaExit(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    """How rank ``rank`` (on node ``node``) of a job's latest incarnation ended: its exit
    ``code``, or the ``signal`` that killed it (then ``code`` is ``None``); both ``None`` when
    the end is not known."""

    rank: Annotated[int, msgspec.Meta(ge=0)]
    node: str
    code: Code | None = None
    signal: Signal | None = None


def split_status(raw: int | None) -> tuple[int | None, int | None]:
    """A launcher's raw status (``Popen.returncode``'s form: ``-N`` when killed by signal N)
    as ``(code, signal)``; ``(None, None)`` for ``None`` or a value no process can have."""
    if raw is None:
        return None, None
    if raw < 0:
        return (None, -raw) if -raw <= 128 else (None, None)
    return (raw, None) if raw <= 255 else (None, None)


def shell_status(code: int | None, signal: int | None) -> int | None:
    """The shell's form of an exit: ``code``, or 128+N for signal N (``None``: neither)."""
    if code is not None:
        return code
    if signal is not None:
        return 128 + signal
    return None
