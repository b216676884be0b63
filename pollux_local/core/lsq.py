"""Bounded nonlinear least squares for small problems: a projected Levenberg-Marquardt.

Minimises C(x) = 1/2 ||r(x)||^2 subject to lower <= x <= upper, for the handful of parameters
of a throughput model.  Each iteration solves, over the variables not held at a bound,

    (J^T J + lambda * D) d = -J^T r,      D = diag(J^T J)  (Marquardt's scaling)

and clips x + d into the box.  A variable at a bound whose gradient points out of the box is
held there for the iteration (the active set), and so is one the residuals do not change with
at x (a zero column of J).  lambda follows the gain ratio
rho = (C(x) - C(x + d)) / (C(x) - 1/2 ||r + J d||^2): a step is taken when rho > 0 and lambda
shrinks by max(1/3, 1 - (2 rho - 1)^3), otherwise it grows by a factor that doubles with each
refusal (Nielsen's rule).  It stops when a step the linear model predicted well (rho > 1/4)
lowers the cost by less than ``ftol`` of it, when the step is shorter than ``xtol`` of x, or
when the scaled gradient of the free variables is below ``gtol``.

The answer is not trusted (``trusted`` False) when it did not converge, or when it ends on a
bound with a variable the residuals do not change with (a zero column of J; in the throughput
model, the network terms once the all-reduce time has been driven to 0): the gradient along
it is zero whatever the rest of the problem wants, so a saddle looks like a minimum.
The throughput fit then falls back to a trust-region solver that stays strictly inside the box.

Per iteration it costs one residual and one Jacobian evaluation and a solve of at most 7x7:
for these problems several times faster than a general-purpose trust-region solver.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

FloatArray = NDArray[np.float64]

#: Starting damping, relative to Marquardt's diagonal.
INITIAL_DAMPING = 1e-3
#: Damping beyond which no step is worth trying: the point is a minimum in the box.
MAX_DAMPING = 1e16

# ``ndarray.any`` and ``.all`` pass through a Python wrapper that costs more than these
# 7-entry reductions themselves
_count = np.count_nonzero
_any_row = np.logical_or.reduce


@dataclass(frozen=True)
class LsqResult:
    """Where the solver stopped, its cost 1/2 ||r||^2 there, how many iterations it took, and
    whether the answer can be used (converged, and not on a bound with a flat direction)."""

    x: FloatArray
    cost: float
    iterations: int
    trusted: bool


def solve_bounded(
    residuals: Callable[[FloatArray], FloatArray],
    jacobian: Callable[[FloatArray], FloatArray],
    start: FloatArray,
    lower: FloatArray,
    upper: FloatArray,
    *,
    ftol: float = 1e-8,
    xtol: float = 1e-8,
    gtol: float = 1e-8,
    max_iterations: int = 200,
) -> LsqResult:
    """min 1/2 ||r(x)||^2 over lower <= x <= upper, from ``start`` (clipped into the box)."""
    x = np.clip(np.asarray(start, dtype=float), lower, upper)
    r = residuals(x)
    cost = 0.5 * float(r @ r)
    if not np.isfinite(cost):
        return LsqResult(x, cost, 0, False)
    jac = jacobian(x)
    moves = _any_row(jac != 0.0)  # the variables r depends on here

    def finish(iteration: int, converged: bool) -> LsqResult:
        on_bound = _count((x <= lower) | (x >= upper)) > 0
        flat = _count(moves) < moves.size
        return LsqResult(x, cost, iteration, converged and not (on_bound and flat))

    lam = INITIAL_DAMPING
    growth = 2.0
    for iteration in range(1, max_iterations + 1):
        grad = jac.T @ r
        held = ((x <= lower) & (grad > 0)) | ((x >= upper) & (grad < 0))
        free = ~held & moves  # a variable r ignores here takes no step
        if not _count(free):
            return finish(iteration, True)
        jf = jac[:, free]
        normal = jf.T @ jf
        scale = np.maximum(normal.diagonal(), 1e-300)
        steps = np.arange(scale.size)
        if float((np.abs(grad[free]) / np.sqrt(scale)).max()) <= gtol * math.sqrt(2.0 * cost):
            return finish(iteration, True)
        while True:
            try:
                damped = normal.copy()
                damped[steps, steps] += lam * scale
                step = np.linalg.solve(damped, -grad[free])
            except np.linalg.LinAlgError:
                step = None
            if step is not None:
                candidate = x.copy()
                candidate[free] += step
                candidate = np.minimum(np.maximum(candidate, lower), upper)
                taken = candidate - x
                # |taken| <= xtol (xtol + |x|), the norms as ``np.linalg.norm`` computes them
                tiny = math.sqrt(float(taken @ taken)) <= xtol * (xtol + math.sqrt(float(x @ x)))
                r_new = residuals(candidate)
                cost_new = 0.5 * float(r_new @ r_new)
                linear = r + jac @ taken
                predicted = cost - 0.5 * float(linear @ linear)
                actual = cost - cost_new
                if np.isfinite(cost_new) and actual > 0 and predicted > 0:
                    rho = actual / predicted
                    lam *= max(1.0 / 3.0, 1.0 - (2.0 * rho - 1.0) ** 3)
                    growth = 2.0
                    previous = cost
                    x, r, cost = candidate, r_new, cost_new
                    jac = jacobian(x)
                    moves = _any_row(jac != 0.0)
                    if (actual <= ftol * previous and rho > 0.25) or tiny:
                        return finish(iteration, True)
                    break
                if tiny:  # no step the model trusts lowers the cost: a minimum in the box
                    return finish(iteration, True)
            lam *= growth
            growth *= 2.0
            if lam > MAX_DAMPING:
                return finish(iteration, True)
    return finish(max_iterations, False)
