"""One user's notifications against another's, and a state disk that fills up: two real Unix
users against a real root daemon (root only).

* notifications: alice's jobs notify a listener that accepts and never answers, and a
  cancelled array of hers adds many more ends; bob's job's webhook still arrives within a
  few seconds of his job's end (per-owner queues served round robin, 2 senders per owner, a
  10 s limit on each sender);
* a full disk: on a 64 MB state filesystem, a job of alice's printing without end is cut at
  ``[limits] max_log_size`` (``logs`` shows the note); once the disk is filled by other means,
  bob's submit fails in one line (``state disk full``), ``status`` and ``show`` still answer,
  the loop backs off instead of spinning, and the ends seen meanwhile (an exit, a time limit)
  are recorded once room returns, each exactly once.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.abuse.lab import Lab, cli, decisions, job, submit, wait_state
from tests.daemon.test_notify import webhook_server
from tests.labinstall import LabDaemon, LabUser, wait_until

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root: real users and a root daemon"),
    pytest.mark.timeout(600),
]


@contextmanager
def silent_listener() -> Iterator[int]:
    """A TCP listener on 127.0.0.1 that accepts connections and never answers: its port."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(256)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        sock.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(sock.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield sock.getsockname()[1]
    finally:
        stop.set()
        thread.join(5)
        for conn in held:
            conn.close()
        sock.close()


def test_one_users_hanging_and_many_notifications_do_not_delay_anothers(
    lab: Lab, alice: LabUser, bob: LabUser
) -> None:
    daemon = lab.daemon(devices="cpu:8")
    quick = lab.script("quick.sh", "exit 0\n")
    with silent_listener() as silent, webhook_server() as (port, received):
        hook = f"http://127.0.0.1:{silent}/hook"
        ends = [submit(alice, daemon, lab, "--notify", hook, str(quick)) for _ in range(8)]
        array = submit(alice, daemon, lab, "--hold", "--array", "0-299", "--notify", hook,
                       str(quick))  # fmt: skip
        for job_id in ends:
            wait_state(daemon, job_id, ("succeeded",), 120)
        done = cli(alice, daemon, "cancel", "--array", array)
        assert done.returncode == 0, done.stderr
        time.sleep(1.0)  # alice's 308 ends are in the outbox, her senders hang on the listener

        mine = submit(bob, daemon, lab, "--notify", f"http://127.0.0.1:{port}/bob", str(quick))
        ended = wait_state(daemon, mine, ("succeeded",), 120)
        wait_until(lambda: received, 60, "bob's notification")
        body = json.loads(received[0].body)
        delay = received[0].time - float(ended["end_time"])
        assert body["job"]["id"] == mine
        assert delay <= 5.0, f"bob's notification came {delay:.1f} s after his job ended"
        # alice's senders give up on her listener (8 s a destination; killed at 10 s)
        cut = (f"sender as {alice.name} failed", "did not finish in 10 s; killed")
        wait_until(lambda: any(c in full_log(daemon) for c in cut), 60, "alice's senders cut")


@contextmanager
def small_filesystem(path: Path, size: str = "64m") -> Iterator[Path]:
    """A tmpfs of ``size`` mounted at ``path`` (root's, 0755), unmounted at the end."""
    path.mkdir(mode=0o755)
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", str(path)],
        capture_output=True, text=True,
    )  # fmt: skip
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {done.stderr.strip()}")
    try:
        yield path
    finally:
        for _ in range(20):
            if subprocess.run(["umount", str(path)], capture_output=True).returncode == 0:
                break
            time.sleep(0.5)
        else:
            subprocess.run(["umount", "-l", str(path)], capture_output=True)


