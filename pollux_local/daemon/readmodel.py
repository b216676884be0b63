"""The read model: jobs, decisions and nodes as the typed replies show them.

The store keeps plain rows (:class:`~pollux_local.daemon.state.JobRecord`); this module turns
them into :class:`api.JobSummary` (``status``), :class:`api.JobDetail` (``show``),
:class:`api.DecisionRecord` and :class:`api.NodeRow` (``nodes``), with the figures derived
from a job's report and model: its gradient noise scale, its fitted throughput model and the
estimated time to its target (:class:`MetricHistory`).
"""

from __future__ import annotations

import math
import os
from collections import deque
from collections.abc import Container, Sequence
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import numpy as np

from pollux_local.api.messages import (
    SUMMARY_AFTER_IDS,
    BatchBoundsView,
    DecisionRecord,
    HistorySample,
    JobDetail,
    JobSummary,
    ModelSummary,
    NodeRow,
    ReplicaPid,
)
from pollux_local.api.report import JobReport
from pollux_local.api.states import PLACED_STATES, JobState
from pollux_local.core.efficiency import noise_scale
from pollux_local.core.schedule import Holding, NodeInput
from pollux_local.core.schedule.forecast import Prediction
from pollux_local.core.schedule.views import sane_eta
from pollux_local.core.types import GradStats
from pollux_local.daemon.config import DaemonConfig
from pollux_local.daemon.executor import NodeHealthBook
from pollux_local.daemon.executor.exits import retries_allowed
from pollux_local.daemon.resizes import ResizeCosts
from pollux_local.daemon.scheduler import ModelCache, progress_eta
from pollux_local.daemon.state import JobRecord

T = TypeVar("T")

#: Target-metric points kept per job for the ETA estimate.
METRIC_POINTS = 12
_BOUND_KEYS = ("batch_size", "max_batch_size", "min_local_batch", "max_local_batch")


def _convert(value: Any, kind: type[T]) -> T | None:
    """Stored data as ``kind``, or ``None`` when it does not fit (a row from an older daemon)."""
    if value is None:
        return None
    try:
        return msgspec.convert(value, kind)
    except msgspec.ValidationError:
        return None


