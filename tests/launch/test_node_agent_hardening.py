"""The SSH node agent and the daemon's side of it under hostile or broken conditions, run here
as root without ssh (``launch/node_agent.py``, ``launch/ssh``): a replica that prints a lot at
once, a daemon that stops reading, a node work directory others could write to, a log swapped
for a link after the start, an exit record planted or too big, a replica's umask."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

from pollux_local.launch.base import LaunchSpec, ReplicaSlot
from pollux_local.launch.node_agent import start_time
from pollux_local.launch.ssh import SETUP_FAILED_EXIT_CODE, SshLauncher, SshNodeConfig
from pollux_local.launch.ssh.recovery import SshRecordedGroup
from tests.launch.test_node_agent import lines_until_exits, spec_for, start_agent
from tests.launch.test_ssh_payload import LocalNodes

pytestmark = pytest.mark.timeout(90)

#: A stranger's uid (no such user is needed: only the ids are looked at).
STRANGER = 54321


class LocalSsh(SshLauncher):
    """An SSH launcher whose sessions run the agent here (``sh -c``) instead of over ssh."""

    def ssh_argv(self, node: SshNodeConfig, *, master: bool = False) -> list[str]:
        return ["/bin/sh", "-c"]

    async def _ensure_master(self, node: SshNodeConfig) -> None:
        return None


def launch_one(
    tmp_path: Path, script: str, python: str = sys.executable
) -> tuple[LaunchSpec, LocalSsh]:
    """A one-replica job running ``script`` with this Python, on a local "node"."""
    workdir = tmp_path / "nodework"
    node = SshNodeConfig(name="n1", host="n1", workdir=str(workdir), python=python)
    slot = ReplicaSlot(rank=0, node="n1", device="cpu:0", local_rank=0, node_rank=0)
    spec = LaunchSpec(
        job_id="7",
        argv=[sys.executable, "-c", script],
        workdir=tmp_path,
        env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")},
        slots=[slot],
        log_dir=tmp_path / "job",
    )
    control = Path(tempfile.mkdtemp(prefix="pl", dir="/tmp"))
    return spec, LocalSsh([node], control_dir=control, failure_grace_s=1.0)


# --- a lot of output at once ----------------------------------------------------------------


def test_every_line_of_the_agent_stays_short_whatever_a_replica_prints(tmp_path: Path) -> None:
    spec = spec_for(
        tmp_path,
        [{"argv": [sys.executable, "-c", "import sys; sys.stdout.write('x' * 300000)"], "env": {}}],
    )
    proc = start_agent(spec)
    lines = lines_until_exits(proc, 1)
    proc.communicate(timeout=30)
    logged = b"".join(base64.b64decode(p[2]) for p in lines if p[:2] == ["LOG", "0"])
    assert logged == b"x" * 300000
    longest = max(len(" ".join(p)) for p in lines)
    assert longest < 48 * 1024, f"a line of {longest} bytes"


def test_a_burst_of_output_does_not_end_the_group_while_its_replica_runs(tmp_path: Path) -> None:
    """Once, a replica printing more than ~48 KiB at once made the agent send a line longer
    than the daemon's reader took: the reader died, and the group counted as ended (75)
    while its replica ran on."""
    marker = tmp_path / "ended"
    script = (
        "import sys, time; sys.stdout.write('x' * 300000); sys.stdout.flush(); time.sleep(2); "
        f"open({str(marker)!r}, 'w').close()"
    )
    spec, launcher = launch_one(tmp_path, script)

    async def run() -> tuple[int, float]:
        started = time.monotonic()
        group = await launcher.launch(spec)
        code = await asyncio.wait_for(group.wait(), 60)
        return code, time.monotonic() - started

    code, took = asyncio.run(run())
    assert code == 0 and marker.exists(), (code, took)
    assert (spec.log_dir / "rank0.log").read_bytes().count(b"x") == 300000


def test_an_over_long_or_garbled_line_is_skipped_not_the_end_of_the_session(
    tmp_path: Path,
) -> None:
    """Whatever an agent sends (here a fake one: a 2 MiB line, garbage, then its lines), the
    group ends only with the session, with the exits it said."""
    fake = tmp_path / "fake-python"
    fake.write_text(
        "#!/bin/sh\nread spec\necho \"PID 0 $$\"\nhead -c 2100000 /dev/zero | tr '\\0' A\n"
        'echo\necho "LOG 0 !!!notbase64"\necho "EXIT zero"\nsleep 1\n'
        'echo "LOG 0 $(printf after | base64)"\necho "EXIT 0 0"\n'
    )
    fake.chmod(0o755)
    spec, launcher = launch_one(tmp_path, "", python=str(fake))

    async def run() -> tuple[int, dict[int, int]]:
        group = await launcher.launch(spec)
        code = await asyncio.wait_for(group.wait(), 30)
        return code, group.exit_codes()

    assert asyncio.run(run()) == (0, {0: 0})
    assert (spec.log_dir / "rank0.log").read_bytes().endswith(b"after")


def test_a_daemon_that_stops_reading_blocks_neither_the_record_nor_the_agents_end(
    tmp_path: Path,
) -> None:
    """The daemon reads nothing more (stopped, or its reader hung): the agent still obeys
    TERM, records the replica's end, and once its stdin closes it ends too."""
    record = tmp_path / "run" / "k" / "7@n1.json"
    script = "import sys, time; sys.stdout.write('y' * 8000000); sys.stdout.flush(); time.sleep(60)"
    spec = spec_for(
        tmp_path,
        [{"argv": [sys.executable, "-c", script], "env": {}}],
        record={"path": str(record), "token": "7:0"},
    )
    proc = start_agent(spec)  # its stdout is never read in this test until the end
    assert proc.stdin is not None
    try:
        time.sleep(3)
        proc.stdin.write("TERM\n")
        proc.stdin.flush()
        deadline = time.monotonic() + 15
        codes: list[Any] = [None]
        while time.monotonic() < deadline:
            if record.exists():
                codes = [r["exit_code"] for r in json.loads(record.read_text())["replicas"]]
                if codes != [None]:
                    break
            time.sleep(0.2)
        assert codes == [128 + signal.SIGTERM], "the replica's end was never recorded"
        proc.stdin.close()
        assert proc.wait(timeout=30) == 0
    finally:
        proc.kill()
        proc.wait()
        assert proc.stdout is not None
        proc.stdout.close()


