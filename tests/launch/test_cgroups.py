"""``launch/cgroups.py``: the layout found under a cgroup root (v1 and v2, against a fake tree
whose directories get their interface files as the kernel's do; the files written start
empty, as a plain file does not take a write whole as cgroupfs does), the limits written, the OOM
killer read back, planted symlinks refused, and, as root on this machine's real v1 (or v2)
hierarchy, a 64 MB group that kills a 300 MB allocation, a CPU quota and the group removed;
through the supervisor, the OOM kill recorded, limits that cannot be set failing the launch,
and a killed supervisor's groups swept of what escaped its process tree."""

from __future__ import annotations

import asyncio
import errno
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from pollux_local.errors import PolluxError
from pollux_local.launch import cgroups
from pollux_local.launch.cgroups import CgroupError, JobGroup, Limits, Support, group_name
from pollux_local.launch.local import LocalLauncher
from tests.launch.test_supervisor import ESCAPEE, alive, make_spec

pytestmark = pytest.mark.timeout(60)

V1_FILES = {
    "memory": {
        "cgroup.procs": "",
        "memory.limit_in_bytes": "",
        "memory.memsw.limit_in_bytes": "",
        "memory.oom_control": "oom_kill_disable 0\nunder_oom 0\noom_kill 0\n",
        "memory.failcnt": "0\n",
        "memory.max_usage_in_bytes": "0\n",
    },
    "cpu": {"cgroup.procs": "", "cpu.cfs_period_us": "", "cpu.cfs_quota_us": ""},
}
V2_FILES = {
    "cgroup.procs": "",
    "cgroup.controllers": "cpu memory pids\n",
    "cgroup.subtree_control": "cpu memory\n",
    "memory.max": "",
    "memory.swap.max": "",
    "memory.events": "low 0\nhigh 0\nmax 0\noom 0\noom_kill 0\n",
    "cpu.max": "",
}


