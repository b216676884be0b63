"""A real daemon with local jobs under their supervisors: stops that never stall scheduling,
nothing of a job left after a cancel, a daemon SIGKILLed and restarted (jobs re-adopted, or
their recorded outcome applied, never run twice), hostile files in a job's directory, and (as
root) a second Unix user whose jobs run as that user."""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import secrets
import shutil
import signal
import sqlite3
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from pollux_local.errors import PolluxError
from tests.daemon_process import DaemonFactory, DaemonProcess, log_tail, wait_for
from tests.labinstall import world_readable_tempdir

pytestmark = pytest.mark.timeout(120)

TERMINAL = ("succeeded", "failed", "cancelled")

#: A job (``sh -c WAITER waiter DIR CODE``) that counts its runs in DIR/runs, writes its pid to
#: DIR/pid, and on its first run waits for DIR/go and exits CODE; later runs exit 0 at once.
WAITER = """
echo run >> "$1/runs"
echo $$ > "$1/pid.tmp"; mv "$1/pid.tmp" "$1/pid"
[ "$(wc -l < "$1/runs")" -gt 1 ] && exit 0
while [ ! -e "$1/go" ]; do sleep 0.05; done
exit "$2"
"""


def config(tmp_path: Path, **daemon_keys: float) -> Path:
    keys = {"stop_grace_s": 6, "backoff_s": 0.2, "max_retries": 1, **daemon_keys}
    path = tmp_path / "config.toml"
    path.write_text(
        '[scheduler]\npolicy = "fifo"\ninterval_s = 0.5\n\n[daemon]\n'
        + "".join(f"{key} = {value}\n" for key, value in keys.items())
    )
    return path


def start_daemon(
    daemons: DaemonFactory, state_dir: Path, conf: Path, devices: str = "cpu:2"
) -> DaemonProcess:
    return daemons(config=conf, devices=devices, state_dir=state_dir)


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def show(daemon: DaemonProcess, job_id: str) -> dict[str, Any]:
    return dict(daemon.client.request("show", id=job_id))


def state(daemon: DaemonProcess, job_id: str) -> str:
    return str(show(daemon, job_id)["job"]["state"])


def kinds(daemon: DaemonProcess, job_id: str) -> list[str]:
    return [d["kind"] for d in show(daemon, job_id)["decisions"]]


def submit(daemon: DaemonProcess, argv: list[str], workdir: Path, **fields: Any) -> str:
    return str(daemon.client.request("submit", argv=argv, workdir=str(workdir), **fields)["id"])


def run_file(daemon: DaemonProcess, job_id: str) -> dict[str, Any] | None:
    path = daemon.state_dir / "run" / f"{job_id}.json"
    with contextlib.suppress(OSError, ValueError):
        return dict(json.loads(path.read_text()))
    return None


def starts(daemon: DaemonProcess, job_id: str) -> int:
    """How many incarnations began: the banners in the job's rank-0 log."""
    log = daemon.state_dir / "jobs" / job_id / "rank0.log"
    return sum(
        1 for line in log.read_text().splitlines() if line.startswith("--- ") and " start #" in line
    )


@pytest.fixture()
def daemons(daemon_factory: DaemonFactory) -> Iterator[DaemonFactory]:
    """The shared factory, and at the end (each daemon stopped) any supervisor left of a job
    (a daemon SIGKILLed and not restarted) killed with what runs below it: what only this
    module's tests leave behind."""
    yield daemon_factory
    daemon_factory.stop_all()
    for path in {d.state_dir for d in daemon_factory.started}:
        for record in (path / "run").glob("*.json") if (path / "run").is_dir() else ():
            with contextlib.suppress(OSError, ValueError, KeyError):
                pid = int(json.loads(record.read_text())["supervisor"]["pid"])
                proc = psutil.Process(pid)
                if "pollux_local.launch.supervisor" in " ".join(proc.cmdline()):
                    for child in proc.children(recursive=True):
                        child.kill()
                    proc.kill()


# --- stops never stall scheduling; a cancel leaves nothing behind ---------------------------------


ESCAPEE = """
setsid sh -c 'trap "" TERM HUP; echo $$ > "$0.tmp"; mv "$0.tmp" "$0"; while :; do sleep 0.2; done' "$1" \\
    </dev/null >/dev/null 2>&1 &
echo $$ > "$2"
while :; do sleep 0.2; done
"""