# --- the node's work directory --------------------------------------------------------------


def make_dir(path: Path, mode: int = 0o755, uid: int = 0) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    os.chown(path, uid, 0)
    path.chmod(mode)
    return path


def workdir_case(tmp_path: Path, case: str) -> tuple[Path, bool]:
    """A node work directory set up as ``case`` says, and whether it is to be taken."""
    base = make_dir(tmp_path / "base")
    good = make_dir(base / "good")
    if case == "a stranger's":
        return make_dir(base / "theirs", uid=STRANGER), False
    if case == "writable by all":
        return make_dir(base / "open", 0o777), False
    if case == "sticky and writable by all":
        return make_dir(base / "sticky", 0o1777), False
    if case == "group-writable":
        return make_dir(base / "grp", 0o775), False
    if case == "below a directory all may write":
        return make_dir(make_dir(base / "shared", 0o777) / "pollux"), False
    if case == "below a stranger's directory":
        return make_dir(make_dir(base / "home", uid=STRANGER) / "pollux"), False
    if case == "a stranger's link":
        link = base / "link"
        link.symlink_to(good)
        os.lchown(link, STRANGER, 0)
        return link, False
    if case == "below a stranger's link":
        link = base / "link"
        link.symlink_to(base)
        os.lchown(link, STRANGER, 0)
        return link / "good", False
    if case == "root's link to a good one":
        link = base / "link"
        link.symlink_to(good)
        return link, True
    if case == "below a sticky root directory":
        return make_dir(make_dir(base / "scratch", 0o1777) / "pollux"), True
    if case == "missing (made)":
        return base / "new" / "pollux", True
    if case == "missing, below a sticky root directory (anyone could claim it first)":
        return make_dir(base / "tmp", 0o1777) / "pollux", False
    assert case == "good"
    return good, True


@pytest.mark.parametrize(
    "case",
    [
        "good",
        "missing (made)",
        "root's link to a good one",
        "below a sticky root directory",
        "missing, below a sticky root directory (anyone could claim it first)",
        "a stranger's",
        "writable by all",
        "sticky and writable by all",
        "group-writable",
        "below a directory all may write",
        "below a stranger's directory",
        "a stranger's link",
        "below a stranger's link",
    ],
)
def test_a_work_directory_others_may_write_to_is_refused(tmp_path: Path, case: str) -> None:
    workdir, taken = workdir_case(tmp_path, case)
    spec = spec_for(tmp_path, [{"argv": ["/bin/true"], "env": {}}], node_workdir=str(workdir))
    spec["replicas"][0]["log"] = str(workdir / "logs" / "7" / "rank0.start0.log")
    proc = start_agent(spec)
    if taken:
        assert ["EXIT", "0", "0"] in lines_until_exits(proc, 1)
        proc.communicate(timeout=30)
        assert proc.returncode == 0
        info = os.stat(workdir)
        assert info.st_uid == 0 and not info.st_mode & 0o022
    else:
        out, _ = proc.communicate(timeout=30)
        assert proc.returncode == SETUP_FAILED_EXIT_CODE, out
        [line] = out.splitlines()  # one line, and nothing started
        # the node's fault, not the job's: the daemon marks the node down with it
        assert line.startswith("NODEFAIL refusing the work directory"), line
        if case.startswith("missing"):
            assert not workdir.exists() and "first, as root" in line, line


