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

Gradient statistics are taken on *measuring* steps (``gradstats.py``), spaced adaptively so
that their extra cost stays within ``stats_budget`` of training time.  With several replicas the
collective decisions (stop for a rescale, checkpoint now, the spacing of measuring steps) ride
on the measuring step's all-reduce, so every replica takes them at the same step; measuring
steps are therefore never more than ``STOP_LATENCY_S`` of training apart.  One replica acts on
SIGTERM right after its current step.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import math
import signal
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import Dataset, TensorDataset, default_collate

from pollux_local.core.efficiency import LR_RULES, lr_scale, progress_gain
from pollux_local.core.types import BatchBounds, BatchChoice, GradStats
from pollux_local.errors import PolluxError
from pollux_local.launch.base import RESCALE_EXIT_CODE
from pollux_local.torch.checkpoint import CheckpointStore, load_file
from pollux_local.torch.env import JobEnv, init_distributed
from pollux_local.torch.gradstats import MIN_SAMPLES, GradNoiseEstimator, squared_norm
from pollux_local.torch.profile import ProfileRecorder
from pollux_local.torch.report import REPORT_VERSION, Reporter
from pollux_local.torch.sampler import ElasticSampler, StepPlan

log = logging.getLogger("pollux_local.torch")

#: A change of (m, s) at an epoch boundary is taken only above this predicted goodput gain.
ADAPT_MIN_GAIN = 1.05
#: Optimizer steps not profiled after a start or a change of configuration (warm-up).
PROFILE_WARMUP_STEPS = 2
#: Upper bound on the spacing of gradient-statistics measurements (optimizer steps).
MAX_STATS_INTERVAL = 64
#: With several replicas, stop requests are agreed on at measuring steps, which are spaced at
#: most this many seconds of training apart.
STOP_LATENCY_S = 3.0