def test_cancel_leaves_no_process_of_the_job(tmp_path: Path, daemons: DaemonFactory) -> None:
    daemon = start_daemon(daemons, tmp_path / "state", config(tmp_path))
    grandchild_file, replica_file = tmp_path / "grandchild", tmp_path / "replica"
    job_id = submit(
        daemon, ["sh", "-c", ESCAPEE, "escapee", str(grandchild_file), str(replica_file)],
        tmp_path,
    )  # fmt: skip
    wait_for(lambda: grandchild_file.exists() and replica_file.exists(), 20, "the job to fork")
    grandchild, replica = int(grandchild_file.read_text()), int(replica_file.read_text())
    supervisor = int(wait_for(lambda: run_file(daemon, job_id), 5, "run file")["supervisor"]["pid"])
    assert alive(grandchild) and os.getsid(grandchild) == grandchild

    daemon.client.request("cancel", ids=[job_id])
    assert state(daemon, job_id) == "cancelled"
    wait_for(lambda: not any(map(alive, (grandchild, replica, supervisor))), 10, "the job's end")
    # its result taken in: the daemon hears of the supervisor's end a moment after it (a full
    # run once read the run file still there)
    wait_for(lambda: run_file(daemon, job_id) is None, 10, "the run file taken in")


STUBBORN = 'trap "" TERM; echo $$ > "$0"; while :; do sleep 0.1; done'


def test_cancelling_a_job_that_ignores_sigterm_stalls_nobody(
    tmp_path: Path, daemons: DaemonFactory
) -> None:
    daemon = start_daemon(daemons, tmp_path / "state", config(tmp_path, stop_grace_s=8))
    pid_file = tmp_path / "stubborn"
    stubborn = submit(daemon, ["sh", "-c", STUBBORN, str(pid_file)], tmp_path, name="stubborn")
    wait_for(lambda: pid_file.exists() and pid_file.read_text().strip(), 20, "the stubborn job")
    pid = int(pid_file.read_text())

    started = time.monotonic()
    daemon.client.request("cancel", ids=[stubborn])
    assert time.monotonic() - started < 2.0, "cancel waited for the job's stop"
    assert state(daemon, stubborn) == "cancelled"
    # another job is scheduled and runs to its end while the stubborn one still dies
    other = submit(daemon, ["sh", "-c", "echo other ran"], tmp_path, name="other")
    wait_for(lambda: state(daemon, other) in TERMINAL, 6, "the other job to run")
    assert state(daemon, other) == "succeeded"
    assert alive(pid), "the stubborn job should still be within its grace period"
    assert time.monotonic() - started < 8.0
    # ...and the stubborn job is killed once its grace is over (by its supervisor)
    wait_for(lambda: not alive(pid), 15, "the stubborn job to be killed")
    assert time.monotonic() - started >= 7.5


# --- a daemon SIGKILLed while jobs run ----------------------------------------------------------


@pytest.mark.parametrize(
    ("code", "outcome", "runs", "decision"),
    # 75 nobody asked for (no resize was under way) is a crash like 3
    [(0, "succeeded", 1, "finished"), (3, "succeeded", 2, "crashed"),
     (75, "succeeded", 2, "crashed")],
)  # fmt: skip
def test_a_job_that_ended_while_the_daemon_was_down_is_taken_as_it_ended(
    tmp_path: Path, daemons: DaemonFactory, code: int, outcome: str, runs: int,
    decision: str,
) -> None:  # fmt: skip
    conf = config(tmp_path)
    daemon = start_daemon(daemons, tmp_path / "state", conf)
    job_id = submit(
        daemon, ["sh", "-c", WAITER, "waiter", str(tmp_path), str(code)], tmp_path, retries=1
    )
    # its start recorded too: a daemon killed between the launch and that record never knew
    # the job ran (its supervisor's result is then a stray one's)
    wait_for(
        lambda: (tmp_path / "pid").exists() and state(daemon, job_id) == "running",
        20, "the job to run",
    )  # fmt: skip
    daemon.kill()

    (tmp_path / "go").touch()
    wait_for(lambda: (run_file(daemon, job_id) or {}).get("state") == "ended", 10, "its end")
    assert run_file(daemon, job_id)["exit_code"] == code  # type: ignore[index]

    daemon = start_daemon(daemons, tmp_path / "state", conf)
    wait_for(lambda: state(daemon, job_id) in TERMINAL, 20, "the job to end")
    time.sleep(1.5)  # a few passes: nothing runs it again
    job = show(daemon, job_id)["job"]
    assert job["state"] == outcome
    assert (tmp_path / "runs").read_text().count("run") == runs
    assert starts(daemon, job_id) == runs
    assert "recovered" in kinds(daemon, job_id) and decision in kinds(daemon, job_id)
    assert job["failures"] == (0 if code == 0 else 1)