def fill(path: Path) -> Path:
    """Fill the filesystem of ``path`` with one file of root's; the file."""
    big = path / "filler"
    fd = os.open(big, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        for chunk in (1 << 20, 4096, 512):
            while True:
                try:
                    os.write(fd, b"\0" * chunk)
                except OSError:
                    break
    finally:
        os.close(fd)
    return big


def full_log(daemon: LabDaemon) -> str:
    return daemon.log_path.read_text(errors="replace")


def retry_lines(text: str) -> int:
    return len(re.findall(r"scheduling pass: .*retrying in", text))


def test_a_job_cannot_fill_the_state_disk_and_a_full_disk_is_survived(
    lab: Lab, alice: LabUser, bob: LabUser
) -> None:
    with small_filesystem(lab.base / "state") as state:
        daemon = lab.daemon(devices="cpu:4", extra_toml='[limits]\nmax_log_size = "1M"\n')
        assert daemon.state_dir == state
        flood = lab.script("flood.sh", "exec yes 'pollux flood pollux flood pollux flood'\n")
        flooding = submit(alice, daemon, lab, str(flood))
        wait_state(daemon, flooding, ("running",), 60)

        def capped() -> bool:
            shown = cli(alice, daemon, "logs", flooding)
            return "log truncated at 1 MB; further output discarded" in shown.stdout

        wait_until(capped, 60, "the truncation note in alice's log")
        time.sleep(2.0)  # the flood goes on: the log stays where it was cut
        log_size = (state / "jobs" / flooding / "rank0.log").stat().st_size
        assert log_size < 1.1 * (1 << 20)
        assert shutil.disk_usage(state).used < 16 << 20
        cli(alice, daemon, "cancel", flooding)

        # bob: one job that exits during the full disk, one that reaches its time limit then
        exits = lab.script("exits.sh", "sleep 6\nexit 0\n")
        limited = lab.script("limited.sh", "exec sleep 600\n")
        ends = submit(bob, daemon, lab, str(exits))
        times_out = submit(bob, daemon, lab, "--time", "8s", str(limited))
        wait_state(daemon, ends, ("running",), 60)
        wait_state(daemon, times_out, ("running",), 60)

        big = fill(state)
        try:
            refusals = []
            for _ in range(5):
                done = cli(bob, daemon, "submit", "--workdir", str(lab.work), str(exits))
                if done.returncode != 0:
                    refusals.append(done.stderr)
            assert refusals, "a submit onto a full state disk was accepted every time"
            for text in refusals:
                assert len(text.strip().splitlines()) == 1, text
                assert "state disk full" in text, text
            # the admin reads it in the daemon's log too (once a minute at most)
            assert full_log(daemon).count("Submit request refused: state disk full") == 1
            # reads still answer
            assert cli(bob, daemon, "status").returncode == 0
            assert cli(bob, daemon, "show", ends).returncode == 0
            # both of bob's jobs end while the disk is full; the loop backs off meanwhile
            time.sleep(10.0)
            before = retry_lines(full_log(daemon))
            time.sleep(6.0)
            during = retry_lines(full_log(daemon)) - before
            assert 1 <= during <= 6, f"{during} retried passes in 6 s"
            assert "cannot rollback" not in full_log(daemon)
        finally:
            big.unlink()

        finished = wait_state(daemon, ends, ("succeeded",), 60)
        limited_end = wait_state(daemon, times_out, ("failed",), 60)
        assert "time limit" in limited_end["reason"]
        assert finished["restarts"] == 0
        time.sleep(2.0)  # a few passes more: nothing is recorded twice, nothing runs again
        for job_id, final in ((ends, "finished"), (times_out, "failed")):
            kinds = decisions(daemon, job_id)
            assert kinds.count(final) == 1, kinds
            assert "requeued" not in kinds and kinds.count("start") == 1, kinds
        assert job(daemon, ends)["state"] == "succeeded"


def test_job_logs_leave_the_state_database_its_room(lab: Lab, alice: LabUser, bob: LabUser) -> None:
    # a log limit bigger than the disk: the per-log cap alone would let one job fill it; logs
    # pause while the disk has under [limits] log_keep_free (here a tenth of 64 MB) free
    with small_filesystem(lab.base / "state") as state:
        daemon = lab.daemon(devices="cpu:2", extra_toml='[limits]\nmax_log_size = "1G"\n')
        flood = lab.script("flood.sh", "exec yes 'pollux flood pollux flood pollux flood'\n")
        flooding = submit(alice, daemon, lab, str(flood))
        wait_state(daemon, flooding, ("running",), 60)

        def paused() -> bool:
            shown = cli(alice, daemon, "logs", flooding, "--tail", "4096")
            return "free; output discarded until it has room" in shown.stdout

        wait_until(paused, 90, "the note that alice's log pauses")
        time.sleep(2.0)  # the flood goes on: the disk keeps its room
        free = shutil.disk_usage(state).free
        assert free >= 6 << 20, f"only {free} bytes left on the state disk"
        # the database still takes bob's submit, runs his job and records its end
        quick = lab.script("quick.sh", "echo done\n")
        ends = submit(bob, daemon, lab, str(quick))
        finished = wait_state(daemon, ends, ("succeeded", "failed"), 60)
        assert finished["state"] == "succeeded", finished
        assert cli(alice, daemon, "cancel", flooding).returncode == 0
        wait_state(daemon, flooding, ("cancelled",), 60)
        assert "state disk full" not in full_log(daemon)
