"""The pass: snapshot -> admission -> sharing -> policy -> devices, batch sizes -> Plan."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from pollux_local.core.goodput import GoodputModel
from pollux_local.core.schedule.admission import admit
from pollux_local.core.schedule.placement import (
    allocate,
    rigid_targets,
    same_allocation,
    within_group_caps,
    within_user_caps,
)
from pollux_local.core.schedule.plan import Action, ActionKind, Plan
from pollux_local.core.schedule.reasons import WaitingWords, backoff_reason, describe
from pollux_local.core.schedule.shared import pack_onto_new_hosts, pack_shared
from pollux_local.core.schedule.snapshot import JobInput, JobPhase, Snapshot
from pollux_local.core.schedule.views import capped_view, choose_batch, predict
from pollux_local.core.types import NodeView, Placement, Policy


def schedulable(job: JobInput, now: float) -> bool:
    """Jobs the policy may see: queued (past any retry back-off) and running."""
    if job.phase is JobPhase.RUNNING:
        return True
    return job.phase is JobPhase.QUEUED and job.retry_after <= now


def run_pass(snapshot: Snapshot, policy: Policy, rng: np.random.Generator) -> Plan:
    """One scheduling decision for ``snapshot`` (see the package's docstring)."""
    now, limits, holdings = snapshot.now, snapshot.limits, snapshot.holdings
    jobs = snapshot.jobs
    candidates, held_back = admit(
        [job for job in jobs if schedulable(job, now)], limits, holdings, now
    )
    sharing = pack_shared(
        candidates, snapshot.nodes, limits.share_slowdown, limits.max_jobs_per_device
    )
    nodes = sharing.policy_nodes
    candidates = [job for job in candidates if job.id not in sharing.handled]
    types = sorted({node.device_type for node in nodes})
    typed = len(types) > 1
    type_of = {node.name: node.device_type for node in nodes}
    job_models: dict[int, GoodputModel | None] = {job.id: job.model for job in candidates}
    if typed:  # the model of the type it runs on
        for job in candidates:
            where = {type_of.get(name, "") for name in job.allocation}
            job_models[job.id] = job.models_by_type.get(where.pop()) if len(where) == 1 else None
    views = [capped_view(job, job_models[job.id], nodes, now, limits) for job in candidates]
    if typed:
        views = [
            replace(view, models_by_type=job.models_by_type, type_rates=job.type_rates or None)
            for job, view in zip(candidates, views, strict=True)
        ]
    node_views = [
        NodeView(
            name=n.name,
            devices=len(n.free_devices),
            up=n.up,
            device_type=n.device_type if typed else "",
        )
        for n in nodes
    ]
    decision = policy.decide(views, node_views, now, rng)
    empty: Placement = tuple(0 for _ in nodes)
    targets = {job.id: tuple(decision.placements.get(job.job_id, empty)) for job in candidates}
    rigid_targets(candidates, targets, nodes)
    within_user_caps(candidates, targets, nodes, limits, holdings)
    within_group_caps(candidates, targets, limits, holdings)
    allocations = allocate(candidates, targets, nodes)
    capped = sharing.capped | pack_onto_new_hosts(
        candidates, allocations, nodes, limits.share_slowdown, limits.max_jobs_per_device
    )
    explain = snapshot.explain
    waits = (
        WaitingWords(decision, candidates, views, allocations, nodes, now, snapshot.nodes)
        if explain
        else None
    )
    actions: list[Action] = []
    unchanged: list[int] = []
    reasons: dict[int, str] = {}
    predictions: dict[int, dict[str, float]] = {}
    for job in candidates:
        allocation = allocations[job.id]
        replicas = sum(len(v) for v in allocation.values())
        policy_reason = decision.reasons.get(job.job_id, "")
        if replicas == 0:
            reason = waits.reason(job) if waits is not None else "waiting"
            if job.id in capped:  # a shared job that would fit but for the cap
                reason = f"waiting: {capped[job.id]}; {reason.removeprefix('waiting: ')}"
            if job.running:
                actions.append(Action(ActionKind.STOP, job.id, {}, None, f"preempted, {reason}"))
            else:
                unchanged.append(job.id)
                if explain and reason != job.reason:
                    reasons[job.id] = reason
            continue
        num_nodes = len(allocation)
        model = job_models[job.id]
        if typed:  # the model of the type it is placed on
            placed_types = {type_of.get(name, "") for name in allocation}
            model = job.models_by_type.get(placed_types.pop()) if len(placed_types) == 1 else None
        kept = job.running and same_allocation(allocation, job.allocation)
        if kept and not explain:  # nothing to start, nothing to tell
            unchanged.append(job.id)
            continue
        choice = choose_batch(job, model, num_nodes, replicas) if job.elastic else None
        try:
            prediction = predict(model, num_nodes, choice) if explain else {}
        except (ValueError, ArithmeticError):
            prediction = {}
        if kept:
            unchanged.append(job.id)
            if prediction != job.prediction:
                predictions[job.id] = prediction
            continue
        actions.append(
            Action(
                ActionKind.RESIZE if job.running else ActionKind.START,
                job.id,
                allocation,
                choice,
                describe(policy_reason, allocation, choice, prediction) if explain else "",
                prediction,
            )
        )
    for job in jobs:  # queued jobs waiting out a back-off
        if job.phase is JobPhase.QUEUED and job.retry_after > now:
            reason = backoff_reason(job, now)
            if reason != job.reason:
                reasons[job.id] = reason
    for job in jobs:  # held back by admission
        why = held_back.get(job.id)
        if why is not None and why != job.reason:
            reasons[job.id] = why
    actions.extend(sharing.starts)
    unchanged.extend(sharing.kept)
    return Plan(
        actions=tuple(actions),
        decision=decision,
        unchanged=tuple(unchanged),
        reasons=reasons,
        predictions=predictions,
    )
