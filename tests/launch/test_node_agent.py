"""The SSH launcher's node-side supervisor, run the way ``launch/ssh.py`` ships it to a node
(``python -u -c <source>``, the spec on stdin) but locally, without ssh or root."""

from __future__ import annotations

import ast
import base64
import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from pollux_local.launch import node_agent
from pollux_local.launch.ssh import SETUP_FAILED_EXIT_CODE, node_agent_source
from tests.launch.hopper import (
    assert_hopper_gone,
    build_hopper,
    needs_fences,
    stop_hopper,
    wait_hopping,
)
from tests.launch.oomscore import can_lower_oom_score

pytestmark = pytest.mark.timeout(60)


def test_the_shipped_source_is_the_module_and_needs_only_python_3_8_stdlib() -> None:
    source = node_agent_source()  # the module, its docstring sent as empty lines
    text = Path(node_agent.__file__).read_text(encoding="utf-8")
    body = text.index("from __future__ import annotations")
    assert source == "\n" * text[:body].count("\n") + text[body:]
    tree = ast.parse(source, feature_version=(3, 8))
    imported: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            imported.add((node.module or "").split(".")[0])
    assert imported <= set(sys.stdlib_module_names) | {"__future__"}


def start_agent(
    spec: dict[str, Any],
    preexec: Callable[[], object] | None = None,
    prefix: Sequence[str] = (),
) -> subprocess.Popen[str]:
    """The agent, given ``spec`` (``preexec``: run in its process first; ``prefix``: a
    command that runs it, such as ``unshare``)."""
    proc = subprocess.Popen(
        [*prefix, sys.executable, "-u", "-c", node_agent_source()],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        preexec_fn=preexec,
    )
    assert proc.stdin is not None
    proc.stdin.write(json.dumps(spec) + "\n")
    proc.stdin.flush()
    return proc


def next_line(proc: subprocess.Popen[str], kind: str) -> list[str]:
    """The next protocol line of ``kind`` (skipping ``LOG`` lines unless asked for)."""
    assert proc.stdout is not None
    while True:
        line = proc.stdout.readline()
        assert line, f"the agent ended before a {kind} line"
        parts = line.rstrip("\n").split(" ", 2)
        if parts[0] == kind:
            return parts


def lines_until_exits(proc: subprocess.Popen[str], count: int) -> list[list[str]]:
    """Every protocol line up to the ``count``-th ``EXIT`` line (stdin stays open: closing it
    would tell the agent that the daemon is gone)."""
    assert proc.stdout is not None
    lines: list[list[str]] = []
    while sum(parts[0] == "EXIT" for parts in lines) < count:
        line = proc.stdout.readline()
        assert line, f"the agent ended after {lines}"
        lines.append(line.rstrip("\n").split(" ", 2))
    return lines


