"""Job-end notifications: the daemon's outbox of job ends (``StateStore.pending_ends``) turned
into a command hook, a desktop notification and the owner's own destinations.

For every end taken from the outbox, :class:`Notifier` starts, in the background:

* the ``[notify] command`` hook: ``/bin/sh -c COMMAND`` as the job's owner, in the owner's home
  (``/`` when it has none), with a clean environment (``PATH``, ``HOME``, ``USER``, ``LOGNAME``)
  and the job's facts (:func:`job_environ`); ``[notify] on = "failure"``: failed jobs only;
* with ``[notify] desktop = true``: ``notify-send`` as the owner, on the owner's session bus
  (``/run/user/UID/bus``), only when that socket exists;
* the sender (:mod:`pollux_local.daemon.notify_send`), as the owner: it reads the owner's
  ``~/.config/pollux-local/notify.toml`` itself and sends to those URLs and the job's own
  (``submit --notify URL``), through ``apprise`` when installed.

Security: every process runs as the job's owner (a daemon run by root drops to the owner's uid,
gid and groups before exec; a daemon not run by root only notifies for its own user's jobs) and
the daemon never opens, reads or stats anything in a user's home: what a user controls is read
by a process with only that user's rights.

Delivery is at most once: an end is marked announced right before its processes start, so a
daemon that dies while sending never sends it again (nor loops resending an end that makes it
die); an end not started stays in the outbox, sent after a restart.

Fair between users, whatever one of them does: every owner has a queue of its own (at most
:data:`QUEUED_PER_OWNER` ends in memory; the rest wait in the outbox), the queues are served
round robin, an owner has at most :data:`SENDERS_PER_OWNER` ends being sent at once (all
owners together :data:`MAX_ENDS_AT_ONCE`), and each process is given :data:`SEND_TIMEOUT_S`,
then its process group is killed.  So one user's hooks that hang, or thousands of ends of a
cancelled array, delay only that user's notifications: another's starts as soon as its end is
recorded.  An owner with more than ``[limits] notify_backlog_per_user`` ends waiting in the
outbox has the oldest beyond it dropped (marked announced, never sent), logged once until its
backlog has drained.  A failure is one line in the daemon's log and never touches the job.

The text a job controls (its name, its reason) is made printable
(:func:`pollux_local.untrusted.printable`) in every notification, and escaped as markup for the
desktop, whose notification daemons read ``<b>`` and ``<a href>`` in a body.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import html
import json
import logging
import os
import shutil
import signal
import stat
import subprocess
import sys
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pollux_local.api.states import JobState
from pollux_local.daemon import notify_send
from pollux_local.daemon.auth import account, owner_gone
from pollux_local.daemon.config import DaemonConfig
from pollux_local.daemon.state import JobEnd, JobRecord, StateStore
from pollux_local.launch.identity import as_user_argv
from pollux_local.launch.supervisor import proc_start_time, signal_group_of
from pollux_local.untrusted import one_line, printable

__all__ = [
    "MAX_ENDS_AT_ONCE",
    "QUEUED_PER_OWNER",
    "SENDERS_PER_OWNER",
    "SEND_TIMEOUT_S",
    "Notifier",
    "job_environ",
]

log = logging.getLogger("pollux_local.daemon")

#: Ends whose notifications run at the same time, all owners together (each end runs up to
#: three processes).
MAX_ENDS_AT_ONCE = 16
#: Ends of one owner whose notifications run at the same time.
SENDERS_PER_OWNER = 2
#: Ends of one owner taken from the outbox into memory, at most; more wait in the outbox.
QUEUED_PER_OWNER = 16
#: Seconds one notification process may run before its process group is killed.
SEND_TIMEOUT_S = 10.0
#: Seconds :meth:`Notifier.close` waits for running notifications before killing them.
CLOSE_GRACE_S = 3.0
#: The PATH the owner's processes get.
USER_PATH = "/usr/local/bin:/usr/bin:/bin"
#: Bytes of a process's output kept for the log line.
OUTPUT_LIMIT = 4096
#: Seconds a process's output may stay open after it exited (something it left running).
OUTPUT_GRACE_S = 1.0
#: Characters of one environment value (a job's reason can be long).
VALUE_LIMIT = 2000
#: The interpreter tried when the daemon's own is not one every user may run.
SYSTEM_PYTHON = "/usr/bin/python3"


@dataclass(frozen=True)
class Owner:
    """Who a job's notifications run as: uid, gid, supplementary groups (``None``: the
    daemon's own, no switch) and the login facts of the environment."""

    uid: int
    gid: int
    groups: list[int] | None
    name: str
    home: str


