"""Elastic sampling: the order of samples in an epoch does not depend on the replica count.

Each epoch visits a permutation of the data set fixed by ``(seed, epoch)``.  The sampler keeps
one number of state besides the epoch: ``position``, how many samples of that permutation the
job has consumed.  An optimizer step takes the next ``B = K * m * s`` samples (fewer at the end
of the epoch) and deals them out: micro-batch j gets samples ``[j*K*m, (j+1)*K*m)`` of the step,
and replica r gets the r-th contiguous share of them.  The samples of a step therefore do not
depend on how they are split, and after a restart with any K the job continues at the exact
next sample, none skipped and none repeated.

Each share carries a loss weight ``K * n_r / N`` (``N`` samples in the step, ``n_r`` in the
share) so that the average over replicas of the weighted mean losses' gradients is the mean
gradient over all ``N`` samples, whatever the split.  A replica left without samples at the
very end of an epoch (fewer samples than replicas) gets a placeholder sample with weight 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from pollux_local.errors import PolluxError


@dataclass(frozen=True)
class MicroBatch:
    """The shares of one micro-batch: per replica, the sample indices and the loss weight."""

    indices: tuple[torch.Tensor, ...]
    weights: tuple[float, ...]


@dataclass(frozen=True)
class StepPlan:
    """The micro-batches of one optimizer step.

    ``total`` is the number of samples N in the step; ``full`` says whether the step has the
    configured size K*m*s (false for the tail of an epoch and for split statistics steps, which
    are not profiled as configuration ``m``).
    """

    micro: tuple[MicroBatch, ...]
    total: int
    full: bool
    split: bool = False


def _shares(count: int, parts: int) -> list[tuple[int, int]]:
    """Contiguous, as-even-as-possible ``(start, stop)`` shares of ``count`` items."""
    return [(r * count // parts, (r + 1) * count // parts) for r in range(parts)]


def resume_point(state: dict[str, Any]) -> tuple[int, int]:
    """``(epoch, position)`` to resume from a sampler's saved state.  A checkpoint taken right
    after an epoch's last step (a stop or a periodic checkpoint there) saved the position at
    the end of that epoch: it resumes at the start of the next one, so that the job's loop is
    never handed an epoch with nothing left in it."""
    epoch, position = int(state["epoch"]), int(state["position"])
    if position >= int(state["num_samples"]):
        return epoch + 1, 0
    return epoch, position


class ElasticSampler:
    """Deterministic, restartable order of samples for one data set."""

    def __init__(self, num_samples: int, *, shuffle: bool = True, seed: int = 0) -> None:
        if num_samples <= 0:
            raise PolluxError(f"the data set is empty (it has {num_samples} samples)")
        self.num_samples = int(num_samples)
        self.shuffle = shuffle
        self.seed = int(seed)
        self.epoch = 0
        self.position = 0
        self._perm_epoch = -1
        self._perm = torch.arange(self.num_samples)

    def permutation(self) -> torch.Tensor:
        """The visiting order of the current epoch."""
        if self._perm_epoch != self.epoch:
            if self.shuffle:
                gen = torch.Generator()
                gen.manual_seed(self.seed * 1_000_003 + self.epoch)
                self._perm = torch.randperm(self.num_samples, generator=gen)
            else:
                self._perm = torch.arange(self.num_samples)
            self._perm_epoch = self.epoch
        return self._perm

    @property
    def remaining(self) -> int:
        return self.num_samples - self.position

    def plan_step(
        self, replicas: int, local_batch: int, accum_steps: int, split: bool = False
    ) -> StepPlan | None:
        """The next optimizer step's micro-batches, or ``None`` when the epoch is used up.

        ``split`` (one replica, no accumulation) deals the step out as two half micro-batches
        so that the gradient-noise estimator gets two gradients of the same step for free.
        """
        if replicas <= 0 or local_batch <= 0 or accum_steps <= 0:
            raise PolluxError(
                f"batch configuration must be positive, got replicas={replicas}, "
                f"local_batch={local_batch}, accum_steps={accum_steps}"
            )
        if self.remaining <= 0:
            return None
        configured = replicas * local_batch * accum_steps
        total = min(configured, self.remaining)
        chunk = self.permutation()[self.position : self.position + total]
        per_micro = replicas * local_batch
        bounds: list[tuple[int, int]]
        do_split = split and replicas == 1 and accum_steps == 1 and total >= 2
        if replicas == 1 and total <= per_micro and not do_split:
            # one replica, one micro-batch (the common step): the whole chunk, weight 1
            return StepPlan((MicroBatch((chunk,), (1.0,)),), total, total == configured)
        if do_split:
            bounds = _shares(total, 2)
        else:
            bounds = [(a, min(a + per_micro, total)) for a in range(0, total, per_micro)]
        micro = []
        for start, stop in bounds:
            part = chunk[start:stop]
            indices: list[torch.Tensor] = []
            weights: list[float] = []
            for a, b in _shares(stop - start, replicas):
                if b > a:
                    indices.append(part[a:b])
                    weights.append(replicas * (b - a) / total)
                else:
                    indices.append(part[:1])
                    weights.append(0.0)
            micro.append(MicroBatch(tuple(indices), tuple(weights)))
        return StepPlan(tuple(micro), total, total == configured and not do_split, do_split)

    def advance(self, count: int) -> None:
        """Record that ``count`` more samples of this epoch were trained on."""
        self.position = min(self.position + count, self.num_samples)

    def next_epoch(self) -> None:
        self.epoch += 1
        self.position = 0

    def state_dict(self) -> dict[str, Any]:
        return {
            "num_samples": self.num_samples,
            "shuffle": self.shuffle,
            "seed": self.seed,
            "epoch": self.epoch,
            "position": self.position,
        }

    def load_state_dict(self, state: dict[str, Any], resume: bool = True) -> None:
        """Take a saved state: with ``resume``, as a job starting from it does
        (:func:`resume_point`: an epoch saved at its end is begun afresh as the next one);
        without, exactly as saved (a replica that stays through a warm resize, its loop in
        the middle of that epoch, finishes it as it would have)."""
        if int(state["num_samples"]) != self.num_samples:
            raise PolluxError(
                f"checkpoint was taken on a data set of {state['num_samples']} samples, "
                f"this one has {self.num_samples}"
            )
        self.shuffle = bool(state["shuffle"])
        self.seed = int(state["seed"])
        if resume:
            self.epoch, self.position = resume_point(state)
        else:
            self.epoch, self.position = int(state["epoch"]), int(state["position"])