def spec_for(tmp_path: Path, replicas: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {
        "node": "n1",
        "cwd": str(tmp_path),
        "node_workdir": str(tmp_path),
        "cwd_required": True,
        "user": None,
        "orphan_grace_s": 0.5,
        "replicas": [
            {"rank": rank, "log": str(tmp_path / "logs" / f"rank{rank}.log"), **r}
            for rank, r in enumerate(replicas)
        ],
        **extra,
    }


def test_replicas_start_with_their_environment_and_report_logs_and_exits(
    tmp_path: Path,
) -> None:
    spec = spec_for(
        tmp_path,
        [
            {
                "argv": ["/bin/sh", "-c", 'echo "value=$X"; exit 3'],
                "env": {"X": "a 'quoted' $value"},
                "banner": "--- start\n",
            },
            {"argv": [str(tmp_path / "missing-program")], "env": {}},
        ],
    )
    proc = start_agent(spec)
    lines = lines_until_exits(proc, 2)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0
    lines += [line.split(" ", 2) for line in out.splitlines()]
    assert ["EXIT", "1", "127"] in lines
    assert ["EXIT", "0", "3"] in lines
    assert any(parts[:2] == ["PID", "0"] for parts in lines)
    logged = b"".join(base64.b64decode(p[2]) for p in lines if p[:2] == ["LOG", "0"])
    assert logged == b"--- start\nvalue=a 'quoted' $value\n"
    assert (tmp_path / "logs" / "rank0.log").read_bytes() == logged
    assert "cannot execute" in (tmp_path / "logs" / "rank1.log").read_text()  # as locally


@pytest.mark.parametrize(("had", "replicas_get"), [("300", "300"), ("-1000", "0"), ("0", "0")])
def test_replicas_get_the_agents_score_but_never_one_below_zero(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, had: str, replicas_get: str
) -> None:
    """What replicas take back: the agent's score before it protected itself, floored at 0 (a
    score inherited from a service the admin protected must not make the job unkillable)."""
    score = tmp_path / "oom_score_adj"
    score.write_text(had + "\n")
    monkeypatch.setattr(node_agent, "OOM_SCORE_ADJ", str(score))
    assert node_agent.protect_from_oom() == replicas_get
    assert score.read_text() == str(node_agent.PROTECTED_OOM_SCORE_ADJ)


def test_a_replica_takes_back_the_oom_score_its_order_names(tmp_path: Path) -> None:
    """The half of the OOM protection that runs everywhere: the replica launcher writes the
    score its order names before anything of the job's runs (raising it needs no privilege,
    so this holds where lowering is not allowed)."""
    spec_r, spec_w = os.pipe()
    report_r, report_w = os.pipe()
    order = {"argv": ["/bin/cat", "/proc/self/oom_score_adj"], "env": {}, "cwd": str(tmp_path),
             "user": None, "umask": None, "oom_score_adj": "500"}  # fmt: skip
    os.write(spec_w, json.dumps(order).encode())
    os.close(spec_w)
    proc = subprocess.run(
        [sys.executable, "-I", "-S", "-c", node_agent.REPLICA_SOURCE, str(spec_r), str(report_w)],
        pass_fds=(spec_r, report_w), capture_output=True, text=True, timeout=30, check=False,
    )  # fmt: skip
    os.close(spec_r)
    os.close(report_w)
    os.close(report_r)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "500"


@pytest.mark.skipif(
    not can_lower_oom_score(), reason="lowering oom_score_adj takes CAP_SYS_RESOURCE"
)
def test_the_oom_killer_spares_the_agent_and_its_replicas_are_as_killable_as_before(
    tmp_path: Path,
) -> None:
    """A job that fills the node's memory must not end the agent (ssh would then lose every
    replica's end): the agent protects itself, and each replica takes back the score the agent
    started with, so the job stays what the OOM killer picks."""
    with open("/proc/self/oom_score_adj") as fh:
        before = fh.read().strip()
    spec = spec_for(
        tmp_path,
        [{"argv": ["/bin/sh", "-c", "cat /proc/self/oom_score_adj; sleep 30"], "env": {}}],
    )
    proc = start_agent(spec)
    try:
        logged = base64.b64decode(next_line(proc, "LOG")[2]).decode()
        agent = Path(f"/proc/{proc.pid}/oom_score_adj").read_text().strip()
    finally:
        proc.kill()
        proc.wait(timeout=30)
    assert agent == str(node_agent.PROTECTED_OOM_SCORE_ADJ)
    assert logged.strip() == before != agent


def test_a_log_the_job_makes_huge_is_sent_only_up_to_the_daemons_limit(tmp_path: Path) -> None:
    """The log is the job's file: made a sparse terabyte, it must not keep the (root) agent
    reading and sending zeros for hours.  What the daemon keeps of it (and one byte more, so
    that its copy notes the cut) is sent; the replica's end is reported at once."""
    grow = "import os; os.write(1, b'hello\\n'); os.ftruncate(1, 1 << 40)"
    spec = spec_for(
        tmp_path, [{"argv": [sys.executable, "-c", grow], "env": {}}], max_log_bytes=100_000
    )
    started = time.monotonic()
    proc = start_agent(spec)
    lines = lines_until_exits(proc, 1)
    elapsed = time.monotonic() - started
    out, _ = proc.communicate(timeout=30)
    lines += [line.split(" ", 2) for line in out.splitlines()]
    assert ["EXIT", "0", "0"] in lines
    sent = b"".join(base64.b64decode(p[2]) for p in lines if p[:2] == ["LOG", "0"])
    assert sent.startswith(b"hello\n") and len(sent) == 100_001
    assert elapsed < 20, elapsed
    assert (tmp_path / "logs" / "rank0.log").stat().st_size == (1 << 40)  # kept on the node


def test_a_stopped_replicas_end_is_said_at_once_however_much_it_wrote(tmp_path: Path) -> None:
    """A stop's grace is short: a replica that answers SIGTERM by making its log huge must
    not hold its ``EXIT`` back while the agent streams it (the daemon would give up on the
    node and take it for lost).  Once stopping, what the backlog holds goes, then the end."""
    script = (
        "import os, signal, time\n"
        "def term(*_):\n"
        "    os.ftruncate(1, 1 << 40)\n"
        "    os._exit(0)\n"
        "signal.signal(signal.SIGTERM, term)\n"
        "print('ready', flush=True)\n"
        "time.sleep(60)\n"
    )
    spec = spec_for(
        tmp_path, [{"argv": [sys.executable, "-c", script], "env": {}}], max_log_bytes=1 << 40
    )
    proc = start_agent(spec)
    assert proc.stdin is not None
    next_line(proc, "PID")
    time.sleep(1.0)  # its handler is set
    proc.stdin.write("TERM\n")
    proc.stdin.flush()
    stopped = time.monotonic()
    lines = lines_until_exits(proc, 1)
    elapsed = time.monotonic() - stopped
    proc.communicate(timeout=30)  # (closes its stdin: the daemon is gone)
    assert ["EXIT", "0", "0"] in lines
    assert elapsed < 10, elapsed  # not the terabyte first


@contextlib.contextmanager
def hopping_agent(
    tmp_path: Path, then: str = "exec sleep 300"
) -> Iterator[tuple[subprocess.Popen[str], Path]]:
    """An agent (:func:`start_agent`) whose one replica starts a pid hopper
    (``tests/launch/hopper.c``) and then runs ``then``: (the agent, the hopper's directory),
    once the replica runs and the hopper hops.  At the end the hopper is asked to stop and the
    agent killed if it still runs.  Skips where no fence can be made."""
    needs_fences()
    hops = tmp_path / "hops"
    hops.mkdir()
    script = f'"$0" {hops} </dev/null >/dev/null 2>&1 & {then}'
    replica = {"argv": ["/bin/sh", "-c", script, str(build_hopper(tmp_path))], "env": {}}
    agent = start_agent(spec_for(tmp_path, [replica]))
    try:
        next_line(agent, "PID")
        wait_hopping(hops)
        yield agent, hops
    finally:
        stop_hopper(hops)
        if agent.poll() is None:
            agent.kill()
            agent.wait()


@pytest.mark.parametrize("how", ["ends", "killed", "daemon gone"])
def test_a_process_that_keeps_changing_its_pid_ends_with_the_incarnation(
    tmp_path: Path, how: str
) -> None:
    """A replica's helper that forks and exits in a loop, a new session at every hop, is
    ended with the incarnation (the agent's fence cgroup, ``node_agent.Fence``): when the
    replicas end, at a ``KILL`` and when the daemon is gone; a listing of pids never
    catches it."""
    then = "sleep 1; exit 0" if how == "ends" else "exec sleep 300"
    with hopping_agent(tmp_path, then) as (proc, hops):
        assert proc.stdin is not None
        if how == "killed":
            proc.stdin.write("KILL\n")
            proc.stdin.flush()
        if how == "daemon gone":
            proc.stdin.close()
            proc.wait(timeout=30)
        else:
            lines_until_exits(proc, 1)
            proc.communicate(timeout=30)
        assert_hopper_gone(hops, "its incarnation")


def test_what_a_replica_left_in_a_session_of_its_own_ends_with_the_incarnation(
    tmp_path: Path,
) -> None:
    """A replica's child in a new session, deaf to SIGTERM, is not in the replica's process
    group: the agent (a child subreaper) still ends it once the replicas have ended, before
    the node's devices go to another job."""
    pid_file = tmp_path / "leftover.pid"
    script = (
        f"setsid sh -c 'trap \"\" TERM; echo $$ > {pid_file}; exec sleep 300' "
        "</dev/null >/dev/null 2>&1 & "
        f"while [ ! -s {pid_file} ]; do sleep 0.05; done; exit 0"
    )
    proc = start_agent(spec_for(tmp_path, [{"argv": ["/bin/sh", "-c", script], "env": {}}]))
    assert ["EXIT", "0", "0"] in lines_until_exits(proc, 1)
    proc.communicate(timeout=30)
    leftover = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while Path(f"/proc/{leftover}").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not Path(f"/proc/{leftover}").exists(), "the setsid child outlived its incarnation"


def test_a_log_planted_as_a_link_is_not_followed(tmp_path: Path) -> None:
    """A replica's log file is opened without following a link at its name: a link planted
    there in advance (to a file of someone else's) leaves its target as it was, that replica
    is not started and says why in its log lines; the others run."""
    target = tmp_path / "someone-elses"
    target.write_text("KEEP\n")
    spec = spec_for(
        tmp_path,
        [{"argv": ["/bin/sh", "-c", "echo ran"], "env": {}} for _ in range(2)],
    )
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "rank1.log").symlink_to(target)
    os.mkfifo(tmp_path / "logs" / "rank2.log")  # and a FIFO is never waited on
    spec["replicas"].append(
        {**spec["replicas"][1], "rank": 2, "log": str(tmp_path / "logs" / "rank2.log")}
    )
    proc = start_agent(spec)
    lines = lines_until_exits(proc, 3)
    out, _ = proc.communicate(timeout=30)
    lines += [line.split(" ", 2) for line in out.splitlines()]
    assert target.read_text() == "KEEP\n"
    assert ["EXIT", "0", "0"] in lines
    for rank in ("1", "2"):
        assert ["EXIT", rank, str(node_agent.NOT_STARTED_EXIT_CODE)] in lines
        said = b"".join(base64.b64decode(p[2]) for p in lines if p[:2] == ["LOG", rank])
        assert b"cannot open its log" in said and b"node n1" in said
        assert not any(p[:2] == ["PID", rank] for p in lines)


