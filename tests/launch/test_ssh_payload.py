"""What an SSH node's agent is told and keeps, where nodes may share one work directory: every
replica writes a log file of its own, even when a joiner takes the rank of a replica still
running or the next incarnation starts while a cut-off node's replicas run on, and every node
keeps an exit record of its own."""

from __future__ import annotations

import asyncio
import json
import re
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from pollux_local.launch.base import LaunchSpec, ReplicaSlot
from pollux_local.launch.node_agent import ExitRecord
from pollux_local.launch.ssh import SshLauncher, SshNodeConfig
from pollux_local.launch.ssh.nodes import UNREACHABLE_EXIT_CODE
from pollux_local.launch.ssh.recovery import RecordUnanswered


def test_a_joiner_writes_its_own_log_file_on_the_node(tmp_path: Path) -> None:
    node = SshNodeConfig(name="b", host="b", devices=("cpu:0", "cpu:1"), workdir="/nfs/u/.pl")
    with tempfile.TemporaryDirectory(prefix="pl", dir="/tmp") as short:  # a socket path's room
        launcher = SshLauncher([node], control_dir=Path(short))
    slots = [
        ReplicaSlot(rank=r, node="b", device=f"cpu:{r}", local_rank=r, node_rank=0) for r in (0, 1)
    ]
    spec = LaunchSpec(
        job_id="7",
        argv=["train.py"],
        workdir=tmp_path,
        env={"POLLUX_RESTARTS": "2"},
        slots=slots,
        log_dir=tmp_path,
    )
    started = launcher.replica_payload(spec, slots[1], node, None, "start #2")
    joined = launcher.replica_payload(spec, slots[1], node, None, "joined", joining=3)
    again = launcher.replica_payload(spec, slots[1], node, None, "joined", joining=4)
    logs = f"/nfs/u/.pl/logs/{launcher.record_key}/7"  # this daemon's (nodes may be shared)
    assert started["log"] == f"{logs}/rank1.start2.log"
    assert joined["log"] == f"{logs}/rank1.start2.join3.log"
    assert len({started["log"], joined["log"], again["log"]}) == 3
    assert started["rank"] == joined["rank"] == 1


def test_the_submitters_umask_goes_to_the_nodes_agent(tmp_path: Path) -> None:
    node = SshNodeConfig(name="b", host="b", devices=("cpu:0",), workdir="/nfs/u/.pl")
    with tempfile.TemporaryDirectory(prefix="pl", dir="/tmp") as short:
        launcher = SshLauncher([node], control_dir=Path(short))
    slot = ReplicaSlot(rank=0, node="b", device="cpu:0", local_rank=0, node_rank=0)

    def payload(umask: int | None) -> dict[str, object]:
        spec = LaunchSpec(job_id="7", argv=["train.py"], workdir=tmp_path, env={},
                          slots=[slot], log_dir=tmp_path, umask=umask)  # fmt: skip
        return dict(launcher.replica_payload(spec, slot, node, None, "start #0"))

    assert payload(0o077)["umask"] == 0o077
    assert "umask" not in payload(None)  # a job stored before: the agent's own


def test_two_daemons_sharing_a_node_write_their_logs_apart(tmp_path: Path) -> None:
    """Two daemons (two state directories) may use one node's work directory: job 1 of each
    is a different user's, and a replica's log must never be one the other daemon's job
    writes (or was handed)."""
    node = SshNodeConfig(name="b", host="b", devices=("cpu:0",), workdir="/nfs/u/.pl")
    slot = ReplicaSlot(rank=0, node="b", device="cpu:0", local_rank=0, node_rank=0)
    spec = LaunchSpec(job_id="1", argv=["t"], workdir=tmp_path, env={}, slots=[slot],
                      log_dir=tmp_path)  # fmt: skip
    logs = []
    for _ in range(2):
        with tempfile.TemporaryDirectory(prefix="pl", dir="/tmp") as short:
            launcher = SshLauncher([node], control_dir=Path(short))
        logs.append(launcher.replica_payload(spec, slot, node, None, "start")["log"])
    assert logs[0] != logs[1]


