"""The simulated jobs' models and batch choices, as their job library makes them.

Two job libraries choose a job's batch on its placement:

* ``goodput`` (this project's): (m, s) from :meth:`GoodputModel.best_choice` on a throughput
  model fitted (``fit_points``, with the measured correction unless turned off) to the points
  the job ran, or with ``share_profiles`` to the points every job of its application ran
  (:class:`~pollux_local.core.pool.ProfilePool`; before its first round such a job uses the
  gradient statistics the application's first job reported in its first epoch); a job
  without a model starts at M0;
* ``sia`` (Sia's): the job's own points, the model alone, Pollux's search of
  :func:`~pollux_local.core.sia.sia_batch_search`.

Static jobs (the baselines) keep the workload row's total batch.  A policy that tells device
types apart gets a model per type, fitted to the points measured on that type; any other policy
one model across all types, as if they were one.
"""

from __future__ import annotations

import math
from dataclasses import replace

from pollux_local.core.correction import TimeCorrection
from pollux_local.core.fitting import fit_points
from pollux_local.core.goodput import GoodputModel
from pollux_local.core.pool import Point, ProfilePool, Times
from pollux_local.core.sia import sia_batch_search
from pollux_local.core.throughput import ThroughputParams
from pollux_local.core.types import BatchBounds, GradStats, split_batch
from pollux_local.sim.jobs import JobRules, SimJob

_Fit = tuple[ThroughputParams, TimeCorrection | None]


