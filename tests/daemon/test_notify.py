"""Job-end notifications (``pollux_local.daemon.notify``): real processes, a real state store.

Each test ends jobs through ``StateStore.update_job`` (which fills the outbox of job ends) and
lets a :class:`Notifier` announce them: the ``[notify] command`` hook writes what it saw to a
file, webhooks are delivered to an HTTP server of the test, and, as root, the hook and the
sender run as a Unix user made for the test.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import http.server
import importlib.util
import json
import logging
import os
import pwd
import secrets
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from pollux_local.api.states import JobState
from pollux_local.daemon import notify, notify_send
from pollux_local.daemon.config import DaemonConfig, load_config
from pollux_local.daemon.notify import Notifier
from pollux_local.daemon.state import IllegalTransition, StateStore
from tests.pids import take_pid

pytestmark = pytest.mark.timeout(120)

ME = pwd.getpwuid(os.geteuid())
IS_ROOT = os.geteuid() == 0
needs_root = pytest.mark.skipif(
    not IS_ROOT or shutil.which("useradd") is None, reason="needs root and useradd"
)
#: What the hook records of each end: one line per run.
RECORD = 'printf "%s %s %s\\n" "$POLLUX_JOB_ID" "$POLLUX_JOB_STATE" "$POLLUX_JOB_REASON" >> '
HAS_APPRISE = importlib.util.find_spec("apprise") is not None


# --- helpers ---------------------------------------------------------------------------------


@pytest.fixture
def store(tmp_path: Path) -> Iterator[StateStore]:
    opened = StateStore(tmp_path / "state.db")
    yield opened
    opened.close()


def daemon_config(**notify_fields: Any) -> DaemonConfig:
    return dataclasses.replace(load_config(None, devices="cpu:1"), **notify_fields)


def add_job(
    store: StateStore,
    name: str,
    *,
    uid: int = ME.pw_uid,
    gid: int = ME.pw_gid,
    owner: str = ME.pw_name,
    **spec: Any,
) -> int:
    job = store.add_job(
        name=name, owner_uid=uid, owner_gid=gid, owner_name=owner,
        spec={"argv": ["train.py"], "workdir": "/tmp", **spec}, priority=0, submit_time=1.0,
    )  # fmt: skip
    store.transition(job.id, JobState.RUNNING, 2.0, None, start_time=2.0)
    return job.id


def end_job(store: StateStore, job_id: int, state: str, reason: str = "") -> None:
    now = time.time()
    store.transition(job_id, JobState(state), now, None, reason=reason, end_time=now)


async def announce_all(notifier: Notifier, timeout_s: float = 60.0) -> int:
    """One pass, then wait for what it started; the number of ends taken."""
    taken = await notifier.announce_pending()
    assert await notifier.wait_idle(timeout_s)
    return taken


def live_members(pgid: int) -> list[int]:
    """The processes of group ``pgid`` still alive (zombies left for init to reap left out)."""
    alive = []
    for proc in psutil.process_iter(["status"]):
        with contextlib.suppress(psutil.Error, OSError):
            if os.getpgid(proc.pid) == pgid and proc.info["status"] != psutil.STATUS_ZOMBIE:
                alive.append(proc.pid)
    return alive


def lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def shared_dir(owner_uid: int | None = None) -> Path:
    """A directory under /tmp that a test's user can reach (and write when it owns it)."""
    path = Path(tempfile.mkdtemp(prefix="pxnotify", dir="/tmp"))
    path.chmod(0o755)
    if owner_uid is not None:
        os.chown(path, owner_uid, -1)
    return path


@dataclasses.dataclass
class Received:
    path: str
    headers: dict[str, str]
    body: bytes
    #: when it arrived (``time.time()``)
    time: float = dataclasses.field(default_factory=time.time)


@contextlib.contextmanager
def webhook_server() -> Iterator[tuple[int, list[Received]]]:
    """An HTTP server on 127.0.0.1 recording every POST: ``(port, received)``."""
    received: list[Received] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - the name http.server calls
            length = int(self.headers.get("Content-Length", "0"))
            received.append(Received(self.path, dict(self.headers), self.rfile.read(length)))
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1], received
    finally:
        server.shutdown()
        server.server_close()


@dataclasses.dataclass
class UnixUser:
    name: str
    uid: int
    gid: int
    home: Path
    groups: list[int]


