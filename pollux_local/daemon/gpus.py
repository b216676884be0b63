"""This machine's NVIDIA GPUs, through NVML: the daemon's only use of ``pynvml``.

Three questions, each answered in one NVML session (``nvmlInit`` ... ``nvmlShutdown``):

* :func:`discover`: which GPUs there are (index, name, UUID, memory, device type);
* :func:`processes_outside`: which are kept busy by compute processes the scheduler did not
  start (by the memory those use: an idle CUDA context alone does not make a GPU busy);
* :func:`free_memory`: how much memory one of them has free now.

``pynvml`` is imported when a question is asked (``importlib.import_module``, so a test can put
a fake module in ``sys.modules["pynvml"]``).  Any NVML failure means *no GPU information*:
no library or driver, no GPUs (the daemon falls back to CPU devices); a device NVML cannot
describe is left out (the others keep their indices); a device whose processes cannot be
listed is not counted busy.  Nothing here raises.

Indices are NVML's, which follow the PCI bus order; a replica's ``CUDA_VISIBLE_DEVICES`` names
that index with ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` (``launch/local.py``), so CUDA numbers the
devices the same way.  The device type is :func:`pollux_local.core.devicetypes.gpu_type_name`
of NVML's name and total memory.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from pollux_local.core.devicetypes import gpu_type_name

log = logging.getLogger("pollux_local.daemon")

__all__ = ["GpuInfo", "discover", "free_memory", "processes_outside"]


@dataclass(frozen=True)
class GpuInfo:
    """One GPU as NVML describes it."""

    index: int
    name: str
    uuid: str
    total_bytes: int
    free_bytes: int
    #: the normalised type (``a100-40gb``, ``t4``, ``rtx2080ti`` ...)
    device_type: str

    @property
    def device(self) -> str:
        """The scheduler's name for it: ``cuda:<index>``."""
        return f"cuda:{self.index}"


def _text(value: Any) -> str:
    """NVML strings are ``bytes`` in older ``pynvml`` releases and ``str`` in newer ones."""
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


@contextlib.contextmanager
def _session() -> Iterator[ModuleType | None]:
    """An initialised ``pynvml`` module, or ``None`` when there is no usable NVML."""
    nvml: ModuleType | None
    try:
        nvml = importlib.import_module("pynvml")
        nvml.nvmlInit()
    except Exception as exc:  # ImportError, NVMLError_LibraryNotFound, driver not loaded ...
        log.debug("no NVML: %s", exc)
        nvml = None
    if nvml is None:
        yield None
        return
    try:
        yield nvml
    finally:
        with contextlib.suppress(Exception):
            nvml.nvmlShutdown()


def _count(nvml: ModuleType) -> int:
    try:
        return int(nvml.nvmlDeviceGetCount())
    except Exception as exc:
        log.debug("NVML cannot count devices: %s", exc)
        return 0


def _describe(nvml: ModuleType, index: int) -> GpuInfo:
    handle = nvml.nvmlDeviceGetHandleByIndex(index)
    name = _text(nvml.nvmlDeviceGetName(handle))
    memory = nvml.nvmlDeviceGetMemoryInfo(handle)
    total, free = int(memory.total), int(memory.free)
    return GpuInfo(
        index=index,
        name=name,
        uuid=_text(nvml.nvmlDeviceGetUUID(handle)),
        total_bytes=total,
        free_bytes=free,
        device_type=gpu_type_name(name, total),
    )


def discover() -> list[GpuInfo]:
    """Every GPU NVML can describe, by index (none without NVML)."""
    found: list[GpuInfo] = []
    with _session() as nvml:
        if nvml is None:
            return found
        for index in range(_count(nvml)):
            try:
                found.append(_describe(nvml, index))
            except Exception as exc:  # a lost or inaccessible device: left out
                log.warning("GPU %d left out: NVML cannot describe it (%s)", index, exc)
    return found


#: Memory that processes outside the scheduler must use on a GPU, together, before it counts
#: as busy (``[devices] busy_memory``): an idle CUDA context holds a few hundred MiB, a
#: process that computes there holds more.
DEFAULT_BUSY_BYTES = 1 << 30


def _used_bytes(proc: Any) -> int | None:
    """A process's memory on a GPU, or ``None`` where NVML cannot tell (it then gives
    ``None`` or its 'not available' value)."""
    used = getattr(proc, "usedGpuMemory", None)
    if not isinstance(used, int) or used < 0 or used >= (1 << 63):
        return None
    return used


def processes_outside(
    own_pids: Collection[int], min_bytes: int = DEFAULT_BUSY_BYTES
) -> dict[int, list[int]]:
    """The GPUs (by index) that compute processes not in ``own_pids`` keep busy, with those
    pids: busy when their memory there adds up to at least ``min_bytes`` (a process whose
    memory NVML cannot tell counts as ``min_bytes``: busy, since it may be computing)."""
    own = set(own_pids)
    outside: dict[int, list[int]] = {}
    with _session() as nvml:
        if nvml is None:
            return outside
        for index in range(_count(nvml)):
            try:
                handle = nvml.nvmlDeviceGetHandleByIndex(index)
                procs = [
                    p for p in nvml.nvmlDeviceGetComputeRunningProcesses(handle)
                    if int(p.pid) not in own
                ]  # fmt: skip
            except Exception as exc:  # no information: not counted busy
                log.debug("NVML cannot list the processes of GPU %d: %s", index, exc)
                continue
            used = [_used_bytes(p) for p in procs]
            total = sum(min_bytes if u is None else u for u in used)
            if procs and total >= min_bytes:
                outside[index] = sorted({int(p.pid) for p in procs})
    return outside


def free_memory(index: int) -> int | None:
    """Bytes free on GPU ``index`` now (``None``: no such GPU, or no NVML)."""
    with _session() as nvml:
        if nvml is None:
            return None
        try:
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            return int(nvml.nvmlDeviceGetMemoryInfo(handle).free)
        except Exception as exc:
            log.debug("NVML cannot tell GPU %d's free memory: %s", index, exc)
            return None
