"""A simulated job: its state, the rules it follows, and its progress between two rounds.

Between decisions each running job advances:

* a job whose placement changed (first start included) makes no progress for its restart
  delay (it still holds its devices);
* then, at its (m, s) on its placement, one iteration takes
  T = (s - 1) * (step - sync) + step (true times, :mod:`pollux_local.sim.profiles`) and
  advances progress by the gain r = M/M0 * EFF(M) = (var + sqr) / (var / (M/M0) + sqr) from
  the true gradient statistics at its batch and epoch, i.e. progress grows at
  r / T / slowdown per second;
* when progress reaches the end of its epoch the epoch advances (an adaptive job re-chooses
  its batch) and after the application's last epoch the job completes.

Every chunk of training records one exact (nodes, replicas, micro-batch) -> times point in the
job's profile (of the device type it ran on, when the policy tells types apart).

Two sets of rules (:class:`JobRules`) describe the simulated jobs, each reproducing a published
simulator: :data:`POLLUX_RULES` (Pollux's artifact, untyped clusters) and :data:`SIA_RULES`
(Sia's simulator, typed clusters: per-application restore delays and slowdowns, restarts on a
change of type or shape only, crossings in whole seconds, a batch re-chosen after every chunk).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Protocol

from pollux_local.core.pool import Point, ProfilePool, Times
from pollux_local.core.types import BatchChoice, GradStats, Placement
from pollux_local.sim.profiles import AppProfile
from pollux_local.sim.workload import WorkloadJob


@dataclass(frozen=True)
class JobRules:
    """How simulated jobs restart, train and choose their batch."""

    name: str
    #: the first decision is one interval after the start (else at t = 0)
    first_decision_at_interval: bool
    #: a job's configuration is its device type and shape (devices per used node, largest
    #: first): the same shape on other nodes of the same type costs no restart and runs at the
    #: same speed; else it is the placement itself (any change restarts; step times follow
    #: the nodes' ring order)
    by_shape: bool
    #: seconds a (re)start takes per application (``None``: the configured restart cost)
    restore_delay_s: Mapping[str, float] | None = None
    default_restore_delay_s: float = 30.0
    #: real runs are this much slower than the profiles predict (divides the progress rate)
    slowdown: Mapping[str, float] = field(default_factory=dict)
    #: epoch crossing times rounded to whole seconds
    whole_second_crossings: bool = False
    #: the batch re-chosen after every chunk of training (else at each epoch's end and after
    #: a round in which the job's model gained a point)
    rechoose_each_chunk: bool = False
    #: the micro-batch bounded by what was measured to fit on the placement (typed profiles)
    placement_memory: bool = False
    #: the largest micro-batch a scheduler may plan for (application, type), below memory
    scheduler_max_local: Mapping[tuple[str, str], int] = field(default_factory=dict)
    #: the restart cost the scheduler is told per application (``None``: its own default);
    #: it is then also told whether a job is still restoring
    told_restart_cost_s: Mapping[str, float] | None = None
    default_told_restart_cost_s: float = 30.0
    #: a job's model is refitted only when it gains a new (N, K, m) point, to its points in
    #: the order measured (else whenever its points change, in (N, K, m) order)
    refit_on_new_point: bool = False
    #: Sia's jobs choose their batch as Sia's do, from their own points (by default)
    library_by_policy: bool = False
    #: tie order when a placement spanning types is cut down to one type (earlier wins)
    type_rank: tuple[str, ...] = ()
    #: finish-time fairness reported (against an equal share of identical nodes)
    fairness: bool = False

    def restore_delay(self, app: str, restart_cost_s: float) -> float:
        if self.restore_delay_s is None:
            return restart_cost_s
        return self.restore_delay_s.get(app, self.default_restore_delay_s)


#: Pollux's artifact: any change of placement costs the configured restart cost.
POLLUX_RULES = JobRules(
    name="pollux",
    first_decision_at_interval=False,
    by_shape=False,
    refit_on_new_point=True,
    fairness=True,
)
#: Sia's simulator, with the figures its authors measured on physical runs.
SIA_RULES = JobRules(
    name="sia",
    first_decision_at_interval=True,
    by_shape=True,
    restore_delay_s={
        "cifar10": 50.0,
        "deepspeech2": 25.0,
        "bert": 120.0,
        "yolov3": 80.0,
        "imagenet": 250.0,
        "ncf": 15.0,
    },
    slowdown={
        "cifar10": 1.8,
        "ncf": 1.5,
        "imagenet": 1.2,
        "yolov3": 1.2,
        "bert": 1.2,
        "deepspeech2": 1.2,
    },
    whole_second_crossings=True,
    rechoose_each_chunk=True,
    placement_memory=True,
    scheduler_max_local={("deepspeech2", "rtx"): 57},
    told_restart_cost_s={
        "deepspeech2": 25.0,
        "imagenet": 250.0,
        "cifar10": 30.0,
        "bert": 120.0,
        "yolov3": 45.0,
    },
    library_by_policy=True,
    type_rank=("dgx-ext", "dgx", "azure", "quad", "rtx", "aws"),
)


@dataclass
class SimJob:
    """The simulator's state of one job."""

    spec: WorkloadJob
    #: the application's profile per device type (``""`` on an untyped cluster)
    apps: dict[str, AppProfile]
    adaptive: bool
    #: the job's id in the scheduling pass (its index in the simulation)
    id: int = 0
    device_type: str | None = None
    placement: Placement = ()
    #: its devices (node -> device ids), as the pass assigned them
    allocation: dict[str, list[str]] = field(default_factory=dict)
    #: (node, device) of each rank: in node order from each start, as a resize in place
    #: leaves them after one (``core.schedule.inplace``)
    ranks: list[tuple[str, str]] = field(default_factory=list)
    #: devices per used node, largest first
    shape: tuple[int, ...] = ()
    local_batch: int = 0
    accum_steps: int = 1
    restart_left_s: float = 0.0
    starts: int = 0
    #: changes of replica count made in place (a warm resize: no restart)
    warm_resizes: int = 0
    progress: float = 0.0
    epoch: int = 0
    attained_gpu_s: float = 0.0
    run_time_s: float = 0.0
    completion_s: float | None = None
    #: measured points per profile key (the device type, or ``""`` when types are not told
    #: apart)
    profiles: dict[str, dict[Point, Times]] = field(default_factory=dict)
    grad: tuple[float, float] | None = None
    device_seconds: dict[str, float] = field(default_factory=dict)
    #: points in the profile when the batch was last chosen
    batch_points: int = 0
    active_count_sum: float = 0.0
    active_rounds: int = 0

    @property
    def name(self) -> str:
        return self.spec.name

    @cached_property
    def app(self) -> AppProfile:
        """The profile supplying type-independent facts (epochs, gradient statistics; the
        job's ``apps`` are set once, when it is made)."""
        return next(iter(self.apps.values()))

    @property
    def profile(self) -> dict[Point, Times]:
        """The points measured with no device type told apart (untyped clusters)."""
        return self.profiles.get("", {})

    @property
    def replicas(self) -> int:
        return int(sum(self.placement))

    @property
    def restarts(self) -> int:
        return max(self.starts - 1, 0)

    @property
    def batch(self) -> BatchChoice:
        """The job's current (m, s) on its K replicas."""
        return BatchChoice(
            local_batch=self.local_batch, accum_steps=self.accum_steps, replicas=self.replicas
        )

    @property
    def fixed_batch(self) -> int | None:
        """The total batch this job always trains at, or None when it adapts."""
        if not self.adaptive:
            return self.spec.batch_size
        return self.app.fixed_batch

    @property
    def max_profiled_replicas(self) -> int:
        return max((p[1] for points in self.profiles.values() for p in points), default=0)

    @property
    def progress_fraction(self) -> float:
        return min(self.progress / float(self.app.epoch_target[-1]), 1.0)


