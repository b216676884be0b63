"""The node-side supervisor of the SSH launcher: starts one job's replicas on its node.

``launch/ssh.py`` does not need pollux-local on the node: it sends this file's source text over
ssh and runs it there as ``python3 -u -c <source>``.  So this module uses the standard library
only and runs on Python 3.8 (annotations stay unevaluated strings; no newer library calls
without a fallback).  Importing it does nothing; :func:`main` runs the supervisor.

Protocol.  The first line of stdin is the launch spec, one JSON object::

    {"node", "cwd", "node_workdir", "cwd_required", "user", "orphan_grace_s",
     "stream_logs", "probe": {"path", "token", "dir"},
     "replicas": [{"rank", "argv", "env", "log", "banner"}, ...]}

(so that environments never appear in the node's process list).  Each replica runs in its own
session and process group with exactly the environment given, its output appended to its log
file.  Lines on stdout, one per event::

    PID <rank> <pid>        replica started
    LOG <rank> <base64>     new bytes of the replica's log
    EXIT <rank> <code>      replica ended (128+signal when killed by a signal)
    FAIL <message>          nothing was started; the process exits with 254

Later stdin lines ``TERM``/``KILL`` signal every replica's process group.  When stdin closes
(the daemon is gone, or the link was lost and the node's sshd noticed) the replicas get
SIGTERM, then SIGKILL after ``orphan_grace_s``, so that no orphan keeps running.

With ``"record": {"path", "token"}`` in the spec the agent keeps an exit record on the node
(JSON, 0600, in a 0700 directory, replaced atomically), written once the replicas run, after
each exit and once all have ended, so that a daemon that restarts reads what became of them
(``ssh.SshRecordedGroup``) instead of running a finished job again::

    {"version": 1, "token", "state": "running" | "ended", "agent_pid", "orphaned",
     "replicas": [{"rank", "pid", "exit_code"}, ...], "exits": [rank, ...], "ended"}

``orphaned`` says that the agent stopped replicas itself because its stdin closed (the
daemon was gone); ``exits`` lists the ranks in the order they ended.  Once stdout is gone the
agent goes on without it: the record is what a restarted daemon reads.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import pwd
import signal
import subprocess
import sys
import threading
import time
from typing import IO, Any, NoReturn

#: Exit status when nothing could be started (bad working dir, unshared checkpoint dir, user):
#: ``api.states.ExitCode.NODE_SETUP`` (this module is stdlib only; tests/api/test_exit_codes.py).
SETUP_FAILED_EXIT_CODE = 254
#: Exit code reported for a replica whose program could not be executed (``ExitCode.EXEC_FAILED``).
NOT_STARTED_EXIT_CODE = 127
#: Largest piece of a log sent in one ``LOG`` line (bytes, before base64).
LOG_CHUNK = 1 << 16
#: Seconds between two looks at the replicas' logs.
TAIL_INTERVAL_S = 0.25


class Lines:
    """Protocol lines on ``stream``, whole and flushed, whichever thread writes them; a
    stream that is gone (the daemon died) is given up, silently."""

    def __init__(self, stream: IO[str]) -> None:
        self._stream = stream
        self._lock = threading.Lock()
        self.gone = False

    def say(self, *parts: object) -> None:
        """Write ``parts`` joined by spaces as one line."""
        with self._lock:
            if self.gone:
                return
            try:
                self._stream.write(" ".join(str(p) for p in parts) + "\n")
                self._stream.flush()
            except (OSError, ValueError):
                self.gone = True

    def fail(self, message: str) -> NoReturn:
        """Report that nothing was started (``FAIL``) and exit with 254."""
        self.say("FAIL", message.replace("\n", " "))
        sys.exit(SETUP_FAILED_EXIT_CODE)


def working_dir(spec: dict[str, Any], lines: Lines) -> str:
    """The replicas' working directory: the job's, else (when the spec allows) the node's."""
    cwd = str(spec["cwd"])
    if not os.path.isdir(cwd):
        alt = os.path.expanduser(spec["node_workdir"])
        if spec.get("cwd_required", True) or not os.path.isdir(alt):
            lines.fail(f"working directory {cwd} does not exist on node {spec['node']}")
        cwd = alt
    return cwd


