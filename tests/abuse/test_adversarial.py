"""A hostile lab member against the lab's daemon: one test per attack, each asserting that the
protection holds.

As on a real lab machine: the daemon runs as root from the shared interpreter that
``scripts/lab-install`` makes (the ``lab_install`` session fixture), and two ordinary Unix
users made for this module (``alice`` and ``bob``, removed with ``userdel -r`` at the end, even
on failure) attack it with that install's ``pollux-local``, its Python and raw sockets.  Jobs
run as their submitters.  The kernel's link protections are not relied on (they are off on the
test machines: ``fs.protected_symlinks = 0``), so a symlink or FIFO a user leaves in a job's
directory reaches whatever the daemon does with it.

The attacks, each named by its letter in ``docs/security.md``:

* a: a job swaps its ``rank0.log`` for a symlink to a root-only file and crashes to be
  restarted; b: ``logs`` of a job whose log is a symlink to a shadow-like file;
  c: a FIFO as ``report.json``; d: a raw submit with a workdir the user cannot enter;
  e: another user's personal daemon; f: 200 connections with partial frames;
  g: a priority above what a user may set; h: the submitter deleted while the job is queued;
  i: terminal escapes in a job's name; j: a job leaving a setsid grandchild that ignores
  SIGTERM, or a helper that keeps changing its pid; k: the state DB's modes; l: another user's job changed; m: ``status | head -1``.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import socket
import stat
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.abuse.lab import (
    CONTROL,
    TERMINAL,
    Lab,
    cli,
    decisions,
    everything_shown,
    file_facts,
    is_alive,
    job,
    raw_request,
    submit,
    wait_state,
)
from tests.labinstall import (
    LabInstall,
    LabUser,
    frame,
    one_line,
    user_pids,
    wait_until,
)
from tests.launch.hopper import (
    assert_hopper_gone,
    hopper_for_users,
    needs_fences,
    stop_hopper,
    wait_hopping,
)

pytestmark = [pytest.mark.timeout(90)]

# --- the attacks -----------------------------------------------------------------------------------


def test_a_log_swapped_for_a_symlink_to_a_root_file_is_not_followed_on_restart(
    lab: Lab, alice: LabUser, bob: LabUser
) -> None:
    secret = "TOPSECRET-" + secrets.token_hex(8)
    target = lab.secret_file("secret.txt", secret + "\n")
    before = file_facts(target)
    mark = lab.work / "a-first-run"
    attack = lab.script(
        "attack_a.sh",
        f"""if [ ! -e {mark} ]; then
    touch {mark}
    rm -f "$POLLUX_JOB_DIR/rank0.log"
    ln -s {target} "$POLLUX_JOB_DIR/rank0.log"
    exit 1      # crash: the daemon restarts the job and opens its log again
fi
echo second run
""",
    )
    daemon = lab.daemon()
    job_id = submit(alice, daemon, lab, "--name", "log-swap", str(attack))
    final = wait_state(daemon, job_id, TERMINAL, 30)
    assert mark.exists(), "the job never ran"
    assert "crashed" in decisions(daemon, job_id) or final["state"] == "failed"

    assert file_facts(target) == before, "the root-only file was changed through the symlink"
    shown = everything_shown(daemon, job_id, alice, bob)
    assert secret not in shown, "the root-only file's content was shown"


def test_a_checkpoint_dir_swapped_for_a_symlink_is_not_chowned_on_restart(
    lab: Lab, alice: LabUser
) -> None:
    # The same attack on the other path the daemon prepares at each start: the checkpoint
    # directory, swapped for a symlink to a root-only directory.
    vault_before = lab.vault.lstat()
    mark = lab.work / "a2-first-run"
    attack = lab.script(
        "attack_a2.sh",
        f"""if [ ! -e {mark} ]; then
    touch {mark}
    rm -rf "$POLLUX_JOB_DIR/checkpoint"
    ln -s {lab.vault} "$POLLUX_JOB_DIR/checkpoint"
    exit 1