def _on_fuse(path: str, mountinfo: str = "/proc/self/mountinfo") -> bool:
    """Whether a FUSE file system is mounted at ``path`` or on anything under it (read from
    ``mountinfo``: the mount point is its 5th field, the type the first after ``-``).  A
    user may mount one over their own ``/run/user/UID`` where ``/etc/fuse.conf`` allows
    ``user_allow_other``; its server could then leave the daemon's ``stat`` unanswered."""
    try:
        with open(mountinfo, encoding="utf-8", errors="replace") as fh:
            lines = fh.read().splitlines()
    except OSError:
        return False
    for line in lines:
        fields, _, rest = line.partition(" - ")
        parts = fields.split()
        if len(parts) < 5 or not rest.split()[:1]:
            continue
        point = parts[4].replace("\\040", " ")
        kind = rest.split()[0]
        if kind.startswith("fuse") and (point == path or point.startswith(path + "/")):
            return True
    return False


def _value(text: object) -> str:
    """An environment value: no NUL, at most :data:`VALUE_LIMIT` characters."""
    return str(text).replace("\x00", "")[:VALUE_LIMIT]


def job_environ(job: JobRecord, end: JobEnd, owner: Owner, path: str = USER_PATH) -> dict[str, str]:
    """The environment of a notification process: the owner's login basics and the job's
    facts (``POLLUX_JOB_ID``, ``_NAME``, ``_STATE``, ``_REASON``, ``_OWNER``, ``_WORKDIR``,
    ``_END_TIME``: Unix seconds, ``_RUN_TIME_S``, ``_ARRAY_ID``/``_ARRAY_INDEX`` for a task of
    an array)."""
    environ = {
        "PATH": path,
        "HOME": owner.home,
        "USER": owner.name,
        "LOGNAME": owner.name,
        "LANG": "C.UTF-8",
        "POLLUX_JOB_ID": job.job_id,
        "POLLUX_JOB_NAME": _value(job.name),
        "POLLUX_JOB_STATE": end.state.value,
        "POLLUX_JOB_REASON": _value(end.reason),
        "POLLUX_JOB_OWNER": _value(job.owner_name),
        "POLLUX_JOB_WORKDIR": _value(job.spec.workdir),
        "POLLUX_JOB_END_TIME": f"{end.time:.0f}",
        "POLLUX_JOB_RUN_TIME_S": f"{job.run_time_s:.0f}",
    }
    if job.spec.array_id is not None:
        environ["POLLUX_ARRAY_ID"] = job.spec.array_id
        environ["POLLUX_ARRAY_INDEX"] = str(job.spec.array_index or 0)
    return environ


def _shown(text: str, limit: int) -> str:
    """Text a job controls as one line of a notification: blanks collapsed, every control
    character an escape (``untrusted.printable``), at most ``limit`` characters."""
    shown = printable(" ".join(text.split()), newline=False)
    return shown if len(shown) <= limit else shown[: limit - 3] + "..."


def _runnable_by_everyone(path: str) -> bool:
    """Every directory above ``path`` (links resolved) may be entered and the file run by
    any user (mode bits only)."""
    real = Path(os.path.realpath(path))
    try:
        if not os.stat(real).st_mode & stat.S_IXOTH:
            return False
        return all(os.stat(parent).st_mode & stat.S_IXOTH for parent in real.parents)
    except OSError:
        return False


def _interpreter(switching_user: bool) -> str:
    """The Python the sender runs with: the daemon's own, unless another user must run it and
    cannot (a daemon run from root's home), then the system's."""
    if not switching_user or _runnable_by_everyone(sys.executable):
        return sys.executable
    return SYSTEM_PYTHON if os.access(SYSTEM_PYTHON, os.X_OK) else sys.executable


def _sender_source() -> str:
    """The sender's source text, run with ``python -c`` (no import of this package needed by
    an interpreter the owner runs)."""
    return Path(notify_send.__file__).read_text(encoding="utf-8")


