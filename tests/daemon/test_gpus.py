"""The GPU path without a GPU: NVML discovery, device types, memory, processes outside the
scheduler, ``CUDA_VISIBLE_DEVICES`` per replica and peak-memory batch limits, against the fake
NVML of ``tests/fake_nvml.py`` (a mixed box: 2x A100-40GB + 4x T4, an outside process on
GPU 3), in this process and in a real daemon."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from pollux_local import api
from pollux_local.api.report import JobReport, MemoryPoint
from pollux_local.core.devicetypes import gpu_type_name, marketed_gb
from pollux_local.core.memory import fit_peak_memory, largest_local_batch
from pollux_local.daemon import config, gpus
from pollux_local.daemon.loop import node_snapshot
from pollux_local.daemon.reports import parse_report
from pollux_local.errors import PolluxError
from pollux_local.launch.base import LaunchSpec, ReplicaSlot
from pollux_local.launch.local import replica_env
from tests.daemon_process import REPO_ROOT, DaemonProcess, wait_for
from tests.fake_nvml import (
    A100_40GB,
    BOX_VARIABLE,
    GIB,
    MIB,
    SHIM_DIR,
    T4,
    FakeBox,
    FakeProcess,
    fake_module,
)

HOST = socket.gethostname() or "localhost"


@pytest.fixture()
def box(monkeypatch: pytest.MonkeyPatch) -> FakeBox:
    """The mixed box, installed as ``pynvml``."""
    described = FakeBox.mixed()
    monkeypatch.setitem(sys.modules, "pynvml", fake_module(described))
    return described


def install(monkeypatch: pytest.MonkeyPatch, described: FakeBox) -> FakeBox:
    monkeypatch.setitem(sys.modules, "pynvml", fake_module(described))
    return described


# --- names and types ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "total_gib", "expected"),
    [
        ("NVIDIA A100-SXM4-40GB", 40, "a100-40gb"),
        ("NVIDIA A100-PCIE-40GB", 40, "a100-40gb"),
        ("NVIDIA A100 80GB PCIe", 80, "a100-80gb"),
        ("NVIDIA H100 80GB HBM3", 79.6, "h100-80gb"),
        ("NVIDIA H100 PCIe", 79.6, "h100-80gb"),  # the size comes from the memory
        ("Tesla V100-SXM2-16GB", 15.8, "v100-16gb"),
        ("Tesla V100-PCIE-32GB", 31.7, "v100-32gb"),
        ("Tesla T4", 15, "t4"),
        ("Quadro RTX 6000", 24, "rtx6000"),
        ("NVIDIA GeForce RTX 2080 Ti", 10.8, "rtx2080ti"),
        ("NVIDIA GeForce RTX 3090", 24, "rtx3090"),
        ("NVIDIA RTX A6000", 48, "rtxa6000"),
        ("NVIDIA", 8, "gpu"),
    ],
)
def test_nvml_names_become_short_types(name: str, total_gib: float, expected: str) -> None:
    assert gpu_type_name(name, int(total_gib * GIB)) == expected


def test_measured_totals_round_to_the_marketed_size() -> None:
    assert [marketed_gb(int(g * GIB)) for g in (15, 15.8, 39.4, 79.6, 10.8)] == [16, 16, 40, 80, 11]


# --- discovery ----------------------------------------------------------------------------------


def test_discovery_describes_every_gpu_and_closes_its_sessions(box: FakeBox) -> None:
    found = gpus.discover()
    assert [g.index for g in found] == [0, 1, 2, 3, 4, 5]
    assert [g.device_type for g in found] == ["a100-40gb"] * 2 + ["t4"] * 4
    assert [g.name for g in found] == [A100_40GB[0]] * 2 + [T4[0]] * 4
    assert found[0].total_bytes == 40960 * MIB and found[2].total_bytes == 15360 * MIB
    assert found[3].free_bytes == 15360 * MIB - 2 * GIB  # the outside process's 2 GiB
    assert found[2].free_bytes == found[2].total_bytes
    assert len({g.uuid for g in found}) == 6 and all(g.uuid.startswith("GPU-") for g in found)
    assert config.discover_gpus() == [f"cuda:{i}" for i in range(6)]
    assert box.calls["init"] == box.calls["shutdown"] == 2


def test_names_given_as_bytes_by_older_pynvml_are_read_alike(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    install(monkeypatch, FakeBox.of(A100_40GB, T4, bytes_strings=True))
    found = gpus.discover()
    assert [(g.name, g.device_type) for g in found] == [(A100_40GB[0], "a100-40gb"), (T4[0], "t4")]
    assert isinstance(found[0].uuid, str) and found[0].uuid.startswith("GPU-")


def test_processes_outside_the_scheduler_make_their_gpu_busy(box: FakeBox) -> None:
    assert gpus.processes_outside(set()) == {3: [4242]}
    assert config.busy_gpus(set()) == {"cuda:3"}
    assert gpus.processes_outside({4242}) == {}  # the scheduler's own process: not busy
    box.gpus[0].processes += [FakeProcess(7, GIB), FakeProcess(8, GIB)]
    assert gpus.processes_outside({8}) == {0: [7], 3: [4242]}
    assert box.calls["init"] == box.calls["shutdown"]


def test_an_idle_cuda_context_alone_does_not_make_a_gpu_busy(box: FakeBox) -> None:
    # any process that merely initialised CUDA there (a notebook, a monitoring tool) holds a
    # few hundred MiB: below [devices] busy_memory (1 GiB) the GPU stays the scheduler's
    box.gpus[0].processes.append(FakeProcess(9, 300 * MIB))
    assert gpus.processes_outside(set()) == {3: [4242]}
    assert config.busy_gpus(set()) == {"cuda:3"}
    # two small ones that add up to the threshold do make it busy; so does a lower threshold
    box.gpus[0].processes.append(FakeProcess(10, GIB - 300 * MIB))
    assert gpus.processes_outside(set()) == {0: [9, 10], 3: [4242]}
    assert config.busy_gpus({10}, min_bytes=256 * MIB) == {"cuda:0", "cuda:3"}
    assert config.busy_gpus({10}) == {"cuda:3"}


def test_a_process_whose_memory_nvml_cannot_tell_makes_its_gpu_busy(box: FakeBox) -> None:
    box.gpus[1].processes.append(FakeProcess(11, None))
    assert gpus.processes_outside(set()) == {1: [11], 3: [4242]}


def test_busy_memory_is_read_from_the_config(tmp_path: Path) -> None:
    path = tmp_path / "config.toml"
    path.write_text('[devices]\nbusy_memory = "512M"\n')
    assert config.load_config(path, devices="cpu:1").busy_memory == 512 * MIB
    assert config.load_config(None, devices="cpu:1").busy_memory == GIB
    path.write_text('[devices]\nbusy_memory = "lots"\n')
    with pytest.raises(PolluxError, match=r"\[devices\] busy_memory: not a size"):
        config.load_config(path, devices="cpu:1")


def test_free_memory_of_one_gpu(box: FakeBox) -> None:
    assert gpus.free_memory(3) == 15360 * MIB - 2 * GIB
    assert gpus.free_memory(0) == 40960 * MIB
    assert gpus.free_memory(6) is None  # no such GPU


def test_busy_gpus_are_withheld_from_the_scheduler_on_their_node_only(box: FakeBox) -> None:
    nodes = config.local_nodes()
    executor = types.SimpleNamespace(groups={}, nodes=types.SimpleNamespace(is_up=lambda _: True))
    snapshot = {
        node.name: node
        for node in node_snapshot(config.DaemonConfig(nodes=nodes), executor)  # type: ignore[arg-type]
    }
    assert snapshot[f"{HOST}-t4"].busy == {"cuda:3"}
    assert snapshot[f"{HOST}-t4"].free_devices == ("cuda:2", "cuda:4", "cuda:5")
    assert snapshot[HOST].busy == frozenset()
    assert snapshot[HOST].free_devices == ("cuda:0", "cuda:1")


# --- no NVML: no GPUs, CPU devices --------------------------------------------------------------


def _broken_count() -> int:
    raise RuntimeError("NVML Driver/library version mismatch")


@pytest.mark.parametrize("failure", ["missing", "no driver", "count fails"])
def test_without_a_working_nvml_there_are_no_gpus_and_cpu_devices(
    monkeypatch: pytest.MonkeyPatch, failure: str
) -> None:
    if failure == "missing":
        monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml: ImportError
    elif failure == "no driver":
        install(monkeypatch, FakeBox.mixed()).no_driver = True
    else:
        module = fake_module(FakeBox.mixed())
        module.nvmlDeviceGetCount = _broken_count  # type: ignore[attr-defined]
        monkeypatch.setitem(sys.modules, "pynvml", module)
    assert gpus.discover() == []
    assert gpus.processes_outside(set()) == {}
    if failure != "count fails":  # a device's own questions need no count
        assert gpus.free_memory(0) is None
    (node,) = config.local_nodes()
    assert node.devices == ("cpu:0", "cpu:1") and node.device_type == "cpu"


def test_a_lost_gpu_is_left_out_and_the_others_keep_their_indices(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    described = install(monkeypatch, FakeBox.mixed())
    described.gpus[1].lost = True
    assert [g.index for g in gpus.discover()] == [0, 2, 3, 4, 5]
    assert gpus.processes_outside(set()) == {3: [4242]}
    assert [n.devices for n in config.local_nodes()] == [
        ("cuda:0",),
        ("cuda:2", "cuda:3", "cuda:4", "cuda:5"),
    ]


# --- a box's nodes: one per type ----------------------------------------------------------------


def test_a_mixed_box_is_one_node_per_gpu_type(box: FakeBox) -> None:
    a100, t4 = config.local_nodes()
    assert (a100.name, a100.devices, a100.device_type) == (HOST, ("cuda:0", "cuda:1"), "a100-40gb")
    assert (t4.name, t4.devices, t4.device_type) == (
        f"{HOST}-t4",
        ("cuda:2", "cuda:3", "cuda:4", "cuda:5"),
        "t4",
    )
    assert a100.is_local and t4.is_local
    assert (a100.device_memory, t4.device_memory) == (40960 * MIB, 15360 * MIB)
    # a device of this machine names the node that has it
    assert config.resolve_target("cuda:3", (a100, t4)) == f"{HOST}-t4:cuda:3"
    assert config.resolve_target("cuda:1", (a100, t4)) == f"{HOST}:cuda:1"


def test_a_box_of_one_type_stays_one_node_of_that_type(monkeypatch: pytest.MonkeyPatch) -> None:
    install(monkeypatch, FakeBox.of(T4, T4))
    (node,) = config.local_nodes()
    assert (node.name, node.devices, node.device_type) == (HOST, ("cuda:0", "cuda:1"), "t4")
    (chosen,) = config.local_nodes("cuda:1")
    assert chosen.devices == ("cuda:1",) and chosen.device_type == "t4"
    (cpu,) = config.local_nodes("cpu:3")
    assert cpu.device_type == "cpu" and cpu.device_memory is None


def test_config_file_nodes_are_split_unless_their_type_is_declared(
    box: FakeBox, tmp_path: Path
) -> None:
    path = tmp_path / "config.toml"
    path.write_text('[nodes.box]\n\n[devices]\nreserved = ["cuda:4"]\n')
    loaded = config.load_config(path)
    assert [(n.name, n.devices, n.device_type) for n in loaded.nodes] == [
        ("box", ("cuda:0", "cuda:1"), "a100-40gb"),
        ("box-t4", ("cuda:2", "cuda:3", "cuda:4", "cuda:5"), "t4"),
    ]
    assert loaded.reserved == ("box-t4:cuda:4",)
    path.write_text('[nodes.box]\ndevices = "cuda:1,2"\n')
    assert [(n.name, n.devices) for n in config.load_config(path).nodes] == [
        ("box", ("cuda:1",)),
        ("box-t4", ("cuda:2",)),
    ]
    path.write_text('[nodes.box]\ntype = "mixed"\nmemory = "16G"\n')
    (declared,) = config.load_config(path).nodes
    assert declared.devices == tuple(f"cuda:{i}" for i in range(6))
    assert (declared.device_type, declared.device_memory) == ("mixed", 16 * GIB)


# --- CUDA_VISIBLE_DEVICES ---------------------------------------------------------------------


def test_each_replica_sees_its_own_physical_gpu(tmp_path: Path) -> None:
    slots = [
        ReplicaSlot(rank=0, node=f"{HOST}-t4", device="cuda:2", local_rank=0, node_rank=0),
        ReplicaSlot(rank=1, node=f"{HOST}-t4", device="cuda:5", local_rank=1, node_rank=0),
    ]
    spec = LaunchSpec(
        job_id="7",
        argv=["true"],
        workdir=tmp_path,
        env={"CUDA_VISIBLE_DEVICES": "0,1", "CUDA_DEVICE_ORDER": "FASTEST_FIRST"},
        slots=slots,
        log_dir=tmp_path,
    )
    envs = [replica_env(spec, slot) for slot in slots]
    assert [env["CUDA_VISIBLE_DEVICES"] for env in envs] == ["2", "5"]
    assert {env["CUDA_DEVICE_ORDER"] for env in envs} == {"PCI_BUS_ID"}  # NVML's numbering
    cpu = dataclass_replace_slot(slots[0], "cpu:0")
    env = replica_env(LaunchSpec("8", ["true"], tmp_path, {}, [cpu], tmp_path), cpu)
    assert "CUDA_VISIBLE_DEVICES" not in env and "CUDA_DEVICE_ORDER" not in env


def dataclass_replace_slot(slot: ReplicaSlot, device: str) -> ReplicaSlot:
    return ReplicaSlot(slot.rank, slot.node, device, slot.local_rank, slot.node_rank)


# --- a real daemon on the fake box ----------------------------------------------------------


class FakeGpuDaemon(DaemonProcess):
    """A real daemon whose ``import pynvml`` finds ``tests/fake_pynvml`` (the box in
    ``box_file``): the shim's directory comes first on its ``PYTHONPATH``."""

    def __init__(self, state_dir: Path, box_file: Path, *extra_args: str) -> None:
        super().__init__(state_dir, *extra_args)
        self.box_file = box_file

    def start(self, timeout_s: float = 30.0) -> DaemonProcess:
        env = {
            **os.environ,
            "PYTHONPATH": f"{SHIM_DIR}{os.pathsep}{REPO_ROOT}",
            BOX_VARIABLE: str(self.box_file),
            "OMP_NUM_THREADS": "1",
        }
        log = open(self.state_dir.parent / f"{self.state_dir.name}.out", "ab")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pollux_local", "daemon", "--state-dir", str(self.state_dir),
             *self.extra_args],
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
            start_new_session=True,
        )  # fmt: skip
        wait_for(self._answers, timeout_s, f"the daemon to answer: {self.output()}")
        return self

    def _answers(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise RuntimeError(f"daemon exited with {self.proc.returncode}: {self.output()}")
        try:
            self.client.request("ping")
        except PolluxError:
            return False
        return True


@pytest.fixture(scope="module")
def gpu_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FakeGpuDaemon]:
    root = tmp_path_factory.mktemp("fakegpu")
    box = FakeBox.mixed()
    box.gpus[0].processes.append(FakeProcess(4343, 300 * MIB))  # an idle CUDA context
    box_file = box.write(root / "box.json")
    config_file = root / "config.toml"
    config_file.write_text(
        '[scheduler]\npolicy = "fifo"\ninterval_s = 0.3\n\n[daemon]\nstop_grace_s = 2\n'
        "max_retries = 0\n"
    )
    daemon = FakeGpuDaemon(root / "state", box_file, "--config", str(config_file))
    daemon.start()
    try:
        yield daemon
    finally:
        daemon.stop()


