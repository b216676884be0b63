"""A job as a policy sees it, counted at the pass's time, and its batch and predictions.

A job's view is taken as the simulator takes it: attained service and run time include the
run in progress (stored + replicas x (now - last start)); restarts count the starts after the
first.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import replace

import numpy as np

from pollux_local.core.goodput import GoodputModel
from pollux_local.core.schedule.snapshot import JobInput, JobPhase, Limits, NodeInput
from pollux_local.core.types import BatchChoice, JobView, Placement


def placement_of(allocation: Mapping[str, Sequence[str]], nodes: Sequence[NodeInput]) -> Placement:
    """Devices per node, in the nodes' order."""
    if not allocation:  # (a queued job's)
        return (0,) * len(nodes)
    return tuple(len(allocation.get(node.name, ())) for node in nodes)


def current_run_s(job: JobInput, now: float) -> float:
    """Seconds of the run in progress (0 when the job is not running)."""
    if job.phase is not JobPhase.RUNNING or job.last_start is None:
        return 0.0
    return max(0.0, now - job.last_start)


def attained_gpu_s(job: JobInput, now: float) -> float:
    """Device-seconds the job has used, the run in progress included."""
    return job.attained_gpu_s + job.replicas * current_run_s(job, now)


def run_time_s(job: JobInput, now: float) -> float:
    """Seconds the job has run, the run in progress included."""
    return job.run_time_s + current_run_s(job, now)


def time_left_s(job: JobInput, now: float) -> float | None:
    """Seconds the job may still run before its time limit (``None``: no limit)."""
    limit = job.time_limit_s
    return None if limit is None else max(0.0, limit - run_time_s(job, now))


def static_replicas(job: JobInput, total_devices: int) -> int:
    """The device count a non-adaptive policy gives: the user's maximum, within the cluster
    (a rigid job: its size)."""
    low = job.needs
    if not job.elastic:
        return low
    wanted = int(job.max_devices) if job.max_devices else low
    return max(low, min(wanted, max(total_devices, low)))


def allowed_nodes(job: JobInput, nodes: Sequence[NodeInput]) -> frozenset[int] | None:
    """Indices of the nodes the job's constraint allows (``None``: no constraint)."""
    constraint = job.constraint
    if constraint is None:
        return None
    return frozenset(
        i for i, node in enumerate(nodes) if constraint.allows_node(node.name, node.device_type)
    )


def job_view(job: JobInput, nodes: Sequence[NodeInput], now: float) -> JobView:
    """The job as a policy sees it at ``now``, with its own model."""
    return view_with(job, job.model, nodes, now)


def waited_s(job: JobInput, now: float) -> float:
    """How long a queued job has waited to run: since it was last queued (its submit, a
    release, a requeue), its begin time or the end of its back-off, whichever is latest."""
    since = job.submit_time if job.queued_since is None else job.queued_since
    since = max(since, job.begin_at or since, job.retry_after)
    return max(0.0, now - since)


def view_with(
    job: JobInput, model: GoodputModel | None, nodes: Sequence[NodeInput], now: float
) -> JobView:
    """The job as a policy sees it at ``now``, with ``model``."""
    total = sum(len(node.devices) for node in nodes)
    low = job.needs
    return JobView(
        id=job.job_id,
        owner=job.owner,
        model=model,
        age_s=max(0.0, now - job.submit_time),
        waited_s=waited_s(job, now),
        # the count is of starts; a view counts the changes after the first
        restarts=max(job.restarts - 1, 0),
        min_replicas=low,
        max_replicas=(int(job.max_devices) if job.max_devices else 1 << 30) if job.elastic else low,
        placement=placement_of(job.allocation, nodes),
        submit_time=job.submit_time,
        priority=job.priority,
        max_profiled_replicas=job.max_profiled_replicas,
        static_replicas=static_replicas(job, total),
        static_batch=job.batch_size,
        attained_gpu_s=attained_gpu_s(job, now),
        run_time_s=run_time_s(job, now),
        progress_fraction=job.progress_fraction,
        rigid=not job.elastic,
        preemptible=job.may_stop,
        time_left_s=time_left_s(job, now),
        allowed_nodes=allowed_nodes(job, nodes),
        restart_cost_s=job.restart_cost_s,
        warm_resize_cost_s=job.warm_resize_cost_s,
    )


