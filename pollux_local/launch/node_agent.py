"""The node-side supervisor of the SSH launcher: starts one job's replicas on its node.

``launch/ssh.py`` does not need pollux-local on the node: it sends this file's source text over
ssh and runs it there as ``python3 -u -c <source>``.  So this module uses the standard library
only and runs on Python 3.8 (annotations stay unevaluated strings; no newer library calls
without a fallback).  Importing it does nothing; :func:`main` runs the supervisor.

Protocol.  The first line of stdin is the launch spec, one JSON object::

    {"node", "cwd", "node_workdir", "cwd_required", "user", "orphan_grace_s",
     "stream_logs", "probe": {"path", "token", "dir"},
     "replicas": [{"rank", "argv", "env", "log", "banner", "umask"}, ...]}

(so that environments never appear in the node's process list; ``umask``, optional, 0..0o777:
the replica's umask, else the agent's).  Each replica runs in its own session and process
group with exactly the environment given, its output appended to its log file.  A replica is
started through a small launcher of its own (:data:`REPLICA_SOURCE`, run as this agent's
user with no environment and ``-I -S``) that takes the job user's groups, gid and effective
uid, enters the working directory as that user, and only right before ``exec`` gives up root
as its real and saved uid: until then no signal of the user's reaches it, and the agent waits
for each start :data:`SPAWN_TIMEOUT_S` at most, holding no lock.  The control thread (stdin)
runs before anything is started.

The work directory (``node_workdir``, where the logs and the exit records lie) is refused,
in one ``FAIL`` line, unless every component of its path, and of the path it resolves to, is
root's or this agent's user's and not writable by anyone else (a sticky root directory such
as ``/tmp`` is fine above it; the work directory itself is writable by its owner only); it
is made, 0755, when missing.  Each log is read back from the descriptor opened at the start,
never again by its path.  Lines on stdout, one per event::

    PID <rank> <pid>        replica started
    LOG <rank> <base64>     new bytes of the replica's log
    EXIT <rank> <code>      replica ended (128+signal when killed by a signal)
    FAIL <message>          nothing was started; the process exits with 254
    NODEFAIL <message>      the same, for a fault of the node's (its work directory, a disk
                            that cannot keep the exit record)
    NOTE <message>          something the node's admin should know (no fence can be made)

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
each exit (``"exited"`` from the last one on: every replica has ended, before the clean-up
of what they left) and once that is cleaned up (``"ended"``), so that a daemon that restarts
reads what became of them (``ssh.SshRecordedGroup``) instead of running a finished job
again; an ``"exited"`` record whose agent is gone (it died during its clean-up) is the
result all the same, once the daemon has ended what is left (``launch.base.settles``)::

    {"version": 1, "token", "state": "running" | "exited" | "ended", "agent_pid", "agent_start",
     "orphaned", "replicas": [{"rank", "pid", "exit_code"}, ...], "exits": [rank, ...],
     "ended"}

``orphaned`` says that the agent stopped replicas itself because its stdin closed (the
daemon was gone); ``exits`` lists the ranks in the order they ended.  Once stdout is gone the
agent goes on without it: the record is what a restarted daemon reads.  Lines are written by a
thread of their own, so that a daemon that stops reading blocks no lock: ``LOG`` lines wait
(the logs are read no further) while :data:`MAX_BACKLOG_BYTES` are unsent; every line is
shorter than :data:`MAX_LINE_BYTES` (a ``LOG`` line carries :data:`LOG_CHUNK` bytes at most).

Run with arguments, the same source is the daemon's tool for the exit records
(:func:`tool`): ``record cat|rm WORKDIR RELPATH`` prints or removes one (at most
:data:`MAX_RECORD_BYTES`), ``signal SIG WORKDIR USER PID:START...`` signals the process
groups a recovered record names (``0``: prints those still running); both refuse a work
directory as the agent does.
"""

from __future__ import annotations