class Notifier:
    """Announces the job ends of ``store``'s outbox with the notifications of
    ``config_getter()`` (read at every pass, so a reloaded config applies to the next end).
    ``daemon_uid``: the daemon's effective uid (0: it may run processes as any job's owner);
    ``timeout_s``: the most seconds one notification process may run; ``user_path``: the
    ``PATH`` they get (``notify-send`` is looked up on it)."""

    def __init__(
        self,
        store: StateStore,
        config_getter: Callable[[], DaemonConfig],
        daemon_uid: int,
        *,
        timeout_s: float = SEND_TIMEOUT_S,
        user_path: str = USER_PATH,
    ) -> None:
        self.store = store
        self.config_getter = config_getter
        self.daemon_uid = daemon_uid
        self.timeout_s = timeout_s
        self.user_path = user_path
        self._tasks: dict[int, asyncio.Task[None]] = {}
        #: each owner's ends taken from the outbox and not started, oldest first
        self._queues: dict[int, deque[JobEnd]] = {}
        #: the owners in the order they are served (round robin)
        self._turns: deque[int] = deque()
        #: ends being sent, by owner
        self._sending: dict[int, int] = {}
        #: the owner of each end taken (queued or being sent)
        self._owner_of: dict[int, int] = {}
        #: owners whose backlog went over the bound (logged once until it drains)
        self._over: set[int] = set()
        self._closing = False
        self._store_failed = False
        self._notify_send_missing_logged = False
        self._source: str | None = None

    @property
    def in_flight(self) -> int:
        """Ends taken from the outbox whose notifications have not finished."""
        return len(self._owner_of)

    async def announce_pending(self) -> int:
        """Take the outbox's pending ends into their owners' queues (at most
        :data:`QUEUED_PER_OWNER` each) and start as many as the bounds allow, in the
        background; the number taken.  Never raises."""
        if self._closing:
            return 0
        self._store_failed = False
        try:
            taken = self._take()
        except Exception:
            log.exception("notify: cannot read the outbox of job ends")
            return 0
        self._start_next()
        return taken

    def _backlog_bound(self) -> int:
        try:
            return max(1, int(self.config_getter().notify_backlog_per_user))
        except Exception:  # noqa: BLE001 - a broken config must not stop notifications
            return DaemonConfig.notify_backlog_per_user

    def _take(self) -> int:
        """Fill every owner's queue from the outbox; an owner over the backlog bound first has
        its oldest pending ends beyond it dropped (logged once)."""
        bound = self._backlog_bound()
        pending = self.store.pending_ends_by_owner(QUEUED_PER_OWNER)
        over = {uid for uid, (count, _) in pending.items() if count > bound}
        for uid in over:
            dropped = self.store.drop_oldest_ends(uid, keep=bound)
            queue = self._queues.get(uid)
            if queue:
                for end in queue:
                    self._owner_of.pop(end.seq, None)
                queue.clear()
            if uid not in self._over:
                self._over.add(uid)
                log.warning(
                    "notify: uid %s has more than %d job ends waiting to be announced"
                    " ([limits] notify_backlog_per_user); the %d oldest are dropped, and"
                    " further drops are not logged until its backlog has drained",
                    uid,
                    bound,
                    dropped,
                )
        if over:
            pending = self.store.pending_ends_by_owner(QUEUED_PER_OWNER)
        self._over &= set(pending)
        taken = 0
        for uid, (_, ends) in pending.items():
            queue = self._queues.setdefault(uid, deque())
            if uid not in self._turns:
                self._turns.append(uid)
            for end in ends:
                if end.seq in self._owner_of or len(queue) >= QUEUED_PER_OWNER:
                    continue
                queue.append(end)
                self._owner_of[end.seq] = uid
                taken += 1
        return taken

    def _start_next(self) -> None:
        """Start queued ends, owner after owner (round robin), while the bounds allow."""
        while not self._closing and len(self._tasks) < MAX_ENDS_AT_ONCE:
            for _ in range(len(self._turns)):
                uid = self._turns[0]
                self._turns.rotate(-1)
                queue = self._queues.get(uid)
                if queue and self._sending.get(uid, 0) < SENDERS_PER_OWNER:
                    end = queue.popleft()
                    self._sending[uid] = self._sending.get(uid, 0) + 1
                    task = asyncio.create_task(self._announce(end), name=f"notify-{end.seq}")
                    self._tasks[end.seq] = task
                    task.add_done_callback(functools.partial(self._forget, end.seq, uid))
                    break
            else:
                break
        for uid in [uid for uid in self._turns if not self._queues.get(uid)]:
            if not self._sending.get(uid):  # idle owners leave the round
                self._turns.remove(uid)
                self._queues.pop(uid, None)

    def _forget(self, seq: int, uid: int, _task: asyncio.Task[None]) -> None:
        self._tasks.pop(seq, None)
        self._owner_of.pop(seq, None)
        self._sending[uid] = max(0, self._sending.get(uid, 0) - 1)
        if self._closing:
            return
        if not self._queues.get(uid) and not self._store_failed:
            with contextlib.suppress(Exception):
                self._take()  # the owner's next ends, without waiting for a pass
        self._start_next()

    async def wait_idle(self, timeout_s: float | None = None) -> bool:
        """Wait until every notification taken has finished (tests, shutdown); whether they
        all did within ``timeout_s``."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout_s is None else loop.time() + timeout_s
        while self._tasks:
            left = None if deadline is None else deadline - loop.time()
            if left is not None and left <= 0:
                return False
            await asyncio.wait(list(self._tasks.values()), timeout=left)
        return not self._owner_of or self._closing

    async def close(self, grace_s: float = CLOSE_GRACE_S) -> None:
        """At daemon stop: take no more ends, give the running notifications ``grace_s``,
        then kill what is left (ends not started yet stay in the outbox, sent at the next
        start)."""
        self._closing = True
        self._queues.clear()
        self._owner_of = {seq: uid for seq, uid in self._owner_of.items() if seq in self._tasks}
        if not await self.wait_idle(grace_s):
            left = list(self._tasks.values())
            for task in left:
                task.cancel()
            await asyncio.gather(*left, return_exceptions=True)
        self._owner_of.clear()

    # --- one end ------------------------------------------------------------------------------

    async def _announce(self, end: JobEnd) -> None:
        """Send one end's notifications; marked announced right before its processes start.
        Logs, never raises."""
        try:
            if self._closing:
                return
            try:
                self.store.mark_announced(end.seq)
            except Exception:
                self._store_failed = True  # left in the outbox; taken again at a later pass
                raise
            await self._send(end)
        except asyncio.CancelledError:
            raise
        except Exception as error:  # noqa: BLE001 - a notification never affects anything else
            log.warning("notify: job %s: %s", end.job_id, one_line(repr(error)))

    def _owner(self, job: JobRecord) -> Owner | None:
        """Who runs ``job``'s notifications, or ``None`` (logged) when nobody may."""
        if self.daemon_uid != 0 and job.owner_uid != self.daemon_uid:
            log.info(
                "notify: job %s belongs to %s; a daemon not run by root notifies only for"
                " its own user's jobs",
                job.id,
                job.owner_name,
            )
            return None
        try:
            entry = account(job.owner_uid)
            gone = (
                None
                if job.owner_uid == self.daemon_uid
                else owner_gone(job.owner_uid, job.owner_name)
            )
        except OSError as exc:
            log.warning("notify: job %s: cannot look up its owner: %s", job.id, exc)
            return None
        if gone is not None:  # deleted, or its uid another account's now (``auth.is_owner``)
            log.warning("notify: job %s: %s", job.id, gone)
            return None
        if entry is None:  # the daemon's own user, with no account
            home = os.environ.get("HOME", "/")
            return Owner(job.owner_uid, job.owner_gid, None, job.owner_name, home)
        switching = self.daemon_uid == 0 and entry.pw_uid != os.geteuid()
        groups = os.getgrouplist(entry.pw_name, entry.pw_gid) if switching else None
        return Owner(entry.pw_uid, entry.pw_gid, groups, entry.pw_name, entry.pw_dir or "/")

    async def _send(self, end: JobEnd) -> None:
        job = self.store.get_job(end.job_id)
        if job is None:
            log.warning("notify: job %s of end %s is not in the store", end.job_id, end.seq)
            return
        owner = self._owner(job)
        if owner is None:
            return
        config = self.config_getter()
        failed = end.state is JobState.FAILED
        environ = job_environ(job, end, owner, self.user_path)
        sends = []
        if config.notify_command and (config.notify_on == "end" or failed):
            # the owner's shell enters the home itself: the daemon never looks into it
            script = 'cd -- "$HOME" 2>/dev/null || cd /\n' + config.notify_command
            sends.append(self._run("command", job, owner, ["/bin/sh", "-c", script], environ))
        if config.notify_desktop and (config.notify_on == "end" or failed):
            desktop = self._desktop_argv(job, end, owner)
            if desktop is not None:
                bus_environ = {
                    **environ,
                    "DBUS_SESSION_BUS_ADDRESS": f"unix:path=/run/user/{owner.uid}/bus",
                    "XDG_RUNTIME_DIR": f"/run/user/{owner.uid}",
                }
                sends.append(self._run("desktop", job, owner, desktop, bus_environ))
        sends.append(self._run_sender(job, end, owner, environ))
        await asyncio.gather(*sends)

    def _title_and_body(self, job: JobRecord, end: JobEnd) -> tuple[str, str]:
        """The notification's title and body as plain text, what the job controls (its name,
        its reason) made printable."""
        title = f"pollux-local: job {job.id} ({_shown(job.name, 80)}) {end.state.value}"
        return title, _shown(end.reason, 1000) or end.state.value

    def _desktop_argv(self, job: JobRecord, end: JobEnd, owner: Owner) -> list[str] | None:
        """``notify-send`` for this end, or ``None`` when the owner has no session bus (or
        this machine has no ``notify-send``: logged once)."""
        runtime = f"/run/user/{owner.uid}"
        if _on_fuse(runtime):  # the user's own mount there could leave the stat unanswered
            return None
        try:
            bus = os.stat(f"{runtime}/bus", follow_symlinks=False)
        except OSError:
            return None
        if not stat.S_ISSOCK(bus.st_mode) or bus.st_uid != owner.uid:
            return None
        program = shutil.which("notify-send", path=self.user_path)
        if program is None:
            if not self._notify_send_missing_logged:
                log.warning("notify: [notify] desktop is on but notify-send is not installed")
                self._notify_send_missing_logged = True
            return None
        title, body = self._title_and_body(job, end)
        urgency = "critical" if end.state is JobState.FAILED else "normal"
        # the body is read as markup by notification daemons: ``<a href>`` would be a link
        body = html.escape(body, quote=False)
        return [program, "--app-name=pollux-local", f"--urgency={urgency}", "--", title, body]

    async def _run_sender(
        self, job: JobRecord, end: JobEnd, owner: Owner, environ: dict[str, str]
    ) -> None:
        """The owner's destinations: the job's ``--notify`` URLs and the per-user file, read
        and sent by :mod:`notify_send` running as the owner."""
        if self._source is None:
            self._source = _sender_source()
        title, body = self._title_and_body(job, end)
        payload = {
            "title": title,
            "body": body,
            "failed": end.state is JobState.FAILED,
            "state": end.state.value,
            "urls": list(job.spec.notify),
            "on": job.spec.notify_on,
            "job": {
                key[len("POLLUX_JOB_") :].lower(): value
                for key, value in environ.items()
                if key.startswith("POLLUX_JOB_")
            },
        }
        python = _interpreter(owner.groups is not None)
        argv = [python, "-I", "-c", self._source]  # (isolated: no user site)
        await self._run("sender", job, owner, argv, environ, json.dumps(payload).encode())

    async def _run(
        self,
        what: str,
        job: JobRecord,
        owner: Owner,
        argv: list[str],
        environ: dict[str, str],
        stdin: bytes | None = None,
    ) -> None:
        """Run ``argv`` as ``owner`` in a session of its own, at most :data:`SEND_TIMEOUT_S`
        (then its process group is killed, while its leader is still the process started
        here: :func:`_kill_group`); a failure is one log line.  Its exit is waited for, not
        its output: something it left running that still holds the output a moment after
        it exited is no longer read (one log line), never waited for."""
        if owner.groups is not None:  # the owner's in every way, the daemon's keyring left
            argv = as_user_argv(owner.uid, owner.gid, owner.groups, argv)
        loop = asyncio.get_running_loop()
        try:
            transport, watched = await loop.subprocess_exec(
                functools.partial(_Watched, loop),
                *argv,
                stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                cwd="/",
                env=environ,
                start_new_session=True,
            )
        except (OSError, ValueError, subprocess.SubprocessError) as error:
            log.warning(
                "notify: job %s: %s as %s cannot start: %s", job.id, what, owner.name, error
            )
            return
        # the leader, as it is known from here on: its pid is its group's id (a session of
        # its own) until it is reaped; then both may be given to another user's process
        pid = transport.get_pid()
        leader = (pid, proc_start_time(pid))
        try:
            await self._wait(what, job, owner, transport, watched, leader, stdin)
        finally:
            _let_go(transport)

    async def _wait(
        self,
        what: str,
        job: JobRecord,
        owner: Owner,
        transport: asyncio.SubprocessTransport,
        watched: _Watched,
        leader: tuple[int, int | None],
        stdin: bytes | None,
    ) -> None:
        """Feed ``stdin``, wait for the exit (killing the group on time-out or cancellation),
        give its output :data:`OUTPUT_GRACE_S` to close, then log a failure with the tail of
        its output."""
        feed = transport.get_pipe_transport(0)
        if isinstance(feed, asyncio.WriteTransport):
            with contextlib.suppress(OSError, RuntimeError):
                feed.write(stdin or b"")
                feed.write_eof()
        try:
            await asyncio.wait_for(asyncio.shield(watched.exited), self.timeout_s)
        except (TimeoutError, asyncio.CancelledError) as error:
            if _kill_group(leader):  # its end and its group's (its output closed), a moment
                await asyncio.wait({watched.exited, watched.closed}, timeout=OUTPUT_GRACE_S)
            if isinstance(error, asyncio.CancelledError):
                raise
            log.warning(
                "notify: job %s: %s as %s did not finish in %.0f s; killed",
                job.id,
                what,
                owner.name,
                self.timeout_s,
            )
            return
        _, holding = await asyncio.wait({watched.closed}, timeout=OUTPUT_GRACE_S)
        if holding:
            # something it started still holds its output; its leader is gone, and with it
            # the one process known to be in its group: that id is signalled no more
            log.warning(
                "notify: job %s: %s as %s exited (exit %s) but left something running that"
                " holds its output; no longer read",
                job.id,
                what,
                owner.name,
                transport.get_returncode(),
            )
            return
        returncode = transport.get_returncode()
        if returncode != 0:
            log.warning(
                "notify: job %s: %s as %s failed (exit %s): %s",
                job.id,
                what,
                owner.name,
                returncode,
                one_line(watched.output.decode("utf-8", "replace")) or "no output",
            )