def test_the_next_incarnation_writes_other_log_files_on_the_node(tmp_path: Path) -> None:
    """A node whose link was cut runs its replicas on until its sshd notices, while the next
    incarnation starts elsewhere: on a shared work directory the two rank 0s must not write
    (and stream) one file.  The incarnation in the name is a number whatever the variable
    holds."""
    node = SshNodeConfig(name="b", host="b", devices=("cpu:0",), workdir="/nfs/u/.pl")
    with tempfile.TemporaryDirectory(prefix="pl", dir="/tmp") as short:
        launcher = SshLauncher([node], control_dir=Path(short))
    slot = ReplicaSlot(rank=0, node="b", device="cpu:0", local_rank=0, node_rank=0)

    def log_of(restarts: str | None) -> str:
        env = {} if restarts is None else {"POLLUX_RESTARTS": restarts}
        spec = LaunchSpec(
            job_id="7", argv=["t"], workdir=tmp_path, env=env, slots=[slot], log_dir=tmp_path
        )
        return str(launcher.replica_payload(spec, slot, node, None, "start")["log"])

    assert log_of("0") != log_of("1") != log_of("2")
    logs = f"/nfs/u/.pl/logs/{launcher.record_key}/7"
    assert log_of(None) == log_of("0") == f"{logs}/rank0.start0.log"
    assert log_of("../../etc/x") == log_of("0")


class LocalNodes(SshLauncher):
    """An SSH launcher whose nodes' commands run here (``sh -c``): every node sees this
    machine's file system, as nodes with one shared work directory do."""

    async def run(
        self, node_name: str, command: str, timeout_s: float = 20.0, stdin: bytes | None = None
    ) -> tuple[int, str, str]:
        proc = await asyncio.create_subprocess_exec(
            "/bin/sh", "-c", command, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
        )
        out, err = await proc.communicate()
        assert proc.returncode is not None
        return proc.returncode, out.decode(), err.decode()


def write_record(path: str, node: str, state: str, workdir: str, token: str = "7:0") -> None:
    """What the node agent of ``node`` writes (``node_agent.ExitRecord``)."""
    spec = {
        "node": node,
        "node_workdir": workdir,
        "record": {"path": path, "token": token},
        "replicas": [],
    }
    record = ExitRecord(spec)
    record.write(
        SimpleNamespace(codes={}, pids={}, start_times={}, orphaned=False, exits=[]),  # type: ignore[arg-type]
        state,
    )


def test_nodes_sharing_a_work_directory_keep_an_exit_record_each(tmp_path: Path) -> None:
    """Two nodes of one job, one work directory: each node's record is its own file and a
    restarted daemon reads each node's from its own (a record naming another node is not
    taken); a record at the path of earlier versions is still read, then both forgotten."""
    shared = str(tmp_path / "work")
    Path(shared).mkdir(mode=0o755)  # as the agent makes it (node_agent.check_workdir)
    nodes = [
        SshNodeConfig(name=n, host=n, workdir=shared, python=sys.executable) for n in ("a", "b/x")
    ]
    with tempfile.TemporaryDirectory(prefix="pl", dir="/tmp") as short:
        launcher = LocalNodes(nodes, control_dir=Path(short))
        paths = [launcher.record_path(node, "7") for node in nodes]
        assert len(set(paths)) == 2
        assert paths[0].endswith("/7@a.json")
        assert re.search(r"/7@b_x-[0-9a-f]{8}\.json$", paths[1]), paths[1]  # not b_x's
        assert (
            launcher.record_path(SshNodeConfig(name="b_x", host="b", workdir=shared), "7")
            != paths[1]
        )
        write_record(paths[0], "a", "ended", shared)
        write_record(paths[1], "b/x", "running", shared)
        read = (
            asyncio.run(launcher.read_record("a", "7")),
            asyncio.run(launcher.read_record("b/x", "7")),
        )
        assert [r and (r["node"], r["state"]) for r in read] == [("a", "ended"), ("b/x", "running")]
        # another node's record where this node's should be: not taken
        write_record(paths[1], "a", "ended", shared)
        assert asyncio.run(launcher.read_record("b/x", "7")) is None
        # an incarnation started before the upgrade: JOB.json, no node in it
        Path(paths[1]).unlink()
        legacy = Path(shared) / "run" / launcher.record_key / "7.json"
        legacy.write_text(json.dumps({"version": 1, "token": "7:0", "state": "running"}))
        old = asyncio.run(launcher.read_record("b/x", "7"))
        assert old is not None and old["state"] == "running"
        asyncio.run(launcher.forget_records("7", ["a", "b/x"], "7:0"))
        assert not legacy.exists() and not Path(paths[0]).exists()