@pytest.fixture()
def fake_fs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A fake cgroupfs under ``tmp_path/cg``: a directory made there gets the interface
    files of its hierarchy (``memory``/``cpu`` for v1, else v2); removing one that lists a
    process is refused (EBUSY), as the kernel does."""
    root = tmp_path / "cg"
    real_mkdir, real_rmdir = os.mkdir, os.rmdir

    def files_for(path: Path) -> dict[str, str]:
        relative = path.relative_to(root).parts
        if relative and relative[0] in V1_FILES:
            return V1_FILES[relative[0]]
        return V2_FILES

    def mkdir(path: str | os.PathLike[str], mode: int = 0o777, **kw: object) -> None:
        real_mkdir(path, mode)
        target = Path(path)
        if root in target.parents:
            for name, text in files_for(target).items():
                (target / name).write_text(text)

    def rmdir(path: str | os.PathLike[str], **kw: object) -> None:
        target = Path(path)
        if root in target.parents and target.is_dir() and not target.is_symlink():
            procs = target / "cgroup.procs"
            if procs.exists() and procs.read_text().split():
                raise OSError(errno.EBUSY, "Device or resource busy", str(path))
            kinds = set(files_for(target))
            if {p.name for p in target.iterdir()} - kinds:
                raise OSError(errno.ENOTEMPTY, "Directory not empty", str(path))
            for name in kinds:
                (target / name).unlink(missing_ok=True)
        real_rmdir(path)

    real_mkdir(root)
    monkeypatch.setattr(os, "mkdir", mkdir)
    monkeypatch.setattr(os, "rmdir", rmdir)
    yield root


def make_v1(root: Path, own: str = "/lab/daemon") -> None:
    for name in ("memory", "cpu"):
        os.mkdir(root / name)
        os.makedirs(root / name / own.strip("/"))


def test_own_cgroups_reads_v1_and_v2_lines() -> None:
    text = "12:memory:/process_api/abc\n4:cpu,cpuacct:/x\n1:name=systemd:/\n0::/user.slice/y\n"
    found = cgroups.own_cgroups(text)
    assert found["memory"] == "/process_api/abc"
    assert found["cpu"] == found["cpuacct"] == "/x"
    assert found[""] == "/user.slice/y"


def test_v1_layout_is_found_under_the_daemons_own_cgroups(fake_fs: Path) -> None:
    make_v1(fake_fs)
    support = cgroups.detect(str(fake_fs), own={"memory": "/lab/daemon", "cpu": "/lab/daemon"})
    assert support == Support(
        1, str(fake_fs / "memory/lab/daemon"), str(fake_fs / "cpu/lab/daemon")
    )
    assert not (fake_fs / "memory/lab/daemon/pollux-local").exists()  # the probe leaves nothing
    parent = cgroups.detect(str(fake_fs), parent="/lab", own={})
    assert parent.memory == str(fake_fs / "memory/lab")


def test_v1_limits_are_written_and_the_oom_killer_read_back(fake_fs: Path) -> None:
    make_v1(fake_fs)
    support = cgroups.detect(str(fake_fs), own={"memory": "/lab/daemon", "cpu": "/"})
    group = JobGroup.create(Limits(support, memory=64 << 20, cpus=0.5), "job-7-2")
    memory, cpu = (Path(p) for p in group.paths)
    assert memory == fake_fs / "memory/lab/daemon/pollux-local/job-7-2"
    assert cpu == fake_fs / "cpu/pollux-local/job-7-2"
    assert (memory / "memory.limit_in_bytes").read_text() == str(64 << 20)
    assert (memory / "memory.memsw.limit_in_bytes").read_text() == str(64 << 20)
    assert (cpu / "cpu.cfs_period_us").read_text() == "100000"
    assert (cpu / "cpu.cfs_quota_us").read_text() == "50000"
    assert group.oom_killed(any_sigkill=True) is False
    (memory / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 1\n")
    assert group.oom_kills() == 1
    assert not group.oom_killed(any_sigkill=True)  # the machine's OOM killer, below the limit
    (memory / "memory.max_usage_in_bytes").write_text(str(64 << 20))
    assert group.oom_killed(any_sigkill=False)
    (memory / "memory.max_usage_in_bytes").write_text("0\n")
    # a kernel that does not count its kills: the limit reached and a replica SIGKILLed
    (memory / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\n")
    (memory / "memory.failcnt").write_text("3\n")
    assert group.oom_kills() is None
    assert group.oom_killed(any_sigkill=True) and not group.oom_killed(any_sigkill=False)
    group.remove()
    assert not memory.exists() and not cpu.exists()
    assert not (fake_fs / "cpu/pollux-local").exists()  # emptied, so removed too


def test_only_the_controllers_a_limit_needs_get_a_group(fake_fs: Path) -> None:
    make_v1(fake_fs)
    support = cgroups.detect(str(fake_fs), own={"memory": "/", "cpu": "/"})
    group = JobGroup.create(Limits(support, cpus=2), "job-1-0")
    assert group.paths == [str(fake_fs / "cpu/pollux-local/job-1-0")]
    assert (Path(group.paths[0]) / "cpu.cfs_quota_us").read_text() == "200000"
    assert group.oom_killed(any_sigkill=True) is False  # no memory limit: never an OOM
    group.remove()


def test_v2_limits_and_oom_events(fake_fs: Path) -> None:
    (fake_fs / "cgroup.controllers").write_text("cpu memory\n")
    os.makedirs(fake_fs / "system.slice")
    os.mkdir(fake_fs / "system.slice" / "pollux.service")
    support = cgroups.detect(str(fake_fs), own={"": "/system.slice/pollux.service"})
    base = fake_fs / "system.slice/pollux.service"
    assert support == Support(2, str(base), str(base))
    group = JobGroup.create(Limits(support, memory=1 << 30, cpus=1.5), "job-12-0")
    assert group.paths == [str(base / "pollux-local/job-12-0")]
    path = Path(group.paths[0])
    assert (path / "memory.max").read_text() == str(1 << 30)
    assert (path / "memory.swap.max").read_text() == "0"
    assert (path / "cpu.max").read_text() == "150000 100000"
    assert not group.oom_killed(any_sigkill=True)
    (path / "memory.events").write_text("low 0\nhigh 0\nmax 0\noom 0\noom_kill 1\n")
    assert not group.oom_killed(any_sigkill=True)  # killed, but not at its limit
    (path / "memory.events").write_text("low 0\nhigh 0\nmax 5\noom 1\noom_kill 1\n")
    assert group.oom_killed(any_sigkill=False)
    group.remove()
    assert not path.exists()


def test_v2_without_the_controller_below_a_busy_cgroup_is_not_usable(fake_fs: Path) -> None:
    (fake_fs / "cgroup.controllers").write_text("cpu memory\n")
    os.mkdir(fake_fs / "busy")
    (fake_fs / "busy" / "cgroup.controllers").write_text("cpu\n")
    (fake_fs / "busy" / "cgroup.subtree_control").write_text("")
    support = cgroups.detect(str(fake_fs), own={"": "/busy"})
    assert support.memory is None
    assert support.memory_why == f"the memory controller is not available in {fake_fs}/busy"
    assert support.cpu == str(fake_fs / "busy")
    assert (fake_fs / "busy" / "cgroup.subtree_control").read_text() == "+cpu"


@pytest.fixture()
def busy_rule(fake_fs: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """v2's rules on the fake tree: enabling a controller below a cgroup that lists a process
    is refused (EBUSY), and a pid written to a ``cgroup.procs`` leaves every other one."""
    real_write = cgroups._write

    def write(path: str, text: str, dir_fd: int | None = None) -> None:
        full = Path(
            path if dir_fd is None else os.path.join(os.readlink(f"/proc/self/fd/{dir_fd}"), path)
        )
        if (
            full.name == "cgroup.subtree_control"
            and (full.parent / "cgroup.procs").read_text().split()
        ):
            raise OSError(errno.EBUSY, "Device or resource busy")
        if full.name == "cgroup.procs":
            for procs in fake_fs.rglob("cgroup.procs"):
                procs.write_text(" ".join(w for w in procs.read_text().split() if w != text))
            full.write_text(text)
            return
        real_write(path, text, dir_fd)

    monkeypatch.setattr(cgroups, "_write", write)
    (fake_fs / "cgroup.controllers").write_text("cpu memory\n")
    os.makedirs(fake_fs / "system.slice")
    os.mkdir(fake_fs / "system.slice/px.service")
    service = fake_fs / "system.slice/px.service"
    (service / "cgroup.subtree_control").write_text("")
    return service


def test_v2_a_daemon_alone_in_its_cgroup_moves_aside_for_the_jobs(busy_rule: Path) -> None:
    service, me = busy_rule, os.getpid()
    (service / "cgroup.procs").write_text(str(me))
    support = cgroups.detect(str(service.parents[1]), own={"": "/system.slice/px.service"})
    assert support.memory == support.cpu == str(service)
    assert (service / "pollux-local-daemon" / "cgroup.procs").read_text() == str(me)
    assert (service / "cgroup.procs").read_text() == ""
    # detected again from the leaf it moved to: the same base, no second move
    again = cgroups.detect(
        str(service.parents[1]), own={"": "/system.slice/px.service/pollux-local-daemon"}
    )
    assert again == support
    assert not (service / "pollux-local-daemon" / "pollux-local-daemon").exists()


def test_v2_a_daemon_not_alone_in_its_cgroup_is_told_to_name_a_parent(busy_rule: Path) -> None:
    service, me = busy_rule, os.getpid()
    (service / "cgroup.procs").write_text(f"{me} 1")
    support = cgroups.detect(str(service.parents[1]), own={"": "/system.slice/px.service"})
    assert support.memory is None and support.cpu is None
    assert "it holds processes (set [limits] cgroup_parent" in support.memory_why
    assert (service / "cgroup.procs").read_text().split() == [str(me), "1"]  # nobody moved


def test_no_hierarchy_or_no_write_access_says_why(fake_fs: Path, tmp_path: Path) -> None:
    missing = cgroups.detect(str(tmp_path / "nowhere"), own={})
    assert missing.memory is None and missing.cpu is None
    assert "no cgroup v1 memory or cpu controller and no cgroup v2 hierarchy" in missing.memory_why
    make_v1(fake_fs)
    gone = cgroups.detect(str(fake_fs), own={"memory": "/not/there", "cpu": "/"})
    assert gone.memory is None and gone.memory_why.endswith("memory/not/there does not exist")
    assert gone.cpu is not None


def test_planted_symlinks_and_odd_names_are_refused(fake_fs: Path, tmp_path: Path) -> None:
    make_v1(fake_fs)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (fake_fs / "memory/lab/daemon/pollux-local").symlink_to(elsewhere)
    support = cgroups.detect(str(fake_fs), own={"memory": "/lab/daemon", "cpu": "/"})
    assert support.memory is None and "is not a directory" in support.memory_why
    forced = Limits(Support(1, str(fake_fs / "memory/lab/daemon"), None), memory=64 << 20)
    with pytest.raises(CgroupError, match="is not a directory"):
        JobGroup.create(forced, "job-3-0")
    assert list(elsewhere.iterdir()) == []
    for name in ("job-../x-0", "job-3-0/../../y", "job-3", "other"):
        with pytest.raises(CgroupError, match="not a cgroup name"):
            JobGroup.create(forced, name)
    climbing = cgroups.detect(str(fake_fs), parent="/lab/../../etc", own={})
    assert climbing.memory is None and "is not a plain path" in climbing.memory_why


def test_a_stale_group_of_the_same_name_is_made_again(fake_fs: Path) -> None:
    make_v1(fake_fs)
    support = cgroups.detect(str(fake_fs), own={"memory": "/", "cpu": "/"})
    first = JobGroup.create(Limits(support, memory=8 << 20), "job-5-0")
    (Path(first.paths[0]) / "memory.limit_in_bytes").write_text("1")
    again = JobGroup.create(Limits(support, memory=16 << 20), "job-5-0")
    assert (Path(again.paths[0]) / "memory.limit_in_bytes").read_text() == str(16 << 20)
    again.remove()


def test_a_group_of_the_same_name_that_holds_processes_is_refused_not_emptied(
    fake_fs: Path,
) -> None:
    """A group of the name asked for that holds processes is another incarnation's (a daemon
    whose state was reset runs job 1 again while the old job 1 runs on): refused, its
    processes untouched; names carry a token of their supervisor's so it does not happen."""
    make_v1(fake_fs)
    support = cgroups.detect(str(fake_fs), own={"memory": "/", "cpu": "/"})
    first = JobGroup.create(Limits(support, memory=8 << 20), "job-5-0")
    (Path(first.paths[0]) / "cgroup.procs").write_text("4242\n")
    with pytest.raises(CgroupError, match="exists and holds processes"):
        JobGroup.create(Limits(support, memory=16 << 20), "job-5-0")
    assert (Path(first.paths[0]) / "cgroup.procs").read_text().split() == ["4242"]
    assert (Path(first.paths[0]) / "memory.limit_in_bytes").read_text() == str(8 << 20)
    second = JobGroup.create(Limits(support, memory=8 << 20), "job-6-0")
    below = Path(second.paths[0]) / "replica-4243"  # on v2 a replica runs in a group below
    below.mkdir()
    (below / "cgroup.procs").write_text("4243\n")
    with pytest.raises(CgroupError, match="exists and holds processes"):
        JobGroup.create(Limits(support, memory=16 << 20), "job-6-0")
    assert (below / "cgroup.procs").read_text().split() == ["4243"]
    key = cgroups.daemon_key("/var/lib/pollux-local/run")
    named = group_name("5", 0, key, "0a1b2c3d")
    assert named == f"job-{key}-5-0-0a1b2c3d" and cgroups.is_job_group(f"/x/pollux-local/{named}")
    with pytest.raises(CgroupError, match="not a cgroup name"):
        group_name("5", 0, key, "../../x")


