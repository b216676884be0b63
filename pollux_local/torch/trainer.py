"""The elastic, goodput-tuned trainer that a ``train.py`` builds around its model and optimizer.

One :class:`ElasticTrainer` per job owns the process group, the (DDP-wrapped) model, the
batch configuration (m, s), the gradient-noise estimator, the learning-rate scaling, progress
in base-batch iterations, timing profiles, checkpoints and reports.  Its loader
(:meth:`ElasticTrainer.loader`) yields this replica's micro-batches; the training loop calls
:meth:`ElasticTrainer.step` with each micro-batch's loss::

    trainer = ElasticTrainer(model, optimizer, base_batch=64, max_batch=1024)
    loader = trainer.loader(dataset)
    for epoch in trainer.epochs(10):
        for x, y in loader:
            trainer.step(loss_fn(trainer.model(x), y))

The trainer composes the parts, each in its own module:

* ``batching.py``: the batch bounds, the first (m, s) and its re-choice at epoch boundaries
  with the goodput model;
* ``scaling.py``: the learning-rate factor and progress gain at batch M, the preconditioner;
* ``measuring.py``: which steps measure the gradient statistics (``gradstats.py``), spaced
  adaptively so that their extra cost stays within ``stats_budget`` of training time;
* ``collectives.py``: the measuring step's all-reduce, on which, with several replicas, the
  collective decisions ride (stop for a rescale, checkpoint now, the spacing of measuring
  steps), so every replica takes them at the same step; measuring steps are therefore never
  more than ``STOP_LATENCY_S`` of training apart; and leaving the process group;
* ``stopping.py``: SIGTERM (a replica acts on it right after its current step), the
  checkpoint payload, and the checkpoint-and-exit with ``ExitCode.RESCALE``;
* ``resizing.py``: warm resizes, the replica count changed in place at a step agreement;
* ``loader.py``, ``sampler.py``, ``profile.py``, ``checkpoint.py``, ``report.py``.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, NoReturn

import torch
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import Dataset

from pollux_local.api.launch import LaunchEnvironment
from pollux_local.api.report import (
    REPORT_VERSION,
    JobReport,
    ProfileRow,
    ReportBatch,
    ReportBounds,
    ReportGradStats,
)
from pollux_local.api.resize import ResizeOrder, decode_order, encode_order
from pollux_local.api.states import ExitCode
from pollux_local.core.efficiency import LR_RULES
from pollux_local.core.types import BatchChoice, GradStats
from pollux_local.errors import PolluxError
from pollux_local.torch.batching import (
    agreed_choice,
    best_choice,
    initial_choice,
    max_local,
    validated_bounds,
)
from pollux_local.torch.checkpoint import CheckpointStore, load_file
from pollux_local.torch.collectives import average_and_agree, barrier, leave_group
from pollux_local.torch.env import init_distributed, job_environment, torch_device
from pollux_local.torch.gradstats import (
    MIN_SAMPLES,
    GradNoiseEstimator,
    SmallBatchGradNorm,
    norms,
    read_sums,
    squared_norm,
)
from pollux_local.torch.loader import ElasticLoader
from pollux_local.torch.measuring import DEFAULT_STATS_BUDGET, MeasuringSchedule
from pollux_local.torch.memory import PeakMemory
from pollux_local.torch.profile import ProfileRecorder
from pollux_local.torch.report import Reporter
from pollux_local.torch.resizing import ResizeWatch, announce_ready, broadcast_object
from pollux_local.torch.sampler import ElasticSampler, StepPlan, resume_point
from pollux_local.torch.scaling import (
    LrScaling,
    Preconditioner,
    gradients,
    keeps_second_moments,
    scaled_learning_rate,
)
from pollux_local.torch.stopping import (
    CheckpointTimer,
    StopRequest,
    build_payload,
    exit_for_rescale,
    restore_payload,
)

log = logging.getLogger("pollux_local.torch")

#: Optimizer steps not profiled after a start or a change of configuration (warm-up).
PROFILE_WARMUP_STEPS = 2


def _never_joined(generation: int, exc: BaseException) -> NoReturn:
    """A joiner whose group did not form exits 0: it holds nothing of the job, so its end
    must not decide the job's.  Either the replicas that stay had already finished (the
    order came after their last look at it: they exited 0, the job is done) or they time out
    too and fall back to a checkpoint-restart (``ExitCode.RESCALE``)."""
    log.warning(
        "did not join warm resize %d (%s); this replica leaves, the job goes on without it",
        generation,
        exc,
    )
    sys.exit(0)


class ElasticTrainer:
    """Elastic data-parallel training driven by the goodput model (see the module docstring).

    ``base_batch`` is M0 (the batch the optimizer's hyper-parameters were tuned for),
    ``max_batch`` M_max (default: M0, no growth), ``min_local``/``max_local`` bound the
    per-replica micro-batch, ``accumulation`` allows s > 1.  ``lr_rule`` is one of
    ``adascale`` (default), ``sqrt``, ``linear``, ``legw``.  ``stats_interval`` is the least
    spacing of measuring steps and ``stats_budget`` the fraction of step time they may cost
    (``None``: measure exactly every ``stats_interval`` steps); the statistics are used (for
    the learning rate, progress and batch adaptation) only after ``min_stats_samples``
    measurements.  ``precondition`` (default: on for
    optimizers keeping ``exp_avg_sq``, i.e. Adam-type) measures the gradient statistics in the
    optimizer's preconditioned space.  ``state`` holds user objects to checkpoint (anything
    with ``state_dict``/``load_state_dict``, or plain picklable values, read back from
    :attr:`state` after a restore).  A checkpoint found in the checkpoint directory is restored
    on construction.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        base_batch: int,
        max_batch: int | None = None,
        min_local: int = 1,
        max_local: int | None = None,
        accumulation: bool = True,
        lr_rule: str = "adascale",
        lr_scheduler: Any = None,
        scaler: Any = None,
        precondition: bool | None = None,
        adapt: bool = True,
        env: LaunchEnvironment | None = None,
        checkpoint_dir: str | Path | None = None,
        checkpoint_interval_s: float | None = 600.0,
        report_interval_s: float = 10.0,
        state: Mapping[str, Any] | None = None,
        stats_interval: int = 8,
        stats_budget: float | None = DEFAULT_STATS_BUDGET,
        min_stats_samples: int = MIN_SAMPLES,
        ddp_kwargs: Mapping[str, Any] | None = None,
        restore: bool = True,
        handle_sigterm: bool = True,
    ) -> None:
        self.env = env if env is not None else job_environment()
        if lr_rule not in LR_RULES:
            raise PolluxError(f"unknown lr_rule {lr_rule!r}; expected one of {', '.join(LR_RULES)}")
        if stats_interval < 1:
            raise PolluxError(f"stats_interval must be at least 1, got {stats_interval}")
        self._bound_args = (base_batch, max_batch, min_local, max_local, accumulation)
        self.bounds = validated_bounds(*self._bound_args, self.env.world_size)
        if stats_budget is not None and not 0.0 < stats_budget <= 1.0:
            raise PolluxError(f"stats_budget must be in (0, 1] or None, got {stats_budget}")
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.scaler = scaler
        self.adapt = adapt
        self.report_interval_s = report_interval_s
        self.state: dict[str, Any] = dict(state or {})
        self.metrics: dict[str, float] = {}
        self._lr = LrScaling(lr_rule, base_batch)
        self._schedule = MeasuringSchedule(stats_interval, stats_budget, self.env.world_size)
        self._stop = StopRequest()
        joining = self.env.resize_join
        self._resize = ResizeWatch(self.env.resize_file, joining or 0)
        self._agreed_resize = 0
        self._proposal: ResizeOrder | None = None
        if joining is not None:
            announce_ready(self.env.job_dir, joining, self.env.rank)
            try:
                init_distributed(self.env)
            except Exception as exc:  # noqa: BLE001 - whatever it was, this replica is not one
                _never_joined(joining, exc)
        else:
            init_distributed(self.env)
        self.rank = self.env.rank
        self.replicas = self.env.world_size
        self.device = torch_device(self.env)
        self.module = model.to(self.device)
        #: the model's parameters, listed once (walking the modules costs a measuring step
        #: about 10 us per five modules)
        self._params = list(self.module.parameters())
        #: peak memory per local batch (CUDA only), for the report
        self.peak_memory = PeakMemory.for_device(self.device)

        self.progress = 0.0
        self.steps = 0
        self.max_epochs: int | None = None
        self.estimator = GradNoiseEstimator(base_batch, min_samples=min_stats_samples)
        self.profile = ProfileRecorder(self.env.device_type)
        self._sampler: ElasticSampler | None = None
        self._sampler_state: dict[str, Any] | None = None
        self._preconditioner = Preconditioner(optimizer)
        self.precondition = (
            keeps_second_moments(optimizer) if precondition is None else precondition
        )

        self._micro: tuple[StepPlan, int] | None = None
        self._t0 = 0.0
        self._step_start = 0.0
        self._step_start_cost = 0.0
        #: a one-replica measuring step's |g_small|^2 as device tensors to sum (one per hooked
        #: layer, or one), a factor to scale their sum by, and b_small (read with |g_big|^2 at
        #: the optimizer step: one read, ``_collect_stats``)
        self._small: tuple[list[torch.Tensor], float, int] | None = None
        #: g_small of a one-replica measuring step without a split (``SmallBatchGradNorm``)
        self._small_norm = SmallBatchGradNorm.for_model(self.module)
        self._warmup_left = PROFILE_WARMUP_STEPS
        self._started = False
        self._last_report = 0.0
        self._checkpoint_timer = CheckpointTimer(checkpoint_interval_s)

        ckpt_dir = checkpoint_dir if checkpoint_dir is not None else self.env.checkpoint_dir
        self.checkpoints = CheckpointStore(ckpt_dir) if ckpt_dir is not None else None
        job_dir = Path(self.env.job_dir) if self.env.job_dir else None
        self.reporter = Reporter(self.env.job_id, job_dir, self.env.daemon_socket)

        self.local_batch, self.accum_steps = initial_choice(
            self.bounds, self.replicas, self.env.local_batch, self.env.accum_steps
        )
        self._env_choice = self.env.local_batch is not None
        if joining is not None:  # a warm resize's joiner: rank 0's state by broadcast
            try:
                payload = broadcast_object(None, self.env)
            except Exception as exc:  # noqa: BLE001 - as above
                _never_joined(joining, exc)
            self._load(payload)
            log.info("joined at step %d (warm resize %d)", self.steps, joining)
        elif restore and self.checkpoints is not None:
            found = self.checkpoints.load_latest()
            if found is not None:
                self._load(found[0])
                log.info("restored %s (progress %.1f)", found[1], self.progress)

        self.model: torch.nn.Module
        self._ddp_kwargs = dict(ddp_kwargs or {})
        self._wrap()
        if handle_sigterm and self.checkpoints is not None:
            self._stop.install()

    # ----------------------------------------------------------------- configuration
    @property
    def base_batch(self) -> int:
        return self.bounds.base_batch

    @property
    def total_batch(self) -> int:
        """M = K * m * s of the current configuration."""
        return self.replicas * self.local_batch * self.accum_steps

    @property
    def epoch(self) -> int:
        if self._sampler is not None:
            return self._sampler.epoch
        return resume_point(self._sampler_state)[0] if self._sampler_state else 0

    @property
    def grad_stats(self) -> GradStats | None:
        return self.estimator.stats

    @property
    def lr_rule(self) -> str:
        """The learning-rate scaling rule (``scaling.py``)."""
        return self._lr.rule

    @lr_rule.setter
    def lr_rule(self, rule: str) -> None:
        self._lr.rule = rule

    @property
    def stats_interval(self) -> int:
        """The least spacing of measuring steps (``measuring.py``)."""
        return self._schedule.stats_interval

    @stats_interval.setter
    def stats_interval(self, steps: int) -> None:
        self._schedule.stats_interval = steps

    @property
    def stats_budget(self) -> float | None:
        """The fraction of training time measuring steps may cost (``measuring.py``)."""
        return self._schedule.stats_budget

    @stats_budget.setter
    def stats_budget(self, fraction: float | None) -> None:
        self._schedule.stats_budget = fraction

    @property
    def checkpoint_interval_s(self) -> float | None:
        """Seconds between periodic checkpoints (``None``: only at a stop)."""
        return self._checkpoint_timer.interval_s

    @checkpoint_interval_s.setter
    def checkpoint_interval_s(self, seconds: float | None) -> None:
        self._checkpoint_timer.interval_s = seconds

    def progress_epochs(self, dataset_size: int) -> float:
        """Progress expressed in epochs at the base batch: progress * M0 / dataset size."""
        return self.progress * self.base_batch / dataset_size

    def _grads(self) -> tuple[list[torch.Tensor], list[torch.Tensor | None] | None]:
        return gradients(self._params, self._preconditioner if self.precondition else None)

    # ----------------------------------------------------------------- data
    def loader(
        self,
        dataset: Dataset[Any],
        *,
        shuffle: bool = True,
        seed: int = 0,
        collate_fn: Callable[[list[Any]], Any] | None = None,
    ) -> ElasticLoader:
        """The job's training loader (one per trainer; its position is checkpointed)."""
        if self._sampler is not None:
            raise PolluxError("a trainer has one training loader; it was already created")
        size = len(dataset)  # type: ignore[arg-type]
        self._sampler = ElasticSampler(size, shuffle=shuffle, seed=seed)
        if self._sampler_state is not None:
            self._sampler.load_state_dict(self._sampler_state)
        return ElasticLoader(self, dataset, collate_fn)

    def epochs(self, max_epochs: int | None = None) -> Iterator[int]:
        """Epoch numbers from the restored epoch on, up to ``max_epochs`` (exclusive).

        ``max_epochs`` is the job's declared length: it is reported (``epochs``) so that the
        scheduler can estimate the job's remaining time."""
        self.max_epochs = max_epochs
        while max_epochs is None or self.epoch < max_epochs:
            current = self.epoch
            yield current
            if self.epoch == current:
                raise PolluxError("each epoch must iterate the trainer's loader to its end")

    def _next_plan(self) -> StepPlan | None:
        assert self._sampler is not None
        if self._stop.requested and self.replicas == 1:
            self._checkpoint_and_exit()  # one replica needs no agreement: stop between steps
        if self.replicas == 1:
            order = self._resize.pending()
            if order is not None:
                self._warm_resize(order)
        measuring = self._schedule.begin_step()
        split = (
            measuring
            and self.replicas == 1
            and self.accum_steps == 1
            and self.local_batch >= 2
            and not self._small_norm_usable()
        )
        return self._sampler.plan_step(self.replicas, self.local_batch, self.accum_steps, split)

    def _begin_micro(self, plan: StepPlan, index: int) -> None:
        if isinstance(self.model, DistributedDataParallel):
            # a measuring step synchronises by hand (see ``_sync_and_measure``)
            last = index == len(plan.micro) - 1
            self.model.require_backward_grad_sync = last and not self._schedule.measuring
        self._micro = (plan, index)
        if self._measures_by_hooks(plan, index):
            assert self._small_norm is not None
            pre = self._preconditioner if self.precondition else None
            self._small_norm.arm(len(plan.micro[0].indices[0]), pre)
        if index == 0 and self.peak_memory is not None:
            self.peak_memory.before_step(plan, self.rank)
        if index == 0 and self.device.type == "cuda" and self._schedule.timed():
            torch.cuda.synchronize(self.device)  # a timed step starts on an idle device
        self._t0 = time.perf_counter()
        if index == 0:
            self._step_start = self._t0
            self._step_start_cost = self._cost_clock()

    def _epoch_start(self) -> None:
        if not self._started:
            self._started = True
            if not self._env_choice:
                self._adapt()
        elif self._sampler is not None and self._sampler.position == 0:
            self._adapt()

    def _epoch_end(self) -> None:
        assert self._sampler is not None
        self._sampler.next_epoch()
        self._report(force=True)

    # ----------------------------------------------------------------- the step
    def step(self, loss: torch.Tensor, *, clip_grad_norm: float | None = None) -> bool:
        """Back-propagate this micro-batch's (mean) loss; on the last micro-batch of the
        optimizer step, synchronise, scale the learning rate and step.  Returns whether the
        optimizer stepped.  On a pending rescale request the job checkpoints and exits with
        ``ExitCode.RESCALE`` right after the step."""
        if self._micro is None:
            raise PolluxError("trainer.step() must be called once for each batch of the loader")
        plan, index = self._micro
        self._micro = None
        weight = plan.micro[index].weights[self.rank]
        scaled = loss if weight == 1.0 else loss * weight
        # torch.autograd.backward(t) is what t.backward() calls (and is typed).
        if self.scaler is not None:
            torch.autograd.backward(self.scaler.scale(scaled))
        else:
            torch.autograd.backward(scaled)
        # on CUDA only timed steps wait for the device (``measuring.py``)
        timed = self.device.type != "cuda" or self._schedule.timed()
        if self.device.type == "cuda" and timed:
            torch.cuda.synchronize(self.device)
        elapsed = time.perf_counter() - self._t0
        slowdown = self.env.device_slowdown
        if slowdown is not None and slowdown > 1.0:
            # a CPU-backed test device declared this many times slower: it takes that long
            time.sleep((slowdown - 1.0) * elapsed)
            elapsed *= slowdown
        last = index == len(plan.micro) - 1
        if self._small_norm is not None and self._small_norm.armed:
            self._take_small_norm(plan, weight)
        elif timed:
            # (a step measured through hooks is a little dearer: not profiled as m)
            self._record_time(plan, index, elapsed, last)
        if not last:
            usable = plan.full or plan.split
            measuring = self._schedule.measuring
            if index == 0 and measuring and self.replicas == 1 and usable and weight > 0:
                grads, pre = self._grads()
                amp = self._amp_scale()
                factor = 1.0 / (weight * amp) ** 2
                self._small = ([squared_norm(grads, pre)], factor, len(plan.micro[0].indices[0]))
            return False
        return self._optimizer_step(plan, clip_grad_norm)

    def _cost_clock(self) -> float:
        """The clock that prices a step for the spacing of measuring steps: one replica on the
        CPU, this process's CPU time, which other processes sharing its cores do not stretch
        (under contention a step's wall time gains whole scheduler slices, which dilute the
        measuring steps' relative cost); otherwise the wall clock: on CUDA timed steps
        synchronise, and with several replicas a step's cost includes waiting for the others,
        which CPU time does not see (the measuring step's blocking all-reduce read as cheaper
        in CPU time than DDP's, whose communication thread counts, and k fell to its least)."""
        if self.device.type == "cuda" or self.replicas > 1:
            return time.perf_counter()
        return time.process_time()

    def _small_norm_usable(self) -> bool:
        return self._small_norm is not None and self._small_norm.usable

    def _measures_by_hooks(self, plan: StepPlan, index: int) -> bool:
        """Whether this micro-batch is a one-replica measuring step's only one, whose g_small
        ``SmallBatchGradNorm`` takes (no split)."""
        return (
            index == 0
            and self._schedule.measuring
            and self.replicas == 1
            and len(plan.micro) == 1
            and plan.full
            and self._small_norm_usable()
        )

    def _take_small_norm(self, plan: StepPlan, weight: float) -> None:
        """g_small of a one-replica measuring step from ``SmallBatchGradNorm``: the hooks summed
        |sum_{r in A} delta_r x_r^T|^2 with delta the gradient of the back-propagated loss
        w * a * (1/B) sum_r l_r (B rows, loss weight w, AMP scale a), so the mean-loss gradient
        of the rows A is g_A = (B / |A|) / (w a) times that sum."""
        assert self._small_norm is not None
        found = self._small_norm.result()
        if found is None or weight <= 0:
            return
        terms, small = found
        rows = len(plan.micro[0].indices[0])
        scale = rows / (small * weight * self._amp_scale())
        if self._small_norm.checking and not self._small_norm.check_total(
            float(squared_norm(*self._grads()))
        ):
            log.info("gradient statistics: the hooks miss some gradients; splitting steps")
            return
        self._small = (terms, scale * scale, small)

    def _amp_scale(self) -> float:
        if self.scaler is None:
            return 1.0
        return float(self.scaler.get_scale())

    def _record_time(self, plan: StepPlan, index: int, elapsed: float, last: bool) -> None:
        if self._warmup_left > 0 or not (plan.full or plan.split):
            return
        local = len(plan.micro[index].indices[self.rank])
        key = (self.env.num_nodes, self.replicas, local)
        if self.replicas == 1:
            self.profile.add_compute(key, elapsed)
            self.profile.add_step(key, elapsed)
        elif not last or self._schedule.measuring:
            self.profile.add_compute(key, elapsed)  # a micro-batch that did not synchronise
        else:
            self.profile.add_step(key, elapsed)

    def _optimizer_step(self, plan: StepPlan, clip_grad_norm: float | None) -> bool:
        # statistics (and, on measuring steps with several replicas, the all-reduce) come
        # first, so that the AMP scaler checks the averaged gradients for infinities
        stop, checkpoint_now = self._collect_stats(plan)
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        factor, gain = self._lr.scales(self.estimator.stats, self.estimator.samples, plan.total)
        if clip_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(self.module.parameters(), clip_grad_norm)
        with scaled_learning_rate(self.optimizer, factor):
            if self.scaler is not None:
                self.scaler.step(self.optimizer)
                self.scaler.update()
            else:
                self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.peak_memory is not None:
            self.peak_memory.after_step(plan, self.rank)
        self.progress += gain
        self.steps += 1
        self._warmup_left = max(self._warmup_left - 1, 0)
        timed = self.device.type != "cuda" or self._schedule.timed()
        self._schedule.end_step()
        if timed and (plan.full or plan.split) and self.steps > PROFILE_WARMUP_STEPS:
            self._schedule.record_time(self._cost_clock() - self._step_start_cost)
        assert self._sampler is not None
        self._sampler.advance(plan.total)
        if stop:
            self._checkpoint_and_exit()
        if checkpoint_now:
            self.checkpoint()
        if self._agreed_resize:
            self._agreed_resize = 0
            self._warm_resize(self._proposal)
        self._report()
        return True

    def _collect_stats(self, plan: StepPlan) -> tuple[bool, bool]:
        """Fold this step's gradient norms into the estimator; return the (stop, checkpoint)
        decisions every replica takes at this step."""
        usable = plan.full or plan.split
        if self.replicas == 1:
            if self._small is not None and usable:
                small_terms, factor, small_batch = self._small
                grads, pre = self._grads()
                amp = self._amp_scale()
                # both norms in one read from the device (one synchronisation)
                small_raw, big_raw = read_sums(small_terms, norms(grads, pre))
                if small_batch < plan.total:
                    self.estimator.update(
                        small_raw * factor, small_batch, big_raw / (amp * amp), plan.total
                    )
            self._small = None
            return self._stop.requested, self._checkpoint_due()
        if not self._schedule.measuring:
            return False, False
        return self._sync_and_measure(plan, usable)

    def _sync_and_measure(self, plan: StepPlan, usable: bool) -> tuple[bool, bool]:
        """A measuring step with several replicas: the backward pass ran without DDP's
        synchronisation, so ``.grad`` holds this replica's local gradient.  Take its squared
        norm |g_k|^2, then average the gradients and agree on the control flags in one
        all-reduce (``collectives.average_and_agree``), and take the squared norm of the
        average: the two-batch estimate with b_small = M / K and b_big = M."""
        grads, pre = self._grads()
        amp = self._amp_scale()
        local_sq = squared_norm(grads, pre) / (amp * amp)
        mean_local, agreed = average_and_agree(
            grads,
            local_sq,
            stop=self._stop.requested,
            checkpoint=self.rank == 0 and self._checkpoint_due(),
            interval=self._schedule.proposed() if self.rank == 0 else 0,
            replicas=self.replicas,
            device=self.device,
            resize=self._pending_generation() if self.rank == 0 else 0,
        )
        self._agreed_resize = agreed.resize
        if usable:
            big_sq = float(squared_norm(grads, pre)) / (amp * amp)
            small_batch = plan.total // self.replicas
            if small_batch < plan.total:
                self.estimator.update(mean_local, small_batch, big_sq, plan.total)
        self._schedule.adopt(agreed.interval)  # rank 0's spacing, the same everywhere
        return agreed.stop, agreed.checkpoint

    def _pending_generation(self) -> int:
        self._proposal = self._resize.pending()
        return self._proposal.generation if self._proposal is not None else 0

    def _checkpoint_due(self) -> bool:
        return self._checkpoint_timer.due(self.checkpoints is not None)

    # ----------------------------------------------------------------- adaptation
    def _adapt(self) -> None:
        """Re-choose (m, s) for this allocation with the goodput model (rank 0 decides; the
        choice is broadcast)."""
        proposal = self._best_choice() if (self.adapt and self.rank == 0) else None
        current = (self.local_batch, self.accum_steps)
        choice = agreed_choice(proposal, current, self.replicas, self.device)
        if choice is not None:
            log.info("batch configuration m=%d s=%d -> m=%d s=%d", *current, *choice)
            self.local_batch, self.accum_steps = choice
            self._warmup_left = PROFILE_WARMUP_STEPS

    def _best_choice(self) -> BatchChoice | None:
        return best_choice(
            self.profile.observations(self.env.device_type),
            self.estimator.stats,
            self.bounds,
            self.env.num_nodes,
            self.replicas,
            (self.local_batch, self.accum_steps),
        )

    # ----------------------------------------------------------------- checkpoints
    def request_stop(self) -> None:
        """Ask for a checkpoint-and-exit after the current step (what SIGTERM does)."""
        self._stop.request()

    def _payload(self) -> dict[str, Any]:
        return build_payload(
            module=self.module,
            optimizer=self.optimizer,
            lr_scheduler=self.lr_scheduler,
            scaler=self.scaler,
            sampler_state=self._sampler.state_dict() if self._sampler else self._sampler_state,
            estimator=self.estimator,
            profile=self.profile,
            progress=self.progress,
            steps=self.steps,
            batch=(self.local_batch, self.accum_steps),
            user=self.state,
        )

    def _load(self, payload: dict[str, Any]) -> None:
        restored = restore_payload(
            payload,
            module=self.module,
            optimizer=self.optimizer,
            lr_scheduler=self.lr_scheduler,
            scaler=self.scaler,
            estimator=self.estimator,
            profile=self.profile,
            user=self.state,
        )
        self._sampler_state = restored.sampler_state
        self.progress = restored.progress
        self.steps = restored.steps

    def restore_from(self, path: str | Path) -> None:
        """Restore a named checkpoint file (missing or damaged: ``PolluxError``)."""
        self._load(load_file(path))
        if self._sampler is not None and self._sampler_state is not None:
            self._sampler.load_state_dict(self._sampler_state)

    def checkpoint(self) -> Path | None:
        """Write a checkpoint now (rank 0 writes; every replica must call this together)."""
        path = None
        if self.checkpoints is not None and self.rank == 0:
            path = self.checkpoints.save(self.steps, self._payload())
        self._checkpoint_timer.reset()
        barrier(self.replicas)
        return path

    def _checkpoint_and_exit(self) -> NoReturn:
        exit_for_rescale(
            self._stop,
            self.steps,
            checkpoint=self.checkpoint,
            report=self._final_report,
            leave=self._leave_group,
        )

    # ----------------------------------------------------------------- warm resizes
    def _wrap(self) -> None:
        """Wrap the module in DDP when this incarnation has several replicas."""
        if self.replicas > 1:
            kwargs = dict(self._ddp_kwargs)
            if self.device.type == "cuda":
                kwargs.setdefault("device_ids", [self.device.index])
            self.model = DistributedDataParallel(self.module, **kwargs)
        else:
            self.model = self.module

    def _warm_resize(self, order: ResizeOrder | None) -> None:
        """Act on a resize order every replica agreed on at this step (``resizing.py``):
        leave the group, form the new one under this replica's new rank (or exit 0: a leaving
        replica), and load the new rank 0's state as a restarted replica would load its
        checkpoint (every replica holds the same state; the new rank 0 may be another than
        the old one, whose node the job left)."""
        data = broadcast_object(encode_order(order) if order is not None else None, self.env)
        order = decode_order(data)
        self._resize.done(order.generation)
        rank = order.new_rank(self.rank)
        payload = self._payload() if rank == 0 else None
        self._leave_group()
        if rank is None:
            log.info("leaving at step %d (warm resize %d)", self.steps, order.generation)
            self.reporter.flush()
            sys.exit(0)
        if rank != self.rank:
            log.info("rank %d becomes rank %d (warm resize %d)", self.rank, rank, order.generation)
        self.rank = rank
        num_nodes = order.num_nodes or self.env.num_nodes
        self.env = dataclasses.replace(
            self.env,
            rank=rank,
            world_size=order.world_size,
            num_nodes=num_nodes,
            local_world_size=order.world_size if num_nodes == 1 else self.env.local_world_size,
            master_addr=order.master_addr,
            master_port=order.master_port,
            local_batch=order.local_batch,
            accum_steps=order.accum_steps,
            resize_join=None,
        )
        self.replicas = order.world_size
        try:
            init_distributed(self.env)
            payload = broadcast_object(payload, self.env)
        except Exception as exc:  # noqa: BLE001 - any failure here falls back to a restart
            self._fall_back(payload, exc)
        self.bounds = validated_bounds(*self._bound_args, self.replicas)
        self._schedule = MeasuringSchedule(
            self._schedule.stats_interval, self._schedule.stats_budget, self.replicas
        )
        self.local_batch, self.accum_steps = initial_choice(
            self.bounds, self.replicas, order.local_batch, order.accum_steps
        )
        self._env_choice = order.local_batch is not None
        self._warmup_left = PROFILE_WARMUP_STEPS
        self._small = None
        self._last_report = 0.0
        self._checkpoint_timer.reset()
        self._load(payload)
        if self._sampler is not None and self._sampler_state is not None:
            # as saved: this replica's loop is in that epoch (saved at its very end, the loop
            # ends it as without a resize; a joiner starts the next one, as a restart would)
            self._sampler.load_state_dict(self._sampler_state, resume=False)
        self._wrap()
        if self._sampler is not None and self._sampler.remaining <= 0:
            # at an epoch's very end: the loop's next epoch start is this incarnation's first,
            # as it is for a joiner (and for a restarted job), where (m, s) is chosen
            self._started = False
        elif not self._env_choice:
            self._adapt()  # what a restarted job does as its loader starts
        log.info(
            "resized warm to %d replica(s) at step %d (order %d)",
            self.replicas,
            self.steps,
            order.generation,
        )

    def _fall_back(self, payload: dict[str, Any] | None, exc: BaseException) -> NoReturn:
        """The new group did not form: rank 0 checkpoints the state it holds and every
        replica exits for a restart (``ExitCode.RESCALE``)."""
        log.warning("warm resize failed (%s); checkpointing for a restart", exc)
        if payload is not None and self.checkpoints is not None:
            self.checkpoints.save(self.steps, payload)
        self._stop.ignore_sigterm()
        sys.exit(ExitCode.RESCALE)

    # ----------------------------------------------------------------- reporting
    def report_metrics(self, **metrics: float) -> None:
        """Record user metrics (e.g. loss, accuracy) to send with the next report."""
        self.metrics.update({k: float(v) for k, v in metrics.items()})

    def build_report(self) -> JobReport:
        """The job report (``pollux_local.api.report.JobReport``, schema version 1)."""
        stats = self.estimator.stats
        return JobReport(
            version=REPORT_VERSION,
            job_id=self.env.job_id,
            time=time.time(),
            bounds=ReportBounds(
                base_batch=self.bounds.base_batch,
                max_batch=self.bounds.max_batch,
                min_local=self.bounds.min_local,
                max_local=max_local(self.bounds),
                accumulation=self.bounds.accumulation,
            ),
            profile=[ProfileRow(**row) for row in self.profile.observations()],
            grad_stats=ReportGradStats(sqr=stats.sqr, var=stats.var) if stats else None,
            progress=self.progress,
            epoch=self.epoch,
            epochs=self.max_epochs,
            batch=ReportBatch(
                local_batch=self.local_batch, accum_steps=self.accum_steps, replicas=self.replicas
            ),
            metrics=dict(self.metrics),
            memory=(self.peak_memory.points() or None) if self.peak_memory is not None else None,
            resizes_in_place=self._resize.path is not None,
        )

    def _report(self, force: bool = False) -> None:
        if self.rank != 0:
            return
        now = time.monotonic()
        if not force and now - self._last_report < self.report_interval_s:
            return
        self._last_report = now
        try:
            self.reporter.submit(self.build_report())
        except Exception as exc:  # noqa: BLE001 - reporting never stops training
            log.warning("report failed: %s", exc)

    def _final_report(self) -> None:
        """Send the last report now and wait for it to go out."""
        self._report(force=True)
        self.reporter.flush()

    def close(self) -> None:
        """End of training: settle pending statistics, send a last report, leave the group."""
        self._final_report()
        self._leave_group()

    def _leave_group(self) -> None:
        """Leave the process group, every replica at once (``collectives.leave_group``)."""
        leave_group(self.replicas, self._unwrap)

    def _unwrap(self) -> None:
        """Drop the DDP wrapper (its reducer holds the process group)."""
        self.model = self.module


__all__ = ["PROFILE_WARMUP_STEPS", "ElasticLoader", "ElasticTrainer"]
