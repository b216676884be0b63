"""The daemon: life cycle, connections and dispatch, in one asyncio loop.

:class:`Daemon` prepares the state directory, holds its lock, serves the socket, runs the
scheduling loop (``loop.py``) and the executor (``executor.py``), and stops them on SIGTERM or
SIGINT.  Each connection is a sequence of frames (``api.wire``): a request is decoded strictly
into its ``api.messages`` class and :func:`dispatch` hands it to its handler
(``handlers/``); the typed reply, or the typed error (``api.errors``), goes back as one frame.

Layout of the state directory (owned by the daemon's user, mode 0755 so that the lab's users
can reach the socket)::

    daemon.sock    the socket (mode 0666: identity comes from SO_PEERCRED, see auth.py)
    daemon.lock    held (flock) while a daemon runs on this directory
    daemon.log     the daemon's own log
    state.db       SQLite (WAL), mode 0600
    jobs/<id>/     per-job logs (rank<r>.log), report.json and, by default, checkpoint/
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from pollux_local.api import wire
from pollux_local.api.errors import InternalError, InvalidRequest, LimitExceeded, PolluxError
from pollux_local.api.messages import (
    Cancel,
    Hold,
    Logs,
    Nodes,
    Ping,
    Release,
    Reply,
    Report,
    Request,
    SetPriority,
    Show,
    Status,
    Submit,
)
from pollux_local.core.types import Policy
from pollux_local.daemon.auth import Peer, peer_credentials
from pollux_local.daemon.config import DaemonConfig
from pollux_local.daemon.context import Context
from pollux_local.daemon.executor import Executor
from pollux_local.daemon.handlers import control, nodes, ping, query, report, submit
from pollux_local.daemon.loop import SchedulingLoop
from pollux_local.daemon.readmodel import MetricHistory
from pollux_local.daemon.scheduler import ModelCache
from pollux_local.daemon.state import StateStore

log = logging.getLogger("pollux_local.daemon")

#: A connection silent for this long is closed (a stuck or malicious client holds nothing).
IDLE_TIMEOUT_S = 30.0
MAX_CONNECTIONS = 256


def make_policy(config: DaemonConfig) -> Policy:
    """The configured policy object from the core (the very code the simulator runs)."""
    if config.policy == "fifo":
        from pollux_local.core.baselines import FifoPolicy

        return FifoPolicy()
    from pollux_local.core.policy import GoodputPolicy

    return GoodputPolicy(
        p=config.p, restart_cost_s=config.restart_cost_s, interval_s=config.interval_s
    )


def policy_name(policy: Policy) -> str:
    return str(getattr(policy, "name", type(policy).__name__))


def prepare_state_dir(state_dir: Path) -> None:
    """Create the state directory (0755) and refuse one the daemon's user does not own or
    that others could write to (they could replace the socket)."""
    state_dir.mkdir(parents=True, exist_ok=True, mode=0o755)
    info = state_dir.stat()
    if info.st_uid != os.geteuid():
        raise PolluxError(
            f"state dir {state_dir} belongs to uid {info.st_uid}, not to the daemon's user"
        )
    if info.st_mode & 0o022:
        os.chmod(state_dir, info.st_mode & ~0o022 & 0o7777)
    (state_dir / "jobs").mkdir(exist_ok=True, mode=0o755)


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
    raise InvalidRequest(f"this daemon has no handler for {type(request).__name__} requests")


async def answer(ctx: Context, body: bytes) -> bytes:
    """One request frame's body -> one reply frame.  A refusal is the typed error's reply;
    anything else that goes wrong is logged and answered as an ``InternalError``."""
    kind = "?"
    try:
        request = wire.decode_request(body)
        kind = type(request).__name__
        return wire.encode_reply(await dispatch(ctx, request))
    except PolluxError as exc:
        return wire.encode_error(exc)
    except Exception as exc:  # never let one request take the daemon down
        log.exception("%s request failed", kind)
        return wire.encode_error(InternalError(f"internal error: {exc.__class__.__name__}: {exc}"))


# --- the daemon ------------------------------------------------------------------------------


class Daemon:
    """One daemon serving one state directory."""

    def __init__(
        self,
        config: DaemonConfig,
        state_dir: Path,
        policy: Policy | None = None,
        clock: Callable[[], float] = time.time,
        seed: int = 0,
    ) -> None:
        self.config = config
        self.state_dir = state_dir
        self.socket_path = state_dir / "daemon.sock"
        self.policy = policy if policy is not None else make_policy(config)
        self.clock = clock
        self.rng = np.random.default_rng(seed)
        self.models = ModelCache()
        self.metrics = MetricHistory()
        self.uid = os.geteuid()
        self.store: StateStore | None = None
        self.executor: Executor | None = None
        self.scheduler: SchedulingLoop | None = None
        self._wake = asyncio.Event()
        self._stop = asyncio.Event()
        self._mutex = asyncio.Lock()
        self._connections = 0
        self._lock_file: Any = None

    # --- life cycle ----------------------------------------------------------------------

    def _acquire_lock(self) -> None:
        handle = open(self.state_dir / "daemon.lock", "a+")  # noqa: SIM115 - held for life
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

    async def run(self, ready: Callable[[], None] | None = None) -> None:
        """Serve until :meth:`request_stop` (or SIGTERM/SIGINT when installed)."""
        prepare_state_dir(self.state_dir)
        self._acquire_lock()
        db_path = self.state_dir / "state.db"
        self.store = StateStore(db_path)
        os.chmod(db_path, 0o600)
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
        recovered = await self.executor.recover()
        if recovered:
            log.info("re-queued %d job(s) that were running: %s", len(recovered), recovered)
        await self.executor.check_nodes(force=True)
        with contextlib.suppress(FileNotFoundError):
            self.socket_path.unlink()
        server = await asyncio.start_unix_server(self._serve_client, path=str(self.socket_path))
        os.chmod(self.socket_path, 0o666)
        log.info(
            "serving %s: %d device(s) on %d node(s), policy %s, interval %g s",
            self.socket_path,
            self.config.total_devices,
            len(self.config.nodes),
            policy_name(self.policy),
            self.config.interval_s,
        )
        loop_task = asyncio.ensure_future(self.scheduler.run())
        if ready is not None:
            ready()
        try:
            await self._stop.wait()
        finally:
            server.close()
            async with self._mutex:  # let a pass in progress finish its launches and stops
                loop_task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await loop_task
                await self.executor.shutdown()
            with contextlib.suppress(FileNotFoundError):
                self.socket_path.unlink()
            self.store.close()
            if self._lock_file is not None:
                self._lock_file.close()
            log.info("stopped")

    def request_stop(self) -> None:
        self._stop.set()

    def install_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, self.request_stop)

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
        )

    async def _serve_client(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        """Answer a connection's requests in order until it closes, goes silent for
        ``IDLE_TIMEOUT_S`` or sends a frame that breaks the framing (answered, then closed)."""
        self._connections += 1
        try:
            if self._connections > MAX_CONNECTIONS:
                writer.write(wire.encode_error(LimitExceeded("too many connections; try again")))
                return
            try:
                ctx = self.context(peer_credentials(writer.get_extra_info("socket")))
            except OSError:
                return
            while True:
                try:
                    body = await wire.read_frame(reader, IDLE_TIMEOUT_S)
                except PolluxError as exc:
                    writer.write(wire.encode_error(exc))
                    return
                except (TimeoutError, ConnectionError):
                    return
                if body is None:
                    return
                writer.write(await answer(ctx, body))
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            self._connections -= 1
            with contextlib.suppress(Exception):
                writer.close()


def setup_logging(state_dir: Path, verbose: bool = False) -> None:
    root = logging.getLogger("pollux_local")
    root.setLevel(logging.DEBUG if verbose else logging.INFO)
    fmt = logging.Formatter("%(asctime)s %(levelname)s %(message)s")
    for handler in (logging.StreamHandler(), logging.FileHandler(state_dir / "daemon.log")):
        handler.setFormatter(fmt)
        root.addHandler(handler)


def run_daemon(config: DaemonConfig, state_dir: Path, verbose: bool = False) -> int:
    """Run a daemon in the foreground until SIGTERM/SIGINT (``pollux-local daemon``)."""
    prepare_state_dir(state_dir)
    setup_logging(state_dir, verbose)
    daemon = Daemon(config, state_dir)

    async def main() -> None:
        daemon.install_signal_handlers()
        await daemon.run()

    asyncio.run(main())
    return 0