fi
""",
    )
    daemon = lab.daemon()
    job_id = submit(alice, daemon, lab, "--name", "ckpt-swap", str(attack))
    wait_state(daemon, job_id, TERMINAL, 30)
    assert mark.exists(), "the job never ran"
    after = lab.vault.lstat()
    assert (after.st_uid, after.st_gid, after.st_mode) == (
        vault_before.st_uid,
        vault_before.st_gid,
        vault_before.st_mode,
    ), "the root-only directory was chowned or chmodded through the symlink"


def test_a_checkpoint_dir_planted_under_a_shared_checkpoint_root_is_not_used(
    lab: Lab, alice: LabUser, bob: LabUser
) -> None:
    # Under a checkpoint_root others may write to (a 1777 directory, an NFS export squashing
    # root), the daemon cannot make the job's directory and leaves it to the job's user.  Job
    # ids are sequential and shown to all: alice makes ROOT/<bob's next id> first, open to
    # her, with a checkpoint of hers in it.  It used to be bob's checkpoint directory: his job
    # failed (refused as hers), and alice could fail every job of every user that way.  Now
    # the directory's name carries a keyed hash of the id no one else can know beforehand:
    # bob's job runs, in a directory of his, and neither reads nor writes hers.
    root = lab.base / "ckpt"
    root.mkdir()
    root.chmod(0o1777)
    daemon = lab.daemon(checkpoint_root=f'"{root}"')
    probe = submit(bob, daemon, lab, "--hold", "--name", "probe", "/bin/true")
    planted = root / str(int(probe) + 1)
    made = alice.python(
        "import os, sys; os.mkdir(sys.argv[1], 0o777); os.chmod(sys.argv[1], 0o777);"
        " open(os.path.join(sys.argv[1], 'ckpt-9999999999.pt'), 'w').write('hers')",
        str(planted),
    )
    assert made.returncode == 0, made.stderr
    victim = lab.script(
        "victim_ckpt.sh",
        'echo "bob-secret" > "$POLLUX_CHECKPOINT_DIR/model.pt"\n'
        'echo "$POLLUX_CHECKPOINT_DIR" > "$POLLUX_JOB_DIR/where"\n'
        'cat "$POLLUX_CHECKPOINT_DIR/ckpt-9999999999.pt" > "$POLLUX_JOB_DIR/loaded" || true\n',
    )
    job_id = submit(bob, daemon, lab, "--name", "victim", str(victim))
    assert job_id == planted.name
    final = wait_state(daemon, job_id, TERMINAL, 30)
    assert final["state"] == "succeeded", final
    assert sorted(os.listdir(planted)) == ["ckpt-9999999999.pt"], "bob's job wrote into hers"
    used = Path((daemon.state_dir / "jobs" / job_id / "where").read_text().strip())
    assert used.parent == root and used.name.startswith(f"{job_id}-"), used
    assert used.stat().st_uid == bob.uid
    assert (used / "model.pt").read_text() == "bob-secret\n"
    assert (daemon.state_dir / "jobs" / job_id / "loaded").read_text() == "", "hers was read"


def test_b_logs_of_a_symlink_to_a_shadow_like_file_are_refused_in_one_line(
    lab: Lab, alice: LabUser, bob: LabUser
) -> None:
    hashed = "root:$6$" + secrets.token_hex(12) + ":19000:0:99999:7:::"
    shadow = lab.secret_file("shadow", hashed + "\n")
    ready = lab.work / "b-linked"
    attack = lab.script(
        "attack_b.sh",
        f'ln -sf {shadow} "$POLLUX_JOB_DIR/rank0.log"\ntouch {ready}\nexec sleep 60\n',
    )
    daemon = lab.daemon()
    job_id = submit(alice, daemon, lab, "--name", "log-link", str(attack))
    wait_until(ready.exists, 20, "the job to replace its log with a symlink")

    for user in (alice, bob):
        for extra in ((), ("--tail", "100")):
            done = cli(user, daemon, "logs", job_id, *extra)
            assert hashed not in done.stdout + done.stderr, "the shadow-like file was shown"
            assert done.returncode != 0, f"logs of a symlinked log was not refused: {done.stdout!r}"
            line = one_line(done.stderr)
            assert "Traceback" not in line
    assert daemon.client.request("ping")  # and the daemon is fine


def test_c_a_fifo_as_report_json_does_not_stall_the_daemon(
    lab: Lab, alice: LabUser, bob: LabUser
) -> None:
    ready = lab.work / "c-fifo"
    attack = lab.script(
        "attack_c.sh",
        f'mkfifo "$POLLUX_JOB_DIR/report.json"\ntouch {ready}\nsleep 3\n',
    )
    daemon = lab.daemon()
    job_id = submit(alice, daemon, lab, "--name", "fifo", str(attack))
    wait_until(ready.exists, 20, "the job to make its FIFO")

    # Several scheduling passes while the job runs, then its exit (the daemon reads a finished
    # job's last report too): every status answers within 2 s.
    deadline = time.monotonic() + 6
    while time.monotonic() < deadline:
        started = time.monotonic()
        try:
            done = cli(bob, daemon, "status", timeout_s=10)
        except subprocess.TimeoutExpired:
            pytest.fail(f"status hung for 10 s with a FIFO as report.json\n{daemon.output()}")
        took = time.monotonic() - started
        assert done.returncode == 0, done.stderr
        assert took < 2.0, f"status took {took:.1f} s with a FIFO as report.json"
        time.sleep(0.3)
    final = wait_state(daemon, job_id, TERMINAL, 10)
    assert final["state"] == "succeeded", final


def test_d_raw_submit_with_a_workdir_the_user_cannot_enter_fails_and_never_runs_there(
    lab: Lab, alice: LabUser, bob: LabUser
) -> None:
    private = lab.base / "alice-private"
    private.mkdir(mode=0o700)
    os.chown(private, alice.uid, alice.gid)
    ran = lab.work / "d-ran"
    daemon = lab.daemon()
    reply = raw_request(
        bob,
        daemon,
        {
            "type": "submit",
            "argv": ["/bin/sh", "-c", f"pwd -P > {ran}; ls -la >> {ran}"],
            "workdir": str(private),
            "name": "into-alice",
        },
    )
    if reply["ok"]:
        final = wait_state(daemon, str(reply["id"]), TERMINAL, 20)
        assert final["state"] == "failed", final
        reason = final["reason"]
    else:  # refused at submit: as good, if it says why
        reason = reply["error"]
    assert str(private) in reason, f"the reason does not name the directory: {reason!r}"
    time.sleep(1)
    assert not ran.exists(), f"the job ran in {private}: {ran.read_text()!r}"


def test_e_a_personal_daemon_answers_its_owner_only(lab: Lab, alice: LabUser, bob: LabUser) -> None:
    daemon = lab.daemon(user=alice, name="personal")
    mine = cli(alice, daemon, "status")
    assert mine.returncode == 0, mine.stderr

    for args in (("status",), ("submit", "--hold", "--workdir", str(lab.work), "/bin/true")):
        theirs = cli(bob, daemon, *args)
        assert theirs.returncode != 0, f"bob's {args[0]} was answered: {theirs.stdout!r}"
        assert "permission denied" in one_line(theirs.stderr).lower(), theirs.stderr
    mine = cli(alice, daemon, "status", "--json")
    assert mine.returncode == 0 and json.loads(mine.stdout)["jobs"] == [], mine


PARTIAL_FRAMES = r"""
import socket, sys
path, count, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
socks = []
for _ in range(count):
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(5)
    try:
        sock.connect(path)
        # a frame announcing 16 MiB - 1 bytes, of which only `size` ever come
        sock.sendall((16 * 1024 * 1024 - 1).to_bytes(4, "big") + b'{"v":1,"type":"status"' + b" " * size)
    except OSError:
        pass
    socks.append(sock)
