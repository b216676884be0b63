"""The supervisor of one incarnation of a job on this machine, as Slurm's slurmstepd is for a
job step.

``launch/local.py`` starts one per launch as ``python -m pollux_local.launch.supervisor --job
ID``, in a session of its own (it outlives a restart of the daemon), running as the daemon's
user (root in a lab).  It uses the standard library only.  The launch spec comes as one JSON
line on stdin (so that environments never appear in ``ps``)::

    {"version": 1, "job_id", "run_file", "control_file", "grace_s", "failure_grace_s",
     "user": {"uid", "gid", "groups", "name"} | null,
     "job_dir", "workdir", "checkpoint_dir" | null, "umask" | null, "stdin": bool,
     "replicas": [{"rank", "argv", "env", "log", "banner"}, ...],
     "limits": null | {"version", "memory_base", "cpu_base", "memory", "cpus"},
     "incarnation": N,
     "launch": {...}}                  # copied into the run file for a restarted daemon

What it does:

* it makes itself a child subreaper (``prctl(PR_SET_CHILD_SUBREAPER)``, best effort), so that
  whatever a replica leaves behind (a ``setsid`` grandchild, say) becomes its child, and
  asks the OOM killer to spare it (``oom_score_adj`` -1000, where it may; each replica takes
  back the value it had);
* with ``limits`` (``--mem``, ``--cpus``: ``launch/cgroups.py``) it makes the incarnation's
  cgroups ``job-<daemon>-<id>-<incarnation>-<token>`` and writes the limits into them; a
  failure there is a failed setup (nothing runs);
* it makes the incarnation's fence (``node_agent.Fence``, the same name, in the unified
  hierarchy or v1's freezer; on v2 the limits' group is the fence): a cgroup that is killed
  as one once the replicas have ended, so that nothing they started outlives them, even a
  process that keeps changing its pid; where none can be made, one line on stderr says so;
* for each replica it forks a child that first joins those cgroups and the fence (as root,
  so the job cannot leave them: they stay root's), then drops privileges to the job's user
  (``setgroups``, ``setgid``, the effective uid: only when ``user`` is given; root stays its
  real and saved uid until right before ``exec``, ``launch/identity.py``), takes the
  submitter's ``umask`` (when given), then, as that user, opens (or creates) its log ``JOB_DIR/<log>`` for appending (never through a symlink, never
  a FIFO), writes the banner, creates the checkpoint directory, enters the working directory
  and execs the command with exactly the replica's environment.  Its stdin is ``/dev/null``;
  with ``stdin`` (``--stdin``) rank 0's is the job's input FIFO ``JOB_DIR/stdin``, made 0600
  as the user when absent (an earlier incarnation's is reused), opened read-write (never
  blocking; no end of file between two senders) without following a symlink,
  and used only when it is a FIFO of the job's user (:func:`open_stdin_fifo`): the supervisor
  itself never opens it.  A child that cannot do one
  of these writes one line saying why to its log (when it has one) and to the supervisor, and
  exits with :data:`WORKDIR_EXIT_CODE`, :data:`SETUP_EXIT_CODE` or :data:`EXEC_EXIT_CODE`;
  then no replica of the incarnation runs (the others are killed);
* all replicas share one new process group.  SIGTERM to the supervisor is forwarded to that
  group once; ``grace_s`` later (or the ``grace_s`` of the daemon's control file, read at the
  SIGTERM) the group and every remaining descendant get SIGKILL.  A replica that fails (an
  exit code other than 0 and 75) stops the others the same way after ``failure_grace_s``;
* once every replica has ended it writes their exits to ``run_file`` (``"exited"``), kills
  any descendant left (found through ``/proc``), reads whether the OOM killer fired in the
  job's memory cgroup, removes the cgroups, then writes the incarnation's result to
  ``run_file`` (``"ended"``).

The run file (JSON, 0600, replaced atomically; in a directory of the daemon's) is written
before the replicas start (listing the cgroups, the fence among them), once they run, once
they have all ended and again when what they left is cleaned up::

    {"version": 1, "job_id", "state": "starting" | "running" | "exited" | "ended",
     "supervisor": {"pid", "start_time", "boot_id"}, "pgid",
     "replicas": [{"rank", "pid", "start_time", "exit_code", "error"}, ...],
     "exit_code": null | CODE, "error": null | "one line", "started", "ended",
     "cgroups": [PATH, ...], "oom_killed": bool, "memory_limit": null | BYTES,
     "launch": {...}}

``start_time`` is the process's start time in clock ticks since boot (``/proc/PID/stat``):
with ``boot_id`` it tells a live supervisor from another process that got its pid.
``exit_code`` is the group's code (:func:`combine_exit_codes`), from ``"exited"`` on; a
replica killed by signal N has code -N.  An ``"exited"`` file whose supervisor is gone (it
died during its clean-up: a power cut, a kill) is the incarnation's result all the same,
once the daemon has killed what is left (``launch/local.py``, ``RunRecord.load``; the rule
every launcher's recovery shares: ``launch/base.py``,
:func:`~pollux_local.launch.base.settles`).  ``error`` says why nothing ran (a failed setup).
``cgroups``: the incarnation's cgroups while they exist (a daemon finding the supervisor gone
kills what is left in them).
``oom_killed``: the kernel's OOM killer ended a process of the job for being over
``memory_limit`` (its ``--mem``).

Warm resizes (``[scheduler] warm_resize``; ``api/resize.py`` is the job's side): the daemon
writes a request to ``warm_file`` (0600, its own) and sends SIGUSR1::

    {"generation", "world_size", "order_file", "order": "JSON of the order",
     "joiners": [{"rank", "argv", "env", "log", "banner"}, ...], "ready_timeout_s",
     "launch": {...}}

The supervisor starts the joiners as it started the first replicas (the same process group,
cgroups and user), waits until each has announced itself (its ready file in the job directory,
``api.resize.ready_name``; only its existence is looked at), then writes the order where the
running replicas read it (``order_file``, 0644, replaced atomically) and records the new
``launch``.  A shrink has no joiners: the order is written at once, and the replicas whose rank
is not below ``world_size`` exit 0 (they are recorded as ``left`` and leave the run file's
replicas).  A joiner that fails before the order, or a group not ready within
``ready_timeout_s``, is killed, its exit counted for nothing, and the resize recorded as
failed: the running replicas never saw an order, and the daemon falls back to a
checkpoint-restart.  The run file's ``warm`` says where the newest request stands::

    "warm": null | {"generation", "world_size", "state": "joining" | "ordered" | "failed",
                    "error": null | "one line"}

On stdout the supervisor prints one JSON line once every replica has started or failed its
setup (``{"ok": true, "pid", "start_time", "pgid", "replicas"}`` or ``{"ok": false,
"error"}``), then closes it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import resource
import secrets
import select
import signal
import stat
import sys
import time
from collections.abc import Iterable, Sequence
from typing import Any, NoReturn

from pollux_local.launch import cgroups, logcap
from pollux_local.launch.identity import IdentityError, become_user_for_setup, settle_ids
from pollux_local.launch.node_agent import (
    OOM_SCORE_ADJ,
    Fence,
    FenceError,
    make_subreaper,
    protect_from_oom,
)
from pollux_local.launch.node_agent import descendants as process_tree_below
from pollux_local.launch.userdirs import make_own_directory
from pollux_local.untrusted import one_line

RUN_FILE_VERSION = 1
#: The run file's state once every replica has ended, before the supervisor's clean-up
#: (``launch.base.EXITED``, kept equal by tests/api/test_exit_codes.py).
EXITED = "exited"
#: Exit code of a replica that checkpointed on SIGTERM (``api.states.ExitCode.RESCALE``).
RESCALE_EXIT_CODE = 75
#: A replica's user could not enter the working directory.
WORKDIR_EXIT_CODE = 252
#: A replica could not be prepared: privileges, its log file, the checkpoint directory.
SETUP_EXIT_CODE = 253
#: A replica's command could not be executed.
EXEC_EXIT_CODE = 127
#: Seconds the others get after one replica failed, unless the spec says otherwise.
FAILURE_GRACE_S = 5.0
#: The longest a replica's child may take to set itself up and reach the job's command (it
#: is killed then, and the start fails naming it); below the daemon's wait for the start.
SPAWN_TIMEOUT_S = 30.0
#: What a replica's child writes to its report pipe right before it becomes the user in
#: every way (from then on its user may stop it: the supervisor waits for it
#: :data:`SETTLED_WAIT_S` more at most, then takes it as started).
SETTLED = b"S"
SETTLED_WAIT_S = 1.0
#: The signals the supervisor waits for (blocked, taken with ``sigtimedwait``).
WAITED = {signal.SIGCHLD, signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1}
#: Largest warm resize request read (its joiners' commands and environments included, as
#: large as a request's 16 MiB frame allows; the file is the daemon's own).
MAX_WARM_BYTES = 64 << 20
#: How often the joiners' ready files are looked for while a warm resize waits on them.
READY_POLL_S = 0.01
#: The name of a joiner's ready file (``api.resize.ready_name``; kept in step by a test).
READY_NAME = "resize-ready-{generation}-{rank}"
#: Largest control file read.
MAX_CONTROL_BYTES = 4096
#: Seconds the log copiers (``logcap``) get to finish once the replicas have ended.
LOG_DRAIN_S = 1.0


def combine_exit_codes(codes_in_exit_order: Sequence[int]) -> int:
    """A group's exit code: 0 if all succeeded, the first failure's code if any replica
    failed (neither 0 nor 75), else 75 (all checkpointed for a rescale)."""
    for code in codes_in_exit_order:
        if code not in (0, RESCALE_EXIT_CODE):
            return code
    if any(code == RESCALE_EXIT_CODE for code in codes_in_exit_order):
        return RESCALE_EXIT_CODE
    return 0


def _stat_field(pid: int, index: int) -> int | None:
    """Field ``index`` of ``/proc/PID/stat`` counted from the one after the command's name
    (0: the state; 2: the process group; 19: the start time), ``None``: no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            data = fh.read()
    except OSError:
        return None
    try:
        return int(data[data.rindex(b")") + 2 :].split()[index])
    except (ValueError, IndexError):
        return None


