"""The daemon: a Unix-socket server, the scheduling loop and the executor, in one asyncio loop.

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
import json
import logging
import math
import os
import signal
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import psutil

from pollux_local.core.efficiency import noise_scale
from pollux_local.core.types import GradStats, Policy
from pollux_local.daemon.auth import Peer, may_modify, peer_credentials
from pollux_local.daemon.config import DaemonConfig, busy_gpus
from pollux_local.daemon.executor import Executor
from pollux_local.daemon.protocol import (
    PROTOCOL_VERSION,
    ProtocolError,
    encode_frame,
    error_reply,
    ok_reply,
    read_frame,
    validate_request,
)
from pollux_local.daemon.scheduler import (
    ModelCache,
    NodeSnapshot,
    job_kind,
    plan_round,
    predict,
)
from pollux_local.daemon.state import ACTIVE_STATES, TERMINAL_STATES, JobRecord, StateStore
from pollux_local.errors import PolluxError

log = logging.getLogger("pollux_local.daemon")

#: A connection silent for this long is closed (a stuck or malicious client holds nothing).
IDLE_TIMEOUT_S = 30.0
MAX_CONNECTIONS = 256
MAX_LOG_CHUNK = 1 << 20


def make_policy(config: DaemonConfig) -> Policy:
    """The configured policy object from the core (the very code the simulator runs)."""
    if config.policy == "fifo":
        from pollux_local.core.baselines import FifoPolicy

        return FifoPolicy()
    from pollux_local.core.policy import GoodputPolicy

    return GoodputPolicy(
        p=config.p, restart_cost_s=config.restart_cost_s, interval_s=config.interval_s
    )


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


def default_job_name(argv: list[str]) -> str:
    """The script's file name (skipping the interpreter and its options), else the program."""
    program = os.path.basename(argv[0])
    if program.startswith("python"):
        for arg in argv[1:]:
            if not arg.startswith("-"):
                return os.path.basename(arg)
    return program


def job_summary(job: JobRecord) -> dict[str, Any]:
    """The per-job row of ``status`` (the contract the CLI, the TUI and tests read)."""
    report = job.report or {}
    spec = job.spec
    batch = job.batch or {}
    running = job.state in ("running", "rescaling")
    total_batch = batch.get("total") if running else None
    return {
        "id": job.job_id,
        "name": job.name,
        "owner": job.owner_name,
        "state": job.state,
        "gpus": job.replicas,
        "devices": job.placement,
        "nodes": sorted(job.placement),
        "batch_size": total_batch if total_batch is not None else spec.get("batch_size"),
        "local_batch": batch.get("local_batch") if running else None,
        "accum_steps": batch.get("accum_steps") if running else None,
        "replicas": job.replicas,
        "goodput": job.prediction.get("goodput") if running else None,
        "efficiency": job.prediction.get("efficiency") if running else None,
        "speedup": job.prediction.get("speedup") if running else None,
        "progress": report.get("progress"),
        "epoch": report.get("epoch"),
        "metrics": report.get("metrics") or {},
        "eta_s": report.get("eta_s"),
        "min_gpus": spec.get("min_gpus"),
        "max_gpus": spec.get("max_gpus"),
        "priority": job.priority,
        "restarts": max(0, job.restarts - 1) if job.restarts else 0,
        "failures": job.failures,
        "submit_time": job.submit_time,
        "start_time": job.start_time,
        "end_time": job.end_time,
        "run_time_s": job.run_time_s + (time.time() - job.last_start if job.last_start else 0.0),
        "reason": job.reason,
        "target": spec.get("target"),
    }


