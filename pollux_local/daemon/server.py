"""The daemon's life cycle, in one asyncio loop.

:class:`Daemon` prepares the state directory and holds its lock (``statedir.py``), opens the
store, serves the socket (``transport.py``: frames, connections, budgets, peer credentials;
``dispatch.py``: the one ``match`` from a request to its handler in ``handlers/``), runs the
scheduling loop (``loop.py``) and the executor (``executor/``), reads its config again on
SIGHUP (``reload.py``), and stops them on SIGTERM or SIGINT.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import faulthandler
import functools
import grp
import logging
import os
import resource
import signal
import sys
import time
from collections.abc import Callable, Coroutine, Mapping
from pathlib import Path
from typing import IO, Any

import numpy as np

import pollux_local
from pollux_local.api.errors import (
    PolluxError,
)
from pollux_local.core.types import Policy
from pollux_local.daemon.auth import Peer, socket_mode
from pollux_local.daemon.config import DaemonConfig, changeable_by_others, load_config
from pollux_local.daemon.context import Context
from pollux_local.daemon.dispatch import answer
from pollux_local.daemon.executor import Executor
from pollux_local.daemon.loop import SchedulingLoop
from pollux_local.daemon.metrics import DaemonSnapshot, PrometheusEndpoint, snapshot_of
from pollux_local.daemon.notify import Notifier
from pollux_local.daemon.pacing import (
    ESTIMATES_PER_MINUTE,
    READ_SHARE,
    LoopShare,
    Uncharged,
    UserPacer,
)
from pollux_local.daemon.readmodel import MetricHistory
from pollux_local.daemon.reload import (
    POLICY_SETTINGS,
    config_changes,
    effective_config,
    held_devices,
)
from pollux_local.daemon.scheduler import ModelCache
from pollux_local.daemon.state import StateStore, open_state
from pollux_local.daemon.statedir import (
    acquire_lock,
    last_alive,
    prepare_state_dir,
    setup_logging,
)
from pollux_local.daemon.transport import ConnectionBook, Connections

log = logging.getLogger("pollux_local.daemon")


def make_policy(config: DaemonConfig) -> Policy:
    """The configured policy object from the core (the very code the simulator runs)."""
    from pollux_local.core.names import make_policy as from_registry

    return from_registry(
        config.policy,
        p=config.p,
        restart_cost_s=config.restart_cost_s,
        interval_s=config.interval_s,
    )


def policy_name(policy: Policy) -> str:
    return str(getattr(policy, "name", type(policy).__name__))


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
        force_devices: bool = False,
    ) -> None:
        self.config = config
        # what SIGHUP reads again (reload_config): the file, --devices, and the command line's
        # settings (--interval, --policy), which keep winning over the file's
        self.config_path = config_path
        self.devices = devices
        self.force_devices = force_devices  # daemon --force: CUDA devices NVML does not see
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
        self.estimate_pacer = UserPacer(
            "estimate", ESTIMATES_PER_MINUTE, time.monotonic, unlimited=frozenset({0, self.uid})
        )
        self.read_share = LoopShare(READ_SHARE, time.monotonic, unlimited=frozenset({0, self.uid}))
        self.book = ConnectionBook(
            per_user=config.max_user_connections,
            per_user_bytes=config.max_user_bytes,
            unlimited=frozenset({0, self.uid}),
        )
        self.connections = Connections(
            self.book, self.uid, self.context, answer, lambda: self.config.allow_group
        )
        self._lock_file: IO[str] | None = None

    # --- life cycle ----------------------------------------------------------------------

    def _acquire_lock(self) -> None:
        self._lock_file = acquire_lock(self.state_dir)

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

    def _warn_unreachable_socket(self) -> None:
        """A socket open to others in a folder they cannot pass through (a state dir made
        0700): every user's request is refused with "permission denied"; said at the start."""
        if not socket_mode(self.uid, self.config.allow_group) & 0o066:
            return
        for folder in (self.socket_path.parent, *self.socket_path.parent.parents):
            try:
                mode = folder.stat().st_mode
            except OSError:
                return
            if not mode & 0o011:
                log.warning(
                    "users cannot reach the socket %s: %s is %o (no one but its owner may"
                    " pass through it)", self.socket_path, folder, mode & 0o777,
                )  # fmt: skip
                return

    async def _listen(self) -> asyncio.AbstractServer:
        """Bind the socket (0600 under the umask), then open it as far as ``socket_mode``
        says, giving it to ``allow_group`` first when the config names one."""
        try:
            with contextlib.suppress(FileNotFoundError):
                self.socket_path.unlink()
            server = await asyncio.start_unix_server(
                self.connections.serve, path=str(self.socket_path)
            )
        except OSError as exc:  # a directory there, a read-only state dir, ...
            raise PolluxError(
                f"cannot listen on {self.socket_path}: {exc.strerror or exc}"
                + (" (a directory is in the way: remove it)" if self.socket_path.is_dir() else "")
            ) from None
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
                recovered = await self.executor.recover(last_alive(self.state_dir))
                if recovered:
                    log.info("re-queued %d job(s) that were running: %s", len(recovered), recovered)
                self._keep_held_devices()
                await self.executor.check_nodes(force=True)
                server = await self._listen()
            except BaseException:
                self.store.close()
                self._release_lock()
                raise
        finally:
            os.umask(started_umask)  # jobs get the umask the daemon was started with
        self._warn_unreachable_socket()
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
            self.scheduler.stop()
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
        if not self._stop.is_set():
            log.info("stopping")
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
                load_config(self.config_path, self.devices, self.force_devices), **self.overrides
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
        for warning in loaded.warnings:
            log.warning("%s", warning)
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

    def _keep_held_devices(self) -> None:
        """At a start: the devices the config no longer lists that a job adopted from the
        last run still holds are kept (reserved) until it ends, as a reload keeps them
        (``reload.effective_config``): a job that may not be stopped was stopped when the
        daemon came back with fewer devices."""
        assert self.executor is not None and self.store is not None
        held = held_devices(self.executor, self.store)
        config, kept = effective_config(self.config, held, self.config)
        if not kept:
            return
        devices = ", ".join(f"{node}:{d}" for node, ds in kept.items() for d in ds)
        log.warning("the config no longer lists %s: kept until their jobs end", devices)
        self._set_config(config)
        self._retiring = asyncio.ensure_future(self._drop_released())

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
            mutex=Uncharged(self._mutex),  # a pass under way is not the requester's work
            wake=self.wake,
            daemon_uid=self.uid,
            policy_name=policy_name(self.policy),
            forecasts=self.scheduler.forecasts if self.scheduler is not None else None,
            estimate_pacer=self.estimate_pacer,
            read_share=self.read_share,
            room_for_reply=functools.partial(self.book.room_for_reply, peer.uid, peer.name),
        )


