"""The SSH launcher against real sshd hosts in network namespaces."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
from pathlib import Path

import pytest

from pollux_local.api.states import ExitCode
from pollux_local.launch.base import LaunchSpec, ReplicaSlot
from pollux_local.launch.ssh import SETUP_FAILED_EXIT_CODE, UNREACHABLE_EXIT_CODE, SshLauncher
from tests.pids import alive, parent_of

from .conftest import GLOO_JOB, PYTHON, job_env
from .testbed import Testbed

pytestmark = pytest.mark.timeout(150)


def two_host_spec(bed: Testbed, tmp_path: Path, job_id: str, steps: int, port: int) -> LaunchSpec:
    h1, h2 = bed.hosts
    return LaunchSpec(
        job_id=job_id,
        argv=[PYTHON, str(GLOO_JOB), "--steps", str(steps), "--step-sleep", "0.05"],
        workdir=tmp_path,
        env=job_env(tmp_path / "ckpt", world=2, port=port),
        slots=[ReplicaSlot(0, h1.name, "cpu:0", 0, 0), ReplicaSlot(1, h2.name, "cpu:0", 0, 1)],
        log_dir=tmp_path / "logs",
    )


def test_check_node_reports_devices_and_load(testbed: Testbed, launcher: SshLauncher) -> None:
    async def check() -> None:
        for host in testbed.hosts:
            health = await launcher.check_node(host.name)
            assert health.reachable, health.error
            assert list(health.devices) == ["cpu:0", "cpu:1"]
            assert health.load is not None and health.load >= 0.0

    asyncio.run(check())


def test_unreachable_node_is_reported_within_the_connect_timeout(
    testbed: Testbed, launcher: SshLauncher
) -> None:
    host = testbed.hosts[1]

    async def check() -> tuple[bool, str | None, float]:
        await launcher.close()  # no shared connection: a fresh login must fail
        testbed.cut_link(host)
        try:
            start = time.monotonic()
            health = await launcher.check_node(host.name)
            return health.reachable, health.error, time.monotonic() - start
        finally:
            testbed.restore_link(host)

    reachable, error, elapsed = asyncio.run(check())
    assert not reachable
    assert error
    assert elapsed < 2 * launcher.connect_timeout_s + 12


def one_sleeper(node: str, tmp_path: Path, job_id: str) -> LaunchSpec:
    """One replica on ``node`` sleeping for a minute."""
    return LaunchSpec(
        job_id=job_id,
        argv=["/bin/sleep", "60"],
        workdir=tmp_path,
        env={"PATH": "/usr/bin:/bin", "WORLD_SIZE": "1"},
        slots=[ReplicaSlot(0, node, "cpu:0", 0, 0)],
        log_dir=tmp_path / "logs",
    )


def test_a_node_whose_agent_does_not_answer_a_stop_is_checked_not_taken_as_lost(
    testbed: Testbed, launcher: SshLauncher, tmp_path: Path
) -> None:
    """The daemon ends an ssh client whose agent did not answer a stop in time.  That is no
    proof the node is lost (a job can keep its own agent busy past any grace, and so take its
    node from everyone): the node is one to check (``unanswered_nodes``), not a lost one."""
    host = testbed.hosts[0]
    spec = one_sleeper(host.name, tmp_path, "deaf")

    async def run() -> tuple[int, set[str], set[str]]:
        group = await launcher.launch(spec)
        deadline = time.monotonic() + 30
        while not group.pids() and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        replica = group.pids()[0]
        agent = parent_of(replica)
        os.kill(agent, signal.SIGSTOP)  # it answers nothing now
        try:
            code = await asyncio.wait_for(group.stop(grace_s=1.0), 60)
        finally:
            os.kill(agent, signal.SIGCONT)  # its stdin is closed: it ends its replica
            with contextlib.suppress(ProcessLookupError):
                os.kill(replica, signal.SIGKILL)
        return code, group.lost_nodes(), group.unanswered_nodes()

    code, lost, unanswered = asyncio.run(run())
    assert lost == set() and unanswered == {host.name}
    assert code != UNREACHABLE_EXIT_CODE


def test_a_killed_agent_is_a_node_to_check_not_a_lost_one(
    testbed: Testbed, launcher: SshLauncher, tmp_path: Path
) -> None:
    """ssh exits 255 when the link is lost, and also when the command it runs is killed (the
    OOM killer picking the agent or its sshd, filled up by a job).  A job must not take its
    node from everyone that way: the node is one to check, not a lost one; and the replica the
    agent left is killed through its exit record once the node answers."""
    host = testbed.hosts[0]
    spec = one_sleeper(host.name, tmp_path, "oomed")

    async def run() -> tuple[int, set[str], set[str], str | None, bool, bool]:
        group = await launcher.launch(spec)
        deadline = time.monotonic() + 30
        while not group.pids() and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        replica = group.pids()[0]
        command = Path(f"/proc/{replica}/cmdline")
        while not command.read_bytes().startswith(b"/bin/sleep") and time.monotonic() < deadline:
            await asyncio.sleep(0.05)  # its launcher has become the job
        await asyncio.sleep(0.5)  # and the agent has written its exit record
        os.kill(parent_of(replica), signal.SIGKILL)  # as the OOM killer would
        try:
            code = await asyncio.wait_for(group.wait(), 60)
            orphaned = alive(replica)  # nothing on the node supervises it now
            await group.end_unanswered(group.unanswered_nodes())  # the node answers
            for _ in range(50):
                if not alive(replica):
                    break
                await asyncio.sleep(0.1)
            ended = not alive(replica)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(replica, signal.SIGKILL)
        return (code, group.lost_nodes(), group.unanswered_nodes(), group.failure_reason,
                orphaned, ended)  # fmt: skip

    code, lost, unanswered, reason, orphaned, ended = asyncio.run(run())
    assert code == UNREACHABLE_EXIT_CODE
    assert lost == set() and unanswered == {host.name}
    assert reason is not None and "ssh exit 255" in reason, reason
    assert orphaned and ended  # the exit record on the node named it: killed from here


def test_a_node_whose_work_directory_anyone_could_claim_is_down_not_the_jobs_failure(
    testbed: Testbed, tmp_path: Path
) -> None:
    """A missing work directory in a directory others may write to (``/tmp``) is not made by
    the agent (anyone could make the name first and so refuse every job there): the node
    check says the node is unusable and why, and a launch there fails the node (its agent's
    ``NODEFAIL``), not the job."""
    import dataclasses
    import uuid

    from .conftest import ssh_nodes

    claimable = f"/tmp/pollux-test-claimable-{uuid.uuid4().hex[:8]}"
    nodes = [dataclasses.replace(node, workdir=claimable) for node in ssh_nodes(testbed)]
    launcher = SshLauncher(nodes, control_dir=testbed.dir / "ctl2", failure_grace_s=3.0)
    host = testbed.hosts[0]
    spec = LaunchSpec(
        job_id="claimable",
        argv=["/bin/true"],
        workdir=tmp_path,
        env={"PATH": "/usr/bin:/bin", "WORLD_SIZE": "1"},
        slots=[ReplicaSlot(0, host.name, "cpu:0", 0, 0)],
        log_dir=tmp_path / "logs",
    )

    async def run() -> tuple[bool, str | None, int, set[str], str | None]:
        try:
            health = await launcher.check_node(host.name)
            group = await launcher.launch(spec)
            code = await asyncio.wait_for(group.wait(), 60)
            return health.reachable, health.error, code, group.lost_nodes(), group.failure_reason
        finally:
            await launcher.close()

    reachable, error, code, lost, reason = asyncio.run(run())
    assert not Path(claimable).exists()  # not made where anyone could have made it first
    assert not reachable and error is not None and f"make {claimable} first" in error, error
    assert code == SETUP_FAILED_EXIT_CODE and lost == {host.name}
    assert reason is not None and "refusing the work directory" in reason, reason


def test_environment_arrives_exactly_and_logs_come_back(
    testbed: Testbed, launcher: SshLauncher, tmp_path: Path
) -> None:
    tricky = "spaces and 'quotes' \"double\" $HOME `x` ; rm -rf / \n second line"
    host = testbed.hosts[0]
    env = {"PATH": "/usr/bin:/bin", "TRICKY": tricky, "WORLD_SIZE": "1"}
    spec = LaunchSpec(
        job_id="envjob",
        argv=["/usr/bin/env", "-0"],  # not Python: it would add LC_CTYPE (PEP 538)
        workdir=tmp_path,
        env=env,
        slots=[ReplicaSlot(0, host.name, "cpu:1", 1, 0)],
        log_dir=tmp_path / "logs",
    )

    async def run() -> int:
        group = await launcher.launch(spec)
        return await asyncio.wait_for(group.wait(), 60)

    assert asyncio.run(run()) == 0
    banner, raw = (tmp_path / "logs" / "rank0.log").read_text().split("\n", 1)
    assert banner.startswith("--- ") and "rank 0/1 on" in banner
    seen = dict(item.split("=", 1) for item in raw.split("\0") if item)
    expected = dict(
        env,
        RANK="0",
        LOCAL_RANK="1",
        NODE_RANK="0",
        GROUP_RANK="0",
        LOCAL_WORLD_SIZE="1",
        POLLUX_DEVICE="cpu",
        GLOO_SOCKET_IFNAME="eth0",
        # the rest of torchrun's contract (api.launch.replica_environ)
        ROLE_RANK="0",
        ROLE_NAME="default",
        ROLE_WORLD_SIZE="1",
        GROUP_WORLD_SIZE="1",
        TORCHELASTIC_RUN_ID="pollux-local",
        TORCHELASTIC_RESTART_COUNT="0",
        TORCHELASTIC_MAX_RESTARTS="0",
        TORCHELASTIC_USE_AGENT_STORE="False",
    )
    assert seen == expected  # nothing added, nothing lost, no CUDA_VISIBLE_DEVICES for a CPU
    remote_logs = Path(launcher.nodes[host.name].workdir) / "logs" / launcher.record_key
    remote_log = remote_logs / "envjob" / "rank0.start0.log"
    assert remote_log.read_text() == (tmp_path / "logs" / "rank0.log").read_text()


def test_a_replica_exiting_255_is_its_own_crash_not_a_lost_node(
    testbed: Testbed, launcher: SshLauncher, tmp_path: Path
) -> None:
    """255 is also what ssh exits with when it loses a node; a replica's own 255 (``exit
    255``, Python's ``sys.exit(-1)``) must not read as one, or any job could mark a node
    down for everyone and be re-queued without a failure counted."""
    host = testbed.hosts[0]
    spec = LaunchSpec(
        job_id="exit255",
        argv=["/bin/sh", "-c", "exit 255"],
        workdir=tmp_path,
        env={"PATH": "/usr/bin:/bin", "WORLD_SIZE": "1"},
        slots=[ReplicaSlot(0, host.name, "cpu:0", 0, 0)],
        log_dir=tmp_path / "logs",
    )

    async def run() -> tuple[int, set[str], str | None]:
        group = await launcher.launch(spec)
        code = await asyncio.wait_for(group.wait(), 60)
        return code, group.lost_nodes(), group.failure_reason

    code, lost, reason = asyncio.run(run())
    assert code == 255  # the job's own code, reported as it is
    assert lost == set()  # but no node was lost
    assert reason is not None and "exited with 255" in reason and "unreachable" not in reason


def test_job_spanning_two_hosts_trains_and_finishes(
    testbed: Testbed, launcher: SshLauncher, tmp_path: Path
) -> None:
    spec = two_host_spec(testbed, tmp_path, "span", steps=60, port=29611)

    async def run() -> int:
        group = await launcher.launch(spec)
        return await asyncio.wait_for(group.wait(), 120)

    assert asyncio.run(run()) == 0
    done = json.loads((tmp_path / "ckpt" / "done.json").read_text())
    assert done["step"] == 60
    assert done["hosts"] == [h.name for h in testbed.hosts]  # one rank in each namespace
    assert done["loss"] < 0.5
    assert "rank 1 finished at step 60" in (tmp_path / "logs" / "rank1.log").read_text()


def test_stop_checkpoints_and_exits_for_a_rescale(
    testbed: Testbed, launcher: SshLauncher, tmp_path: Path
) -> None:
    spec = two_host_spec(testbed, tmp_path, "stop", steps=100_000, port=29612)

    async def run() -> int:
        group = await launcher.launch(spec)
        await _wait_for_step(tmp_path / "ckpt", 10)
        return await group.stop(grace_s=20)

    code = asyncio.run(run())
    logs = [(tmp_path / "logs" / f"rank{rank}.log").read_text() for rank in (0, 1)]
    assert code == ExitCode.RESCALE, f"group exited {code}; logs:\n" + "\n".join(logs)
    assert all("checkpointed at step" in log for log in logs)


def test_cut_link_fails_the_group_and_the_job_resumes_on_the_other_host(
    testbed: Testbed, launcher: SshLauncher, tmp_path: Path
) -> None:
    h1, h2 = testbed.hosts
    spec = two_host_spec(testbed, tmp_path, "cut", steps=100_000, port=29613)

    async def first() -> tuple[int, float, str | None]:
        group = await launcher.launch(spec)
        await _wait_for_step(tmp_path / "ckpt", 20)
        testbed.cut_link(h2)
        cut = time.monotonic()
        code = await asyncio.wait_for(group.wait(), 90)
        return code, time.monotonic() - cut, group.failure_reason

    try:
        code, detected_after, reason = asyncio.run(first())
    finally:
        testbed.restore_link(h2)
    assert code == UNREACHABLE_EXIT_CODE
    assert reason == (
        f"node {h2.name}'s session ended (ssh exit 255) before its replicas said how they ended"
    )
    # keepalive bound + the surviving rank's stop grace + slack
    assert detected_after < launcher.detect_dead_link_s + launcher.failure_grace_s + 5
    saved = _checkpoint_step(tmp_path / "ckpt")
    assert saved >= 20

    resumed = LaunchSpec(
        job_id="cut",
        argv=[PYTHON, str(GLOO_JOB), "--steps", str(saved + 30), "--step-sleep", "0.01"],
        workdir=tmp_path,
        env=job_env(tmp_path / "ckpt", world=1, port=29614),
        slots=[ReplicaSlot(0, h1.name, "cpu:0", 0, 0)],
        log_dir=tmp_path / "logs",
    )

    async def second() -> int:
        group = await launcher.launch(resumed)
        return await asyncio.wait_for(group.wait(), 60)

    assert asyncio.run(second()) == 0
    incarnations = [
        json.loads(line)
        for line in (tmp_path / "ckpt" / "incarnations.jsonl").read_text().splitlines()
    ]
    assert incarnations[0] == {"start_step": 0, "world": 2, "hosts": [h1.name, h2.name]}
    assert incarnations[-1] == {"start_step": saved, "world": 1, "hosts": [h1.name]}
    assert json.loads((tmp_path / "ckpt" / "done.json").read_text())["step"] == saved + 30


def test_checkpoint_dir_not_shared_fails_clearly(
    testbed: Testbed, launcher: SshLauncher, tmp_path: Path
) -> None:
    host = testbed.hosts[0]
    private = testbed.private_dir / "ckpt"
    spec = LaunchSpec(
        job_id="unshared",
        argv=[PYTHON, "-c", "print('must not run')"],
        workdir=tmp_path,
        env={"PATH": "/usr/bin:/bin", "POLLUX_CHECKPOINT_DIR": str(private)},
        slots=[ReplicaSlot(0, host.name, "cpu:0", 0, 0)],
        log_dir=tmp_path / "logs",
    )

    async def run() -> tuple[int, str | None]:
        group = await launcher.launch(spec)
        return await asyncio.wait_for(group.wait(), 30), group.failure_reason

    code, reason = asyncio.run(run())
    assert code == SETUP_FAILED_EXIT_CODE
    assert reason is not None and "is not shared with node" in reason and str(private) in reason
    with pytest.raises(Exception, match="is not shared with node"):
        asyncio.run(launcher.check_shared_dir(host.name, private))
    asyncio.run(launcher.check_shared_dir(host.name, tmp_path / "shared"))  # a shared one passes


def test_replicas_do_not_outlive_a_lost_daemon(
    testbed: Testbed, launcher: SshLauncher, tmp_path: Path
) -> None:
    """The ssh client dies (as with a SIGKILLed daemon): the node's supervisor stops the
    replica itself instead of leaving it running."""
    host = testbed.hosts[0]
    launcher.orphan_grace_s = 2.0
    spec = LaunchSpec(
        job_id="orphan",
        argv=["sleep", "300"],
        workdir=tmp_path,
        env={"PATH": "/usr/bin:/bin"},
        slots=[ReplicaSlot(0, host.name, "cpu:0", 0, 0)],
        log_dir=tmp_path / "logs",
    )

    async def run() -> int:
        group = await launcher.launch(spec)
        for _ in range(100):
            if group.pids():
                break
            await asyncio.sleep(0.1)
        pid = group.pids()[0]
        for session in group._sessions:
            session.proc.kill()
        await asyncio.wait_for(group.wait(), 20)
        return pid

    pid = asyncio.run(run())
    deadline = time.monotonic() + 15
    alive = True
    while time.monotonic() < deadline and alive:
        alive = testbed.ssh(host, f"kill -0 {pid}").returncode == 0
        time.sleep(0.3)
    assert not alive


async def _wait_for_step(ckpt_dir: Path, step: int, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if _checkpoint_step(ckpt_dir) >= step:
            return
        await asyncio.sleep(0.2)
    raise AssertionError(f"no checkpoint at step {step} within {timeout_s:g} s")


def _checkpoint_step(ckpt_dir: Path) -> int:
    import torch

    path = ckpt_dir / "model.pt"
    if not path.exists():
        return -1
    try:
        return int(torch.load(path)["step"])
    except Exception:
        return -1


#: A replica that says where its resize orders come, then waits; a joiner of a warm resize
#: exits 3 when asked to fail (``FAIL_JOIN``), else announces itself ready and waits.
WARM_SCRIPT = """
if [ -n "$POLLUX_RESIZE_JOIN" ]; then
  [ -n "$FAIL_JOIN" ] && exit 3
  : > "$POLLUX_JOB_DIR/resize-ready-$POLLUX_RESIZE_JOIN-$RANK"