def _validated_bounds(
    base_batch: int,
    max_batch: int | None,
    min_local: int,
    max_local: int | None,
    accumulation: bool,
    replicas: int,
) -> BatchBounds:
    for name, value in (("base_batch", base_batch), ("min_local", min_local)):
        if not isinstance(value, int) or value <= 0:
            raise PolluxError(f"{name} must be a positive integer, got {value!r}")
    if max_batch is not None and (not isinstance(max_batch, int) or max_batch <= 0):
        raise PolluxError(f"max_batch must be a positive integer, got {max_batch!r}")
    if max_local is not None and (not isinstance(max_local, int) or max_local <= 0):
        raise PolluxError(f"max_local must be a positive integer, got {max_local!r}")
    try:
        bounds = BatchBounds(
            base_batch=base_batch,
            max_batch=base_batch if max_batch is None else max_batch,
            min_local=min_local,
            max_local=max_local,
            accumulation=accumulation,
        )
    except ValueError as exc:
        raise PolluxError(str(exc)) from None
    if replicas * bounds.min_local > bounds.max_batch:
        raise PolluxError(
            f"batch bounds cannot hold on {replicas} replicas: {replicas} x min_local "
            f"{bounds.min_local} exceeds max_batch {bounds.max_batch}"
        )
    return bounds


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
        env: JobEnv | None = None,
        checkpoint_dir: str | Path | None = None,
        checkpoint_interval_s: float | None = 600.0,
        report_interval_s: float = 10.0,
        state: Mapping[str, Any] | None = None,
        stats_interval: int = 8,
        stats_budget: float | None = 0.01,
        min_stats_samples: int = MIN_SAMPLES,
        ddp_kwargs: Mapping[str, Any] | None = None,
        restore: bool = True,
        handle_sigterm: bool = True,
    ) -> None:
        self.env = env if env is not None else JobEnv.from_environ()
        if lr_rule not in LR_RULES:
            raise PolluxError(f"unknown lr_rule {lr_rule!r}; expected one of {', '.join(LR_RULES)}")
        if stats_interval < 1:
            raise PolluxError(f"stats_interval must be at least 1, got {stats_interval}")
        self.bounds = _validated_bounds(
            base_batch, max_batch, min_local, max_local, accumulation, self.env.world_size
        )
        self.lr_rule = lr_rule
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.scaler = scaler
        self.adapt = adapt
        self.stats_interval = stats_interval
        if stats_budget is not None and not 0.0 < stats_budget <= 1.0:
            raise PolluxError(f"stats_budget must be in (0, 1] or None, got {stats_budget}")
        self.stats_budget = stats_budget
        self._interval = stats_interval
        self._time_plain: float | None = None
        self._time_measured: float | None = None
        self._step_start = 0.0
        self._gain_cache: tuple[int, int, float, float] | None = None
        self.checkpoint_interval_s = checkpoint_interval_s
        self.report_interval_s = report_interval_s
        self.state: dict[str, Any] = dict(state or {})
        self.metrics: dict[str, float] = {}

        init_distributed(self.env)
        self.rank = self.env.rank
        self.replicas = self.env.world_size
        self.device = self.env.torch_device()
        self.module = model.to(self.device)

        self.progress = 0.0
        self.steps = 0
        self.max_epochs: int | None = None
        self.estimator = GradNoiseEstimator(base_batch, min_samples=min_stats_samples)
        self.profile = ProfileRecorder()
        self._sampler: ElasticSampler | None = None
        self._sampler_state: dict[str, Any] | None = None
        self._group_of = {id(p): g for g in optimizer.param_groups for p in g["params"]}
        if precondition is None:
            precondition = isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW)
        self.precondition = precondition

        self._stop_requested = False
        self._micro: tuple[StepPlan, int] | None = None
        self._t0 = 0.0
        self._small: tuple[torch.Tensor, int] | None = None
        self._since_stats = stats_interval  # measure the very first step
        self._measuring = True
        self._warmup_left = PROFILE_WARMUP_STEPS
        self._started = False
        self._last_report = 0.0
        self._last_checkpoint = time.monotonic()

        ckpt_dir = checkpoint_dir if checkpoint_dir is not None else self.env.checkpoint_dir
        self.checkpoints = CheckpointStore(ckpt_dir) if ckpt_dir is not None else None
        self.reporter = Reporter(self.env.job_id, self.env.job_dir, self.env.daemon_socket)

        self.local_batch, self.accum_steps = self._initial_choice()
        self._env_choice = self.env.local_batch is not None
        if restore and self.checkpoints is not None:
            found = self.checkpoints.load_latest()
            if found is not None:
                self._load(found[0])
                log.info("restored %s (progress %.1f)", found[1], self.progress)

        self.model: torch.nn.Module
        if self.replicas > 1:
            kwargs = dict(ddp_kwargs or {})
            if self.device.type == "cuda":
                kwargs.setdefault("device_ids", [self.device.index])
            self.model = DistributedDataParallel(self.module, **kwargs)
        else:
            self.model = self.module
        self._handles_sigterm = handle_sigterm and self.checkpoints is not None
        if self._handles_sigterm:
            signal.signal(signal.SIGTERM, self._on_sigterm)

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
        return int(self._sampler_state["epoch"]) if self._sampler_state else 0

    @property
    def grad_stats(self) -> GradStats | None:
        return self.estimator.stats

    def progress_epochs(self, dataset_size: int) -> float:
        """Progress expressed in epochs at the base batch: progress * M0 / dataset size."""
        return self.progress * self.base_batch / dataset_size

    def _max_local(self) -> int:
        return int(self.bounds.max_local or self.bounds.max_batch)

    def _initial_choice(self) -> tuple[int, int]:
        k = self.replicas
        if self.env.local_batch is not None:
            m, s = self.env.local_batch, self.env.accum_steps or 1
            if not self.bounds.min_local <= m <= self._max_local():
                raise PolluxError(
                    f"POLLUX_LOCAL_BATCH={m} is outside the job's local batch bounds "
                    f"[{self.bounds.min_local}, {self._max_local()}]"
                )
            if s > 1 and not self.bounds.accumulation:
                raise PolluxError(f"POLLUX_ACCUM_STEPS={s} but the job disables accumulation")
            if k * m * s > self.bounds.max_batch:
                raise PolluxError(
                    f"{k} replicas x local batch {m} x {s} steps exceeds max_batch "
                    f"{self.bounds.max_batch}"
                )
            return m, s
        target = max(self.bounds.base_batch, k * self.bounds.min_local)
        max_local = self._max_local()
        per_replica = max(target // k, self.bounds.min_local)
        steps = math.ceil(per_replica / max_local) if self.bounds.accumulation else 1
        m = min(max(target // (k * steps), self.bounds.min_local), max_local)
        return m, steps

    def _preconditioner(self, param: torch.Tensor) -> torch.Tensor | None:
        """sqrt(v_hat) + eps of an Adam-type optimizer for ``param`` (None before its first
        step)."""
        st = self.optimizer.state.get(param)
        if not st or "exp_avg_sq" not in st:
            return None
        group = self._group_of.get(id(param))
        beta2 = float(group.get("betas", (0.9, 0.999))[1]) if group else 0.999
        eps = float(group.get("eps", 1e-8)) if group else 1e-8
        step = float(st.get("step", 1))
        correction = 1.0 - beta2**step if step > 0 else 1.0
        return (st["exp_avg_sq"] / correction).sqrt().add_(eps)

    def _grads(self) -> tuple[list[torch.Tensor], list[torch.Tensor | None] | None]:
        params = [p for p in self.module.parameters() if p.grad is not None]
        grads = [p.grad for p in params if p.grad is not None]
        pre = [self._preconditioner(p) for p in params] if self.precondition else None
        return grads, pre

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
        if self._stop_requested and self.replicas == 1:
            self._checkpoint_and_exit()  # one replica needs no agreement: stop between steps
        self._measuring = self._since_stats >= self._interval
        split = (
            self._measuring
            and self.replicas == 1
            and self.accum_steps == 1
            and self.local_batch >= 2
        )
        return self._sampler.plan_step(self.replicas, self.local_batch, self.accum_steps, split)

    def _begin_micro(self, plan: StepPlan, index: int) -> None:
        if isinstance(self.model, DistributedDataParallel):
            # a measuring step synchronises by hand (see ``_sync_and_measure``)
            last = index == len(plan.micro) - 1
            self.model.require_backward_grad_sync = last and not self._measuring
        self._micro = (plan, index)
        self._t0 = time.perf_counter()
        if index == 0:
            self._step_start = self._t0

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
        ``RESCALE_EXIT_CODE`` right after the step."""
        if self._micro is None:
            raise PolluxError("trainer.step() must be called once for each batch of the loader")
        plan, index = self._micro
        self._micro = None
        weight = plan.micro[index].weights[self.rank]
        scaled = loss if weight == 1.0 else loss * weight
        if self.scaler is not None:
            self.scaler.scale(scaled).backward()
        else:
            scaled.backward()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        elapsed = time.perf_counter() - self._t0
        last = index == len(plan.micro) - 1
        self._record_time(plan, index, elapsed, last)
        if not last:
            usable = plan.full or plan.split
            if index == 0 and self._measuring and self.replicas == 1 and usable and weight > 0:
                grads, pre = self._grads()
                amp = self._amp_scale()
                small = squared_norm(grads, pre) / (weight * amp) ** 2
                self._small = (small, len(plan.micro[0].indices[0]))
            return False
        return self._optimizer_step(plan, clip_grad_norm)

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
        elif not last or self._measuring:
            self.profile.add_compute(key, elapsed)  # a micro-batch that did not synchronise
        else:
            self.profile.add_step(key, elapsed)

    def _optimizer_step(self, plan: StepPlan, clip_grad_norm: float | None) -> bool:
        # statistics (and, on measuring steps with several replicas, the all-reduce) come
        # first, so that the AMP scaler checks the averaged gradients for infinities
        stop, checkpoint_now = self._collect_stats(plan)
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        stats = self.estimator.stats
        factor, gain = self._scales(stats, plan.total)
        if clip_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(self.module.parameters(), clip_grad_norm)
        saved = [g["lr"] for g in self.optimizer.param_groups]
        for g in self.optimizer.param_groups:
            g["lr"] = g["lr"] * factor
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        for g, lr in zip(self.optimizer.param_groups, saved, strict=True):
            g["lr"] = lr
        self.optimizer.zero_grad(set_to_none=True)
        self.progress += gain
        self.steps += 1
        self._warmup_left = max(self._warmup_left - 1, 0)
        self._since_stats = 0 if self._measuring else self._since_stats + 1
        if (plan.full or plan.split) and self.steps > PROFILE_WARMUP_STEPS:
            self._time_step(time.perf_counter() - self._step_start)
        assert self._sampler is not None
        self._sampler.advance(plan.total)
        if stop:
            self._checkpoint_and_exit()
        if checkpoint_now:
            self.checkpoint()
        self._report()
        return True

    def _collect_stats(self, plan: StepPlan) -> tuple[bool, bool]:
        """Fold this step's gradient norms into the estimator; return the (stop, checkpoint)
        decisions every replica takes at this step."""
        usable = plan.full or plan.split
        if self.replicas == 1:
            if self._small is not None and usable:
                small, small_batch = self._small
                grads, pre = self._grads()
                amp = self._amp_scale()
                big = float(squared_norm(grads, pre)) / (amp * amp)
                if small_batch < plan.total:
                    self.estimator.update(float(small), small_batch, big, plan.total)
            self._small = None
            return self._stop_requested, self._checkpoint_due()
        if not self._measuring:
            return False, False
        return self._sync_and_measure(plan, usable)

    def _sync_and_measure(self, plan: StepPlan, usable: bool) -> tuple[bool, bool]:
        """A measuring step with several replicas: the backward pass ran without DDP's
        synchronisation, so ``.grad`` holds this replica's local gradient.  Take its squared
        norm, then all-reduce the flattened gradients together with [local squared norm, stop
        flag, checkpoint flag, rank 0's next measuring interval] in one collective, average,
        and take the squared norm of the result."""
        params = [p for p in self.module.parameters() if p.grad is not None]
        grads = [p.grad for p in params if p.grad is not None]
        pre = [self._preconditioner(p) for p in params] if self.precondition else None
        amp = self._amp_scale()
        local_sq = squared_norm(grads, pre) / (amp * amp)
        control = torch.tensor(
            [
                float(self._stop_requested),
                float(self.rank == 0 and self._checkpoint_due()),
                float(self._proposed_interval() if self.rank == 0 else 0),
            ],
            device=self.device,
        )
        flat = torch.cat(
            [g.reshape(-1) for g in grads]
            + [local_sq.reshape(1).to(grads[0]), control.to(grads[0])]
        )
        dist.all_reduce(flat)
        flat.div_(self.replicas)
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()
        mean_local, stop, ckpt, interval = (
            float(v) * self.replicas for v in flat[offset:].tolist()
        )
        mean_local /= self.replicas
        if usable:
            big_sq = float(squared_norm(grads, pre)) / (amp * amp)
            small_batch = plan.total // self.replicas
            if small_batch < plan.total:
                self.estimator.update(mean_local, small_batch, big_sq, plan.total)
        if interval >= 1:
            self._interval = int(round(interval))  # rank 0's spacing, the same everywhere
        return stop > 0, ckpt > 0

    def _scales(self, stats: GradStats | None, total: int) -> tuple[float, float]:
        """(learning-rate factor, progress gain) at batch ``total`` (cached: both change only
        when the statistics or the batch do)."""
        cache = self._gain_cache
        key = self.estimator.samples
        if cache is not None and cache[0] == key and cache[1] == total:
            return cache[2], cache[3]
        factor = lr_scale(stats, self.base_batch, total, self.lr_rule)
        if stats is not None:
            gain = float(progress_gain(stats, self.base_batch, total))
        else:
            gain = min(total / self.base_batch, 1.0)
        self._gain_cache = (key, total, factor, gain)
        return factor, gain

    def _time_step(self, seconds: float) -> None:
        """Track the cost of measuring steps against ordinary ones (EMAs of step time)."""
        if self._measuring:
            prev = self._time_measured
            self._time_measured = seconds if prev is None else 0.8 * prev + 0.2 * seconds
        else:
            prev = self._time_plain
            self._time_plain = seconds if prev is None else 0.9 * prev + 0.1 * seconds
        if self.replicas == 1:
            self._interval = self._proposed_interval()

    def _proposed_interval(self) -> int:
        """Steps between measuring steps so that their extra cost stays within
        ``stats_budget`` of the training time: max(stats_interval, extra / (budget * step)),
        at most ``MAX_STATS_INTERVAL``."""
        plain, measured = self._time_plain, self._time_measured
        if self.stats_budget is None:
            return self.stats_interval
        if plain is None or measured is None or plain <= 0:
            return self._interval
        extra = max(measured - plain, 0.0) / plain
        wanted = max(self.stats_interval, math.ceil(extra / self.stats_budget))
        if self.replicas > 1:
            # a rescale request is acted on at a measuring step: bound the wait
            wanted = min(wanted, max(1, int(STOP_LATENCY_S / plain)))
        return int(min(wanted, MAX_STATS_INTERVAL))

    def _checkpoint_due(self) -> bool:
        if self.checkpoints is None or self.checkpoint_interval_s is None:
            return False
        return time.monotonic() - self._last_checkpoint >= self.checkpoint_interval_s

    # ----------------------------------------------------------------- adaptation
    def _adapt(self) -> None:
        """Re-choose (m, s) for this allocation with the goodput model (rank 0 decides; the
        choice is broadcast)."""
        choice = self._best_choice() if (self.adapt and self.rank == 0) else None
        m, s = (choice.local_batch, choice.accum_steps) if choice else (self.local_batch, 0)
        if self.replicas > 1:
            buf = torch.tensor([m, s], dtype=torch.int64)
            if self.device.type == "cuda":
                buf = buf.to(self.device)
            dist.broadcast(buf, src=0)
            m, s = (int(v) for v in buf.tolist())
        if s > 0 and (m, s) != (self.local_batch, self.accum_steps):
            log.info(
                "batch configuration m=%d s=%d -> m=%d s=%d",
                self.local_batch,
                self.accum_steps,
                m,
                s,
            )
            self.local_batch, self.accum_steps = m, s
            self._warmup_left = PROFILE_WARMUP_STEPS

    def _best_choice(self) -> BatchChoice | None:
        stats = self.estimator.stats
        rows = self.profile.observations()
        if stats is None or not rows:
            return None
        from pollux_local.core.correction import fit_corrected
        from pollux_local.core.goodput import GoodputModel

        try:
            params, correction = fit_corrected(
                [r["nodes"] for r in rows],
                [r["replicas"] for r in rows],
                [r["local_batch"] for r in rows],
                [r["compute_s"] for r in rows],
                [r["step_s"] for r in rows],
            )
        except ValueError as exc:
            log.warning("cannot fit the throughput model: %s", exc)
            return None
        model = GoodputModel(params, stats, self.bounds, correction)
        best = model.best_choice(self.env.num_nodes, self.replicas)
        nodes, k = self.env.num_nodes, self.replicas
        current = float(model.goodput(nodes, k, self.local_batch, self.accum_steps))
        proposed = float(model.goodput(nodes, k, best.local_batch, best.accum_steps))
        if proposed > ADAPT_MIN_GAIN * current:
            return best
        return None

    # ----------------------------------------------------------------- checkpoints
    def _on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        self._stop_requested = True

    def request_stop(self) -> None:
        """Ask for a checkpoint-and-exit after the current step (what SIGTERM does)."""
        self._stop_requested = True

    def _payload(self) -> dict[str, Any]:
        user: dict[str, Any] = {}
        for name, obj in self.state.items():
            user[name] = obj.state_dict() if hasattr(obj, "state_dict") else obj
        return {
            "format": 1,
            "model": self.module.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "lr_scheduler": self.lr_scheduler.state_dict() if self.lr_scheduler else None,
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
            "sampler": self._sampler.state_dict() if self._sampler else self._sampler_state,
            "grad_stats": self.estimator.state_dict(),
            "profile": self.profile.state_dict(),
            "progress": self.progress,
            "steps": self.steps,
            "batch": [self.local_batch, self.accum_steps],
            "rng": torch.get_rng_state(),
            "user": user,
        }

    def _load(self, payload: dict[str, Any]) -> None:
        try:
            self.module.load_state_dict(payload["model"])
            self.optimizer.load_state_dict(payload["optimizer"])
            if self.lr_scheduler is not None and payload.get("lr_scheduler") is not None:
                self.lr_scheduler.load_state_dict(payload["lr_scheduler"])
            if self.scaler is not None and payload.get("scaler") is not None:
                self.scaler.load_state_dict(payload["scaler"])
            self._sampler_state = payload.get("sampler")
            self.estimator.load_state_dict(payload["grad_stats"])
            self.profile.load_state_dict(payload["profile"])
            self.progress = float(payload["progress"])
            self.steps = int(payload["steps"])
            if payload.get("rng") is not None:
                torch.set_rng_state(payload["rng"])
        except (KeyError, RuntimeError, ValueError, TypeError) as exc:
            raise PolluxError(f"checkpoint does not match this job: {exc}") from None
        for name, value in payload.get("user", {}).items():
            obj = self.state.get(name)
            if obj is not None and hasattr(obj, "load_state_dict"):
                obj.load_state_dict(value)
            else:
                self.state[name] = value

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
        self._last_checkpoint = time.monotonic()
        if self.replicas > 1:
            dist.barrier()
        return path

    def _checkpoint_and_exit(self) -> None:
        if self._handles_sigterm:
            # The replicas decided to stop together, so a peer's flag can come before this
            # replica's own SIGTERM.  Arriving during interpreter shutdown, where the handler is
            # gone, that signal would turn the checkpointed exit 75 into a kill.
            with contextlib.suppress(ValueError):  # not the main thread: nothing to guard
                signal.signal(signal.SIGTERM, signal.SIG_IGN)
        self.checkpoint()
        self._report(force=True)
        self.reporter.flush()
        self._leave_group()
        log.info("checkpointed at step %d for a rescale; exiting %d", self.steps, RESCALE_EXIT_CODE)
        sys.exit(RESCALE_EXIT_CODE)

    # ----------------------------------------------------------------- reporting
    def report_metrics(self, **metrics: float) -> None:
        """Record user metrics (e.g. loss, accuracy) to send with the next report."""
        self.metrics.update({k: float(v) for k, v in metrics.items()})

    def build_report(self) -> dict[str, Any]:
        """The job report (schema version 1 of ``docs/architecture.md``)."""
        stats = self.estimator.stats
        return {
            "version": REPORT_VERSION,
            "job_id": self.env.job_id,
            "time": time.time(),
            "bounds": {
                "base_batch": self.bounds.base_batch,
                "max_batch": self.bounds.max_batch,
                "min_local": self.bounds.min_local,
                "max_local": self._max_local(),
                "accumulation": self.bounds.accumulation,
            },
            "profile": self.profile.observations(),
            "grad_stats": {"sqr": stats.sqr, "var": stats.var} if stats else None,
            "progress": self.progress,
            "epoch": self.epoch,
            "epochs": self.max_epochs,
            "batch": {
                "local_batch": self.local_batch,
                "accum_steps": self.accum_steps,
                "replicas": self.replicas,
            },
            "metrics": dict(self.metrics),
        }

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

    def close(self) -> None:
        """End of training: settle pending statistics, send a last report, leave the group."""
        self._report(force=True)
        self.reporter.flush()
        self._leave_group()

    def _leave_group(self) -> None:
        """Leave the process group together, every replica at once.

        The DDP wrapper goes first (its reducer holds the group), while every replica is still
        connected; then the group.  Left to the interpreter's exit, that teardown ran after a
        peer had gone and could block the process for ever.
        """
        if self.replicas <= 1 or not dist.is_initialized():
            return
        dist.barrier()
        self.model = self.module
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()


class ElasticLoader:
    """Yields this replica's micro-batches; the trainer decides their sizes step by step."""

    def __init__(
        self,
        trainer: ElasticTrainer,
        dataset: Dataset[Any],
        collate_fn: Callable[[list[Any]], Any] | None,
    ) -> None:
        self.trainer = trainer
        self.dataset = dataset
        self.collate_fn = collate_fn or default_collate

    def _fetch(self, indices: torch.Tensor) -> Any:
        if isinstance(self.dataset, TensorDataset):
            return tuple(t[indices] for t in self.dataset.tensors)
        return self.collate_fn([self.dataset[i] for i in indices.tolist()])

    def __iter__(self) -> Iterator[Any]:
        trainer = self.trainer
        trainer._epoch_start()
        while True:
            plan = trainer._next_plan()
            if plan is None:
                break
            for index, micro in enumerate(plan.micro):
                batch = self._fetch(micro.indices[trainer.rank])
                trainer._begin_micro(plan, index)
                yield batch
                if trainer._micro is not None:
                    raise PolluxError("trainer.step(loss) must be called for every batch")
        trainer._epoch_end()
