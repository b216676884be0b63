"""The daemon: life cycle, connections and dispatch, in one asyncio loop.

:class:`Daemon` prepares the state directory, holds its lock, serves the socket, runs the
scheduling loop (``loop.py``) and the executor (``executor.py``), and stops them on SIGTERM or
SIGINT.  Each connection is a sequence of frames (``api.wire``): a request is decoded strictly
into its ``api.messages`` class and :func:`dispatch` hands it to its handler
(``handlers/``); the typed reply, or the typed error (``api.errors``), goes back as one frame.

Layout of the state directory (owned by the daemon's user, mode 0755; a symlink, or a
directory of another user, is refused)::

    daemon.sock    the socket: 0666 for a root daemon (identity from SO_PEERCRED), 0600 for a
                   user's, 0660 with [daemon] allow_group's group (see auth.py)
    daemon.lock    held (flock) while a daemon runs on this directory, 0600
    daemon.log     the daemon's own log, 0600
    state.db       SQLite (WAL), 0600 from the first byte, like its -wal and -shm (state.py)
    jobs/<id>/     per-job logs (rank<r>.log), report.json and, by default, checkpoint/

Every state file is created under ``umask 077`` and opened without following symlinks; once
they exist the daemon gives its jobs back the umask it was started with.

Connections (:class:`ConnectionBook`): at most :data:`MAX_CONNECTIONS` in all and
``[limits] connections_per_user`` (16) per user (root and the daemon's own user: no per-user
cap).  A frame may be up to ``wire.MAX_FRAME_BYTES`` (16 MiB: a submit's environment, a long
report) for anyone, because its type is only known once it is read; what bounds memory is the
budget of bytes in flight: the declared length of a frame over :data:`FREE_FRAME_BYTES` is
reserved from its user's budget (``[limits] mib_in_flight_per_user``, 32 MiB) and from the
daemon's (:data:`MAX_BYTES_IN_FLIGHT`) before its body is read, and given back once it is
answered; a frame that does not fit is refused (``LimitExceeded``; its body read and
dropped, never kept) and its connection closed.  Smaller frames are bounded by the connection
caps, so a user whose budget is full may still ask.  A frame's first byte must come within
:data:`IDLE_TIMEOUT_S`, the rest of it within :data:`FRAME_DEADLINE_S`; a reply the client
does not read within :data:`REPLY_TIMEOUT_S` closes the connection.  Bodies over
:data:`SMALL_FRAME_BYTES` are read into an anonymous mapping, returned to the system as soon
as the request is answered.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import fcntl
import grp
import logging
import mmap
import os
import signal
import stat
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import IO, Any, cast

import numpy as np

from pollux_local.api import wire
from pollux_local.api.errors import (
    InternalError,
    InvalidRequest,
    LimitExceeded,
    PermissionDenied,
    PolluxError,
    ProtocolError,
)
from pollux_local.api.messages import (
    Cancel,
    Drain,
    Edit,
    Estimate,
    Hold,
    Logs,
    Nodes,
    Ping,
    Release,
    Reply,
    Report,
    Request,
    Restart,
    Resume,
    SetPriority,
    Show,
    Status,
    Submit,
    Usage,
)
from pollux_local.core.types import Policy
from pollux_local.daemon.auth import Peer, may_connect, peer_credentials, refusal, socket_mode
from pollux_local.daemon.config import DaemonConfig, load_config
from pollux_local.daemon.context import Context
from pollux_local.daemon.executor import Executor
from pollux_local.daemon.handlers import (
    control,
    devices,
    estimate,
    nodes,
    ping,
    query,
    report,
    resubmit,
    submit,
    usage,
)
from pollux_local.daemon.loop import SchedulingLoop
from pollux_local.daemon.metrics import DaemonSnapshot, PrometheusEndpoint, snapshot_of
from pollux_local.daemon.notify import Notifier
from pollux_local.daemon.readmodel import MetricHistory
from pollux_local.daemon.reload import (
    POLICY_SETTINGS,
    config_changes,
    effective_config,
    held_devices,
)
from pollux_local.daemon.scheduler import ModelCache
from pollux_local.daemon.state import StateStore, open_state

log = logging.getLogger("pollux_local.daemon")

#: A connection silent for this long between frames is closed (a stuck client holds nothing).
IDLE_TIMEOUT_S = 30.0
#: Once a frame's first byte came, the rest of it (header and body) must come within this.
FRAME_DEADLINE_S = 20.0
#: A reply the client does not take within this closes its connection.
REPLY_TIMEOUT_S = 30.0
#: A refused connection's request is read and dropped, this much and this long at most.
REFUSED_DRAIN_BYTES = 64 * 1024
REFUSED_DRAIN_S = 1.0
#: Connections open at once, all users together.
MAX_CONNECTIONS = 256
#: Request bytes the daemon buffers at once, all users together.
MAX_BYTES_IN_FLIGHT = 256 * 1024 * 1024
#: Frames up to this size are not counted against the byte budgets (their memory is bounded by
#: the connection caps), so that a user whose budget large frames fill may still ping and ask.
FREE_FRAME_BYTES = 64 * 1024
#: Bodies larger than this are read into an anonymous mapping (unmapped once answered).
SMALL_FRAME_BYTES = 1024 * 1024
_CHUNK = 256 * 1024


def make_policy(config: DaemonConfig) -> Policy:
    """The configured policy object from the core (the very code the simulator runs)."""
    from pollux_local.core.names import make_policy as from_registry

    return from_registry(
        config.policy, p=config.p, restart_cost_s=config.restart_cost_s, interval_s=config.interval_s
    )


def policy_name(policy: Policy) -> str:
    return str(getattr(policy, "name", type(policy).__name__))


def _own_directory(path: Path, what: str, create_mode: int) -> None:
    """Make ``path`` a directory of the daemon's user (created with ``create_mode``); refuse a
    symlink, anything not a directory, or one of another user; remove group/other write."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        with contextlib.suppress(FileExistsError):
            os.mkdir(path, create_mode)
            os.chmod(path, create_mode)
        info = os.lstat(path)
    if stat.S_ISLNK(info.st_mode):
        raise PolluxError(
            f"{what} {path} is a symlink (to {os.path.realpath(path)}); give the real path"
        )
    if not stat.S_ISDIR(info.st_mode):
        raise PolluxError(f"{what} {path} is not a directory")
    if info.st_uid != os.geteuid():
        raise PolluxError(f"{what} {path} belongs to uid {info.st_uid}, not to the daemon's user")
    if info.st_mode & 0o022:
        os.chmod(path, stat.S_IMODE(info.st_mode) & ~0o022)