@pytest.fixture
def unix_user() -> Iterator[UnixUser]:
    """A Unix user made for the test (``useradd -m``), removed with its home afterwards."""
    name = "pxn" + secrets.token_hex(3)
    subprocess.run(["useradd", "-m", "-s", "/bin/sh", name], check=True, capture_output=True)
    entry = pwd.getpwnam(name)
    try:
        yield UnixUser(
            name,
            entry.pw_uid,
            entry.pw_gid,
            Path(entry.pw_dir),
            sorted(os.getgrouplist(name, entry.pw_gid)),
        )
    finally:
        subprocess.run(["pkill", "-KILL", "-U", str(entry.pw_uid)], capture_output=True)
        subprocess.run(["userdel", "-r", name], capture_output=True)


# --- the command hook ------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_each_end_runs_the_hook_once_with_the_jobs_facts(
    store: StateStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DAEMON_ONLY_SECRET", "s3cr3t-of-the-daemon")
    record, environs = tmp_path / "ends.txt", tmp_path / "env"
    environs.mkdir()
    command = RECORD + f"{record}; env > {environs}/$POLLUX_JOB_ID; pwd >> {environs}/pwd"
    won = add_job(store, "won")
    lost = add_job(store, "lost; touch " + str(tmp_path / "pwned"))
    dropped = add_job(store, "dropped")
    end_job(store, won, "succeeded")
    end_job(store, lost, "failed", "exit code 3 on rank 0")
    end_job(store, dropped, "cancelled", "cancelled by alice")
    with pytest.raises(IllegalTransition):  # a terminal job never moves again: no new end
        end_job(store, won, "succeeded")
    notifier = Notifier(store, lambda: daemon_config(notify_command=command), os.geteuid())

    assert await announce_all(notifier) == 3
    assert await announce_all(notifier) == 0  # announced once: nothing left to take

    assert sorted(lines(record)) == sorted(
        [
            f"{won} succeeded ",
            f"{lost} failed exit code 3 on rank 0",
            f"{dropped} cancelled cancelled by alice",
        ]
    )
    assert store.pending_ends() == []
    assert not (tmp_path / "pwned").exists()  # the name is data, never shell code
    environ = dict(
        line.split("=", 1)
        for line in (environs / str(lost)).read_text().splitlines()
        if "=" in line
    )
    assert environ["POLLUX_JOB_NAME"] == "lost; touch " + str(tmp_path / "pwned")
    assert environ["POLLUX_JOB_OWNER"] == ME.pw_name
    assert environ["POLLUX_JOB_STATE"] == "failed"
    assert environ["POLLUX_JOB_WORKDIR"] == "/tmp"
    assert environ["USER"] == environ["LOGNAME"] == ME.pw_name
    assert environ["HOME"] == ME.pw_dir
    assert "DAEMON_ONLY_SECRET" not in environ  # a clean environment, nothing of the daemon's
    assert set(lines(environs / "pwd")) == {ME.pw_dir if os.path.isdir(ME.pw_dir) else "/"}


@pytest.mark.asyncio
async def test_on_failure_notifies_failed_jobs_only(store: StateStore, tmp_path: Path) -> None:
    record = tmp_path / "ends.txt"
    ids = {state: add_job(store, state) for state in ("succeeded", "failed", "cancelled")}
    for state, job_id in ids.items():
        end_job(store, job_id, state, f"why {state}")
    config = daemon_config(notify_command=RECORD + str(record), notify_on="failure")
    notifier = Notifier(store, lambda: config, os.geteuid())

    assert await announce_all(notifier) == 3
    assert lines(record) == [f"{ids['failed']} failed why failed"]
    assert store.pending_ends() == []  # the others were looked at, and are done with