def pollux(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pollux_local", *args],
        capture_output=True, text=True, timeout=60,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
    )  # fmt: skip


def test_a_real_daemon_shows_the_mixed_box_as_typed_nodes(gpu_daemon: FakeGpuDaemon) -> None:
    done = pollux("nodes", "--json", "--state-dir", str(gpu_daemon.state_dir))
    assert done.returncode == 0, done.stderr
    rows = {row["name"]: row for row in json.loads(done.stdout)["nodes"]}
    assert set(rows) == {HOST, f"{HOST}-t4"}
    assert rows[HOST]["device_type"] == "a100-40gb"
    # the idle context on cuda:0 (300 MiB, below [devices] busy_memory) leaves it free
    assert rows[HOST]["devices"] == ["cuda:0", "cuda:1"] and rows[HOST]["busy"] == []
    assert rows[f"{HOST}-t4"]["device_type"] == "t4"
    assert rows[f"{HOST}-t4"]["devices"] == ["cuda:2", "cuda:3", "cuda:4", "cuda:5"]
    assert rows[f"{HOST}-t4"]["busy"] == ["cuda:3"]  # the outside process
    assert all(row["local"] for row in rows.values())


def _run_job(daemon: FakeGpuDaemon, workdir: Path, gpus_wanted: int, device_type: str) -> str:
    script = workdir / "show.sh"
    script.write_text(
        '#!/bin/sh\necho "$CUDA_VISIBLE_DEVICES $CUDA_DEVICE_ORDER $POLLUX_DEVICE"'
        ' > "out-$RANK.txt"\n'
    )
    script.chmod(0o755)
    reply = daemon.client.call(
        api.Submit(
            argv=[str(script)],
            workdir=str(workdir),
            min_gpus=gpus_wanted,
            constraint=api.Constraint(device_type=device_type),
        )
    )

    def ended() -> api.JobDetail | None:
        job = daemon.client.call(api.Show(id=reply.id)).job
        return job if job.state.value in ("succeeded", "failed", "cancelled") else None

    job = wait_for(ended, 60, f"job {reply.id} to end")
    assert job.state.value == "succeeded", (job.reason, daemon.output())
    return reply.id


