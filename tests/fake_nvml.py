"""A fake NVML: the part of ``pynvml``'s API pollux-local uses, over a described box of GPUs.

No machine of the test suite has a GPU, so the NVML code runs against this instead::

    box = FakeBox.mixed()                     # 2x A100-SXM4-40GB + 4x T4, pid 4242 on GPU 3
    sys.modules["pynvml"] = fake_module(box)  # what the ``fake_pynvml`` fixture does

The module has ``nvmlInit``, ``nvmlShutdown``, ``nvmlDeviceGetCount``,
``nvmlDeviceGetHandleByIndex``, ``nvmlDeviceGetName`` (``bytes`` as older pynvml releases
return, or ``str``), ``nvmlDeviceGetMemoryInfo`` (``.total``/``.free``/``.used``),
``nvmlDeviceGetUUID``, ``nvmlDeviceGetComputeRunningProcesses`` (objects with ``.pid`` and
``.usedGpuMemory``) and ``NVMLError``, and it behaves as NVML does where it matters: a call
before ``nvmlInit`` (or after the last ``nvmlShutdown``) fails with ``Uninitialized``, an
index out of range with ``InvalidArgument``, a lost GPU with ``GpuIsLost``, and a box
without a driver fails ``nvmlInit`` with ``LibraryNotFound``.  ``box.calls`` counts inits and
shutdowns, so a test can check every session is closed.

A real daemon process sees the same box through ``tests/fake_pynvml/pynvml.py``: put that
directory first on its ``PYTHONPATH`` and the box's JSON file (:meth:`FakeBox.write`) in
``$POLLUX_FAKE_NVML``; the file is read again at every ``nvmlInit``, so a test can start an
"outside" process on a GPU while the daemon runs.
"""

from __future__ import annotations

import json
import types
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

GIB = 2**30
MIB = 2**20
#: Totals NVML reports for these cards (MiB), as on real machines.
A100_40GB = ("NVIDIA A100-SXM4-40GB", 40960 * MIB)
T4 = ("Tesla T4", 15360 * MIB)
#: The environment variable naming the box file a daemon's fake ``pynvml`` reads.
BOX_VARIABLE = "POLLUX_FAKE_NVML"
#: The directory to put first on a daemon's ``PYTHONPATH``.
SHIM_DIR = Path(__file__).resolve().parent / "fake_pynvml"

NVML_ERROR_UNINITIALIZED = 1
NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_ERROR_GPU_IS_LOST = 15
ERROR_NAMES = {
    NVML_ERROR_UNINITIALIZED: "Uninitialized",
    NVML_ERROR_INVALID_ARGUMENT: "Invalid Argument",
    NVML_ERROR_LIBRARY_NOT_FOUND: "NVML Shared Library Not Found",
    NVML_ERROR_GPU_IS_LOST: "GPU is lost",
}


class NVMLError(Exception):
    """pynvml's error: ``value`` is NVML's return code."""

    def __init__(self, value: int) -> None:
        super().__init__(ERROR_NAMES.get(value, f"NVML error {value}"))
        self.value = value


@dataclass
class FakeProcess:
    pid: int
    #: ``None``: NVML cannot tell (pynvml gives ``None`` for its 'not available' value)
    used_bytes: int | None


@dataclass
class FakeGpu:
    name: str
    total_bytes: int
    uuid: str = ""
    processes: list[FakeProcess] = field(default_factory=list)
    #: NVML cannot reach it (``GpuIsLost`` from every call on its handle)
    lost: bool = False

    @property
    def used_bytes(self) -> int:
        return sum(proc.used_bytes or 0 for proc in self.processes)