def proc_start_time(pid: int) -> int | None:
    """The start time of process ``pid`` in clock ticks since boot (``None``: no such
    process)."""
    return _stat_field(pid, 19)


def boot_id() -> str:
    """This boot's id (``/proc/sys/kernel/random/boot_id``; empty when unknown)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as fh:
            return fh.read().strip()
    except OSError:
        return ""


def read_until_closed(
    ends: dict[int, int], deadline: float, settled: bytes = b"", settled_wait_s: float = 1.0
) -> dict[int, str]:
    """Read each pipe of ``ends`` (key -> read end) until its writer closes it, or until
    ``deadline`` (monotonic): key -> what was read, for the pipes closed in time.  A pipe
    whose text begins with ``settled`` is waited for at most ``settled_wait_s`` more, and
    taken as it is then.  Every read end is closed here."""
    chunks: dict[int, list[bytes]] = {key: [] for key in ends}
    open_ends = {fd: key for key, fd in ends.items()}
    own_deadline: dict[int, float] = {}  # fd -> when a settled pipe is taken as it is
    done: dict[int, str] = {}
    poller = select.poll()
    for fd in open_ends:
        poller.register(fd, select.POLLIN | select.POLLHUP)

    def finish(fd: int) -> None:
        key = open_ends.pop(fd)
        poller.unregister(fd)
        done[key] = b"".join(chunks[key]).decode(errors="replace")

    try:
        while open_ends:
            now = time.monotonic()
            for fd in [fd for fd, at in own_deadline.items() if at <= now and fd in open_ends]:
                finish(fd)
            if not open_ends:
                break
            until = min([deadline, *(own_deadline[fd] for fd in open_ends if fd in own_deadline)])
            left_ms = int((until - now) * 1000)
            if left_ms <= 0:
                if until >= deadline:
                    break
                continue
            for fd, _ in poller.poll(left_ms):
                try:
                    chunk = os.read(fd, 4096)
                except InterruptedError:
                    continue
                if not chunk:
                    finish(fd)
                    continue
                key = open_ends[fd]
                chunks[key].append(chunk)
                if settled and fd not in own_deadline and b"".join(chunks[key]).startswith(settled):
                    own_deadline[fd] = time.monotonic() + settled_wait_s
    finally:
        for fd in ends.values():
            with contextlib.suppress(OSError):
                os.close(fd)
    return done


def proc_group(pid: int) -> int | None:
    """The process group of process ``pid`` (``None``: no such process)."""
    return _stat_field(pid, 2)


def signal_group_of(pgid: int, signum: int, members: Iterable[tuple[int, int | None]]) -> bool:
    """``killpg(pgid, signum)``, but only while a process known to be the job's is in that
    group: a ``(pid, start time)`` still that process (start ``None``: a process seen below
    this one just now).  A group's id is given out again once no process is in it: a job whose
    leader exited and whose other processes left the group could otherwise have the id taken
    by another user's new group, which a stop would then signal as root.  ``True`` when
    signalled."""
    if pgid <= 1:
        return False
    for pid, start in members:
        if (start is None or proc_start_time(pid) == start) and proc_group(pid) == pgid:
            with contextlib.suppress(OSError):
                os.killpg(pgid, signum)
            return True
    return False


def parent_of(pid: int) -> int | None:
    """``pid``'s parent (``/proc/PID/stat``), ``None`` when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            rest = fh.read().rpartition(b")")[2].split()
    except OSError:
        return None
    return int(rest[1]) if len(rest) > 1 else None