def test_forgetting_an_incarnation_leaves_the_record_of_the_next_one(tmp_path: Path) -> None:
    """The daemon forgets an incarnation's exit records after its end, in the background; by
    then the job may have started again on the node and written its new record at the same
    path (review s67): only a record of the incarnation forgotten is removed."""
    shared = str(tmp_path / "work")
    Path(shared).mkdir(mode=0o755)
    node = SshNodeConfig(name="a", host="a", workdir=shared, python=sys.executable)
    with tempfile.TemporaryDirectory(prefix="pl", dir="/tmp") as short:
        launcher = LocalNodes([node], control_dir=Path(short))
        path = launcher.record_path(node, "7")
        write_record(path, "a", "running", shared, token="7:1")  # the next start's
        asyncio.run(launcher.forget_records("7", ["a"], "7:0"))
        kept = asyncio.run(launcher.read_record("a", "7"))
        assert kept is not None and kept["token"] == "7:1" and kept["state"] == "running"
        assert sorted(p.name for p in Path(path).parent.iterdir()) == [Path(path).name]
        asyncio.run(launcher.forget_records("7", ["a"], "7:1"))  # its own end: removed
        assert not Path(path).exists()
        assert asyncio.run(launcher.read_record("a", "7")) is None


def test_a_restarted_daemon_signals_only_the_processes_its_records_name(tmp_path: Path) -> None:
    """A record read after a daemon's restart names each replica by pid and start time: a
    stop signals the group of a pid that is still that process, and leaves alone a pid the
    node gave to another process since (after a reboot, or once the pids cycled)."""
    import signal
    import subprocess

    from pollux_local.launch.node_agent import start_time
    from pollux_local.launch.ssh.recovery import SshRecordedGroup

    node = SshNodeConfig(name="a", host="a", workdir=str(tmp_path), python=sys.executable)
    replica = subprocess.Popen(["sleep", "60"], start_new_session=True)
    stranger = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        started = start_time(replica.pid)
        assert started is not None
        records = {
            "a": {
                "state": "running",
                "token": "7:0",
                "replicas": [
                    {"rank": 0, "pid": replica.pid, "start_time": started, "exit_code": None},
                    # the record's pid 1 is the stranger's now: it started at another time
                    {"rank": 1, "pid": stranger.pid, "start_time": started - 1, "exit_code": None},
                    # an older agent's record: no start time, never signalled
                    {"rank": 2, "pid": stranger.pid, "exit_code": None},
                ],
            }
        }
        slots = [
            ReplicaSlot(rank=r, node="a", device=f"cpu:{r}", local_rank=r, node_rank=0)
            for r in range(3)
        ]
        spec = LaunchSpec(
            job_id="7", argv=["x"], workdir=tmp_path, env={}, slots=slots, log_dir=tmp_path
        )
        with tempfile.TemporaryDirectory(prefix="pl", dir="/tmp") as short:
            group = SshRecordedGroup(LocalNodes([node], control_dir=Path(short)), spec, records)
            asyncio.run(group._signal("TERM"))
        assert replica.wait(10) == -signal.SIGTERM
        assert stranger.poll() is None, "a process the record does not name was signalled"
    finally:
        for proc in (replica, stranger):
            proc.kill()
            proc.wait()


def test_closing_removes_the_control_dir_once_empty() -> None:
    """A daemon's shared-connection directory (``/run/pollux-ssh-*`` for a long state dir)
    goes with it; one with something still in it stays."""
    node = SshNodeConfig(name="b", host="b.invalid", devices=("cpu:0",), workdir="/nfs/u/.pl")
    with tempfile.TemporaryDirectory(prefix="pl", dir="/tmp") as short:
        empty, busy = Path(short) / "e", Path(short) / "f"
        for control in (empty, busy):
            control.mkdir(mode=0o700)
        (busy / "a-socket-still-there").touch()
        for control in (empty, busy):
            asyncio.run(SshLauncher([node], control_dir=control).close())
        assert not empty.exists() and busy.exists()