@dataclass
class FakeBox:
    """The GPUs of one machine, by NVML index, and how its NVML misbehaves."""

    gpus: list[FakeGpu]
    #: no driver: ``nvmlInit`` fails with ``LibraryNotFound``
    no_driver: bool = False
    #: names and UUIDs as ``bytes`` (pynvml before 11.5) instead of ``str``
    bytes_strings: bool = False
    calls: Counter[str] = field(default_factory=Counter, compare=False)

    def __post_init__(self) -> None:
        for index, gpu in enumerate(self.gpus):
            if not gpu.uuid:
                gpu.uuid = f"GPU-{index:08x}-fake-0000-0000-{index:012x}"

    @classmethod
    def of(cls, *cards: tuple[str, int], **options: Any) -> FakeBox:
        """A box of ``cards`` (name, total bytes), in NVML's index order."""
        return cls([FakeGpu(name, total) for name, total in cards], **options)

    @classmethod
    def mixed(cls, outside_pid: int = 4242) -> FakeBox:
        """2x A100-SXM4-40GB (GPUs 0, 1) + 4x T4 (GPUs 2-5), a process outside the scheduler
        (``outside_pid``, 2 GiB) on GPU 3."""
        box = cls.of(A100_40GB, A100_40GB, T4, T4, T4, T4)
        box.gpus[3].processes.append(FakeProcess(outside_pid, 2 * GIB))
        return box

    def to_json(self) -> str:
        data = asdict(self)
        data.pop("calls")
        return json.dumps(data)

    @classmethod
    def from_json(cls, text: str) -> FakeBox:
        data = json.loads(text)
        gpus = [
            FakeGpu(**{**gpu, "processes": [FakeProcess(**p) for p in gpu.get("processes", [])]})
            for gpu in data.pop("gpus")
        ]
        return cls(gpus, **data)

    def write(self, path: Path) -> Path:
        """Write the box where a daemon's fake ``pynvml`` reads it (atomically)."""
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(self.to_json())
        tmp.replace(path)
        return path


@dataclass(frozen=True)
class _Handle:
    index: int


@dataclass(frozen=True)
class _Memory:
    total: int
    free: int
    used: int


@dataclass(frozen=True)
class _Process:
    pid: int
    usedGpuMemory: int | None  # noqa: N815 - pynvml's name


def fake_module(box: FakeBox | None = None, load: Any = None) -> types.ModuleType:
    """A ``pynvml`` module over ``box`` (or over ``load()``, called at every ``nvmlInit``)."""
    module = types.ModuleType("pynvml")
    state: dict[str, Any] = {"box": box, "depth": 0}

    def current() -> FakeBox:
        if state["depth"] <= 0:
            raise NVMLError(NVML_ERROR_UNINITIALIZED)
        found: FakeBox = state["box"]
        return found

    def gpu(handle: _Handle) -> FakeGpu:
        if not isinstance(handle, _Handle):
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        found = current().gpus[handle.index]
        if found.lost:
            raise NVMLError(NVML_ERROR_GPU_IS_LOST)
        return found

    def text(value: str) -> str | bytes:
        return value.encode() if current().bytes_strings else value

    def nvmlInit() -> None:
        if load is not None:
            state["box"] = load()
        box_now: FakeBox = state["box"]
        box_now.calls["init"] += 1
        if box_now.no_driver:
            raise NVMLError(NVML_ERROR_LIBRARY_NOT_FOUND)
        state["depth"] += 1

    def nvmlShutdown() -> None:
        current().calls["shutdown"] += 1
        state["depth"] -= 1

    def nvmlDeviceGetCount() -> int:
        return len(current().gpus)

    def nvmlDeviceGetHandleByIndex(index: int) -> _Handle:
        if not 0 <= index < len(current().gpus):
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        return _Handle(index)

    def nvmlDeviceGetName(handle: _Handle) -> str | bytes:
        return text(gpu(handle).name)

    def nvmlDeviceGetUUID(handle: _Handle) -> str | bytes:
        return text(gpu(handle).uuid)

    def nvmlDeviceGetMemoryInfo(handle: _Handle) -> _Memory:
        card = gpu(handle)
        used = min(card.used_bytes, card.total_bytes)
        return _Memory(total=card.total_bytes, free=card.total_bytes - used, used=used)

    def nvmlDeviceGetComputeRunningProcesses(handle: _Handle) -> list[_Process]:
        return [_Process(proc.pid, proc.used_bytes) for proc in gpu(handle).processes]

    functions = (
        nvmlInit,
        nvmlShutdown,
        nvmlDeviceGetCount,
        nvmlDeviceGetHandleByIndex,
        nvmlDeviceGetName,
        nvmlDeviceGetUUID,
        nvmlDeviceGetMemoryInfo,
        nvmlDeviceGetComputeRunningProcesses,
    )
    for function in functions:
        setattr(module, function.__name__, function)
    module.NVMLError = NVMLError  # type: ignore[attr-defined]
    module.NVML_ERROR_UNINITIALIZED = NVML_ERROR_UNINITIALIZED  # type: ignore[attr-defined]
    module.NVML_ERROR_INVALID_ARGUMENT = NVML_ERROR_INVALID_ARGUMENT  # type: ignore[attr-defined]
    module.NVML_ERROR_LIBRARY_NOT_FOUND = NVML_ERROR_LIBRARY_NOT_FOUND  # type: ignore[attr-defined]
    module.NVML_ERROR_GPU_IS_LOST = NVML_ERROR_GPU_IS_LOST  # type: ignore[attr-defined]
    return module