@pytest.mark.parametrize("swapped", ["fifo", "link"])
def test_a_probe_file_swapped_by_the_job_fails_the_setup_at_once(
    tmp_path: Path, swapped: str
) -> None:
    """The probe file lies in the job's own checkpoint directory, which its user may change
    at any time: it is read as a plain file only (a FIFO in its place fails at once instead
    of holding the agent, a link is not followed), and no more than a token's worth of it."""
    probe = tmp_path / ".pollux-probe-x"
    token = "a" * 32
    if swapped == "fifo":
        os.mkfifo(probe)
    else:
        (tmp_path / "elsewhere").write_text(token)
        probe.symlink_to(tmp_path / "elsewhere")
    spec = spec_for(tmp_path, [{"argv": ["/bin/true"], "env": {}}])
    spec["probe"] = {"path": str(probe), "token": token, "dir": str(tmp_path)}
    proc = start_agent(spec)
    out, _ = proc.communicate(timeout=20)
    assert proc.returncode == SETUP_FAILED_EXIT_CODE
    assert out.startswith("FAIL checkpoint dir ") and "is not shared" in out


def test_a_missing_working_dir_fails_the_setup(tmp_path: Path) -> None:
    spec = spec_for(tmp_path, [{"argv": ["/bin/true"], "env": {}}])
    spec["cwd"] = str(tmp_path / "absent")
    proc = start_agent(spec)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == SETUP_FAILED_EXIT_CODE
    assert out.startswith("FAIL working directory ") and "node n1" in out


def test_term_signals_the_replicas_and_a_closed_stdin_kills_what_is_left(
    tmp_path: Path,
) -> None:
    spec = spec_for(
        tmp_path,
        [
            {"argv": ["/bin/sleep", "30"], "env": {}},
            {"argv": ["/bin/sh", "-c", "trap '' TERM; echo ready; sleep 30"], "env": {}},
        ],
    )
    proc = start_agent(spec)
    assert proc.stdin is not None
    while base64.b64decode(next_line(proc, "LOG")[2]) != b"ready\n":
        pass  # rank 1 ignores SIGTERM from now on
    proc.stdin.write("TERM\n")
    proc.stdin.flush()
    assert next_line(proc, "EXIT") == ["EXIT", "0", "143"]  # 128 + SIGTERM
    proc.stdin.close()  # the daemon is gone: SIGTERM (ignored here), then SIGKILL
    assert next_line(proc, "EXIT") == ["EXIT", "1", "137"]
    assert proc.wait(timeout=30) == 0