import base64
import contextlib
import ctypes
import errno
import json
import os
import pwd
import queue
import select
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
#: The exit record's state once every replica has ended, before the clean-up (``base.EXITED``).
EXITED = "exited"
#: Largest piece of a log sent in one ``LOG`` line (bytes, before base64: the line stays
#: below 48 KiB, far below what the daemon reads, ``ssh.group.MAX_LINE_BYTES``).
LOG_CHUNK = 1 << 15
#: Bytes of one replica's log sent at most when the daemon names no limit (its
#: ``[limits] max_log_size`` by default): the daemon keeps no more, and the log is the job's
#: file to make as large (or as sparse) as it likes.
DEFAULT_MAX_LOG_BYTES = 100 * 1024 * 1024
#: Longest protocol line written (a longer one, never a ``LOG`` line, is cut).
MAX_LINE_BYTES = 1 << 16
#: Bytes of lines not yet written past which the logs are not read further (the daemon
#: stopped reading; the logs' bytes wait on the node).
MAX_BACKLOG_BYTES = 1 << 22
#: Seconds the last lines get once the replicas ended (while the daemon reads; after its
#: stdin closed, :data:`DRAIN_AFTER_EOF_S` at most).
FINAL_DRAIN_S = 300.0
DRAIN_AFTER_EOF_S = 5.0
#: Seconds an ended replica's last log bytes wait for a daemon that takes no line at all.
FINAL_STALL_S = 30.0
#: The longest a replica's launcher may take to reach the point where it becomes the user
#: for good (it is killed then); and how long after that its ``exec`` is waited for (then
#: it is taken as started: from there on it is the user's, who may stop it).
SPAWN_TIMEOUT_S = 30.0
SETTLED_WAIT_S = 1.0
#: Largest exit record read back (``tool record cat``).
MAX_RECORD_BYTES = 1 << 20
#: Seconds between two looks at the replicas' logs.
TAIL_INTERVAL_S = 0.25
#: Seconds between two looks for the joiners' ready files during a warm resize.
READY_POLL_S = 0.1
#: The launcher of one replica, run as ``python -I -S -c REPLICA_SOURCE SPEC_FD REPORT_FD``
#: by this agent's user, in a session of its own, its stdout and stderr the replica's log:
#: it reads the replica (``{"argv", "env", "cwd", "user", "umask", "oom_score_adj",
#: "keyctl"}``, JSON) from SPEC_FD, takes back the ``oom_score_adj`` the agent had before it
#: protected itself (:func:`protect_from_oom`; else exit 127: no replica runs unkillable), takes
#: the user's groups, gid and effective uid (root stays its real and saved uid: the user's
#: signals do not reach it), enters ``cwd`` as the user (else exit 252), applies ``umask``,
#: writes ``S`` to REPORT_FD (closed at ``exec``), becomes the user for good, joins a new
#: session keyring of the user's (``keyctl``: the system call's number here; the agent's
#: keyring is shared with other users' jobs) and runs the command (else ``E`` to REPORT_FD,
#: exit 127).  No environment of the job's reaches the interpreter (``-I``; the environment
#: is the command's only).
REPLICA_SOURCE = r"""
import json, os, signal, sys
def fail(code, message):
    try:
        os.write(2, (message + "\n").encode("utf-8", "replace"))
    finally:
        os._exit(code)
def main():
    spec_fd, report = int(sys.argv[1]), int(sys.argv[2])
    os.set_inheritable(report, False)
    for name in ("SIGPIPE", "SIGXFSZ"):
        if hasattr(signal, name):
            signal.signal(getattr(signal, name), signal.SIG_DFL)
    try:
        with os.fdopen(spec_fd, "rb") as fh:
            spec = json.loads(fh.read().decode("utf-8", "surrogateescape"))
        argv, env, cwd = list(spec["argv"]), dict(spec["env"]), spec["cwd"]
        user, mask = spec.get("user"), spec.get("umask")
        oom = spec.get("oom_score_adj")
    except Exception as e:
        fail(127, "cannot start: no launch order (%r)" % (e,))
    if oom is not None:
        try:
            with open("/proc/self/oom_score_adj", "w") as fh:
                fh.write(str(int(oom)))
        except (OSError, ValueError) as e:
            fail(127, "cannot take back the OOM score of the node: %s" % (e,))
    if user:
        uid, gid = int(user["uid"]), int(user["gid"])
        keyctl = spec.get("keyctl")
        if keyctl is not None:  # loaded while root may still read the interpreter's files
            import ctypes, errno
            libc = ctypes.CDLL(None, use_errno=True)
        try:
            os.setgroups([int(g) for g in user.get("groups") or [gid]])
            os.setresgid(gid, gid, gid)
            os.setresuid(0, uid, 0)
        except OSError as e:
            fail(127, "cannot become uid %d: %s" % (uid, e.strerror))
    try:
        os.chdir(cwd)
    except OSError as e:
        fail(252, "cannot enter working directory %s: %s" % (cwd, e.strerror))
    if mask is not None:
        os.umask(int(mask))
    os.write(report, b"S")
    if user:
        try:
            os.setresgid(gid, gid, gid)
            os.setresuid(uid, uid, uid)
        except OSError as e:
            fail(127, "cannot settle as uid %d: %s" % (uid, e.strerror))
        if os.getresuid() != (uid, uid, uid) or os.getresgid() != (gid, gid, gid):
            fail(127, "cannot settle as uid %d" % uid)
        if keyctl is not None:  # a new session keyring, the user's (identity.py)
            if libc.syscall(ctypes.c_long(int(keyctl)), ctypes.c_long(1),
                            ctypes.c_void_p(None)) == -1:
                e = ctypes.get_errno()
                if e not in (errno.ENOSYS, errno.EPERM):
                    fail(127, "cannot leave the agent's session keyring: %s" % os.strerror(e))
    try:
        os.execvpe(argv[0], argv, env)
    except (OSError, ValueError, IndexError) as e:
        try:
            os.write(report, b"E")
        finally:
            what = getattr(e, "strerror", None) or e
            fail(127, "cannot execute %s: %s" % (argv[0] if argv else "", what))
main()
"""
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
    """Protocol lines on ``stream``, whole, whichever thread says them, written in order by a
    thread of their own (:meth:`say` never blocks: a daemon that stops reading holds up no
    lock of the agent's); a stream that is gone (the daemon died) is given up, silently."""

    def __init__(self, stream: IO[str]) -> None:
        self._stream = stream
        try:
            self._fd: int | None = stream.fileno()
        except (AttributeError, OSError, ValueError):
            self._fd = None  # a stream without a descriptor (tests): written as text
        self._cond = threading.Condition()
        self._queue: list[bytes] = []
        self._queued = 0  # bytes said and not yet written
        self._writer: threading.Thread | None = None
        self.gone = False
        #: bytes written so far
        self.written = 0

    def say(self, *parts: object) -> None:
        """Queue ``parts`` joined by spaces as one line (cut at :data:`MAX_LINE_BYTES`)."""
        data = " ".join(str(p) for p in parts).replace("\n", " ").encode(errors="replace")
        data = data[: MAX_LINE_BYTES - 1] + b"\n"
        with self._cond:
            if self.gone:
                return
            self._queue.append(data)
            self._queued += len(data)
            if self._writer is None:
                self._writer = threading.Thread(target=self._write_all, daemon=True)
                self._writer.start()
            self._cond.notify_all()

    def room(self) -> bool:
        """Whether more log lines may be said now (the backlog is small, or nobody reads)."""
        with self._cond:
            return self.gone or self._queued < MAX_BACKLOG_BYTES

    def wait_room(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for :meth:`room`."""
        with self._cond:
            return self._cond.wait_for(
                lambda: self.gone or self._queued < MAX_BACKLOG_BYTES, timeout_s
            )

    def drain(self, timeout_s: float | None, give_up: Callable[[], bool] = lambda: False) -> bool:
        """Wait until every line said is written (``True``), or ``timeout_s`` passed, or
        ``give_up()`` says so (looked at every 0.1 s)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            while self._queued and not self.gone:
                if give_up() or (deadline is not None and time.monotonic() > deadline):
                    return False
                self._cond.wait(0.1)
            return True

    def _write_all(self) -> None:
        """The writer thread: every queued line, in order, until the stream is gone."""
        while True:
            with self._cond:
                while not self._queue:
                    self._cond.wait()
                data = b"".join(self._queue)
                self._queue.clear()
            try:
                if self._fd is not None:
                    view = memoryview(data)
                    while view:
                        view = view[os.write(self._fd, view) :]
                else:
                    self._stream.write(data.decode(errors="replace"))
                    self._stream.flush()
            except (OSError, ValueError):
                with self._cond:
                    self.gone = True
                    self._queue.clear()
                    self._queued = 0
                    self._cond.notify_all()
                return
            with self._cond:
                self._queued -= len(data)
                self.written += len(data)
                self._cond.notify_all()

    def fail(self, message: str, node: bool = False) -> NoReturn:
        """Report that nothing was started (``FAIL``; ``NODEFAIL`` when the node is at fault,
        not the job: no job can start here until an admin acts) and exit with 254."""
        self.say("NODEFAIL" if node else "FAIL", message.replace("\n", " "))
        self.drain(30.0)
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
    """The ids the replicas run with, as the spec's ``user`` (``{"uid", "gid", "groups"}``;
    empty: as this login).  A ``user_uid`` given (the user's uid on the daemon's machine)
    must be the name's uid here too: where the name is another account's, the replicas are
    not run as that account (``FAIL``; review s62)."""
    user = spec.get("user")
    if not user:
        return {}
    try:
        pw = pwd.getpwnam(user)
    except KeyError:
        lines.fail(f"user {user} does not exist on node {spec['node']}")
    wanted = spec.get("user_uid")
    if wanted is not None and int(wanted) != pw.pw_uid:
        lines.fail(
            f"user {user} is uid {pw.pw_uid} on node {spec['node']}, not uid {int(wanted)} as"
            " on the daemon's machine: not run as another account"
        )
    if os.getuid() == pw.pw_uid:
        return {}
    if os.getuid() != 0:
        lines.fail(f"cannot run as {user} on node {spec['node']}: the ssh login there is not root")
    return {"uid": pw.pw_uid, "gid": pw.pw_gid, "groups": os.getgrouplist(user, pw.pw_gid)}


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


def trusted_owner(uid: int) -> bool:
    """Whether files of ``uid`` are as trusted as this agent's own: root's or its user's."""
    return uid in (0, os.geteuid())


def component_problem(path: str, info: os.stat_result, last: bool) -> str | None:
    """Why ``path`` (``info``: its ``lstat``) cannot be a component of a work directory's path
    (``last``: the work directory itself), or ``None``: a link must be root's or this
    agent's user's; a directory too, and writable by no one else, but for a sticky root
    directory above the work directory (such as ``/tmp``)."""
    if stat.S_ISLNK(info.st_mode):
        return None if trusted_owner(info.st_uid) else f"{path} is a link of uid {info.st_uid}"
    if not stat.S_ISDIR(info.st_mode):
        return f"{path} is not a directory"
    if not trusted_owner(info.st_uid):
        return f"{path} belongs to uid {info.st_uid}"
    if last:
        if info.st_mode & 0o022:
            return f"{path} may be written by others (mode {stat.S_IMODE(info.st_mode):o})"
        return None
    others = info.st_mode & 0o002 or (info.st_mode & 0o020 and info.st_gid != 0)
    if others and not (info.st_mode & stat.S_ISVTX and info.st_uid == 0):
        return f"{path} may be written by others (mode {stat.S_IMODE(info.st_mode):o})"
    return None


def prefixes(path: str) -> list[str]:
    """``/``, then every longer prefix of the absolute ``path``, ``path`` last."""
    parts = [part for part in path.split("/") if part]
    return ["/"] + ["/" + "/".join(parts[: i + 1]) for i in range(len(parts))]


def workdir_problem(path: str, make: bool = False) -> str | None:
    """Why the work directory ``path`` (absolute, normalized) is not this agent's to trust,
    or ``None``: each component of ``path``, then of the path it resolves to, checked by
    :func:`component_problem`.  With ``make``, missing components are made (0755), but only
    in a directory no one else may write to: in one such as ``/tmp`` anyone could make the
    name first (their directory, or a link) and so refuse every job the node's agent starts,
    so there the admin makes it."""
    if not os.path.isabs(path) or os.path.normpath(path) != path:
        return f"{path} is not an absolute, normalized path"
    try:
        steps = prefixes(path)
        for index, each in enumerate(steps):
            try:
                info = os.lstat(each)
            except FileNotFoundError:
                if not make:
                    return f"{each} does not exist"
                above = os.lstat(os.path.dirname(each))
                if above.st_mode & 0o022:
                    return (
                        f"{each} does not exist, and {os.path.dirname(each)} may be written by "
                        f"others (mode {stat.S_IMODE(above.st_mode):o}): make {path} first, as "
                        "root, mode 0755"
                    )
                with contextlib.suppress(FileExistsError):
                    os.mkdir(each, 0o755)
                    os.chmod(each, 0o755)  # whatever the umask
                info = os.lstat(each)
            problem = component_problem(each, info, index == len(steps) - 1)
            if problem is not None:
                return problem
        real = os.path.realpath(path)
        steps = prefixes(real)
        for index, each in enumerate(steps):
            problem = component_problem(each, os.lstat(each), index == len(steps) - 1)
            if problem is not None:
                return problem + (f" (resolving {path})" if real != path else "")
    except OSError as exc:
        return f"cannot look at {exc.filename or path}: {exc.strerror}"
    return None


def node_workdir(spec: dict[str, Any]) -> str:
    """The node's work directory of ``spec`` (``~`` expanded), absolute and normalized."""
    return os.path.normpath(os.path.expanduser(str(spec.get("node_workdir") or "~/.pollux-local")))


def check_workdir(spec: dict[str, Any], lines: Lines) -> str:
    """The node's work directory, made when missing; ``FAIL`` when it is not this agent's
    alone (:func:`workdir_problem`)."""
    path = node_workdir(spec)
    problem = workdir_problem(path, make=True)
    if problem is not None:
        lines.fail(workdir_refusal(path, problem), node=True)
    return path


def workdir_refusal(path: str, problem: str) -> str:
    """The one line that refuses the work directory ``path`` for ``problem``."""
    return (
        f"refusing the work directory {path}: {problem} (it and every directory above it must "
        "be root's, or the ssh login's, and writable by no one else; a sticky directory such "
        "as /tmp may be above it)"
    )


def relative_under(path: str, workdir: str) -> list[str] | None:
    """The components of ``path`` below ``workdir`` (``None``: not below it, or ``..``)."""
    path = os.path.normpath(os.path.expanduser(path))
    if not path.startswith(workdir.rstrip("/") + "/"):
        return None
    parts = path[len(workdir.rstrip("/")) + 1 :].split("/")
    if any(part in ("", ".", "..") for part in parts):
        return None
    return parts


def open_own_dirs(workdir: str, names: Sequence[str], make: bool) -> int:
    """A descriptor of ``workdir/names...``, each of ``names`` opened from the one above it,
    never through a link, made 0700 when missing (with ``make``), and refused unless it is a
    directory of this agent's user writable by no one else."""
    fd = os.open(workdir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for name in names:
            if make:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(name, 0o700, dir_fd=fd)
            flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
            below = os.open(name, flags, dir_fd=fd)
            os.close(fd)
            fd = below
            info = os.fstat(fd)
            if info.st_uid != os.geteuid() or info.st_mode & 0o022:
                raise OSError(errno.EPERM, f"{name} is not a directory of the agent's user alone")
        return fd
    except BaseException:
        os.close(fd)
        raise


class ExitRecord:
    """The exit record a restarted daemon reads (``spec["record"]``; none without it).  It is
    kept only below the node's work directory (checked by :func:`check_workdir`), each
    directory on the way opened from the one above it, never through a link."""

    def __init__(self, spec: dict[str, Any]) -> None:
        record = spec.get("record") or {}
        self.workdir = node_workdir(spec)
        self.names = (
            relative_under(str(record["path"]), self.workdir) if record.get("path") else None
        )
        self.token = str(record.get("token", ""))
        self.node = str(spec.get("node", ""))
        self.agent_start = start_time(os.getpid())  # (the agent told from a later pid's owner)
        self._lock = threading.Lock()

    def write(self, supervisor: Supervisor, state: str) -> str | None:
        """Replace the record with ``supervisor``'s replicas as they are now: ``None``, or
        why it could not be (a full disk, most often).  The first write and each replica's
        start must succeed (nothing of the job runs unrecorded: a restarted daemon that finds
        no record runs the job again); later ones only lose what such a daemon could learn."""
        if not self.names:
            return None
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
            "agent_start": self.agent_start,
            "orphaned": supervisor.orphaned,
            "replicas": replicas,
            "exits": list(supervisor.exits),
            "ended": time.time() if state == "ended" else None,
        }
        name = self.names[-1]
        tmp = f".{name}.{os.getpid()}.tmp"
        with self._lock:
            try:
                dir_fd = open_own_dirs(self.workdir, self.names[:-1], make=True)
            except OSError as exc:
                return exc.strerror or str(exc)
            try:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp, dir_fd=dir_fd)
                flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
                fd = os.open(tmp, flags, 0o600, dir_fd=dir_fd)
                with os.fdopen(fd, "w") as fh:
                    json.dump(data, fh)
                    fh.flush()
                    os.fsync(fh.fileno())  # (a full disk is found here, not after)
                os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
                return None
            except OSError as exc:
                with contextlib.suppress(OSError):
                    os.unlink(tmp, dir_fd=dir_fd)
                return exc.strerror or str(exc)
            finally:
                os.close(dir_fd)