def test_a_job_on_the_fake_a100s_gets_their_physical_indices(
    gpu_daemon: FakeGpuDaemon, tmp_path: Path
) -> None:
    _run_job(gpu_daemon, tmp_path, 2, "a100-40gb")
    seen = sorted((tmp_path / f"out-{rank}.txt").read_text().split()[0] for rank in (0, 1))
    assert seen == ["0", "1"]
    assert (tmp_path / "out-0.txt").read_text().split()[1:] == ["PCI_BUS_ID", "cuda"]


def test_a_job_on_the_t4s_never_gets_the_busy_one(
    gpu_daemon: FakeGpuDaemon, tmp_path: Path
) -> None:
    _run_job(gpu_daemon, tmp_path, 3, "t4")
    seen = sorted((tmp_path / f"out-{rank}.txt").read_text().split()[0] for rank in range(3))
    assert seen == ["2", "4", "5"]


# --- peak memory and batch limits ---------------------------------------------------------------


def test_the_largest_local_batch_follows_the_linear_fit() -> None:
    # peak(m) = 2 GiB + 0.25 GiB m: on 16 GiB with 10 % margin and 0.5 GiB reserve,
    # (16 * 0.9 - 0.5 - 2) / 0.25 = 47.6 -> 47
    points = [(m, 2 * GIB + 0.25 * GIB * m) for m in (8, 16, 32)]
    assert fit_peak_memory(points) == pytest.approx((2 * GIB, 0.25 * GIB))
    assert largest_local_batch(points, 16 * GIB) == 47
    assert largest_local_batch(points, 40 * GIB) == 134
    assert largest_local_batch(points, 16 * GIB, margin=0.0, reserve_bytes=0) == 56
    assert largest_local_batch(points, 2 * GIB) == 0  # not even one example fits