def _float(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


# --- derived figures -------------------------------------------------------------------------


def job_noise_scale(job: JobRecord) -> float | None:
    """The gradient noise scale phi = M0 * var / sqr from the job's last report
    (``core.efficiency.noise_scale``), or ``None`` without gradient statistics."""
    report = job.report
    stats = report.grad_stats if report is not None else None
    bounds = report.bounds if report is not None else None
    base = bounds.base_batch if bounds is not None else job.spec.batch_size
    if stats is None or not base:
        return None
    try:
        value = float(noise_scale(GradStats(sqr=stats.sqr, var=stats.var), float(base)))
    except ArithmeticError:
        return None
    return value if math.isfinite(value) else None


def effective_bounds(job: JobRecord) -> BatchBoundsView:
    """The batch bounds a job runs under, as the scheduler takes them
    (``scheduler._bounds_from``): each one its trainer reported, else the one it was submitted
    with (``None``: neither gave it)."""
    spec = job.spec
    reported = job.report.bounds if job.report is not None else None
    if reported is None:
        return BatchBoundsView(**{key: getattr(spec, key) for key in _BOUND_KEYS})
    return BatchBoundsView(
        batch_size=reported.base_batch or spec.batch_size,
        max_batch_size=reported.max_batch or spec.max_batch_size,
        min_local_batch=reported.min_local or spec.min_local_batch,
        max_local_batch=reported.max_local or spec.max_local_batch,
    )


def model_summary(models: ModelCache, job: JobRecord) -> ModelSummary | None:
    """The job's fitted throughput model with what it was fitted from, or ``None`` while no
    pass has fitted one (neither the job nor its kind has reported a profile and gradient
    statistics, or the job has not yet been fitted)."""
    model = models.current(job)  # as the passes fitted it: a read fits nothing
    if model is None:
        return None
    return ModelSummary(
        params={name: float(value) for name, value in model.params.to_dict().items()},
        profile_points=len(job.report.profile) if job.report is not None else 0,
        # the points the model was fitted to: its own and its owner's jobs' of its kind
        fitted_points=models.fitted_points(job),
        base_batch=int(model.bounds.base_batch),
    )


class MetricHistory:
    """Recent (time, target metric) points per job, from its reports: the ETA estimate."""

    def __init__(self, limit: int = METRIC_POINTS) -> None:
        self.limit = limit
        self._points: dict[int, deque[tuple[float, float]]] = {}

    def note(self, job: JobRecord, report: JobReport, now: float) -> None:
        """Remember the report's value of the job's target metric (at the report's time)."""
        target = job.spec.target
        if target is None:
            return
        value = report.metrics.get(target.metric)
        if value is None or not math.isfinite(value):  # not reported, or not a number
            return
        history = self._points.setdefault(job.id, deque(maxlen=self.limit))
        stamp = report.time or now
        if not history or history[-1][0] < stamp:
            history.append((stamp, value))

    def keep_only(self, running: Container[int]) -> None:
        """Forget the jobs not in ``running``: the trend is read for running jobs alone, and
        the points of every job that ever reported were kept until the daemon stopped (about
        900 bytes a job: one user's reports from held arrays grew it by 65 MB an hour)."""
        for job_id in [key for key in self._points if key not in running]:
            del self._points[job_id]

    def __len__(self) -> int:
        """The jobs whose points are kept."""
        return len(self._points)

    def eta(self, job: JobRecord, now: float) -> float | None:
        """Seconds until the target metric is reached, from a least-squares line through its
        recent values: t* = t_last + (target - y_last) / slope, when it moves the right way
        (``None`` when it does not, or when t* has passed without the target being reached;
        at most ``scheduler.MAX_ETA_S``)."""
        target = job.spec.target
        history = self._points.get(job.id)
        goal = _float(target.value) if target is not None else None
        if not history or len(history) < 3 or goal is None:
            return None
        times = np.array([t for t, _ in history])
        values = np.array([v for _, v in history])
        if np.ptp(times) <= 0:
            return None
        try:
            slope = float(np.polyfit(times - times[-1], values, 1)[0])
        except (ValueError, np.linalg.LinAlgError):
            return None
        remaining = goal - float(values[-1])
        maximise = target is None or target.mode == "max"
        if (remaining <= 0) if maximise else (remaining >= 0):
            return 0.0
        if slope == 0 or (slope > 0) != maximise:
            return None
        return sane_eta(remaining / slope - (now - float(times[-1])))


# --- jobs ----------------------------------------------------------------------------------


def job_eta(job: JobRecord, now: float, metrics: MetricHistory | None = None) -> float | None:
    """Seconds to the end of a running job: its own estimate when it reports one, else the
    sooner of the end of its declared length at its pace so far (``scheduler.progress_eta``)
    and the trend of its target metric in ``metrics``; ``None`` when unknown or not running,
    never negative, infinite or beyond ``scheduler.MAX_ETA_S``."""
    if job.state not in PLACED_STATES:
        return None
    own = sane_eta(job.report.eta_s) if job.report is not None else None
    if own is not None:
        return own
    trend = metrics.eta(job, now) if metrics is not None else None
    known = [value for value in (progress_eta(job, now), trend) if value is not None]
    return sane_eta(min(known)) if known else None


def job_summary(
    job: JobRecord,
    now: float,
    metrics: MetricHistory | None = None,
    device_type: str | None = None,
    forecast: Prediction | None = None,
    *,
    after_ids: int | None = SUMMARY_AFTER_IDS,
) -> JobSummary:
    """The row of ``status`` for one job (``eta_s``: :func:`job_eta`; goodput, efficiency and
    speed-up: the prediction the scheduler stored for its allocation; expected start and
    finish: ``forecast``, the loop's for a queued or running job, each marked when it is an
    upper bound; the exit of its latest
    incarnation that ended, for the job and per rank, as stored; the first ``after_ids`` of
    the jobs it waits for, ``None``: all)."""
    report = job.report
    spec = job.spec
    batch = job.batch or {}
    placed = job.state in PLACED_STATES
    total_batch = _int(batch.get("total")) if placed else None
    eta = job_eta(job, now, metrics)
    max_gpus = spec.max_gpus
    return JobSummary(
        id=job.job_id,
        name=job.name,
        owner=job.owner_name,
        state=JobState(job.state),
        gpus=job.replicas,
        devices={node: list(devices) for node, devices in job.placement.items()},
        nodes=sorted(job.placement),
        batch_size=total_batch if total_batch is not None else _int(spec.batch_size),
        local_batch=_int(batch.get("local_batch")) if placed else None,
        accum_steps=_int(batch.get("accum_steps")) if placed else None,
        replicas=job.replicas,
        goodput=_float(job.prediction.get("goodput")) if placed else None,
        efficiency=_float(job.prediction.get("efficiency")) if placed else None,
        speedup=_float(job.prediction.get("speedup")) if placed else None,
        progress=report.progress if report is not None else None,
        epoch=report.epoch if report is not None else None,
        metrics=dict(report.metrics) if report is not None else {},
        eta_s=eta,
        min_gpus=int(spec.min_gpus or 1),
        max_gpus=int(max_gpus) if max_gpus else None,
        priority=job.priority,
        restarts=max(0, job.restarts - 1) if job.restarts else 0,
        failures=job.failures,
        submit_time=job.submit_time,
        start_time=job.start_time,
        end_time=job.end_time,
        run_time_s=job.run_time_s + (now - job.last_start if job.last_start else 0.0),
        reason=job.reason,
        target=spec.target,
        elastic=job.spec.elastic,
        preemptible=spec.preemptible,
        after=list(spec.after[:after_ids]),
        after_count=len(spec.after),
        after_any=spec.after_any,
        after_one=spec.after_one,
        array_id=spec.array_id,
        array_index=spec.array_index,
        time_limit_s=spec.time_limit_s,
        constraint=spec.constraint,
        device_type=device_type,
        gpu_memory=spec.gpu_memory,
        shared=spec.shared,
        stdin=spec.stdin,
        group=spec.group,
        account=spec.account,
        begin_at=spec.begin_at,
        expected_start=forecast.start if forecast is not None else None,
        expected_finish=forecast.finish if forecast is not None else None,
        expected_devices=forecast.devices if forecast is not None else None,
        expected_start_at_latest=forecast is not None and forecast.start_at_latest,
        expected_finish_at_latest=forecast is not None and forecast.finish_at_latest,
        exit_code=job.exit_code,
        exit_signal=job.exit_signal,
        replica_exits=list(job.replica_exits),
    )


def job_detail(
    job: JobRecord,
    summary: JobSummary,
    *,
    job_dir: Path,
    models: ModelCache,
    history: list[dict[str, float | None]],
    with_env: bool,
    config: DaemonConfig,
    resize_costs: ResizeCosts | None = None,
) -> JobDetail:
    """``show``'s view of a job: its ``status`` row and what it runs, its latest report, its
    noise scale, model and history; ``env`` only when ``with_env`` (its owner or an admin);
    its crash restarts, allowed (``exits.retries_allowed``) and had (each crash counts one,
    but the crash that failed it); what its resizes were measured to cost."""
    spec = job.spec
    costs = resize_costs or ResizeCosts()
    allowed = retries_allowed(spec, config)
    crashes = job.failures - (1 if job.state == JobState.FAILED and job.failures else 0)
    return JobDetail(
        **msgspec.structs.asdict(summary),
        argv=list(spec.argv),
        workdir=spec.workdir,
        batch_bounds=effective_bounds(job),
        job_dir=str(job_dir),
        pids=_convert(job.pids, list[ReplicaPid]) or [],
        report=job.report,
        noise_scale=job_noise_scale(job),
        model=model_summary(models, job),
        history=_convert(history, list[HistorySample]) or [],
        env=dict(job.env or {}) if with_env else None,
        retries_used=min(crashes, allowed),
        retries_allowed=allowed,
        resize_cold_s=costs.cold_s,
        resize_warm_s=costs.warm_s,
        resizes_cold=costs.cold_count,
        resizes_warm=costs.warm_count,
        rank0_local=rank0_local(job, config),
    )


def rank0_local(job: JobRecord, config: DaemonConfig) -> bool | None:
    """Whether a running job's rank 0 runs on this machine (a Slurm node is not this
    machine's even when it is this host: its ranks are Slurm's steps): the node of rank 0's
    process as stored (``pids``; a warm resize that gave up rank 0's node renumbers them),
    else, before its processes are known, the first of the config's nodes the job holds
    devices on (ranks start in the config's node order,
    ``executor.launchspec.build_launch_spec``); ``None`` when it runs nowhere (or on no node
    known)."""
    if job.state not in PLACED_STATES:
        return None
    nodes = {node.name: node for node in config.nodes}
    named = next((str(p.get("node")) for p in job.pids if p.get("rank") == 0), None)
    first = (
        nodes.get(named)
        if named is not None
        else next((node for node in config.nodes if job.placement.get(node.name)), None)
    )
    return first.is_local and first.slurm is None if first is not None else None


def decision_records(rows: list[dict[str, Any]]) -> list[DecisionRecord]:
    """Decision-log rows as the typed records of ``show``."""
    return [record for row in rows if (record := _convert(row, DecisionRecord)) is not None]


# --- nodes ---------------------------------------------------------------------------------


def node_rows(
    config: DaemonConfig,
    health: NodeHealthBook,
    snapshot: list[NodeInput],
    placed: list[JobRecord],
    drained: list[str] | None = None,
    stopping: Sequence[Holding] = (),
) -> list[NodeRow]:
    """``nodes``: each configured node, its health, its devices' type, devices busy outside
    the scheduler, devices withheld from new jobs (reserved or ``drained``), which job holds
    each device (``placed``: the jobs holding devices; ``stopping``: the jobs whose
    processes, asked to stop, still hold theirs) and its load per core (this machine's now, a
    remote node's at its last check)."""
    holders: dict[str, dict[str, str]] = {}
    for job in placed:
        for node_name, devices in job.placement.items():
            for device in devices:
                holders.setdefault(node_name, {})[device] = job.job_id
    draining: dict[str, list[str]] = {}
    for stop in stopping:
        for node_name, held in stop.devices.items():
            for device in held:
                holders.setdefault(node_name, {})[device] = str(stop.job_id)
                draining.setdefault(node_name, []).append(device)
    busy = {node.name: node.busy for node in snapshot}
    closed = set(config.reserved) | set(drained or ())
    rows = []
    for node in config.nodes:
        status = health[node.name]
        load = status.load
        if node.is_local:
            load = os.getloadavg()[0] / max(1, os.cpu_count() or 1)
        rows.append(
            NodeRow(
                name=node.name,
                host=node.host or "localhost",
                local=node.is_local,
                up=status.up,
                error=status.error or None,
                devices=list(node.devices),
                busy=sorted(busy.get(node.name, ())),
                jobs=holders.get(node.name, {}),
                load=None if load is None else round(load, 3),
                device_type=node.device_type,
                withheld=[
                    device
                    for device in node.devices
                    if node.name in closed or f"{node.name}:{device}" in closed
                ],
                drained=node.name in closed,
                memory=node.device_memory,
                stopping=sorted(draining.get(node.name, ())),
            )
        )
    return rows
