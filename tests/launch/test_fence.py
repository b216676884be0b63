"""The fence (``node_agent.Fence``, ``AgentFence``): one cgroup per incarnation, killed as one,
on this machine's real cgroups (as root).  What a hostile review (s57) found: a group of the
same name that holds processes was taken for a stale one and killed (a daemon whose state
was reset killed another user's running job); an agent's fence left by an agent killed
outright was looked for only in the next agent's own cgroup (another login session on a
systemd node), and its liveness judged by pid in the looker's pid namespace; removing the
shared ``pollux-local`` directory raced another fence being made there."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from pollux_local.launch import node_agent
from pollux_local.launch.node_agent import AgentFence, Fence, FenceError
from pollux_local.launch.ssh import node_agent_source
from tests.launch.hopper import (
    assert_hopper_gone,
    build_hopper,
    hopper_beats,
    needs_fences,
    stop_hopper,
    wait_hopping,
)
from tests.launch.test_node_agent import (
    hopping_agent,
    lines_until_exits,
    spec_for,
    start_agent,
)

pytestmark = pytest.mark.timeout(120)


@pytest.fixture()
def scratch_cgroup() -> Iterator[Path]:
    """A cgroup of the test's own at the top of the unified hierarchy (or the freezer's),
    standing for another login session's; removed at the end."""
    needs_fences()
    base, _ = node_agent.fence_hierarchies(node_agent.CGROUP_ROOT, node_agent.AT_THE_TOP)[0]
    path = Path(base) / f"fence-test-{os.getpid()}"
    path.mkdir()
    yield path
    for proc in (path / "cgroup.procs").read_text().split():
        with contextlib.suppress(OSError):
            os.kill(int(proc), signal.SIGKILL)
    deadline = time.monotonic() + 10
    while True:
        try:
            path.rmdir()
            break
        except OSError:
            assert time.monotonic() < deadline, f"{path} stays busy"
            time.sleep(0.05)


def sleeper_in(group: Path) -> subprocess.Popen[bytes]:
    """``sleep 300`` started in the cgroup ``group``."""
    return subprocess.Popen(
        ["/bin/sh", "-c", f"echo $$ > {group}/cgroup.procs && exec sleep 300"],
    )


def test_a_fence_of_the_same_name_that_holds_processes_is_refused_not_killed() -> None:
    needs_fences()
    name = f"job-test-{os.getpid()}"
    first = Fence.make(name)
    sleeper = sleeper_in(Path(first.replica(os.getpid()).path))  # where a replica runs
    try:
        deadline = time.monotonic() + 10
        while not first.pids():
            assert time.monotonic() < deadline
            time.sleep(0.02)
        with pytest.raises(FenceError, match="exists and holds processes"):
            Fence.make(name, own_text=_only_v2())
        assert sleeper.poll() is None, "another incarnation's process was killed"
    finally:
        first.remove()
        sleeper.wait(timeout=10)
    again = Fence.make(name)  # an empty one (left behind) is taken
    again.remove()


def _only_v2() -> str:
    """``/proc/self/cgroup`` with only the unified hierarchy's line (no fallback to v1)."""
    with open("/proc/self/cgroup") as fh:
        return "".join(line for line in fh if line.startswith("0::"))


def _make_and_remove(tag: str, rounds: int, out: multiprocessing.Queue[object]) -> None:
    kinds: dict[str, int] = {}
    errors: list[str] = []
    for i in range(rounds):
        try:
            fence = Fence.make(f"race-{tag}-{i}")
        except FenceError as exc:
            errors.append(str(exc))
            continue
        kinds[fence.kind] = kinds.get(fence.kind, 0) + 1
        fence.remove()
    out.put((kinds, errors))


def test_fences_made_and_removed_at_once_never_fail_nor_fall_back() -> None:
    needs_fences()
    best = Fence.make(f"probe-{os.getpid()}")
    best.remove()
    out: multiprocessing.Queue[object] = multiprocessing.Queue()
    workers = [
        multiprocessing.Process(target=_make_and_remove, args=(f"{os.getpid()}{tag}", 400, out))
        for tag in "abc"
    ]
    for worker in workers:
        worker.start()
    results = [out.get(timeout=100) for _ in workers]
    for worker in workers:
        worker.join(10)
    for kinds, errors in results:  # type: ignore[misc]
        assert errors == []
        assert kinds == {best.kind: 400}, kinds