#: Descriptors the daemon asks for: its soft limit is raised to this (at most its hard
#: limit).  Each running replica, client connection and state file holds some, and a limit
#: of 1,024 (systemd's default soft limit) is reached by one job of many ranks and a few
#: hundred clients.
OPEN_FILES_WANTED = 65536


def raise_open_files_limit() -> int:
    """Raise the soft limit on open descriptors to :data:`OPEN_FILES_WANTED` (at most the
    hard limit; never lowered); the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = OPEN_FILES_WANTED if hard == resource.RLIM_INFINITY else min(hard, OPEN_FILES_WANTED)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
            soft = wanted
        except (OSError, ValueError) as exc:
            log.warning("cannot raise the open-files limit from %s to %s: %s", soft, wanted, exc)
    return soft


def warn_of_changeable_code() -> list[str]:
    """Log, once at the start of a root daemon, the code it runs that a user other than root
    could change (its interpreter, its package): whoever can change it runs as root.  The
    lines logged."""
    said = []
    for what, path in (
        ("interpreter", Path(sys.executable)),
        ("package", Path(pollux_local.__file__).resolve().parent),
    ):
        problem = changeable_by_others(path)
        if problem is not None:
            line = (
                f"this root daemon's {what} {path} can be changed by others ({problem}):"
                " whoever can change it runs as root; install it where only root can write"
                " (docs/deploy.md)"
            )
            log.warning("%s", line)
            said.append(line)
    return said


#: Where FUSE reads whether users may mount for others (``user_allow_other``).
FUSE_CONF = Path("/etc/fuse.conf")


def warn_of_fuse_for_others(path: Path = FUSE_CONF) -> str | None:
    """Log, once at the start of a root daemon, that ``path`` lets users mount FUSE file
    systems that root may enter (``user_allow_other``): a user can then mount one over their
    own job's directory and leave the daemon's reads of it unanswered, holding it for
    everyone.  The line logged, or ``None`` (the option off, or no such file)."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return None
    enabled = any(line.split("#", 1)[0].strip() == "user_allow_other" for line in text.splitlines())
    if not enabled:
        return None
    line = (
        f"{path} enables user_allow_other: a user can mount a FUSE file system over their"
        " job's directory that never answers this daemon's reads; turn it off on a machine a"
        " root daemon serves (docs/security.md, Not protected)"
    )
    log.warning("%s", line)
    return line