def descendants(root: int) -> list[int]:
    """Every process below ``root`` in the process tree (children first; the node agent's
    listing, :func:`~pollux_local.launch.node_agent.descendants`, without start times)."""
    return [pid for pid, _ in process_tree_below(root)]


def write_private_json(path: str, data: dict[str, Any]) -> None:
    """Replace ``path`` with ``data`` atomically (a 0600 temporary file, fsync, rename)."""
    tmp = f"{path}.{os.getpid()}.tmp"
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, json.dumps(data, separators=(",", ":")).encode() + b"\n")
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def read_own_json(path: object, limit: int) -> dict[str, Any] | None:
    """A JSON object from a regular file of this process's user at ``path`` (never through a
    symlink, never blocking on a FIFO; one over ``limit`` bytes is refused), else ``None``."""
    if not path:
        return None
    try:
        fd = os.open(str(path), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid():
            return None
        if info.st_size > limit:
            return None
        data = json.loads(os.pread(fd, info.st_size, 0) or b"null")
        return data if isinstance(data, dict) else None
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)


def write_public_text(path: str, text: str) -> None:
    """Replace ``path`` with ``text``, readable by all (0644): a temporary file beside it,
    then a rename (the directory is the daemon's)."""
    tmp = f"{path}.{os.getpid()}.tmp"
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        os.fchmod(fd, 0o644)
        os.write(fd, text.encode())
    finally:
        os.close(fd)
    os.replace(tmp, path)