def test_the_exit_record_outlives_the_daemon_and_says_how_each_replica_ended(
    tmp_path: Path,
) -> None:
    record = tmp_path / "run" / "key" / "7.json"
    spec = spec_for(
        tmp_path,
        [
            {"argv": ["/bin/sh", "-c", "exit 0"], "env": {}},
            {"argv": ["/bin/sh", "-c", "trap '' TERM; echo ready; sleep 1; exit 0"], "env": {}},
        ],
        record={"path": str(record), "token": "7:0"},
        orphan_grace_s=10,
    )
    proc = start_agent(spec)
    assert proc.stdin is not None and proc.stdout is not None
    seen: list[list[str]] = []
    while ["EXIT", "0", "0"] not in seen or ["LOG", "1", "ready"] not in seen:
        parts = proc.stdout.readline().rstrip("\n").split(" ", 2)
        assert parts != [""], f"the agent ended after {seen}"
        if parts[0] == "LOG":
            parts[2] = base64.b64decode(parts[2]).decode().strip()
        seen.append(parts)
    running = json.loads(record.read_text())
    assert running["state"] == "running" and running["token"] == "7:0"
    assert running["node"] == "n1"  # whose record it is (nodes may share the file system)
    # each replica named by pid and start time (what a restarted daemon signals by)
    alive = {r["rank"]: r for r in running["replicas"] if r["exit_code"] is None}
    assert 1 in alive and alive[1]["start_time"] == node_agent.start_time(alive[1]["pid"])
    assert alive[1]["start_time"] is not None
    proc.stdin.close()  # the daemon is gone; so is whoever read stdout
    proc.stdout.close()
    assert proc.wait(timeout=30) == 0
    ended = json.loads(record.read_text())
    assert ended["state"] == "ended" and ended["orphaned"] is True
    assert [(r["rank"], r["exit_code"]) for r in ended["replicas"]] == [(0, 0), (1, 0)]
    assert ended["exits"] == [0, 1]
    assert record.stat().st_mode & 0o777 == 0o600
    assert record.parent.stat().st_mode & 0o777 == 0o700


def test_each_replica_is_in_the_exit_record_before_its_command_runs(tmp_path: Path) -> None:
    """An agent killed while it starts replicas leaves none that its record does not name
    (the daemon kills what a killed agent left by its record): each is recorded before its
    launch order is sent, and a launcher without an order runs nothing."""
    record = tmp_path / "run" / "3.json"
    look = f'grep -q "\\"pid\\": $$," {record} && echo listed || echo unlisted'
    spec = spec_for(
        tmp_path,
        [{"argv": ["/bin/sh", "-c", look], "env": {}} for _ in range(3)],
        record={"path": str(record), "token": "3:0"},
    )
    proc = start_agent(spec)
    lines = lines_until_exits(proc, 3)
    said = sorted(base64.b64decode(p[2]).decode().strip() for p in lines if p[0] == "LOG")
    assert said == ["listed"] * 3
    assert proc.stdin is not None
    proc.stdin.close()
    assert proc.wait(timeout=30) == 0


def test_a_node_that_cannot_keep_the_exit_record_starts_nothing(tmp_path: Path) -> None:
    """A job whose node cannot keep its exit record (review s61 filled the node's disk from
    another job) would run unrecorded, and a restarted daemon that finds no record runs it
    again.  The agent writes the record before it starts anything, and starts nothing it
    could not record: ``NODEFAIL`` (the node's fault), and the command never runs."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare (a full file system of the agent's own)")
    full = tmp_path / "full"
    full.mkdir(mode=0o755)
    ran = tmp_path / "ran"
    spec = spec_for(
        tmp_path,
        [{"argv": ["/bin/sh", "-c", f"touch {ran}"], "env": {}}],
        node_workdir=str(full),
        record={"path": str(full / "run" / "3.json"), "token": "3:0"},
    )
    fill = (
        f"mount -t tmpfs -o size=64k,mode=0755 tmpfs {full}"
        f' && {{ head -c 1M /dev/zero > {full}/filler 2>/dev/null; exec "$@"; }}'
    )
    proc = start_agent(spec, prefix=["unshare", "-m", "sh", "-c", fill, "sh"])
    failed = next_line(proc, "NODEFAIL")
    assert "cannot keep the job's exit record" in failed[1] + " " + failed[2], failed
    assert "No space left on device" in failed[2], failed
    assert proc.wait(timeout=30) == 254
    assert not ran.exists()


def test_an_agent_that_can_make_no_fence_tells_the_daemon(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Where no fence can be made (here: no cgroup hierarchy in the agent's mount
    namespace, as in review s61's test bed) the replicas run without one, and the daemon's
    log says so, once per node: the agent's stderr reaches no one."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare (a mount namespace without cgroups)")
    from pollux_local.launch.ssh.group import note_from_node

    spec = spec_for(tmp_path, [{"argv": ["/bin/true"], "env": {}}])
    hide = 'mount -t tmpfs -o size=4k tmpfs /sys/fs/cgroup && exec "$@"'
    proc = start_agent(spec, prefix=["unshare", "-m", "sh", "-c", hide, "sh"])
    note = next_line(proc, "NOTE")
    said = " ".join(note[1:])
    assert said.startswith("no fence for the job's processes"), note
    assert ["EXIT", "0", "0"] in lines_until_exits(proc, 1)  # the job runs, without one
    assert proc.stdin is not None
    proc.stdin.close()
    assert proc.wait(timeout=30) == 0
    with caplog.at_level("WARNING", logger="pollux_local.launch.ssh"):
        for _ in range(3):
            note_from_node("n-test-fence", said)
        for token in ("0123456789abcdef", "fedcba9876543210"):  # each agent's own group
            note_from_node("n-test-fence", f"no fence: cannot create /x/agent-{token}: EROFS")
    warned = [r.getMessage() for r in caplog.records if "n-test-fence" in r.getMessage()]
    assert warned == [
        f"node n-test-fence: {said}",
        "node n-test-fence: no fence: cannot create /x/agent-0123456789abcdef: EROFS",
    ]


def test_a_name_that_is_another_account_on_the_node_is_not_run_as(tmp_path: Path) -> None:
    """The agent runs replicas as the job's user by name; where the name is another uid on
    the node than on the daemon's machine (local accounts made apart), it is another
    account, whose files on shared storage are someone else's: nothing runs (review s62)."""
    import pwd

    if os.geteuid() != 0:
        pytest.skip("runs replicas as another user: needs root")
    nobody = pwd.getpwnam("nobody")
    ran = tmp_path / "ran"
    spec = spec_for(
        tmp_path,
        [{"argv": ["/bin/sh", "-c", f"touch {ran}"], "env": {}}],
        user="nobody",
        user_uid=nobody.pw_uid + 1,
    )
    proc = start_agent(spec)
    failed = next_line(proc, "FAIL")
    said = " ".join(failed[1:])
    assert f"user nobody is uid {nobody.pw_uid} on node n1, not uid {nobody.pw_uid + 1}" in said
    assert proc.wait(timeout=30) == SETUP_FAILED_EXIT_CODE
    assert not ran.exists()