def test_batch_limits_are_conservative_with_little_data() -> None:
    assert largest_local_batch([], 16 * GIB) is None
    assert largest_local_batch([(0, GIB), (4, float("nan"))], 16 * GIB) is None
    # one batch of the line 2 GiB + 0.25 GiB m: proportional to m through it (a = 0), so
    # (16 * 0.9 - 0.5) / (6 / 16) = 37.07 -> 37, below the whole line's 47
    assert fit_peak_memory([(16, 6 * GIB)]) == (0.0, 6 * GIB / 16)
    assert largest_local_batch([(16, 6 * GIB)], 16 * GIB) == 37
    # a batch measured twice counts with its larger peak
    assert fit_peak_memory([(16, 5 * GIB), (16, 6 * GIB)]) == (0.0, 6 * GIB / 16)
    # a fit that does not grow with m falls back to the proportional rule
    assert fit_peak_memory([(8, 4 * GIB), (16, 4 * GIB)]) == (0.0, 4 * GIB / 16)
    with pytest.raises(ValueError, match="margin"):
        largest_local_batch([(8, GIB)], 16 * GIB, margin=1.0)


def test_the_job_library_reports_peak_memory_per_local_batch() -> None:
    pytest.importorskip("torch")
    from pollux_local.torch.memory import PeakMemory

    measured = iter([3 * GIB, 4 * GIB, 5 * GIB, 7 * GIB])
    resets: list[int] = []
    tracker = PeakMemory("a100-40gb", 40960 * MIB, lambda: next(measured), lambda: resets.append(1))
    for batch in (16, 16, 32, 64):
        tracker.measure(batch)
    assert len(resets) == 4
    points = tracker.points()
    assert [(p.local_batch, p.peak_bytes) for p in points] == [
        (16, 4 * GIB),
        (32, 5 * GIB),
        (64, 7 * GIB),
    ]
    report = JobReport(job_id="3", memory=points)
    decoded = parse_report(msgspec.json.encode(report))  # as the daemon reads it
    assert decoded.memory == points
    assert decoded.memory is not None
    assert decoded.memory[0] == MemoryPoint(
        device_type="a100-40gb", local_batch=16, peak_bytes=4 * GIB, total_bytes=40960 * MIB
    )
    limit = largest_local_batch(
        [(p.local_batch, p.peak_bytes) for p in decoded.memory], 15360 * MIB
    )
    assert limit is not None and 64 < limit < 200
    assert parse_report(b'{"job_id": "3"}').memory is None  # reports without it still decode
    with pytest.raises(Exception, match="memory"):
        parse_report(b'{"memory": [{"device_type": "t4", "local_batch": 0,'
                     b' "peak_bytes": 1, "total_bytes": 1}]}')  # fmt: skip