def test_a_fence_is_made_when_pollux_local_vanished_and_its_removal_leaves_it() -> None:
    """The race behind a fallback: ``pollux-local`` removed (by another fence's removal)
    between its ``mkdir`` and the fence's.  Now a fence's removal leaves ``pollux-local``, and
    a fence whose parent vanished makes it again (``make_cgroup``)."""
    needs_fences()
    base, _ = node_agent.fence_hierarchies(node_agent.CGROUP_ROOT, node_agent.AT_THE_TOP)[0]
    parent = Path(base) / f"fence-parent-{os.getpid()}"
    child = parent / "pollux-local" / "job"
    try:
        assert node_agent.make_cgroup(str(child)) is True  # both parents made on the way
        assert node_agent.make_cgroup(str(child)) is False
        fence = Fence(str(child), Fence.kind_of(str(child)) or "")
        fence.remove()
        assert not child.exists() and child.parent.is_dir()
    finally:
        for path in (child, child.parent, parent):
            with contextlib.suppress(OSError):
                path.rmdir()


def agent_in(group: Path, spec: dict[str, object]) -> subprocess.Popen[str]:
    """:func:`start_agent` run in the cgroup ``group`` (another login session's)."""
    proc = start_agent(spec, preexec=lambda: (group / "cgroup.procs").write_text(str(os.getpid())))
    return proc


@pytest.mark.parametrize("where", ["another session", "another pid namespace"])
def test_an_agent_ends_the_fence_of_a_killed_agent_and_only_that(
    tmp_path: Path, scratch_cgroup: Path, where: str
) -> None:
    """Agent A runs a replica that leaves a pid hopper, then is killed outright; agent B,
    in another cgroup (a login session of its own) ends A's fence.  An agent started in
    another pid namespace while A still runs leaves A's replica alone."""
    if where == "another pid namespace" and shutil.which("unshare") is None:
        pytest.skip("no unshare(1) here")
    second_dir = tmp_path / "second"
    second_dir.mkdir()
    second_spec = spec_for(second_dir, [{"argv": ["/bin/true"], "env": {}}])
    with hopping_agent(tmp_path) as (first, hops):
        if where == "another pid namespace":
            second = start_agent(second_spec, prefix=["unshare", "-pf", "--mount-proc"])
            assert ["EXIT", "0", "0"] in lines_until_exits(second, 1)
            second.communicate(timeout=30)
            assert hopper_beats(hops, 1.0) > 1, "a live agent's fence was ended"
            assert first.poll() is None
            return
        first.kill()
        first.wait(timeout=30)
        assert hopper_beats(hops, 0.5) > 1  # the agent is gone, the hopper is not
        second = agent_in(scratch_cgroup, second_spec)
        assert ["EXIT", "0", "0"] in lines_until_exits(second, 1)
        second.communicate(timeout=30)
        assert_hopper_gone(hops, "its agent's successor")


def test_an_agent_fence_is_removed_and_the_agent_moved_back_at_its_end() -> None:
    needs_fences()
    with open("/proc/self/cgroup") as fh:
        before = fh.read()
    fence = AgentFence.make()
    with open("/proc/self/cgroup") as fh:
        assert fh.read() != before  # in its keeper
    assert os.path.isdir(fence.fence.path)
    fence.release()
    with open("/proc/self/cgroup") as fh:
        assert fh.read() == before
    assert not os.path.exists(fence.home)


def test_a_stale_fence_whose_processes_do_not_die_costs_an_agent_little(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A process in uninterruptible sleep (a FUSE server that never answers, a hung
    driver) survives SIGKILL: its agent's fence cannot be removed.  Every later agent (and
    node check) looks at it again; each look waits ``FENCE_SHORT_END_S``, not the 10 s of an
    incarnation's end (review s58: 10 s more for every agent start on the node, per such
    fence).  Stood for here by processes that never leave the fence's listing."""
    needs_fences()
    base, _ = node_agent.fence_hierarchies(node_agent.CGROUP_ROOT, node_agent.AT_THE_TOP)[0]
    top = Path(base) / node_agent.FENCE_DIR
    homes = [top / f"{node_agent.AGENT_FENCE_PREFIX}dead{os.getpid()}{i}" for i in range(2)]
    for home in homes:  # marked and its keeper removed by an earlier look: the agent is gone
        (home / "job").mkdir(parents=True)
        (home / "ended").mkdir()
    monkeypatch.setattr(Fence, "pids", lambda self: [1] if "dead" in self.path else [])
    monkeypatch.setattr(node_agent, "_cgroup_write", lambda *args: None)  # kills that miss
    try:
        started = time.monotonic()
        node_agent.end_stale_agent_fences(str(top))
        took = time.monotonic() - started
        assert took < 2 * node_agent.FENCE_SHORT_END_S + 1.0, took
    finally:
        monkeypatch.undo()
        for home in homes:
            for path in (home / "job", home / "ended", home):
                with contextlib.suppress(OSError):
                    path.rmdir()