# --- warm resizes ---------------------------------------------------------------------------------

#: A replica that says where its orders come, waits for one and says what it read; then exits
#: with the code given as its argument.
WAIT_FOR_ORDER = """\
import os, sys, time
path = os.environ.get("POLLUX_RESIZE_FILE", "")
print("file", path, flush=True)
while not (path and os.path.exists(path)):
    time.sleep(0.02)
print("order", open(path).read(), flush=True)
sys.exit(int(sys.argv[1]))
"""

#: A joiner: announces itself ready in the job directory (its first argument), then acts as
#: :data:`WAIT_FOR_ORDER`.
JOINER = (
    """\
import os, sys
open(os.path.join(sys.argv[2], "resize-ready-" + sys.argv[3] + "-" + os.environ["RANK"]), "w")
"""
    + WAIT_FOR_ORDER
)


def send(proc: subprocess.Popen[str], line: str) -> None:
    assert proc.stdin is not None
    proc.stdin.write(line + "\n")
    proc.stdin.flush()


def protocol_until(proc: subprocess.Popen[str], last: list[str]) -> list[list[str]]:
    """Protocol lines (``LOG`` decoded) up to and with the first whose leading parts are
    ``last``."""
    assert proc.stdout is not None
    lines: list[list[str]] = []
    while not lines or lines[-1][: len(last)] != last:
        line = proc.stdout.readline()
        assert line, f"the agent ended after {lines}"
        parts = line.rstrip("\n").split(" ", 2)
        if parts[0] == "LOG":
            parts[2] = base64.b64decode(parts[2]).decode()
        lines.append(parts)
    return lines


def logged(lines: list[list[str]], rank: int) -> str:
    return "".join(p[2] for p in lines if p[:2] == ["LOG", str(rank)])


def resize_line(
    generation: int, world_size: int, joiners: list[dict[str, Any]], **extra: Any
) -> str:
    """A ``RESIZE`` line to ``world_size`` replicas, keeping those below it by default."""
    request = {
        "generation": generation,
        "kept": min(world_size, extra.pop("kept", world_size)),
        "order": json.dumps({"generation": generation, "world_size": world_size}),
        "joiners": joiners,
        "ready_timeout_s": 20,
        **extra,
    }
    return "RESIZE " + json.dumps(request)


def joiner(
    tmp_path: Path, rank: int, generation: int, code: int = 0, program: str = JOINER
) -> dict[str, Any]:
    return {
        "rank": rank,
        "argv": [sys.executable, "-c", program, str(code), str(tmp_path), str(generation)],
        "env": {"RANK": str(rank), "POLLUX_RESIZE_FILE": str(tmp_path / "theirs.json")},
        "log": str(tmp_path / "logs" / f"rank{rank}.log"),
        "banner": f"--- joined at resize {generation}\n",
    }


def test_the_agents_ready_file_name_is_the_apis() -> None:
    from pollux_local.api.resize import ready_name

    assert node_agent.READY_NAME.format(generation=7, rank=3) == ready_name(7, 3)


def test_a_warm_grow_starts_the_joiners_and_writes_the_order_once_they_are_ready(
    tmp_path: Path,
) -> None:
    # the job's own POLLUX_RESIZE_FILE is never where its orders come from
    hostile = {"POLLUX_RESIZE_FILE": str(tmp_path / "theirs.json")}
    spec = spec_for(
        tmp_path,
        [{"argv": [sys.executable, "-c", WAIT_FOR_ORDER, "0"], "env": hostile}],
        resize=True,
        record={"path": str(tmp_path / "run" / "1.json"), "token": "1:0"},
    )
    proc = start_agent(spec)
    first = protocol_until(proc, ["LOG", "0"])
    path = Path(logged(first, 0).split()[1])
    assert path.name == "order.json" and path.parent != tmp_path
    assert path.parent.stat().st_mode & 0o777 == 0o755 and not path.exists()
    send(proc, resize_line(5, 2, [joiner(tmp_path, 1, 5)], job_dir=str(tmp_path), kept=1))
    lines = protocol_until(proc, ["ORDERED"])
    assert lines[-1] == ["ORDERED", "5"]
    assert any(p[:2] == ["PID", "1"] for p in lines)
    lines += lines_until_exits(proc, 2)
    out, _ = proc.communicate(timeout=30)
    lines += [line.split(" ", 2) for line in out.splitlines()]
    assert ["EXIT", "0", "0"] in lines and ["EXIT", "1", "0"] in lines
    assert not (tmp_path / "theirs.json").exists()
    rank1 = (tmp_path / "logs" / "rank1.log").read_text()
    assert rank1.startswith("--- joined at resize 5\n") and f"file {path}\n" in rank1
    assert 'order {"generation": 5, "world_size": 2}' in rank1
    assert not path.parent.exists()  # the agent's order directory goes with it
    record = json.loads((tmp_path / "run" / "1.json").read_text())
    assert [(r["rank"], r["exit_code"]) for r in record["replicas"]] == [(0, 0), (1, 0)]