def test_a_job_still_running_at_the_restart_is_adopted_not_restarted(
    tmp_path: Path, daemons: DaemonFactory
) -> None:
    conf = config(tmp_path)
    daemon = start_daemon(daemons, tmp_path / "state", conf)
    job_id = submit(daemon, ["sh", "-c", WAITER, "waiter", str(tmp_path), "0"], tmp_path)
    wait_for(lambda: (tmp_path / "pid").exists(), 20, "the job to run")
    # its start recorded (a start not yet recorded is the test below's)
    before = wait_for(lambda: (job := show(daemon, job_id)["job"])["pids"] and job, 20, "pids")
    supervisor = int(run_file(daemon, job_id)["supervisor"]["pid"])  # type: ignore[index]
    replica = int((tmp_path / "pid").read_text())
    daemon.kill()
    assert alive(supervisor) and alive(replica)

    daemon = start_daemon(daemons, tmp_path / "state", conf)
    after = show(daemon, job_id)
    assert after["job"]["state"] == "running"
    assert after["job"]["pids"] == before["pids"] and after["job"]["pids"][0]["pid"] == replica
    assert after["decisions"][-1]["kind"] == "recovered"
    assert "kept running" in after["decisions"][-1]["reason"]
    time.sleep(1.0)  # passes go by: it is left running as it is
    assert state(daemon, job_id) == "running" and alive(replica)

    (tmp_path / "go").touch()
    wait_for(lambda: state(daemon, job_id) in TERMINAL, 20, "the job to end")
    assert state(daemon, job_id) == "succeeded"
    assert (tmp_path / "runs").read_text().count("run") == 1 and starts(daemon, job_id) == 1
    assert not alive(supervisor)


def test_a_job_running_across_an_upgrade_is_adopted_not_restarted(
    tmp_path: Path, daemons: DaemonFactory
) -> None:
    """An upgrade (review s79): the old daemon killed while a job runs, its database at
    schema 5 (the daemons of 2026-11-26) and the run file of a supervisor of 2026-11-23 (no
    cgroups, OOM, memory limit, warm-resize, start-time or incarnation keys).  The new daemon
    migrates the database and adopts the running job: it runs once and ends as it ends."""
    conf = config(tmp_path)
    daemon = start_daemon(daemons, tmp_path / "state", conf)
    job_id = submit(daemon, ["sh", "-c", WAITER, "waiter", str(tmp_path), "0"], tmp_path,
                    env={"SEED": "42"})  # fmt: skip
    wait_for(lambda: (tmp_path / "pid").exists(), 20, "the job to run")
    wait_for(lambda: show(daemon, job_id)["job"]["pids"], 20, "its start recorded")
    daemon.kill()

    db = sqlite3.connect(daemon.state_dir / "state.db")
    db.executescript(
        "DROP INDEX jobs_argv_ref; DROP INDEX jobs_env_ref; DROP INDEX jobs_owner_kept;"
        " DROP INDEX blobs_size; DROP TABLE dependency_outcomes; DROP TABLE admin_holds;"
        " ALTER TABLE jobs DROP COLUMN queued_since;"
        " UPDATE meta SET value = '5' WHERE key = 'schema_version';"
    )
    db.close()
    path = daemon.state_dir / "run" / f"{job_id}.json"
    record = json.loads(path.read_text())
    for key in ("cgroups", "oom_killed", "memory_limit", "warm", "started"):
        record.pop(key, None)
    record["launch"].pop("incarnation", None)
    path.write_text(json.dumps(record))  # in place: the daemon's own file, as it was

    daemon = start_daemon(daemons, tmp_path / "state", conf)
    db = sqlite3.connect(daemon.state_dir / "state.db")
    from pollux_local.daemon.state.schema import SCHEMA_VERSION

    version = db.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
    assert version == (str(SCHEMA_VERSION),)  # migrated from 5
    db.close()
    after = show(daemon, job_id)
    assert after["job"]["state"] == "running" and after["job"]["env"]["SEED"] == "42"
    assert after["decisions"][-1]["kind"] == "recovered"
    time.sleep(1.0)  # passes go by: it is left running as it is
    assert state(daemon, job_id) == "running"
    (tmp_path / "go").touch()
    ends_once_as(daemon, job_id, "succeeded", tmp_path)
    assert starts(daemon, job_id) == 1