def _plan(local: int, full: bool = True) -> Any:
    """A one-replica optimizer step of ``local`` samples (``full``: of the configured size)."""
    torch = pytest.importorskip("torch")
    from pollux_local.torch.sampler import MicroBatch, StepPlan

    micro = MicroBatch(indices=(torch.arange(local),), weights=(1.0,))
    return StepPlan(micro=(micro,), total=local, full=full)


class FakeAllocator:
    """The allocator's peak as the tracker reads it: the largest allocation since the last
    restart; every read counted."""

    def __init__(self) -> None:
        self.peak = 0
        self.reads = 0

    def step(self, peak: int) -> None:
        self.peak = max(self.peak, peak)

    def read(self) -> int:
        self.reads += 1
        return self.peak

    def reset(self) -> None:
        self.peak = 0


def test_the_peak_is_read_once_per_run_of_steps_of_one_local_batch() -> None:
    """The allocator's statistics are dear to read (a Python table of every statistic), so the
    peak of a run of same-size steps is read together: every READ_EVERY steps, before a step
    of another size or one left out (an epoch's tail), and for a report.  A step left out
    never counts for any local batch."""
    pytest.importorskip("torch")
    from pollux_local.torch.memory import READ_EVERY, PeakMemory

    alloc = FakeAllocator()
    tracker = PeakMemory("t4", 15360 * MIB, alloc.read, alloc.reset)

    def run(local: int, peak: int, full: bool = True) -> None:
        plan = _plan(local, full)
        tracker.before_step(plan, 0)
        alloc.step(peak)
        tracker.after_step(plan, 0)

    for i in range(READ_EVERY - 1):
        run(16, GIB + i * MIB)
    assert alloc.reads == 0  # nothing read step by step
    run(16, GIB)  # the READ_EVERY-th: read
    assert alloc.reads == 1
    run(16, 2 * GIB)
    run(16, 3 * GIB, full=False)  # an epoch's tail: 16's peak read before it, its own dropped
    assert alloc.reads == 2
    run(32, 4 * GIB)
    run(64, 5 * GIB)  # another local batch: 32's peak read before it
    assert alloc.reads == 3
    points = {p.local_batch: p.peak_bytes for p in tracker.points()}  # a report reads 64's
    assert alloc.reads == 4
    assert points == {16: 2 * GIB, 32: 4 * GIB, 64: 5 * GIB}
    tracker.points()
    assert alloc.reads == 4  # nothing unread: nothing read