def job_noise_scale(job: JobRecord) -> float | None:
    """The gradient noise scale phi = M0 * var / sqr from the job's last report
    (``core.efficiency.noise_scale``), or ``None`` without gradient statistics."""
    report = job.report or {}
    stats = report.get("grad_stats")
    bounds = report.get("bounds") or {}
    base = bounds.get("base_batch") or job.spec.get("batch_size")
    if not isinstance(stats, dict) or not base:
        return None
    try:
        grad = GradStats(sqr=float(stats["sqr"]), var=float(stats["var"]))
        value = float(noise_scale(grad, float(base)))
    except (KeyError, TypeError, ValueError, ArithmeticError):
        return None
    return value if math.isfinite(value) else None


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
        self.uid = os.geteuid()
        self.store: StateStore | None = None
        self.executor: Executor | None = None
        self._wake = asyncio.Event()
        self._stop = asyncio.Event()
        self._mutex = asyncio.Lock()
        self._connections = 0
        self._report_mtimes: dict[int, float] = {}
        self._metric_history: dict[int, deque[tuple[float, float]]] = {}
        self._last_sample: dict[int, float] = {}
        self._lock_file: Any = None
        self.ticks = 0

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
            getattr(self.policy, "name", type(self.policy).__name__),
            self.config.interval_s,
        )
        loop_task = asyncio.ensure_future(self._schedule_loop())
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

    # --- scheduling ----------------------------------------------------------------------

    async def _schedule_loop(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.config.interval_s)
            await asyncio.sleep(0.02)  # coalesce bursts of submits
            self._wake.clear()
            try:
                await self.schedule_once()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("scheduling pass failed")

    def _refresh_reports(self, jobs: list[JobRecord]) -> None:
        assert self.store is not None
        for job in jobs:
            if job.state not in ("running", "rescaling", "queued"):
                continue
            path = self.state_dir / "jobs" / job.job_id / "report.json"
            try:
                mtime = path.stat().st_mtime
            except OSError:
                continue
            if self._report_mtimes.get(job.id) == mtime:
                continue
            try:
                report = json.loads(path.read_text())
            except (OSError, ValueError):
                continue
            if isinstance(report, dict):
                self._report_mtimes[job.id] = mtime
                self.store.update_job(job.id, report=report)
                job.report = report
                self._note_metric(job, report)

    def _node_snapshot(self) -> list[NodeSnapshot]:
        assert self.executor is not None
        busy: set[str] = set()
        if any(d.startswith("cuda") for n in self.config.nodes if n.is_local for d in n.devices):
            own: set[int] = set()
            for group in self.executor.groups.values():
                for pid in group.pids().values():
                    own.add(pid)
                    with contextlib.suppress(psutil.Error):
                        own.update(c.pid for c in psutil.Process(pid).children(recursive=True))
            busy = busy_gpus(own)
        return [
            NodeSnapshot(
                name=node.name,
                devices=node.devices,
                up=self.executor.node_up.get(node.name, True),
                busy=frozenset(busy) if node.is_local else frozenset(),
            )
            for node in self.config.nodes
        ]

    async def schedule_once(self) -> None:
        """One pass: reports -> models -> policy -> plan -> executor."""
        assert self.store is not None and self.executor is not None
        async with self._mutex:
            await self.executor.check_nodes(background=True)
            now = self.clock()
            jobs = self.store.jobs(["queued", "running", "rescaling"])
            self._refresh_reports(jobs)
            nodes = self._node_snapshot()
            if not jobs:
                return
            plan = await asyncio.to_thread(
                plan_round, self.policy, jobs, nodes, self.models, now, self.rng
            )
            self.ticks += 1
            await self.executor.apply(plan)
            for job_id in plan.unchanged:
                self._refresh_prediction(job_id)
            self._sample_history(self.clock())

    def _sample_history(self, now: float) -> None:
        """One (goodput, noise scale) sample per running job, at most one per half interval
        (bursts of passes do not flood it); the store keeps the newest HISTORY_LIMIT."""
        assert self.store is not None
        spacing = 0.5 * self.config.interval_s
        running = self.store.jobs(["running"])
        live = {job.id for job in running}
        self._last_sample = {k: v for k, v in self._last_sample.items() if k in live}
        for job in running:
            if now - self._last_sample.get(job.id, -math.inf) < spacing:
                continue
            goodput = job.prediction.get("goodput")
            noise = job_noise_scale(job)
            if goodput is None and noise is None:
                continue
            self.store.add_history(job.id, now, goodput, noise)
            self._last_sample[job.id] = now

    def _refresh_prediction(self, job_id: int) -> None:
        assert self.store is not None
        job = self.store.get_job(job_id)
        if job is None or job.state != "running" or not job.batch.get("local_batch"):
            return
        model = self.models.model_for(job)
        if model is None:
            return
        from pollux_local.core.types import BatchChoice

        choice = BatchChoice(
            int(job.batch["local_batch"]), int(job.batch.get("accum_steps", 1)), job.replicas
        )
        with contextlib.suppress(ValueError, ArithmeticError):
            self.store.update_job(job_id, prediction=predict(model, len(job.placement), choice))

    # --- connections ---------------------------------------------------------------------

    async def _serve_client(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        self._connections += 1
        try:
            if self._connections > MAX_CONNECTIONS:
                writer.write(encode_frame(error_reply("too many connections; try again")))
                return
            try:
                peer = peer_credentials(writer.get_extra_info("socket"))
            except OSError:
                return
            while True:
                try:
                    message = await read_frame(reader, IDLE_TIMEOUT_S)
                except ProtocolError as exc:
                    writer.write(encode_frame(error_reply(f"protocol error: {exc}")))
                    return
                except (TimeoutError, ConnectionError):
                    return
                if message is None:
                    return
                reply = await self._answer(message, peer)
                writer.write(encode_frame(reply))
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            self._connections -= 1
            with contextlib.suppress(Exception):
                writer.close()

    async def _answer(self, message: dict[str, Any], peer: Peer) -> dict[str, Any]:
        try:
            kind, fields = validate_request(message)
            handler = getattr(self, f"_on_{kind}")
            result = await handler(peer, **fields)
            return ok_reply(**result)
        except (ProtocolError, PolluxError) as exc:
            return error_reply(str(exc))
        except Exception as exc:  # never let one request take the daemon down
            log.exception("request %r failed", message.get("type"))
            return error_reply(f"internal error: {exc.__class__.__name__}: {exc}")

    # --- request handlers ----------------------------------------------------------------

    def _job(self, job_id: str) -> JobRecord:
        assert self.store is not None
        job = self.store.get_job(int(job_id)) if job_id.strip().isdigit() else None
        if job is None:
            raise PolluxError(f"no job with id {job_id!r}")
        return job

    def _check_may_modify(self, peer: Peer, job: JobRecord, verb: str) -> None:
        if not may_modify(peer, job.owner_uid, self.config.admin_group, self.uid):
            raise PolluxError(
                f"permission denied: job {job.id} belongs to {job.owner_name}; "
                f"only its owner or an admin may {verb} it"
            )

    async def _on_ping(self, peer: Peer) -> dict[str, Any]:
        return {
            "version": PROTOCOL_VERSION,
            "pid": os.getpid(),
            "state_dir": str(self.state_dir),
            "devices": self.config.total_devices,
            "policy": getattr(self.policy, "name", type(self.policy).__name__),
            "you": {"uid": peer.uid, "name": peer.name},
        }

    async def _on_submit(self, peer: Peer, **fields: Any) -> dict[str, Any]:
        assert self.store is not None
        argv: list[str] = fields["argv"]
        if not argv or not argv[0]:
            raise PolluxError("submit: the command is empty")
        workdir = fields["workdir"]
        if not os.path.isabs(workdir):
            raise PolluxError(f"submit: workdir must be an absolute path, got {workdir!r}")
        min_gpus = fields.get("min_gpus", 1)
        max_gpus = fields.get("max_gpus")
        total = self.config.total_devices
        if min_gpus < 1:
            raise PolluxError(f"min_gpus must be at least 1, got {min_gpus}")
        if max_gpus is not None and max_gpus < min_gpus:
            raise PolluxError(f"min_gpus {min_gpus} is greater than max_gpus {max_gpus}")
        if min_gpus > total:
            raise PolluxError(
                f"the job needs at least {min_gpus} device(s) but this daemon has {total}"
            )
        batch = fields.get("batch_size")
        max_batch = fields.get("max_batch_size")
        min_local = fields.get("min_local_batch")
        max_local = fields.get("max_local_batch")
        for key in ("batch_size", "max_batch_size", "min_local_batch", "max_local_batch"):
            value = fields.get(key)
            if value is not None and value <= 0:
                raise PolluxError(f"{key} must be positive, got {value}")
        if max_batch is not None and batch is None:
            raise PolluxError("max_batch_size needs batch_size")
        if max_batch is not None and batch is not None and max_batch < batch:
            raise PolluxError(f"max_batch_size {max_batch} is below batch_size {batch}")
        if min_local is not None and max_local is not None and max_local < min_local:
            raise PolluxError(f"max_local_batch {max_local} is below min_local_batch {min_local}")
        name = fields.get("name") or default_job_name(argv)
        spec = {
            "argv": argv,
            "workdir": workdir,
            "min_gpus": min_gpus,
            "max_gpus": max_gpus,
            "batch_size": batch,
            "max_batch_size": max_batch,
            "min_local_batch": min_local,
            "max_local_batch": max_local,
            "target": fields.get("target"),
        }
        job = self.store.add_job(
            name=name,
            owner_uid=peer.uid,
            owner_gid=peer.gid,
            owner_name=peer.name,
            spec=spec,
            priority=fields.get("priority", 0),
            submit_time=self.clock(),
            held=fields.get("hold", False),
            env=fields.get("env") or {},
        )
        self.store.record_decision(job.id, job.submit_time, "submitted", f"by {peer.name}")
        self.wake()
        return {"id": job.job_id, "state": job.state}

    async def _on_status(self, peer: Peer, all: bool = True) -> dict[str, Any]:  # noqa: A002
        assert self.store is not None
        jobs = self.store.jobs() if all else self.store.jobs(ACTIVE_STATES)
        return {"jobs": [self._summary(job) for job in jobs]}

    def _summary(self, job: JobRecord) -> dict[str, Any]:
        summary = job_summary(job)
        if summary["eta_s"] is None and job.state in ("running", "rescaling"):
            summary["eta_s"] = self._eta(job)
        return summary

    async def _on_show(self, peer: Peer, id: str) -> dict[str, Any]:  # noqa: A002
        assert self.store is not None
        job = self._job(id)
        summary = self._summary(job)
        summary["argv"] = job.spec.get("argv")
        summary["workdir"] = job.spec.get("workdir")
        summary["batch_bounds"] = {
            k: job.spec.get(k)
            for k in ("batch_size", "max_batch_size", "min_local_batch", "max_local_batch")
        }
        summary["job_dir"] = str(self.state_dir / "jobs" / job.job_id)
        summary["pids"] = job.pids
        summary["report"] = job.report
        summary["noise_scale"] = job_noise_scale(job)
        summary["model"] = self._model_summary(job)
        summary["history"] = self.store.history(job.id)
        if may_modify(peer, job.owner_uid, self.config.admin_group, self.uid):
            summary["env"] = job.env or {}
        return {"job": summary, "decisions": self.store.decisions(job.id, limit=100)}

    def _model_summary(self, job: JobRecord) -> dict[str, Any] | None:
        """The job's fitted throughput model (``ThroughputParams.to_dict()``) with what it was
        fitted from, or ``None`` before the job has reported a profile and gradient stats."""
        model = self.models.model_for(job)
        if model is None:
            return None
        profile = (job.report or {}).get("profile") or []
        return {
            "params": model.params.to_dict(),
            "profile_points": len(profile),
            # points the model was fitted to, the job's kind's included
            "fitted_points": len(self.models.pool.points_for(job_kind(job), {})),
            "base_batch": model.bounds.base_batch,
        }

    async def _on_logs(
        self,
        peer: Peer,
        id: str,
        rank: int = 0,
        offset: int = 0,
        max_bytes: int = 65536,  # noqa: A002
    ) -> dict[str, Any]:
        job = self._job(id)
        path = self.state_dir / "jobs" / job.job_id / f"rank{rank}.log"
        max_bytes = max(1, min(max_bytes, MAX_LOG_CHUNK))
        try:
            with open(path, "rb") as handle:
                size = os.fstat(handle.fileno()).st_size
                start = max(0, size + offset) if offset < 0 else min(offset, size)
                handle.seek(start)
                data = handle.read(max_bytes)
        except FileNotFoundError:
            if rank != 0 and job.state not in ("queued", "held"):
                raise PolluxError(f"job {job.id} has no log for rank {rank}") from None
            size, start, data = 0, 0, b""
        return {
            "data": data.decode(errors="replace"),
            "offset": start + len(data),
            "size": size,
            "state": job.state,
        }

    async def _on_cancel(self, peer: Peer, ids: list[str]) -> dict[str, Any]:
        assert self.executor is not None
        if not ids:
            raise PolluxError("cancel: no job ids given")
        jobs = [self._job(job_id) for job_id in ids]
        for job in jobs:
            self._check_may_modify(peer, job, "cancel")
        cancelled, skipped = [], []
        async with self._mutex:
            for job in jobs:
                current = self._job(job.job_id)
                if current.state in TERMINAL_STATES:
                    skipped.append({"id": job.job_id, "state": current.state})
                    continue
                await self.executor.cancel(job.id)
                cancelled.append(job.job_id)
        self.wake()
        return {"cancelled": cancelled, "skipped": skipped}

    async def _on_hold(self, peer: Peer, id: str) -> dict[str, Any]:  # noqa: A002
        assert self.executor is not None
        job = self._job(id)
        self._check_may_modify(peer, job, "hold")
        async with self._mutex:
            job = self._job(id)
            if job.state in TERMINAL_STATES:
                raise PolluxError(f"job {job.id} has already {job.state}")
            if job.state != "held":
                await self.executor.hold(job.id)
        self.wake()
        return {"id": job.job_id, "state": "held"}

    async def _on_release(self, peer: Peer, id: str) -> dict[str, Any]:  # noqa: A002
        assert self.store is not None
        job = self._job(id)
        self._check_may_modify(peer, job, "release")
        async with self._mutex:
            job = self._job(id)
            if job.state != "held":
                raise PolluxError(f"job {job.id} is not held (it is {job.state})")
            self.store.update_job(job.id, state="queued", reason="released", retry_after=0.0)
            self.store.record_decision(job.id, self.clock(), "released", f"by {peer.name}")
        self.wake()
        return {"id": job.job_id, "state": "queued"}

    async def _on_set_priority(self, peer: Peer, id: str, priority: int) -> dict[str, Any]:  # noqa: A002
        assert self.store is not None
        job = self._job(id)
        self._check_may_modify(peer, job, "change the priority of")
        self.store.update_job(job.id, priority=priority)
        self.store.record_decision(job.id, self.clock(), "priority", f"set to {priority}")
        self.wake()
        return {"id": job.job_id, "priority": priority}

    async def _on_nodes(self, peer: Peer) -> dict[str, Any]:
        assert self.store is not None and self.executor is not None
        users: dict[str, dict[str, str]] = {}
        for job in self.store.jobs(["running", "rescaling"]):
            for node_name, devices in job.placement.items():
                for device in devices:
                    users.setdefault(node_name, {})[device] = job.job_id
        snapshot = {node.name: node for node in self._node_snapshot()}
        rows = []
        for node in self.config.nodes:
            health = self.executor.node_health.get(node.name)
            load = health.load if health is not None else None
            if node.is_local:
                load = os.getloadavg()[0] / max(1, os.cpu_count() or 1)
            rows.append(
                {
                    "name": node.name,
                    "host": node.host or "localhost",
                    "local": node.is_local,
                    "up": self.executor.node_up.get(node.name, True),
                    "error": self.executor.node_error.get(node.name) or None,
                    "devices": list(node.devices),
                    "busy": sorted(snapshot[node.name].busy),
                    "jobs": users.get(node.name, {}),
                    "load": None if load is None else round(load, 3),
                }
            )
        return {"nodes": rows}

    async def _on_report(self, peer: Peer, job_id: str, report: dict[str, Any]) -> dict[str, Any]:
        assert self.store is not None
        job = self._job(job_id)
        self._check_may_modify(peer, job, "report for")
        if job.state in TERMINAL_STATES:
            return {"accepted": False}
        self.store.update_job(job.id, report=report)
        self._note_metric(job, report)
        return {"accepted": True}

    def _note_metric(self, job: JobRecord, report: dict[str, Any]) -> None:
        """Remember (time, target metric) points for the ETA estimate."""
        target = job.spec.get("target") or {}
        value = (report.get("metrics") or {}).get(target.get("metric"))
        if not isinstance(value, int | float) or isinstance(value, bool):
            return
        history = self._metric_history.setdefault(job.id, deque(maxlen=12))
        stamp = float(report.get("time") or self.clock())
        if not history or history[-1][0] < stamp:
            history.append((stamp, float(value)))

    def _eta(self, job: JobRecord) -> float | None:
        """Seconds until the target metric is reached, from a least-squares line through its
        recent values: t* = t_last + (target - y_last) / slope, when it moves the right way."""
        target = job.spec.get("target") or {}
        history = self._metric_history.get(job.id)
        goal = target.get("value")
        if not history or len(history) < 3 or not isinstance(goal, int | float):
            return None
        times = np.array([t for t, _ in history])
        values = np.array([v for _, v in history])
        if np.ptp(times) <= 0:
            return None
        slope = float(np.polyfit(times - times[-1], values, 1)[0])
        remaining = float(goal) - values[-1]
        maximise = target.get("mode", "max") == "max"
        if (remaining <= 0) if maximise else (remaining >= 0):
            return 0.0
        if slope == 0 or (slope > 0) != maximise:
            return None
        return max(0.0, remaining / slope - (self.clock() - times[-1]))


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
