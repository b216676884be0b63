"""Accounting: node health (checks, lost nodes, the ``node-down`` decisions) and the
device-seconds, run time and last report of each incarnation that ended."""

from __future__ import annotations

import asyncio
import functools

from pollux_local.api.states import DecisionKind, ExitCode
from pollux_local.daemon.config import NodeConfig
from pollux_local.daemon.executor.base import ExecutorBase, log
from pollux_local.daemon.reports import InvalidReport, read_job_report
from pollux_local.daemon.state import JobRecord
from pollux_local.errors import PolluxError
from pollux_local.launch.base import (
    NodeHealth,
    ReplicaGroup,
)


class Accounting(ExecutorBase):
    """Node checks and the account of an incarnation's end."""

    async def check_nodes(self, force: bool = False, background: bool = False) -> None:
        """Check remote nodes every ``node_retry_s`` (all nodes when ``force``); a node that
        fails is marked down and offers no devices until a later check succeeds.

        With ``background`` the due checks run as tasks and this returns at once: a dead node
        costs its check seconds of ssh timeouts, which must not stall a scheduling pass.  A
        check that changes a node's state wakes the scheduler (``on_change``)."""
        now = self.clock()
        due = [
            node
            for node in self.config.nodes
            if force
            or (
                not node.is_local
                and node.name not in self._checking
                and now - self.nodes[node.name].checked >= self.config.node_retry_s
            )
        ]
        if not background:
            await asyncio.gather(*(self._check(node) for node in due))
            return
        for node in due:
            self._check_soon(node)

    def _check_soon(self, node: NodeConfig) -> asyncio.Task[None]:
        """A check of ``node`` running in the background: the one under way, else a new one."""
        task = self._checking.get(node.name)
        if task is None:
            task = asyncio.ensure_future(self._check(node))
            self._checking[node.name] = task
            task.add_done_callback(functools.partial(self._check_done, node.name))
        return task

    def _check_done(self, name: str, task: asyncio.Task[None]) -> None:
        self._checking.pop(name, None)

    async def _check(self, node: NodeConfig) -> None:
        try:
            health = await self.launcher_for(node).check_node(node.name)
        except PolluxError as exc:
            health = NodeHealth(node=node.name, reachable=False, error=str(exc))
        except Exception as exc:  # a broken check must not take the daemon down
            health = NodeHealth(node=node.name, reachable=False, error=repr(exc))
        self.nodes[node.name].load = health.load
        self._set_node_state(node.name, health.reachable, health.error or "")

    def _set_node_state(self, name: str, up: bool, error: str) -> None:
        """Record a node's state; on a change, log it and wake the scheduler.  A node going
        down is noted in the decision log of every job running on it."""
        if not self.nodes.mark(name, up, error, self.clock()):
            return
        log.warning("node %s is %s%s", name, "up" if up else "down", f": {error}" if error else "")
        if not up:
            now = self.clock()
            for job_id, group in self.groups.items():
                if any(slot.node == name for slot in group.spec.slots):
                    self._note_node_down(job_id, [name], now)
        self.on_change()

    def _note_node_down(self, job_id: int, names: list[str], now: float) -> None:
        """One ``node-down`` decision per job and lost node (the check and the job's exit may
        both notice the same loss)."""
        fresh = [name for name in names if (job_id, name) not in self._noted_down]
        if not fresh:
            return
        self._noted_down.update((job_id, name) for name in fresh)
        errors = "; ".join(
            error if name in error else f"{name}: {error}"
            for name in fresh
            for error in [self.nodes[name].error or "no answer"]
        )
        reason = f"node(s) {', '.join(fresh)} unreachable ({errors}); resuming from checkpoint"
        self.store.update_job(job_id, reason=reason)
        self.store.record_decision(job_id, now, DecisionKind.NODE_DOWN, reason)

    def _read_final_report(self, job: JobRecord) -> None:
        """Store the report a job wrote last (its final progress) once its replicas exited:
        ``report.json`` taken as every report is (``reports.read_job_report``: the job's
        owner's plain file, for a job that has not ended)."""
        try:
            report = read_job_report(self._job_dir(job), job)
        except InvalidReport as exc:
            log.warning("job %s: ignoring its final report: %s", job.id, exc)
            return
        if report is not None:
            self.store.update_job(job.id, report=report)

    def _account(self, job_id: int, now: float) -> None:
        job = self.store.get_job(job_id)
        if job is None or job.last_start is None:
            return
        elapsed = max(0.0, now - job.last_start)
        by_type = dict(job.device_seconds)
        for node, devices in job.placement.items():
            kind = self.config.device_type_of(node)
            by_type[kind] = by_type.get(kind, 0.0) + elapsed * len(devices)
        self.store.update_job(
            job_id,
            attained_gpu_s=job.attained_gpu_s + elapsed * job.replicas,
            device_seconds=by_type,
            run_time_s=job.run_time_s + elapsed,
            last_start=None,
            placement={},
            pids=[],
        )

    async def _lost_nodes(self, group: ReplicaGroup, code: int) -> list[str]:
        """The remote nodes a failed group lost.  A node the group says it lost
        (:meth:`ReplicaGroup.lost_nodes`: its agent refused the node, Slurm reports it down)
        is marked down at once and re-checked every ``node_retry_s``.  When the group's code
        is 255 and it names no lost node, the nodes are checked now.  The nodes whose
        replicas' ends are not known (:meth:`ReplicaGroup.unanswered_nodes`: ssh lost the
        link or the agent, or the daemon gave up waiting) were checked as the group ended
        (``Exits._settle_unanswered``): only a failed check marked such a node down.  Other
        failures (a rank timing out in a collective with a lost peer, say) count as node
        losses only when some node is down."""
        slots = group.spec.slots
        remote = [
            self.config.node(name)
            for name in dict.fromkeys(s.node for s in slots)
            if self.is_remote(name)
        ]
        if not remote:
            return []
        lost = self._mark_lost_nodes(group)
        if code == ExitCode.NODE_LOST and not lost and not group.unanswered_nodes():
            await asyncio.gather(*(self._check_soon(node) for node in remote))
        return [n.name for n in remote if not self.nodes.is_up(n.name)]

    def _mark_lost_nodes(self, group: ReplicaGroup) -> set[str]:
        """Mark down the nodes ``group`` lost (its launcher's word: the agent refused the
        node, Slurm reports it down; never a replica's exit code, 255 included, which the job
        chooses); returns those nodes."""
        lost = {name for name in group.lost_nodes() if self.is_remote(name)}
        failure = getattr(group, "failure_reason", None) or "ssh connection lost"
        for name in lost:
            if self.nodes.is_up(name):
                self._set_node_state(name, False, str(failure))
        return lost