def test_two_daemons_in_one_cgroup_never_share_a_job_group(fake_fs: Path) -> None:
    """Two daemons started in one cgroup (from one shell, or one service) both run their job
    1: the groups are named by each daemon's state directory, so the second's is made beside
    the first's instead of taking it for a stale group of its own (and killing its replicas)."""
    make_v1(fake_fs)
    support = cgroups.detect(str(fake_fs), own={"memory": "/", "cpu": "/"})
    first_key = cgroups.daemon_key("/var/lib/pollux-local/run")
    second_key = cgroups.daemon_key("/home/ann/.local/state/pollux-local/run")
    assert first_key != second_key and len(first_key) == 8
    assert cgroups.daemon_key("/var/lib/pollux-local/run/") == first_key
    first = JobGroup.create(Limits(support, memory=8 << 20), group_name("1", 0, first_key))
    (Path(first.paths[0]) / "cgroup.procs").write_text("4242\n")  # its replica
    second = JobGroup.create(Limits(support, memory=16 << 20), group_name("1", 0, second_key))
    assert first.paths != second.paths
    assert (Path(first.paths[0]) / "cgroup.procs").read_text().split() == ["4242"]
    assert (Path(first.paths[0]) / "memory.limit_in_bytes").read_text() == str(8 << 20)
    assert Path(first.paths[0]).name == f"job-{first_key}-1-0"
    second.remove()
    assert Path(first.paths[0]).is_dir()
    # a group of an earlier version (no daemon in its name), read from a run file, is still
    # one of a job's: a daemon upgraded while it ran removes it
    assert cgroups.is_job_group(str(fake_fs / "memory/pollux-local/job-1-0"))
    assert cgroups.is_job_group(first.paths[0])
    for name in (f"job-{first_key}-1", f"job-{first_key.upper()}-1-0", "job-xyz-1-0"):
        assert not cgroups.is_job_group(str(fake_fs / "memory/pollux-local" / name))