def test_at_a_warm_shrink_the_leaving_rank_is_left_not_exited(tmp_path: Path) -> None:
    spec = spec_for(
        tmp_path,
        [
            {
                "argv": [
                    sys.executable,
                    "-c",
                    WAIT_FOR_ORDER.replace("sys.exit", "time.sleep(0.5); sys.exit"),
                    "0",
                ],
                "env": {},
            },
            {"argv": [sys.executable, "-c", WAIT_FOR_ORDER, "0"], "env": {}},
        ],
        resize=True,
        record={"path": str(tmp_path / "run" / "2.json"), "token": "2:0"},
    )
    proc = start_agent(spec)
    send(proc, resize_line(9, 1, [], job_dir=str(tmp_path)))
    lines = protocol_until(proc, ["LEFT"])
    assert ["ORDERED", "9"] in lines and lines[-1] == ["LEFT", "1", "0"]
    record = json.loads((tmp_path / "run" / "2.json").read_text())
    assert [r["rank"] for r in record["replicas"]] == [0]
    lines += lines_until_exits(proc, 1)
    assert [p for p in lines if p[0] == "EXIT"] == [["EXIT", "0", "0"]]
    send(proc, resize_line(9, 1, [], job_dir=str(tmp_path)))  # not newer, and too late
    assert proc.wait(timeout=30) == 0


def test_what_a_leaving_rank_started_ends_when_it_leaves_at_a_warm_shrink(
    tmp_path: Path,
) -> None:
    """At a warm shrink, what the leaving replica started (a pid hopper) is killed when it
    leaves (its group below the fence, ``Fence.replica``), before ``LEFT`` gives its device
    back, while the replica that stays runs on."""
    needs_fences()
    hops = tmp_path / "hops"
    hops.mkdir()
    hopper = build_hopper(tmp_path)
    stays = WAIT_FOR_ORDER.replace("sys.exit", "time.sleep(3); sys.exit")
    leaves = f'{hopper} {hops} </dev/null >/dev/null 2>&1 & exec "$0" -c "$1" 0'
    spec = spec_for(
        tmp_path,
        [
            {"argv": [sys.executable, "-c", stays, "0"], "env": {}},
            {"argv": ["/bin/sh", "-c", leaves, sys.executable, WAIT_FOR_ORDER], "env": {}},
        ],
        resize=True,
    )
    proc = start_agent(spec)
    try:
        wait_hopping(hops)
        send(proc, resize_line(9, 1, [], job_dir=str(tmp_path)))
        lines = protocol_until(proc, ["LEFT"])
        assert lines[-1] == ["LEFT", "1", "0"]
        assert_hopper_gone(hops, "the rank that left")
        assert not any(p[0] == "EXIT" for p in lines)  # rank 0 runs on
        assert [p for p in lines_until_exits(proc, 1) if p[0] == "EXIT"] == [["EXIT", "0", "0"]]
        assert proc.wait(timeout=30) == 0
    finally:
        stop_hopper(hops)
        if proc.poll() is None:
            proc.kill()


def test_a_joiner_that_fails_or_is_late_fails_the_resize_and_is_no_exit(tmp_path: Path) -> None:
    spec = spec_for(
        tmp_path, [{"argv": ["/bin/sleep", "30"], "env": {}}], resize=True, orphan_grace_s=0.5
    )
    proc = start_agent(spec)
    next_line(proc, "PID")
    send(
        proc,
        resize_line(
            3, 2, [joiner(tmp_path, 1, 3, program="import sys; sys.exit(3)")], job_dir=str(tmp_path)
        ),
    )
    lines = protocol_until(proc, ["LEFT"])
    assert ["WARMFAIL", "3", "joining rank 1 exited with 3 first"] in lines
    assert lines[-1] == ["LEFT", "1", "3"]
    late = joiner(tmp_path, 1, 4, program="import time; time.sleep(30)")
    send(proc, resize_line(4, 2, [late], job_dir=str(tmp_path), ready_timeout_s=0.5))
    lines = protocol_until(proc, ["LEFT"])
    assert ["WARMFAIL", "4", "the joining replicas were not ready in time"] in lines
    assert lines[-1] == ["LEFT", "1", "137"]  # killed: 128 + SIGKILL
    send(proc, resize_line(2, 2, [], job_dir=str(tmp_path)))
    assert protocol_until(proc, ["WARMFAIL"])[-1] == [
        "WARMFAIL",
        "2",
        "not newer than the last resize",
    ]
    send(proc, "garbage {")
    send(proc, "RESIZE {not json")
    assert protocol_until(proc, ["WARMFAIL"])[-1] == ["WARMFAIL", "0", "a malformed resize request"]
    send(proc, "TERM")
    assert next_line(proc, "EXIT") == ["EXIT", "0", "143"]
    assert proc.wait(timeout=30) == 0


