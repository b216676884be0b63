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
* one replica, no accumulation, a model made of linear layers (:class:`SmallBatchGradNorm`):
  ``g_small`` is the gradient of the first quarter of the step's samples, its squared norm
  summed by hooks from each layer's inputs and output gradients in the step's one backward
  (Gram matrices of those rows), ``g_big`` the whole step's.  The cost is the hooks' small
  matrix products and one norm of ``.grad``, on that step only.
* one replica, no accumulation, any other model: the measuring step is dealt out as two
  half micro-batches; ``g_small`` is the first half's gradient (the norm of ``.grad`` after
  its backward), ``g_big`` the whole step's.  The cost is one extra, smaller
  forward/backward, the second one's accumulation into ``.grad``, and two norms.
  Both are the two-batch estimate of the same step (the hooks' with b_small = B / 4, which
  is cheaper and less noisy than a half: see :class:`SmallBatchGradNorm`).
  The previous-gradient copy of the reference design (a full extra gradient buffer written
  every step, and a g_small from another step than g_big) is never made.

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

import functools
import math
from collections.abc import Callable, Iterable, Sequence
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


def norms(
    grads: Sequence[torch.Tensor], preconditioners: Iterable[torch.Tensor | None] | None = None
) -> list[torch.Tensor]:
    """|g_i / p_i| for each gradient, as 0-d float32 tensors on the gradients' device, with
    fused kernels (one ``_foreach_div``, one ``_foreach_norm``) and no host synchronisation."""
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
    return list(torch._foreach_norm(tensors, 2, dtype=torch.float32)) if tensors else []


def squared_norm(
    grads: Sequence[torch.Tensor], preconditioners: Iterable[torch.Tensor | None] | None = None
) -> torch.Tensor:
    """sum_i |g_i / p_i|^2 as a 0-d float32 tensor on the gradients' device (:func:`norms`,
    no host synchronisation)."""
    if not grads:
        return torch.zeros(())
    return torch.stack(norms(grads, preconditioners)).square().sum()


def read_sums(
    plain: Sequence[torch.Tensor], squared: Sequence[torch.Tensor]
) -> tuple[float, float]:
    """(sum_i plain_i, sum_j squared_j^2) of 0-d tensors, read from the device in one copy:
    one synchronisation, two kernels (a stack and the copy), the sums taken on the host
    (``math.fsum``)."""
    values = torch.stack([*(t.float() for t in plain), *squared]).tolist()
    head = len(plain)
    return math.fsum(values[:head]), math.fsum(value * value for value in values[head:])


def _gram_or_product(
    rows_out: torch.Tensor, rows_in: torch.Tensor, with_bias: bool = False
) -> torch.Tensor:
    """|D^T X|_F^2 for D (n x out) and X (n x in), as a 0-d tensor, plus with ``with_bias``
    the bias's |sum_r d_r|^2 = <D D^T, 1 1^T>: through the Gram matrices,
    sum((D D^T) * (X X^T + [1])) (n^2 (in + out) multiply-adds), when n is small enough for
    that to be cheaper than forming D^T X (n in out); otherwise directly.  The bias comes as
    a column of ones on X, and the squared norm as one ``vdot``: three or four calls, a
    kernel launch each on a GPU (a measuring step's hooks are host-bound on small steps)."""
    n, width_out = rows_out.shape
    width_in = rows_in.shape[1]
    if with_bias:  # X with a column of ones: [X 1] [X 1]^T = X X^T + 1, D^T [X 1] = [dW db]
        rows_in = torch.nn.functional.pad(rows_in, (0, 1), value=1.0)
        width_in += 1
    if n * (width_in + width_out) <= width_in * width_out:
        return torch.vdot((rows_out @ rows_out.T).view(-1), (rows_in @ rows_in.T).view(-1))
    product = rows_out.T @ rows_in
    return torch.vdot(product.view(-1), product.view(-1))