def run_daemon(
    config: DaemonConfig,
    state_dir: Path,
    verbose: bool = False,
    reset_state: bool = False,
    config_path: Path | None = None,
    devices: str | None = None,
    overrides: Mapping[str, Any] | None = None,
    force_devices: bool = False,
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
    raise_open_files_limit()
    if os.geteuid() == 0:
        warn_of_changeable_code()
        warn_of_fuse_for_others()
    for warning in config.warnings:  # in the log and on stderr
        log.warning("%s", warning)
    daemon = Daemon(
        config,
        state_dir,
        reset_state=reset_state,
        config_path=config_path,
        devices=devices,
        overrides=overrides,
        force_devices=force_devices,
    )

    async def main() -> None:
        daemon.install_signal_handlers()
        await daemon.run()

    # ``kill -USR2``: every thread's Python stack on stderr (the journal), for a daemon that
    # seems stuck; the event loop does not have to answer for it
    faulthandler.register(signal.SIGUSR2, all_threads=True)
    run_to_the_end(main())
    return 0


#: How long the tasks still running when the daemon has stopped get to end once cancelled.
LEFTOVER_TIMEOUT_S = 5.0


def run_to_the_end(
    main: Coroutine[Any, Any, None], leftover_timeout_s: float = LEFTOVER_TIMEOUT_S
) -> None:
    """Run ``main`` on a new event loop, then cancel the tasks still running and give them
    ``leftover_timeout_s`` to end.  ``asyncio.run`` would wait for them without a bound: one
    task that does not end when cancelled kept a stopped daemon's process alive until it was
    killed.  Each such task is logged with where it waits, and left."""
    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(main)
    finally:  # (after a failed start too, as asyncio.run does)
        try:
            _end_leftover_tasks(loop, leftover_timeout_s)
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.run_until_complete(loop.shutdown_default_executor())
        finally:
            loop.close()


def _end_leftover_tasks(loop: asyncio.AbstractEventLoop, timeout_s: float) -> None:
    left = [task for task in asyncio.all_tasks(loop) if not task.done()]
    for task in left:
        task.cancel()
    if not left:
        return
    done, pending = loop.run_until_complete(asyncio.wait(left, timeout=timeout_s))
    for task in done:
        if not task.cancelled():
            task.exception()  # retrieved: not reported again at exit
    for task in pending:
        where = "; ".join(
            f"{frame.f_code.co_name} ({frame.f_code.co_filename}:{frame.f_lineno})"
            for frame in task.get_stack()
        )
        log.warning("a task did not end when cancelled at stop: %s at %s", task.get_name(), where)