class FloodedNodes(LocalNodes):
    """Nodes whose sshd takes no new connection while ``flooded`` (ssh exits 255), as a
    user holding its slots for logins (``MaxStartups``) makes it."""

    flooded = True

    async def run(
        self, node_name: str, command: str, timeout_s: float = 20.0, stdin: bytes | None = None
    ) -> tuple[int, str, str]:
        if self.flooded:
            return 255, "", "kex_exchange_identification: Connection reset by peer"
        return await super().run(node_name, command, timeout_s, stdin)


def test_a_node_that_does_not_answer_is_not_taken_for_one_without_the_record(
    tmp_path: Path,
) -> None:
    """Review s61: a restarted daemon took a node it could not reach (its sshd flooded) for
    a node without the job's exit record, queued the job again, and ran a job that had
    finished there a second time.  A node that does not answer now leaves its part
    unknown: the job is adopted and its record read again until the node answers; only a
    node that says it has no record gets the job queued again."""
    shared = tmp_path / "work"
    shared.mkdir(mode=0o755)
    node = SshNodeConfig(name="a", host="a", workdir=str(shared), python=sys.executable)
    slot = ReplicaSlot(0, "a", "cpu:0", 0, 0)
    spec = LaunchSpec(
        job_id="7", argv=["t"], workdir=tmp_path, env={}, slots=[slot], log_dir=tmp_path
    )
    with tempfile.TemporaryDirectory(prefix="pl", dir="/tmp") as short:
        launcher = FloodedNodes([node], control_dir=Path(short))
        write_record(launcher.record_path(node, "7"), "a", "ended", str(shared))  # it finished

        async def recovered() -> tuple[list[str], int | None, int]:
            with pytest.raises(RecordUnanswered, match="node a did not answer"):
                await launcher.read_record("a", "7")
            group = await launcher.recover(spec, "7:0")
            assert group is not None
            unread, before = group.unread_nodes(), group.poll()
            launcher.flooded = False  # the flood ends
            return unread, before, await asyncio.wait_for(group.wait(), 10)

        unread, before, code = asyncio.run(recovered())
        assert unread == ["a"] and before is None  # waited for, not queued again
        assert code == 0  # its recorded end, once read
        asyncio.run(launcher.forget_records("7", ["a"], "7:0"))
        assert asyncio.run(launcher.recover(spec, "7:0")) is None  # the node has none

        async def unread_then_none() -> tuple[int, float, str | None]:
            launcher.flooded = True
            group = await launcher.recover(spec, "7:0")
            assert group is not None and group.unread_nodes() == ["a"]
            launcher.flooded = False  # it answers now: no record there
            began = time.monotonic()
            code = await asyncio.wait_for(group.wait(), 10)
            return code, time.monotonic() - began, group.failure_reason

        code, took, why = asyncio.run(unread_then_none())
        # lost there at once, not after the wait for an unanswering node
        assert code == UNREACHABLE_EXIT_CODE and took < 5 and "could not be read" in (why or "")


def test_a_recovered_incarnation_forgets_its_own_records_not_the_next_starts(
    tmp_path: Path,
) -> None:
    """A recovered group's spec is built for the job's next start (``POLLUX_RESTARTS`` 3), its
    records are of the incarnation before (``7:2``): forgetting them names ``7:2``, else the
    node keeps them (a record is removed only while it names the incarnation given)."""
    from pollux_local.launch.ssh.recovery import SshRecordedGroup

    asked: list[tuple[str, list[str], str]] = []

    class Forgetting:
        async def forget_records(self, job_id: str, names: list[str], token: str) -> None:
            asked.append((job_id, list(names), token))

    slots = [ReplicaSlot(rank=0, node="a", device="cpu:0", local_rank=0, node_rank=0)]
    spec = LaunchSpec(
        job_id="7", argv=["x"], workdir=tmp_path, env={"POLLUX_RESTARTS": "3"}, slots=slots,
        log_dir=tmp_path,
    )  # fmt: skip
    records = {"a": {"token": "7:2", "state": "ended", "replicas": [{"rank": 0, "exit": 0}]}}
    group = SshRecordedGroup(Forgetting(), spec, records, "7:2")  # type: ignore[arg-type]
    asyncio.run(group.forget())
    unnamed = SshRecordedGroup(Forgetting(), spec, records)  # type: ignore[arg-type]
    asyncio.run(unnamed.forget())
    assert asked == [("7", ["a"], "7:2"), ("7", ["a"], "7:2")]