def test_a_log_swapped_for_a_link_after_the_start_is_never_read(tmp_path: Path) -> None:
    """The log is read back from the descriptor it was opened with: a log directory replaced
    afterwards by a link (to a file of someone else's at the same name) is not followed."""
    secret = tmp_path / "elsewhere" / "rank0.log"
    secret.parent.mkdir()
    secret.write_text("PADDING " * 40 + "SECRET\n")
    script = "import time; print('first', flush=True); time.sleep(2); print('second')"
    spec = spec_for(tmp_path, [{"argv": [sys.executable, "-c", script], "env": {}}])
    proc = start_agent(spec)
    assert proc.stdout is not None
    while not proc.stdout.readline().startswith("LOG 0"):
        pass
    (tmp_path / "logs").rename(tmp_path / "logs.old")
    (tmp_path / "logs").symlink_to(secret.parent)
    lines = lines_until_exits(proc, 1)
    proc.communicate(timeout=30)
    logged = b"".join(base64.b64decode(p[2]) for p in lines if p[:2] == ["LOG", "0"])
    assert b"SECRET" not in logged and b"PADDING" not in logged
    assert logged == b"second\n"


def test_the_exit_record_is_never_written_through_a_link(tmp_path: Path) -> None:
    workdir = make_dir(tmp_path / "wd")
    elsewhere = make_dir(tmp_path / "root-only", 0o700)
    (workdir / "run").symlink_to(elsewhere)
    spec = spec_for(
        tmp_path,
        [{"argv": ["/bin/true"], "env": {}}],
        node_workdir=str(workdir),
        record={"path": str(workdir / "run" / "k" / "7@n1.json"), "token": "7:0"},
    )
    proc = start_agent(spec)
    # nothing is written through it, and nothing runs that its record would not name: the
    # node is refused (a restarted daemon finding no record would run the job again)
    out, _ = proc.communicate(timeout=30)
    assert out.startswith("NODEFAIL cannot keep the job's exit record"), out
    assert proc.returncode == SETUP_FAILED_EXIT_CODE
    assert list(elsewhere.iterdir()) == []


def test_the_replicas_umask_is_applied_when_given(tmp_path: Path) -> None:
    make = "import sys; open(sys.argv[1], 'w').close()"
    spec = spec_for(
        tmp_path,
        [
            {"argv": [sys.executable, "-c", make, str(tmp_path / "a")], "env": {}, "umask": 0o077},
            {"argv": [sys.executable, "-c", make, str(tmp_path / "b")], "env": {}, "umask": 0o002},
            {"argv": [sys.executable, "-c", make, str(tmp_path / "c")], "env": {}},
            {"argv": ["/bin/true"], "env": {}, "umask": "077"},
        ],
    )
    old = os.umask(0o022)
    try:
        proc = start_agent(spec)
    finally:
        os.umask(old)
    lines = lines_until_exits(proc, 4)
    proc.communicate(timeout=30)
    assert {p[1]: p[2] for p in lines if p[0] == "EXIT"} == {
        "0": "0",
        "1": "0",
        "2": "0",
        "3": "127",
    }
    assert (tmp_path / "a").stat().st_mode & 0o777 == 0o600
    assert (tmp_path / "b").stat().st_mode & 0o777 == 0o664
    assert (tmp_path / "c").stat().st_mode & 0o777 == 0o644  # the agent's own


# --- recovery -------------------------------------------------------------------------------


def recovery_launcher(workdir: Path) -> LocalNodes:
    node = SshNodeConfig(name="a", host="a", workdir=str(workdir), python=sys.executable)
    return LocalNodes([node], control_dir=Path(tempfile.mkdtemp(prefix="pl", dir="/tmp")))


def plant_record(launcher: LocalNodes, workdir: Path, record: dict[str, Any], pad: int = 0) -> None:
    path = workdir / "run" / launcher.record_key / "7@a.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record) + " " * pad)