class SetupFailed(Exception):
    """A replica's child could not be prepared (``code`` is its exit code)."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


def open_log(path: str) -> int:
    """The replica's log opened for appending as the job's user: created 0644 when absent;
    a symlink, FIFO or anything but a plain file is refused."""
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY
    try:
        fd = os.open(path, flags | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise SetupFailed(SETUP_EXIT_CODE, f"log file {path} is a symlink") from None
        if exc.errno == errno.ENXIO:
            raise SetupFailed(SETUP_EXIT_CODE, f"log file {path} is not a regular file") from None
        raise SetupFailed(SETUP_EXIT_CODE, f"cannot open log file {path}: {exc.strerror}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise SetupFailed(SETUP_EXIT_CODE, f"log file {path} is not a regular file")
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    return fd


#: The name of the FIFO in the job's directory that rank 0 reads as its stdin (``--stdin``;
#: ``pollux-local send`` writes to it).
STDIN_NAME = "stdin"


def open_stdin_fifo(path: str, uid: int) -> int:
    """The job's input FIFO ``path`` (``JOB_DIR/stdin``), made 0600 when absent, opened for
    reading and writing (so the open never blocks, and the reader never sees an end of file
    between two senders) as the job's user ``uid``: a symlink, anything but a FIFO, or a FIFO
    another user owns is refused (:class:`SetupFailed`), never used."""
    mask = os.umask(0o077)
    try:
        os.mkfifo(path, 0o600)
    except FileExistsError:
        pass  # an earlier incarnation's: reused, once checked below
    except OSError as exc:
        raise SetupFailed(
            SETUP_EXIT_CODE, f"cannot make the input FIFO {path}: {exc.strerror}"
        ) from None
    finally:
        os.umask(mask)
    flags = os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise SetupFailed(SETUP_EXIT_CODE, f"input FIFO {path} is a symlink") from None
        raise SetupFailed(
            SETUP_EXIT_CODE, f"cannot open input FIFO {path}: {exc.strerror}"
        ) from None
    info = os.fstat(fd)
    problem = None
    if not stat.S_ISFIFO(info.st_mode):
        problem = f"input FIFO {path} is not a FIFO"
    elif info.st_uid != uid:
        problem = f"input FIFO {path} belongs to uid {info.st_uid}, not the job's user"
    if problem is not None:
        os.close(fd)
        raise SetupFailed(SETUP_EXIT_CODE, problem)
    os.fchmod(fd, 0o600)
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    return fd


def drop_privileges(user: dict[str, Any] | None) -> None:
    """Become the job's user for the replica's setup (``identity.become_user_for_setup``:
    groups, gid and effective uid; root stays the real and saved uid, so that the user cannot
    stop the child before it runs the command) when ``user`` is given."""
    try:
        become_user_for_setup(user)
    except IdentityError as exc:
        raise SetupFailed(SETUP_EXIT_CODE, str(exc)) from None


def replica_child(
    spec: dict[str, Any],
    replica: dict[str, Any],
    pgid: int,
    report: int,
    group: cgroups.JobGroup | None = None,
    fence: Fence | None = None,
) -> NoReturn:
    """In a forked child: become the replica (see the module's docstring); never returns.  A
    failure is written to ``report`` (``CODE MESSAGE``) and ends the child with CODE."""
    log_fd = -1
    code = SETUP_EXIT_CODE
    try:
        os.setpgid(0, pgid)
        restore_oom_score()
        signal.pthread_sigmask(signal.SIG_SETMASK, set())
        for signum in (signal.SIGPIPE, signal.SIGXFSZ, signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, signal.SIG_DFL)
        if group is not None:  # still root: the job cannot move itself out again
            try:
                group.add(os.getpid())
            except cgroups.CgroupError as exc:
                raise SetupFailed(SETUP_EXIT_CODE, str(exc)) from None
        if fence is not None:  # a group of its own below the fence (on v2: below the limits')
            try:
                fence.replica(os.getpid()).add(os.getpid())
            except FenceError as exc:
                raise SetupFailed(SETUP_EXIT_CODE, str(exc)) from None
        drop_privileges(spec.get("user"))
        umask = spec.get("umask")
        if umask is not None:  # the submitter's: what the job creates is as private as theirs
            os.umask(int(umask) & 0o777)
        job_dir = str(spec["job_dir"])
        try:
            os.makedirs(job_dir, exist_ok=True)
        except OSError as exc:
            raise SetupFailed(
                SETUP_EXIT_CODE, f"cannot create job directory {job_dir}: {exc.strerror}"
            ) from None
        log_fd = open_log(os.path.join(job_dir, str(replica["log"])))
        os.write(log_fd, str(replica.get("banner", "")).encode())
        if spec.get("max_log_bytes"):  # output through a copier that stops at the limit
            log_fd = logcap.capped_log(
                log_fd, int(spec["max_log_bytes"]), keep_free=int(spec.get("log_keep_free") or 0)
            )
        checkpoint = spec.get("checkpoint_dir")
        if checkpoint:  # made as the user, and theirs alone (not one planted there first)
            problem = make_own_directory(str(checkpoint))
            if problem is not None:
                raise SetupFailed(SETUP_EXIT_CODE, f"refusing the checkpoint dir: {problem}")
        workdir = str(spec["workdir"])
        try:
            os.chdir(workdir)
        except OSError as exc:
            raise SetupFailed(
                WORKDIR_EXIT_CODE, f"cannot enter working directory {workdir}: {exc.strerror}"
            ) from None
        if spec.get("stdin") and int(replica["rank"]) == 0:  # ``--stdin``: rank 0 reads it
            stdin_fd = open_stdin_fifo(os.path.join(job_dir, STDIN_NAME), os.geteuid())
        else:
            stdin_fd = os.open(os.devnull, os.O_RDONLY)
        os.dup2(stdin_fd, 0)
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        argv = [str(arg) for arg in replica["argv"]]
        env = {str(k): str(v) for k, v in dict(replica["env"]).items()}
        open_files = spec.get("open_files")
        if open_files:  # what the job would have started by hand (the daemon raised its own)
            _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
            with contextlib.suppress(OSError, ValueError):
                resource.setrlimit(resource.RLIMIT_NOFILE, (min(int(open_files), hard), hard))
        os.write(report, SETTLED)  # the supervisor waits for the rest SETTLED_WAIT_S at most
        try:
            settle_ids()  # the user's in every way from here: the command is theirs
        except IdentityError as exc:
            raise SetupFailed(SETUP_EXIT_CODE, str(exc)) from None
        code = EXEC_EXIT_CODE
        try:
            os.execvpe(argv[0], argv, env)
        except OSError as exc:
            raise SetupFailed(EXEC_EXIT_CODE, f"cannot execute {argv[0]}: {exc.strerror}") from None
    except SetupFailed as exc:
        code, message = exc.code, one_line(str(exc))
    except BaseException as exc:  # noqa: BLE001 - whatever it is, the child must not return
        message = one_line(f"cannot start the replica: {exc!r}")
    with contextlib.suppress(BaseException):
        if log_fd >= 0:
            os.write(log_fd, f"pollux-local: {message}\n".encode())
        os.write(report, f"{code} {message}".encode())
    os._exit(code)


class Supervisor:
    """The replicas of one incarnation, their process group and their descendants."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = spec
        self.pid = os.getpid()
        self.start_time = proc_start_time(self.pid)
        self.boot_id = boot_id()
        self.started = time.time()
        self.pgid = 0
        self.replicas: dict[int, dict[str, Any]] = {}  # pid -> record
        self.codes: list[int] = []  # in exit order
        self.error: str | None = None
        self.kill_at: float | None = None  # monotonic time of the SIGKILL
        self.terminated = False  # SIGTERM sent to the group
        self.killed = False
        #: the incarnation's cgroups (``limits`` in the spec), made by :meth:`make_cgroups`
        self.cgroup: cgroups.JobGroup | None = None
        #: the cgroup every replica and all it starts is in, ended as one at the end
        #: (:meth:`make_fence`)
        self.fence: Fence | None = None
        self.token = secrets.token_hex(4)
        self.oom_killed = False
        #: the newest warm resize request: where it stands (the run file's ``warm``)
        self.warm: dict[str, Any] | None = None
        self._warm_request: dict[str, Any] | None = None
        self._ready_deadline: float | None = None
        self._joining: set[int] = set()  # pids of joiners not yet ordered in

    # --- limits -----------------------------------------------------------------------------

    def memory_limit(self) -> int | None:
        limits = self.spec.get("limits")
        return int(limits["memory"]) if limits and limits.get("memory") else None

    def make_cgroups(self) -> None:
        """The incarnation's cgroups with the spec's ``limits`` written (none without them);
        a failure becomes the incarnation's setup error."""
        data = self.spec.get("limits")
        if not data:
            return
        try:
            limits = cgroups.Limits.from_json(data)
            self.cgroup = cgroups.JobGroup.create(limits, self.group_name())
        except (cgroups.CgroupError, KeyError, TypeError, ValueError) as exc:
            self.error = one_line(f"cannot set the job's limits: {exc}")

    def group_name(self) -> str:
        """The incarnation's cgroups' name (:func:`cgroups.group_name`, with a token of this
        supervisor's: no other daemon's or earlier supervisor's group has it)."""
        return cgroups.group_name(
            str(self.spec["job_id"]),
            int(self.spec.get("incarnation") or 0),
            cgroups.daemon_key(os.path.dirname(str(self.spec["run_file"]))),
            self.token,
        )

    def make_fence(self) -> None:
        """The incarnation's fence (``node_agent.Fence``): on cgroup v2 the group of its limits
        when it has one (a process is in one group of a hierarchy), else a group of its own.
        Where none can be made (cgroups not writable: a daemon not run as root, most often)
        the job runs without one, said in one line on stderr: what a replica leaves behind
        is then killed by pid only, which a process that keeps changing its pid escapes."""
        if self.cgroup is not None and self.cgroup.limits.support.version == 2:
            for path in self.cgroup.paths:
                kind = Fence.kind_of(path)
                if kind is not None:
                    self.fence = Fence(path, kind, owned=False)
                    return
        try:
            self.fence = Fence.make(self.group_name())
        except (FenceError, cgroups.CgroupError, KeyError, TypeError, ValueError) as exc:
            print(
                f"pollux-local supervisor: no fence for the job's processes: {one_line(str(exc))}",
                file=sys.stderr,
            )

    def end_replica_group(self, pid: int) -> None:
        """A replica left the job while the others run on: kill what it left behind (its
        group below the fence, ``Fence.end_replica``)."""
        if self.fence is not None:
            self.fence.end_replica(pid)

    def end_fence(self) -> None:
        """Kill everything left in the fence, as one."""
        if self.fence is not None and not self.fence.end():
            print(
                f"pollux-local supervisor: processes are left in {self.fence.path}",
                file=sys.stderr,
            )

    def release_cgroups(self) -> None:
        """Once nothing of the job is left: whether the OOM killer fired, then the groups
        removed (a failure is one line in the supervisor's output, the job is not failed
        for it)."""
        if self.fence is not None:
            self.fence.remove()  # (a group of the limits: only the replicas' groups below it)
            self.fence = None
        if self.cgroup is None:
            return
        sigkilled = any(code == -signal.SIGKILL for code in self.codes)
        self.oom_killed = self.cgroup.oom_killed(sigkilled)
        try:
            self.cgroup.remove()
        except cgroups.CgroupError as exc:
            print(f"pollux-local supervisor: {one_line(str(exc))}", file=sys.stderr)
        self.cgroup = None

    # --- starting ---------------------------------------------------------------------------

    def start(self) -> None:
        """Fork every replica (each joins the first one's process group) and learn from each
        whether it got as far as exec."""
        self.error, _ = self.spawn(self.spec["replicas"])

    def spawn(self, replicas: Sequence[dict[str, Any]]) -> tuple[str | None, list[int]]:
        """Fork ``replicas`` into the incarnation's process group: the first setup failure
        (``"rank R: why"``, or ``None`` when each got as far as exec) and their pids."""
        error: str | None = None
        reports: list[tuple[int, int]] = []  # (pid, read end)
        for replica in replicas:
            read_end, write_end = os.pipe()
            pid = os.fork()
            if pid == 0:
                os.close(read_end)
                replica_child(self.spec, replica, self.pgid, write_end, self.cgroup, self.fence)
            os.close(write_end)
            if self.pgid == 0:
                self.pgid = pid
            with contextlib.suppress(OSError):
                os.setpgid(pid, self.pgid)
            self.replicas[pid] = {
                "rank": int(replica["rank"]),
                "pid": pid,
                "start_time": proc_start_time(pid),
                "exit_code": None,
                "error": None,
            }
            reports.append((pid, read_end))
        texts = read_until_closed(
            dict(reports), time.monotonic() + SPAWN_TIMEOUT_S, SETTLED, SETTLED_WAIT_S
        )
        for pid, _ in reports:
            text = texts.get(pid)
            if text is None:  # still setting up: killed (it never ran the command)
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
                text = f"{SETUP_EXIT_CODE} did not reach its command within {SPAWN_TIMEOUT_S:g} s"
            # settled as the user: its command is its own from there (an exec that fails
            # after the wait is seen as the replica's exit code)
            text = text.removeprefix(SETTLED.decode())
            if text:
                _, _, message = text.partition(" ")
                self.replicas[pid]["error"] = message
                if error is None:
                    error = f"rank {self.replicas[pid]['rank']}: {message}"
        return error, [pid for pid, _ in reports]

    # --- signals and processes --------------------------------------------------------------

    def live(self) -> list[int]:
        return [pid for pid, rec in self.replicas.items() if rec["exit_code"] is None]

    def signal_group(self, signum: int) -> None:
        """Signal the incarnation's process group while a process below this one is in it
        (:func:`signal_group_of`)."""
        if self.pgid:
            signal_group_of(self.pgid, signum, ((pid, None) for pid in descendants(self.pid)))

    def stop(self, grace_s: float) -> None:
        """SIGTERM the group (once), SIGKILL everything ``grace_s`` from now (or earlier)."""
        if not self.terminated:
            self.terminated = True
            self.signal_group(signal.SIGTERM)
        deadline = time.monotonic() + max(0.0, grace_s)
        if self.kill_at is None or deadline < self.kill_at:
            self.kill_at = deadline

    def kill_all(self) -> None:
        """SIGKILL the fence (everything of the job in it), the group and every descendant
        of this process."""
        self.killed = True
        self.end_fence()
        self.signal_group(signal.SIGKILL)
        for pid in descendants(self.pid):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)

    def control_grace(self) -> float:
        """The grace of the daemon's latest stop request (its control file), else the spec's."""
        grace = float(self.spec.get("grace_s", 60.0))
        data = read_own_json(self.spec.get("control_file"), MAX_CONTROL_BYTES)
        if data is None:
            return grace
        try:
            value = float(data.get("grace_s", grace))
        except (TypeError, ValueError):
            return grace
        return value if value >= 0 else grace

    def reap(self) -> None:
        """Collect every child that ended: replicas get their exit codes (-N when killed by
        signal N), anything else (an orphan it adopted) is just reaped."""
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            except InterruptedError:
                continue
            if pid == 0:
                return
            record = self.replicas.get(pid)
            if record is None or record["exit_code"] is not None:
                continue
            code = os.waitstatus_to_exitcode(status)
            record["exit_code"] = code
            if record.get("left"):  # a joiner killed when its resize failed: not the job's exit
                self.end_replica_group(pid)
                continue
            if pid in self._joining:  # a joiner that never joined: the resize failed
                self._joining.discard(pid)
                record["left"] = True
                self.end_replica_group(pid)
                self.warm_failed(f"joining rank {record['rank']} exited with {code} first")
                continue
            self.codes.append(code)
            warm = self.warm
            if (
                code == 0
                and warm is not None
                and warm["state"] == "ordered"
                and int(record["rank"]) >= int(warm["world_size"])
            ):
                record["left"] = True  # left the job at a warm shrink
                self.end_replica_group(pid)  # before the daemon gives its device away
                self.write("running")
            if code not in (0, RESCALE_EXIT_CODE) and not self.terminated:
                # a crashed replica leaves its peers blocked in collectives: stop them
                self.stop(float(self.spec.get("failure_grace_s", FAILURE_GRACE_S)))

    def supervise(self) -> None:
        """Until every replica has ended: take signals, forward stops, escalate on time."""
        while True:
            self.reap()
            if not self.live():
                return
            timeout = 3600.0
            if self.kill_at is not None and not self.killed:
                timeout = self.kill_at - time.monotonic()
                if timeout <= 0:
                    self.kill_all()
                    continue
            if self._joining:
                self.check_joiners()
                timeout = min(timeout, READY_POLL_S)
            info = signal.sigtimedwait(WAITED, max(0.0, timeout))
            if info is None:
                continue
            if info.si_signo in (signal.SIGTERM, signal.SIGINT):
                self.warm_failed("the job is stopping")
                self.stop(self.control_grace())
            elif info.si_signo == signal.SIGUSR1:
                self.take_warm_request()

    # --- warm resizes -----------------------------------------------------------------------

    def take_warm_request(self) -> None:
        """Read the daemon's newest warm resize request and start on it (a request not newer
        than the last one, or one while stopping, is ignored)."""
        request = read_own_json(self.spec.get("warm_file"), MAX_WARM_BYTES)
        if request is None or self.terminated:
            return
        try:
            generation = int(request["generation"])
            world_size = int(request["world_size"])
            joiners = list(request.get("joiners") or ())
            str(request["order_file"]), str(request["order"])
            timeout_s = float(request.get("ready_timeout_s") or 60.0)
        except (KeyError, TypeError, ValueError):
            return
        if self.warm is not None and generation <= int(self.warm["generation"]):
            return
        if self._joining:
            self.warm_failed("a newer resize came")
        self.warm = {
            "generation": generation,
            "world_size": world_size,
            "state": "joining",
            "error": None,
        }
        self._warm_request = request
        error, started = self.spawn(joiners)
        for pid in started:
            self.replicas[pid]["joining"] = generation
        self._joining = {pid for pid in started if self.replicas[pid]["exit_code"] is None}
        if error is not None:
            self.warm_failed(error)
            return
        self._ready_deadline = time.monotonic() + max(0.0, timeout_s)
        self.check_joiners()

    def check_joiners(self) -> None:
        """Order the resize once every joiner is ready; give up at the deadline."""
        warm, request = self.warm, self._warm_request
        if warm is None or request is None or warm["state"] != "joining":
            return
        job_dir = str(self.spec["job_dir"])
        generation = int(warm["generation"])
        ranks = [int(self.replicas[pid]["rank"]) for pid in self._joining]
        ready = all(
            os.path.lexists(
                os.path.join(job_dir, READY_NAME.format(generation=generation, rank=rank))
            )
            for rank in ranks
        )
        if not ready:
            if self._ready_deadline is not None and time.monotonic() > self._ready_deadline:
                self.warm_failed("the joining replicas were not ready in time")
            return
        try:
            write_public_text(str(request["order_file"]), str(request["order"]))
        except OSError as exc:
            self.warm_failed(f"cannot write the resize order: {exc.strerror}")
            return
        for pid in self._joining:
            self.replicas[pid].pop("joining", None)
        self._joining.clear()
        warm["state"] = "ordered"
        if isinstance(request.get("launch"), dict):
            self.spec["launch"] = request["launch"]
        self.write("running")

    def warm_failed(self, why: str) -> None:
        """The warm resize under way failed before its order: its joiners are killed and
        forgotten (the running replicas never saw an order)."""
        warm = self.warm
        if warm is None or warm["state"] != "joining":
            return
        for pid in self._joining:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
            self.replicas[pid]["left"] = True
        self._joining.clear()
        warm["state"] = "failed"
        warm["error"] = one_line(why)
        self.write("running")

    def drain_failed_logs(self) -> None:
        """A replica that failed its setup wrote why to its log; through a copier
        (``logcap``, ``max_log_bytes``) that line is still in the copier's pipe when the
        child ends.  Such a copier, its replica gone, is this process's child (a subreaper's
        orphan): it is given :data:`LOG_DRAIN_S` to write the line out and end before
        :meth:`kill_all` kills everything.  A copier whose replica still runs has that
        replica as its parent and is not waited for."""
        until = time.monotonic() + LOG_DRAIN_S
        while time.monotonic() < until:
            self.reap()
            orphans = [
                pid
                for pid in logcap.live_copiers(descendants(self.pid))
                if parent_of(pid) == self.pid
            ]
            if not orphans:
                return
            time.sleep(0.02)

    def clean_up(self) -> None:
        """Kill whatever is left below this process (the group, adopted orphans and their
        descendants) and reap it, until nothing is left.  The log copiers are given
        :data:`LOG_DRAIN_S` first to write out what the replicas printed last."""
        drain_until = time.monotonic() + LOG_DRAIN_S
        while logcap.live_copiers(descendants(self.pid)) and time.monotonic() < drain_until:
            self.reap()
            time.sleep(0.02)
        self.end_fence()
        for _ in range(200):
            self.signal_group(signal.SIGKILL)
            left = descendants(self.pid)
            for pid in left:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
            self.reap()
            if not left:
                try:
                    os.waitpid(-1, os.WNOHANG)
                except ChildProcessError:
                    return
            time.sleep(0.02)

    # --- the run file -----------------------------------------------------------------------

    def record(self, state: str) -> dict[str, Any]:
        ended = state in ("ended", EXITED)
        replicas = sorted(
            (r for r in self.replicas.values() if not r.get("left") and not r.get("joining")),
            key=lambda r: int(r["rank"]),
        )

        return {
            "version": RUN_FILE_VERSION,
            "job_id": str(self.spec["job_id"]),
            "state": state,
            "supervisor": {"pid": self.pid, "start_time": self.start_time, "boot_id": self.boot_id},
            "pgid": self.pgid,
            "replicas": replicas,
            "exit_code": combine_exit_codes(self.codes) if ended else None,
            "error": self.error,
            "started": self.started,
            "ended": time.time() if ended else None,
            "cgroups": self.cgroup_paths(),
            "oom_killed": self.oom_killed,
            "memory_limit": self.memory_limit(),
            "launch": self.spec.get("launch") or {},
            "warm": dict(self.warm) if self.warm is not None else None,
        }

    def cgroup_paths(self) -> list[str]:
        """The incarnation's cgroups that exist: its limits' and its fence."""
        paths = list(self.cgroup.paths) if self.cgroup is not None else []
        if self.fence is not None and self.fence.path not in paths:
            paths.append(self.fence.path)
        return paths

    def write(self, state: str) -> None:
        """Write the run file; on a full disk, again with a back-off (up to 5 s) until there is
        room: the daemon takes the result in once this process has ended."""
        delay = 0.5
        while True:
            try:
                write_private_json(str(self.spec["run_file"]), self.record(state))
                return
            except OSError as exc:
                if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                    raise
            time.sleep(delay)
            delay = min(5.0, 2 * delay)