print("open", len(socks), flush=True)
sys.stdin.readline()
for sock in socks:
    sock.close()
print("closed", flush=True)
"""


def test_f_two_hundred_partial_frames_do_not_starve_other_users(
    lab: Lab, alice: LabUser, bob: LabUser
) -> None:
    daemon = lab.daemon()
    for _ in range(3):
        assert cli(alice, daemon, "status").returncode == 0
    baseline = daemon.rss_bytes()

    flood = bob.popen(
        bob.lab.python, "-c", PARTIAL_FRAMES, str(daemon.state_dir / "daemon.sock"), "200",
        str(256 * 1024), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
    )  # fmt: skip
    try:
        assert flood.stdout is not None and flood.stdin is not None
        assert flood.stdout.readline().startswith("open"), "the flood did not start"
        during = daemon.rss_bytes()
        for _ in range(3):
            started = time.monotonic()
            done = cli(alice, daemon, "status", timeout_s=10)
            took = time.monotonic() - started
            assert done.returncode == 0, done.stderr
            assert took < 2.0, f"alice's status took {took:.1f} s during bob's flood"
        flood.stdin.write("\n")
        flood.stdin.flush()
        assert flood.stdout.readline().startswith("closed")
    finally:
        flood.kill()
        flood.wait(10)

    limit = baseline + 24 * 1024 * 1024

    def settled() -> bool:
        cli(alice, daemon, "status")
        return daemon.rss_bytes() <= limit

    try:
        wait_until(settled, 10, "the daemon's memory to return near its baseline", every_s=0.5)
    except AssertionError:
        mib = 1 << 20
        pytest.fail(
            f"RSS {daemon.rss_bytes() / mib:.0f} MiB after the flood closed (baseline "
            f"{baseline / mib:.0f} MiB, {during / mib:.0f} MiB during it)"
        )
    assert cli(alice, daemon, "status").returncode == 0


def test_g_a_user_cannot_give_a_job_priority_100(lab: Lab, alice: LabUser) -> None:
    daemon = lab.daemon()
    refused = cli(alice, daemon, "submit", "--hold", "--priority", "100", "--workdir",
                  str(lab.work), "/bin/true")  # fmt: skip
    assert refused.returncode != 0, f"priority 100 was accepted: {refused.stdout!r}"
    one_line(refused.stderr)
    assert daemon.client.request("status")["jobs"] == [], "the job was queued anyway"

    job_id = submit(alice, daemon, lab, "--hold", "/bin/true")
    refused = cli(alice, daemon, "priority", job_id, "100")
    assert refused.returncode != 0, f"priority 100 was accepted: {refused.stdout!r}"
    one_line(refused.stderr)
    assert job(daemon, job_id)["priority"] == 0

    # root (an admin) may
    daemon.client.request("set_priority", id=job_id, priority=100)
    assert job(daemon, job_id)["priority"] == 100


def test_h_a_deleted_users_queued_job_fails_and_does_not_block_others(
    lab: Lab, lab_install: LabInstall, bob: LabUser
) -> None:
    daemon = lab.daemon()  # one device
    blocker = daemon.client.request("submit", argv=["/bin/sleep", "600"], workdir="/tmp")["id"]
    wait_state(daemon, str(blocker), ("running",), 20)

    carol = LabUser(lab_install, "pxcarol")
    try:
        carol_ran, bob_ran = lab.work / "h-carol", lab.work / "h-bob"
        carols = submit(
            carol, daemon, lab, "--name", "orphan", "/bin/sh", "-c", f"touch {carol_ran}"
        )
        bobs = submit(bob, daemon, lab, "--name", "next", "/bin/sh", "-c", f"touch {bob_ran}")
        assert job(daemon, carols)["state"] == "queued"
    finally:
        carol.remove()

    daemon.client.request("cancel", ids=[str(blocker)])
    final = wait_state(daemon, bobs, TERMINAL, 20)
    assert final["state"] == "succeeded" and bob_ran.exists(), final
    orphan = wait_state(daemon, carols, TERMINAL, 10)
    assert orphan["state"] == "failed", orphan
    assert orphan["reason"], "no reason given"
    assert any(word in orphan["reason"] for word in (carol.name, str(carol.uid), "user")), orphan
    assert not carol_ran.exists()


ESCAPES = "\x1b[2J\x1b]0;owned\x07red\x1b[31m\rX\x9b1m"


def test_i_job_names_with_terminal_escapes_are_refused_or_printed_escaped(
    lab: Lab, alice: LabUser, bob: LabUser
) -> None:
    daemon = lab.daemon()
    via_cli = cli(alice, daemon, "submit", "--hold", "--name", "evil" + ESCAPES, "--workdir",
                  str(lab.work), "/bin/true")  # fmt: skip
    raw = raw_request(
        alice,
        daemon,
        {"type": "submit", "argv": ["/bin/true"], "workdir": str(lab.work), "hold": True,
         "name": "evil" + ESCAPES},
    )  # fmt: skip
    if via_cli.returncode != 0:
        assert not CONTROL & set(one_line(via_cli.stderr)), repr(via_cli.stderr)
    if not raw["ok"]:
        assert not CONTROL & set(raw["error"]), repr(raw["error"])
    for job_id in {j["id"] for j in daemon.client.request("status")["jobs"]}:
        for args in (("status",), ("show", job_id)):
            out = cli(bob, daemon, *args)
            assert out.returncode == 0, out.stderr
            assert not CONTROL & set(out.stdout), f"raw control characters: {out.stdout!r}"


def test_i_what_a_job_controls_is_printed_escaped(lab: Lab, alice: LabUser, bob: LabUser) -> None:
    # Names are checked at submit, but a command line may hold anything, and a crashed job's
    # reason is its last log line: `show` and `status` print them to other users' terminals.
    daemon = lab.daemon(max_retries=0)
    job_id = submit(
        alice, daemon, lab, "--name", "escapes", "/bin/sh", "-c",
        f"printf '%s\\n' '{ESCAPES}'; exit 3", "#" + ESCAPES,
    )  # fmt: skip
    wait_state(daemon, job_id, ("failed",), 20)
    for args in (("status",), ("show", job_id)):
        out = cli(bob, daemon, *args)
        assert out.returncode == 0, out.stderr
        assert not CONTROL & set(out.stdout), f"raw control characters: {out.stdout!r}"


def test_j_a_setsid_grandchild_ignoring_sigterm_does_not_outlive_cancel(
    lab: Lab, bob: LabUser
) -> None:
    pidfile = lab.work / "j-grandchild"
    attack = lab.script(
        "attack_j.sh",
        f"""setsid sh -c 'trap "" TERM HUP; echo $$ > {pidfile}; while :; do sleep 1; done' \\
    </dev/null >/dev/null 2>&1 &
