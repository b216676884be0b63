"""The per-incarnation supervisor of local launches (``launch/supervisor.py``) with real
processes: its run file, its session, stops it escalates itself, descendants it kills,
adoption by a later daemon, and the replicas' setup as the job's user (a second Unix user,
made for the tests, when run as root)."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import dataclasses
import json
import os
import pwd
import secrets
import shutil
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from pollux_local.api.states import ExitCode
from pollux_local.daemon.jobfiles import make_owned_dir
from pollux_local.errors import PolluxError
from pollux_local.launch.base import LaunchSpec, ReplicaSlot
from pollux_local.launch.local import LocalLauncher, LocalReplicaGroup, RunRecord, read_run_file
from pollux_local.launch.supervisor import (
    EXEC_EXIT_CODE,
    SETUP_EXIT_CODE,
    WORKDIR_EXIT_CODE,
    combine_exit_codes,
    descendants,
    proc_start_time,
)
from tests.labinstall import world_readable_tempdir
from tests.launch.hopper import (
    assert_hopper_gone,
    build_hopper,
    needs_fences,
    stop_hopper,
    wait_hopping,
)
from tests.launch.oomscore import can_lower_oom_score
from tests.paths import REPO_ROOT
from tests.pids import take_pid

pytestmark = pytest.mark.timeout(60)


#: A shell job (``sh -c ESCAPEE escapee PIDFILE MODE``) that leaves a grandchild in a session of
#: its own, ignoring SIGTERM and SIGHUP, which writes its pid to PIDFILE; then it waits
#: (ignoring SIGTERM too when MODE is "stubborn").
ESCAPEE = """
setsid sh -c 'trap "" TERM HUP; echo $$ > "$0.tmp"; mv "$0.tmp" "$0"; while :; do sleep 0.2; done' "$1" \\
    </dev/null >/dev/null 2>&1 &
[ "$2" = stubborn ] && trap "" TERM
while :; do sleep 0.2; done
"""


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def wait_until(predicate, timeout_s: float, what: str):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(0.05)


def make_spec(
    job_dir: Path,
    argv: list[str],
    workdir: Path,
    replicas: int = 1,
    env: dict[str, str] | None = None,
    run_as_uid: int | None = None,
) -> LaunchSpec:
    slots = [ReplicaSlot(rank, "local", f"cpu:{rank}", rank, 0) for rank in range(replicas)]
    return LaunchSpec(
        job_id="7",
        argv=argv,
        workdir=workdir,
        env={
            "PATH": "/usr/local/bin:/usr/bin:/bin",
            "POLLUX_JOB_ID": "7",
            "POLLUX_JOB_DIR": str(job_dir),
            **(env or {}),
        },
        slots=slots,
        log_dir=job_dir,
        run_as=pwd.getpwuid(run_as_uid).pw_name if run_as_uid is not None else None,
        run_as_uid=run_as_uid,
    )


@pytest.fixture()
def launcher(tmp_path: Path) -> LocalLauncher:
    return LocalLauncher(run_dir=tmp_path / "run", stop_grace_s=1.0)


def test_combine_exit_codes_matches_the_contract() -> None:
    assert ExitCode.RESCALE == 75
    assert combine_exit_codes([0, 0]) == 0
    assert combine_exit_codes([75, 0]) == 75
    assert combine_exit_codes([75, -9, 3]) == -9
    assert len({EXEC_EXIT_CODE, SETUP_EXIT_CODE, WORKDIR_EXIT_CODE, 0, 75}) == 5


@pytest.mark.asyncio
async def test_run_file_while_running_and_after(launcher: LocalLauncher, tmp_path: Path) -> None:
    secret = "SECRET-" + secrets.token_hex(6)
    go = tmp_path / "go"
    script = 'trap "" TERM; while [ ! -e "$0" ]; do sleep 0.05; done; exit 3'
    spec = make_spec(
        tmp_path / "job", ["sh", "-c", script, str(go)], tmp_path, replicas=2,
        env={"TOKEN": secret},
    )  # fmt: skip
    group = await launcher.launch(spec)
    run_file = launcher.run_file("7")
    assert stat.S_IMODE(run_file.stat().st_mode) == 0o600
    running = read_run_file(run_file)
    assert running is not None and running["state"] == "running"
    sup = running["supervisor"]
    assert sup["pid"] == group.supervisor_pid
    assert sup["start_time"] == proc_start_time(group.supervisor_pid)
    assert {r["rank"]: r["pid"] for r in running["replicas"]} == dict(group.pids())
    assert running["exit_code"] is None
    # its own session (it outlives the daemon); the replicas share one other process group
    assert os.getsid(group.supervisor_pid) == group.supervisor_pid != os.getsid(0)
    pgids = {os.getpgid(pid) for pid in group.pids().values()}
    assert pgids == {group.pgid} and group.pgid != group.supervisor_pid
    # the replicas' environment never shows in the supervisor's command line or environment
    for part in ("cmdline", "environ"):
        assert secret.encode() not in Path(f"/proc/{group.supervisor_pid}/{part}").read_bytes()

    go.touch()
    assert await asyncio.wait_for(group.wait(), 20) == 3
    ended = read_run_file(run_file)
    assert ended is not None and ended["state"] == "ended" and ended["exit_code"] == 3
    assert [r["exit_code"] for r in ended["replicas"]] == [3, 3]
    assert ended["ended"] >= ended["started"]
    assert not alive(group.supervisor_pid)


@pytest.mark.asyncio
@pytest.mark.skipif(
    not can_lower_oom_score(), reason="lowering oom_score_adj takes CAP_SYS_RESOURCE"
)
async def test_the_oom_killer_spares_the_supervisor_not_the_job(
    launcher: LocalLauncher, tmp_path: Path
) -> None:
    """A job filling the memory must not end its supervisor (what it left in a session of its
    own would outlive the incarnation): the supervisor protects itself, and the replica takes
    back the score the daemon had."""
    before = Path("/proc/self/oom_score_adj").read_text().strip()
    script = "cat /proc/self/oom_score_adj; sleep 30"
    spec = make_spec(tmp_path / "job", ["sh", "-c", script], tmp_path)
    group = await launcher.launch(spec)
    try:
        log = tmp_path / "job" / "rank0.log"
        wait_until(lambda: log.exists() and log.read_text().strip(), 20, "the replica's line")
        supervisor = Path(f"/proc/{group.supervisor_pid}/oom_score_adj").read_text().strip()
    finally:
        await group.stop(grace_s=1.0)
    assert supervisor == "-1000"
    assert log.read_text().strip().splitlines()[-1] == before != supervisor


@pytest.mark.asyncio
async def test_a_command_as_large_as_a_request_allows_runs(
    launcher: LocalLauncher, tmp_path: Path
) -> None:
    """Two arguments of 131,000 control characters (``Submit`` allows 131,072 each) are 1.5 MB
    in the run file's JSON: over the 1 MiB its reader took, the job was recorded as ended
    without a result and its supervisor killed."""
    big = "\x01" * 131_000
    spec = make_spec(tmp_path / "job", ["sh", "-c", "exit 4", big, big], tmp_path)
    group = await launcher.launch(spec)
    assert await asyncio.wait_for(group.wait(), 30) == 4


@pytest.mark.asyncio
async def test_stop_kills_a_setsid_grandchild_that_ignores_sigterm(
    launcher: LocalLauncher, tmp_path: Path
) -> None:
    pidfile = tmp_path / "grandchild"
    spec = make_spec(tmp_path / "job", ["sh", "-c", ESCAPEE, "escapee", str(pidfile), ""], tmp_path)
    group = await launcher.launch(spec)
    grandchild = int(wait_until(lambda: pidfile.exists() and pidfile.read_text(), 10, "pid"))
    assert alive(grandchild) and os.getsid(grandchild) == grandchild  # it escaped the group
    started = time.monotonic()
    code = await group.stop(grace_s=5.0)
    assert code == -signal.SIGTERM  # the replica took the SIGTERM; no grace was needed
    assert time.monotonic() - started < 4.0
    assert not alive(grandchild), "the setsid grandchild outlived its job"
    assert not alive(group.supervisor_pid)


@pytest.mark.asyncio
async def test_leftovers_are_killed_when_the_replicas_end(
    launcher: LocalLauncher, tmp_path: Path
) -> None:
    pidfile = tmp_path / "left"
    script = f"""(trap "" TERM HUP; exec sleep 60) & echo $! > {pidfile}