def with_node(tmp_path: Path, name: str, devices: str) -> Path:
    """The test config with one local node ``name`` of ``devices`` (``cpu:N``)."""
    path = tmp_path / f"{name}-{devices.replace(':', '')}.toml"
    path.write_text(config(tmp_path).read_text() + f'[nodes.{name}]\ndevices = "{devices}"\n')
    return path


def ends_once_as(daemon: DaemonProcess, job_id: str, outcome: str, folder: Path) -> None:
    """The job ends as ``outcome``, its one run counted in ``folder/runs``, and a few passes
    later nothing has run it again."""
    wait_for(lambda: state(daemon, job_id) in TERMINAL, 20, "the job's end")
    time.sleep(1.5)
    assert state(daemon, job_id) == outcome
    assert (folder / "runs").read_text().count("run") == 1


@pytest.mark.parametrize(("code", "outcome"), [(0, "succeeded"), (3, "failed")])
def test_a_start_made_but_not_recorded_is_adopted_not_run_again(
    tmp_path: Path, daemons: DaemonFactory, code: int, outcome: str
) -> None:
    """A daemon killed between a job's launch and the record of its start finds it queued
    with a run file of that start: it is recorded as running and adopted (its exit applied
    whatever its code), where it was stopped as a stray and run again (a review's
    reproduction: a rigid job killed and rerun, a failed run's result thrown away)."""
    import sqlite3

    conf = config(tmp_path)
    daemon = start_daemon(daemons, tmp_path / "state", conf)
    job_id = submit(daemon, ["sh", "-c", WAITER, "waiter", str(tmp_path), str(code)], tmp_path)
    wait_for(
        lambda: (tmp_path / "pid").exists() and state(daemon, job_id) == "running",
        20, "the job to run",
    )  # fmt: skip
    daemon.kill()
    # the store as the killed daemon would have left it a moment earlier: queued, never started
    db = sqlite3.connect(tmp_path / "state" / "state.db")
    with db:
        db.execute(
            "UPDATE jobs SET state = 'queued', restarts = 0, placement = '{}', pids = '[]',"
            " last_start = NULL, start_time = NULL WHERE id = ?", (int(job_id),),
        )  # fmt: skip
    db.close()
    replica = int((tmp_path / "pid").read_text())

    daemon = start_daemon(daemons, tmp_path / "state", conf)
    after = show(daemon, job_id)
    assert after["job"]["state"] == "running", after["decisions"]
    assert "not recorded" in after["decisions"][-2]["reason"]
    assert after["job"]["devices"] and alive(replica)
    # its processes, from the run file: what tells its own from others on its devices
    assert [(p["rank"], p["pid"]) for p in after["job"]["pids"]] == [(0, replica)]
    (tmp_path / "go").touch()
    ends_once_as(daemon, job_id, outcome, tmp_path)


def test_a_job_on_a_node_the_config_dropped_is_stopped_before_it_runs_again(
    tmp_path: Path, daemons: DaemonFactory
) -> None:
    """The local node a job ran on renamed in the config across a crash: its replicas are
    stopped first, then it runs again on the node of the new name; never two at once (it
    was queued again while its first run went on, unsupervised)."""
    old, new = with_node(tmp_path, "ws1", "cpu:1"), with_node(tmp_path, "ws2", "cpu:1")
    daemon = daemons(config=old, state_dir=tmp_path / "state")
    job_id = submit(daemon, ["sh", "-c", WAITER, "waiter", str(tmp_path), "0"], tmp_path)
    wait_for(lambda: (tmp_path / "pid").exists(), 20, "the job to run")
    first = int((tmp_path / "pid").read_text())
    daemon.kill()
    assert alive(first)

    daemon = daemons(config=new, state_dir=tmp_path / "state")
    assert not alive(first)  # stopped before the daemon served anyone
    wait_for(lambda: state(daemon, job_id) in TERMINAL, 30, "its second run")
    assert state(daemon, job_id) == "succeeded"
    assert (tmp_path / "runs").read_text().count("run") == 2


