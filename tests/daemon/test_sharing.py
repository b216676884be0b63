"""Small jobs sharing a device: the pure packing rule, the pass, and a real daemon packing
rigid jobs by the memory they declared on CPU devices that declare theirs."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from pollux_local import api
from pollux_local.api.states import JobState
from pollux_local.core.baselines import FifoPolicy
from pollux_local.core.schedule import ActionKind, Limits, NodeInput
from pollux_local.core.sharing import (
    SharedDevice,
    choose_shared_device,
    shared_speed,
    sharing_gain,
)
from pollux_local.daemon.scheduler import ModelCache, plan_round
from pollux_local.daemon.state import JobRecord
from pollux_local.sizes import SizeError, format_size, parse_size
from tests.daemon_process import DaemonFactory, DaemonProcess, wait_for
from tests.store_spy import count_job_loads

GIB = 1 << 30
RNG = np.random.default_rng(0)


def test_sizes() -> None:
    assert parse_size("6G") == 6 * GIB == parse_size("6GiB") == parse_size("6gb")
    assert parse_size("512M") == 512 << 20 and parse_size(4096) == 4096
    assert format_size(6 * GIB) == "6.0G"
    for bad in ("", "6X", "-1G", "0"):
        with pytest.raises(SizeError):
            parse_size(bad)


def test_the_slowdown_model_and_the_gain_of_one_more_job() -> None:
    assert shared_speed(1, 0.25) == 1.0
    assert shared_speed(2, 0.25) == pytest.approx(0.8)
    # two jobs do 1.6 jobs' worth: the second adds 0.6; a third adds 3/1.5 - 1.6 = 0.4
    assert sharing_gain(1, 0.25) == pytest.approx(0.6)
    assert sharing_gain(2, 0.25) == pytest.approx(0.4)
    assert sharing_gain(5, 0.0) == pytest.approx(1.0)  # no interference: always worth it


def test_a_job_joins_the_fullest_device_it_fits_while_sharing_pays() -> None:
    a = SharedDevice(("n", "cuda:0"), jobs=1, used=10 * GIB, total=16 * GIB)
    b = SharedDevice(("n", "cuda:1"), jobs=1, used=4 * GIB, total=16 * GIB)
    assert choose_shared_device([a, b], 6 * GIB, 0.25) == a  # fits a exactly: best fit
    assert choose_shared_device([a, b], 7 * GIB, 0.25) == b
    assert choose_shared_device([a, b], 13 * GIB, 0.25) is None
    # the device reports less free than declared: the report wins
    tight = SharedDevice(("n", "cuda:2"), jobs=1, used=2 * GIB, total=16 * GIB, free=3 * GIB)
    assert choose_shared_device([tight], 4 * GIB, 0.25) is None
    # a third job joins while the admin's cap allows three, and never where sharing adds no
    # work (beta >= 1)
    two = SharedDevice(("n", "cuda:3"), jobs=2, used=2 * GIB, total=16 * GIB)
    assert choose_shared_device([two], GIB, 0.25, max_jobs=2) is None
    assert choose_shared_device([two], GIB, 0.25, max_jobs=3) == two
    assert choose_shared_device([two], GIB, 1.0, max_jobs=8) is None


def record(job_id: int, state: str = "queued", elastic: bool = False, **spec: object) -> JobRecord:
    placement = spec.pop("placement", {})
    return JobRecord(
        id=job_id, name=f"j{job_id}", owner_uid=1000, owner_gid=1000, owner_name="ann",
        state=JobState(state), placement=placement,  # type: ignore[arg-type]
        spec={"argv": ["x"], "workdir": "/", "elastic": elastic, "batch_size": 8, **spec},
        last_start=0.0 if placement else None,
    )  # fmt: skip


def test_the_pass_packs_shared_jobs_and_keeps_others_off_their_device() -> None:
    nodes = [NodeInput("n", ("cpu:0", "cpu:1"), memory=16 * GIB)]
    running = record(1, "running", shared=True, gpu_memory=6 * GIB, placement={"n": ["cpu:0"]})
    joiner = record(2, shared=True, gpu_memory=6 * GIB)
    too_big = record(3, shared=True, gpu_memory=12 * GIB)
    elastic = record(4, elastic=True, max_gpus=2)
    plan = plan_round(
        FifoPolicy(), [running, joiner, too_big, elastic], nodes, ModelCache(), 1.0, RNG, Limits()
    )
    starts = {a.job_id: a for a in plan.actions if a.kind is ActionKind.START}
    assert starts[2].allocation == {"n": ["cpu:0"]}  # packed beside job 1
    assert "sharing it with job(s) 1" in starts[2].reason and "0.80" in starts[2].reason
    # job 3 does not fit beside them: it gets a device of its own, and the elastic job no
    # device that a shared job runs on
    assert starts[3].allocation == {"n": ["cpu:1"]}
    assert 4 not in starts
    assert 1 in plan.unchanged


@pytest.fixture()
def daemon(daemon_factory: DaemonFactory) -> DaemonProcess:
    return daemon_factory(
        config='[scheduler]\npolicy = "fifo"\ninterval_s = 0.3\n\n'
        '[nodes.box]\ndevices = "cpu:2"\nmemory = "16G"\n'
    )


def test_a_real_daemon_packs_small_jobs_by_their_declared_memory(
    daemon: DaemonProcess, tmp_path: Path
) -> None:
    sleeper = tmp_path / "sleep.sh"
    sleeper.write_text("#!/bin/sh\nsleep 4\n")
    sleeper.chmod(0o755)

    def submit(memory: str, shared: bool = True) -> str:
        request = api.Submit(
            argv=[str(sleeper)], workdir=str(tmp_path), gpu_memory=parse_size(memory), shared=shared
        )
        return daemon.client.call(request).id

    first, second, third = submit("6G"), submit("6G"), submit("8G")

    def placed() -> dict[str, dict[str, list[str]]] | None:
        jobs = {j: daemon.client.call(api.Show(id=j)).job for j in (first, second, third)}
        if all(job.state.value == "running" for job in jobs.values()):
            return {j: job.devices for j, job in jobs.items()}
        return None

    devices = wait_for(placed, 30, "three shared jobs running")
    assert devices[first] == devices[second]  # 6G + 6G on one 16G device
    assert devices[third] != devices[first]  # 8G more would not fit there
    nodes = daemon.client.call(api.Nodes()).nodes
    assert nodes[0].memory == 16 * GIB
    # a job that does not share waits for a device no shared job runs on
    alone = daemon.client.call(api.Submit(argv=[str(sleeper)], workdir=str(tmp_path))).id
    for job_id in (first, second, third):
        wait_for(
            lambda job_id=job_id: (
                daemon.client.call(api.Show(id=job_id)).job.state.value == "succeeded"
            ),
            30,
            f"job {job_id} to end",
        )
    wait_for(
        lambda: daemon.client.call(api.Show(id=alone)).job.state.value == "running", 30, "alone"
    )
    with pytest.raises(api.InvalidRequest, match="more than any device has"):
        submit("40G")
    with pytest.raises(api.InvalidRequest, match="needs --gpu-memory"):
        daemon.client.call(api.Submit(argv=["x"], workdir=str(tmp_path), shared=True))


def test_the_cli_and_job_toml_ask_to_share(tmp_path: Path) -> None:
    from pollux_local.cli import build_parser
    from pollux_local.cli.submit import build_submit_request
    from pollux_local.errors import PolluxError

    def request(*argv: str) -> api.Submit:
        return build_submit_request(build_parser().parse_args(["submit", *argv]))

    made = request("--gpu-memory", "6G", "--shared", "--workdir", str(tmp_path), "/bin/true")
    assert (made.gpu_memory, made.shared, made.elastic) == (6 * GIB, True, False)
    with pytest.raises(PolluxError, match="--gpu-memory: not a size"):
        request("--gpu-memory", "lots", "/bin/true")
    spec = tmp_path / "job.toml"
    spec.write_text('[job]\nscript = "run.sh"\ngpu_memory = "512M"\nshared = true\n')
    (tmp_path / "run.sh").write_text("#!/bin/sh\n")
    (tmp_path / "run.sh").chmod(0o755)
    from_file = request("--spec", str(spec))
    assert (from_file.gpu_memory, from_file.shared) == (512 << 20, True)


def test_on_gpus_a_job_joins_only_while_nvml_reports_its_memory_free(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import sys
    import types

    from pollux_local.daemon import config
    from pollux_local.daemon.loop import node_snapshot
    from tests.fake_nvml import A100_40GB, FakeBox, FakeProcess, fake_module

    box = FakeBox.of(A100_40GB, A100_40GB)
    # the running shared job (ours: pid 4242) declared 8G but uses 30G
    box.gpus[0].processes.append(FakeProcess(4242, 30 * GIB))
    monkeypatch.setitem(sys.modules, "pynvml", fake_module(box))
    nodes = config.local_nodes()
    (node,) = nodes
    assert node.device_memory == 40960 << 20 and node.device_type == "a100-40gb"
    group = types.SimpleNamespace(pids=lambda: {0: 4242})
    executor = types.SimpleNamespace(
        groups={1: group}, nodes=types.SimpleNamespace(is_up=lambda _: True)
    )
    running = record(
        1, "running", shared=True, gpu_memory=8 * GIB, placement={node.name: ["cuda:0"]}
    )
    (snap,) = node_snapshot(config.DaemonConfig(nodes=nodes), executor, (), [running])  # type: ignore[arg-type]
    assert snap.busy == frozenset()  # its process is the scheduler's own
    assert snap.free_memory["cuda:0"] == 40960 * (1 << 20) - 30 * GIB
    big, small = (
        record(2, shared=True, gpu_memory=12 * GIB),
        record(3, shared=True, gpu_memory=8 * GIB),
    )
    plan = plan_round(FifoPolicy(), [running, big, small], [snap], ModelCache(), 1.0, RNG, Limits())
    starts = {a.job_id: a.allocation for a in plan.actions}
    # declared, 12G would fit beside 8G on 40G; NVML says only 10G is free: not there
    assert starts[2] == {node.name: ["cuda:1"]}
    assert starts[3] == {node.name: ["cuda:0"]}


def test_a_real_daemon_runs_as_many_shared_jobs_on_one_device_as_the_admin_allows(
    daemon_factory: DaemonFactory, tmp_path: Path
) -> None:
    daemon = daemon_factory(
        devices="cpu:1",
        config='[scheduler]\npolicy = "fifo"\ninterval_s = 0.3\n\n[nodes.box]\nmemory = "16G"\n\n'
        "[devices]\nmax_jobs_per_device = 3\n",
    )
    script = tmp_path / "wait.sh"  # says it started, then waits for the test's go
    script.write_text(
        '#!/bin/sh\ntouch "started-$POLLUX_JOB_ID"\nwhile [ ! -e go ]; do sleep 0.1; done\n'
    )
    script.chmod(0o755)
    ids = [
        daemon.client.call(
            api.Submit(argv=[str(script)], workdir=str(tmp_path), gpu_memory=GIB, shared=True)
        ).id
        for _ in range(4)
    ]

    def show(job_id: str) -> api.JobDetail:
        return daemon.client.call(api.Show(id=job_id)).job

    def three_running() -> bool:
        return all(show(j).state.value == "running" for j in ids[:3])

    wait_for(three_running, 30, "three shared jobs running")
    wait_for(lambda: all((tmp_path / f"started-{j}").exists() for j in ids[:3]), 30, "starts")
    assert all(show(j).devices == {"box": ["cpu:0"]} for j in ids[:3])

    def capped() -> api.JobDetail | None:
        job = show(ids[3])
        return job if "max_jobs_per_device" in job.reason else None

    fourth = wait_for(capped, 30, "the fourth job's reason")
    assert fourth.state.value == "queued" and not (tmp_path / f"started-{ids[3]}").exists()
    assert "box[cpu:0] runs 3 shared jobs, the most [devices] max_jobs_per_device = 3" in (
        fourth.reason
    )
    (tmp_path / "go").touch()

    def all_succeeded() -> bool:
        return all(show(j).state.value == "succeeded" for j in ids)

    wait_for(all_succeeded, 30, "the four jobs to succeed")


def test_telling_whether_holders_are_shared_reads_no_environment(tmp_path: Path) -> None:
    """Before a shared job starts, the executor asks of every job holding a device whether it
    is shared (``Applying._shared_only``), and of every job of a plan's actions.  It loaded
    each whole, environment included: 4 MB of 200,000 variables is 13 ms a job on the event
    loop, so one user's shared jobs (up to ``max_jobs_per_device`` a device) made every
    shared start, anyone's, wait a fraction of a second (review s69).  The spec is all it
    needs."""
    from types import SimpleNamespace

    from pollux_local.daemon.executor.applying import Applying
    from pollux_local.daemon.state import StateStore

    store = StateStore(tmp_path / "s.db")
    ids = []
    for shared in (True, False):
        job = store.add_job(
            name="j", owner_uid=1001, owner_gid=1001, owner_name="a", priority=0,
            spec={"argv": ["t.py"], "workdir": "/tmp", "shared": shared, "gpu_memory": 1 << 30},
            submit_time=0.0, env={f"V{i}": "x" for i in range(20_000)},
        )  # fmt: skip
        ids.append(job.id)
    loads = count_job_loads(store)
    executor = SimpleNamespace(store=store)
    assert Applying._is_shared(executor, ids[0]) is True  # type: ignore[arg-type]
    assert Applying._is_shared(executor, ids[1]) is False  # type: ignore[arg-type]
    assert Applying._is_shared(executor, 999) is False  # type: ignore[arg-type]
    assert loads == []  # no environment read
