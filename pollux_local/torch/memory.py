"""Peak device memory per local batch, for the job report (``JobReport.memory``).

On CUDA the allocator's peak (``torch.cuda.max_memory_allocated``, restarted by
``reset_peak_memory_stats``) is read for the steps of one local batch together: the peak over
a run of optimizer steps with the configured size (not the tail of an epoch, nor a statistics
step split in halves) is that local batch's, the largest per local batch is kept.  It is read
every ``READ_EVERY`` such steps, before a step of another size or of another kind, and before
a report; a step of another kind is left out (the peak restarted after it).  Not after every
step: ``max_memory_allocated`` builds, flattens and sorts the allocator's whole table of
statistics in Python, a tenth of a millisecond or more, as long as a small model's whole step
on a fast GPU.  The scheduler fits ``peak(m) = a + b m`` to these points
(``core.memory.largest_local_batch``) to bound the local batch on every device type.  On CPU
devices nothing is measured (:meth:`PeakMemory.for_device` is ``None``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from pollux_local.api.report import MemoryPoint
from pollux_local.core.devicetypes import gpu_type_name
from pollux_local.torch.sampler import StepPlan

__all__ = ["READ_EVERY", "PeakMemory"]

#: Steps of one local batch whose peak is read together (at most).
READ_EVERY = 64


class PeakMemory:
    """The largest peak allocated at each local batch on one device of ``device_type`` with
    ``total_bytes``; ``read_peak`` returns the peak since the last ``reset_peak``."""

    def __init__(
        self,
        device_type: str,
        total_bytes: int,
        read_peak: Callable[[], int],
        reset_peak: Callable[[], None],
    ) -> None:
        self.device_type = device_type
        self.total_bytes = int(total_bytes)
        self._read_peak = read_peak
        self._reset_peak = reset_peak
        self._peaks: dict[int, int] = {}
        #: the local batch of the steps since the peak was last read or restarted (``None``:
        #: none, or only steps left out), and how many they are
        self._unread_batch: int | None = None
        self._unread_steps = 0

    @classmethod
    def for_device(cls, device: torch.device) -> PeakMemory | None:
        """The tracker of a CUDA ``device`` (typed as the daemon types it: NVML's and CUDA's
        names agree); ``None`` for any other device."""
        if device.type != "cuda":
            return None
        props = torch.cuda.get_device_properties(device)
        return cls(
            gpu_type_name(props.name, props.total_memory),
            props.total_memory,
            lambda: int(torch.cuda.max_memory_allocated(device)),
            lambda: torch.cuda.reset_peak_memory_stats(device),
        )

    @staticmethod
    def _counted_batch(plan: StepPlan, rank: int) -> int | None:
        """The local batch a step's peak counts for: its largest micro-batch when the step
        has the configured size; ``None`` for a step left out."""
        return max(len(micro.indices[rank]) for micro in plan.micro) if plan.full else None

    def before_step(self, plan: StepPlan, rank: int) -> None:
        """An optimizer step begins: the unread peak of the steps before it is theirs when
        this one is of another local batch or left out."""
        if self._unread_batch is not None and self._counted_batch(plan, rank) != self._unread_batch:
            self._read()

    def after_step(self, plan: StepPlan, rank: int) -> None:
        """An optimizer step ended: one more step of its local batch (read every
        ``READ_EVERY``), or a step left out, whose peak is dropped."""
        batch = self._counted_batch(plan, rank)
        if batch is None:
            self._reset_peak()
            return
        self._unread_batch = batch
        self._unread_steps += 1
        if self._unread_steps >= READ_EVERY:
            self._read()

    def _read(self) -> None:
        """Record the peak of the unread steps as their local batch's, and start anew."""
        if self._unread_batch is not None:
            self.measure(self._unread_batch)
        self._unread_batch = None
        self._unread_steps = 0

    def measure(self, local_batch: int) -> None:
        """Record the peak since the last measurement as ``local_batch``'s, and start anew."""
        self.record(local_batch, self._read_peak())
        self._reset_peak()

    def record(self, local_batch: int, peak_bytes: int) -> None:
        if local_batch >= 1 and peak_bytes >= 0:
            self._peaks[local_batch] = max(int(peak_bytes), self._peaks.get(local_batch, 0))

    def points(self) -> list[MemoryPoint]:
        """The report's points, by local batch (the unread steps' peak read first)."""
        self._read()
        return [
            MemoryPoint(
                device_type=self.device_type,
                local_batch=batch,
                peak_bytes=peak,
                total_bytes=self.total_bytes,
            )
            for batch, peak in sorted(self._peaks.items())
        ]
