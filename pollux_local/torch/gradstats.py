"""Gradient noise statistics: unbiased |G|^2 and tr(S)/M0 from two gradient estimates.

Two gradients of the same step, one averaged over ``b_small`` examples and one over
``b_big > b_small`` examples (the second containing the first or not), satisfy
E|g_small|^2 = |G|^2 + tr(S)/b_small and E|g_big|^2 = |G|^2 + tr(S)/b_big, hence

    tr(S) = (|g_small|^2 - |g_big|^2) / (1/b_small - 1/b_big)
    |G|^2 = (b_big |g_big|^2 - b_small |g_small|^2) / (b_big - b_small)

(with c equal-sized estimates this is ``core.efficiency.estimate_grad_stats``).  Statistics are
taken on *measuring* steps only, spaced so that their extra cost stays within a budget (1% of
training time by default; see ``ElasticTrainer``), and no gradient is ever copied aside:

* several replicas: on a measuring step the backward pass runs without DDP's overlapped
  all-reduce, so ``.grad`` is the replica's local gradient ``g_small``; its squared norm is
  taken, and one all-reduce of the flattened gradients, with that norm and the replicas'
  control flags appended, yields the average ``g_big`` and the mean local norm together.
  Ordinary steps use DDP's own all-reduce untouched.
* one replica with accumulation: ``g_small`` is the first micro-batch's gradient (the norm of
  ``.grad`` right after its backward), ``g_big`` the accumulated one.
* one replica, no accumulation: the measuring step is dealt out as two half micro-batches;
  ``g_small`` is the first half's gradient, ``g_big`` the whole step's.  The cost is one
  extra, smaller forward/backward launch and two norms on that step only.
  The previous-gradient copy of the reference design (a full extra gradient buffer written
  every step) is never made.

For Adam-type optimisers every gradient is divided elementwise by the optimiser's
preconditioner sqrt(v_hat) + eps before its norm is taken.  Norms are fused: one
``torch._foreach_norm`` over all gradients (and one ``torch._foreach_div`` for the
preconditioner), a 0-d tensor on the gradients' device; the host reads it on measuring steps
only, so ordinary steps never wait for the device.

The two statistics are smoothed separately with a bias-corrected exponential moving average
(weight ``smoothing`` = beta per measurement).  Each also carries its standard error
(:attr:`GradNoiseEstimator.stderr`): the spread of one measurement, from half the squared
difference of successive measurements (which a slow drift of the statistic hardly inflates),
times sqrt(sum w_i^2) / sum w_i of the EMA's weights.  The estimate's 95% band is +-1.96 of it.
Measuring every k steps leaves that band as it is (the same number of measurements is
averaged) but makes the average k times older (its lag is k * beta / (1 - beta) steps); the
choice of k against this lag is in ``measuring.py``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from pollux_local.core.types import GradStats


def two_batch_estimate(
    small_sq: float, small_batch: float, big_sq: float, big_batch: float
) -> tuple[float, float]:
    """(|G|^2, tr(S)) from squared norms of gradients over ``small_batch`` and ``big_batch``
    examples (formulas in the module docstring)."""
    if not 0 < small_batch < big_batch:
        raise ValueError(f"need 0 < small batch < big batch, got {small_batch}, {big_batch}")
    trace = (small_sq - big_sq) / (1.0 / small_batch - 1.0 / big_batch)
    sqr = (big_batch * big_sq - small_batch * small_sq) / (big_batch - small_batch)
    return sqr, trace


#: Measurements needed before the statistics are trusted.  Each two-batch estimate is very
#: noisy (its |G|^2 part is often negative); trusting the first few made a job jump to a 16x
#: batch with a 16x learning rate after one epoch and diverge.
MIN_SAMPLES = 10


class GradNoiseEstimator:
    """Bias-corrected EMAs of |G|^2 and tr(S)/M0 (``var``), with their standard errors.

    ``stats`` stays ``None`` (the trainer then keeps the base learning rate and counts no
    large-batch gain) until ``min_samples`` measurements are in and the smoothed |G|^2 is
    positive.
    """

    def __init__(
        self, base_batch: int, smoothing: float = 0.9, min_samples: int = MIN_SAMPLES
    ) -> None:
        if not 0.0 <= smoothing < 1.0:
            raise ValueError(f"smoothing must be in [0, 1), got {smoothing}")
        self.base_batch = int(base_batch)
        self.smoothing = float(smoothing)
        self.min_samples = int(min_samples)
        self._sqr = 0.0
        self._var = 0.0
        self._weight = 0.0
        self._weight_sq = 0.0  # sum of the squared EMA weights (unnormalised)
        self._sqr_spread = 0.0  # EMA of (x_t - x_{t-1})^2 / 2, per statistic
        self._var_spread = 0.0
        self._spread_weight = 0.0
        self._last: tuple[float, float] | None = None
        self.samples = 0

    def update(self, small_sq: float, small_batch: float, big_sq: float, big_batch: float) -> None:
        """Fold in one pair of squared gradient norms."""
        sqr, trace = two_batch_estimate(small_sq, small_batch, big_sq, big_batch)
        if not (math.isfinite(sqr) and math.isfinite(trace)):
            return
        var = trace / self.base_batch
        beta = self.smoothing
        self._sqr = beta * self._sqr + (1.0 - beta) * sqr
        self._var = beta * self._var + (1.0 - beta) * var
        self._weight = beta * self._weight + (1.0 - beta)
        self._weight_sq = beta * beta * self._weight_sq + (1.0 - beta) ** 2
        if self._last is not None:
            last_sqr, last_var = self._last
            self._sqr_spread = beta * self._sqr_spread + (1.0 - beta) * (sqr - last_sqr) ** 2 / 2
            self._var_spread = beta * self._var_spread + (1.0 - beta) * (var - last_var) ** 2 / 2
            self._spread_weight = beta * self._spread_weight + (1.0 - beta)
        self._last = (sqr, var)
        self.samples += 1

    @property
    def stats(self) -> GradStats | None:
        """The smoothed statistics, or ``None`` while they cannot be trusted (fewer than
        ``min_samples`` measurements, or a smoothed |G|^2 that is not positive).  A negative
        smoothed variance is reported as 0 (no benefit from larger batches)."""
        if self.samples < max(self.min_samples, 1) or self._weight <= 0.0:
            return None
        sqr = self._sqr / self._weight
        if sqr <= 0.0:
            return None
        return GradStats(sqr=sqr, var=max(self._var / self._weight, 0.0))

    @property
    def smoothed(self) -> GradStats | None:
        """The smoothed statistics as they are (no trust threshold, no clipping at 0)."""
        if self._weight <= 0.0:
            return None
        return GradStats(sqr=self._sqr / self._weight, var=self._var / self._weight)

    @property
    def stderr(self) -> GradStats | None:
        """Standard errors of the smoothed |G|^2 and var (``None`` before two measurements);
        the 95% band of each is +-1.96 of its error."""
        if self._spread_weight <= 0.0 or self._weight <= 0.0:
            return None
        shrink = math.sqrt(self._weight_sq) / self._weight
        return GradStats(
            sqr=math.sqrt(self._sqr_spread / self._spread_weight) * shrink,
            var=math.sqrt(self._var_spread / self._spread_weight) * shrink,
        )

    def state_dict(self) -> dict[str, Any]:
        return {
            "base_batch": self.base_batch,
            "smoothing": self.smoothing,
            "sqr": self._sqr,
            "var": self._var,
            "weight": self._weight,
            "weight_sq": self._weight_sq,
            "sqr_spread": self._sqr_spread,
            "var_spread": self._var_spread,
            "spread_weight": self._spread_weight,
            "samples": self.samples,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._sqr = float(state["sqr"])
        self._var = float(state["var"])
        self._weight = float(state["weight"])
        self.samples = int(state["samples"])
        # checkpoints of earlier versions carry no spread: the error is unknown until the
        # next two measurements
        self._weight_sq = float(state.get("weight_sq", 0.0))
        self._sqr_spread = float(state.get("sqr_spread", 0.0))
        self._var_spread = float(state.get("var_spread", 0.0))
        self._spread_weight = float(state.get("spread_weight", 0.0))
        self._last = None
        # a changed base batch rescales var = tr(S)/M0
        rescale = float(state["base_batch"]) / self.base_batch
        self._var *= rescale
        self._var_spread *= rescale * rescale


def squared_norm(
    grads: Sequence[torch.Tensor], preconditioners: Iterable[torch.Tensor | None] | None = None
) -> torch.Tensor:
    """sum_i |g_i / p_i|^2 as a 0-d float32 tensor on the gradients' device, with fused
    kernels (one ``_foreach_div``, one ``_foreach_norm``) and no host synchronisation."""
    if not grads:
        return torch.zeros(())
    tensors = list(grads)
    if preconditioners is not None:
        pre = list(preconditioners)
        scaled = [i for i, p in enumerate(pre) if p is not None]
        if scaled:
            quotients = torch._foreach_div(
                [tensors[i] for i in scaled],
                [pre[i] for i in scaled],  # type: ignore[misc]
            )
            for i, q in zip(scaled, quotients, strict=True):
                tensors[i] = q
    norms = torch._foreach_norm(tensors, 2, dtype=torch.float32)
    return torch.stack(norms).square().sum()
