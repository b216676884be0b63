"""A shared job's memory on a GPU: the caps its environment carries (``api.launch``), as a
real daemon on the fake A100s gives them, and the job library applying its fraction against
a fake ``torch.cuda`` (no GPU here: that is all this machine can show)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pollux_local import api
from pollux_local.api.launch import LaunchEnvironment, replica_environ
from pollux_local.errors import PolluxError
from pollux_local.torch.env import job_environment, torch_device
from tests.daemon.test_gpus import FakeGpuDaemon, gpu_daemon  # noqa: F401 (the fixture)
from tests.daemon_process import wait_for

GIB = 1 << 30


def test_the_environment_of_a_shared_job_carries_its_caps() -> None:
    launch = LaunchEnvironment(device="cuda", gpu_memory_limit=6 * GIB, gpu_memory_fraction=0.375)
    env = replica_environ(
        launch.common_environ(), rank=0, local_rank=0, node_rank=0, local_world_size=1,
        device="cuda", device_index="3",
    )  # fmt: skip
    assert env["CUDA_VISIBLE_DEVICES"] == "3"
    assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=6144M"  # its one device is 0 to it
    assert env["POLLUX_GPU_MEMORY_FRACTION"] == "0.375"
    assert LaunchEnvironment.from_environ(env).gpu_memory_fraction == 0.375
    plain = LaunchEnvironment(device="cuda").common_environ()
    assert "POLLUX_GPU_MEMORY_FRACTION" not in plain
    assert "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT" not in plain
    for bad in ("1.5", "0", "lots"):
        with pytest.raises(PolluxError, match="POLLUX_GPU_MEMORY_FRACTION"):
            LaunchEnvironment.from_environ({"POLLUX_GPU_MEMORY_FRACTION": bad})


@pytest.fixture()
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> list[tuple[float, torch.device]]:
    """``torch.cuda`` as on a one-GPU box, recording the fractions set."""
    calls: list[tuple[float, torch.device]] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(
        torch.cuda,
        "set_per_process_memory_fraction",
        lambda fraction, device=None: calls.append((fraction, device)),
    )
    return calls


def test_the_job_library_caps_its_allocator_at_the_fraction(
    fake_cuda: list[tuple[float, torch.device]],
) -> None:
    env = job_environment({"POLLUX_DEVICE": "cuda", "POLLUX_GPU_MEMORY_FRACTION": "0.25"})
    device = torch_device(env)
    assert device == torch.device("cuda", 0) and fake_cuda == [(0.25, device)]
    torch_device(job_environment({"POLLUX_DEVICE": "cuda"}))  # not shared: no cap
    torch_device(job_environment({"POLLUX_DEVICE": "cpu", "POLLUX_GPU_MEMORY_FRACTION": "0.5"}))
    assert len(fake_cuda) == 1


def test_a_real_daemon_gives_a_shared_job_on_a_fake_a100_its_caps(
    gpu_daemon: FakeGpuDaemon,  # noqa: F811
    tmp_path: Path,
    fake_cuda: list[tuple[float, torch.device]],
) -> None:
    script = tmp_path / "env.sh"
    script.write_text('#!/bin/sh\nenv > "env-$RANK.txt"\n')
    script.chmod(0o755)
    reply = gpu_daemon.client.call(
        api.Submit(
            argv=[str(script)], workdir=str(tmp_path), gpu_memory=10 * GIB, shared=True,
            constraint=api.Constraint(device_type="a100-40gb"),
        )
    )  # fmt: skip

    def ended() -> api.JobDetail | None:
        job = gpu_daemon.client.call(api.Show(id=reply.id)).job
        return job if job.state.value in ("succeeded", "failed", "cancelled") else None

    job = wait_for(ended, 60, f"job {reply.id} to end")
    assert job.state.value == "succeeded", (job.reason, gpu_daemon.output())
    lines = (tmp_path / "env-0.txt").read_text().splitlines()
    env = dict(line.split("=", 1) for line in lines if "=" in line)
    # 10G declared on a 40 GiB A100
    assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=10240M"
    assert float(env["POLLUX_GPU_MEMORY_FRACTION"]) == pytest.approx(0.25)
    assert env["CUDA_VISIBLE_DEVICES"] in ("0", "1") and env["POLLUX_DEVICE"] == "cuda"
    # what the job library does with that environment, before its first allocation
    device = torch_device(job_environment(env))
    ((fraction, capped),) = fake_cuda
    assert fraction == pytest.approx(0.25) and capped == device
