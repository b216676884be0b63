"""Who may talk to the daemon, and how much one user may hold: the socket's mode and the peer
check (a root daemon serves everyone, a user's daemon its user, ``allow_group`` a group),
connections and bytes in flight per user, frame deadlines, and memory back at its baseline
after abusive clients leave.

The tests that need other Unix identities run their clients (or the daemon) as uids of their
own (``nobody``, and uids without a passwd entry) with the interpreter every user may run
(the ``lab_install`` fixture: root only); the others run as anyone.
"""

from __future__ import annotations

import asyncio
import grp
import json
import os
import pwd
import shutil
import signal
import socket
import stat
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import pytest_asyncio

from pollux_local.api import wire
from pollux_local.api.errors import LimitExceeded
from pollux_local.client import Client
from pollux_local.core.baselines import FifoPolicy
from pollux_local.daemon import transport
from pollux_local.daemon.auth import Peer, may_connect, socket_mode
from pollux_local.daemon.config import DaemonConfig, NodeConfig
from pollux_local.daemon.server import Daemon
from pollux_local.daemon.transport import ConnectionBook
from pollux_local.errors import PolluxError
from tests.daemon_process import wait_for
from tests.labinstall import LabInstall
from tests.paths import REPO_ROOT

pytestmark = pytest.mark.timeout(120)
NOBODY = 65534
#: uids (and gids) with no passwd entry, for clients that are "another user"
STRANGER = 65533
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="other Unix identities need root")


def short_dir(prefix: str) -> Path:
    """A world-traversable directory under /tmp (socket paths are limited to ~107 bytes)."""
    path = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    path.chmod(0o755)
    return path


def mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


CLIENT = r"""
import json, sys
from pollux_local.client import Client
from pollux_local.errors import PolluxError
try:
    reply = Client(sys.argv[1], timeout_s=20).request(sys.argv[2], **json.loads(sys.argv[3]))
    print(json.dumps({"ok": reply}))
except PolluxError as exc:
    print(json.dumps({"error": type(exc).__name__, "message": str(exc)}))
"""


@pytest.fixture()
def lab_python(lab_install: LabInstall) -> Path:
    """An interpreter with pollux-local that every user may run (root only: else skipped)."""
    return lab_install.python


