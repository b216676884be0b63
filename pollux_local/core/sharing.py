"""Small jobs sharing one device: where a new one goes, and what sharing costs.

Co-located jobs slow each other down.  With n jobs on a device each runs at

    speed(n) = 1 / (1 + beta (n - 1))

of its speed alone (beta: the declared interference, ``[scheduler] share_slowdown``), so the
device does n speed(n) jobs' worth of work and one more job adds
``gain(n) = (n + 1) speed(n + 1) - n speed(n)``, positive while beta < 1.

A new job joins a device only when the memory all its jobs declared fits the device, the
device runs fewer than the admin's cap of jobs (``[devices] max_jobs_per_device``) and sharing
still adds work (gain > 0); among such devices it joins the one where it adds the most (the
fewest jobs), then the one it fills best.  Otherwise it needs a device of its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

#: Jobs that may share one device unless the admin says otherwise: with the default slowdown
#: (0.25) each of 4 still runs at 1 / 1.75 = 0.57 of its speed alone (5 would be at 0.5), and 4
#: CUDA contexts (300-500 MiB each) stay within 2 GiB of a device's memory.
DEFAULT_MAX_JOBS_PER_DEVICE = 4


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
    max_jobs: int = DEFAULT_MAX_JOBS_PER_DEVICE,
) -> SharedDevice | None:
    """The device a job declaring ``memory`` bytes joins: among those running fewer than
    ``max_jobs`` where it fits and adds work, the one where it adds the most (the slowdown
    model), then the one it fills best (least room left); ``None`` when there is none."""
    fits = [
        device
        for device in devices
        if device.jobs < max_jobs
        and device.room() >= memory
        and sharing_gain(device.jobs, slowdown) > 0
    ]
    if not fits:
        return None
    return min(
        fits, key=lambda d: (-sharing_gain(d.jobs, slowdown), d.room() - memory, d.jobs, d.key)
    )


def full_devices(devices: Sequence[SharedDevice], memory: int, max_jobs: int) -> list[SharedDevice]:
    """The devices a job declaring ``memory`` bytes would fit on but for the cap of
    ``max_jobs`` jobs: what its waiting reason names."""
    return [device for device in devices if device.jobs >= max_jobs and device.room() >= memory]