def close_all(*fds: int) -> None:
    """Close each of ``fds`` (one already closed is no matter)."""
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


#: ``prctl`` option that makes orphaned descendants children of the caller.
PR_SET_CHILD_SUBREAPER = 36
#: Rounds of SIGKILL to what the replicas left behind once they all ended.
LEFTOVER_ROUNDS = 50


#: The agent's own ``oom_score_adj``: the kernel's OOM killer never picks it (a job that fills
#: the node's memory must not end the supervision of everyone's replicas there).
PROTECTED_OOM_SCORE_ADJ = -1000
OOM_SCORE_ADJ = "/proc/self/oom_score_adj"


def protect_from_oom() -> str | None:
    """Set this process's ``oom_score_adj`` to :data:`PROTECTED_OOM_SCORE_ADJ` (best effort:
    it takes ``CAP_SYS_RESOURCE``); return what replicas set theirs to (``REPLICA_SOURCE``):
    the value it had, but never below 0 (one inherited from a protected service would leave
    the job unkillable too); ``None`` when it is unchanged and not below 0."""
    try:
        with open(OOM_SCORE_ADJ) as fh:
            original = int(fh.read().strip())
        with open(OOM_SCORE_ADJ, "w") as fh:
            fh.write(str(PROTECTED_OOM_SCORE_ADJ))
        with open(OOM_SCORE_ADJ) as fh:
            now = int(fh.read().strip())
    except (OSError, ValueError):
        return None
    return str(max(original, 0)) if now != original or original < 0 else None