#: With hooks, g_small is the gradient of the first 1/SMALL_SHARE of a step's samples.
SMALL_SHARE = 4


def small_rows(rows: int) -> int:
    """|A|: the samples of a step of ``rows`` whose gradient is g_small (at least 1)."""
    return max(rows // SMALL_SHARE, 1)


class SmallBatchGradNorm:
    """|g_A|^2 of the first quarter A of a step's samples, from the whole step's one backward.

    For a linear layer y_r = W x_r + b over rows r (a sample, or a sample's positions for
    sequence inputs) with output gradients delta_r, the gradient of the rows R is
    dW_R = D_R^T X_R, db_R = sum_{r in R} delta_r, and

        |dW_R|_F^2 = sum_{r, s in R} (delta_r . delta_s) (x_r . x_s) = <D_R D_R^T, X_R X_R^T>

    (the Gram matrices cost |R|^2 (in + out) multiply-adds, a small part of the layer's own
    |R| in out when |R| is small; ``_gram_or_product`` takes the cheaper way).  Summed over the
    layers this is the squared norm of the gradient of A's share of the loss: what a separate
    backward over A would give, without that backward, its accumulation into ``.grad``, or
    any copy of the gradients.  Hooks are attached on measuring steps only (a forward hook per
    layer keeps a view of its input's rows and hooks the output's gradient); ordinary steps
    run no hook.

    A is a quarter of the step (``SMALL_SHARE``), not a half: the two-batch estimate is
    unbiased for any |A| < B, and in the noise-dominated regime (|G|^2 << tr(S)/B, isotropic
    noise) the variance of its tr(S), in units of tr(S^2), is 2 (1 + f)^2 + 4 f^3 / (1 - f)
    + 2 f^2 for f = |A| / B: 6.0 for a half, 3.3 for a quarter (a simulation agrees), while
    the Gram matrices cost a quarter as much.

    It applies (:meth:`for_model`) when every trainable parameter is the weight or bias of
    exactly one ``torch.nn.Linear`` and no module mixes samples (batch normalisation); rows
    are the first dimension of each layer's input, which must be the step's sample count (a
    layer called twice, or on other rows, voids the measurement).  The first use also sums
    over *all* rows and checks that against the norm of ``.grad`` (:meth:`check_total`): a
    weight used outside its layer fails it and the trainer falls back to the split step for
    good.  With an Adam-type preconditioner P the weight's term is |D_R^T X_R / P|_F^2,
    formed directly.
    """

    def __init__(self, layers: list[torch.nn.Linear]) -> None:
        self.layers = layers
        self.usable = True
        self._handles: list[Any] = []
        self._terms: list[torch.Tensor] = []
        self._all_terms: list[torch.Tensor] = []
        self._called: set[int] = set()
        self._valid = True
        self._rows = 0
        self._small = 0
        self._checking = True
        self._pre: dict[int, torch.Tensor | None] = {}

    @classmethod
    def for_model(cls, module: torch.nn.Module) -> SmallBatchGradNorm | None:
        """The estimator for ``module``, or ``None`` where it does not apply."""
        layers: list[torch.nn.Linear] = []
        owned: set[int] = set()
        for sub in module.modules():
            if isinstance(sub, torch.nn.modules.batchnorm._BatchNorm):
                return None
            if isinstance(sub, torch.nn.Linear):
                mine = [p for p in (sub.weight, sub.bias) if p is not None]
                if any(id(p) in owned for p in mine):
                    return None  # a parameter shared by two layers
                owned.update(id(p) for p in mine)
                layers.append(sub)
        trainable = [p for p in module.parameters() if p.requires_grad]
        if not layers or any(id(p) not in owned for p in trainable):
            return None
        return cls(layers)

    @property
    def armed(self) -> bool:
        return bool(self._handles)

    @property
    def checking(self) -> bool:
        """Whether the next result is checked against |.grad|^2 (the first use)."""
        return self._checking

    def arm(
        self, rows: int, preconditioner: Callable[[torch.Tensor], torch.Tensor | None] | None
    ) -> None:
        """Hook the layers for the next forward/backward of ``rows`` samples; A is the first
        ``small_rows(rows)`` of them."""
        self.disarm()
        self._rows, self._small = rows, small_rows(rows)
        self._terms, self._all_terms = [], []
        self._called.clear()
        self._valid = rows >= 2
        self._pre = {}
        if preconditioner is not None:
            for layer in self.layers:
                for p in (layer.weight, layer.bias):
                    if p is not None:
                        self._pre[id(p)] = preconditioner(p)
        self._handles = [layer.register_forward_hook(self._forward_hook) for layer in self.layers]

    def disarm(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def result(self) -> tuple[list[torch.Tensor], int] | None:
        """(the layers' terms of |g_A|^2, as the backward left them; |A|), or ``None`` when
        the step broke an assumption (a layer called twice, rows that are not the samples).
        The gradients are of the loss as back-propagated (mean over all ``rows``, times any
        loss weight): the caller rescales."""
        self.disarm()
        if not self._valid or not self._terms:
            return None
        return list(self._terms), self._small

    def check_total(self, grad_sq: float) -> bool:
        """The first use: does the sum over all rows match |.grad|^2 (``grad_sq``, the same
        scale)?  If not, this estimator is not used again."""
        self._checking = False
        total = float(torch.stack(self._all_terms).sum()) if self._all_terms else math.nan
        self.usable = math.isclose(total, grad_sq, rel_tol=1e-3, abs_tol=1e-12)
        return self.usable

    def _forward_hook(self, layer: torch.nn.Module, inputs: Any, output: Any) -> None:
        if id(layer) in self._called:
            self._valid = False  # a layer used twice in one step: cross terms are missed
            return
        self._called.add(id(layer))
        if not isinstance(output, torch.Tensor) or not output.requires_grad:
            return
        x = inputs[0]
        if x.dim() < 2 or x.shape[0] != self._rows:
            self._valid = False
            return
        assert isinstance(layer, torch.nn.Linear)
        hook = functools.partial(self._backward_hook, layer, x.detach())
        output.register_hook(hook)  # type: ignore[no-untyped-call]

    def _backward_hook(self, layer: torch.nn.Linear, x: torch.Tensor, grad: torch.Tensor) -> None:
        self._add_terms(layer, x, grad, self._small, self._terms)
        if self._checking:
            self._add_terms(layer, x, grad, self._rows, self._all_terms)

    def _add_terms(
        self,
        layer: torch.nn.Linear,
        x: torch.Tensor,
        grad: torch.Tensor,
        rows: int,
        into: list[torch.Tensor],
    ) -> None:
        """Append the rows' |dW|^2 and |db|^2 (each over its preconditioner) to ``into``."""
        d, xs = grad[:rows], x[:rows]
        if d.dim() != 2:  # sequence inputs: each of a sample's positions is a row
            d, xs = d.reshape(-1, d.shape[-1]), xs.reshape(-1, xs.shape[-1])
        if d.dtype != torch.float32:
            d = d.float()
        if xs.dtype != torch.float32:
            xs = xs.float()
        bias = layer.bias is not None and layer.bias.requires_grad
        if layer.weight.requires_grad:
            pre = self._pre.get(id(layer.weight))
            if pre is None:
                # an unscaled bias rides on the weight's Gram matrices (fewer kernels)
                joint = bias and self._pre.get(id(layer.bias)) is None
                into.append(_gram_or_product(d, xs, with_bias=joint))
                if joint:
                    return
            else:
                into.append(((d.T @ xs) / pre).square().sum())
        if bias:
            assert layer.bias is not None
            summed = d.sum(0)
            pre_b = self._pre.get(id(layer.bias))
            into.append((summed if pre_b is None else summed / pre_b).square().sum())
