"""Learning-rate scaling and progress at a batch M, and the optimizer's preconditioner.

A step at total batch M = K * m * s runs with the base learning rate eta_0 times a factor of
the job's rule (``core.efficiency.lr_scale``; S = M / M0)::

    adascale: eta = r(M) * eta_0,  r(M) = (var + sqr) / (var / S + sqr)   (1 without statistics)
    sqrt, legw: eta = sqrt(S) * eta_0        linear: eta = S * eta_0

and counts r(M) = M / M0 * E(M) base-batch iterations of progress (min(M / M0, 1) before the
statistics are trusted).  For Adam-type optimizers the gradient statistics are measured in
the preconditioned space: each gradient is divided elementwise by sqrt(v_hat) + eps.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import torch

from pollux_local.core.efficiency import LrRule, lr_scale, progress_gain
from pollux_local.core.types import GradStats


class LrScaling:
    """(learning-rate factor, progress gain) of a step at batch M under one rule.

    Both change only when the statistics or the batch do, so the last answer is kept, keyed by
    (number of measurements folded into the statistics, M).
    """

    def __init__(self, rule: str, base_batch: int) -> None:
        self.rule = rule
        self.base_batch = base_batch
        self._cache: tuple[int, int, float, float] | None = None

    def scales(self, stats: GradStats | None, samples: int, total: int) -> tuple[float, float]:
        """(eta / eta_0, r(M)) at M = ``total`` with ``stats`` from ``samples`` measurements."""
        cache = self._cache
        if cache is not None and cache[0] == samples and cache[1] == total:
            return cache[2], cache[3]
        factor = lr_scale(stats, self.base_batch, total, cast(LrRule, self.rule))
        if stats is not None:
            gain = float(progress_gain(stats, self.base_batch, total))
        else:
            gain = min(total / self.base_batch, 1.0)
        self._cache = (samples, total, factor, gain)
        return factor, gain


class scaled_learning_rate:
    """Within the block every parameter group's learning rate is ``factor`` times its own;
    afterwards the groups' own rates are back (a user's schedule keeps owning them).  (A class,
    not a generator: it runs every step, and costs a third as much.)"""

    def __init__(self, optimizer: torch.optim.Optimizer, factor: float) -> None:
        self.groups = optimizer.param_groups
        self.factor = factor
        self.saved: list[float] = []

    def __enter__(self) -> None:
        self.saved = [g["lr"] for g in self.groups]
        for g in self.groups:
            g["lr"] = g["lr"] * self.factor

    def __exit__(self, *exc: object) -> None:
        for g, lr in zip(self.groups, self.saved, strict=True):
            g["lr"] = lr


def keeps_second_moments(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` is Adam-type (the default for measuring preconditioned)."""
    return isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW)


class Preconditioner:
    """P = sqrt(v_hat) + eps, v_hat = v / (1 - beta2^t), of an Adam-type optimizer, per
    parameter (``None`` before the parameter's first step)."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self._group_of = {id(p): g for g in optimizer.param_groups for p in g["params"]}

    def __call__(self, param: torch.Tensor) -> torch.Tensor | None:
        st = self.optimizer.state.get(param)
        if not st or "exp_avg_sq" not in st:
            return None
        group = self._group_of.get(id(param))
        beta2 = float(group.get("betas", (0.9, 0.999))[1]) if group else 0.999
        eps = float(group.get("eps", 1e-8)) if group else 1e-8
        step = float(st.get("step", 1))
        correction = 1.0 - beta2**step if step > 0 else 1.0
        exp_avg_sq: torch.Tensor = st["exp_avg_sq"]
        return (exp_avg_sq / correction).sqrt().add_(eps)


def gradients(
    parameters: Sequence[torch.Tensor], preconditioner: Preconditioner | None
) -> tuple[list[torch.Tensor], list[torch.Tensor | None] | None]:
    """The gradients of those ``parameters`` that have one and, with a ``preconditioner``,
    each one's P."""
    params = [p for p in parameters if p.grad is not None]
    grads = [p.grad for p in params if p.grad is not None]
    pre = [preconditioner(p) for p in params] if preconditioner is not None else None
    return grads, pre
