"""The English of a pass: why each waiting job waits, and one line for each job placed.

The reasons are worded from the policy's facts (``Decision.waiting``: the rule that left a job
waiting, the jobs that hold what it needs and why they come first) and what the pass knows:
who holds which devices (their owners, the device-hours they used and when they are expected
to end) and how many are free.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from pollux_local.core.schedule.snapshot import Allocation, Constraint, JobInput, NodeInput
from pollux_local.core.schedule.views import progress_eta
from pollux_local.core.types import BatchChoice, Decision, JobView, Waiting
from pollux_local.durations import format_duration


def in_time(seconds: float) -> str:
    """A time from now for a reason line (``durations.format_duration``, brief), rounded up so
    that a wait not yet over never reads ``0s``: ``45s``, ``4m07s``, ``12m``, ``3h05m``,
    ``4d07h``."""
    return format_duration(math.ceil(seconds), exact=False, brief=True)


def backoff_reason(job: JobInput, now: float) -> str:
    """The reason of a queued job waiting out its back-off after a crash."""
    return f"waiting: retry in {in_time(job.retry_after - now)} (back-off after a crash)"


def device_hours(seconds: float, digits: int | None = None) -> str:
    """Device-seconds as device-hours for a reason line (``digits``: decimals, else by size)."""
    hours = max(seconds, 0.0) / 3600.0
    if digits is None:
        digits = 0 if hours >= 10 else 1 if hours >= 0.1 else 2
    return f"{hours:.{digits}f}"


def service_words(theirs: float, mine: float) -> str:
    """``it has used 0.4 device-hours, this job 3.2``, with the decimals that tell apart two
    different amounts."""
    it, this = device_hours(theirs), device_hours(mine)
    for digits in range(2, 5):
        if it != this or theirs == mine:
            break
        it, this = device_hours(theirs, digits), device_hours(mine, digits)
    return f"it has used {it} device-hours, this job {this}"


class WaitingWords:
    """The reason line of each job left waiting in one pass."""

    #: holders named in one line; the rest are counted
    SHOWN = 3

    def __init__(
        self,
        decision: Decision,
        candidates: Sequence[JobInput],
        views: Sequence[JobView],
        allocations: Mapping[int, Allocation],
        nodes: Sequence[NodeInput],
        now: float,
        configured: Sequence[NodeInput],
    ) -> None:
        """``nodes``: as the policy saw them; ``configured``: as the snapshot gave them (their
        ``withheld`` devices are the reserved or drained ones)."""
        self.decision = decision
        self.records = {job.job_id: job for job in candidates}
        self.views = {view.id: view for view in views}
        self.held = {
            job.job_id: sum(len(v) for v in allocations[job.id].values()) for job in candidates
        }
        # the jobs holding devices, most devices first
        self.holding = sorted(
            (job_id for job_id, count in self.held.items() if count > 0),
            key=lambda job_id: (-self.held[job_id], int(job_id) if job_id.isdigit() else 0),
        )
        self.offered = sum(len(node.free_devices) for node in nodes)
        self.free = self.offered - sum(self.held.values())
        self.configured = configured
        #: constraint -> (devices open to jobs, devices withheld) on the nodes it allows
        self._closed: dict[Constraint | None, tuple[int, int]] = {}
        self.now = now

    def reason(self, job: JobInput) -> str:
        facts = self.decision.waiting.get(job.job_id)
        policy_reason = self.decision.reasons.get(job.job_id, "")
        needs = job.needs
        devices = f"{needs} device{'s' if needs > 1 else ''}"
        closed = self._withheld(job)
        if closed is not None:
            return f"waiting: needs {devices}; {closed}"
        if facts is not None and facts.rule == "size":
            return f"waiting: needs {devices}, the nodes offer {self.offered} now"
        if facts is not None and facts.rule == "bounds":
            return policy_reason or "cannot run: no feasible replica count within its bounds"
        head = f"waiting: needs {devices}, {self.free} free"
        if facts is not None and facts.rule == "placement":
            return f"{head}, but no placement of them fits without sharing nodes"
        if facts is not None and facts.rule == "reserved" and facts.holders:
            first = self.records.get(facts.holders[0].id)
            named = f"job {facts.holders[0].id}" + (f" ({first.owner})" if first else "")
            wide = self.decision.waiting.get(facts.holders[0].id)
            wants = f" for {wide.needs}" if wide is not None else ""
            return (
                f"{head}; a job that keeps its devices until it ends starts only after {named},"
                f" which waits{wants} (first come: so that it is not held back for ever)"
            )
        placed = sum(self.decision.placements.get(job.job_id, ())) > 0
        if facts is None and not placed and policy_reason not in ("", "waiting", "running"):
            said = policy_reason.removeprefix("waiting: ")
            head = f"waiting: {said}; needs {devices}, {self.free} free"
        return head + self._holders(job, facts)

    def _withheld(self, job: JobInput) -> str | None:
        """``3 are open to jobs (1 reserved or drained)`` when the job needs more devices than
        the nodes it may use have outside the withheld ones (which a reload or ``resume`` may
        give back), else ``None``."""
        counts = self._closed.get(job.constraint)
        if counts is None:  # counted once per constraint: a pass may word thousands of jobs
            nodes = [
                node
                for node in self.configured
                if job.constraint is None or job.constraint.allows_node(node.name, node.device_type)
            ]
            withheld = sum(len(node.withheld) for node in nodes)
            counts = (sum(len(node.devices) for node in nodes) - withheld, withheld)
            self._closed[job.constraint] = counts
        open_, withheld = counts
        if withheld == 0 or job.needs <= open_:
            return None
        verb = "is" if open_ == 1 else "are"
        return f"{open_} {verb} open to jobs ({withheld} reserved or drained)"

    def _holders(self, job: JobInput, facts: Waiting | None) -> str:
        """``; job 6 (alice) holds 2 (rigid, not preemptible; expected to finish in 20m)``"""
        rules = {h.id: h.rule for h in facts.holders} if facts is not None else None
        holders = [
            job_id
            for job_id in self.holding
            if job_id != job.job_id and (rules is None or job_id in rules)
        ]
        if not holders:
            return ""
        parts = [
            self._holder(job, job_id, rules.get(job_id, "") if rules else "")
            for job_id in holders[: self.SHOWN]
        ]
        rest = holders[self.SHOWN :]
        if rest:
            count = sum(self.held[job_id] for job_id in rest)
            many = len(rest) > 1
            parts.append(f"{len(rest)} more job{'s hold' if many else ' holds'} {count}")
        return "; " + "; ".join(parts)

    def _holder(self, job: JobInput, holder_id: str, rule: str) -> str:
        holder = self.records[holder_id]
        me, them = self.views[job.job_id], self.views[holder_id]
        notes = []
        if rule == "rigid":
            notes.append("rigid, not preemptible")
        elif rule == "priority":
            notes.append(f"priority {them.priority}, this job {me.priority}")
        elif rule == "service" and them.attained_gpu_s == me.attained_gpu_s:
            first = "was running" if them.replicas else "was submitted first"
            hours = device_hours(me.attained_gpu_s)
            notes.append(f"fair share: both have used {hours} device-hours, it {first}")
        elif rule in ("service", "kept"):
            used = service_words(them.attained_gpu_s, me.attained_gpu_s)
            if rule == "service":
                notes.append(f"fair share: {used}")
            else:
                notes.append(f"running jobs are preempted only for much less served ones: {used}")
        eta = progress_eta(holder, self.now)
        if eta is not None:
            notes.append(f"expected to finish in {in_time(eta)}")
        text = f"job {holder_id} ({holder.owner}) holds {self.held[holder_id]}"
        return text + (f" ({'; '.join(notes)})" if notes else "")


def describe(
    policy_reason: str,
    allocation: Mapping[str, Sequence[str]],
    choice: BatchChoice | None,
    prediction: Mapping[str, float],
) -> str:
    """One line for ``show`` and the TUI: why, where, which batch, predicted figures."""
    replicas = sum(len(v) for v in allocation.values())
    where = ", ".join(f"{node}[{','.join(devs)}]" for node, devs in allocation.items())
    parts = [f"{replicas} device(s) on {where}"]
    if choice is not None:
        parts.append(
            f"batch {choice.local_batch}x{choice.accum_steps}x{choice.replicas}={choice.total_batch}"
        )
    if prediction:
        parts.append(
            f"predicted speedup x{prediction['speedup']:.2f} vs 1 device, "
            f"efficiency {prediction['efficiency']:.2f}, goodput {prediction['goodput']:.1f}/s"
        )
    if policy_reason:
        parts.append(policy_reason)
    return "; ".join(parts)