def make_subreaper() -> bool:
    """``prctl(PR_SET_CHILD_SUBREAPER, 1)``: a replica's orphaned descendants (``setsid``, a
    double fork) stay below the agent, where a stop reaches them; ``False`` where it is not
    available."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def descendants(root: int) -> list[tuple[int, int]]:
    """Every process below ``root`` in the process tree (from ``/proc``, children first), as
    (pid, start time): what tells each apart from a later process given its pid."""
    children: dict[int, list[tuple[int, int]]] = {}
    try:
        names = os.listdir("/proc")
    except OSError:
        return []
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as fh:
                data = fh.read()
            fields = data[data.rindex(b")") + 2 :].split()
            parent, started = int(fields[1]), int(fields[19])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(parent, []).append((int(name), started))
    found: list[tuple[int, int]] = []
    todo = list(children.get(root, ()))
    while todo:
        pid, started = todo.pop(0)
        found.append((pid, started))
        todo.extend(children.get(pid, ()))
    return found


def signal_exactly(pid: int, started: int, sig: int) -> None:
    """Send ``sig`` to process ``pid`` only while it is the process started at ``started``
    (a pid given out again since the listing is someone else's): through a pidfd where the
    system has them (the check and the signal then reach one process), else by its start
    time read just before."""
    opener = getattr(os, "pidfd_open", None)  # Python >= 3.9, Linux >= 5.3
    sender = getattr(signal, "pidfd_send_signal", None)
    if opener is not None and sender is not None:
        try:
            fd = opener(pid)
        except OSError as exc:
            if exc.errno != errno.ENOSYS:
                return  # gone
        else:
            try:
                if start_time(pid) == started:
                    sender(fd, sig)
            except OSError:
                pass
            finally:
                os.close(fd)
            return
    with contextlib.suppress(OSError):
        if start_time(pid) == started:
            os.kill(pid, sig)


# --- the fence: one cgroup per incarnation that none of its processes can leave -------------

#: Where cgroupfs is mounted.
CGROUP_ROOT = "/sys/fs/cgroup"
#: The directory, below the process's own cgroup, that holds the fences (and, on the
#: daemon's machine, the groups of ``--mem``/``--cpus``: ``launch/cgroups.py``).
FENCE_DIR = "pollux-local"
#: On v2, the leaf a daemon moves itself into (``cgroups.DAEMON_LEAF``): its fences go beside.
FENCE_DAEMON_LEAF = "pollux-local-daemon"
#: How long :meth:`Fence.end` keeps at it before it gives up (seconds).
FENCE_END_TIMEOUT_S = 10.0
#: How long one freeze is waited for before its kills are sent anyway (seconds).
FENCE_FREEZE_WAIT_S = 2.0
#: How long a replica's group is waited for when the replica leaves while the others run on,
#: and a fence of an agent that is gone when another agent or the node check finds it: a
#: process that cannot die (in uninterruptible sleep) must not hold them up each time.
FENCE_SHORT_END_S = 0.5


class FenceError(Exception):
    """A fence could not be made or joined (one line)."""


def own_cgroups(text: str) -> dict[str, str]:
    """``/proc/self/cgroup`` as controller -> path (the unified hierarchy under ``""``)."""
    found: dict[str, str] = {}
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, names, path = parts
        for name in names.split(",") if names else [""]:
            found[name] = path
    return found


def read_own_cgroups() -> dict[str, str]:
    """This process's :func:`own_cgroups` (none when ``/proc/self/cgroup`` cannot be read)."""
    try:
        with open("/proc/self/cgroup") as fh:
            return own_cgroups(fh.read())
    except OSError:
        return {}


def fence_hierarchies(root: str, own_text: str) -> list[tuple[str, str]]:
    """Where a fence may go, best first: (directory of this process's own cgroup there,
    ``"v2"`` or ``"v1"``), from ``/proc/self/cgroup``'s text: the unified hierarchy (at
    ``root``, or ``root/unified`` on a hybrid mount), then v1's freezer."""
    own = own_cgroups(own_text)
    found = []
    for unified in (root, os.path.join(root, "unified")):
        if os.path.isfile(os.path.join(unified, "cgroup.controllers")) and "" in own:
            mine = own[""]
            if os.path.basename(mine) == FENCE_DAEMON_LEAF:
                mine = os.path.dirname(mine)
            found.append((_cgroup_dir(unified, mine), "v2"))
            break
    freezer = os.path.join(root, "freezer")
    if os.path.isfile(os.path.join(freezer, "cgroup.procs")) and "freezer" in own:
        found.append((_cgroup_dir(freezer, own.get("freezer", "/")), "v1"))
    return found


def _cgroup_dir(hierarchy: str, relative: str) -> str:
    parts = [p for p in relative.split("/") if p]
    if any(p in (".", "..") for p in parts):
        raise FenceError(f"cgroup path {relative!r} is not a plain path")
    return os.path.join(hierarchy, *parts)


def cgroup_tree_procs(directory: str) -> list[int]:
    """The processes in the cgroup ``directory`` and in every group below it now."""
    found = []
    for path, _, _ in os.walk(directory, followlinks=False):
        found.extend(cgroup_procs(path))
    return found


def cgroup_procs(directory: str) -> list[int]:
    """The processes in the cgroup ``directory`` now (none when it cannot be read)."""
    try:
        with open(os.path.join(directory, "cgroup.procs")) as fh:
            return [int(w) for w in fh.read().split() if w.isdigit()]
    except OSError:
        return []


def _cgroup_write(directory: str, name: str, text: str) -> None:
    fd = os.open(os.path.join(directory, name), os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def _cgroup_read(directory: str, name: str) -> str:
    fd = os.open(os.path.join(directory, name), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        return os.read(fd, 4096).decode(errors="replace")
    finally:
        os.close(fd)


class Fence:
    """A cgroup that every process of one incarnation is put in (by root, before it runs the
    job's command: the group is root's, so no process of the user's can leave it), so that
    all of them end at once, also one that keeps forking and exiting to change its pid faster
    than a listing of pids can be signalled.  ``kind`` is how it ends them:

    * ``"kill"``: v2's ``cgroup.kill`` (Linux 5.14): the kernel kills the whole group, forks
      under way included;
    * ``"freeze"`` (v2's ``cgroup.freeze``) or ``"freezer"`` (v1's ``freezer.state``): the
      group is frozen (no process in it forks or exits), each process is sent SIGKILL, and
      it is thawed.
    """

    def __init__(self, path: str, kind: str, owned: bool = True) -> None:
        self.path = path
        self.kind = kind
        #: made for the fence (removed with it); ``False``: a group of the job's limits
        self.owned = owned

    @staticmethod
    def kind_of(path: str) -> str | None:
        """How the cgroup ``path`` ends its processes (:class:`Fence`), ``None``: it cannot."""
        for name, kind in (("cgroup.kill", "kill"), ("cgroup.freeze", "freeze"),
                           ("freezer.state", "freezer")):  # fmt: skip
            if os.path.isfile(os.path.join(path, name)):
                return kind
        return None

    @classmethod
    def make(cls, name: str, root: str = CGROUP_ROOT, own_text: str | None = None) -> Fence:
        """A new fence ``OWN/pollux-local/NAME`` (``OWN``: this process's cgroup) in the best
        hierarchy that has one (:func:`fence_hierarchies`).  A group of that name that holds
        processes is never taken (nor ended: they are not this caller's); an empty one is.
        :class:`FenceError` (one line, every reason) when none can be made."""
        if not name or "/" in name or name in (".", ".."):
            raise FenceError(f"not a cgroup name: {name!r}")
        if own_text is None:
            try:
                with open("/proc/self/cgroup") as fh:
                    own_text = fh.read()
            except OSError as exc:
                raise FenceError(f"cannot read /proc/self/cgroup: {exc.strerror}") from None
        whys = []
        for base, _ in fence_hierarchies(root, own_text):
            path = os.path.join(base, FENCE_DIR, name)
            try:
                if not make_cgroup(path) and cgroup_tree_procs(path):
                    whys.append(f"{path} exists and holds processes")
                    continue
            except OSError as exc:
                whys.append(f"cannot create {path}: {exc.strerror or exc}")
                continue
            kind = cls.kind_of(path)
            if kind is not None:
                return cls(path, kind)
            whys.append(f"{path} can neither be killed nor frozen as a whole")
            with contextlib.suppress(OSError):
                os.rmdir(path)
        if not whys:
            whys.append(f"no cgroup v2 hierarchy and no v1 freezer under {root}")
        raise FenceError("; ".join(whys))

    def add(self, pid: int) -> None:
        """Put ``pid`` in the fence (:class:`FenceError` when it cannot be)."""
        try:
            _cgroup_write(self.path, "cgroup.procs", str(pid))
        except OSError as exc:
            raise FenceError(
                f"cannot add pid {pid} to cgroup {self.path}: {exc.strerror or exc}"
            ) from None

    def pids(self) -> list[int]:
        """The processes in the fence and in the groups below it (its replicas')."""
        return [pid for path in self._groups() for pid in cgroup_procs(path)]

    def _groups(self) -> list[str]:
        """The fence's group and those below it, deepest first."""
        found: list[str] = []
        for path, names, _ in os.walk(self.path, followlinks=False):
            found.extend(os.path.join(path, name) for name in names)
        return [*reversed(found), self.path]

    def replica(self, pid: int) -> Fence:
        """The group of one replica below the fence (``replica-<pid>``, made here), so that
        what that replica starts can be ended when it leaves the job at a warm shrink while
        the others run on (:meth:`end`); the fence's own end takes it too.  Never below a
        fence that is gone: :class:`FenceError` then."""
        path = os.path.join(self.path, f"replica-{pid}")
        try:
            with contextlib.suppress(FileExistsError):
                os.mkdir(path)
        except OSError as exc:
            raise FenceError(f"cannot create cgroup {path}: {exc.strerror or exc}") from None
        return Fence(path, self.kind_of(path) or self.kind)

    def end_replica(self, pid: int) -> None:
        """Kill what replica ``pid`` left behind (its group, :meth:`replica`) and remove the
        group: it left the job while the others run on (waited for
        :data:`FENCE_SHORT_END_S` at most; the fence's end takes what is left)."""
        path = os.path.join(self.path, f"replica-{pid}")
        kind = self.kind_of(path)
        if kind is not None:
            Fence(path, kind).remove(FENCE_SHORT_END_S)

    def _freeze(self, frozen: bool) -> None:
        if self.kind == "freeze":
            _cgroup_write(self.path, "cgroup.freeze", "1" if frozen else "0")
        else:
            _cgroup_write(self.path, "freezer.state", "FROZEN" if frozen else "THAWED")

    def _frozen(self) -> bool:
        if self.kind == "freeze":
            return "frozen 1" in _cgroup_read(self.path, "cgroup.events").splitlines()
        return _cgroup_read(self.path, "freezer.state").strip() == "FROZEN"

    def end(self, timeout_s: float = FENCE_END_TIMEOUT_S) -> bool:
        """SIGKILL every process in the fence, as one (see the class); ``True`` once none is
        left (the caller reaps those that are its children), ``False`` after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            if not self.pids():
                return True
            if time.monotonic() > deadline:
                return False
            try:
                if self.kind == "kill":
                    _cgroup_write(self.path, "cgroup.kill", "1")
                else:
                    self._kill_frozen(max(0.0, deadline - time.monotonic()))
            except OSError:
                pass
            wait_until = min(deadline, time.monotonic() + 0.5)
            while self.pids() and time.monotonic() < wait_until:
                time.sleep(0.01)

    def _kill_frozen(self, wait_s: float) -> None:
        """Freeze, SIGKILL each process (none can exit meanwhile, so no pid listed is given
        to another process), thaw; the freeze waited for ``wait_s`` at most (a process in
        uninterruptible sleep is never frozen: it is sent the SIGKILL all the same)."""
        self._freeze(True)
        try:
            until = time.monotonic() + min(wait_s, FENCE_FREEZE_WAIT_S)
            while not self._frozen() and time.monotonic() < until:
                time.sleep(0.005)
            for pid in self.pids():
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
        finally:
            self._freeze(False)

    def remove(self, timeout_s: float = FENCE_END_TIMEOUT_S) -> None:
        """End what is left (:meth:`end`, ``timeout_s``) and remove the fence and the groups
        below it, best effort (``pollux-local`` above it is left); a group of the job's
        limits is left to its owner (the groups below it go)."""
        self.end(timeout_s)
        for path in self._groups():
            if path != self.path or self.owned:
                with contextlib.suppress(OSError):
                    os.rmdir(path)


#: The signals that would end the agent (root's to send: a session's end, an admin, a
#: ``timeout``, Ctrl-C in an ``ssh -t``): each is taken as the end of its stdin, so that its
#: replicas are stopped and its fence ended before it exits.
ENDING_SIGNALS = (
    signal.SIGTERM,
    signal.SIGHUP,
    signal.SIGINT,
    signal.SIGQUIT,
    signal.SIGUSR1,
    signal.SIGUSR2,
    signal.SIGALRM,
)
#: ``/proc/self/cgroup`` as if this process were in the root cgroup of each hierarchy: where
#: the node agents' fences go (:func:`make_agent_fence`), whatever login session runs them.
AT_THE_TOP = "0::/\n1:freezer:/\n"
#: The agents' fences: ``TOP/pollux-local/agent-<token>/``, the agent itself in ``keeper``
#: (its liveness, readable from any pid namespace) and its replicas in ``job`` (the fence).
AGENT_FENCE_PREFIX = "agent-"


def make_cgroup(path: str, attempts: int = 20) -> bool:
    """``mkdir -p`` of a cgroup: ``True`` when ``path`` was made here, ``False`` when it
    was there; tried again when a parent vanished meanwhile (another process removed an
    empty one); :class:`OSError` otherwise."""
    for _ in range(attempts):
        try:
            os.mkdir(path)
            return True
        except FileExistsError:
            return False
        except FileNotFoundError:
            parent = os.path.dirname(path)
            if parent == path:
                raise
            make_cgroup(parent, attempts)
    raise OSError(errno.ENOENT, f"{path} keeps disappearing")


def own_cgroup(hierarchy_root: str, kind: str) -> str | None:
    """This process's cgroup in the hierarchy at ``hierarchy_root`` (``kind``: "v2" or
    "v1", the freezer), as a directory; ``None`` when unknown."""
    path = read_own_cgroups().get("" if kind == "v2" else "freezer")
    if path is None:
        return None
    try:
        return _cgroup_dir(hierarchy_root, path)
    except FenceError:
        return None


class AgentFence:
    """A node agent's fence (:class:`Fence`) where every agent of the node finds it, whatever
    login session (cgroup) runs the agent: ``TOP/pollux-local/agent-<token>/job``, ``TOP``
    the root of the hierarchy.  The agent puts itself in ``keeper`` beside it: a keeper that
    can be removed holds no process, so its agent is gone (killed before it ended its fence),
    which the next agent of the node or a node check tells from any pid namespace
    (:func:`end_stale_agent_fences`)."""

    def __init__(self, fence: Fence, home: str, kind: str, came_from: str | None) -> None:
        self.fence = fence
        self.home = home
        self.kind = kind  # "v2" or "v1": the hierarchy
        self.came_from = came_from  # the agent's cgroup before it moved into its keeper

    @classmethod
    def make(cls, root: str = CGROUP_ROOT, attempts: int = 3) -> AgentFence:
        """A new agent fence with this process in its keeper; the fences of agents that are
        gone ended first.  :class:`FenceError` (one line) when none can be made."""
        whys = []
        for base, kind in fence_hierarchies(root, AT_THE_TOP):
            top = os.path.join(base, FENCE_DIR)
            for _ in range(attempts):
                end_stale_agent_fences(top)
                home = os.path.join(top, AGENT_FENCE_PREFIX + os.urandom(8).hex())
                came_from = own_cgroup(base, kind)
                try:
                    make_cgroup(home)
                    os.mkdir(os.path.join(home, "keeper"))
                    _cgroup_write(os.path.join(home, "keeper"), "cgroup.procs", str(os.getpid()))
                    job = os.path.join(home, "job")
                    os.mkdir(job)
                except OSError as exc:  # another agent took it for a stale one: again
                    whys.append(f"cannot create {home}: {exc.strerror or exc}")
                    _remove_agent_home(home, came_from)
                    continue
                fence_kind = Fence.kind_of(job)
                if fence_kind is None:
                    whys.append(f"{job} can neither be killed nor frozen as a whole")
                    _remove_agent_home(home, came_from)
                    break
                return cls(Fence(job, fence_kind), home, kind, came_from)
        if not whys:
            whys.append(f"no cgroup v2 hierarchy and no v1 freezer under {root}")
        raise FenceError("; ".join(whys))

    def release(self) -> None:
        """End the fence, move the agent back where it came from and remove the groups (best
        effort: what is left, the next agent removes)."""
        self.fence.remove()
        _remove_agent_home(self.home, self.came_from)


def _remove_agent_home(home: str, came_from: str | None) -> None:
    """This agent out of ``home``'s keeper (back into ``came_from``) and ``home`` removed."""
    if came_from is not None:
        with contextlib.suppress(OSError):
            _cgroup_write(came_from, "cgroup.procs", str(os.getpid()))
    for name in ("job", "keeper", "ended", ""):
        with contextlib.suppress(OSError):
            os.rmdir(os.path.join(home, name) if name else home)


def end_stale_agent_fences(top: str) -> None:
    """End and remove the agent fences in ``top`` whose agent is gone.  An agent is gone
    when its keeper can be removed: the kernel refuses to remove a cgroup that holds a
    process, whatever pid namespace looks (a zombie is no longer in it), and once removed no
    agent can move into it, so no live agent's fence is taken (an agent still making its
    home finds it gone and makes another).  The home is marked (``ended``) before its keeper
    is removed, so that a later look ends what this one could not; a group with neither a
    keeper nor the mark is not an agent's home (or one still empty): it is left alone.  Each
    fence is given :data:`FENCE_SHORT_END_S`: one whose process cannot die is left for a
    later look."""
    try:
        names = os.listdir(top)
    except OSError:
        return
    for name in names:
        if not name.startswith(AGENT_FENCE_PREFIX):
            continue
        home = os.path.join(top, name)
        keeper, ended = os.path.join(home, "keeper"), os.path.join(home, "ended")
        if os.path.isdir(keeper):
            try:  # marked first, so that a look that dies after the claim leaves it marked
                with contextlib.suppress(FileExistsError):
                    os.mkdir(ended)
                os.rmdir(keeper)
            except OSError:  # its agent runs (EBUSY), or it cannot be told
                with contextlib.suppress(OSError):
                    if os.path.isdir(keeper):
                        os.rmdir(ended)
                continue
        elif not os.path.isdir(ended):  # half made (gone once empty), or not an agent's
            with contextlib.suppress(OSError):
                os.rmdir(home)
            continue
        job = os.path.join(home, "job")
        kind = Fence.kind_of(job)
        if kind is not None:
            Fence(job, kind).remove(FENCE_SHORT_END_S)
        for path in (job, ended, home):
            with contextlib.suppress(OSError):
                os.rmdir(path)


def end_stale_fences_here(root: str = CGROUP_ROOT) -> None:
    """:func:`end_stale_agent_fences` in every hierarchy of this node (the node check runs
    it, so that an agent killed outright leaves nothing running past the next check)."""
    for base, _ in fence_hierarchies(root, AT_THE_TOP):
        end_stale_agent_fences(os.path.join(base, FENCE_DIR))


def sent_log_limit(value: object) -> int:
    """The daemon's limit on one replica's log (``max_log_bytes`` of the spec): a positive
    whole number, else :data:`DEFAULT_MAX_LOG_BYTES`."""
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    return DEFAULT_MAX_LOG_BYTES


class Supervisor:
    """The replicas of one job on this node, their logs and their process groups."""

    def __init__(self, spec: dict[str, Any], lines: Lines) -> None:
        self.spec = spec
        self.lines = lines
        self.procs: dict[int, tuple[int, subprocess.Popen[bytes]]] = {}  # pid -> (rank, proc)
        #: pid -> [the descriptor its log was opened with at its start, the offset sent up
        #: to, the offset it started at]
        self.logs: dict[int, list[int]] = {}
        #: bytes of one replica's log sent at most, past where it started (one more than
        #: the daemon keeps, so that its copy says it was cut); the rest stays on the node
        self.max_log_bytes = sent_log_limit(spec.get("max_log_bytes")) + 1
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
        #: what each replica's ``oom_score_adj`` is set back to (:func:`protect_from_oom`)
        self.oom_score_adj: str | None = None
        #: every replica has ended: nothing more is started
        self.finished = False
        #: a TERM or KILL came (or stdin closed): nothing more is started
        self.stopping = False
        #: the signal sent last to every replica (given at once to one started after it)
        self.last_signal = signal.SIGTERM
        #: stdin closed: the daemon is gone
        self.daemon_gone = False
        #: the first replicas are started (warm resize lines wait for it)
        self.started = threading.Event()
        self.warm_lines: queue.Queue[tuple[str, str]] | None = None
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
        #: the cgroup every replica and all it starts is in (:meth:`make_fence`)
        self.fence: Fence | None = None
        self.agent_fence: AgentFence | None = None
        #: the replicas are being stopped because the daemon is gone (:meth:`abandon`)
        self.abandoned = False

    def ended(self, rank: int, code: int, say: bool = True, state: str = "running") -> None:
        """``rank`` ended with ``code``: recorded, then ``EXIT`` said (unless ``say`` is
        false: the caller says it later)."""
        self.codes[rank] = code
        self.exits.append(rank)
        self.record.write(self, state)
        if say:
            self.lines.say("EXIT", rank, code)

    def gone(self, rank: int, code: int, say: bool = True) -> None:
        """``rank`` is no longer one of the job's replicas (``LEFT``): forgotten."""
        self.pids.pop(rank, None)
        self.codes.pop(rank, None)
        self.exits = [r for r in self.exits if r != rank]
        self.record.write(self, "running")
        if say:
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
        self.make_fence()
        join = self.spec.get("join")
        if join:
            self.start_joining(join)
            return
        for r in self.spec["replicas"]:
            pid, why = self.spawn(r)
            if pid is None:
                with self.lock:
                    self.pids[r["rank"]] = 0
                    code = 128 + int(self.last_signal) if why == "stopping" else None
                    self.ended(r["rank"], code or NOT_STARTED_EXIT_CODE)

    def end_replica_group(self, pid: int) -> None:
        """Replica ``pid`` is no longer the job's while the others run on: what it left
        behind ended (:meth:`Fence.end_replica`)."""
        if self.fence is not None:
            self.fence.end_replica(pid)

    def make_fence(self) -> None:
        """The fence every replica is put in (:class:`AgentFence`); the fences of agents
        that are gone (killed before they ended theirs) are ended first.  Where none can be
        made (an agent not run as root, cgroups not writable) the replicas run without one,
        said in the agent's stderr and to the daemon (``NOTE``): what they leave behind is then killed by pid only, which
        a process that keeps changing its pid escapes."""
        try:
            self.agent_fence = AgentFence.make()
        except FenceError as exc:
            sys.stderr.write(f"pollux-local agent: no fence for the job's processes: {exc}\n")
            self.lines.say("NOTE", f"no fence for the job's processes: {exc}")
            return
        self.fence = self.agent_fence.fence

    def start_joining(self, join: dict[str, Any]) -> None:
        """This node's replicas join a running group (``"join"`` in the spec: a ``RESIZE``'s
        fields, held): started as joiners, ``READY`` once all are, then ``ORDER``."""
        generation = int(join["generation"])
        deadline = time.monotonic() + max(0.0, float(join["ready_timeout_s"]))
        with self.lock:
            if self.order_path is None:
                self.lines.say("WARMFAIL", generation, "no directory for resize orders")
                return
            self.begin_resize(generation, len(self.spec["replicas"]), None, True)
        if self.spawn_joiners(generation, list(self.spec["replicas"])):  # then watched
            args = (generation, str(join["job_dir"]), deadline)  # while this thread reaps
            threading.Thread(target=self.watch_joiners, args=args, daemon=True).start()

    def start_joiners(
        self, generation: int, joiners: list[dict[str, Any]], job_dir: str, deadline: float
    ) -> None:
        """Start the joiners of ``generation``, then wait for them (:meth:`watch_joiners`);
        the resize fails at the first that cannot be started."""
        if self.spawn_joiners(generation, joiners):
            self.watch_joiners(generation, job_dir, deadline)

    def spawn_joiners(self, generation: int, joiners: list[dict[str, Any]]) -> bool:
        """Start the joiners of ``generation``: whether all could be (else the resize
        failed)."""
        for r in joiners:
            pid, why = self.spawn(r, generation)
            if pid is None or why is not None:
                self.warm_failed(f"rank {r['rank']}: cannot start {r['argv'][0]}")
                return False
        return True

    def spawn(
        self, r: dict[str, Any], generation: int | None = None
    ) -> tuple[int | None, str | None]:
        """Start replica ``r`` (a joiner of ``generation`` when given) through its launcher
        (:data:`REPLICA_SOURCE`), holding :attr:`lock` only while it is forked and noted
        (``PID`` said): the launcher is this agent's user's until right before the job's
        command, so nothing of the job's user can hold it up there.  Returns its pid and
        ``None`` once it runs the command (or ended before: its exit code says why), or its
        pid and why not (``"cannot start"``: the launcher ends with 127, or was killed when
        late) or ``None`` and why nothing was started (its log, or ``"stopping"``)."""
        rank = int(r["rank"])
        path = os.path.expanduser(r["log"])
        mask = r.get("umask")
        if mask is not None and (type(mask) is not int or not 0 <= mask <= 0o777):
            self.say_log(rank, f"cannot start: umask {mask!r} is not a number 0..0o777\n")
            return None, "umask"
        try:
            fd = self.open_log(path)
        except OSError as e:
            self.say_log(rank, f"cannot open its log {path} on node {self.spec.get('node')}: {e}\n")
            return None, "log"
        start = os.lseek(fd, 0, os.SEEK_END)
        with contextlib.suppress(OSError):
            os.write(fd, str(r.get("banner", "")).encode())
        env = dict(r["env"])
        env.pop("POLLUX_RESIZE_FILE", None)
        if self.order_path is not None:
            env["POLLUX_RESIZE_FILE"] = self.order_path
        order = {
            "argv": [str(a) for a in r["argv"]],
            "env": {str(k): str(v) for k, v in env.items()},
            "cwd": self.cwd,
            "user": self.run_as or None,
            "umask": mask,
            "oom_score_adj": self.oom_score_adj,
            "keyctl": (self.spec.get("keyctl_numbers") or {}).get(os.uname().machine),
        }
        spec_r, spec_w = os.pipe()
        report_r, report_w = os.pipe()
        try:
            with self.lock:
                if self.stopping if generation is None else not self.joins(generation):
                    close_all(fd, spec_w, report_r)
                    return None, "stopping"
                try:
                    p = subprocess.Popen(
                        [
                            sys.executable,
                            "-I",
                            "-S",
                            "-c",
                            REPLICA_SOURCE,
                            str(spec_r),
                            str(report_w),
                        ],
                        cwd="/",
                        stdin=subprocess.DEVNULL,
                        stdout=fd,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                        pass_fds=(spec_r, report_w),
                    )
                except OSError as e:
                    with contextlib.suppress(OSError):
                        os.write(fd, f"cannot start {r['argv'][0]}: {e}\n".encode())
                    close_all(fd, spec_w, report_r)
                    return None, "launcher"
                if self.fence is not None:  # before its order: the command runs in it
                    try:
                        self.fence.replica(p.pid).add(p.pid)
                    except FenceError as e:
                        with contextlib.suppress(OSError):
                            os.write(fd, f"cannot start {r['argv'][0]}: {e}\n".encode())
                        p.kill()  # it reads no order: nothing of the job ran
                        close_all(fd, spec_w, report_r)
                        return None, "fence"
                self.procs[p.pid] = (rank, p)
                self.pids[rank] = p.pid
                self.start_times[p.pid] = start_time(p.pid)
                # recorded before its launch order is sent: the job's command never runs
                # unrecorded (an agent killed before the order leaves a launcher that reads
                # no order and ends; one killed after leaves a replica its record names)
                problem = self.record.write(self, "running")
                if problem is not None:  # (review s61: a disk filled by another job)
                    del self.procs[p.pid], self.pids[rank], self.start_times[p.pid]
                    with contextlib.suppress(OSError):
                        note = f"cannot start {r['argv'][0]}: cannot keep its exit record"
                        os.write(fd, f"{note} on this node: {problem}\n".encode())
                    p.kill()  # it reads no order: nothing of the job ran
                    close_all(fd, spec_w, report_r)
                    return None, "record"
                with self._pump_lock:
                    self.logs[p.pid] = [fd, start, start]
                if generation is not None:
                    self.joining[p.pid] = rank
                elif self.stopping:
                    with contextlib.suppress(OSError):
                        os.killpg(p.pid, self.last_signal)
                self.lines.say("PID", rank, p.pid)
        finally:
            os.close(spec_r)
            os.close(report_w)
        try:
            data = json.dumps(order).encode()
            view = memoryview(data)
            while view:
                view = view[os.write(spec_w, view) :]
        except OSError:
            pass  # the launcher is gone: its exit says so
        finally:
            os.close(spec_w)
        return p.pid, self.await_start(p.pid, report_r, fd)

    def joins(self, generation: int) -> bool:
        """Whether joiners of ``generation`` may still start (under :attr:`lock`): not once
        every replica has ended (the fence is gone then, and nothing would reap them)."""
        warm = self.warm
        return (
            not self.stopping
            and not self.finished
            and warm is not None
            and warm["generation"] == generation
            and warm["state"] == "joining"
        )

    def await_start(self, pid: int, report: int, log_fd: int) -> str | None:
        """Wait (holding no lock) for replica ``pid``'s launcher to run the command: ``None``
        once it did (its report pipe closed at ``exec``, or it settled as the user
        :data:`SETTLED_WAIT_S` ago: from there on it is the user's, who may stop it), or
        ended before it settled (its exit code says why); ``"cannot start"`` when its
        ``exec`` failed, or when it did not settle within :data:`SPAWN_TIMEOUT_S` (killed)."""
        got = b""
        closed = False
        settled_at: float | None = None
        deadline = time.monotonic() + SPAWN_TIMEOUT_S
        poller = select.poll()
        poller.register(report, select.POLLIN)
        try:
            while True:
                limit = deadline if settled_at is None else settled_at + SETTLED_WAIT_S
                left = limit - time.monotonic()
                if left <= 0:
                    break
                if not poller.poll(left * 1000):
                    continue
                chunk = os.read(report, 64)
                if not chunk:
                    closed = True
                    break
                got += chunk
                if settled_at is None and b"S" in got:
                    settled_at = time.monotonic()
        finally:
            os.close(report)
        if b"E" in got:
            return "cannot start"
        if not closed and settled_at is None:
            with contextlib.suppress(OSError):
                os.killpg(pid, signal.SIGKILL)
            with contextlib.suppress(OSError):
                note = f"did not reach its command within {SPAWN_TIMEOUT_S:g} s: killed\n"
                os.write(log_fd, note.encode())
            return "cannot start"
        return None

    def say_log(self, rank: int, text: str) -> None:
        """Tell the daemon ``text`` as output of ``rank`` (a replica that has no log)."""
        self.lines.say("LOG", rank, base64.b64encode(text.encode()[:LOG_CHUNK]).decode())

    def open_log(self, path: str) -> int:
        """A replica's log, opened to append (and to be read back from, :meth:`pump`) as
        safely as a root agent must: a plain file, never through a link, in a directory
        (made when missing) and a parent that, when the replicas run as another user, are no
        links and this agent's user's alone (no one else may write there), the file handed
        to the replica's user by its descriptor.  Every replica has a file of its own
        (``rank<N>.start<I>...log``), so a user who could write there could plant one in
        advance."""
        directory = os.path.dirname(path)
        os.makedirs(directory, exist_ok=True)
        if self.run_as:
            # every directory below the node's work directory (which the agent checked),
            # else the log's directory and the one above it
            below = relative_under(directory, node_workdir(self.spec))
            chain = [os.path.dirname(directory), directory]
            if below:
                workdir = node_workdir(self.spec).rstrip("/")
                chain = ["/".join([workdir, *below[: i + 1]]) for i in range(len(below))]
            for each in chain:
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
        flags = os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        owner = self.run_as["uid"] if self.run_as else os.geteuid()
        try:
            fd = os.open(path, flags | os.O_EXCL, 0o644)
        except FileExistsError:
            info = os.lstat(path)
            if stat.S_ISREG(info.st_mode) and info.st_uid != owner:
                # an earlier replica's of the same name, another user's (a job id used again
                # after the state was reset): never handed to this one, nor written into
                os.unlink(path)
                fd = os.open(path, flags | os.O_EXCL, 0o644)
            else:  # this user's (an attempt of the same start), or refused below
                fd = os.open(path, flags, 0o644)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise OSError(errno.EINVAL, f"{path} is not a plain file")
            if self.run_as:
                os.fchown(fd, self.run_as["uid"], self.run_as["gid"])
            return fd
        except BaseException:
            os.close(fd)
            raise

    def pump(self, pid: int, final: bool = False) -> None:
        """Send what replica ``pid``'s log gained since the last call (``LOG`` lines, under
        its rank of now), read from the descriptor it was opened with, while the daemon
        takes them (:meth:`Lines.room`); ``final`` (it ended): all it holds (up to
        :attr:`max_log_bytes`), waiting for room as long as it takes, holding no lock
        meanwhile, unless the replicas are being stopped."""
        end: int | None = None
        progress = (self.lines.written, time.monotonic())
        while True:
            with self._pump_lock:
                entry = self.logs.get(pid)
                proc = self.procs.get(pid)
                if entry is None or proc is None:
                    return
                fd, pos, first = entry
                if final and end is None:
                    try:
                        end = os.fstat(fd).st_size
                    except OSError:
                        return
                # (nobody reads once the daemon's stream is gone: the log stays on the node)
                while self.lines.room() and not self.lines.gone:
                    left = first + self.max_log_bytes - pos
                    size = min(LOG_CHUNK, left) if end is None else min(LOG_CHUNK, end - pos, left)
                    try:
                        data = os.pread(fd, size, pos) if size > 0 else b""
                    except OSError:
                        data = b""
                    if not data:
                        return
                    pos += len(data)
                    entry[1] = pos
                    self.lines.say("LOG", proc[0], base64.b64encode(data).decode())
            if not final or self.stopping:
                # (stopping: what the backlog holds goes, not more: the replica's end must
                # reach the daemon within its stop's grace, however much the job wrote)
                return
            # the daemon does not take lines as fast: wait while it takes some, not after
            # stdin closed nor once nothing was taken for FINAL_STALL_S (the rest stays in
            # the log on the node)
            if (
                self.daemon_gone
                or self.lines.gone
                or time.monotonic() - progress[1] > FINAL_STALL_S
            ):
                return
            self.lines.wait_room(1.0)
            if self.lines.written != progress[0]:
                progress = (self.lines.written, time.monotonic())

    def close_log(self, pid: int) -> None:
        """Replica ``pid`` ended and its log was sent: its descriptor closed."""
        with self._pump_lock:
            entry = self.logs.pop(pid, None)
        if entry is not None:
            with contextlib.suppress(OSError):
                os.close(entry[0])

    def tail(self) -> None:
        """Stream every log, for ever (a daemon thread)."""
        while True:
            for pid in list(self.logs):
                self.pump(pid)
            time.sleep(TAIL_INTERVAL_S)

    def live(self) -> list[subprocess.Popen[bytes]]:
        return [p for _, p in list(self.procs.values()) if p.returncode is None]

    def signal_all(self, sig: int) -> None:
        """Send ``sig`` to the process group of every replica still running, and to every
        process below the agent (what a replica started in a session of its own); SIGKILL
        ends the fence first (all that is in it at once)."""
        if sig == signal.SIGKILL and self.fence is not None:
            self.fence.end(FENCE_SHORT_END_S)  # (the end of the replicas waits for the rest)
        for p in self.live():
            with contextlib.suppress(OSError):
                os.killpg(p.pid, sig)
        for pid, started in descendants(os.getpid()):
            signal_exactly(pid, started, sig)

    def end_leftovers(self) -> None:
        """Every replica ended: SIGKILL what they left behind below the agent, and reap it,
        until nothing is left (as this machine's supervisor does): an incarnation's devices
        go to the next job, and nothing of this one may hold them.  The fence first: all
        that is in it at once (also a process that keeps changing its pid)."""
        if self.fence is not None:
            self.fence.end()
        for _ in range(LEFTOVER_ROUNDS):
            left = descendants(os.getpid())
            if not left:
                return
            for pid, started in left:
                signal_exactly(pid, started, signal.SIGKILL)
            deadline = time.monotonic() + 0.2
            while time.monotonic() < deadline:
                try:
                    pid, _ = os.waitpid(-1, os.WNOHANG)
                except ChildProcessError:
                    break
                if pid == 0:
                    time.sleep(0.02)

    def control(self, commands: IO[str]) -> None:
        """Obey ``TERM``/``KILL``/``RESIZE`` lines; at their end (stdin closed) stop the
        replicas: SIGTERM, up to ``orphan_grace_s`` for them to exit, then SIGKILL (a daemon
        thread)."""
        for line in commands:
            cmd, _, rest = line.strip().partition(" ")
            if cmd in ("TERM", "KILL"):
                self.stop_all(signal.SIGTERM if cmd == "TERM" else signal.SIGKILL)
                self.warm_failed("the job is stopping")
            elif cmd in ("RESIZE", "ORDER", "ABORT"):
                if self.warm_lines is None:
                    self.warm_lines = queue.Queue()
                    threading.Thread(target=self.warm_commands, daemon=True).start()
                self.warm_lines.put((cmd, rest))
        self.abandon()

    def abandon(self) -> None:
        """The daemon is gone (stdin closed) or the agent is told to end (SIGTERM, SIGHUP):
        nothing more is started; SIGTERM to the replicas, up to ``orphan_grace_s`` for them
        to exit, then SIGKILL (once, whichever comes first)."""
        with self.lock:
            if self.abandoned:
                return
            self.abandoned = True
        self.daemon_gone = True
        with self.lock:
            self.stopping = True
            if self.live():
                self.orphaned = True
                self.record.write(self, "running")
        self.warm_failed("the daemon is gone")
        self.stop_all(signal.SIGTERM)
        deadline = time.time() + float(self.spec.get("orphan_grace_s", 10))
        while time.time() < deadline and self.live():
            time.sleep(0.2)
        self.stop_all(signal.SIGKILL)

    def warm_commands(self) -> None:
        """Obey the warm resize lines, in order, once the replicas are started (a thread)."""
        self.started.wait()
        assert self.warm_lines is not None
        while True:
            cmd, rest = self.warm_lines.get()
            if cmd == "RESIZE":
                self.take_resize(rest)
            else:
                self.order_line(cmd, rest)

    def stop_all(self, sig: int) -> None:
        """Nothing more is started; ``sig`` to every replica's process group, and to any
        that is started yet (:meth:`spawn`)."""
        with self.lock:
            self.stopping = True
            self.last_signal = signal.Signals(sig)
            self.signal_all(sig)

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
        # started by a thread of their own: this one goes on reading TERM, KILL and ABORT
        deadline = time.monotonic() + max(0.0, timeout_s)
        args = (generation, joiners, job_dir, deadline)
        threading.Thread(target=self.start_joiners, args=args, daemon=True).start()

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
        with self._pump_lock:  # a log being sent goes on under its old rank until then
            self.procs = {pid: (mapping.get(r, r), p) for pid, (r, p) in self.procs.items()}
        self.pids = {mapping.get(r, r): pid for r, pid in self.pids.items()}
        self.codes = {mapping.get(r, r): code for r, code in self.codes.items()}
        self.exits = [mapping.get(r, r) for r in self.exits]

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
                if pid in self.joining:  # a joiner that never joined: the resize failed
                    del self.joining[pid]
                    self.left.add(pid)
                    self.warm_failed(f"joining rank {rank} exited with {code} first")
                if pid in self.left or (code == 0 and pid in self.leaving):
                    kind = "LEFT"  # a joiner of a failed resize, or it left at one
                    self.end_replica_group(pid)  # before the daemon gives its device away
                    self.gone(rank, code, say=False)
                else:
                    kind = "EXIT"
                    self.ended(rank, code, False, "running" if self.live() else EXITED)
            if stream:  # its last bytes, before its end is said (holding no lock meanwhile)
                self.pump(pid, final=True)
            self.close_log(pid)
            with self.lock:  # under its rank of now: a resize may have renamed it
                self.lines.say(kind, self.procs[pid][0], code)
        self.record.write(self, EXITED)  # before the clean-up: the result if it dies there
        self.end_leftovers()
        if self.agent_fence is not None:
            self.agent_fence.release()
        self.record.write(self, "ended")
        if self.order_dir is not None:
            shutil.rmtree(self.order_dir, ignore_errors=True)


def main() -> None:
    """Read the spec from stdin, check the node, start the replicas, supervise them; with
    arguments, the daemon's tool for the exit records (:func:`tool`)."""
    if len(sys.argv) > 1:
        sys.exit(tool(sys.argv[1:]))
    spec = json.loads(sys.stdin.readline())
    make_subreaper()
    oom_score_adj = protect_from_oom()
    lines = Lines(sys.stdout)
    run_as = identity(spec, lines)
    check_workdir(spec, lines)
    cwd = working_dir(spec, lines, as_user=bool(run_as))
    check_probe(spec, lines)
    supervisor = Supervisor(spec, lines)
    supervisor.oom_score_adj = oom_score_adj
    problem = supervisor.record.write(supervisor, "running")
    if problem is not None:  # nothing may run that a restarted daemon would not find
        where = supervisor.record.workdir
        lines.fail(f"cannot keep the job's exit record in {where}: {problem}", node=True)
    # TERM, KILL and the end of stdin are obeyed from now on, while the replicas start
    threading.Thread(target=supervisor.control, args=(sys.stdin,), daemon=True).start()

    def told_to_end(signum: int, frame: object) -> None:  # as when the daemon is gone
        threading.Thread(target=supervisor.abandon, daemon=True).start()

    for signum in ENDING_SIGNALS:
        signal.signal(signum, told_to_end)
    stream = spec.get("stream_logs", True)
    if stream:
        threading.Thread(target=supervisor.tail, daemon=True).start()
    try:
        supervisor.start(cwd, run_as)
    finally:
        supervisor.started.set()
    supervisor.record.write(supervisor, "running")
    supervisor.reap(stream)
    # the last lines, while the daemon reads them (not for ever once it is gone)
    gone_since: list[float] = []

    def give_up() -> bool:
        if supervisor.daemon_gone and not gone_since:
            gone_since.append(time.monotonic())
        return bool(gone_since) and time.monotonic() - gone_since[0] > DRAIN_AFTER_EOF_S

    lines.drain(FINAL_DRAIN_S, give_up)
    sys.exit(0)


def tool(args: Sequence[str]) -> int:
    """The daemon's tool for exit records on this node (``launch/ssh``), refusing a work
    directory as the agent does (:func:`workdir_problem`; one line on stderr, exit 2):

    ``workdir WORKDIR``: ``ok``, or why the agent would refuse it (one line, exit 2), the
    missing components made as a launch makes them; ``record cat WORKDIR RELPATH``: print
    the record (a plain file of this user's, at most
    :data:`MAX_RECORD_BYTES`; exit 3 when there is none); ``record rm WORKDIR RELPATH
    [TOKEN]``: remove it (with a ``TOKEN``: only while it is that incarnation's,
    :func:`remove_record_of`); ``signal SIG WORKDIR USER PID:START...``: send SIG to the
    process group of each pid that is still the process started then and, with a ``USER`` (not ``-``), runs
    as that user."""
    if len(args) == 2 and args[0] == "workdir":  # the node check: usable, made if missing
        end_stale_fences_here()  # (what an agent killed outright left running)
        path = node_workdir({"node_workdir": args[1]})
        problem = workdir_problem(path, make=True)
        sys.stdout.write("ok\n" if problem is None else workdir_refusal(path, problem) + "\n")
        return 0 if problem is None else 2
    try:
        if args[0] == "record" and (args[1], len(args)) in (("cat", 4), ("rm", 4), ("rm", 5)):
            workdir, relpath = args[2], args[3]
        elif args[0] == "signal" and len(args) >= 4:
            workdir, relpath = args[2], ""
        else:
            raise IndexError
    except IndexError:
        sys.stderr.write(
            "usage: workdir WORKDIR | record cat|rm WORKDIR RELPATH | record rm WORKDIR"
            " RELPATH TOKEN"
            " | signal SIG WORKDIR USER PID:START...\n"
        )
        return 2
    workdir = node_workdir({"node_workdir": workdir})
    problem = workdir_problem(workdir)
    if problem is not None:
        sys.stderr.write(f"refusing the work directory {workdir}: {problem}\n")
        return 2
    if args[0] == "signal":
        return signal_replicas(args[1], args[3], args[4:])
    names = relative_under(os.path.join(workdir, relpath), workdir)
    if not names:
        sys.stderr.write(f"{relpath} is not below {workdir}\n")
        return 2
    try:
        dir_fd = open_own_dirs(workdir, names[:-1], make=False)
    except OSError:
        return 3
    try:
        if args[1] == "rm" and len(args) == 5:
            remove_record_of(names[-1], dir_fd, args[4])
            return 0
        if args[1] == "rm":
            with contextlib.suppress(OSError):
                os.unlink(names[-1], dir_fd=dir_fd)
            return 0
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        fd = os.open(names[-1], flags, dir_fd=dir_fd)
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid():
                return 3
            data = os.read(fd, MAX_RECORD_BYTES + 1)
        finally:
            os.close(fd)
        if len(data) > MAX_RECORD_BYTES:
            sys.stderr.write(f"the record is over {MAX_RECORD_BYTES} bytes\n")
            return 3
        sys.stdout.write(data.decode(errors="replace"))
        return 0
    except OSError:
        return 3
    finally:
        os.close(dir_fd)


def remove_record_of(name: str, dir_fd: int, token: str) -> None:
    """Remove exit record ``name`` only while it is incarnation ``token``'s: the job may have
    started here again, with a new record, before the daemon forgot its last (review s67).
    Taken aside (a rename, as the agent writes), read, and linked back when another's."""
    aside = f".{name}.{os.getpid()}.forget"
    try:
        os.rename(name, aside, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except OSError:
        return
    try:
        fd = os.open(aside, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dir_fd)
        with os.fdopen(fd, "rb") as fh:
            record = json.loads(fh.read(MAX_RECORD_BYTES).decode())
        seen = record.get("token") if isinstance(record, dict) else None
        if seen and seen != token:  # (a record written meanwhile is newer: it stays)
            os.link(aside, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd, follow_symlinks=False)
    except (OSError, ValueError):
        pass
    finally:
        with contextlib.suppress(OSError):
            os.unlink(aside, dir_fd=dir_fd)


def signal_replicas(name: str, user: str, pairs: Sequence[str]) -> int:
    """Send signal ``name`` to the process group of each ``PID:START`` in ``pairs`` that is
    still the process started then (its start time in clock ticks since boot) and, unless
    ``user`` is ``-``, one of that user's (its real uid): never a process of anyone else.
    Each pid signalled is printed; ``0`` signals nothing (which of them still run)."""
    sig = 0 if name == "0" else getattr(signal, "SIG" + name, None)
    if not isinstance(sig, int):
        return 2
    uid = None
    if user != "-":
        try:
            uid = pwd.getpwnam(user).pw_uid
        except KeyError:
            return 2
    for pair in pairs:
        try:
            pid, start = (int(x) for x in pair.split(":"))
            if pid <= 1 or start_time(pid) != start:
                continue
            if uid is not None and real_uid(pid) != uid:
                continue
            if sig:
                os.killpg(pid, sig)
            print(pid)
        except (OSError, ValueError):
            continue
    return 0


def real_uid(pid: int) -> int | None:
    """Process ``pid``'s real user id (``None``: no such process)."""
    try:
        with open(f"/proc/{pid}/status", "rb") as fh:
            for line in fh:
                if line.startswith(b"Uid:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


if __name__ == "__main__":
    main()