def test_the_trainer_measures_peak_memory_on_cuda_only() -> None:
    torch = pytest.importorskip("torch")
    from pollux_local.api.launch import LaunchEnvironment
    from pollux_local.torch import ElasticTrainer
    from pollux_local.torch.memory import PeakMemory

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    trainer = ElasticTrainer(
        model,
        optimizer,
        base_batch=8,
        env=LaunchEnvironment(),
        report_interval_s=1e9,
        checkpoint_dir=None,
    )
    assert trainer.peak_memory is None and trainer.build_report().memory is None  # on CPU
    alloc = FakeAllocator()
    trainer.peak_memory = PeakMemory("t4", 15360 * MIB, alloc.read, alloc.reset)
    allocated = iter(range(1, 100))
    original = trainer.optimizer.step

    def step_allocating(*args: Any, **kwargs: Any) -> Any:
        alloc.step(GIB + next(allocated) * MIB)  # each step peaks a little higher
        return original(*args, **kwargs)

    trainer.optimizer.step = step_allocating  # type: ignore[method-assign]
    data = torch.utils.data.TensorDataset(torch.randn(36, 4), torch.randint(0, 2, (36,)))
    loader = trainer.loader(data)
    for _ in trainer.epochs(1):
        for x, y in loader:
            trainer.step(torch.nn.functional.cross_entropy(trainer.model(x), y))
    assert trainer.steps == 5  # four of 8 samples, then the epoch's tail of 4
    assert alloc.reads == 1  # before the tail
    (point,) = trainer.build_report().memory or []
    assert (point.device_type, point.local_batch) == ("t4", trainer.local_batch)
    assert point.peak_bytes == GIB + 4 * MIB and point.total_bytes == 15360 * MIB  # not the tail's
    assert isinstance(point, MemoryPoint)