# --- this machine's real cgroups (as root) ------------------------------------------------------------


def real_support() -> Support:
    if os.geteuid() != 0:
        pytest.skip("writing cgroups needs root")
    support = cgroups.detect()
    if support.memory is None or support.cpu is None:
        pytest.skip(f"no writable memory and cpu cgroups here: {support.memory_why}")
    return support


def in_group(group: JobGroup, code: str) -> Callable[[], subprocess.Popen[bytes]]:
    """A Python child that waits for a line on stdin, put into ``group`` first."""

    def start() -> subprocess.Popen[bytes]:
        child = subprocess.Popen(
            [sys.executable, "-c", f"import sys; sys.stdin.readline(); {code}"],
            stdin=subprocess.PIPE,
        )
        group.add(child.pid)
        assert child.stdin is not None
        child.stdin.write(b"go\n")
        child.stdin.close()
        return child

    return start


def test_real_memory_limit_kills_an_allocation_over_it() -> None:
    support = real_support()
    group = JobGroup.create(Limits(support, memory=64 << 20, cpus=0.5), "job-990001-0")
    try:
        paths = group.paths
        hog = in_group(group, "b = b'x' * (300 << 20); import time; time.sleep(1)")()
        assert hog.wait(30) == -9
        assert group.oom_kills() == 1 and group.oom_killed(any_sigkill=True)
        cpu = next(Path(p) for p in paths if "/cpu" in p or support.version == 2)
        quota = "cpu.max" if support.version == 2 else "cpu.cfs_quota_us"
        assert (cpu / quota).read_text().split()[0] == "50000"
        small = in_group(group, "b = b'x' * (8 << 20)")()
        assert small.wait(30) == 0
    finally:
        group.remove()
    assert not any(os.path.exists(p) for p in paths)