class BatchChooser(Protocol):
    """What progress needs of the jobs' models (:class:`~pollux_local.sim.models.JobModels`)."""

    pool: ProfilePool
    share_profiles: bool

    def profile_key(self, device_type: str) -> str: ...

    def kind(self, job: SimJob, key: str) -> str: ...

    def choose_batch(self, job: SimJob) -> None: ...


def advance(job: SimJob, now: float, seconds: float, rules: JobRules, models: BatchChooser) -> None:
    """Run ``job`` for ``seconds`` of simulated time from ``now``."""
    k = job.replicas
    if k == 0 or job.completion_s is not None or job.device_type is None:
        return
    device_type = job.device_type
    job.device_seconds[device_type] = job.device_seconds.get(device_type, 0.0) + seconds * k
    clock = now
    delay = min(job.restart_left_s, seconds)
    job.restart_left_s -= delay
    job.attained_gpu_s += delay * k
    clock += delay
    left = seconds - delay
    app, ref = job.apps[device_type], job.app
    counts = job.shape if rules.by_shape else tuple(c for c in job.placement if c > 0)
    key = models.profile_key(device_type)
    kind = models.kind(job, key)
    share = job.adaptive and models.share_profiles
    slowdown = rules.slowdown.get(ref.name, 1.0)
    profile = job.profiles.setdefault(key, {})
    while left > 1e-9:
        m, s = job.local_batch, job.accum_steps
        batch = k * m * s
        step, sync = app.step_sync_time(counts, m)
        iter_time = (s - 1) * (step - sync) + step
        sqr, var = ref.grad_stats(batch, job.epoch)
        gain = (var + sqr) / (var * ref.base_batch / batch + sqr)
        point = (len(counts), k, m)
        if point not in profile:
            profile[point] = (max(step - sync, 1e-9), step)
        job.grad = (sqr, var)
        if job.epoch == 0 and share:
            models.pool.add(ref.name, {}, GradStats(sqr=sqr, var=var), first_epoch=True)
        rate = gain / iter_time / slowdown
        target = ref.epoch_target[job.epoch + 1]
        crossed = job.progress + rate * left >= target
        if crossed:
            used = (target - job.progress) / rate
            if rules.whole_second_crossings:
                used = min(float(round(used)), left)
            job.progress = float(target)
            job.epoch += 1
        else:
            job.progress += rate * left
            used = left
        job.attained_gpu_s += used * k
        job.run_time_s += used
        clock += used
        left -= used
        if job.epoch >= ref.epochs:
            job.completion_s = clock
            break
        if rules.rechoose_each_chunk:
            if share:
                models.pool.add(kind, {point: profile[point]})
            models.choose_batch(job)
        elif crossed and job.adaptive:
            models.choose_batch(job)  # re-decide the batch at each epoch boundary
    if share:
        models.pool.add(kind, profile)
    if rules.rechoose_each_chunk or not job.adaptive or job.completion_s is not None:
        return
    if job.batch_points != len(profile):
        models.choose_batch(job)  # the model gained a point: re-decide without a restart