@pytest.mark.asyncio
async def test_a_failing_or_hanging_hook_is_logged_and_holds_back_no_other(
    store: StateStore, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    record, pid_file = tmp_path / "ends.txt", tmp_path / "hang.pid"
    command = (
        f'case "$POLLUX_JOB_NAME" in hang) echo $$ > {pid_file}; sleep 60;;'
        " bad) echo 'boom: no such\tthing' >&2; exit 7;; esac; " + RECORD + str(record)
    )
    hang, bad, good = (add_job(store, name) for name in ("hang", "bad", "good"))
    for job_id in (hang, bad, good):
        end_job(store, job_id, "failed", "x")
    notifier = Notifier(
        store, lambda: daemon_config(notify_command=command), os.geteuid(), timeout_s=3.0
    )
    caplog.set_level(logging.INFO, logger="pollux_local")

    started = time.monotonic()
    assert await notifier.announce_pending() == 3
    assert time.monotonic() - started < 0.5  # a pass only starts them
    while not lines(record) and time.monotonic() - started < 20:
        await asyncio.sleep(0.05)
    assert lines(record) == [f"{good} failed x"]
    assert notifier.in_flight >= 1  # the hanging one still runs: the good one did not wait
    assert await notifier.wait_idle(30)
    took = time.monotonic() - started

    assert 3.0 <= took < 15.0
    assert live_members(int(pid_file.read_text())) == []  # the shell and its sleep: killed
    messages = [record.getMessage() for record in caplog.records]
    assert any(f"job {hang}: command as" in m and "did not finish in 3 s" in m for m in messages)
    failed = [m for m in messages if f"job {bad}: command" in m]
    assert failed == [
        f"notify: job {bad}: command as {ME.pw_name} failed (exit 7): boom: no such thing"
    ]
    assert store.pending_ends() == []


@pytest.mark.asyncio
async def test_a_pass_takes_at_most_the_per_owner_queue_the_rest_waits_in_the_outbox(
    store: StateStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(notify, "QUEUED_PER_OWNER", 3)
    monkeypatch.setattr(notify, "SENDERS_PER_OWNER", 1)
    record, gate = tmp_path / "ends.txt", tmp_path / "gate"
    ids = [add_job(store, f"j{i}") for i in range(5)]
    for job_id in ids:
        end_job(store, job_id, "succeeded")
    command = f"while [ ! -e {gate} ]; do sleep 0.05; done; " + RECORD + str(record)
    notifier = Notifier(store, lambda: daemon_config(notify_command=command), os.geteuid())

    assert await notifier.announce_pending() == 3
    assert await notifier.announce_pending() == 0  # the owner's queue is full
    await asyncio.sleep(0.5)
    assert [end.job_id for end in store.pending_ends()] == ids[1:]  # one started, marked
    gate.touch()
    assert await notifier.wait_idle(60)  # as each finishes, the owner's next ones follow
    assert sorted(int(line.split()[0]) for line in lines(record)) == ids
    assert store.pending_ends() == []


@needs_root
@pytest.mark.asyncio
async def test_one_owners_hanging_hooks_and_many_ends_do_not_delay_anothers(
    store: StateStore, tmp_path: Path
) -> None:
    record = tmp_path / "ends.txt"
    command = f'case "$POLLUX_JOB_NAME" in hang*) sleep 60;; esac; {RECORD}{record}'
    other = pwd.getpwnam("nobody")
    hanging = [
        add_job(store, f"hang{i}", uid=other.pw_uid, gid=other.pw_gid, owner=other.pw_name)
        for i in range(40)
    ]
    mine = add_job(store, "mine")
    for job_id in hanging:
        end_job(store, job_id, "cancelled")
    end_job(store, mine, "succeeded")
    config = dataclasses.replace(daemon_config(notify_command=command), notify_backlog_per_user=30)
    notifier = Notifier(store, lambda: config, 0, timeout_s=20.0)
    started = time.monotonic()
    await notifier.announce_pending()
    while not lines(record) and time.monotonic() - started < 15:
        await asyncio.sleep(0.05)
    took = time.monotonic() - started
    assert lines(record) == [f"{mine} succeeded "]
    assert took < 3.0  # not behind the other owner's 40 ends, each hanging for 20 s
    # the other owner: 2 at a time, 16 in memory, and the 10 oldest beyond 30 dropped
    assert notifier._sending[other.pw_uid] == 2
    assert len(store.pending_ends(limit=1000)) == 28
    await notifier.close(grace_s=0.1)


@pytest.mark.asyncio
async def test_close_kills_running_hooks_and_leaves_ends_not_started_in_the_outbox(
    store: StateStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(notify, "MAX_ENDS_AT_ONCE", 1)
    pids = tmp_path / "pids"
    first, second = add_job(store, "first"), add_job(store, "second")
    end_job(store, first, "failed")
    end_job(store, second, "failed")
    command = f"echo $$ >> {pids}; sleep 60"
    notifier = Notifier(store, lambda: daemon_config(notify_command=command), os.geteuid())

    assert await notifier.announce_pending() == 2
    while not lines(pids):
        await asyncio.sleep(0.05)
    started = time.monotonic()
    await notifier.close(grace_s=0.5)

    assert time.monotonic() - started < 5
    assert notifier.in_flight == 0
    (pid,) = lines(pids)
    assert live_members(int(pid)) == []
    assert [end.job_id for end in store.pending_ends()] == [second]  # sent at the next start
    assert await notifier.announce_pending() == 0  # a closed notifier takes nothing


@pytest.mark.asyncio
@pytest.mark.skipif(os.geteuid() != 0, reason="giving a chosen pid needs root (ns_last_pid)")
async def test_a_group_whose_leader_is_gone_is_not_signalled_nor_its_output_waited_for(
    store: StateStore, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The hook (the owner's code) starts a ``setsid`` child that keeps its output open, and
    exits: its group empties and its pid, the group's id, is free.  Another process given
    that pid (a user who cycles the pids can make that happen) leads a group of that id: the
    notification's time-out, as root, must not kill it.  And the child that never closes the
    output must not keep the notification (a task of the daemon's) waiting."""
    from pollux_local.launch.supervisor import proc_start_time

    leader_file, holder_file = tmp_path / "leader", tmp_path / "holder"
    command = f"echo $$ > {leader_file}; setsid sleep 30 & echo $! > {holder_file}"
    end_job(store, add_job(store, "holder"), "failed", "x")
    notifier = Notifier(
        store, lambda: daemon_config(notify_command=command), os.geteuid(), timeout_s=3.0
    )
    caplog.set_level(logging.INFO, logger="pollux_local")
    started = time.monotonic()
    assert await notifier.announce_pending() == 1
    while not (lines(leader_file) and lines(holder_file)) and time.monotonic() - started < 10:
        await asyncio.sleep(0.02)
    leader, holder = int(lines(leader_file)[0]), int(lines(holder_file)[0])
    stranger = None
    try:
        while proc_start_time(leader) is not None and time.monotonic() - started < 2.5:
            await asyncio.sleep(0.01)  # the hook's shell ends and is reaped
        assert proc_start_time(leader) is None, "the hook's shell did not end"
        try:
            stranger = take_pid(leader)
        except OSError as exc:  # a read-only /proc/sys (some containers)
            pytest.skip(f"cannot choose the next pid here: {exc}")
        if stranger is None:
            pytest.skip(f"could not give pid {leader} to a new process (the machine took it)")
        assert os.getpgid(stranger.pid) == leader  # the hook's old group id, now its

        assert await notifier.wait_idle(10)  # not the 30 s the child holds the output
        assert time.monotonic() - started < 8
        await asyncio.sleep(3.5)  # past the time-out, had it been waited for
        assert stranger.poll() is None, "the notification signalled another process's group"
        messages = [record.getMessage() for record in caplog.records]
        assert any(
            "left something running that holds its output; no longer read" in m for m in messages
        ), messages
    finally:
        if stranger is not None:
            stranger.kill()
            stranger.wait()
        with contextlib.suppress(OSError, psutil.Error):
            if "sleep" in psutil.Process(holder).name():
                os.kill(holder, 9)


@pytest.mark.asyncio
async def test_a_daemon_not_run_by_root_notifies_only_for_its_own_users_jobs(
    store: StateStore, tmp_path: Path
) -> None:
    record = tmp_path / "ends.txt"
    daemon_uid = os.geteuid() or 54321  # as root: a daemon of uid 54321, not root
    own = add_job(store, "own", uid=daemon_uid, owner="me")
    other = add_job(store, "other", uid=daemon_uid + 1, owner="someone")
    end_job(store, own, "succeeded")
    end_job(store, other, "succeeded")
    config = daemon_config(notify_command=RECORD + str(record))
    notifier = Notifier(store, lambda: config, daemon_uid)

    assert await announce_all(notifier) == 2
    assert lines(record) == [f"{own} succeeded "]
    assert store.pending_ends() == []


@pytest.mark.asyncio
async def test_a_bad_config_or_a_vanished_job_never_raises(
    store: StateStore, caplog: pytest.LogCaptureFixture
) -> None:
    job_id = add_job(store, "j")
    end_job(store, job_id, "failed")

    def broken() -> DaemonConfig:
        raise RuntimeError("config gone")

    notifier = Notifier(store, broken, os.geteuid())
    assert await announce_all(notifier) == 1
    assert any("config gone" in record.getMessage() for record in caplog.records)
    store.db.execute("DELETE FROM jobs WHERE id = ?", (job_id,))
    store.db.execute("UPDATE job_ends SET notified = 0")
    assert await announce_all(notifier) == 1
    assert store.pending_ends() == []


# --- webhooks through the sender -------------------------------------------------------------


@pytest.mark.asyncio
async def test_webhook_urls_of_the_job_are_posted(
    store: StateStore, caplog: pytest.LogCaptureFixture
) -> None:
    with webhook_server() as (port, received):
        urls = [
            f"json://127.0.0.1:{port}/hook?topic=a",
            f"http://alice:pa55word@127.0.0.1:{port}/plain",
        ]
        failed = add_job(store, "sweep-3", notify=urls, notify_on="failure")
        ok = add_job(store, "fine", notify=urls, notify_on="failure")
        end_job(store, failed, "failed", "exit code 1")
        end_job(store, ok, "succeeded")
        notifier = Notifier(store, lambda: daemon_config(), os.geteuid())
        assert await announce_all(notifier) == 2

    assert sorted(hit.path for hit in received) == ["/hook?topic=a", "/plain"]
    for hit in received:
        body = json.loads(hit.body)
        assert body["type"] == "failure"
        assert body["title"] == f"pollux-local: job {failed} (sweep-3) failed"
        assert body["message"] == "exit code 1"
        if hit.path == "/plain" or not HAS_APPRISE:  # apprise's json:// has no job facts
            assert body["job"]["id"] == str(failed) and body["job"]["state"] == "failed"
    plain = next(hit for hit in received if hit.path == "/plain")
    assert plain.headers["Authorization"] == "Basic YWxpY2U6cGE1NXdvcmQ="  # alice:pa55word
    assert "pa55word" not in caplog.text


@pytest.mark.asyncio
@pytest.mark.skipif(HAS_APPRISE, reason="apprise is installed: it sends ntfy:// itself")
async def test_without_apprise_another_scheme_is_one_log_line_without_its_secret(
    store: StateStore, caplog: pytest.LogCaptureFixture
) -> None:
    job_id = add_job(store, "j", notify=["ntfy://ntfy.example/topic-t0ken"])
    end_job(store, job_id, "failed")
    caplog.set_level(logging.INFO, logger="pollux_local")
    notifier = Notifier(store, lambda: daemon_config(), os.geteuid())
    assert await announce_all(notifier) == 1

    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("notify:")]
    assert "sender as" in line and "destination 1 (ntfy://...): apprise not installed" in line
    assert "t0ken" not in caplog.text and "ntfy.example" not in caplog.text


def test_the_per_user_file_is_parsed_strictly() -> None:
    urls, on = notify_send.parse_user_file(b'urls = ["json://h/x"]\non = "failure"\n', "f")
    assert (urls, on) == (["json://h/x"], "failure")
    assert notify_send.parse_user_file(b"", "f") == ([], "end")
    with pytest.raises(ValueError, match=r"^f: unknown key 'url' \(known: urls, on\)$"):
        notify_send.parse_user_file(b'url = "json://h/x"', "f")
    with pytest.raises(ValueError, match=r"^f: on must be 'end' or 'failure', got 'fail'$"):
        notify_send.parse_user_file(b'on = "fail"', "f")
    assert notify_send.redact("mailto://me:pw@gmail.com/x?to=y") == "mailto://gmail.com"
    assert notify_send.redact("jsons://u:pw@hooks.lab:8443/t0ken") == "jsons://hooks.lab"
    assert notify_send.redact("tgram://123:bot-t0ken/chat") == "tgram://..."


# --- as root: the job's owner ----------------------------------------------------------------


@needs_root
@pytest.mark.asyncio
async def test_as_root_the_hook_runs_as_the_jobs_owner(
    store: StateStore, unix_user: UnixUser
) -> None:
    out = shared_dir(owner_uid=unix_user.uid)
    try:
        command = f"{{ id -u; id -g; id -G; pwd; echo $HOME $USER; }} > {out}/who"
        job_id = add_job(store, "j", uid=unix_user.uid, gid=unix_user.gid, owner=unix_user.name)
        end_job(store, job_id, "succeeded")
        notifier = Notifier(store, lambda: daemon_config(notify_command=command), 0)
        assert await announce_all(notifier) == 1

        uid, gid, groups, cwd, login = lines(out / "who")
        assert (int(uid), int(gid)) == (unix_user.uid, unix_user.gid)
        assert sorted(map(int, groups.split())) == unix_user.groups  # not root's groups
        assert cwd == str(unix_user.home)
        assert login == f"{unix_user.home} {unix_user.name}"
    finally:
        shutil.rmtree(out)


@needs_root
@pytest.mark.asyncio
async def test_as_root_a_reused_uid_gets_no_notification_of_the_old_accounts_job(
    store: StateStore, unix_user: UnixUser, caplog: pytest.LogCaptureFixture
) -> None:
    """The job was submitted by the account that held the uid before (another name): its
    end is not announced to the account that holds the uid now (``auth.is_owner``)."""
    out = shared_dir(owner_uid=unix_user.uid)
    try:
        command = f"id -u > {out}/who"
        job_id = add_job(store, "j", uid=unix_user.uid, gid=unix_user.gid, owner="before")
        end_job(store, job_id, "failed")
        notifier = Notifier(store, lambda: daemon_config(notify_command=command), 0)
        await announce_all(notifier)
        assert not (out / "who").exists()
        assert f"owner before is gone: uid {unix_user.uid} now belongs to" in caplog.text
    finally:
        shutil.rmtree(out)


@needs_root
@pytest.mark.asyncio
async def test_as_root_a_per_user_file_linked_to_a_root_only_file_is_never_read(
    store: StateStore, unix_user: UnixUser, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="pollux_local")
    secret_dir = shared_dir()
    marker = "ROOTONLY" + secrets.token_hex(8)
    with webhook_server() as (port, received):
        secret = secret_dir / "secret.toml"  # a TOML file a read by root would obey
        secret.write_text(f'urls = ["json://127.0.0.1:{port}/{marker}"]\n')
        secret.chmod(0o600)
        config_dir = unix_user.home / ".config" / "pollux-local"
        subprocess.run(["install", "-d", "-o", unix_user.name, str(config_dir)], check=True)
        os.symlink(secret, config_dir / "notify.toml")
        os.lchown(config_dir / "notify.toml", unix_user.uid, unix_user.gid)
        job_id = add_job(
            store, "j", uid=unix_user.uid, gid=unix_user.gid, owner=unix_user.name,
            notify=[f"json://127.0.0.1:{port}/job-url"],
        )  # fmt: skip
        end_job(store, job_id, "failed")
        notifier = Notifier(store, lambda: daemon_config(), 0)
        assert await announce_all(notifier) == 1

    assert [hit.path for hit in received] == ["/job-url"]  # the sender ran, as the user
    (line,) = [r.getMessage() for r in caplog.records if "sender as" in r.getMessage()]
    assert f"sender as {unix_user.name} failed" in line
    assert "notify.toml: cannot open: Permission denied" in line
    everything = caplog.text + "".join(hit.body.decode() + hit.path for hit in received)
    assert marker not in everything
    shutil.rmtree(secret_dir)


@needs_root
@pytest.mark.asyncio
async def test_as_root_the_users_own_file_adds_destinations_with_its_own_on(
    store: StateStore, unix_user: UnixUser
) -> None:
    with webhook_server() as (port, received):
        config_dir = unix_user.home / ".config" / "pollux-local"
        subprocess.run(["install", "-d", "-o", unix_user.name, str(config_dir)], check=True)
        user_file = config_dir / "notify.toml"
        user_file.write_text(f'urls = ["json://127.0.0.1:{port}/mine"]\non = "failure"\n')
        os.chown(user_file, unix_user.uid, unix_user.gid)
        user_file.chmod(0o600)
        owner = {"uid": unix_user.uid, "gid": unix_user.gid, "owner": unix_user.name}
        ok = add_job(store, "ok", notify=[f"json://127.0.0.1:{port}/job"], **owner)
        bad = add_job(store, "bad", **owner)
        end_job(store, ok, "succeeded")
        end_job(store, bad, "failed")
        notifier = Notifier(store, lambda: daemon_config(), 0)
        assert await announce_all(notifier) == 2

    got = sorted((hit.path, json.loads(hit.body)["title"]) for hit in received)
    assert got == [
        ("/job", f"pollux-local: job {ok} (ok) succeeded"),
        ("/mine", f"pollux-local: job {bad} (bad) failed"),
    ]


@needs_root
@pytest.mark.asyncio
async def test_as_root_a_desktop_notification_goes_to_the_owners_session_bus(
    store: StateStore, unix_user: UnixUser, tmp_path: Path
) -> None:
    tools = shared_dir()
    seen = shared_dir(owner_uid=unix_user.uid) / "seen"
    fake = tools / "notify-send"  # a stand-in for the real program: records how it was run
    fake.write_text(
        f'#!/bin/sh\n{{ id -u; echo "$DBUS_SESSION_BUS_ADDRESS"; printf "%s|" "$@"; echo; }}'
        f" >> {seen}\n"
    )
    fake.chmod(0o755)
    runtime = Path(f"/run/user/{unix_user.uid}")
    made_run_user = not runtime.parent.exists()
    with_bus, without_bus = (add_job(store, name, uid=unix_user.uid, gid=unix_user.gid,
                                     owner=unix_user.name) for name in ("bus", "nobus"))  # fmt: skip
    config = daemon_config(notify_desktop=True)
    notifier = Notifier(store, lambda: config, 0, user_path=f"{tools}:{notify.USER_PATH}")
    bus = None
    try:
        end_job(store, without_bus, "succeeded")
        assert await announce_all(notifier) == 1
        assert not seen.exists()  # no session bus: skipped, silently

        runtime.mkdir(parents=True, exist_ok=True)
        os.chown(runtime, unix_user.uid, unix_user.gid)
        bus = socket.socket(socket.AF_UNIX)
        bus.bind(str(runtime / "bus"))
        os.chown(runtime / "bus", unix_user.uid, unix_user.gid)
        end_job(store, with_bus, "failed", 'out of <a href="http://x">memory</a>\x1b[2J')
        assert await announce_all(notifier) == 1
    finally:
        if bus is not None:
            bus.close()
        shutil.rmtree(runtime, ignore_errors=True)
        if made_run_user:
            runtime.parent.rmdir()
        shutil.rmtree(tools)
    uid, address, args = lines(seen)
    shutil.rmtree(seen.parent)
    assert int(uid) == unix_user.uid
    assert address == f"unix:path=/run/user/{unix_user.uid}/bus"
    assert args.split("|")[:-1] == [
        "--app-name=pollux-local",
        "--urgency=critical",
        "--",
        f"pollux-local: job {with_bus} (bus) failed",
        'out of &lt;a href="http://x"&gt;memory&lt;/a&gt;\\x1b[2J',  # markup and escapes inert
    ]


def test_a_fuse_mount_over_a_users_runtime_directory_is_not_looked_into(tmp_path: Path) -> None:
    """The desktop notification's look at ``/run/user/UID/bus`` is skipped when a FUSE file
    system is mounted there or below (the user's own, which could leave the daemon's ``stat``
    unanswered); logind's tmpfs there is looked into as before."""
    from pollux_local.daemon.notify import _on_fuse

    mountinfo = tmp_path / "mountinfo"
    mountinfo.write_text(
        "22 1 0:21 / /run rw,nosuid - tmpfs tmpfs rw\n"
        "40 22 0:35 / /run/user/1000 rw,nosuid - tmpfs tmpfs rw,uid=1000\n"
        "41 40 0:36 / /run/user/1000/bus rw - fuse.evil evil rw,user_id=1000\n"
        "42 22 0:37 / /run/user/1001 rw - fuse.sshfs host:/ rw,user_id=1001\n"
        "43 22 0:38 / /run/user/1002\\040x rw - fuse x rw\n"
    )
    assert _on_fuse("/run/user/1000", str(mountinfo))  # on the bus below it
    assert _on_fuse("/run/user/1001", str(mountinfo))  # over the directory itself
    assert not _on_fuse("/run/user/100", str(mountinfo))  # a prefix of another's name
    assert not _on_fuse("/run/user/1003", str(mountinfo))
    assert _on_fuse("/run/user/1002 x", str(mountinfo))
    assert not _on_fuse("/run/user/1000", str(tmp_path / "absent"))
