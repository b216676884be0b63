"""Peak device memory per local batch, for the job report (``JobReport.memory``).

On CUDA the trainer calls :meth:`PeakMemory.after_step` after every optimizer step: the peak
allocated since the previous step (``torch.cuda.max_memory_allocated``, then
``reset_peak_memory_stats``) is kept as the local batch's the step ran, the largest per local
batch.  The scheduler fits ``peak(m) = a + b m`` to these points
(``core.memory.largest_local_batch``) to bound the local batch on every device type.  On CPU
devices nothing is measured (:meth:`PeakMemory.for_device` is ``None``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from pollux_local.api.report import MemoryPoint
from pollux_local.core.devicetypes import gpu_type_name
from pollux_local.torch.sampler import StepPlan

__all__ = ["PeakMemory"]


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

    def after_step(self, plan: StepPlan, rank: int) -> None:
        """An optimizer step ended: its peak is the local batch's when the step had the
        configured size (not the tail of an epoch, nor a statistics step split in halves,
        whose extra gradient copy would blur the line), and the next step starts anew."""
        if plan.full:
            self.measure(max(len(micro.indices[rank]) for micro in plan.micro))
        else:
            self._reset_peak()

    def measure(self, local_batch: int) -> None:
        """Record the peak since the last measurement as ``local_batch``'s, and start anew."""
        self.record(local_batch, self._read_peak())
        self._reset_peak()

    def record(self, local_batch: int, peak_bytes: int) -> None:
        if local_batch >= 1 and peak_bytes >= 0:
            self._peaks[local_batch] = max(int(peak_bytes), self._peaks.get(local_batch, 0))

    def points(self) -> list[MemoryPoint]:
        """The report's points, by local batch."""
        return [
            MemoryPoint(
                device_type=self.device_type,
                local_batch=batch,
                peak_bytes=peak,
                total_bytes=self.total_bytes,
            )
            for batch, peak in sorted(self._peaks.items())
        ]