def say(line: dict[str, Any]) -> None:
    """The one line on stdout, then stdout closed (nothing more goes to the daemon there)."""
    with contextlib.suppress(OSError):
        os.write(1, json.dumps(line, separators=(",", ":")).encode() + b"\n")
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    os.close(null)


#: The ``oom_score_adj`` the supervisor had before it protected itself (``None``: unchanged),
#: which each replica takes back before it becomes its user.
_replica_oom_score: str | None = None


def restore_oom_score() -> None:
    """In a replica's child: take back the ``oom_score_adj`` the supervisor gave up (so the
    job, not its supervisor, is what the OOM killer picks); a failure fails the setup (no
    replica runs unkillable)."""
    if _replica_oom_score is None:
        return
    try:
        with open(OOM_SCORE_ADJ, "w") as fh:
            fh.write(_replica_oom_score)
    except OSError as exc:
        raise SetupFailed(
            SETUP_EXIT_CODE, f"cannot take back the OOM score: {exc.strerror}"
        ) from None


def run(spec: dict[str, Any]) -> int:
    """Supervise one incarnation; the supervisor's own exit status (0 once the result is
    written).  The OOM killer spares the supervisor where it may (``oom_score_adj`` -1000,
    :func:`~pollux_local.launch.node_agent.protect_from_oom`): a job filling the machine's
    memory must not leave its replicas unsupervised (a ``setsid`` grandchild would outlive
    the incarnation on devices given to the next job)."""
    global _replica_oom_score
    signal.pthread_sigmask(signal.SIG_BLOCK, WAITED)
    make_subreaper()
    _replica_oom_score = protect_from_oom()
    supervisor = Supervisor(spec)
    try:
        return supervised(supervisor)
    except BaseException:
        # A fault of the supervisor itself: nothing of the job outlives it.  The run file
        # is left without a result, so the daemon fails the start or the incarnation
        # (``LocalReplicaGroup._finish``) and kills what the file lists.
        for end in (supervisor.kill_all, supervisor.clean_up, supervisor.release_cgroups):
            with contextlib.suppress(BaseException):
                end()
        raise