def test_a_restarted_daemon_reads_no_record_from_a_work_directory_others_may_write_to(
    tmp_path: Path,
) -> None:
    record = {"version": 1, "token": "7:0", "node": "a", "state": "ended"}
    good = make_dir(tmp_path / "good")
    launcher = recovery_launcher(good)
    plant_record(launcher, good, record)
    assert asyncio.run(launcher.read_record("a", "7")) == record
    plant_record(launcher, good, record, pad=2 << 20)  # too big to be a record: not read
    assert asyncio.run(launcher.read_record("a", "7")) is None
    theirs = make_dir(tmp_path / "theirs", uid=STRANGER)
    launcher = recovery_launcher(theirs)
    plant_record(launcher, theirs, record)
    assert asyncio.run(launcher.read_record("a", "7")) is None


@pytest.mark.parametrize("case", ["a stranger's work directory", "not the job user's process"])
def test_a_forged_record_gets_no_process_of_anyone_else_signalled(
    tmp_path: Path, case: str
) -> None:
    """A recovered record names a root process (forged by whoever could write there): the
    stop of the recovered job signals nothing, when the work directory is not root's alone,
    and when the process is not one of the job's user."""
    workdir = make_dir(tmp_path / "wd", uid=STRANGER if case.startswith("a stranger") else 0)
    victim = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        started = start_time(victim.pid)
        replica = {"rank": 0, "pid": victim.pid, "start_time": started, "exit_code": None}
        records = {"a": {"state": "running", "token": "7:0", "replicas": [replica]}}
        slot = ReplicaSlot(rank=0, node="a", device="cpu:0", local_rank=0, node_rank=0)
        spec = LaunchSpec(
            job_id="7", argv=["x"], workdir=tmp_path, env={}, slots=[slot], log_dir=tmp_path,
            run_as="nobody" if case.startswith("not") else None,
        )  # fmt: skip
        group = SshRecordedGroup(recovery_launcher(workdir), spec, records)
        asyncio.run(group._signal("KILL"))
        time.sleep(0.3)
        assert victim.poll() is None, "a process the job's user does not own was killed"
    finally:
        victim.kill()
        victim.wait()


def echo_as_nobody(tmp_path: Path, workdir: Path, log: Path) -> list[list[str]]:
    """The agent's lines (up to the end) of one replica run as ``nobody`` that echoes
    ``mine``, its log at ``log`` and the node's work directory ``workdir``."""
    spec = spec_for(
        tmp_path,
        [{"argv": ["/bin/sh", "-c", "echo mine"], "env": {}}],
        node_workdir=str(workdir),
        user="nobody",
        cwd="/",
    )
    spec["replicas"][0]["log"] = str(log)
    proc = start_agent(spec)
    lines = lines_until_exits(proc, 1)
    proc.communicate(timeout=30)
    return lines


def test_a_log_left_by_another_users_replica_is_replaced_not_handed_over(tmp_path: Path) -> None:
    """A replica's log on the node may already exist: an earlier replica's of the same name
    (a job id used again after the daemon's state was reset, another user's job).  It is
    neither written into nor given to this job's user: a fresh file takes its name."""
    import pwd

    nobody = pwd.getpwnam("nobody")
    workdir = make_dir(tmp_path / "wd")
    log = workdir / "logs" / "key" / "7" / "rank0.start0.log"
    make_dir(make_dir(make_dir(workdir / "logs") / "key") / "7")
    log.write_text("THEIRS\n")
    os.chown(log, STRANGER, STRANGER)
    lines = echo_as_nobody(tmp_path, workdir, log)
    assert ["EXIT", "0", "0"] in lines
    info = log.stat()
    assert info.st_uid == nobody.pw_uid
    assert log.read_text() == "mine\n"  # nothing of theirs in it (appended, it held both)


def test_a_log_directory_anywhere_below_the_work_directory_must_be_the_agents(
    tmp_path: Path,
) -> None:
    """Logs lie at ``WORKDIR/logs/KEY/JOB/``: a ``logs`` of another user's (made while the
    work directory was open, say) could have ``KEY`` swapped under the agent; every
    directory from the work directory down is checked, not only the last two."""
    workdir = make_dir(tmp_path / "wd")
    make_dir(workdir / "logs", uid=STRANGER)
    log = workdir / "logs" / "key" / "7" / "rank0.start0.log"
    lines = echo_as_nobody(tmp_path, workdir, log)
    assert ["EXIT", "0", "127"] in lines  # not started
    said = b"".join(base64.b64decode(p[2]) for p in lines if p[:2] == ["LOG", "0"])
    assert b"cannot open its log" in said and b"logs is not a directory" in said, said