setsid sh -c 'trap "" TERM HUP; while :; do sleep 0.2; done' </dev/null >/dev/null 2>&1 &
echo $! >> {pidfile}
exit 0
"""
    group = await launcher.launch(make_spec(tmp_path / "job", ["sh", "-c", script], tmp_path))
    assert await asyncio.wait_for(group.wait(), 20) == 0
    left = [int(line) for line in pidfile.read_text().split()]
    assert len(left) == 2
    wait_until(lambda: not any(alive(pid) for pid in left), 5, "the leftovers to be killed")


@pytest.mark.asyncio
@pytest.mark.parametrize("how", ["ends", "cancelled"])
async def test_a_process_that_keeps_changing_its_pid_does_not_outlive_its_job(
    launcher: LocalLauncher, tmp_path: Path, how: str
) -> None:
    """A job's helper that forks and exits in a loop, a new session at every hop, is ended
    with its job (the incarnation's fence cgroup: ``node_agent.Fence``), whether the replicas
    end by themselves or are stopped; listing its pids and signalling each never catches it."""
    needs_fences()
    hops = tmp_path / "hops"
    hops.mkdir()
    wait = "sleep 1; exit 0" if how == "ends" else "while :; do sleep 0.2; done"
    script = f'"$0" {hops} & {wait}'
    spec = make_spec(tmp_path / "job", ["sh", "-c", script, str(build_hopper(tmp_path))], tmp_path)
    group = await launcher.launch(spec)
    try:
        wait_hopping(hops, 20)
        if how == "ends":
            assert await asyncio.wait_for(group.wait(), 30) == 0
        else:
            await asyncio.wait_for(group.stop(grace_s=1.0), 30)
        assert_hopper_gone(hops, "its job")
    finally:
        stop_hopper(hops)


#: A supervisor that fails right after it started the replicas, once the job's hopper hops:
#: killed outright (``killed``) or by an exception of its own (``raises``).
FAULTY_SUPERVISOR = r"""
import os, signal, sys, time
from pathlib import Path
import pollux_local.launch.supervisor as supervisor

HOPS, HOW = Path(sys.argv[1]), sys.argv[2]
original = supervisor.Supervisor.start

def start_then_fail(self):
    original(self)
    deadline = time.monotonic() + 20
    while not (HOPS / "beat").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    if HOW == "killed":
        os.kill(os.getpid(), signal.SIGKILL)
    raise RuntimeError("a fault of the supervisor's own")

supervisor.Supervisor.start = start_then_fail
supervisor.main()
"""


@pytest.mark.asyncio
@pytest.mark.parametrize("how", ["killed", "raises"])
async def test_a_supervisor_failing_while_it_starts_the_replicas_leaves_nothing_running(
    launcher: LocalLauncher, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """The run file lists the fence before any replica starts: a supervisor killed after it
    started them (before it could say so) has its fence ended by the daemon, which fails
    the start; one that fails by an exception ends it itself.  Its replicas' helper that
    keeps changing its pid is gone either way."""
    needs_fences()
    hops = tmp_path / "hops"
    hops.mkdir()
    faulty = tmp_path / "faulty_supervisor.py"
    faulty.write_text(FAULTY_SUPERVISOR)
    python = tmp_path / "python"
    python.write_text(f"#!/bin/sh\nexec {sys.executable} {faulty} {hops} {how}\n")
    python.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(python))
    script = f'"$0" {hops} & while :; do sleep 0.2; done'
    spec = make_spec(tmp_path / "job", ["sh", "-c", script, str(build_hopper(tmp_path))], tmp_path)
    try:
        with pytest.raises(PolluxError, match="the job's supervisor failed") as failed:
            await launcher.launch(spec)
        assert (hops / "beat").exists(), "the hopper never started: nothing was tested"
        if how == "raises":
            assert "a fault of the supervisor's own" in str(failed.value)
        assert_hopper_gone(hops, f"its supervisor ({how})")
        assert launcher.records() == {}
    finally:
        stop_hopper(hops)


@pytest.mark.asyncio
async def test_what_a_leaving_rank_started_ends_when_it_leaves_at_a_warm_shrink(
    launcher: LocalLauncher, tmp_path: Path
) -> None:
    """At a warm shrink, what the leaving replica started (a pid hopper) is killed when it
    leaves (its group below the fence), before ``resize_warm`` returns and the daemon gives
    its device to another job, while the replica that stays runs on."""
    needs_fences()
    from pollux_local.api.resize import ResizeOrder

    hops = tmp_path / "hops"
    hops.mkdir()
    hopper = build_hopper(tmp_path)
    order_file = tmp_path / "resize" / "7-0.json"
    order_file.parent.mkdir()
    script = f"""[ "$RANK" = 1 ] && {hopper} {hops} </dev/null >/dev/null 2>&1 &
while [ ! -f "$POLLUX_RESIZE_FILE" ]; do sleep 0.05; done
[ "$RANK" = 0 ] && sleep 3
exit 0
"""
    env = {"POLLUX_RESIZE_FILE": str(order_file)}

    def spec_of(replicas: int) -> LaunchSpec:
        made = make_spec(tmp_path / "job", ["sh", "-c", script], tmp_path, replicas, env)
        return dataclasses.replace(made, resize_file=order_file)

    group = await launcher.launch(spec_of(2))
    try:
        wait_hopping(hops, 20)
        order = ResizeOrder(generation=1001, world_size=1, master_addr="127.0.0.1", master_port=1)
        assert await group.resize_warm(spec_of(1), order, ready_timeout_s=20) is None
        assert_hopper_gone(hops, "the rank that left")
        assert sorted(group.pids()) == [0]  # rank 0 runs on
        assert await asyncio.wait_for(group.wait(), 20) == 0
    finally:
        stop_hopper(hops)


@pytest.mark.asyncio
async def test_the_supervisor_escalates_to_sigkill_on_its_own(
    launcher: LocalLauncher, tmp_path: Path
) -> None:
    pidfile = tmp_path / "grandchild"
    spec = make_spec(
        tmp_path / "job", ["sh", "-c", ESCAPEE, "escapee", str(pidfile), "stubborn"], tmp_path
    )
    group = await launcher.launch(spec)
    grandchild = int(wait_until(lambda: pidfile.exists() and pidfile.read_text(), 10, "pid"))
    # a SIGTERM from anyone (no control file: the launcher's grace, 1 s) is enough
    started = time.monotonic()
    os.kill(group.supervisor_pid, signal.SIGTERM)
    assert await asyncio.wait_for(group.wait(), 10) == -signal.SIGKILL
    assert 0.9 < time.monotonic() - started < 5
    assert not alive(grandchild)


@pytest.mark.asyncio
async def test_stop_waits_only_as_long_as_asked(launcher: LocalLauncher, tmp_path: Path) -> None:
    spec = make_spec(tmp_path / "job", ["sh", "-c", 'trap "" TERM; while :; do sleep 0.1; done'],
                     tmp_path)  # fmt: skip
    group = await launcher.launch(spec)
    started = time.monotonic()
    assert await group.stop(grace_s=0.3) == -signal.SIGKILL  # the control file's grace
    assert time.monotonic() - started < 3


HELPER = r"""
import asyncio, json, sys
from pathlib import Path
from pollux_local.launch.base import LaunchSpec, ReplicaSlot
from pollux_local.launch.local import LocalLauncher

async def main():
    run_dir, work, script = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
    spec = LaunchSpec("7", ["sh", "-c", script], work, {"PATH": "/usr/bin:/bin"},
                      [ReplicaSlot(0, "local", "cpu:0", 0, 0)], work / "job")
    group = await LocalLauncher(run_dir=run_dir, stop_grace_s=5).launch(spec)
    print(json.dumps({"supervisor": group.supervisor_pid, "pids": group.pids()}), flush=True)
    await asyncio.sleep(120)

asyncio.run(main())
"""


def launch_from_a_daemon_that_dies(tmp_path: Path, script: str) -> dict[str, object]:
    """Launch from another process (a daemon), then SIGKILL that process."""
    helper = subprocess.Popen(
        [sys.executable, "-c", HELPER, str(tmp_path / "run"), str(tmp_path), script],
        stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
    )  # fmt: skip
    assert helper.stdout is not None
    line = helper.stdout.readline()
    helper.kill()
    helper.wait(10)
    return dict(json.loads(line))


@pytest.mark.asyncio
async def test_a_later_daemon_adopts_a_running_supervisor(tmp_path: Path) -> None:
    script = 'trap "exit 75" TERM; while :; do sleep 0.1; done'
    info = launch_from_a_daemon_that_dies(tmp_path, script)
    supervisor = int(info["supervisor"])  # type: ignore[call-overload]
    assert alive(supervisor)  # it outlived the process that started it
    try:
        later = LocalLauncher(run_dir=tmp_path / "run", stop_grace_s=5)
        records = later.records()
        assert set(records) == {"7"} and records["7"].supervisor_alive()
        group = later.adopt(records["7"])
        assert group is not None and group.supervisor_pid == supervisor
        assert {str(k): v for k, v in group.pids().items()} == info["pids"]
        await asyncio.sleep(0.2)
        assert group.poll() is None
        assert await group.stop(grace_s=5) == ExitCode.RESCALE
        assert not alive(supervisor)
    finally:
        with contextlib.suppress(OSError):
            os.kill(supervisor, signal.SIGKILL)


@pytest.mark.asyncio
async def test_a_result_recorded_while_no_daemon_watched_is_taken_in(tmp_path: Path) -> None:
    info = launch_from_a_daemon_that_dies(tmp_path, "sleep 0.5; exit 0")
    supervisor = int(info["supervisor"])  # type: ignore[call-overload]
    wait_until(lambda: not alive(supervisor), 10, "the supervisor to end")
    later = LocalLauncher(run_dir=tmp_path / "run")
    record = later.records()["7"]
    assert record.finished and record.exit_code == 0 and not record.supervisor_alive()
    group = later.adopt(record)
    assert group is not None
    assert await asyncio.wait_for(group.wait(), 5) == 0
    later.forget("7")
    assert later.records() == {}


@pytest.mark.asyncio
async def test_a_group_adopted_while_its_replicas_started_learns_them_from_its_run_file(
    tmp_path: Path,
) -> None:
    """A daemon restarted while a supervisor was still starting the replicas adopts a run
    file that says ``starting`` and names none; the group reads them from it once the
    supervisor has written them (before, it kept none: its processes looked like someone
    else's on its devices)."""
    from pollux_local.launch.local import _Watched

    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    path = run / "7.json"

    def write(state: str, replicas: list[dict[str, object]]) -> None:
        path.write_text(
            json.dumps({"version": 1, "job_id": "7", "state": state,
                        "supervisor": {"pid": os.getpid(), "start_time": None, "boot_id": ""},
                        "pgid": 0, "replicas": replicas, "launch": {}})
        )  # fmt: skip
        path.chmod(0o600)

    write("starting", [])
    spec = make_spec(tmp_path / "job", ["true"], tmp_path)
    watched = _Watched(os.getpid(), proc_start_time(os.getpid()))
    group = LocalReplicaGroup(spec, path, run / "7.control", watched, 0, {})
    try:
        assert group.pids() == {}
        me = os.getpid()
        write("running", [{"rank": 0, "pid": me, "start_time": proc_start_time(me)}])
        assert group.pids() == {0: me}
    finally:
        group._watcher.cancel()


def test_a_dead_supervisor_without_a_result_is_not_adopted(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    (run / "7.json").write_text(
        json.dumps({"version": 1, "job_id": "7", "state": "running",
                    "supervisor": {"pid": 2**22 + 5, "start_time": 1, "boot_id": ""},
                    "pgid": 0, "replicas": [], "launch": {}})
    )  # fmt: skip
    (run / "7.json").chmod(0o600)
    record = RunRecord.load(run / "7.json")
    assert record is not None and not record.supervisor_alive()
    assert LocalLauncher(run_dir=run).adopt(record) is None


# --- setup failures: one line, a distinct code, nothing run --------------------------------------


@pytest.mark.asyncio
async def test_a_missing_workdir_fails_the_launch_naming_it(
    launcher: LocalLauncher, tmp_path: Path
) -> None:
    missing = tmp_path / "no-such-dir"
    spec = make_spec(tmp_path / "job", ["sh", "-c", "touch ran"], missing)
    with pytest.raises(PolluxError, match=f"cannot enter working directory {missing}"):
        await launcher.launch(spec)
    log = (tmp_path / "job" / "rank0.log").read_text()
    assert f"cannot enter working directory {missing}" in log
    assert launcher.records() == {}


@pytest.mark.asyncio
async def test_a_setup_failure_reaches_a_capped_log_too(tmp_path: Path) -> None:
    """With ``max_log_bytes`` the log goes through a copier (``logcap``): the failed replica's
    line is written out before the incarnation is killed, not lost with the copier."""
    missing = tmp_path / "no-such-dir"
    launcher = LocalLauncher(run_dir=tmp_path / "run", max_log_bytes=1 << 20)
    spec = make_spec(tmp_path / "job", ["sh", "-c", "touch ran"], missing)
    with pytest.raises(PolluxError, match=f"cannot enter working directory {missing}"):
        await launcher.launch(spec)
    log = (tmp_path / "job" / "rank0.log").read_text()
    assert f"cannot enter working directory {missing}" in log


@pytest.mark.asyncio
async def test_a_command_that_cannot_run_fails_the_launch(
    launcher: LocalLauncher, tmp_path: Path
) -> None:
    spec = make_spec(tmp_path / "job", ["no-such-program-here"], tmp_path, replicas=2)
    with pytest.raises(PolluxError, match="cannot execute no-such-program-here"):
        await launcher.launch(spec)


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", ["symlink", "fifo"])
async def test_a_log_that_is_not_a_plain_file_is_refused(
    launcher: LocalLauncher, tmp_path: Path, kind: str
) -> None:
    job_dir = tmp_path / "job"
    job_dir.mkdir()
    target = tmp_path / "precious"
    target.write_text("keep me\n")
    target.chmod(0o600)
    before = target.stat()
    if kind == "symlink":
        (job_dir / "rank0.log").symlink_to(target)
    else:
        os.mkfifo(job_dir / "rank0.log")
    spec = make_spec(job_dir, ["sh", "-c", "echo written"], tmp_path)
    started = time.monotonic()
    with pytest.raises(PolluxError, match="rank0.log is (a symlink|not a regular file)"):
        await launcher.launch(spec)
    assert time.monotonic() - started < 10
    assert target.read_text() == "keep me\n"
    assert target.stat().st_mtime_ns == before.st_mtime_ns


# --- as the job's user (root only) ---------------------------------------------------------------


@pytest.fixture(scope="module")
def other_user() -> Iterator[pwd.struct_passwd]:
    """A second Unix user, made for these tests and deleted after them."""
    if os.geteuid() != 0:
        pytest.skip("needs root (a second Unix user)")
    if shutil.which("useradd") is None or shutil.which("userdel") is None:
        pytest.skip("needs useradd and userdel")
    name = "pxsv" + secrets.token_hex(3)
    subprocess.run(["useradd", "-M", "-s", "/bin/sh", name], check=True, capture_output=True)
    entry = pwd.getpwnam(name)
    try:
        yield entry
    finally:
        for proc in psutil.process_iter(["uids"]):
            with contextlib.suppress(psutil.Error):
                if proc.info["uids"] and entry.pw_uid in (proc.info["uids"].real,):
                    proc.kill()
        subprocess.run(["userdel", name], capture_output=True)


@pytest.fixture()
def lab_dir() -> Iterator[Path]:
    base = world_readable_tempdir("pollux-sup-")
    (base / "jobs").mkdir(mode=0o755)
    try:
        yield base
    finally:
        shutil.rmtree(base, ignore_errors=True)


@pytest.mark.asyncio
async def test_replicas_run_as_the_user_who_owns_their_files(
    other_user: pwd.struct_passwd, lab_dir: Path
) -> None:
    uid, gid = other_user.pw_uid, other_user.pw_gid
    job_dir = make_owned_dir(lab_dir / "jobs", "7", uid, gid)
    checkpoint = job_dir / "checkpoint"
    script = 'C=$POLLUX_CHECKPOINT_DIR; id -u > "$C/who$RANK"; pwd -P >> "$C/who$RANK"'
    spec = make_spec(
        job_dir, ["sh", "-c", script], Path("/tmp"), replicas=2,
        env={"POLLUX_CHECKPOINT_DIR": str(checkpoint)}, run_as_uid=uid,
    )  # fmt: skip
    launcher = LocalLauncher(run_dir=lab_dir / "run")
    group = await launcher.launch(spec)
    sup = psutil.Process(group.supervisor_pid)
    assert sup.uids().real == 0  # the supervisor is the daemon's user's
    assert await asyncio.wait_for(group.wait(), 20) == 0
    for path in (job_dir, checkpoint, job_dir / "rank0.log", job_dir / "rank1.log"):
        info = path.lstat()
        assert (info.st_uid, info.st_gid) == (uid, gid), path
    for rank in (0, 1):
        assert (checkpoint / f"who{rank}").read_text().split() == [str(uid), "/tmp"]
    run_file = launcher.run_file("7").lstat()
    assert run_file.st_uid == 0 and stat.S_IMODE(run_file.st_mode) == 0o600


@pytest.mark.asyncio
async def test_a_workdir_the_user_cannot_enter_fails_and_nothing_runs_there(
    other_user: pwd.struct_passwd, lab_dir: Path
) -> None:
    uid = other_user.pw_uid
    job_dir = make_owned_dir(lab_dir / "jobs", "7", uid, other_user.pw_gid)
    private = lab_dir / "roots-private"
    private.mkdir(mode=0o700)
    spec = make_spec(job_dir, ["sh", "-c", "touch ran; ls > listing"], private, run_as_uid=uid)
    with pytest.raises(PolluxError, match=f"cannot enter working directory {private}"):
        await LocalLauncher(run_dir=lab_dir / "run").launch(spec)
    assert list(private.iterdir()) == []
    assert f"cannot enter working directory {private}" in (job_dir / "rank0.log").read_text()


@pytest.mark.asyncio
async def test_a_log_symlinked_to_a_root_only_file_is_not_opened_for_the_user(
    other_user: pwd.struct_passwd, lab_dir: Path
) -> None:
    uid = other_user.pw_uid
    job_dir = make_owned_dir(lab_dir / "jobs", "7", uid, other_user.pw_gid)
    vault = lab_dir / "vault"
    vault.mkdir(mode=0o700)
    secret = vault / "secret"
    secret.write_text("root only\n")
    secret.chmod(0o600)
    before = secret.stat()
    (job_dir / "rank0.log").symlink_to(secret)
    os.lchown(job_dir / "rank0.log", uid, other_user.pw_gid)
    spec = make_spec(job_dir, ["sh", "-c", "echo appended"], Path("/tmp"), run_as_uid=uid)
    with pytest.raises(PolluxError, match="rank0.log is a symlink"):
        await LocalLauncher(run_dir=lab_dir / "run").launch(spec)
    after = secret.stat()
    assert secret.read_text() == "root only\n"
    assert (after.st_uid, after.st_mode, after.st_mtime_ns) == (
        before.st_uid,
        before.st_mode,
        before.st_mtime_ns,
    )


#: A replica of a warm resize, in shell: rank 0 waits for the order and keeps it; a joiner
#: notes who it runs as, announces itself ready (its file in the job directory) and exits 0 once
#: the order is there (or 3 at once when FAIL_JOIN is set, before announcing anything).
WARM_REPLICA = r"""
C=$POLLUX_CHECKPOINT_DIR
if [ -n "$POLLUX_RESIZE_JOIN" ]; then
  [ -n "$FAIL_JOIN" ] && exit 3
  [ -n "$NEVER_READY" ] && exec sleep 60
  id -u > "$C/joiner$RANK"
  touch "$POLLUX_JOB_DIR/resize-ready-$POLLUX_RESIZE_JOIN-$RANK"
fi
for i in $(seq 200); do
  if [ -f "$POLLUX_RESIZE_FILE" ]; then cat "$POLLUX_RESIZE_FILE" > "$C/seen$RANK"; exit 0; fi
  sleep 0.05
done
exit 9
"""


async def warm_grow(
    user: pwd.struct_passwd, lab_dir: Path, ready_timeout_s: float = 20, **env: str
) -> tuple[LocalLauncher, object, str | None, Path, Path]:
    """A one-replica group of ``user``'s grown to two in place: (launcher, group, what
    ``resize_warm`` said, the job's checkpoint directory, the order file)."""
    from pollux_local.api.resize import ResizeOrder

    uid, gid = user.pw_uid, user.pw_gid
    job_dir = make_owned_dir(lab_dir / "jobs", "7", uid, gid)
    checkpoint = job_dir / "checkpoint"
    orders = lab_dir / "resize"
    orders.mkdir(mode=0o755)
    order_file = orders / "7-0.json"
    common = {"POLLUX_CHECKPOINT_DIR": str(checkpoint), "POLLUX_RESIZE_FILE": str(order_file)}
    spec = make_spec(
        job_dir, ["sh", "-c", WARM_REPLICA], Path("/tmp"), env={**common, **env}, run_as_uid=uid
    )
    spec = dataclasses.replace(spec, resize_file=order_file)
    launcher = LocalLauncher(run_dir=lab_dir / "run")
    group = await launcher.launch(spec)
    grown = make_spec(
        job_dir, ["sh", "-c", WARM_REPLICA], Path("/tmp"), replicas=2,
        env={**common, **env}, run_as_uid=uid,
    )  # fmt: skip
    grown = dataclasses.replace(grown, resize_file=order_file)
    order = ResizeOrder(generation=1001, world_size=2, master_addr="127.0.0.1", master_port=29999)
    said = await group.resize_warm(grown, order, ready_timeout_s=ready_timeout_s)
    return launcher, group, said, checkpoint, order_file


@pytest.mark.asyncio
async def test_a_warm_grow_starts_the_joiner_as_the_user_and_orders_once_it_is_ready(
    other_user: pwd.struct_passwd, lab_dir: Path
) -> None:
    launcher, group, said, checkpoint, order_file = await warm_grow(other_user, lab_dir)
    assert said is None
    assert isinstance(group, LocalReplicaGroup)
    assert await asyncio.wait_for(group.wait(), 20) == 0
    assert (checkpoint / "joiner1").read_text().split() == [str(other_user.pw_uid)]
    info = order_file.lstat()  # the supervisor's (root's), readable by the job
    assert info.st_uid == 0 and stat.S_IMODE(info.st_mode) == 0o644
    for rank in (0, 1):
        assert json.loads((checkpoint / f"seen{rank}").read_text())["world_size"] == 2
    assert sorted(group.pids()) == [0, 1] and [s.device for s in group.spec.slots] == [
        "cpu:0",
        "cpu:1",
    ]
    record = RunRecord.load(launcher.run_file("7"))
    assert record is not None and record.warm is not None and record.warm["state"] == "ordered"


@pytest.mark.asyncio
async def test_a_joiner_that_fails_before_it_is_ready_fails_only_the_resize(
    other_user: pwd.struct_passwd, lab_dir: Path
) -> None:
    launcher, group, said, checkpoint, order_file = await warm_grow(
        other_user, lab_dir, FAIL_JOIN="1"
    )
    assert said == "joining rank 1 exited with 3 first"
    assert isinstance(group, LocalReplicaGroup)
    assert [s.rank for s in group.spec.slots] == [0]  # the group is as it was
    assert not order_file.exists()  # rank 0 never saw an order
    order_file.write_text("{}")  # let rank 0 end: its exit, not the joiner's, is the group's
    assert await asyncio.wait_for(group.wait(), 20) == 0
    assert group.exit_codes() == {0: 0}


@pytest.mark.asyncio
async def test_a_joiner_given_up_at_the_ready_deadline_fails_only_the_resize(
    other_user: pwd.struct_passwd, lab_dir: Path
) -> None:
    """A joiner not ready in time is killed and the resize fails; its exit (SIGKILL, the
    supervisor's own doing) is not the job's: the replica that runs is not stopped as if
    a peer had crashed, and the group's exit code is that replica's (review s60 read the
    kill counted as the job's first failure)."""
    launcher, group, said, checkpoint, order_file = await warm_grow(
        other_user, lab_dir, ready_timeout_s=0.5, NEVER_READY="1"
    )
    assert said == "the joining replicas were not ready in time"
    assert isinstance(group, LocalReplicaGroup)
    await asyncio.sleep(1.0)
    assert group.poll() is None  # rank 0 runs on
    order_file.write_text("{}")  # let rank 0 end
    assert await asyncio.wait_for(group.wait(), 20) == 0
    assert group.exit_codes() == {0: 0}


def test_descendants_walks_the_process_tree() -> None:
    child = subprocess.Popen(["sh", "-c", "sleep 30 & wait"])
    try:
        wait_until(lambda: len(descendants(child.pid)) >= 1, 5, "the grandchild")
        assert child.pid in descendants(os.getpid())
    finally:
        for pid in descendants(child.pid):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        child.kill()
        child.wait()


def test_the_supervisor_looks_for_the_ready_files_the_job_library_makes() -> None:
    """The supervisor (standard library only) names a joiner's ready file as
    ``api.resize.ready_name`` does."""
    from pollux_local.api.resize import ready_name
    from pollux_local.launch.supervisor import READY_NAME

    for generation, rank in ((1, 1), (3002, 7)):
        assert READY_NAME.format(generation=generation, rank=rank) == ready_name(generation, rank)


#: A two-replica job (``python -c GROUP_LEAVER``): rank 0 ends at once; rank 1 leaves the
#: job's process group for one of its own and waits.  The group, whose id was rank 0's pid,
#: is then empty: the id is free to be given to another process's new group.
GROUP_LEAVER = """
import os, time
if os.environ["RANK"] == "0":
    raise SystemExit(0)
os.setpgid(0, 0)
open(os.environ["POLLUX_JOB_DIR"] + "/left", "w").close()
time.sleep(60)
"""


def test_a_group_is_signalled_only_while_one_of_its_own_is_in_it() -> None:
    from pollux_local.launch.supervisor import signal_group_of

    stranger = subprocess.Popen(["sleep", "60"], start_new_session=True)
    ours = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        mine = (ours.pid, proc_start_time(ours.pid))
        # the stranger's group, with only ours (in another group) known: not signalled
        assert not signal_group_of(stranger.pid, signal.SIGKILL, [mine])
        gone = (stranger.pid, (proc_start_time(stranger.pid) or 0) + 1)  # another process's
        assert not signal_group_of(stranger.pid, signal.SIGKILL, [gone])
        time.sleep(0.1)
        assert stranger.poll() is None
        # a member known to be in the group: signalled
        assert signal_group_of(ours.pid, signal.SIGKILL, [mine])
        assert ours.wait(5) == -signal.SIGKILL
    finally:
        for proc in (stranger, ours):
            proc.kill()
            proc.wait()


@pytest.mark.asyncio
@pytest.mark.skipif(os.geteuid() != 0, reason="giving a chosen pid needs root (ns_last_pid)")
async def test_a_stop_does_not_signal_a_group_that_took_the_jobs_group_id(
    launcher: LocalLauncher, tmp_path: Path
) -> None:
    """Rank 0 (whose pid is the group's id) ends, rank 1 leaves the group: another process
    given that pid as its new group's id (a user who cycles the pids can make that happen)
    must survive the job's stop, which the supervisor sends as root."""
    job_dir = tmp_path / "job"
    spec = make_spec(job_dir, [sys.executable, "-c", GROUP_LEAVER], tmp_path, replicas=2)
    group = await launcher.launch(spec)
    leader = group.pids()[0]
    wait_until(lambda: (job_dir / "left").exists() and not alive(leader), 20, "rank 0 gone")
    wait_until(lambda: proc_start_time(leader) is None, 10, "rank 0 reaped")
    try:
        stranger = take_pid(leader)
    except OSError as exc:  # a read-only /proc/sys (some containers)
        await group.stop(grace_s=1.0)
        pytest.skip(f"cannot choose the next pid here: {exc}")
    if stranger is None:
        await group.stop(grace_s=1.0)
        pytest.skip(f"could not give pid {leader} to a new process (the machine took it)")
    try:
        assert os.getpgid(stranger.pid) == leader  # the job's old group id, now its
        await group.stop(grace_s=1.0)
        # the group ends once the supervisor's SIGKILL reaches rank 1 (on a loaded machine
        # that can come after stop() stopped waiting)
        await asyncio.wait_for(group.wait(), 20)
        assert stranger.poll() is None, "the stop signalled another process's group"
        # rank 1 (rank 0's pid is the stranger's now) dies of the SIGKILL when next
        # scheduled, which on a loaded machine can come after the supervisor's end
        rank1 = group.pids()[1]
        wait_until(lambda: not alive(rank1), 10, "rank 1 killed")
    finally:
        stranger.kill()
        stranger.wait()


def test_a_replica_setting_up_cannot_be_stopped_by_its_user(
    other_user: pwd.struct_passwd,
) -> None:
    """While a replica's child sets itself up as the job's user, only its effective ids are
    the user's: a ``kill -STOP`` of the user's is refused (it would hold the supervisor and
    the daemon waiting for the start).  Once settled, right before ``exec``, every id is the
    user's."""
    from pollux_local.launch.identity import become_user_for_setup, settle_ids

    uid, gid = other_user.pw_uid, other_user.pw_gid
    user = {"uid": uid, "gid": gid, "groups": [gid]}
    child_reads, parent_writes = os.pipe()
    parent_reads, child_writes = os.pipe()
    pid = os.fork()
    if pid == 0:  # the replica's child, as the supervisor forks it
        code = 1
        try:
            os.close(parent_writes)
            os.close(parent_reads)
            become_user_for_setup(user)
            os.write(child_writes, f"{os.getresuid()} {os.getresgid()}\n".encode())
            os.read(child_reads, 1)  # the parent tried to stop us
            settle_ids()
            os.write(child_writes, f"{os.getresuid()} {os.getresgid()}\n".encode())
            os.read(child_reads, 1)
            code = 0
        finally:
            os._exit(code)
    os.close(child_reads)
    os.close(child_writes)
    try:
        reader = os.fdopen(parent_reads)
        assert reader.readline().split(") (")[0] == f"(0, {uid}, 0"  # setting up
        as_user = subprocess.run(
            ["kill", "-STOP", str(pid)], user=uid, group=gid, capture_output=True, text=True
        )
        assert as_user.returncode != 0 and "not permitted" in as_user.stderr, as_user
        os.write(parent_writes, b"g")
        assert reader.readline().strip() == f"({uid}, {uid}, {uid}) ({gid}, {gid}, {gid})"
        settled = subprocess.run(["kill", "-0", str(pid)], user=uid, group=gid)
        assert settled.returncode == 0  # the user's own process now
        os.write(parent_writes, b"g")
        assert os.waitpid(pid, 0)[1] == 0
    finally:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)


@pytest.mark.asyncio
async def test_a_replica_runs_with_every_id_its_users(
    other_user: pwd.struct_passwd, lab_dir: Path
) -> None:
    uid, gid = other_user.pw_uid, other_user.pw_gid
    job_dir = make_owned_dir(lab_dir / "jobs", "7", uid, gid)
    spec = make_spec(
        job_dir, ["sh", "-c", "grep -E '^(Uid|Gid):' /proc/self/status"], Path("/tmp"),
        run_as_uid=uid,
    )  # fmt: skip
    launcher = LocalLauncher(run_dir=lab_dir / "run", max_log_bytes=1 << 20)
    group = await launcher.launch(spec)
    assert await asyncio.wait_for(group.wait(), 20) == 0
    text = (job_dir / "rank0.log").read_text()
    ids = {line.split(":")[0]: line.split()[1:] for line in text.splitlines() if ":" in line}
    assert ids["Uid"] == [str(uid)] * 4 and ids["Gid"] == [str(gid)] * 4, text


def test_a_replica_that_never_reaches_its_command_is_not_waited_for_past_the_deadline() -> None:
    from pollux_local.launch.supervisor import read_until_closed

    done_r, done_w = os.pipe()
    stuck_r, stuck_w = os.pipe()
    os.write(done_w, b"253 cannot create job directory")
    os.close(done_w)
    started = time.monotonic()
    texts = read_until_closed({1: done_r, 2: stuck_r}, time.monotonic() + 0.5)
    assert 0.4 < time.monotonic() - started < 5.0
    assert texts == {1: "253 cannot create job directory"}  # 2: still open at the deadline
    with pytest.raises(OSError):
        os.fstat(stuck_r)  # closed for the caller
    os.close(stuck_w)
    # a child that settled as its user (and was stopped by it before exec): taken as started
    # after the short wait, not held to the long deadline
    settled_r, settled_w = os.pipe()
    os.write(settled_w, b"S")
    started = time.monotonic()
    texts = read_until_closed({3: settled_r}, time.monotonic() + 30, b"S", 0.3)
    assert time.monotonic() - started < 5.0
    assert texts == {3: "S"}
    os.close(settled_w)


@pytest.mark.asyncio
async def test_a_job_starts_with_the_descriptor_limit_the_daemon_started_with(
    launcher: LocalLauncher, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The daemon raises its own limit on open files (it holds many); a job gets the one the
    daemon started with (``local.JOB_OPEN_FILES``, taken before the raise), as it would
    started by hand.  Here the daemon's is this process's, and the one it started with is
    made lower."""
    import resource

    from pollux_local.launch import local

    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    started_with = min(soft, 4096) // 2
    monkeypatch.setattr(local, "JOB_OPEN_FILES", started_with)
    job_dir = tmp_path / "job"
    group = await launcher.launch(make_spec(job_dir, ["sh", "-c", "ulimit -n"], tmp_path))
    assert await asyncio.wait_for(group.wait(), 20) == 0
    assert (job_dir / "rank0.log").read_text().split()[-1] == str(started_with)


#: Prints the caller's session keyring's serial and owner uid: keyctl(KEYCTL_GET_KEYRING_ID,
#: @s, 0) and KEYCTL_DESCRIBE (argv[1]: keyctl's system call number); stdlib only, for the
#: system's python3.
KEYRING_ID = (
    "import ctypes, sys; libc = ctypes.CDLL(None, use_errno=True); n = int(sys.argv[1]);"
    " b = ctypes.create_string_buffer(256);"
    " libc.syscall(ctypes.c_long(n), ctypes.c_long(6), ctypes.c_long(-3), b, ctypes.c_long(256));"
    " print(libc.syscall(ctypes.c_long(n), ctypes.c_long(0), ctypes.c_long(-3),"
    " ctypes.c_long(0)), b.value.decode().split(';')[1])"
)


def test_what_the_daemon_runs_as_a_user_outside_a_job_leaves_its_session_keyring(
    other_user: pwd.struct_passwd,
) -> None:
    """Review s62: the notification helpers (a sender the user's own ``.pth`` files could
    run code in, a ``[notify] command``) and the removal of a job's directory ran as the
    user with ``subprocess``'s ``user=``, keeping the daemon's session keyring, whose keys
    (other users' Kerberos caches) that code could read.  They run through
    ``identity.as_user_argv``: the user's in every way, in a new keyring of their own."""
    from pollux_local.launch.identity import (
        KEYCTL_JOIN_SESSION_KEYRING,
        as_user_argv,
        keyctl_number,
    )

    number = keyctl_number()
    python = shutil.which("python3", path="/usr/bin:/bin")
    if number is None or python is None:
        pytest.skip("needs keyctl's number here and the system's python3")
    libc = ctypes.CDLL(None, use_errno=True)
    name = ctypes.c_char_p(b"pollux-test-daemon")
    if libc.syscall(ctypes.c_long(number), ctypes.c_long(KEYCTL_JOIN_SESSION_KEYRING), name) < 0:
        pytest.skip(f"no keyrings here ({os.strerror(ctypes.get_errno())})")
    probe = [python, "-c", KEYRING_ID, str(number)]
    ours = subprocess.run(probe, capture_output=True, text=True, check=True).stdout.split()
    uid, gid = other_user.pw_uid, other_user.pw_gid

    def seen(argv: list[str], **switch: object) -> list[str]:
        done = subprocess.run(
            argv, capture_output=True, text=True, cwd="/", env={"PATH": "/usr/bin:/bin"},
            timeout=30, **switch,  # type: ignore[call-overload]
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        return list(done.stdout.split())

    before = seen(probe, user=uid, group=gid, extra_groups=[])  # as they ran before
    assert before == ours  # the daemon's keyring (root's), possessed by the user's code
    now = seen(as_user_argv(uid, gid, [gid], probe))
    assert now[1] == str(uid) and int(now[0]) > 0 and now[0] != ours[0], (ours, now)
    failed = subprocess.run(as_user_argv(uid, gid, [], ["/nonexistent/x"]), capture_output=True)
    assert failed.returncode == 127 and b"cannot run /nonexistent/x" in failed.stderr


@pytest.mark.asyncio
async def test_a_replica_of_another_user_leaves_the_daemons_session_keyring(
    other_user: pwd.struct_passwd, lab_dir: Path
) -> None:
    """Review s55: every job possessed the daemon's session keyring, so one user's job read a
    key another user's job had put there.  A replica that becomes a user joins a new session
    keyring: its keyring is neither the daemon's nor the other replica's."""
    from pollux_local.launch.identity import KEYCTL_JOIN_SESSION_KEYRING, keyctl_number

    number = keyctl_number()
    if number is None:
        pytest.skip("keyctl's system call number is not known on this machine")
    libc = ctypes.CDLL(None, use_errno=True)
    # a session keyring of this process's own, as systemd gives the daemon's service one
    name = ctypes.c_char_p(b"pollux-test-daemon")
    if libc.syscall(ctypes.c_long(number), ctypes.c_long(KEYCTL_JOIN_SESSION_KEYRING), name) < 0:
        pytest.skip(f"no keyrings here ({os.strerror(ctypes.get_errno())})")
    python = shutil.which("python3", path="/usr/bin:/bin")
    if python is None:
        pytest.skip("needs the system's python3 (one every user may run)")
    probe = [python, "-c", KEYRING_ID, str(number)]
    ours = subprocess.run(probe, capture_output=True, text=True, check=True).stdout.split()
    uid, gid = other_user.pw_uid, other_user.pw_gid
    job_dir = make_owned_dir(lab_dir / "jobs", "7", uid, gid)
    spec = make_spec(
        job_dir, probe, Path("/tmp"), replicas=2, run_as_uid=uid,
    )  # fmt: skip
    launcher = LocalLauncher(run_dir=lab_dir / "run")
    group = await launcher.launch(spec)
    assert await asyncio.wait_for(group.wait(), 30) == 0
    found = [(job_dir / f"rank{rank}.log").read_text().split()[-2:] for rank in (0, 1)]
    theirs = [serial for serial, _ in found]
    assert int(ours[0]) > 0 and all(int(serial) > 0 for serial in theirs), (ours, found)
    assert ours[0] not in theirs and theirs[0] != theirs[1], (ours, found)
    assert all(owner == str(uid) for _, owner in found), found  # the user's own