def capped_view(
    job: JobInput,
    model: GoodputModel | None,
    nodes: Sequence[NodeInput],
    now: float,
    limits: Limits,
) -> JobView:
    """The job's view with its upper bound cut to what it may ever hold: the devices its
    constraint allows, its owner's device cap and its group's."""
    view = view_with(job, model, nodes, now)
    high = view.max_replicas
    if view.allowed_nodes is not None:
        high = min(high, sum(len(nodes[i].free_devices) for i in view.allowed_nodes))
    if limits.max_devices_per_user is not None:
        high = min(high, limits.max_devices_per_user)
    group = limits.groups.get(job.group) if job.group is not None else None
    if group is not None and group.max_devices is not None:
        high = min(high, group.max_devices)
    if high == view.max_replicas or view.rigid:
        return view
    return replace(view, max_replicas=max(high, view.min_replicas))


# --- expected time to the end ------------------------------------------------------------

#: The longest ETA given: an estimate beyond it says only that the job has very long to go.
MAX_ETA_S = 30 * 24 * 3600.0


def sane_eta(value: object) -> float | None:
    """An ETA as shown: ``None`` for anything but a finite number >= 0, at most
    :data:`MAX_ETA_S`."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    if not math.isfinite(value) or value < 0:
        return None
    return min(float(value), MAX_ETA_S)


def eta_from_progress(fraction: float | None, elapsed: float) -> float | None:
    """Seconds to the end of a declared length at the pace so far: with f done in t seconds
    of running, t * (1 - f) / f; ``None`` while unknown (no declared length, nothing done
    yet, or not run)."""
    if fraction is None or fraction <= 0 or elapsed <= 0:
        return None
    return sane_eta(elapsed * (1.0 - fraction) / fraction)


def progress_eta(job: JobInput, now: float) -> float | None:
    """:func:`eta_from_progress` of the job at ``now``."""
    return eta_from_progress(job.progress_fraction, run_time_s(job, now))


# --- batch choice and predictions --------------------------------------------------------


def static_batch(job: JobInput, replicas: int) -> BatchChoice | None:
    """m = ceil(M0 / K) within the local bounds, s = 1 (jobs without a model)."""
    base = job.batch_size
    if not base or replicas <= 0:
        return None
    local = math.ceil(int(base) / replicas)
    low = int(job.min_local_batch or 1)
    high = job.max_local_batch
    local = max(low, local if high is None else min(local, int(high)))
    return BatchChoice(local_batch=local, accum_steps=1, replicas=replicas)


def choose_batch(
    job: JobInput, model: GoodputModel | None, num_nodes: int, replicas: int
) -> BatchChoice | None:
    """The model's best (m, s) on ``replicas`` devices over ``num_nodes`` nodes, else
    :func:`static_batch`."""
    if replicas <= 0:
        return None
    if model is not None:
        try:
            return model.best_choice(num_nodes, replicas)
        except (ValueError, ArithmeticError):
            pass
    return static_batch(job, replicas)


def predict(
    model: GoodputModel | None, num_nodes: int, choice: BatchChoice | None
) -> dict[str, float]:
    """Goodput, efficiency and speed-up over one device (best batch) for a choice."""
    if model is None or choice is None:
        return {}
    k, m, s = choice.replicas, choice.local_batch, choice.accum_steps
    goodput = model.goodput_at(num_nodes, k, m, s)
    eff = float(np.asarray(model.efficiency(choice.total_batch)).reshape(-1)[0])
    single, _, _ = model.best_goodput(np.array([1]), np.array([1]))
    base = float(single[0])
    speedup = goodput / base if base > 0 else 0.0
    return {"goodput": goodput, "efficiency": eff, "speedup": speedup}