def prepare_state_dir(state_dir: Path) -> None:
    """Create the state directory (0755) and ``jobs/`` in it; refuse a state dir that is a
    symlink or that the daemon's user does not own, and remove group/other write (others could
    replace the socket)."""
    state_dir.parent.mkdir(parents=True, exist_ok=True)
    _own_directory(state_dir, "state dir", 0o755)
    _own_directory(state_dir / "jobs", "jobs dir", 0o755)


def open_private(path: Path, flags: int) -> int:
    """A descriptor of the daemon's own file ``path``, created 0600 when absent, never through
    a symlink; an older file readable by others is made 0600."""
    try:
        fd = os.open(path, flags | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise PolluxError(f"cannot open {path}: {exc.strerror} (a symlink?)") from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid():
        os.close(fd)
        raise PolluxError(f"{path} is not a plain file of the daemon's user")
    if stat.S_IMODE(info.st_mode) & 0o077:
        os.fchmod(fd, 0o600)
    return fd


# --- connections: who may hold how much --------------------------------------------------------


class ConnectionBook:
    """Connections open and request bytes in flight, per user and in all.  ``unlimited`` uids
    (root, the daemon's user) have no per-user connection cap; every user has a byte budget."""

    def __init__(
        self,
        per_user: int,
        per_user_bytes: int,
        total_bytes: int = MAX_BYTES_IN_FLIGHT,
        unlimited: frozenset[int] = frozenset(),
    ) -> None:
        self.per_user = per_user
        self.per_user_bytes = per_user_bytes
        self.total_bytes = total_bytes
        self.unlimited = unlimited
        self.connections: dict[int, int] = {}
        self.bytes: dict[int, int] = {}
        self.bytes_total = 0

    def open(self, uid: int) -> bool:
        """Count a new connection of ``uid``; False (not counted) when over its cap."""
        count = self.connections.get(uid, 0)
        if count >= self.per_user and uid not in self.unlimited:
            return False
        self.connections[uid] = count + 1
        return True

    def close(self, uid: int) -> None:
        count = self.connections.get(uid, 0) - 1
        if count > 0:
            self.connections[uid] = count
        else:
            self.connections.pop(uid, None)

    @contextlib.contextmanager
    def reserve(self, uid: int, name: str, nbytes: int) -> Iterator[None]:
        """Hold ``nbytes`` of ``uid``'s budget and the daemon's for the block
        (:class:`LimitExceeded` when either would be exceeded)."""
        held = self.bytes.get(uid, 0)
        if held + nbytes > self.per_user_bytes:
            raise LimitExceeded(
                f"{name} has {held} bytes of requests in flight; this {nbytes}-byte one would"
                f" pass the {self.per_user_bytes}-byte cap per user: try again later"
            )
        if self.bytes_total + nbytes > self.total_bytes:
            raise LimitExceeded("the daemon is busy reading other requests; try again later")
        self.bytes[uid] = held + nbytes
        self.bytes_total += nbytes
        try:
            yield
        finally:
            left = self.bytes.get(uid, 0) - nbytes
            if left > 0:
                self.bytes[uid] = left
            else:
                self.bytes.pop(uid, None)
            self.bytes_total -= nbytes


async def read_header(
    reader: asyncio.StreamReader, idle_s: float, frame_s: float
) -> tuple[int, float] | None:
    """A frame's declared length and the loop time by which all of it must have come
    (``None``: the stream ended cleanly between frames).  Its first byte must come within
    ``idle_s``; the rest of the frame, header and body, within ``frame_s`` of it."""
    async with asyncio.timeout(idle_s):
        first = await reader.read(1)
    if not first:
        return None
    deadline = asyncio.get_running_loop().time() + frame_s
    async with asyncio.timeout_at(deadline):
        try:
            rest = await reader.readexactly(wire.HEADER.size - 1)
        except asyncio.IncompleteReadError:
            raise ProtocolError("truncated frame header") from None
    (length,) = wire.HEADER.unpack(first + rest)
    wire.check_length(length)
    return length, deadline


async def discard(reader: asyncio.StreamReader, length: int) -> None:
    """Read and drop ``length`` bytes (a refused frame's body: the client that sent it whole
    then reads its error), keeping none of them."""
    while length > 0:
        chunk = await reader.read(min(_CHUNK, length))
        if not chunk:
            return
        length -= len(chunk)


async def read_body(reader: asyncio.StreamReader, length: int) -> bytes | mmap.mmap:
    """``length`` bytes of body: small ones as bytes, larger ones in an anonymous mapping
    (the caller closes it)."""
    if length <= SMALL_FRAME_BYTES:
        try:
            return await reader.readexactly(length)
        except asyncio.IncompleteReadError:
            raise ProtocolError(f"truncated frame: expected {length} bytes") from None
    buffer = mmap.mmap(-1, length)
    try:
        position = 0
        while position < length:
            chunk = await reader.read(min(_CHUNK, length - position))
            if not chunk:
                raise ProtocolError(f"truncated frame: expected {length} bytes")
            buffer[position : position + len(chunk)] = chunk
            position += len(chunk)
    except BaseException:
        buffer.close()
        raise
    return buffer


# --- dispatch --------------------------------------------------------------------------------


async def dispatch(ctx: Context, request: Request) -> Reply:
    """The handler of ``request``'s type, and its reply."""
    match request:
        case Ping():
            return ping.ping(ctx, request)
        case Submit():
            return submit.submit(ctx, request)
        case Status():
            return query.status(ctx, request)
        case Show():
            return query.show(ctx, request)
        case Logs():
            return query.logs(ctx, request)
        case Cancel():
            return await control.cancel(ctx, request)
        case Hold():
            return await control.hold(ctx, request)
        case Release():
            return await control.release(ctx, request)
        case SetPriority():
            return control.set_priority(ctx, request)
        case Nodes():
            return nodes.nodes(ctx, request)
        case Report():
            return report.report(ctx, request)
        case Restart():
            return resubmit.restart(ctx, request)
        case Edit():
            return resubmit.edit(ctx, request)
        case Usage():
            return usage.usage(ctx, request)
        case Drain():
            return devices.drain(ctx, request)
        case Resume():
            return devices.resume(ctx, request)
        case Estimate():
            return await estimate.estimate(ctx, request)
    raise InvalidRequest(f"this daemon has no handler for {type(request).__name__} requests")


async def answer(ctx: Context, body: bytes | mmap.mmap) -> bytes:
    """One request frame's body -> one reply frame.  A refusal is the typed error's reply;
    anything else that goes wrong is logged and answered as an ``InternalError``."""
    kind = "?"
    try:
        request = wire.decode_request(cast(bytes, body))  # any buffer decodes
        kind = type(request).__name__
        return wire.encode_reply(await dispatch(ctx, request))
    except PolluxError as exc:
        return wire.encode_error(exc)
    except Exception as exc:  # never let one request take the daemon down
        log.exception("%s request failed", kind)
        return wire.encode_error(InternalError(f"internal error: {exc.__class__.__name__}: {exc}"))


# --- the daemon ------------------------------------------------------------------------------


class Daemon:
    """One daemon serving one state directory.  ``reset_state`` (``daemon --reset-state``):
    a state database that cannot be used is moved aside and a new one started
    (``state.open_state``)."""

    def __init__(
        self,
        config: DaemonConfig,
        state_dir: Path,
        policy: Policy | None = None,
        clock: Callable[[], float] = time.time,
        seed: int = 0,
        reset_state: bool = False,
        config_path: Path | None = None,
        devices: str | None = None,
        overrides: Mapping[str, Any] | None = None,
    ) -> None:
        self.config = config
        # what SIGHUP reads again (reload_config): the file, --devices, and the command line's
        # settings (--interval, --policy), which keep winning over the file's
        self.config_path = config_path
        self.devices = devices
        self.overrides = dict(overrides or {})
        self.loaded_config = config
        self._policy_from_config = policy is None
        self._retiring: asyncio.Task[None] | None = None
        self._reload_tasks: set[asyncio.Task[bool]] = set()
        self.prometheus: PrometheusEndpoint | None = None
        self.state_dir = state_dir
        self.socket_path = state_dir / "daemon.sock"
        self.policy = policy if policy is not None else make_policy(config)
        self.clock = clock
        self.rng = np.random.default_rng(seed)
        self.models = ModelCache()
        self.metrics = MetricHistory()
        self.uid = os.geteuid()
        self.reset_state = reset_state
        self.store: StateStore | None = None
        self.executor: Executor | None = None
        self.scheduler: SchedulingLoop | None = None
        self._wake = asyncio.Event()
        self._stop = asyncio.Event()
        self._mutex = asyncio.Lock()
        self._connections = 0
        self.book = ConnectionBook(
            per_user=config.max_user_connections,
            per_user_bytes=config.max_user_bytes,
            unlimited=frozenset({0, self.uid}),
        )
        self._refusals: dict[int, float] = {}
        self._lock_file: IO[str] | None = None

    # --- life cycle ----------------------------------------------------------------------

    def _acquire_lock(self) -> None:
        handle = os.fdopen(open_private(self.state_dir / "daemon.lock", os.O_RDWR), "r+")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.close()
            raise PolluxError(f"another daemon is already running on {self.state_dir}") from None
        handle.seek(0)
        handle.truncate()
        handle.write(f"{os.getpid()}\n")
        handle.flush()
        self._lock_file = handle

    def _release_lock(self) -> None:
        if self._lock_file is not None:
            self._lock_file.close()
            self._lock_file = None

    def _open_store(self) -> StateStore:
        store = open_state(self.state_dir, reset=self.reset_state)
        if store.set_aside_to is not None:
            log.warning(
                "--reset-state: the state database could not be used; moved it and jobs/ to"
                " %s and started with no job history",
                store.set_aside_to,
            )
        elif self.reset_state:
            log.info("--reset-state: the state database is healthy; nothing was reset")
        return store

    async def _listen(self) -> asyncio.AbstractServer:
        """Bind the socket (0600 under the umask), then open it as far as ``socket_mode``
        says, giving it to ``allow_group`` first when the config names one."""
        with contextlib.suppress(FileNotFoundError):
            self.socket_path.unlink()
        server = await asyncio.start_unix_server(self._serve_client, path=str(self.socket_path))
        group = self.config.allow_group
        try:
            if group is not None:
                os.chown(self.socket_path, -1, grp.getgrnam(group).gr_gid)
            os.chmod(self.socket_path, socket_mode(self.uid, group))
        except (KeyError, OSError) as exc:
            server.close()
            raise PolluxError(
                f"cannot give the socket {self.socket_path} to the group {group}"
                f" (allow_group): {getattr(exc, 'strerror', None) or exc}"
            ) from None
        return server

    async def run(self, ready: Callable[[], None] | None = None) -> None:
        """Serve until :meth:`request_stop` (or SIGTERM/SIGINT when installed)."""
        prepare_state_dir(self.state_dir)
        started_umask = os.umask(0o077)  # every state file private from its first byte
        try:
            self._acquire_lock()
            try:
                self.store = self._open_store()
            except BaseException:
                self._release_lock()
                raise
            self.executor = Executor(
                self.store,
                self.config,
                self.state_dir,
                self.socket_path,
                on_change=self.wake,
                clock=self.clock,
            )
            self.scheduler = SchedulingLoop(
                store=self.store,
                executor=self.executor,
                config=self.config,
                state_dir=self.state_dir,
                policy=self.policy,
                models=self.models,
                metrics=self.metrics,
                mutex=self._mutex,
                wake_event=self._wake,
                clock=self.clock,
                rng=self.rng,
            )
            # job ends are announced after each pass (the first one too: ends the last run
            # left in the outbox go out then)
            self.notifier = Notifier(self.store, lambda: self.config, os.geteuid())
            self.scheduler.notifier = self.notifier
            try:
                recovered = await self.executor.recover()
                if recovered:
                    log.info("re-queued %d job(s) that were running: %s", len(recovered), recovered)
                await self.executor.check_nodes(force=True)
                server = await self._listen()
            except BaseException:
                self.store.close()
                self._release_lock()
                raise
        finally:
            os.umask(started_umask)  # jobs get the umask the daemon was started with
        log.info(
            "serving %s (mode %o): %d device(s) on %d node(s), policy %s, interval %g s",
            self.socket_path,
            socket_mode(self.uid, self.config.allow_group),
            self.config.total_devices,
            len(self.config.nodes),
            policy_name(self.policy),
            self.config.interval_s,
        )
        loop_task = asyncio.ensure_future(self.scheduler.run())
        await self._serve_prometheus()
        if ready is not None:
            ready()
        try:
            await self._stop.wait()
        finally:
            server.close()
            await self._stop_reload_work()
            async with self._mutex:  # let a pass in progress finish its launches and stops
                loop_task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await loop_task
                await self.executor.shutdown()
            await self.notifier.close()
            with contextlib.suppress(FileNotFoundError):
                self.socket_path.unlink()
            self.store.close()
            self._release_lock()
            log.info("stopped")

    def request_stop(self) -> None:
        self._stop.set()

    def install_signal_handlers(self) -> None:
        """SIGTERM and SIGINT stop the daemon; SIGHUP reads the config again."""
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, self.request_stop)
        loop.add_signal_handler(signal.SIGHUP, self.request_reload)

    # --- reading the config again (SIGHUP) -----------------------------------------------

    def request_reload(self) -> None:
        """Read the config again soon (:meth:`reload_config`; SIGHUP)."""
        if self.store is not None and not self._stop.is_set():
            task = asyncio.ensure_future(self.reload_config())
            self._reload_tasks.add(task)
            task.add_done_callback(self._reload_tasks.discard)

    async def reload_config(self) -> bool:
        """Read the config file (and ``--devices``) again and use it without stopping a job:
        nodes and devices, limits, reserved devices, notifications, the metrics endpoint, the
        policy's settings; the command line's ``--interval`` and ``--policy`` still win.  A
        job keeps the devices the new config drops until it ends (``reload.effective_config``).
        A config that cannot be read or used is logged in one line and the one in use kept
        (``False``)."""
        where = self.config_path or "the embedded default"
        try:
            loaded = dataclasses.replace(
                load_config(self.config_path, self.devices), **self.overrides
            )
        except Exception as exc:  # whatever is wrong with the file, the daemon runs on
            text = " ".join(str(exc).split())
            log.error("reload: %s is not usable, keeping the config in use: %s", where, text)
            return False
        async with self._mutex:
            try:
                changes = await self._use_config(loaded)
            except PolluxError as exc:
                log.error("reload: %s, keeping the config in use", " ".join(str(exc).split()))
                return False
        log.info("reloaded %s: %s", where, "; ".join(changes) or "nothing changed")
        self.wake()
        return True

    async def _use_config(self, loaded: DaemonConfig) -> list[str]:
        """Make every part of the daemon use ``loaded`` (the caller holds the mutex); the
        changes, one phrase each."""
        assert self.executor is not None and self.scheduler is not None and self.store
        old = self.config
        config, kept = effective_config(loaded, held_devices(self.executor, self.store), old)
        if config.allow_group != old.allow_group:
            self._give_socket_to(config.allow_group)
        changes = config_changes(old, config)
        self.loaded_config = loaded
        self._set_config(config)
        self.book.per_user = config.max_user_connections
        self.book.per_user_bytes = config.max_user_bytes
        if self._policy_from_config and any(
            getattr(old, name) != getattr(config, name) for name in POLICY_SETTINGS
        ):
            self.policy = make_policy(config)
            self.scheduler.policy = self.policy
        if config.prometheus != old.prometheus:
            if self.prometheus is not None:
                await self.prometheus.close()
                self.prometheus = None
            await self._serve_prometheus()
        if kept:
            devices = ", ".join(f"{node}:{d}" for node, ds in kept.items() for d in ds)
            changes.append(f"kept until their jobs end: {devices}")
            if self._retiring is None or self._retiring.done():
                self._retiring = asyncio.ensure_future(self._drop_released())
        await self.executor.check_nodes(force=True, background=True)
        return changes

    def _set_config(self, config: DaemonConfig) -> None:
        """The config every part uses from now on (new connections' ``Context`` included)."""
        assert self.executor is not None and self.scheduler is not None
        self.config = config
        self.executor.reconfigure(config)
        self.scheduler.config = config

    async def _drop_released(self, poll_s: float = 1.0) -> None:
        """While the config in use keeps devices the file dropped, drop each once no job
        holds it any longer."""
        while self.config is not self.loaded_config:
            await asyncio.sleep(poll_s)
            assert self.executor is not None and self.store is not None
            async with self._mutex:
                held = held_devices(self.executor, self.store)
                config, _ = effective_config(self.loaded_config, held, self.config)
                if config != self.config:
                    changes = config_changes(self.config, config)
                    log.info("reload: no job holds them any more: %s", "; ".join(changes))
                    self._set_config(config)
                    self.wake()

    def _give_socket_to(self, group: str | None) -> None:
        """Open the socket to ``group`` (``[daemon] allow_group``; ``None``: to no group),
        as at the start."""
        try:
            if group is not None:
                os.chown(self.socket_path, -1, grp.getgrnam(group).gr_gid)
            os.chmod(self.socket_path, socket_mode(self.uid, group))
        except (KeyError, OSError) as exc:
            raise PolluxError(
                f"cannot give the socket {self.socket_path} to the group {group}"
                f" (allow_group): {getattr(exc, 'strerror', None) or exc}"
            ) from None

    async def _serve_prometheus(self) -> None:
        """Serve ``/metrics`` at ``[metrics] prometheus`` when the config names an address."""
        if self.config.prometheus is not None:
            self.prometheus = await PrometheusEndpoint.start(
                self.config.prometheus, self._metrics_snapshot
            )

    def _metrics_snapshot(self) -> DaemonSnapshot:
        assert self.store is not None and self.scheduler is not None
        return snapshot_of(self.config, self.store, self.scheduler.ticks)

    async def _stop_reload_work(self) -> None:
        """Stop the reloads in flight, the wait for kept devices and the metrics endpoint."""
        for task in [*self._reload_tasks, self._retiring]:
            if task is not None and not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        if self.prometheus is not None:
            await self.prometheus.close()
            self.prometheus = None

    def wake(self) -> None:
        """Ask for a scheduling pass soon (submit, finish, node change)."""
        self._wake.set()

    async def schedule_once(self) -> None:
        """One scheduling pass now (``SchedulingLoop.schedule_once``)."""
        assert self.scheduler is not None, "the daemon is not running"
        await self.scheduler.schedule_once()

    # --- connections ---------------------------------------------------------------------

    def context(self, peer: Peer) -> Context:
        """What the handlers of one connection's requests see."""
        assert self.store is not None and self.executor is not None
        return Context(
            peer=peer,
            store=self.store,
            executor=self.executor,
            config=self.config,
            state_dir=self.state_dir,
            clock=self.clock,
            models=self.models,
            metrics=self.metrics,
            mutex=self._mutex,
            wake=self.wake,
            daemon_uid=self.uid,
            policy_name=policy_name(self.policy),
            forecasts=self.scheduler.forecasts if self.scheduler is not None else None,
        )

    def _note_refusal(self, peer: Peer, why: str) -> None:
        """Log a refused connection, at most once a minute per user (a flood stays short)."""
        now = time.monotonic()
        if now - self._refusals.get(peer.uid, -120.0) >= 60.0:
            self._refusals[peer.uid] = now
            log.warning(
                "refused a connection of %s (uid %d, pid %d): %s",
                peer.name,
                peer.uid,
                peer.pid,
                why,
            )

    @staticmethod
    async def _send(writer: asyncio.StreamWriter, data: bytes) -> bool:
        """Write one frame; False (the connection aborted) when the client does not take it
        within :data:`REPLY_TIMEOUT_S`."""
        try:
            writer.write(data)
            async with asyncio.timeout(REPLY_TIMEOUT_S):
                await writer.drain()
            return True
        except (TimeoutError, ConnectionError, OSError):
            writer.transport.abort()
            return False

    async def _refuse(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, error: PolluxError
    ) -> None:
        """Refuse a connection before reading its request: the error, then what the client
        sends is taken and dropped (at most :data:`REFUSED_DRAIN_BYTES`, for at most
        :data:`REFUSED_DRAIN_S`) so that its request does not meet a closed socket before it
        reads the error."""
        if not await self._send(writer, wire.encode_error(error)):
            return
        with contextlib.suppress(TimeoutError, ConnectionError, OSError):
            writer.write_eof()
            async with asyncio.timeout(REFUSED_DRAIN_S):
                left = REFUSED_DRAIN_BYTES
                while left > 0 and (chunk := await reader.read(left)):
                    left -= len(chunk)

    async def _serve_client(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        """Answer a connection's requests in order until it closes, goes silent, is refused
        (who it is, too many connections, too many bytes in flight) or sends a frame that
        breaks the framing: the refusal is answered as one typed error, then it is closed."""
        self._connections += 1
        uid: int | None = None
        try:
            if self._connections > MAX_CONNECTIONS:
                error = LimitExceeded("too many connections; try again")
                await self._refuse(reader, writer, error)
                return
            try:
                peer = peer_credentials(writer.get_extra_info("socket"))
            except OSError:
                return
            if not may_connect(peer, self.uid, self.config.allow_group):
                why = refusal(peer, self.uid, self.config.allow_group)
                self._note_refusal(peer, why)
                await self._refuse(reader, writer, PermissionDenied(why))
                return
            if not self.book.open(peer.uid):
                self._note_refusal(peer, "too many connections")
                error = LimitExceeded(
                    f"too many connections from {peer.name} (at most {self.book.per_user} at"
                    " once); close some and try again"
                )
                await self._refuse(reader, writer, error)
                return
            uid = peer.uid
            ctx = self.context(peer)
            while True:
                try:
                    header = await read_header(reader, IDLE_TIMEOUT_S, FRAME_DEADLINE_S)
                    if header is None:
                        return
                    length, deadline = header
                    counted = length if length > FREE_FRAME_BYTES else 0
                    with self.book.reserve(peer.uid, peer.name, counted):
                        async with asyncio.timeout_at(deadline):
                            body = await read_body(reader, length)
                        try:
                            reply = await answer(ctx, body)
                        finally:
                            if isinstance(body, mmap.mmap):
                                with contextlib.suppress(BufferError):
                                    body.close()
                            del body
                except LimitExceeded as exc:  # over a byte budget: its body is not kept
                    if await self._send(writer, wire.encode_error(exc)):
                        with contextlib.suppress(TimeoutError, ConnectionError, OSError):
                            async with asyncio.timeout_at(deadline):
                                await discard(reader, length)
                    return
                except PolluxError as exc:
                    await self._send(writer, wire.encode_error(exc))
                    return
                except (TimeoutError, ConnectionError):
                    return
                if not await self._send(writer, reply):
                    return
        except (ConnectionError, OSError):
            pass
        finally:
            self._connections -= 1
            if uid is not None:
                self.book.close(uid)
            with contextlib.suppress(Exception):
                writer.close()


class JournalFormatter(logging.Formatter):
    """Lines for journald: each line of a record starts with its syslog priority (``<3>``
    error, ``<4>`` warning, ``<6>`` info, ``<7>`` debug) and has no time (the journal adds
    it), so that a traceback's lines keep the priority of their record."""

    #: lowest level -> syslog priority, most severe first; below INFO: 7 (debug)
    PRIORITIES = {logging.CRITICAL: 2, logging.ERROR: 3, logging.WARNING: 4, logging.INFO: 6}

    def format(self, record: logging.LogRecord) -> str:
        priority = next((p for level, p in self.PRIORITIES.items() if record.levelno >= level), 7)
        text = super().format(record)
        return "\n".join(f"<{priority}>{line}" for line in text.splitlines() or [""])


def stderr_is_journal() -> bool:
    """Whether stderr is the journal stream systemd gave us: ``$JOURNAL_STREAM`` is
    ``DEVICE:INODE`` of that stream, and stderr is still it (not redirected since)."""
    device, _, inode = os.environ.get("JOURNAL_STREAM", "").partition(":")
    try:
        info = os.fstat(2)
        return (info.st_dev, info.st_ino) == (int(device), int(inode))
    except (OSError, ValueError):
        return False


class LogFileHandler(logging.StreamHandler):
    """``daemon.log``: a line it cannot write (a full disk) is lost from the file alone (every
    line goes to stderr too), said once on stderr in one line instead of a traceback a line."""

    failing = False

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.stream.write(self.format(record) + self.terminator)
            self.flush()
        except RecursionError:
            raise
        except Exception as exc:  # noqa: BLE001 - whatever the file refuses, the daemon goes on
            if not self.failing:
                reason = getattr(exc, "strerror", None) or exc
                sys.stderr.write(f"daemon.log: cannot write ({reason}); lines go to stderr only\n")
            self.failing = True
            return
        self.failing = False


def setup_logging(state_dir: Path, verbose: bool = False) -> None:
    """Log to stderr and to ``STATE_DIR/daemon.log`` (0600, never through a symlink); on a
    stderr that is the journal (:func:`stderr_is_journal`), in :class:`JournalFormatter`'s
    lines."""
    root = logging.getLogger("pollux_local")
    root.setLevel(logging.DEBUG if verbose else logging.INFO)
    fmt = logging.Formatter("%(asctime)s %(levelname)s %(message)s")
    path = state_dir / "daemon.log"
    stream = os.fdopen(open_private(path, os.O_WRONLY | os.O_APPEND), "a", encoding="utf-8")
    stderr = logging.StreamHandler()
    stderr.setFormatter(JournalFormatter("%(message)s") if stderr_is_journal() else fmt)
    logfile = LogFileHandler(stream)
    logfile.setFormatter(fmt)
    root.addHandler(stderr)
    root.addHandler(logfile)


def run_daemon(
    config: DaemonConfig,
    state_dir: Path,
    verbose: bool = False,
    reset_state: bool = False,
    config_path: Path | None = None,
    devices: str | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> int:
    """Run a daemon in the foreground until SIGTERM/SIGINT (``pollux-local daemon``);
    SIGHUP reads ``config_path`` (with ``devices`` and ``overrides``, as at the start)
    again."""
    prepare_state_dir(state_dir)
    started_umask = os.umask(0o077)
    try:
        setup_logging(state_dir, verbose)
    finally:
        os.umask(started_umask)
    daemon = Daemon(
        config,
        state_dir,
        reset_state=reset_state,
        config_path=config_path,
        devices=devices,
        overrides=overrides,
    )

    async def main() -> None:
        daemon.install_signal_handlers()
        await daemon.run()

    asyncio.run(main())
    return 0