class _Watched(asyncio.SubprocessProtocol):
    """One notification process: the tail of its output (:data:`OUTPUT_LIMIT` bytes), when
    it exited and when its output closed, each known on its own (``asyncio``'s
    ``Process.wait`` returns only once the output is closed too)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.output = bytearray()
        self.exited: asyncio.Future[None] = loop.create_future()
        self.closed: asyncio.Future[None] = loop.create_future()

    def pipe_data_received(self, fd: int, data: bytes | str) -> None:
        self.output.extend(data.encode() if isinstance(data, str) else data)
        del self.output[:-OUTPUT_LIMIT]

    def pipe_connection_lost(self, fd: int, exc: Exception | None) -> None:
        if fd == 1 and not self.closed.done():
            self.closed.set_result(None)

    def process_exited(self) -> None:
        if not self.exited.done():
            self.exited.set_result(None)


def _let_go(transport: asyncio.SubprocessTransport) -> None:
    """Stop feeding and reading a notification process: its pipes are closed here (what
    its input still held is dropped), whatever holds their other ends."""
    feed = transport.get_pipe_transport(0)
    if isinstance(feed, asyncio.WriteTransport) and not feed.is_closing():
        feed.abort()
    transport.close()


def _kill_group(leader: tuple[int, int | None]) -> bool:
    """SIGKILL the process group a notification process leads (its own session), only while
    that process, ``(pid, start time)``, is still in it: once it is reaped, its pid and so
    its group's id may be another user's (:func:`signal_group_of`).  ``True`` when
    signalled."""
    pid, start = leader
    if start is None:  # gone before it could be known: nothing is known to be its group
        return False
    return signal_group_of(pid, signal.SIGKILL, [leader])