def test_the_node_check_ends_the_fence_of_a_killed_agent(tmp_path: Path) -> None:
    """An agent killed outright leaves its fence; the node check (the agent's ``workdir``
    tool, run at every check of the node) ends it, before any other agent starts there."""
    with hopping_agent(tmp_path) as (agent, hops):
        agent.kill()
        agent.wait(timeout=30)
        check = subprocess.run(
            [sys.executable, "-c", node_agent_source(), "workdir", str(tmp_path / "work")],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert check.stdout.strip() == "ok", check
        assert_hopper_gone(hops, "a node check after its agent was killed")


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT])
def test_an_agent_told_to_end_stops_its_replicas_and_ends_its_fence(
    tmp_path: Path, signum: int
) -> None:
    """SIGTERM, SIGHUP or SIGINT to an agent (a session ended, an admin's kill, Ctrl-C in an
    ``ssh -t``; ``node_agent.ENDING_SIGNALS``) is taken as the end of its stdin: its
    replicas are stopped and its fence ended before it exits (it had no handler: it died
    and left them running until another agent came)."""
    with hopping_agent(tmp_path) as (agent, hops):
        agent.send_signal(signum)
        assert agent.stdout is not None
        said = agent.stdout.read()
        assert agent.wait(timeout=30) == 0
        assert "EXIT 0 " in said, said
        assert_hopper_gone(hops, "its agent told to end")


@pytest.mark.parametrize("kind", ["kill", "freeze", "freezer"])
def test_each_way_of_ending_a_fence_ends_a_process_that_keeps_changing_its_pid(
    tmp_path: Path, kind: str
) -> None:
    """``cgroup.kill`` (v2, Linux 5.14), and freezing, killing and thawing (v2's
    ``cgroup.freeze`` for an older kernel, v1's freezer), each end a pid hopper at once."""
    needs_fences()
    hierarchies = dict(
        (version, base)
        for base, version in node_agent.fence_hierarchies(
            node_agent.CGROUP_ROOT, node_agent.AT_THE_TOP
        )
    )
    version = "v1" if kind == "freezer" else "v2"
    if version not in hierarchies:
        pytest.skip(f"no cgroup {version} hierarchy for fences here")
    control = {"kill": "cgroup.kill", "freeze": "cgroup.freeze", "freezer": "freezer.state"}
    path = Path(hierarchies[version]) / f"fence-kind-{os.getpid()}"
    path.mkdir()
    if not (path / control[kind]).exists():
        path.rmdir()
        pytest.skip(f"no {control[kind]} here")
    fence = Fence(str(path), kind)
    hops = tmp_path / "hops"
    hops.mkdir()
    hopper = subprocess.Popen(
        ["/bin/sh", "-c", f'echo $$ > {path}/cgroup.procs && exec "$0" "$1"',
         str(build_hopper(tmp_path)), str(hops)],
    )  # fmt: skip
    try:
        wait_hopping(hops)
        assert fence.end(5.0)
        assert_hopper_gone(hops, f"its fence ended by {kind}")
    finally:
        stop_hopper(hops)
        hopper.wait(timeout=10)
        fence.remove()
        assert not path.exists()


def test_a_group_under_pollux_local_that_is_no_agents_home_is_left_alone() -> None:
    """An ``agent-*`` group with neither a keeper nor the mark of an earlier look (an
    admin's, say) is not a fence of a gone agent: the node check leaves its processes and
    its groups alone (review s59: it killed them)."""
    needs_fences()
    base, _ = node_agent.fence_hierarchies(node_agent.CGROUP_ROOT, node_agent.AT_THE_TOP)[0]
    top = Path(base) / node_agent.FENCE_DIR
    home = top / f"{node_agent.AGENT_FENCE_PREFIX}admin{os.getpid()}"
    (home / "job").mkdir(parents=True)
    sleeper = sleeper_in(home / "job")
    try:
        deadline = time.monotonic() + 10
        while not (home / "job" / "cgroup.procs").read_text().split():
            assert time.monotonic() < deadline
            time.sleep(0.02)
        node_agent.end_stale_fences_here()
        assert sleeper.poll() is None, "a process of a group that is no agent's was killed"
        assert (home / "job").is_dir()
    finally:
        sleeper.kill()
        sleeper.wait(timeout=10)
        for path in (home / "job", home):
            with contextlib.suppress(OSError):
                path.rmdir()


def test_no_joiner_starts_once_every_replica_has_ended() -> None:
    """Review s59: a joiner whose start raced the last replica's exit was started after the
    fence was gone, never reaped, and ran on as the user.  ``joins`` now says no once the
    replicas have all ended (``finished``)."""
    with open(os.devnull, "w") as nowhere:
        agent = node_agent.Supervisor({"replicas": []}, node_agent.Lines(nowhere))
        agent.warm = {"generation": 4, "world_size": 2, "state": "joining"}
        assert agent.joins(4)
        agent.finished = True
        assert not agent.joins(4)
