"""A daemon without processes, for scheduler-level tests over many rounds: the real store,
executor and scheduling loop on a fake clock, with a launcher that starts nothing.

``await harness.tick(seconds)`` advances the clock and runs one scheduling pass exactly as the
daemon's loop runs it (``SchedulingLoop.schedule_once``: ``plan_round``, the executor applying
the plan, the reasons and predictions stored); ``await harness.finish(job_id)`` makes a running
job's replicas exit with a code, as if it ended on its own.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from pollux_local.core.types import Policy
from pollux_local.daemon.auth import Peer
from pollux_local.daemon.config import DaemonConfig, NodeConfig
from pollux_local.daemon.context import Context
from pollux_local.daemon.executor import Executor
from pollux_local.daemon.loop import SchedulingLoop
from pollux_local.daemon.readmodel import MetricHistory
from pollux_local.daemon.scheduler import ModelCache
from pollux_local.daemon.state import JobRecord, StateStore
from pollux_local.launch.base import LaunchSpec, NodeHealth


class FakeGroup:
    """A replica group that runs nothing: it ends when told (:meth:`end`) or stopped (75)."""

    def __init__(self, spec: LaunchSpec) -> None:
        self.spec = spec
        self.exit: asyncio.Future[int] = asyncio.get_running_loop().create_future()

    def end(self, code: int) -> None:
        if not self.exit.done():
            self.exit.set_result(code)

    def poll(self) -> int | None:
        return self.exit.result() if self.exit.done() else None

    async def wait(self) -> int:
        return int(await asyncio.shield(self.exit))

    async def stop(self, grace_s: float) -> int:
        self.end(75)  # checkpointed and exited
        return await self.wait()

    def pids(self) -> Mapping[int, int]:
        return {}

    def lost_nodes(self) -> set[str]:
        return set()

    def unanswered_nodes(self) -> set[str]:
        return set()


class FakeLauncher:
    """Records every launch (its spec: slots and environment) per job."""

    def __init__(self) -> None:
        self.launches: dict[str, list[FakeGroup]] = {}

    async def launch(self, spec: LaunchSpec) -> FakeGroup:
        group = FakeGroup(spec)
        self.launches.setdefault(spec.job_id, []).append(group)
        return group

    async def check_node(self, node: str) -> NodeHealth:
        return NodeHealth(node, True)


class Harness:
    """The daemon's scheduling machinery on ``devices`` (devices per node, nodes ``node0``...)."""

    def __init__(
        self,
        root: Path,
        devices: Sequence[int],
        policy: Policy,
        *,
        interval_s: float = 60.0,
        models: ModelCache | None = None,
    ) -> None:
        self.now = 0.0
        nodes = tuple(
            NodeConfig(f"node{i}", tuple(f"cpu:{d}" for d in range(count)))
            for i, count in enumerate(devices)
        )
        self.config = DaemonConfig(nodes=nodes, interval_s=interval_s, stop_grace_s=1.0)
        root.mkdir(parents=True, exist_ok=True)
        self.store = StateStore(root / "state.db")
        self.executor = Executor(
            self.store, self.config, root, root / "daemon.sock", clock=self.clock
        )
        self.launcher = FakeLauncher()
        self.executor._local = self.launcher  # type: ignore[assignment]
        self.loop = SchedulingLoop(
            store=self.store,
            executor=self.executor,
            config=self.config,
            state_dir=root,
            policy=policy,
            models=models or ModelCache(),
            metrics=MetricHistory(),
            mutex=asyncio.Lock(),
            wake_event=asyncio.Event(),
            clock=self.clock,
            rng=np.random.default_rng(0),
        )

    def clock(self) -> float:
        return self.now

    def context(self, uid: int | None = None, **fields: Any) -> Context:
        """The handlers' :class:`Context` over this daemon, for a request from ``uid`` (default:
        the daemon's own user), with ``fields`` set besides (``forecasts=...``)."""
        return Context(
            peer=Peer(pid=1, uid=os.geteuid() if uid is None else uid, gid=os.getegid()),
            store=self.store,
            executor=self.executor,
            config=self.config,
            state_dir=self.loop.state_dir,
            clock=self.clock,
            models=ModelCache(),
            metrics=MetricHistory(),
            mutex=self.loop.mutex,
            wake=lambda: None,
            daemon_uid=0,
            policy_name="fifo",
            **fields,
        )

    def submit(self, *, owner: str = "ann", priority: int = 0, **spec: Any) -> int:
        """A job as the submit handler stores it (``spec``: its fields, ``elastic`` included)."""
        full: dict[str, Any] = {"argv": ["train.py"], "workdir": "/", "min_gpus": 1}
        full.update(spec)
        job = self.store.add_job(
            name=f"job-{self.store.count_jobs() + 1}",
            # the daemon's own uid: it runs as them (another uid's jobs start only while
            # that uid is still the account ``owner`` names: ``launchspec.owner_gone``)
            owner_uid=os.geteuid(),
            owner_gid=os.getegid(),
            owner_name=owner,
            spec=full,
            priority=priority,
            submit_time=self.now,
        )
        self.store.record_decision(job.id, self.now, "submitted", f"by {owner}")
        return job.id

    def job(self, job_id: int) -> JobRecord:
        job = self.store.get_job(job_id)
        assert job is not None
        return job

    async def tick(self, seconds: float = 0.0) -> None:
        """Advance the clock, then one scheduling pass."""
        self.now += seconds
        await self.loop.schedule_once()
        # stops run as tasks of their own and a start waiting for the devices they free
        # launches when they end: let those settle, as the real loop would before its next pass
        for _ in range(200):
            await asyncio.sleep(0)

    async def finish(self, job_id: int, code: int = 0) -> None:
        """The job's running replicas exit with ``code``; returns once the executor noticed."""
        self.launcher.launches[str(job_id)][-1].end(code)
        for _ in range(200):
            if self.job(job_id).state != "running":
                return
            await asyncio.sleep(0.001)
        raise AssertionError(f"job {job_id} still running after its replicas exited")

    def decisions(self, job_id: int) -> list[dict[str, Any]]:
        return self.store.decisions(job_id, limit=10_000)