class JobModels:
    """The models of every job of one simulation, cached by what they were fitted to."""

    def __init__(
        self,
        rules: JobRules,
        types: list[str],
        job_library: str,
        share_profiles: bool,
        correct_times: bool,
        type_aware: bool,
    ) -> None:
        self.rules = rules
        self.types = types
        self.job_library = job_library
        self.share_profiles = share_profiles
        self.correct_times = correct_times
        self.type_aware = type_aware
        self.pool = ProfilePool()
        self._fits: dict[tuple[object, ...], _Fit] = {}
        #: bounds per (application and per-type profiles, device type), with the profiles
        self._bounds: dict[
            tuple[tuple[int, ...], str | None], tuple[BatchBounds, tuple[object, ...]]
        ] = {}
        #: the same bounds by job (its profiles are set once, when it is made)
        self._job_bounds: dict[tuple[int, str | None], tuple[SimJob, BatchBounds]] = {}
        self._fit_keys: dict[tuple[str, str], tuple[tuple[int, int], tuple[object, ...]]] = {}
        self._models: dict[tuple[str, str], tuple[tuple[object, ...], GoodputModel]] = {}

    def profile_key(self, device_type: str) -> str:
        """The key a job's points on ``device_type`` are kept under (``""``: types not told
        apart)."""
        return device_type if self.type_aware else ""

    def kind(self, job: SimJob, key: str) -> str:
        """The pool kind of a job's points under ``key``: its application (on a type)."""
        return f"{job.app.name}@{key}" if key else job.app.name

    def bounds(self, job: SimJob, device_type: str | None) -> BatchBounds:
        """Batch bounds a scheduler plans with on a type (``None``: the smallest memory of
        all the types)."""
        mine = self._job_bounds.get((job.id, device_type))
        if mine is not None and mine[0] is job:
            return mine[1]
        apps = job.apps
        profiles = (job.app, *(apps.get(t) for t in self.types))
        memo_key = (tuple(map(id, profiles)), device_type)
        known = self._bounds.get(memo_key)
        if known is not None:
            self._job_bounds[(job.id, device_type)] = (job, known[0])
            return known[0]
        types = [device_type] if device_type is not None else self.types
        limits = self.rules.scheduler_max_local
        largest = min(limits.get((job.app.name, t), job.apps[t].max_local) for t in types)
        smallest = min(job.apps[t].min_local for t in types)
        bounds = BatchBounds(
            base_batch=job.app.base_batch,
            max_batch=job.app.max_batch,
            min_local=smallest,
            max_local=max(largest, smallest),
            accumulation=True,
        )
        self._bounds[memo_key] = (bounds, profiles)  # (kept: their ids stay theirs)
        self._job_bounds[(job.id, device_type)] = (job, bounds)
        return bounds

    def _grad(self, job: SimJob) -> tuple[float, float] | None:
        if job.grad is not None or not self.share_profiles:
            return job.grad
        start = self.pool.start_stats(job.app.name)
        return None if start is None else (start.sqr, start.var)

    def _points(self, job: SimJob, key: str) -> dict[Point, Times]:
        own = job.profiles.get(key, {})
        if self.share_profiles:
            return self.pool.points_for(self.kind(job, key), own)
        return dict(own)

    def _stamp(self, job: SimJob, key: str) -> tuple[int, int]:
        """What the set of the job's points under ``key`` follows: the pooled points' version
        (shared profiles) and how many points the job measured (its own only grow)."""
        pooled = self.pool.version(self.kind(job, key)) if self.share_profiles else 0
        return pooled, len(job.profiles.get(key, ()))

    def fit(self, job: SimJob, key: str) -> tuple[tuple[object, ...], _Fit] | None:
        """The throughput fit of the job's points under ``key`` (when refitted: the job's
        rules).  The key of the fit is remembered per job while its points' set stays the
        same (:meth:`_stamp`), so that asking again does not gather the points again."""
        stamp = self._stamp(job, key)
        known = self._fit_keys.get((job.name, key))
        if known is not None and known[0] == stamp:
            return known[1], self._fits[known[1]]
        points = self._points(job, key)
        if not points:
            return None
        correct = self.correct_times and self.job_library == "goodput"
        cache_key: tuple[object, ...]
        if self.rules.refit_on_new_point:
            cache_key = (job.name, key, correct, len(points))
        else:
            owner = self.kind(job, key) if self.share_profiles else job.name
            cache_key = (owner, key, correct, frozenset(points))
            points = dict(sorted(points.items()))
        hit = self._fits.get(cache_key)
        if hit is None:
            fitted = fit_points(points, correct=correct)
            hit = (fitted.params, fitted.correction)
            self._fits[cache_key] = hit
        self._fit_keys[(job.name, key)] = (stamp, cache_key)
        return cache_key, hit

    def model(self, job: SimJob, key: str = "") -> GoodputModel | None:
        """The job's goodput model under ``key`` (the same object until its points or
        gradient statistics change)."""
        if not job.adaptive:
            return None
        grad = self._grad(job)
        fit = self.fit(job, key)
        if grad is None or fit is None:
            return None
        cache_key, (params, correction) = fit
        full = (cache_key, grad)
        hit = self._models.get((job.name, key))
        if hit is not None and hit[0] == full:
            return hit[1]
        sqr, var = grad
        bounds = self.bounds(job, key or None)
        model = GoodputModel(params, GradStats(sqr=sqr, var=var), bounds, correction)
        self._models[(job.name, key)] = (full, model)
        return model

    def models_by_type(self, job: SimJob) -> dict[str, GoodputModel]:
        models: dict[str, GoodputModel] = {}
        for device_type in self.types:
            model = self.model(job, device_type)
            if model is not None:
                models[device_type] = model
        return models

    # ----------------------------------------------------------------- batch choice
    def choose_batch(self, job: SimJob) -> None:
        """Set (m, s) for the job's current placement, as its job library would."""
        device_type = job.device_type
        assert device_type is not None
        app = job.apps[device_type]
        n, k = len(job.shape), job.replicas
        key = self.profile_key(device_type)
        job.batch_points = len(job.profiles.get(key, {}))
        if self.job_library == "sia":
            job.local_batch, job.accum_steps = self._sia_choice(job, device_type)
            return
        bounds = self.bounds(job, device_type)
        memory = None
        if self.rules.placement_memory:
            memory = app.max_local_for(job.shape)
            limit = self.rules.scheduler_max_local.get((job.app.name, device_type), memory)
            bounds = replace(
                bounds, max_local=max(min(memory, limit), app.min_local), min_local=app.min_local
            )
        fixed = job.fixed_batch
        if fixed is not None:
            choice = split_batch(fixed, k, bounds)
        else:
            model = self.model(job, key)
            if model is None:
                choice = split_batch(max(bounds.base_batch, bounds.min_local * k), k, bounds)
            else:
                if model.bounds != bounds:
                    model = replace(model, bounds=bounds)
                choice = model.best_choice(n, k)
        local = choice.local_batch
        per_size = app.max_local_for_replicas(k) if memory is not None else None
        if per_size is not None:
            local = min(local, per_size)
        job.local_batch, job.accum_steps = int(local), int(choice.accum_steps)

    def _sia_choice(self, job: SimJob, device_type: str) -> tuple[int, int]:
        """(m, s) as Sia's job library picks them on the job's placement."""
        app, ref = job.apps[device_type], job.app
        k = job.replicas
        memory = app.max_local_for(job.shape)
        fixed = app.fixed_batch
        fit = self.fit(job, self.profile_key(device_type))
        if fixed is not None:
            local, accum = _split_sia(fixed, k, memory, ref.base_batch)
        elif fit is None or job.grad is None:
            total = max(ref.base_batch, app.min_local * k)
            local, accum = _split_sia(total, k, memory, ref.base_batch)
        else:
            _, m, a = sia_batch_search(
                fit[1][0],
                GradStats(sqr=job.grad[0], var=job.grad[1]),
                ref.base_batch,
                [len(job.shape)],
                [k],
                ref.max_batch,
                (app.min_local, memory),
            )
            local, accum = int(m[0]), int(a[0])
        per_size = app.max_local_for_replicas(k)
        if per_size is not None:
            local = min(local, per_size)
        local = max(1, min(local, int(ref.max_batch / (k * (accum + 1)))))
        return local, accum + 1


def _split_sia(total: float, k: int, memory: int, base_batch: int) -> tuple[int, int]:
    """A user-given total batch on k replicas, Sia's way: (micro-batch, extra steps)."""
    per_replica = math.ceil(total / k - 1e-8)
    accum = math.ceil(per_replica / memory - 1e-8) - 1
    if k == 1 and total > base_batch:
        accum = max(1, accum)
    return math.ceil(per_replica / (accum + 1) - 1e-8), accum