exec sleep 600
""",
    )
    daemon = lab.daemon()
    job_id = submit(bob, daemon, lab, "--name", "escapee", str(attack))
    wait_state(daemon, job_id, ("running",), 20)
    wait_until(lambda: pidfile.exists() and pidfile.read_text().strip(), 20, "the grandchild")
    grandchild = int(pidfile.read_text())
    assert is_alive(grandchild)

    cancelled = cli(bob, daemon, "cancel", job_id)
    assert cancelled.returncode == 0, cancelled.stderr
    assert job(daemon, job_id)["state"] == "cancelled"
    try:
        wait_until(lambda: not user_pids(bob.uid), 10, "every process of the job to end")
    except AssertionError:
        left = [psutil.Process(pid).cmdline() for pid in user_pids(bob.uid) if is_alive(pid)]
        pytest.fail(f"after cancel, still running as {bob.name}: {left}")
    assert not is_alive(grandchild)


@pytest.mark.parametrize("how", ["ends", "cancelled"])
def test_j_a_process_that_keeps_changing_its_pid_does_not_outlive_its_job(
    lab: Lab, bob: LabUser, how: str
) -> None:
    needs_fences()
    # A helper that forks and lets its parent exit, about 9,000 times a second with a new
    # session at each hop: every pid listed is gone before a kill lands.  The incarnation's
    # fence cgroup (root's: the job cannot leave it) is killed as one.
    hops = lab.work / f"j-hops-{how}"
    hopper = hopper_for_users(lab.base, hops)
    wait = "sleep 1; exit 0" if how == "ends" else "exec sleep 600"
    attack = lab.script(
        f"attack_j_{how}.sh", f"{hopper} {hops} </dev/null >/dev/null 2>&1 &\n{wait}\n"
    )
    daemon = lab.daemon()
    job_id = submit(bob, daemon, lab, "--name", "hopper", str(attack))
    try:
        wait_hopping(hops, 30)
        if how == "cancelled":
            cancelled = cli(bob, daemon, "cancel", job_id)
            assert cancelled.returncode == 0, cancelled.stderr
        wait_state(daemon, job_id, ("succeeded", "cancelled"), 30)
        assert_hopper_gone(hops, "its job")
        wait_until(lambda: not user_pids(bob.uid), 10, "every process of the job to end")
    finally:
        stop_hopper(hops)


def test_k_the_state_db_and_its_wal_and_shm_are_0600_from_the_first_start(lab: Lab) -> None:
    state = lab.base / "state"
    names = ("state.db", "state.db-wal", "state.db-shm")
    seen: dict[str, set[int]] = {name: set() for name in names}
    stop = threading.Event()

    def watch() -> None:  # every mode each file ever has, from before the daemon starts
        while not stop.is_set():
            for name in names:
                with contextlib.suppress(OSError):
                    seen[name].add(stat.S_IMODE((state / name).lstat().st_mode))
            time.sleep(0.0005)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        daemon = lab.daemon()
        daemon.client.request("submit", argv=["/bin/true"], workdir="/tmp", hold=True)
        time.sleep(0.3)
    finally:
        stop.set()
        watcher.join(5)
    assert seen["state.db"] and seen["state.db-wal"], seen
    loose = {name: sorted(oct(m) for m in modes if m != 0o600) for name, modes in seen.items()}
    assert not any(loose.values()), f"modes other than 0600 seen: {loose}"


def test_l_another_users_job_cannot_be_cancelled_held_released_or_reprioritised(
    lab: Lab, alice: LabUser, bob: LabUser
) -> None:
    daemon = lab.daemon()
    running = submit(alice, daemon, lab, "--name", "alices", "/bin/sleep", "600")
    held = submit(alice, daemon, lab, "--name", "alices-held", "--hold", "/bin/sleep", "600")
    wait_state(daemon, running, ("running",), 20)

    attempts: list[tuple[str, ...]] = [
        ("cancel", running), ("hold", running), ("priority", running, "-5"),
        ("cancel", held), ("release", held), ("priority", held, "-5"),
    ]  # fmt: skip
    for args in attempts:
        done = cli(bob, daemon, *args)
        assert done.returncode != 0, f"bob's {args} was accepted"
        line = one_line(done.stderr)
        assert "permission denied" in line and alice.name in line, line
    raw = raw_request(bob, daemon, {"type": "cancel", "ids": [running, held]})
    assert not raw["ok"] and raw["code"] == "permission_denied", raw

    assert job(daemon, running)["state"] == "running"
    assert job(daemon, held)["state"] == "held"
    assert job(daemon, running)["priority"] == job(daemon, held)["priority"] == 0
    # alice herself may
    assert cli(alice, daemon, "cancel", running, held).returncode == 0


def test_m_status_into_head_prints_no_traceback(lab: Lab, bob: LabUser) -> None:
    daemon = lab.daemon()
    # enough jobs for `status` to outrun the pipe (over 64 KiB), sent on one connection
    frames = b"".join(
        frame(json.dumps({"v": 1, "type": "submit", "argv": ["/bin/true"], "workdir": "/tmp",
                          "hold": True, "name": f"job-{i:05d}-" + "x" * 14}).encode())
        for i in range(1500)
    )  # fmt: skip
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(60)
        sock.connect(str(daemon.state_dir / "daemon.sock"))
        sock.sendall(frames)
        received = 0
        while received < 1500:
            length = int.from_bytes(_recv(sock, 4), "big")
            _recv(sock, length)
            received += 1
    for command in ("status", "status --json"):
        line = f"{bob.lab.cli} {command} --state-dir {daemon.state_dir} | head -1"
        done = bob.run("/bin/sh", "-c", line)
        assert done.returncode == 0
        assert len(done.stdout.splitlines()) == 1, done.stdout[:200]
        assert done.stderr == "", f"`{command} | head -1` printed: {done.stderr}"


def _recv(sock: Any, count: int) -> bytes:
    data = b""
    while len(data) < count:
        chunk = sock.recv(count - len(data))
        assert chunk, "the daemon closed the connection"
        data += chunk
    return data