def check_probe(spec: dict[str, Any], lines: Lines) -> None:
    """Fail unless the daemon's probe file (written into the checkpoint dir) is visible here
    with its token: the checkpoint dir must be shared by every node of the job."""
    probe = spec.get("probe")
    if not probe:
        return
    try:
        with open(probe["path"]) as f:
            seen: str | None = f.read().strip()
    except OSError:
        seen = None
    if seen != probe["token"]:
        lines.fail(
            f"checkpoint dir {probe['dir']} is not shared with node {spec['node']} (a probe "
            "file written by the daemon is not visible there); put POLLUX_CHECKPOINT_DIR on a "
            "filesystem every node mounts"
        )


def identity(spec: dict[str, Any], lines: Lines) -> dict[str, Any]:
    """``Popen`` keywords that run the replicas as the spec's ``user`` (empty: as this login)."""
    user = spec.get("user")
    if not user:
        return {}
    try:
        pw = pwd.getpwnam(user)
    except KeyError:
        lines.fail(f"user {user} does not exist on node {spec['node']}")
    if os.getuid() == pw.pw_uid:
        return {}
    if os.getuid() != 0:
        lines.fail(f"cannot run as {user} on node {spec['node']}: the ssh login there is not root")
    return {
        "user": pw.pw_uid,
        "group": pw.pw_gid,
        "extra_groups": os.getgrouplist(user, pw.pw_gid),
    }


def exit_code(status: int) -> int:
    """``Popen.returncode`` of a wait status: the exit code, or -signal when killed."""
    to_code = getattr(os, "waitstatus_to_exitcode", None)  # Python >= 3.9
    return int(to_code(status)) if to_code is not None else status >> 8


class ExitRecord:
    """The exit record a restarted daemon reads (``spec["record"]``; none without it)."""

    def __init__(self, spec: dict[str, Any]) -> None:
        record = spec.get("record") or {}
        self.path = os.path.expanduser(str(record["path"])) if record.get("path") else None
        self.token = str(record.get("token", ""))
        self._lock = threading.Lock()

    def write(self, supervisor: Supervisor, state: str) -> None:
        """Replace the record with ``supervisor``'s replicas as they are now (best effort:
        a node that cannot keep it only loses what a restarted daemon could learn)."""
        if self.path is None:
            return
        replicas = [
            {"rank": rank, "pid": pid, "exit_code": supervisor.codes.get(rank)}
            for rank, pid in sorted(supervisor.pids.items())
        ]
        data = {
            "version": 1,
            "token": self.token,
            "state": state,
            "agent_pid": os.getpid(),
            "orphaned": supervisor.orphaned,
            "replicas": replicas,
            "exits": list(supervisor.exits),
            "ended": time.time() if state == "ended" else None,
        }
        with self._lock:
            try:
                os.makedirs(os.path.dirname(self.path), mode=0o700, exist_ok=True)
                tmp = f"{self.path}.{os.getpid()}.tmp"
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
                with os.fdopen(fd, "w") as fh:
                    json.dump(data, fh)
                os.replace(tmp, self.path)
            except OSError:
                pass


