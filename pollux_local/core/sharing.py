"""Small jobs sharing one device: where a new one goes, and what sharing costs.

Co-located jobs slow each other down.  With n jobs on a device each runs at

    speed(n) = 1 / (1 + beta (n - 1))

of its speed alone (beta: the declared interference, ``[scheduler] share_slowdown``), so the
device does n speed(n) jobs' worth of work.  A new job joins a device only when that adds at
least ``min_gain`` of a job's worth (``gain(n) = (n + 1) speed(n + 1) - n speed(n)``) and when
the memory all its jobs declared fits the device; otherwise it needs a device of its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

#: The least work (in jobs' worth) a job joining a shared device must add.
MIN_SHARE_GAIN = 0.5


def shared_speed(count: int, slowdown: float) -> float:
    """speed(n) = 1 / (1 + beta (n - 1)): each job's speed with ``count`` on one device."""
    return 1.0 / (1.0 + slowdown * max(count - 1, 0))


def sharing_gain(count: int, slowdown: float) -> float:
    """gain(n) = (n + 1) speed(n + 1) - n speed(n): the work one more job adds to a device
    that runs ``count``."""
    return (count + 1) * shared_speed(count + 1, slowdown) - count * shared_speed(count, slowdown)


@dataclass(frozen=True)
class SharedDevice:
    """A device running shared jobs: its key, its jobs' count and declared memory, and the
    memory it has (``free``: what the device reports free now, when it reports it)."""

    key: tuple[str, str]
    jobs: int
    used: int
    total: int
    free: int | None = None

    def room(self) -> int:
        """Bytes a new job may declare: total - declared, and at most the reported free."""
        room = self.total - self.used
        return room if self.free is None else min(room, self.free)


def choose_shared_device(
    devices: Sequence[SharedDevice],
    memory: int,
    slowdown: float,
    min_gain: float = MIN_SHARE_GAIN,
) -> SharedDevice | None:
    """The device a job declaring ``memory`` bytes joins: among those where it fits and adds
    at least ``min_gain``, the one it fills best (least room left, then fewest jobs); ``None``
    when there is none."""
    fits = [
        device
        for device in devices
        if device.room() >= memory and sharing_gain(device.jobs, slowdown) >= min_gain
    ]
    if not fits:
        return None
    return min(fits, key=lambda d: (d.room() - memory, d.jobs, d.key))