def test_real_remove_kills_what_is_left_in_the_group() -> None:
    support = real_support()
    group = JobGroup.create(Limits(support, memory=64 << 20), "job-990002-0")
    paths = group.paths
    sleeper = in_group(group, "import time; time.sleep(60)")()
    assert group.pids() == [sleeper.pid]
    try:
        group.remove()
    finally:
        sleeper.kill()
    assert sleeper.wait(10) == -9
    assert not any(os.path.exists(p) for p in paths)


# --- through the supervisor ------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_the_supervisor_records_an_oom_kill_and_removes_the_groups(tmp_path: Path) -> None:
    support = real_support()
    launcher = LocalLauncher(run_dir=tmp_path / "run", stop_grace_s=1.0)
    hog = [sys.executable, "-c", "b = b'x' * (300 << 20); import time; time.sleep(1)"]
    spec = replace(
        make_spec(tmp_path / "job", hog, tmp_path), limits=Limits(support, memory=64 << 20)
    )
    group = await launcher.launch(spec)
    paths = [str(Path(base) / "pollux-local/job-7-0") for base in (support.memory,) if base]
    assert await group.wait() == -9
    assert group.over_memory == "killed: over its host memory limit --mem 64M"
    assert not any(os.path.exists(p) for p in paths)
    fine = replace(spec, argv=[sys.executable, "-c", "b = b'x' * (8 << 20)"])
    group = await launcher.launch(fine)
    assert await group.wait() == 0 and group.over_memory is None