class Supervisor:
    """The replicas of one job on this node, their logs and their process groups."""

    def __init__(self, spec: dict[str, Any], lines: Lines) -> None:
        self.spec = spec
        self.lines = lines
        self.procs: dict[int, tuple[int, subprocess.Popen[bytes]]] = {}  # pid -> (rank, proc)
        self.logs: dict[int, list[Any]] = {}  # rank -> [path, bytes already sent]
        self._pump_lock = threading.Lock()
        self.record = ExitRecord(spec)
        self.pids: dict[int, int] = {}  # rank -> pid (0: could not be started)
        self.codes: dict[int, int] = {}  # rank -> exit code
        self.exits: list[int] = []  # ranks in the order they ended
        #: replicas were stopped by the agent itself because its stdin closed
        self.orphaned = False

    def ended(self, rank: int, code: int) -> None:
        """``rank`` ended with ``code``: recorded, then ``EXIT`` said."""
        self.codes[rank] = code
        self.exits.append(rank)
        self.record.write(self, "running")
        self.lines.say("EXIT", rank, code)

    def start(self, cwd: str, run_as: dict[str, Any]) -> None:
        """Start every replica, each appending to its log (after its banner); ``PID`` for each
        started, ``EXIT <rank> 127`` for each that could not be."""
        for r in self.spec["replicas"]:
            path = os.path.expanduser(r["log"])
            os.makedirs(os.path.dirname(path), exist_ok=True)
            fh = open(path, "ab")  # noqa: SIM115 - handed to the child, closed below
            start = fh.tell()
            fh.write(r.get("banner", "").encode())
            fh.flush()
            if run_as:
                os.chown(path, run_as["user"], run_as["group"])
            try:
                p = subprocess.Popen(
                    r["argv"],
                    cwd=cwd,
                    env=r["env"],
                    stdin=subprocess.DEVNULL,
                    stdout=fh,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    **run_as,
                )
            except OSError as e:
                fh.write(f"cannot start {r['argv'][0]}: {e}\n".encode())
                fh.close()
                self.pids[r["rank"]] = 0
                self.ended(r["rank"], NOT_STARTED_EXIT_CODE)
                continue
            fh.close()
            self.procs[p.pid] = (r["rank"], p)
            self.pids[r["rank"]] = p.pid
            self.logs[r["rank"]] = [path, start]
            self.lines.say("PID", r["rank"], p.pid)

    def pump(self, rank: int) -> None:
        """Send what ``rank``'s log gained since the last call (``LOG`` lines)."""
        with self._pump_lock:
            path, pos = self.logs[rank]
            try:
                with open(path, "rb") as f:
                    f.seek(pos)
                    data = f.read(LOG_CHUNK)
                    while data:
                        pos += len(data)
                        self.lines.say("LOG", rank, base64.b64encode(data).decode())
                        data = f.read(LOG_CHUNK)
            except OSError:
                pass
            self.logs[rank][1] = pos

    def tail(self) -> None:
        """Stream every log, for ever (a daemon thread)."""
        while True:
            for rank in list(self.logs):
                self.pump(rank)
            time.sleep(TAIL_INTERVAL_S)

    def signal_all(self, sig: int) -> None:
        """Send ``sig`` to the process group of every replica still running."""
        for _, p in list(self.procs.values()):
            if p.returncode is None:
                with contextlib.suppress(OSError):
                    os.killpg(p.pid, sig)

    def control(self, commands: IO[str]) -> None:
        """Obey ``TERM``/``KILL`` lines; at their end (stdin closed) stop the replicas:
        SIGTERM, up to ``orphan_grace_s`` for them to exit, then SIGKILL (a daemon thread)."""
        for line in commands:
            cmd = line.strip()
            if cmd == "TERM":
                self.signal_all(signal.SIGTERM)
            elif cmd == "KILL":
                self.signal_all(signal.SIGKILL)
        if any(p.returncode is None for _, p in self.procs.values()):
            self.orphaned = True
            self.record.write(self, "running")
        self.signal_all(signal.SIGTERM)
        deadline = time.time() + float(self.spec.get("orphan_grace_s", 10))
        while time.time() < deadline and any(p.returncode is None for _, p in self.procs.values()):
            time.sleep(0.2)
        self.signal_all(signal.SIGKILL)

    def reap(self, stream: bool) -> None:
        """Wait for every replica; ``EXIT <rank> <code>`` for each (after its last log bytes
        when streaming), code 128+n for a replica killed by signal n."""
        pending = dict(self.procs)
        while pending:
            try:
                pid, status = os.wait()
            except ChildProcessError:
                break
            if pid not in pending:
                continue
            rank, p = pending.pop(pid)
            p.returncode = exit_code(status)
            code = p.returncode if p.returncode >= 0 else 128 - p.returncode
            if stream:
                self.pump(rank)
            self.ended(rank, code)
        self.record.write(self, "ended")


def main() -> None:
    """Read the spec from stdin, check the node, start the replicas, supervise them."""
    spec = json.loads(sys.stdin.readline())
    lines = Lines(sys.stdout)
    cwd = working_dir(spec, lines)
    check_probe(spec, lines)
    run_as = identity(spec, lines)
    supervisor = Supervisor(spec, lines)
    supervisor.start(cwd, run_as)
    supervisor.record.write(supervisor, "running")
    stream = spec.get("stream_logs", True)
    threading.Thread(target=supervisor.control, args=(sys.stdin,), daemon=True).start()
    if stream:
        threading.Thread(target=supervisor.tail, daemon=True).start()
    supervisor.reap(stream)
    sys.exit(0)


if __name__ == "__main__":
    main()