def supervised(supervisor: Supervisor) -> int:
    """:func:`run` once the supervisor is made.  The run file lists the incarnation's
    cgroups (the fence among them) before any replica starts, so that a supervisor killed
    while it starts them leaves nothing the daemon does not know of."""
    supervisor.make_cgroups()
    if supervisor.error is None:
        supervisor.make_fence()
        supervisor.write("starting")
        supervisor.start()
    if supervisor.error is not None:
        supervisor.drain_failed_logs()
        supervisor.kill_all()
        supervisor.clean_up()
        supervisor.release_cgroups()
        supervisor.write("ended")
        say({"ok": False, "error": supervisor.error})
        return 0
    supervisor.write("running")
    say(
        {
            "ok": True,
            "pid": supervisor.pid,
            "start_time": supervisor.start_time,
            "pgid": supervisor.pgid,
            "replicas": supervisor.record("running")["replicas"],
        }
    )
    supervisor.supervise()
    # every replica's exit is known: kept before the clean-up (up to seconds: a log drained,
    # what the job left killed), so that a supervisor dying there leaves the result, not a
    # finished job to be run again; one try (a full disk: the "ended" write waits for room)
    with contextlib.suppress(OSError):
        write_private_json(str(supervisor.spec["run_file"]), supervisor.record(EXITED))
    supervisor.clean_up()
    supervisor.release_cgroups()
    supervisor.write("ended")
    return 0


def read_spec(lines: Iterable[str]) -> dict[str, Any]:
    for line in lines:
        spec = json.loads(line)
        if not isinstance(spec, dict) or spec.get("version") != RUN_FILE_VERSION:
            raise ValueError("not a version-1 launch spec")
        return spec
    raise ValueError("no launch spec on stdin")


def main() -> None:
    try:
        spec = read_spec(sys.stdin)
    except ValueError as exc:
        say({"ok": False, "error": one_line(f"bad launch spec: {exc}")})
        sys.exit(2)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    sys.exit(run(spec))


if __name__ == "__main__":
    main()