def test_replicas_not_started_for_orders_get_no_order_file_and_refuse_resizes(
    tmp_path: Path,
) -> None:
    spec = spec_for(
        tmp_path,
        [
            {
                "argv": ["/bin/sh", "-c", 'echo "[$POLLUX_RESIZE_FILE]"; sleep 30'],
                "env": {"POLLUX_RESIZE_FILE": "/x"},
            }
        ],
    )
    proc = start_agent(spec)
    assert protocol_until(proc, ["LOG", "0"])[-1][2] == "[]\n"
    send(proc, resize_line(1, 2, [joiner(tmp_path, 1, 1)], job_dir=str(tmp_path)))
    reply = protocol_until(proc, ["WARMFAIL"])
    assert reply[-1] == ["WARMFAIL", "1", "the replicas were not started to take resize orders"]
    assert not any(p[:2] == ["PID", "1"] for p in reply)
    send(proc, "KILL")
    assert next_line(proc, "EXIT") == ["EXIT", "0", "137"]
    assert proc.wait(timeout=30) == 0


def test_a_held_resize_is_ready_first_and_ordered_only_when_told(tmp_path: Path) -> None:
    spec = spec_for(
        tmp_path,
        [
            {"argv": [sys.executable, "-c", WAIT_FOR_ORDER, "0"], "env": {}},
            {"argv": [sys.executable, "-c", WAIT_FOR_ORDER, "0"], "env": {}},
        ],
        resize=True,
    )
    proc = start_agent(spec)
    # rank 1 leaves and a joiner takes its place (a move); the order is written here
    line = resize_line(6, 2, [joiner(tmp_path, 2, 6)], job_dir=str(tmp_path), kept=1, hold=True)
    send(proc, line)
    lines = protocol_until(proc, ["READY"])
    assert lines[-1] == ["READY", "6"]
    if not logged(lines, 0):  # rank 0's first words may come before READY or after
        lines += protocol_until(proc, ["LOG", "0"])
    order_file = Path(logged(lines, 0).split()[1])
    assert not order_file.exists()  # held
    send(proc, "ORDER 5")  # not this resize's
    send(proc, "ORDER 6")
    lines = protocol_until(proc, ["ORDERED"])
    assert json.loads(order_file.read_text()) == {"generation": 6, "world_size": 2}
    assert proc.stdout is not None  # every replica ends by itself: so does the agent
    lines += [line.split(" ", 2) for line in proc.stdout.read().splitlines()]
    # rank 1 was running before the order and is not kept: it left; the joiner did not
    assert ["LEFT", "1", "0"] in lines and ["EXIT", "2", "0"] in lines
    assert ["EXIT", "0", "0"] in lines and not any(p[:2] == ["EXIT", "1"] for p in lines)
    assert proc.wait(timeout=30) == 0


def test_an_aborted_held_resize_kills_its_joiners(tmp_path: Path) -> None:
    spec = spec_for(tmp_path, [{"argv": ["/bin/sleep", "30"], "env": {}}], resize=True)
    proc = start_agent(spec)
    next_line(proc, "PID")
    send(
        proc,
        resize_line(
            8, 2, [joiner(tmp_path, 1, 8)], job_dir=str(tmp_path), order=None, kept=1, hold=True
        ),
    )
    assert protocol_until(proc, ["READY"])[-1] == ["READY", "8"]
    send(proc, "ABORT 8")
    lines = protocol_until(proc, ["LEFT"])
    assert ["WARMFAIL", "8", "the resize was called off"] in lines
    assert lines[-1][:2] == ["LEFT", "1"]
    send(proc, "ORDER 8")  # too late: nothing
    send(proc, "TERM")
    assert next_line(proc, "EXIT") == ["EXIT", "0", "143"]
    assert proc.wait(timeout=30) == 0


def joining_agent(tmp_path: Path, program: str = JOINER) -> subprocess.Popen[str]:
    """An agent started for a node the group grows onto (resize 4): its one replica, rank 1,
    runs ``program`` as a joiner."""
    join = {"generation": 4, "ready_timeout_s": 20, "job_dir": str(tmp_path)}
    spec = spec_for(tmp_path, [], resize=True, join=join)
    spec["replicas"] = [joiner(tmp_path, 1, 4, program=program)]
    return start_agent(spec)


def test_a_node_joined_by_a_growing_group_starts_its_replicas_as_joiners(tmp_path: Path) -> None:
    proc = joining_agent(tmp_path)
    lines = protocol_until(proc, ["READY"])
    assert lines[-1] == ["READY", "4"] and any(p[:2] == ["PID", "1"] for p in lines)
    send(proc, "ORDER 4")
    assert protocol_until(proc, ["ORDERED"])[-1] == ["ORDERED", "4"]
    # the order is read on rank 0's node: nothing is written here, and the joiner waits on
    send(proc, "TERM")
    assert next_line(proc, "EXIT") == ["EXIT", "1", "143"]
    assert proc.wait(timeout=30) == 0


def test_a_node_joined_whose_joiner_fails_ends_with_its_replica_left(tmp_path: Path) -> None:
    proc = joining_agent(tmp_path, program="import sys; sys.exit(3)")
    lines = protocol_until(proc, ["LEFT"])
    assert ["WARMFAIL", "4", "joining rank 1 exited with 3 first"] in lines
    assert lines[-1] == ["LEFT", "1", "3"]
    out, _ = proc.communicate(timeout=30)  # nothing left to run: it ends by itself
    assert proc.returncode == 0 and "EXIT" not in out