@pytest.mark.asyncio
async def test_limits_that_cannot_be_set_fail_the_launch_and_run_nothing(tmp_path: Path) -> None:
    launcher = LocalLauncher(run_dir=tmp_path / "run", stop_grace_s=1.0)
    gone = tmp_path / "no-cgroup"
    spec = replace(
        make_spec(tmp_path / "job", ["touch", str(tmp_path / "ran")], tmp_path),
        limits=Limits(Support(1, memory=str(gone)), memory=64 << 20),
    )
    with pytest.raises(
        PolluxError,
        match=f"cannot set the job's limits: cannot create cgroup {gone}/.*: {gone} does not exist",
    ):
        await launcher.launch(spec)
    assert not (tmp_path / "ran").exists()


@pytest.mark.asyncio
async def test_a_dead_supervisors_groups_are_swept_of_escaped_processes(tmp_path: Path) -> None:
    support = real_support()
    assert support.memory is not None
    launcher = LocalLauncher(run_dir=tmp_path / "run", stop_grace_s=1.0)
    pid_file = tmp_path / "escapee.pid"
    argv = ["sh", "-c", ESCAPEE, "escapee", str(pid_file), "stubborn"]
    spec = replace(
        make_spec(tmp_path / "job", argv, tmp_path), limits=Limits(support, memory=64 << 20)
    )
    group = await launcher.launch(spec)
    key = cgroups.daemon_key(str(tmp_path / "run"))
    for _ in range(200):
        if pid_file.exists():
            break
        await asyncio.sleep(0.05)
    (path,) = (Path(support.memory) / "pollux-local").glob(f"job-{key}-7-0-*")
    escapee = int(pid_file.read_text())
    assert str(escapee) in (path / "cgroup.procs").read_text().split()
    os.kill(group.supervisor_pid, signal.SIGKILL)  # it cannot clean up after itself
    assert await group.wait() == -9
    assert group.supervisor_failure is not None
    for _ in range(100):
        if not alive(escapee) and not path.exists():
            break
        await asyncio.sleep(0.05)
    assert not alive(escapee), "a process left in the dead supervisor's cgroup lives on"
    assert not path.exists()
