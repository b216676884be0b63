"""Warm resizes: an elastic job (on one node of this machine, or on SSH nodes) changes its
replicas in place (``[scheduler] warm_resize``); the replicas that stay keep training state in
memory.

A ``RESIZE`` action is applied warm when all of these hold (:meth:`Warm._warm_action`), else
as a checkpoint-restart as before:

* the job is elastic, its group can resize in place (``launch.base.WarmResizable``: this
  machine's launcher or the SSH launcher, not a Slurm step nor a group adopted after a
  restart) and was started to take orders (``LaunchSpec.takes_orders``: here at an order file
  of the daemon's, ``LaunchSpec.resize_file``, there at one the node agent makes, never a path
  from the job's environment, since the supervisor or the agent writes there as root), and its
  reports say it acts on them (``JobReport.resizes_in_place``: the job library's
  ``ElasticTrainer``);
* the group reaches the new nodes (``resizes_onto``: this machine's only its one node, the
  SSH launcher any of its nodes), and ``core.schedule.inplace.plan_in_place`` allows it:
  the first ranks on each node the job keeps stay on their devices (the policy's choice on
  their node is swapped for those when no other start of the plan claims them), renumbered
  in their order when some rank before them leaves (``ResizeOrder.ranks``; rank 0's node
  may be given up, the lowest rank that stays becoming rank 0), and joiners get devices no
  running replica holds (a move keeps fewer ranks than the new size: ``ResizeOrder.kept``).

Then (:meth:`Warm._resize_warm`): the job goes ``RESCALING``; the supervisor (or the node
agent) starts the joiners and, once they are ready, writes the order
(``LocalReplicaGroup.resize_warm``, ``SshReplicaGroup.resize_warm``); the
job goes back to ``RUNNING`` on its new devices once it reports a step at the new size.  Until
then a stop of the group counts as a resize's (``StopIntent.RESIZE``): a job whose new group
did not form checkpoints and exits 75, and is restarted at its new size.  When the order
cannot be given (a joiner failed or was not ready in ``warm_timeout_s``), or the job does not
report at its new size in ``warm_timeout_s`` (a job library too old to take orders), the
resize falls back to the checkpoint-restart.  The downtime is measured as a warm resize's
(``daemon/resizes.py``), from the order to the first step at the new size.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

from pollux_local.api.resize import ResizeOrder
from pollux_local.api.states import DecisionKind, JobState, StopIntent
from pollux_local.core.schedule.inplace import plan_in_place
from pollux_local.daemon.executor.base import Device, log
from pollux_local.daemon.executor.exits import Exits
from pollux_local.daemon.resizes import resizes_of
from pollux_local.daemon.scheduler import Action, ActionKind
from pollux_local.daemon.state import DecisionEntry
from pollux_local.launch.base import LaunchSpec, ReplicaSlot, WarmResizable, pick_master_port

#: Orders of one incarnation are numbered from ``incarnation * GENERATIONS`` (a ready file
#: left by an earlier incarnation's joiner never matches a newer order).
GENERATIONS = 1000
#: How often the job's reports are looked at while a warm resize waits for its first step.
CONFIRM_POLL_S = 0.1


@dataclasses.dataclass(frozen=True)
class InPlace:
    """A resize as it is done in place (:func:`plan_in_place`, computed once): the action
    with its allocation in rank order, the new group's (node, device) by rank and the old
    ranks that stay, in their new order."""

    action: Action
    slots: list[Device]
    stayers: list[int]


class Warm(Exits):
    """Resizing an elastic job in place."""

    def _warm_action(self, action: Action, claimed: set[Device]) -> InPlace | None:
        """How ``action`` (a resize) is done in place; ``None`` when it must be a
        checkpoint-restart.  ``claimed``: devices other actions of the plan start on."""
        if not self.config.warm_resize or action.kind is not ActionKind.RESIZE:
            return None
        job_id = action.job_id
        group = self.groups.get(job_id)
        job = self.store.get_job(job_id)
        if (
            not isinstance(group, WarmResizable)
            or not group.warm_capable
            or group.poll() is not None
            or job_id in self._warming
            or job is None
            or not job.spec.elastic
            or job.state is not JobState.RUNNING
            or job.report is None
            or not job.report.resizes_in_place
            # an incarnation numbers its orders below the next one's: past that, a
            # checkpoint-restart starts the numbering again (review s72)
            or self._warm_count.get(job_id, 0) + 1 >= GENERATIONS
        ):
            return None
        old = [(slot.node, slot.device) for slot in sorted(group.spec.slots, key=lambda s: s.rank)]
        wanted = {node: list(devices) for node, devices in action.allocation.items() if devices}
        if not group.resizes_onto(wanted):
            return None
        planned = plan_in_place(old, wanted, claimed)
        if planned is None:
            return None
        slots, stayers = planned
        allocation: dict[str, list[str]] = {}
        for node, device in slots:
            allocation.setdefault(node, []).append(device)
        return InPlace(dataclasses.replace(action, allocation=allocation), slots, stayers)

    async def _resize_warm(self, in_place: InPlace) -> None:
        """Resize the job in place as planned; fall back to a checkpoint-restart when the
        order cannot be given or the job does not take it."""
        action = in_place.action
        job_id = action.job_id
        group = self.groups.get(job_id)
        job = self.store.get_job(job_id)
        if not isinstance(group, WarmResizable) or job is None:
            return
        now = self.clock()
        count = self._warm_count.get(job_id, 0) + 1
        self._warm_count[job_id] = count
        generation = min(2**31, max(1, job.restarts) * GENERATIONS + count)
        spec = self._warm_spec(group.spec, in_place)
        stayers = in_place.stayers
        kept = len(stayers)
        renumbered = stayers != list(range(kept))
        batch = action.batch
        order = ResizeOrder(
            generation=generation,
            world_size=len(spec.slots),
            master_addr=spec.env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=int(spec.env["MASTER_PORT"]),
            local_batch=batch.local_batch if batch is not None else None,
            accum_steps=batch.accum_steps if batch is not None else None,
            # a move (some leave while others join) says who stays; else the default
            kept=kept if kept != min(len(group.spec.slots), len(spec.slots)) else None,
            ranks=tuple(stayers) if renumbered else None,
            num_nodes=len({slot.node for slot in spec.slots}),
        )
        self.store.transition(
            job_id, JobState.RESCALING, now,
            DecisionEntry(
                DecisionKind.RESIZE, f"{action.reason} (in place)", action.allocation,
                _batch_columns(action, len(spec.slots)),
            ),
        )  # fmt: skip
        error = await group.resize_warm(spec, order, self.config.warm_timeout_s)
        if self.groups.get(job_id) is not group:
            return  # stopped meanwhile (cancel, hold, a time limit, a shutdown): its exit decides
        if error is not None:
            log.info("job %s: warm resize %d not ordered (%s)", job_id, generation, error)
            self._fall_back(job_id, group, action, f"in place: {error}")
            return
        ordered_at = self.clock()
        log.info(
            "job %s: resize %d ordered in place: %d -> %d replica(s)",
            job_id, generation, sum(len(d) for d in (job.placement or {}).values()),
            order.world_size,
        )  # fmt: skip
        resizes = resizes_of(self.store)
        current = self.store.get_job(job_id)
        report = current.report if current is not None else None
        resizes.begin(job_id, ordered_at, report, warm=True)
        resizes.launched(job_id, ordered_at, True, report, replicas=order.world_size)
        # until the job steps at its new size, its exit is a resize's (its own fallback
        # checkpoints and exits 75) and the devices it goes to are its
        self.intent[job_id] = StopIntent.RESIZE
        self._resize[job_id] = action
        await self._launch_waiting()  # a shrink's devices are free: the leavers have exited
        progress = report.progress if report is not None else None
        confirmed = await self._stepped_at(job_id, group, order.world_size, progress)
        if self.groups.get(job_id) is not group:
            return
        if not confirmed:
            log.info("job %s: no step after warm resize %d; restarting it", job_id, generation)
            self._fall_back(job_id, group, action, "in place: the job took no step at its new size")
            return
        log.info(
            "job %s: resized in place to %d replica(s), first step %.2f s after the order",
            job_id, order.world_size, self.clock() - ordered_at,
        )  # fmt: skip
        self.intent.pop(job_id, None)
        self._resize.pop(job_id, None)
        self.store.transition(
            job_id, JobState.RUNNING, self.clock(), None,
            only_from=[JobState.RESCALING],
            placement=action.allocation,
            batch=_batch_columns(action, len(spec.slots), total=True),
            # as a start records them: with each local process's start time, which tells it
            # from a later process given its pid (``recovery._stop_orphans``; review s72)
            pids=self.pid_records(
                spec.slots,
                {
                    rank: pid
                    for rank, pid in sorted(group.pids().items())
                    if 0 <= rank < len(spec.slots)
                },
            ),
            reason=action.reason,
            prediction=action.prediction,
        )  # fmt: skip
        self.on_change()
        await self._launch_waiting()

    def _warm_spec(self, spec: LaunchSpec, in_place: InPlace) -> LaunchSpec:
        """The running group's spec after the resize: the ranks that stay where they are
        (renumbered), joiners on the added devices, a new rendezvous port and the
        scheduler's batch."""
        action, placed, stayers = in_place.action, in_place.slots, in_place.stayers
        by_rank = sorted(spec.slots, key=lambda s: s.rank)
        kept = len(stayers)
        order = list(dict.fromkeys(node for node, _ in placed))
        slots = [dataclasses.replace(by_rank[old], rank=new) for new, old in enumerate(stayers)]
        for rank, (node, device) in enumerate(placed[kept:], start=kept):
            local = sum(1 for other, _ in placed[:rank] if other == node)
            slots.append(ReplicaSlot(rank, node, device, local, order.index(node)))
        env = {**spec.env, "MASTER_PORT": str(pick_master_port())}
        env.pop("POLLUX_LOCAL_BATCH", None)
        env.pop("POLLUX_ACCUM_STEPS", None)
        if action.batch is not None:
            env["POLLUX_LOCAL_BATCH"] = str(action.batch.local_batch)
            env["POLLUX_ACCUM_STEPS"] = str(action.batch.accum_steps)
        env["POLLUX_NUM_NODES"] = str(len(order))
        return dataclasses.replace(spec, slots=slots, env=env)

    async def _stepped_at(
        self, job_id: int, group: WarmResizable, replicas: int, progress: float | None
    ) -> bool:
        """Whether the job reports a step at ``replicas`` (beyond ``progress``) within
        ``warm_timeout_s``.  Its report is read every :data:`CONFIRM_POLL_S`, never its
        environment (up to 4 MB, 13 ms a look for 200,000 variables: review s69)."""
        deadline = time.monotonic() + self.config.warm_timeout_s
        while time.monotonic() < deadline and self.groups.get(job_id) is group:
            found = self.store.jobs_by_id([job_id])
            report = found[0].report if found else None
            if (
                report is not None
                and report.batch is not None
                and report.batch.replicas == replicas
                and report.progress is not None
                and (progress is None or report.progress > progress)
            ):
                return True
            await asyncio.sleep(CONFIRM_POLL_S)
        return False

    def _fall_back(self, job_id: int, group: WarmResizable, action: Action, why: str) -> None:
        """Resize ``job_id`` by checkpoint-restart after all (its group stopped for a
        resize; the job restarts on ``action``'s devices once it has exited)."""
        now = self.clock()
        self.store.record_decision(job_id, now, DecisionKind.RESIZE, f"{action.reason} ({why})")
        resizes_of(self.store).begin(job_id, now, None)
        self._resize[job_id] = action
        self._begin_stop(job_id, group, StopIntent.RESIZE)

    def _start_warm(self, in_place: InPlace) -> None:
        """Run :meth:`_resize_warm` as a task of its own (a pass never waits for it)."""
        action = in_place.action
        job_id = action.job_id

        async def run() -> None:
            try:
                await self._resize_warm(in_place)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("job %s: warm resize failed", job_id)
                group = self.groups.get(job_id)
                if isinstance(group, WarmResizable):
                    self._fall_back(job_id, group, action, "in place: failed")
            finally:
                if self._warming.get(job_id) is task:
                    del self._warming[job_id]

        task = asyncio.ensure_future(run())
        self._warming[job_id] = task


def _batch_columns(action: Action, replicas: int, total: bool = False) -> dict[str, int]:
    """The decision's (or, with ``total``, the job's) batch columns of ``action``."""
    batch = action.batch
    if batch is None:
        return {"replicas": replicas}
    columns = {
        "local_batch": batch.local_batch,
        "accum_steps": batch.accum_steps,
        "replicas": replicas,
    }
    if total:
        columns["total"] = batch.total_batch
    return columns