def test_the_renaming_rule_keeps_a_prefix_and_moves_leavers_out_of_the_way() -> None:
    assert node_agent.relabelling([0, 1, 2], [0, 1]) == {}
    assert node_agent.relabelling([0, 1, 2], [1, 2]) == {0: -1, 1: 0, 2: 1}
    assert node_agent.relabelling([3, 5], [0, 3, 5]) == {3: 1, 5: 2}


def test_a_resize_that_renumbers_renames_the_replicas_before_any_joiner_starts(
    tmp_path: Path,
) -> None:
    """Rank 0 leaves, rank 1 becomes rank 0, and a joiner takes rank 1: the joiner's rank was
    the stayer's until the rename, which comes first (``RENAMED``)."""
    spec = spec_for(
        tmp_path,
        [
            {"argv": [sys.executable, "-c", WAIT_FOR_ORDER, "0"], "env": {}},
            {"argv": [sys.executable, "-c", WAIT_FOR_ORDER, "0"], "env": {}},
        ],
        resize=True,
        record={"path": str(tmp_path / "run" / "7.json"), "token": "7:0"},
    )
    proc = start_agent(spec)
    next_line(proc, "PID")
    next_line(proc, "PID")
    line = resize_line(7, 2, [joiner(tmp_path, 1, 7)], job_dir=str(tmp_path), ranks=[1], hold=True)
    send(proc, line)
    lines = protocol_until(proc, ["READY"])
    kinds = [p[:2] for p in lines if p[0] in ("RENAMED", "PID")]
    assert kinds == [["RENAMED", "7"], ["PID", "1"]]  # renamed, then the joiner
    send(proc, "ORDER 7")
    lines += protocol_until(proc, ["ORDERED"])
    assert proc.stdout is not None  # every replica ends by itself: so does the agent
    lines += [line.split(" ", 2) for line in proc.stdout.read().splitlines()]
    # the old rank 0 left under its new name; the old rank 1 ended as rank 0; the joiner as 1
    assert ["LEFT", "-1", "0"] in lines
    assert sorted(p for p in lines if p[0] == "EXIT") == [["EXIT", "0", "0"], ["EXIT", "1", "0"]]
    assert proc.wait(timeout=30) == 0
    record = json.loads((tmp_path / "run" / "7.json").read_text())
    assert [(r["rank"], r["exit_code"]) for r in record["replicas"]] == [(0, 0), (1, 0)]


def test_the_agents_command_fits_in_one_argument_with_room(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An SSH node's shell gets the agent's whole source in one argument (``sh -c``), which
    Linux caps at 128 KiB: the command stays under three quarters of it, so that the agent's
    growth is noticed here long before ssh fails on a node; one over the cap is refused in
    one line."""
    from pollux_local.errors import PolluxError
    from pollux_local.launch.ssh import nodes

    for command in (
        nodes.agent_command("/usr/bin/python3", unbuffered=True),
        nodes.agent_command("python3", "record", "cat", "/w" * 200, "run/k/1@n.json"),
    ):
        assert len(command.encode()) < 0.75 * nodes.MAX_COMMAND_BYTES, len(command)
    monkeypatch.setattr(nodes, "node_agent_source", lambda: "pass\n" * 30_000)
    with pytest.raises(PolluxError, match="over the 131072 one argument may hold"):
        nodes.agent_command("python3")


def test_a_replica_of_another_user_joins_a_session_keyring_of_its_own() -> None:
    """Review s55: replicas possessed the agent's session keyring, shared with every other
    user's jobs on the node.  The replica launcher, told ``keyctl`` (the system call's number),
    joins a new one before the job's command runs."""
    import ctypes
    import shutil

    from pollux_local.launch.identity import KEYCTL_JOIN_SESSION_KEYRING, keyctl_number

    number, python = keyctl_number(), shutil.which("python3", path="/usr/bin:/bin")
    if os.geteuid() != 0 or number is None or python is None:
        pytest.skip("needs root, a known keyctl number and the system's python3")
    libc = ctypes.CDLL(None, use_errno=True)
    name = ctypes.c_char_p(b"pollux-test-agent")
    if libc.syscall(ctypes.c_long(number), ctypes.c_long(KEYCTL_JOIN_SESSION_KEYRING), name) < 0:
        pytest.skip("no keyrings here")
    from tests.launch.test_supervisor import KEYRING_ID

    probe = [python, "-c", KEYRING_ID, str(number)]
    ours = subprocess.run(probe, capture_output=True, text=True, check=True).stdout.split()[0]
    nobody = {"uid": 65534, "gid": 65534, "groups": [65534]}
    seen = []
    for keyctl in (number, None):  # with the number, and (as before) without
        spec_r, spec_w = os.pipe()
        report_r, report_w = os.pipe()
        order = {"argv": probe, "env": {}, "cwd": "/tmp", "user": nobody, "umask": None,
                 "oom_score_adj": None, "keyctl": keyctl}  # fmt: skip
        os.write(spec_w, json.dumps(order).encode())
        os.close(spec_w)
        proc = subprocess.run(
            [sys.executable, "-I", "-S", "-c", node_agent.REPLICA_SOURCE, str(spec_r),
             str(report_w)],
            pass_fds=(spec_r, report_w), capture_output=True, text=True, timeout=30, check=False,
        )  # fmt: skip
        for fd in (spec_r, report_w, report_r):
            os.close(fd)
        assert proc.returncode == 0, proc.stderr
        seen.append(proc.stdout.split())
    assert int(ours) > 0 and int(seen[0][0]) > 0
    assert seen[0][0] != ours and seen[0][1] == "65534"  # its own, nobody's
    assert seen[1][0] == ours  # the agent's, shared: what the number prevents