def as_uid(
    python: Path, uid: int, gid: int, socket_path: Path, kind: str, **fields: Any
) -> dict[str, Any]:
    """One request sent by a process running as ``uid``/``gid`` (no supplementary groups)."""
    done = subprocess.run(
        [str(python), "-c", CLIENT, str(socket_path), kind, json.dumps(fields)],
        user=uid, group=gid, extra_groups=[], capture_output=True, text=True, timeout=60,
        env={"OMP_NUM_THREADS": "1", "HOME": "/"}, cwd="/",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return dict(json.loads(done.stdout))


# --- the rules ------------------------------------------------------------------------------------


def test_who_may_connect_and_the_socket_mode() -> None:
    alice, bob, root = Peer(1, 1000, 1000), Peer(2, 1001, 1001), Peer(3, 0, 0)
    # a root daemon: everyone (identity from SO_PEERCRED)
    assert socket_mode(0, None) == 0o666 and may_connect(bob, 0, None)
    # alice's own daemon: alice and root only
    assert socket_mode(1000, None) == 0o600
    assert may_connect(alice, 1000, None) and may_connect(root, 1000, None)
    assert not may_connect(bob, 1000, None)
    # opened to a group: its members (primary or supplementary)
    nobody = pwd.getpwnam("nobody")  # a member of nogroup, its primary group
    group = grp.getgrgid(nobody.pw_gid).gr_name
    assert socket_mode(1000, group) == 0o660
    assert may_connect(Peer(4, nobody.pw_uid, 1), 1000, group)
    assert not may_connect(bob, 1000, group)
    # membership is the databases': a process running with the group's gid is not a member
    assert not may_connect(Peer(5, 65533, nobody.pw_gid), 1000, group)
    assert not may_connect(bob, 0, "no-such-group-here")  # a root daemon limited to a group


def test_connection_book_caps_connections_and_bytes_per_user() -> None:
    book = ConnectionBook(per_user=2, per_user_bytes=100, total_bytes=150, unlimited=frozenset({0}))
    assert book.open(7) and book.open(7) and not book.open(7)
    assert all(book.open(0) for _ in range(10))  # root: no per-user cap
    book.close(7)
    assert book.open(7)
    with book.reserve(7, "ann", 60):
        with (
            pytest.raises(LimitExceeded, match="100-byte cap per user"),
            book.reserve(7, "ann", 41),
        ):
            pass
        with (
            book.reserve(8, "bob", 90),
            pytest.raises(LimitExceeded, match="busy"),
            book.reserve(9, "cy", 1),
        ):
            pass
        assert book.bytes == {7: 60}
    assert book.bytes == {} and book.bytes_total == 0


# --- an in-process root daemon: budgets and deadlines ---------------------------------------------


@pytest_asyncio.fixture
async def daemon(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Daemon]:
    monkeypatch.setattr(transport, "FRAME_DEADLINE_S", 1.0)
    base = short_dir("plx-srv-")
    config = DaemonConfig(nodes=(NodeConfig("n0", ("cpu:0",)),), interval_s=60.0)
    made = Daemon(config, base / "s", policy=FifoPolicy())
    ready = asyncio.Event()
    task = asyncio.ensure_future(made.run(ready=ready.set))
    await asyncio.wait_for(ready.wait(), 10)
    yield made
    made.request_stop()
    await asyncio.wait_for(task, 10)
    shutil.rmtree(base, ignore_errors=True)


def _partial(path: Path, length: int, sent: int) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    sock.connect(str(path))
    sock.sendall(struct.pack(">I", length) + b'{"v":1,"type":"status"' + b" " * sent)
    return sock


def _reply(sock: socket.socket) -> dict[str, Any]:
    try:
        return dict(json.loads(wire.recv_frame(sock)))
    except (OSError, PolluxError):
        return {}


@pytest.mark.asyncio
async def test_bytes_in_flight_are_capped_per_user_and_given_back(daemon: Daemon) -> None:
    path, big = daemon.socket_path, wire.MAX_FRAME_BYTES - 1
    first = await asyncio.to_thread(_partial, path, big, 1000)
    second = await asyncio.to_thread(_partial, path, big, 1000)
    await asyncio.sleep(0.1)
    assert daemon.book.bytes_total == 2 * big  # two 16 MiB frames reserved: the 32 MiB budget
    # a third, sent whole: refused, its body read and dropped so that the error reaches it
    third = await asyncio.to_thread(_partial, path, big, big - 22)
    refused = await asyncio.to_thread(_reply, third)
    assert refused["code"] == "limit_exceeded" and "in flight" in refused["error"]
    # a small request of the same user still fits, and others are served meanwhile
    ping = await asyncio.to_thread(Client(path).request, "ping")
    assert ping["pid"] == os.getpid()
    for sock in (first, second, third):
        sock.close()
    for _ in range(50):
        if daemon.book.bytes_total == 0 and not daemon.book.connections:
            break
        await asyncio.sleep(0.02)
    assert daemon.book.bytes_total == 0 and daemon.book.bytes == {}
    assert daemon.book.connections == {}


def _unread_logs(path: Path, job_id: str) -> socket.socket:
    """A ``logs`` request for 1 MiB whose reply is never read."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.settimeout(20)
    sock.connect(str(path))
    body = json.dumps({"v": 1, "type": "logs", "id": job_id, "max_bytes": 1 << 20}).encode()
    sock.sendall(struct.pack(">I", len(body)) + body)
    return sock


@pytest.mark.asyncio
async def test_replies_not_read_are_held_within_the_users_budget(daemon: Daemon) -> None:
    """Review s68: a reply was outside the byte budget.  A log of 1 MiB of NULs is a 6 MiB
    reply (each byte ``\\u0000``), anyone may ask for any job's log, and a reply the client
    does not read is kept for 30 s: 16 connections asking for it and reading nothing held
    208 MiB of the daemon (the reply and the transport's copy of it), again and again.  Now
    the replies a user has not taken count against their budget: past it, their next request
    is refused (nothing of it done), and a reply is handed to the socket a part at a time."""
    client = Client(daemon.socket_path)
    job = await asyncio.to_thread(
        client.request, "submit", argv=["/bin/true"], workdir="/", hold=True
    )
    folder = daemon.state_dir / "jobs" / job["id"]
    folder.mkdir(mode=0o700, parents=True)
    (folder / "rank0.log").write_bytes(b"\x00" * (1 << 20))
    me = psutil.Process()
    await asyncio.sleep(0.2)
    before = me.memory_info().rss
    socks = [
        await asyncio.to_thread(_unread_logs, daemon.socket_path, job["id"]) for _ in range(16)
    ]
    await asyncio.sleep(1.0)
    held = me.memory_info().rss - before
    replies = [await asyncio.to_thread(_reply, sock) for sock in socks]
    for sock in socks:
        sock.close()
    served = [r for r in replies if r.get("ok")]
    refused = [r for r in replies if r.get("code") == "limit_exceeded"]
    assert len(served) + len(refused) == 16
    assert all(r["size"] == 1 << 20 for r in served)
    assert refused and "not yet read" in refused[0]["error"]
    assert held < 80 * 2**20, f"{held / 2**20:.0f} MiB held for replies nobody reads"
    # taken, they are given back: the same user is served again
    again = await asyncio.to_thread(client.request, "logs", id=job["id"], max_bytes=1 << 20)
    assert again["size"] == 1 << 20
    for _ in range(50):
        if not daemon.book.replies:
            break
        await asyncio.sleep(0.02)
    assert daemon.book.replies == {}


@pytest.mark.asyncio
async def test_a_frame_must_arrive_within_its_deadline(daemon: Daemon) -> None:
    slow = await asyncio.to_thread(_partial, daemon.socket_path, 5000, 100)
    began = time.monotonic()
    # the daemon gives up on the frame after FRAME_DEADLINE_S (1 s here) and closes
    data = await asyncio.to_thread(slow.recv, 100)
    assert data == b"" and time.monotonic() - began < 4
    slow.close()
    # half a header counts too
    half = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    half.settimeout(5)
    half.connect(str(daemon.socket_path))
    half.sendall(b"\x00\x00")
    assert await asyncio.to_thread(half.recv, 100) == b""
    half.close()
    assert daemon.book.bytes_total == 0


@pytest.mark.asyncio
async def test_a_large_frame_is_read_whole(daemon: Daemon) -> None:
    env = {f"V{i}": "x" * 4000 for i in range(1000)}  # a 4 MB submit: read into a mapping
    request = {"argv": ["/bin/true"], "workdir": "/", "hold": True, "env": env}
    reply = await asyncio.to_thread(Client(daemon.socket_path).request, "submit", **request)
    shown = await asyncio.to_thread(Client(daemon.socket_path).request, "show", id=reply["id"])
    assert shown["job"]["env"] == env
    assert daemon.book.bytes_total == 0


#: Holds its user's 16 connections, then opens ``sys.argv[2]`` more (each refused, and each
#: held open unread while the daemon drains it), says so and holds them all until stdin ends.
FLOODER = r"""
import socket, sys
socks = []
for _ in range(16 + int(sys.argv[2])):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM); s.connect(sys.argv[1]); socks.append(s)
print("flooding", flush=True)
sys.stdin.read()
"""


@needs_root
@pytest.mark.asyncio
async def test_one_users_refused_connections_keep_no_other_user_out(
    daemon: Daemon, lab_python: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A user at their own cap who keeps connecting is refused without taking the places
    of the connections served: another user still gets in (the daemon's place for 20 here,
    the flooder's 16 and their 40 refused ones all held open at once)."""
    monkeypatch.setattr(transport, "MAX_CONNECTIONS", 20)
    flooder = subprocess.Popen(
        [str(lab_python), "-c", FLOODER, str(daemon.socket_path), "40"],
        user=STRANGER, group=STRANGER, extra_groups=[], stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, text=True, env={"HOME": "/"}, cwd="/",
    )  # fmt: skip
    try:
        assert flooder.stdout is not None
        assert await asyncio.to_thread(flooder.stdout.readline) == "flooding\n"
        other = await asyncio.to_thread(
            as_uid, lab_python, STRANGER - 1, STRANGER - 1, daemon.socket_path, "ping"
        )
        assert "ok" in other, other
        assert daemon.connections.count <= 17  # the flooder's 16 (and the ping's, ending)
    finally:
        flooder.kill()
        flooder.wait(timeout=30)
    for _ in range(100):  # every place is given back once its connection closed
        if daemon.connections.count == 0 and daemon.connections.refusing == 0:
            break
        await asyncio.sleep(0.05)
    assert (daemon.connections.count, daemon.connections.refusing) == (0, 0)
    assert daemon.connections.refusing_by == {}


@needs_root
@pytest.mark.asyncio
async def test_connections_are_capped_per_user_but_not_for_root(
    daemon: Daemon, lab_python: Path
) -> None:
    holder = r"""
import socket, sys, json
from pollux_local.client import Client
from pollux_local.errors import PolluxError
socks = []
for _ in range(16):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM); s.connect(sys.argv[1]); socks.append(s)
import time; time.sleep(0.3)
try:
    Client(sys.argv[1], timeout_s=10).request("ping"); print("served")
except PolluxError as exc:
    print(type(exc).__name__, exc)
"""
    done = await asyncio.to_thread(
        subprocess.run,
        [str(lab_python), "-c", holder, str(daemon.socket_path)],
        user=STRANGER, group=STRANGER, extra_groups=[], capture_output=True, text=True,
        timeout=60, env={"HOME": "/"}, cwd="/",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    line = done.stdout.strip()
    # refused unread (``Busy``, a ``LimitExceeded``): the client tried again, then said so
    assert line.startswith("Busy") and "at most 16" in line, line
    # root (the daemon's user) is not capped: 40 open connections, then a ping
    socks = []
    for _ in range(40):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        await asyncio.to_thread(sock.connect, str(daemon.socket_path))
        socks.append(sock)
    try:
        ping = await asyncio.to_thread(Client(daemon.socket_path).request, "ping")
        assert ping["pid"] == os.getpid()
    finally:
        for sock in socks:
            sock.close()


# --- memory: 200 abusive connections, then back to the baseline -----------------------------------

FLOOD = r"""
import socket, sys
path, count, sent = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
socks = []
for _ in range(count):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(2)
    try:
        s.connect(path)
        s.sendall((16 * 1024 * 1024 - 1).to_bytes(4, "big") + b'{"v":1,"type":"status"' + b" " * sent)
    except OSError:
        pass
    socks.append(s)
print("open", flush=True)
sys.stdin.readline()
for s in socks:
    s.close()
print("closed", flush=True)
"""


class DaemonProcess:
    """A real daemon (``python -m pollux_local daemon``) on ``cpu:1``, as ``user`` if given.

    Not the shared ``tests.daemon_process.DaemonProcess``: this one can run as another Unix
    user from the lab install's interpreter (``user``, ``python``), always in a bare
    environment with ``/`` as its folder (what the socket and memory checks measure against),
    and is ready when its socket appears (a user's daemon answers no one else, so a ping from
    this test's root cannot tell); it also reports its memory (``rss``)."""

    def __init__(
        self, state_dir: Path, *args: str, user: int | None = None, python: Path | None = None
    ) -> None:
        self.state_dir = state_dir
        self.socket_path = state_dir / "daemon.sock"
        env = {"OMP_NUM_THREADS": "1", "HOME": "/", "PATH": "/usr/bin:/bin"}
        if python is None:
            env["PYTHONPATH"] = str(REPO_ROOT)  # this checkout, as this test runner's user
        ids: dict[str, Any] = {}
        if user is not None:
            ids = {"user": user, "group": user, "extra_groups": []}
        self.log = state_dir.parent / "daemon.out"
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                [str(python or sys.executable), "-m", "pollux_local", "daemon", "--state-dir",
                 str(state_dir),
                 "--devices", "cpu:1", "--interval", "30", *args],
                stdout=out, stderr=subprocess.STDOUT, env=env, cwd="/", start_new_session=True,
                **ids,
            )  # fmt: skip
        deadline = time.monotonic() + 30
        while not self.socket_path.exists():
            assert self.proc.poll() is None, self.log.read_text()
            assert time.monotonic() < deadline, self.log.read_text()
            time.sleep(0.05)
        time.sleep(0.1)

    def rss(self) -> int:
        return int(psutil.Process(self.proc.pid).memory_info().rss)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


@pytest.fixture()
def base() -> Iterator[Path]:
    made = short_dir("plx-srv-")
    yield made
    shutil.rmtree(made, ignore_errors=True)


def test_memory_returns_to_its_baseline_after_200_partial_16_mib_frames(base: Path) -> None:
    proc = DaemonProcess(base / "s")
    try:
        client = Client(proc.socket_path, timeout_s=20)
        for _ in range(20):
            client.request("status")
        baseline = proc.rss()
        flood = subprocess.Popen(
            [sys.executable, "-c", FLOOD, str(proc.socket_path), "200", str(1 << 20)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            assert flood.stdout is not None and flood.stdin is not None
            assert flood.stdout.readline().startswith("open")
            during = proc.rss()
            began = time.monotonic()
            client.request("status")  # still served
            assert time.monotonic() - began < 2.0
            flood.stdin.write("\n")
            flood.stdin.flush()
            assert flood.stdout.readline().startswith("closed")
        finally:
            flood.kill()
            flood.wait(10)
        mib = 1 << 20
        assert during - baseline < 100 * mib, f"{(during - baseline) / mib:.0f} MiB more during"
        deadline = time.monotonic() + 10
        while True:
            client.request("status")
            after = proc.rss()
            if after - baseline < 30 * mib or time.monotonic() > deadline:
                break
            time.sleep(0.25)
        assert after - baseline < 30 * mib, (
            f"RSS {after / mib:.0f} MiB after the flood (baseline {baseline / mib:.0f} MiB,"
            f" {during / mib:.0f} MiB during it)"
        )
        assert client.request("ping")["pid"] == proc.proc.pid
    finally:
        proc.stop()


# --- a user's own daemon: 0600, its user only; allow_group opens it to a group ------------------


@needs_root
def test_a_users_daemon_serves_that_user_only(base: Path, lab_python: Path) -> None:
    state = base / "s"
    state.mkdir(mode=0o755)
    os.chown(state, NOBODY, NOBODY)
    proc = DaemonProcess(state, user=NOBODY, python=lab_python)
    try:
        sock = proc.socket_path
        assert mode(sock) == 0o600 and sock.lstat().st_uid == NOBODY
        for name in ("state.db", "state.db-wal", "state.db-shm", "daemon.lock", "daemon.log"):
            assert mode(state / name) == 0o600, name
        assert mode(state) == 0o755
        # its user is served
        mine = as_uid(lab_python, NOBODY, NOBODY, sock, "ping")
        assert mine["ok"]["you"]["uid"] == NOBODY
        # another user cannot even connect (the kernel refuses: the socket is 0600)
        other = as_uid(lab_python, STRANGER, STRANGER, sock, "status")
        assert other["error"] == "DaemonUnavailable" and "permission denied" in other["message"]
        # ... and if the socket is opened by hand, the daemon's own check refuses
        os.chmod(sock, 0o666)
        other = as_uid(
            lab_python, STRANGER, STRANGER, sock, "submit", argv=["/bin/true"], workdir="/"
        )
        assert other["error"] == "PermissionDenied", other
        assert "serves only that user" in other["message"] and "\n" not in other["message"]
        assert as_uid(lab_python, NOBODY, NOBODY, sock, "status")["ok"]["jobs"] == []
    finally:
        proc.stop()


@needs_root
def test_allow_group_opens_a_users_daemon_to_that_group(base: Path, lab_python: Path) -> None:
    group = grp.getgrgid(NOBODY).gr_name
    state = base / "s"
    state.mkdir(mode=0o755)
    os.chown(state, NOBODY, NOBODY)
    config = base / "c.toml"
    config.write_text(f'[daemon]\nallow_group = "{group}"\n')
    config.chmod(0o644)
    name = "plxmem" + os.urandom(3).hex()  # a member: nogroup is its primary group
    subprocess.run(["useradd", "-M", "-N", "-g", group, "-s", "/bin/sh", name], check=True)
    proc = DaemonProcess(state, "--config", str(config), user=NOBODY, python=lab_python)
    try:
        sock = proc.socket_path
        assert mode(sock) == 0o660 and sock.lstat().st_gid == NOBODY
        uid = pwd.getpwnam(name).pw_uid
        member = as_uid(
            lab_python, uid, NOBODY, sock, "submit", argv=["/bin/true"], workdir="/", hold=True
        )
        assert "ok" in member, member
        # a process that runs with the group's gid, its user no member (the kernel lets it
        # open the socket): membership is the databases', review s55 kept it past a removal
        posing = as_uid(lab_python, STRANGER, NOBODY, sock, "status")
        assert posing["error"] == "PermissionDenied" and group in posing["message"], posing
        outsider = as_uid(lab_python, STRANGER, STRANGER, sock, "status")
        assert (
            outsider["error"] == "DaemonUnavailable" and "permission denied" in outsider["message"]
        )
        os.chmod(sock, 0o666)
        outsider = as_uid(lab_python, STRANGER, STRANGER, sock, "status")
        assert outsider["error"] == "PermissionDenied" and group in outsider["message"]
    finally:
        proc.stop()
        subprocess.run(["userdel", name], check=False)


KEEPALIVE = r"""
import socket, sys
from pollux_local.api import wire
from pollux_local.client import build_request
from pollux_local.api.messages import PingReply
from pollux_local.errors import PolluxError
sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
sock.settimeout(20)
sock.connect(sys.argv[1])
for line in sys.stdin:  # one ping on the same connection per line read
    try:
        sock.sendall(wire.encode_request(build_request("ping")))
        print("ok", wire.decode_reply(wire.recv_frame(sock), PingReply).you.uid, flush=True)
    except PolluxError as exc:
        print(type(exc).__name__, str(exc), flush=True)
        break
"""


@needs_root
def test_a_narrowed_allow_group_ends_a_connection_already_open(
    base: Path, lab_python: Path
) -> None:
    """A user the reloaded config no longer lets in is not served on a connection opened
    before the reload: its next request is refused, as a new connection would be."""
    config = base / "c.toml"
    config.write_text("[scheduler]\ninterval_s = 60\n")
    proc = DaemonProcess(base / "s", "--config", str(config), python=lab_python)
    client = subprocess.Popen(
        [str(lab_python), "-c", KEEPALIVE, str(proc.socket_path)],
        user=STRANGER, group=STRANGER, extra_groups=[], stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, text=True, env={"OMP_NUM_THREADS": "1", "HOME": "/"}, cwd="/",
    )  # fmt: skip
    assert client.stdin is not None and client.stdout is not None
    try:
        client.stdin.write("\n")
        client.stdin.flush()
        assert client.stdout.readline().split() == ["ok", str(STRANGER)]
        group = grp.getgrgid(0).gr_name  # the stranger is not in it
        config.write_text(f'[daemon]\nallow_group = "{group}"\n[scheduler]\ninterval_s = 60\n')
        os.kill(proc.proc.pid, signal.SIGHUP)
        wait_for(lambda: "reloaded" in (base / "s" / "daemon.log").read_text(), 15, "reload")
        client.stdin.write("\n")
        client.stdin.flush()
        answer = client.stdout.readline()
        assert answer.startswith("PermissionDenied") and group in answer, answer
    finally:
        client.kill()
        client.wait(timeout=10)
        proc.stop()


@needs_root
def test_a_root_daemon_socket_is_0666_and_files_0600(base: Path, lab_python: Path) -> None:
    proc = DaemonProcess(base / "s", python=lab_python)
    try:
        state = base / "s"
        assert mode(proc.socket_path) == 0o666
        for name in ("state.db", "state.db-wal", "state.db-shm", "daemon.lock", "daemon.log"):
            assert mode(state / name) == 0o600, name
        stranger = as_uid(lab_python, STRANGER, STRANGER, proc.socket_path, "status")
        assert "ok" in stranger, stranger  # everyone may read, identity from SO_PEERCRED
    finally:
        proc.stop()


@pytest.mark.asyncio
async def test_state_files_are_private_and_jobs_get_the_starting_umask_back() -> None:
    base = short_dir("plx-srv-")
    config = DaemonConfig(nodes=(NodeConfig("n0", ("cpu:0",)),), interval_s=60.0)
    made = Daemon(config, base / "s", policy=FifoPolicy())
    before = os.umask(0o002)
    try:
        ready = asyncio.Event()
        task = asyncio.ensure_future(made.run(ready=ready.set))
        await asyncio.wait_for(ready.wait(), 10)
        assert os.umask(0o002) == 0o002  # what the jobs inherit: the daemon's starting umask
        for name in ("state.db", "state.db-wal", "state.db-shm", "daemon.lock"):
            assert mode(base / "s" / name) == 0o600, name
        assert mode(base / "s") == 0o755 and mode(base / "s" / "jobs") == 0o755
        assert mode(made.socket_path) == socket_mode(os.geteuid(), None)
        made.request_stop()
        await asyncio.wait_for(task, 10)
    finally:
        os.umask(before)
        shutil.rmtree(base, ignore_errors=True)