@pytest.mark.parametrize(("code", "outcome"), [(0, "succeeded"), (3, "failed")])
def test_a_job_that_ended_on_a_node_the_config_dropped_is_taken_as_it_ended(
    tmp_path: Path, daemons: DaemonFactory, code: int, outcome: str
) -> None:
    """Its end, recorded by its supervisor while the daemon was down, is applied, not thrown
    away with the node (the job ran a second time)."""
    old, new = with_node(tmp_path, "ws1", "cpu:1"), with_node(tmp_path, "ws2", "cpu:1")
    daemon = daemons(config=old, state_dir=tmp_path / "state")
    job_id = submit(daemon, ["sh", "-c", WAITER, "waiter", str(tmp_path), str(code)], tmp_path)
    wait_for(lambda: (tmp_path / "pid").exists(), 20, "the job to run")
    daemon.kill()
    (tmp_path / "go").touch()
    wait_for(lambda: (run_file(daemon, job_id) or {}).get("state") == "ended", 10, "its end")

    daemon = daemons(config=new, state_dir=tmp_path / "state")
    ends_once_as(daemon, job_id, outcome, tmp_path)


def test_a_daemon_back_with_fewer_devices_keeps_them_until_their_jobs_end(
    tmp_path: Path, daemons: DaemonFactory
) -> None:
    """A device the config dropped across a restart is kept (reserved) until the job adopted
    on it ends, as a reload keeps it: that job was stopped and run again."""
    both, one = with_node(tmp_path, "ws1", "cpu:2"), with_node(tmp_path, "ws1", "cpu:1")
    daemon = daemons(config=both, state_dir=tmp_path / "state")
    dirs = [tmp_path / "a", tmp_path / "b"]
    ids = []
    for folder in dirs:
        folder.mkdir()
        ids.append(submit(daemon, ["sh", "-c", WAITER, "waiter", str(folder), "0"], tmp_path))
    wait_for(lambda: all((d / "pid").exists() for d in dirs), 20, "both to run")
    daemon.kill()

    daemon = daemons(config=one, state_dir=tmp_path / "state")
    time.sleep(1.5)  # passes go by: neither is stopped
    assert [state(daemon, job) for job in ids] == ["running", "running"]
    for folder in dirs:
        (folder / "go").touch()
    wait_for(lambda: all(state(daemon, job) in TERMINAL for job in ids), 20, "their ends")
    assert [state(daemon, job) for job in ids] == ["succeeded", "succeeded"]
    assert [(d / "runs").read_text().count("run") for d in dirs] == [1, 1]


#: A job (``sh -c SLOW_STOP slow DIR``) that counts its runs in DIR/runs and writes its pid to
#: DIR/pid; on its first run it takes 3 s to stop on SIGTERM (then exits 143), later runs
#: exit 0 at once.
SLOW_STOP = """
echo run >> "$1/runs"
[ "$(wc -l < "$1/runs")" -gt 1 ] && exit 0
trap 'sleep 3; exit 143' TERM
echo $$ > "$1/pid.tmp"; mv "$1/pid.tmp" "$1/pid"
while :; do sleep 0.1; done
"""


def test_a_stopping_daemon_leaves_a_job_that_may_not_be_stopped_running(
    tmp_path: Path, daemons: DaemonFactory
) -> None:
    """A daemon stopped (an upgrade, ``systemctl restart``) leaves a rigid job that is not
    ``--preemptible`` running under its supervisor, and the next one adopts it: it ran
    again from its start.  A preemptible one is checkpoint-stopped and queued, recorded
    first: a daemon killed while it waits for that stop leaves it queued, not failed by its
    SIGTERM."""
    conf = config(tmp_path)
    daemon = start_daemon(daemons, tmp_path / "state", conf)
    rigid_dir, loose_dir = tmp_path / "rigid", tmp_path / "loose"
    rigid_dir.mkdir()
    loose_dir.mkdir()
    rigid = submit(daemon, ["sh", "-c", WAITER, "waiter", str(rigid_dir), "0"], tmp_path)
    loose = submit(
        daemon, ["sh", "-c", SLOW_STOP, "slow", str(loose_dir)], tmp_path, preemptible=True
    )
    wait_for(lambda: (rigid_dir / "pid").exists() and (loose_dir / "pid").exists(), 20, "runs")
    replica, stopping = int((rigid_dir / "pid").read_text()), int((loose_dir / "pid").read_text())
    database = tmp_path / "state" / "state.db"

    def states() -> dict[int, str]:
        return dict(sqlite3_rows(database, "SELECT id, state FROM jobs"))

    # both starts recorded: a start launched but not yet recorded is still "queued", and the
    # wait below passed at once; the daemon, killed before it took the SIGTERM, left the
    # preemptible job running for the next one to adopt, never stopped (seen in full runs)
    wait_for(lambda: states() == {int(rigid): "running", int(loose): "running"}, 20, "starts")
    os.kill(daemon.pid, signal.SIGTERM)  # the daemon stops: it waits for the slow stop
    wait_for(lambda: states()[int(loose)] == "queued", 5, "the stop recorded")
    assert alive(stopping)  # still stopping when the daemon is killed
    daemon.kill()
    assert alive(replica) and states()[int(rigid)] == "running"  # left running

    daemon = start_daemon(daemons, tmp_path / "state", conf)
    after = show(daemon, rigid)
    assert after["job"]["state"] == "running" and "kept running" in after["decisions"][-1]["reason"]
    (rigid_dir / "go").touch()

    def seen() -> str:
        shown = {job: show(daemon, job) for job in (rigid, loose)}
        return "\n".join(
            [f"job {job}: {s['job']['state']}; {[d['reason'] for d in s['decisions'][-3:]]}"
             for job, s in shown.items()]
            + [log_tail(daemon.state_dir / "daemon.log")]
        )  # fmt: skip

    # the preemptible job starts again only once its slow stop has ended
    wait_for(lambda: state(daemon, rigid) in TERMINAL and state(daemon, loose) in TERMINAL, 60,
             "both to end", seen)  # fmt: skip
    assert state(daemon, rigid) == "succeeded" and state(daemon, loose) == "succeeded"
    assert (rigid_dir / "runs").read_text().count("run") == 1
    assert (loose_dir / "runs").read_text().count("run") == 2  # stopped once, resumed once