fi
echo "file=$POLLUX_RESIZE_FILE"
exec sleep 60
"""


def test_a_warm_resize_on_one_node_fails_cleanly_then_grows_in_place(
    testbed: Testbed, launcher: SshLauncher, tmp_path: Path
) -> None:
    from pollux_local.api.resize import ResizeOrder, decode_order

    host = testbed.hosts[0]
    job_dir = tmp_path / "job"
    job_dir.mkdir()
    env = {**job_env(tmp_path / "ckpt", world=1, port=29511), "POLLUX_JOB_DIR": str(job_dir)}
    one = LaunchSpec(
        job_id="41",
        argv=["/bin/sh", "-c", WARM_SCRIPT],
        workdir=tmp_path,
        env={**env, "FAIL_JOIN": "1"},
        slots=[ReplicaSlot(0, host.name, "cpu:0", 0, 0)],
        log_dir=job_dir,
        takes_orders=True,
    )
    two = LaunchSpec(
        **{**one.__dict__, "slots": [*one.slots, ReplicaSlot(1, host.name, "cpu:1", 1, 0)]}
    )

    async def run() -> tuple[str | None, str | None, int | None, dict[int, int], int]:
        group = await launcher.launch(one)
        assert group.warm_capable
        failed = await group.resize_warm(two, ResizeOrder(1, 2, "127.0.0.1", 29512), 10)
        await asyncio.sleep(0.5)
        still = group.poll()
        assert group.spec is one and list(group.pids()) == [0]
        grown = LaunchSpec(**{**two.__dict__, "env": env})
        order = ResizeOrder(2, 2, "127.0.0.1", 29513, local_batch=8, accum_steps=1)
        ordered = await group.resize_warm(grown, order, 10)
        assert group.spec is grown
        log = job_dir / "rank0.log"
        for _ in range(100):  # the logs come back every quarter of a second
            if log.exists() and "file=" in log.read_text():
                break
            await asyncio.sleep(0.1)
        file = log.read_text().split("file=")[1].split()[0]
        assert decode_order(Path(file).read_bytes()) == order
        pids = dict(group.pids())
        code = await group.stop(2.0)
        return failed, ordered, still, pids, code

    failed, ordered, still, pids, code = asyncio.run(run())
    assert failed == "joining rank 1 exited with 3 first"  # and the group ran on
    assert still is None and ordered is None
    assert sorted(pids) == [0, 1]
    assert code != 0  # both were stopped
    file = (job_dir / "rank0.log").read_text().split("file=")[1].split()[0]
    assert file.endswith("/order.json") and not file.startswith(str(tmp_path))
    rank1 = (job_dir / "rank1.log").read_text()
    assert "joined at resize 1" in rank1 and "joined at resize 2" in rank1
    assert f"file={file}" in rank1
    assert not Path(file).exists()  # the agent's order directory went with the incarnation
