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

Warm resizes (``api/resize.py``; the local supervisor does the same on the daemon's machine).
With ``"resize": true`` in the spec the agent makes a directory of its own for the
incarnation's resize orders (``mkdtemp``, 0755, removed at the end) and gives every replica
``POLLUX_RESIZE_FILE`` = its ``order.json``: no path of the job's user is ever written.  A
stdin line ``RESIZE <json>`` (``{"generation", "ranks", "order", "hold", "joiners": [replica,
...], "ready_timeout_s", "job_dir"}``; ``ranks``: the running ranks that stay, in their new
order, or ``"kept"``: the lowest that many) starts the joining replicas like the first ones and
waits until each has created ``resize-ready-<generation>-<rank>`` in ``job_dir`` (only its
existence is looked at).  Then the order is given: ``order`` (the order's JSON as the daemon
encoded it; ``null`` on a node other than rank 0's, which reads it) is written to the order
file, atomically, and the running replicas that do not stay are noted as leaving.  When the
ranks that stay are renumbered (:func:`relabelling`), every line about a running replica uses
its new rank from the ``RESIZE`` on, a leaver's being ``-1 - rank`` (they stay renamed when
the resize fails: the daemon then restarts the job from a checkpoint).  With
``"hold": true`` (a job on several nodes) the agent says ``READY`` instead and gives the order
at a later ``ORDER <generation>`` line (the daemon orders rank 0's node last, once every node
is ready and the others have noted their leavers); ``ABORT <generation>`` calls it off.  A
spec with ``"join": {"generation", "ready_timeout_s", "job_dir"}`` starts a node's
replicas as joiners of a held resize (a group that grows onto this node).  More lines::

    RENAMED <generation>            the running replicas took their new ranks (a resize
                                    that renumbers them), before any joiner starts
    READY <generation>              every joiner here is ready (a held resize)
    ORDERED <generation>            the order is given (written, when it is this node's)
    WARMFAIL <generation> <message> it was not (a joiner failed or was late, the job stops,
                                    an ABORT); its joiners are killed
    LEFT <rank> <code>              a replica is no longer one of the job's: a joiner of a
                                    failed resize, or one noted as leaving that exited 0

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
import errno
import json
import os
import pwd
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Sequence
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
#: Seconds between two looks for the joiners' ready files during a warm resize.
READY_POLL_S = 0.1
#: The file a joining replica creates in its job directory once it is about to rendezvous
#: (``api.resize.ready_name``; tests/launch/test_node_agent.py holds them equal).
READY_NAME = "resize-ready-{generation}-{rank}"


def relabelling(labels: Iterable[int], ranks: Sequence[int]) -> dict[int, int]:
    """How a warm resize that keeps ``ranks`` (old ranks, in their new order) renames the
    running replicas known by ``labels``: none when the ranks that stay are the lowest ones
    (they keep their ranks); else a stayer takes its new rank and a leaver ``-1 - rank``, so
    that no two replicas share a rank while the leavers run on.  The daemon's side of an SSH
    group renames its records by the same rule."""
    if list(ranks) == list(range(len(ranks))):
        return {}
    new = {old: index for index, old in enumerate(ranks)}
    return {label: new.get(label, -1 - label) for label in labels}


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


def working_dir(spec: dict[str, Any], lines: Lines, as_user: bool = False) -> str:
    """The replicas' working directory: the job's, else (when the spec allows) the node's.
    Replicas run as another user (``as_user``) check it themselves, as that user, when they
    enter it (:func:`entering`): root's answer would tell the user whether a path exists
    where they cannot look."""
    cwd = str(spec["cwd"])
    if as_user:
        return cwd
    if not os.path.isdir(cwd):
        alt = os.path.expanduser(spec["node_workdir"])
        if spec.get("cwd_required", True) or not os.path.isdir(alt):
            lines.fail(f"working directory {cwd} does not exist on node {spec['node']}")
        cwd = alt
    return cwd


#: The exit code of a replica that could not enter its working directory
#: (``api.states.ExitCode.WORKDIR``, as this machine's supervisor's; tests/api/test_exit_codes.py).
WORKDIR_EXIT_CODE = 252


def entering(directory: str) -> Callable[[], None]:
    """What a replica run as another user does before it becomes its program, with that
    user's identity already taken (``Popen``'s ``preexec_fn`` runs after the privileges are
    dropped, while its ``cwd`` is entered before, as root, which would let a user work in a
    directory one of whose parents shuts them out, such as another user's 0700 home): enter
    the working directory, or say why not in the log and exit ``WORKDIR_EXIT_CODE``.  Only a
    system call and a write: safe in the child of a process with threads."""

    def enter() -> None:
        try:
            os.chdir(directory)
        except OSError as e:
            message = f"cannot enter working directory {directory}: {e.strerror}\n"
            os.write(2, message.encode())
            os._exit(WORKDIR_EXIT_CODE)

    return enter


#: The most of a probe file read (its token is 32 characters).
PROBE_BYTES = 256


def check_probe(spec: dict[str, Any], lines: Lines) -> None:
    """Fail unless the daemon's probe file (written into the checkpoint dir) is visible here
    with its token: the checkpoint dir must be shared by every node of the job."""
    probe = spec.get("probe")
    if not probe:
        return
    seen: str | None = None
    try:  # a file in the job's own directory: no link, no FIFO to wait on, no more than a token
        fd = os.open(probe["path"], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            if stat.S_ISREG(os.fstat(fd).st_mode):
                seen = os.read(fd, PROBE_BYTES).decode(errors="replace").strip()
        finally:
            os.close(fd)
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


def start_time(pid: int) -> int | None:
    """Process ``pid``'s start time in clock ticks since boot (``None``: no such process):
    with its pid, what tells the process apart from a later one given the same pid."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            data = fh.read()
        return int(data[data.rindex(b")") + 2 :].split()[19])
    except (OSError, ValueError, IndexError):
        return None


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
        self.node = str(spec.get("node", ""))
        self._lock = threading.Lock()

    def write(self, supervisor: Supervisor, state: str) -> None:
        """Replace the record with ``supervisor``'s replicas as they are now (best effort:
        a node that cannot keep it only loses what a restarted daemon could learn)."""
        if self.path is None:
            return
        replicas = [
            {
                "rank": rank,
                "pid": pid,
                "start_time": supervisor.start_times.get(pid),
                "exit_code": supervisor.codes.get(rank),
            }
            for rank, pid in sorted(supervisor.pids.items())
        ]
        data = {
            "version": 1,
            "token": self.token,
            "node": self.node,
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
        #: guards the replicas' tables: the reaper, the control thread and a resize's watcher
        self.lock = threading.RLock()
        self.record = ExitRecord(spec)
        self.pids: dict[int, int] = {}  # rank -> pid (0: could not be started)
        self.start_times: dict[int, int | None] = {}  # pid -> its start time
        self.codes: dict[int, int] = {}  # rank -> exit code
        self.exits: list[int] = []  # ranks in the order they ended
        #: replicas were stopped by the agent itself because its stdin closed
        self.orphaned = False
        self.cwd = "."
        self.run_as: dict[str, Any] = {}
        #: every replica has ended: nothing more is started
        self.finished = False
        #: a TERM or KILL came: no resize is started any more
        self.stopping = False
        #: the directory of the warm resize orders (``"resize"`` in the spec), and the file
        self.order_dir: str | None = None
        self.order_path: str | None = None
        #: the newest warm resize: ``{"generation", "world_size", "state"}``, state one of
        #: ``joining``, ``ordered``, ``failed``
        self.warm: dict[str, Any] | None = None
        self.joining: dict[int, int] = {}  # pid -> rank of the joiners not yet ordered in
        self.left: set[int] = set()  # pids of replicas that are no longer the job's
        #: pids of the replicas that leave at the order given last (an exit 0 is ``LEFT``)
        self.leaving: set[int] = set()

    def ended(self, rank: int, code: int) -> None:
        """``rank`` ended with ``code``: recorded, then ``EXIT`` said."""
        self.codes[rank] = code
        self.exits.append(rank)
        self.record.write(self, "running")
        self.lines.say("EXIT", rank, code)

    def gone(self, rank: int, code: int) -> None:
        """``rank`` is no longer one of the job's replicas (``LEFT``): forgotten."""
        self.pids.pop(rank, None)
        self.codes.pop(rank, None)
        self.exits = [r for r in self.exits if r != rank]
        self.record.write(self, "running")
        self.lines.say("LEFT", rank, code)

    def start(self, cwd: str, run_as: dict[str, Any]) -> None:
        """Start every replica, each appending to its log (after its banner); ``PID`` for each
        started, ``EXIT <rank> 127`` for each that could not be.  With ``"resize"`` in the
        spec, first the directory of the incarnation's resize orders."""
        self.cwd, self.run_as = cwd, run_as
        if self.spec.get("resize"):
            try:
                self.order_dir = tempfile.mkdtemp(prefix="pollux-resize-")
                os.chmod(self.order_dir, 0o755)
                self.order_path = os.path.join(self.order_dir, "order.json")
            except OSError:
                self.order_dir = self.order_path = None  # resized by restarts only
        join = self.spec.get("join")
        if join:
            self.start_joining(join)
            return
        with self.lock:
            for r in self.spec["replicas"]:
                if self.spawn(r) is None:
                    self.pids[r["rank"]] = 0
                    self.ended(r["rank"], NOT_STARTED_EXIT_CODE)

    def start_joining(self, join: dict[str, Any]) -> None:
        """This node's replicas join a running group (``"join"`` in the spec: a ``RESIZE``'s
        fields, held): started as joiners, ``READY`` once all are, then ``ORDER``."""
        generation = int(join["generation"])
        with self.lock:
            if self.order_path is None:
                self.lines.say("WARMFAIL", generation, "no directory for resize orders")
                return
            self.begin_resize(generation, len(self.spec["replicas"]), None, True)
            for r in self.spec["replicas"]:
                pid = self.spawn(r)
                if pid is None:
                    self.warm_failed(f"rank {r['rank']}: cannot start {r['argv'][0]}")
                    return
                self.joining[pid] = int(r["rank"])
        self.watch(generation, str(join["job_dir"]), float(join["ready_timeout_s"]))

    def spawn(self, r: dict[str, Any]) -> int | None:
        """Start replica ``r`` (under :attr:`lock`): its pid and ``PID`` said, or ``None``
        (the reason in its log) when it could not be started."""
        path = os.path.expanduser(r["log"])
        try:
            fh = self.open_log(path)
        except OSError as e:
            why = f"cannot open its log {path} on node {self.spec.get('node')}: {e}\n"
            self.lines.say("LOG", r["rank"], base64.b64encode(why.encode()).decode())
            return None
        start = fh.tell()
        fh.write(r.get("banner", "").encode())
        fh.flush()
        env = dict(r["env"])
        env.pop("POLLUX_RESIZE_FILE", None)
        if self.order_path is not None:
            env["POLLUX_RESIZE_FILE"] = self.order_path
        # run as another user, it enters its working directory as that user, not as root
        as_user = bool(self.run_as)
        try:
            p = subprocess.Popen(
                r["argv"],
                cwd="/" if as_user else self.cwd,
                preexec_fn=entering(self.cwd) if as_user else None,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=fh,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                **self.run_as,
            )
        except OSError as e:
            fh.write(f"cannot start {r['argv'][0]}: {e}\n".encode())
            fh.close()
            return None
        fh.close()
        self.procs[p.pid] = (r["rank"], p)
        self.pids[r["rank"]] = p.pid
        self.start_times[p.pid] = start_time(p.pid)
        self.logs[r["rank"]] = [path, start]
        self.lines.say("PID", r["rank"], p.pid)
        return p.pid

    def open_log(self, path: str) -> IO[bytes]:
        """A replica's log, opened to append as safely as a root agent must: a plain file,
        never through a link, in a directory (made when missing) and a parent that, when the
        replicas run as another user, are no links and this agent's user's alone (no one
        else may write there), the file handed to the replica's user by its descriptor.
        Every replica has a file of its own (``rank<N>.start<I>...log``), so a user who could
        write there could plant one in advance."""
        directory = os.path.dirname(path)
        os.makedirs(directory, exist_ok=True)
        if self.run_as:
            for each in (os.path.dirname(directory), directory):
                info = os.lstat(each)
                foreign = (
                    info.st_uid != os.geteuid()
                    or info.st_mode & 0o002
                    or (info.st_mode & 0o020 and info.st_gid != os.getegid())
                )
                if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode) or foreign:
                    raise OSError(
                        errno.EPERM, f"{each} is not a directory of the agent's user alone"
                    )
        # (O_NONBLOCK: a FIFO there fails at once instead of waiting for a reader; a plain
        # file ignores it)
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK
        fd = os.open(path, flags | os.O_CLOEXEC, 0o644)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise OSError(errno.EINVAL, f"{path} is not a plain file")
            if self.run_as:
                os.fchown(fd, self.run_as["user"], self.run_as["group"])
            os.lseek(fd, 0, os.SEEK_END)
            return os.fdopen(fd, "ab")
        except BaseException:
            os.close(fd)
            raise

    def pump(self, rank: int) -> None:
        """Send what ``rank``'s log gained since the last call (``LOG`` lines)."""
        with self._pump_lock:
            if rank not in self.logs:
                return  # renamed meanwhile (a warm resize): sent under its new rank
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

    def live(self) -> list[subprocess.Popen[bytes]]:
        return [p for _, p in list(self.procs.values()) if p.returncode is None]

    def signal_all(self, sig: int) -> None:
        """Send ``sig`` to the process group of every replica still running."""
        for p in self.live():
            with contextlib.suppress(OSError):
                os.killpg(p.pid, sig)

    def control(self, commands: IO[str]) -> None:
        """Obey ``TERM``/``KILL``/``RESIZE`` lines; at their end (stdin closed) stop the
        replicas: SIGTERM, up to ``orphan_grace_s`` for them to exit, then SIGKILL (a daemon
        thread)."""
        for line in commands:
            cmd, _, rest = line.strip().partition(" ")
            if cmd in ("TERM", "KILL"):
                self.stopping = True
                self.warm_failed("the job is stopping")
                self.signal_all(signal.SIGTERM if cmd == "TERM" else signal.SIGKILL)
            elif cmd == "RESIZE":
                self.take_resize(rest)
            elif cmd in ("ORDER", "ABORT"):
                self.order_line(cmd, rest)
        self.stopping = True
        self.warm_failed("the daemon is gone")
        if self.live():
            self.orphaned = True
            self.record.write(self, "running")
        self.signal_all(signal.SIGTERM)
        deadline = time.time() + float(self.spec.get("orphan_grace_s", 10))
        while time.time() < deadline and self.live():
            time.sleep(0.2)
        self.signal_all(signal.SIGKILL)

    # --- warm resizes ---------------------------------------------------------------------

    def take_resize(self, text: str) -> None:
        """Start the warm resize of a ``RESIZE`` line: its joiners started, then watched by a
        thread of their own until the order is given or the resize fails."""
        try:
            request = json.loads(text)
            generation = int(request["generation"])
            if request.get("ranks") is not None:
                ranks = [int(rank) for rank in request["ranks"]]
            else:
                ranks = list(range(int(request["kept"])))
            order = request.get("order")
            joiners = list(request.get("joiners") or ())
            timeout_s = float(request.get("ready_timeout_s") or 60.0)
            job_dir = str(request["job_dir"])
            hold = bool(request.get("hold", False))
            if order is not None and not isinstance(order, str):
                raise TypeError("order")
        except (KeyError, TypeError, ValueError):
            self.lines.say("WARMFAIL", 0, "a malformed resize request")
            return
        with self.lock:
            why = None
            if self.order_path is None:
                why = "the replicas were not started to take resize orders"
            elif self.finished or self.stopping:
                why = "the job is stopping"
            elif self.warm is not None and generation <= int(self.warm["generation"]):
                why = "not newer than the last resize"
            if why is not None:
                self.lines.say("WARMFAIL", generation, why)
                return
            self.warm_failed("a newer resize came")
            self.begin_resize(generation, len(ranks), order, hold)
            mapping = relabelling([rank for rank, _ in self.procs.values()], ranks)
            self.relabel(mapping)
            if mapping:
                self.lines.say("RENAMED", generation)
            for r in joiners:
                pid = self.spawn(r)
                if pid is None:
                    self.warm_failed(f"rank {r['rank']}: cannot start {r['argv'][0]}")
                    return
                self.joining[pid] = int(r["rank"])
        self.watch(generation, job_dir, timeout_s)

    def begin_resize(self, generation: int, kept: int, order: str | None, hold: bool) -> None:
        """A warm resize of ``generation`` is under way (under :attr:`lock`): ``kept``
        replicas stay (ranks below ``kept`` once renamed); ``order`` is written here
        (``None``: not on this node; rank 0 reads it elsewhere); with ``hold``, only once an
        ``ORDER`` line says so."""
        self.warm = {
            "generation": generation,
            "kept": kept,
            "order": order,
            "hold": hold,
            "state": "joining",
        }

    def relabel(self, mapping: dict[int, int]) -> None:
        """Rename the replicas' ranks (``old -> new``) in every table (under :attr:`lock`)."""
        if not mapping:
            return
        self.procs = {pid: (mapping.get(r, r), p) for pid, (r, p) in self.procs.items()}
        self.pids = {mapping.get(r, r): pid for r, pid in self.pids.items()}
        self.codes = {mapping.get(r, r): code for r, code in self.codes.items()}
        self.exits = [mapping.get(r, r) for r in self.exits]
        with self._pump_lock:
            self.logs = {mapping.get(r, r): log for r, log in self.logs.items()}

    def watch(self, generation: int, job_dir: str, timeout_s: float) -> None:
        """Watch the joiners of ``generation`` in a thread of their own."""
        deadline = time.monotonic() + max(0.0, timeout_s)
        args = (generation, job_dir, deadline)
        threading.Thread(target=self.watch_joiners, args=args, daemon=True).start()

    def watch_joiners(self, generation: int, job_dir: str, deadline: float) -> None:
        """Once every joiner of ``generation`` is ready: the order given, or ``READY`` said
        when it is held; give up at ``deadline`` (a thread)."""
        while True:
            with self.lock:
                warm = self.warm
                if warm is None or warm["generation"] != generation or warm["state"] != "joining":
                    return
                ranks = list(self.joining.values())
                ready = all(
                    os.path.lexists(
                        os.path.join(job_dir, READY_NAME.format(generation=generation, rank=rank))
                    )
                    for rank in ranks
                )
                if ready:
                    if warm["hold"]:
                        warm["state"] = "ready"
                        self.lines.say("READY", generation)
                    else:
                        self.give_order()
                    return
                if time.monotonic() > deadline:
                    self.warm_failed("the joining replicas were not ready in time")
                    return
            time.sleep(READY_POLL_S)

    def order_line(self, command: str, rest: str) -> None:
        """``ORDER <generation>``: give the held order; ``ABORT <generation>``: call the
        resize off (its joiners killed)."""
        try:
            generation = int(rest)
        except ValueError:
            return
        with self.lock:
            warm = self.warm
            if warm is None or warm["generation"] != generation:
                return
            if command == "ABORT" and warm["state"] == "ordered" and warm["order"] is None:
                # given here but not on rank 0's node: nobody leaves after all
                self.leaving.clear()
                warm["state"] = "failed"
                self.lines.say("WARMFAIL", generation, "the resize was called off")
            elif command == "ABORT":
                self.warm_failed("the resize was called off")
            elif warm["state"] == "ready":
                self.give_order()

    def give_order(self) -> None:
        """Write the order when it is this node's (a temporary file in the agent's own
        directory, then a rename); the replicas that leave at it noted; then ``ORDERED``.
        Under :attr:`lock`."""
        warm = self.warm
        assert warm is not None
        if warm["order"] is not None:
            assert self.order_dir is not None and self.order_path is not None
            tmp = os.path.join(self.order_dir, ".order.tmp")
            try:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
                try:
                    os.fchmod(fd, 0o644)
                    os.write(fd, warm["order"].encode())
                finally:
                    os.close(fd)
                os.replace(tmp, self.order_path)
            except OSError as exc:
                self.warm_failed(f"cannot write the resize order: {exc.strerror}")
                return
        self.leaving = {
            pid
            for pid, (rank, p) in self.procs.items()
            if p.returncode is None
            and pid not in self.joining
            and not 0 <= rank < int(warm["kept"])
        }
        self.joining.clear()
        warm["state"] = "ordered"
        self.lines.say("ORDERED", warm["generation"])

    def warm_failed(self, why: str) -> None:
        """The warm resize under way failed before its order: ``WARMFAIL``, and its joiners
        are killed (each ``LEFT`` once reaped; the running replicas never saw an order)."""
        with self.lock:
            warm = self.warm
            if warm is None or warm["state"] not in ("joining", "ready"):
                return
            for pid in self.joining:
                self.left.add(pid)
                with contextlib.suppress(OSError):
                    os.killpg(pid, signal.SIGKILL)
            self.joining.clear()
            warm["state"] = "failed"
            self.lines.say("WARMFAIL", warm["generation"], why.replace("\n", " "))

    # --- ends -----------------------------------------------------------------------------

    def reap(self, stream: bool) -> None:
        """Wait for every replica, joiners included; ``EXIT <rank> <code>`` for each (after
        its last log bytes when streaming), code 128+n for a replica killed by signal n;
        ``LEFT`` instead for one that is no longer the job's."""
        while True:
            with self.lock:
                if not self.live():
                    self.finished = True
                    break
            try:
                pid, status = os.wait()
            except ChildProcessError:
                time.sleep(READY_POLL_S)
                continue
            except InterruptedError:
                continue
            with self.lock:
                entry = self.procs.get(pid)
                if entry is None or entry[1].returncode is not None:
                    continue
                rank, p = entry
                p.returncode = exit_code(status)
                code = p.returncode if p.returncode >= 0 else 128 - p.returncode
                if stream:
                    self.pump(rank)
                if pid in self.joining:  # a joiner that never joined: the resize failed
                    del self.joining[pid]
                    self.left.add(pid)
                    self.warm_failed(f"joining rank {rank} exited with {code} first")
                if pid in self.left or (code == 0 and pid in self.leaving):
                    self.gone(rank, code)  # a joiner of a failed resize, or it left at one
                else:
                    self.ended(rank, code)
        self.record.write(self, "ended")
        if self.order_dir is not None:
            shutil.rmtree(self.order_dir, ignore_errors=True)


def main() -> None:
    """Read the spec from stdin, check the node, start the replicas, supervise them."""
    spec = json.loads(sys.stdin.readline())
    lines = Lines(sys.stdout)
    run_as = identity(spec, lines)
    cwd = working_dir(spec, lines, as_user=bool(run_as))
    check_probe(spec, lines)
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