def sqlite3_rows(path: Path, query: str) -> list[tuple[Any, ...]]:
    import sqlite3

    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        return list(db.execute(query).fetchall())
    finally:
        db.close()


def test_a_log_swapped_for_a_symlink_is_not_followed_on_restart(
    tmp_path: Path, daemons: DaemonFactory
) -> None:
    vault = tmp_path / "vault"
    vault.mkdir(mode=0o700)
    secret = vault / "secret"
    secret.write_text("TOPSECRET-" + secrets.token_hex(8) + "\n")
    secret.chmod(0o600)
    before = secret.stat()
    mark = tmp_path / "first-run"
    attack = f"""if [ ! -e {mark} ]; then
    touch {mark}
    rm -f "$POLLUX_JOB_DIR/rank0.log"
    ln -s {secret} "$POLLUX_JOB_DIR/rank0.log"
    exit 1
fi
echo second run
"""
    daemon = start_daemon(daemons, tmp_path / "state", config(tmp_path))
    job_id = submit(daemon, ["sh", "-c", attack], tmp_path, retries=1)
    wait_for(lambda: state(daemon, job_id) in TERMINAL, 30, "the job to end")
    assert mark.exists()
    after = secret.stat()
    assert secret.read_text().startswith("TOPSECRET-")
    assert (after.st_size, after.st_mtime_ns, after.st_mode) == (
        before.st_size,
        before.st_mtime_ns,
        before.st_mode,
    )
    job = show(daemon, job_id)["job"]
    assert job["state"] == "failed" and "symlink" in job["reason"], job
    with pytest.raises(PolluxError) as refused:
        daemon.client.request("logs", id=job_id)
    assert "TOPSECRET" not in str(refused.value)
    assert "crashed" in kinds(daemon, job_id)


# --- a second Unix user (root only) -------------------------------------------------------------

RAW_REQUEST = r"""
import socket, sys
sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
sock.settimeout(20)
sock.connect(sys.argv[1])
body = sys.argv[2].encode()
sock.sendall(len(body).to_bytes(4, "big") + body)
def recv(n):
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise SystemExit("closed")
        data += chunk
    return data
sys.stdout.write(recv(int.from_bytes(recv(4), "big")).decode())
"""


@pytest.fixture(scope="module")
def other_user() -> Iterator[pwd.struct_passwd]:
    """A second Unix user, made for these tests (``useradd``) and deleted after them."""
    if os.geteuid() != 0:
        pytest.skip("needs root (a second Unix user)")
    missing = [t for t in ("useradd", "userdel", "setpriv") if shutil.which(t) is None]
    if missing or not os.access("/usr/bin/python3", os.X_OK):
        pytest.skip(f"needs {', '.join(missing) or '/usr/bin/python3'}")
    name = "pxrc" + secrets.token_hex(3)
    subprocess.run(["useradd", "-M", "-s", "/bin/sh", name], check=True, capture_output=True)
    entry = pwd.getpwnam(name)
    try:
        yield entry
    finally:
        for proc in psutil.process_iter(["uids"]):
            with contextlib.suppress(psutil.Error):
                if proc.info["uids"] and proc.info["uids"].real == entry.pw_uid:
                    proc.kill()
        subprocess.run(["userdel", name], capture_output=True)


@pytest.fixture()
def lab(daemons: DaemonFactory) -> Iterator[Path]:
    """A directory every user may enter (the daemon's state dir goes in it)."""
    base = world_readable_tempdir("pollux-rec-")
    (base / "work").mkdir(mode=0o1777)
    (base / "work").chmod(0o1777)
    try:
        yield base
    finally:
        daemons.stop_all()
        shutil.rmtree(base, ignore_errors=True)


def submit_as(user: pwd.struct_passwd, daemon: DaemonProcess, **request: Any) -> dict[str, Any]:
    """A submit sent by ``user`` over the socket (the system Python, as that user)."""
    body = json.dumps({"v": 1, "type": "submit", **request})
    done = subprocess.run(
        ["setpriv", f"--reuid={user.pw_uid}", f"--regid={user.pw_gid}", "--init-groups", "--",
         "/usr/bin/python3", "-c", RAW_REQUEST, str(daemon.state_dir / "daemon.sock"), body],
        capture_output=True, text=True, timeout=30, cwd="/tmp", env={"PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return dict(json.loads(done.stdout))


def test_a_users_job_runs_as_the_user_who_owns_its_files(
    other_user: pwd.struct_passwd, lab: Path, daemons: DaemonFactory
) -> None:
    daemon = start_daemon(daemons, lab / "state", config(lab))
    script = 'id -u > "$POLLUX_CHECKPOINT_DIR/who"; echo hello from the job'
    reply = submit_as(other_user, daemon, argv=["sh", "-c", script], workdir=str(lab / "work"))
    assert reply["ok"], reply
    job_id = str(reply["id"])
    wait_for(lambda: state(daemon, job_id) in TERMINAL, 20, "the job to end")
    assert state(daemon, job_id) == "succeeded", show(daemon, job_id)["job"]
    job_dir = lab / "state" / "jobs" / job_id
    uid = other_user.pw_uid
    for path in (
        job_dir,
        job_dir / "rank0.log",
        job_dir / "checkpoint",
        job_dir / "checkpoint/who",
    ):
        assert path.lstat().st_uid == uid, path
    assert (job_dir / "checkpoint" / "who").read_text().strip() == str(uid)
    assert "hello from the job" in daemon.client.request("logs", id=job_id)["data"]
    run_dir = (lab / "state" / "run").lstat()
    assert run_dir.st_uid == 0 and run_dir.st_mode & 0o077 == 0


def test_a_workdir_the_user_cannot_enter_fails_naming_it(
    other_user: pwd.struct_passwd, lab: Path, daemons: DaemonFactory
) -> None:
    daemon = start_daemon(daemons, lab / "state", config(lab))
    private = lab / "roots-private"
    private.mkdir(mode=0o700)
    ran = lab / "work" / "ran"
    reply = submit_as(
        other_user, daemon, argv=["/bin/sh", "-c", f"pwd -P > {ran}; touch here"],
        workdir=str(private),
    )  # fmt: skip
    if reply["ok"]:
        job_id = str(reply["id"])
        wait_for(lambda: state(daemon, job_id) in TERMINAL, 20, "the job to end")
        job = show(daemon, job_id)["job"]
        assert job["state"] == "failed", job
        reason = job["reason"]
    else:  # refused at submit: as good, if it says why
        reason = reply["error"]
    assert str(private) in reason, reason
    time.sleep(0.5)
    assert not ran.exists() and list(private.iterdir()) == []


def test_a_users_log_swapped_for_a_symlink_to_a_root_file_is_not_followed(
    other_user: pwd.struct_passwd, lab: Path, daemons: DaemonFactory
) -> None:
    vault = lab / "vault"
    vault.mkdir(mode=0o700)
    secret = vault / "secret"
    secret.write_text("TOPSECRET-" + secrets.token_hex(8) + "\n")
    secret.chmod(0o600)
    before = secret.stat()
    mark = lab / "work" / "first-run"
    attack = f"""if [ ! -e {mark} ]; then
    touch {mark}
    rm -f "$POLLUX_JOB_DIR/rank0.log"
    ln -s {secret} "$POLLUX_JOB_DIR/rank0.log"
    exit 1
fi
"""
    daemon = start_daemon(daemons, lab / "state", config(lab))
    reply = submit_as(other_user, daemon, argv=["sh", "-c", attack], workdir=str(lab / "work"))
    job_id = str(reply["id"])
    wait_for(lambda: state(daemon, job_id) in TERMINAL, 30, "the job to end")
    assert mark.exists()
    after = secret.stat()
    assert (after.st_uid, after.st_mode, after.st_size, after.st_mtime_ns) == (
        before.st_uid,
        before.st_mode,
        before.st_size,
        before.st_mtime_ns,
    )
    with pytest.raises(PolluxError) as refused:
        daemon.client.request("logs", id=job_id)
    assert "TOPSECRET" not in str(refused.value)
    assert "TOPSECRET" not in json.dumps(show(daemon, job_id))


def test_a_deleted_owner_fails_the_job_without_stopping_the_others(
    lab: Path, daemons: DaemonFactory
) -> None:
    if os.geteuid() != 0 or shutil.which("useradd") is None:
        pytest.skip("needs root (a Unix user to delete)")
    name = "pxgone" + secrets.token_hex(3)
    subprocess.run(["useradd", "-M", "-s", "/bin/sh", name], check=True, capture_output=True)
    user = pwd.getpwnam(name)
    daemon = start_daemon(daemons, lab / "state", config(lab), devices="cpu:1")
    try:
        blocker = submit(daemon, ["sleep", "600"], lab / "work")
        wait_for(lambda: state(daemon, blocker) == "running", 20, "the blocker")
        orphan = str(submit_as(user, daemon, argv=["sh", "-c", "echo hi"], workdir="/tmp")["id"])
    finally:
        subprocess.run(["userdel", name], capture_output=True)
    after = submit(daemon, ["sh", "-c", "echo after"], lab / "work")
    daemon.client.request("cancel", ids=[blocker])
    wait_for(lambda: state(daemon, after) in TERMINAL, 20, "the next job")
    assert state(daemon, after) == "succeeded"
    job = show(daemon, orphan)["job"]
    assert job["state"] == "failed" and job["reason"] == f"owner uid {user.pw_uid} no longer exists"


#: A job (``sh -c HOLDOUT holdout DIR``) that counts its runs in DIR/runs and writes its pid to
#: DIR/pid; on its first run it notes a SIGTERM in DIR/termed and goes on until DIR/go, then
#: exits 0 (it had finished its work as its stop came); a later run exits 0 at once.
HOLDOUT = """
echo run >> "$1/runs"
[ "$(wc -l < "$1/runs")" -gt 1 ] && exit 0
trap 'touch "$1/termed"' TERM
echo $$ > "$1/pid.tmp"; mv "$1/pid.tmp" "$1/pid"
while [ ! -e "$1/go" ]; do sleep 0.05; done
exit 0
"""


def test_a_held_job_that_finished_while_the_daemon_was_down_is_not_run_again(
    tmp_path: Path, daemons: DaemonFactory
) -> None:
    """An elastic job held (its stop asked for) that exits 0 while the daemon is down has
    finished, as a running daemon takes it (``Exits._on_stopped``): the restarted daemon
    found the stray run file, forgot it and left the job held, and a release ran its
    finished work a second time (review s66)."""
    conf = config(tmp_path, stop_grace_s=60)
    daemon = start_daemon(daemons, tmp_path / "state", conf)
    job_id = submit(daemon, ["sh", "-c", HOLDOUT, "holdout", str(tmp_path)], tmp_path,
                    elastic=True, max_gpus=1)  # fmt: skip
    wait_for(
        lambda: (tmp_path / "pid").exists() and state(daemon, job_id) == "running",
        20, "the job to run",
    )  # fmt: skip
    daemon.client.request("hold", id=job_id)
    wait_for(lambda: (tmp_path / "termed").exists(), 10, "the stop to reach the job")
    daemon.kill()
    (tmp_path / "go").touch()  # its last step done: it exits 0 while no daemon runs
    wait_for(lambda: (run_file(daemon, job_id) or {}).get("state") == "ended", 10, "its end")
    assert run_file(daemon, job_id)["exit_code"] == 0  # type: ignore[index]

    daemon = start_daemon(daemons, tmp_path / "state", conf)
    assert state(daemon, job_id) == "succeeded", show(daemon, job_id)["decisions"]
    with contextlib.suppress(PolluxError):
        daemon.client.request("release", id=job_id)
    time.sleep(1.5)  # a few passes: nothing runs it again
    assert state(daemon, job_id) == "succeeded"
    assert (tmp_path / "runs").read_text().count("run") == 1
