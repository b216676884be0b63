"""The batch configuration (m, s) of a job: its bounds, its first choice and its re-choice.

A configuration is the local micro-batch m and the accumulation steps s, so that on K
replicas the total batch is M = K * m * s.  The first choice is the scheduler's (when the
launcher passes ``POLLUX_LOCAL_BATCH``/``POLLUX_ACCUM_STEPS``) or the smallest one that reaches
the base batch M0.  At epoch boundaries rank 0 re-chooses with the goodput model fitted to the
job's own timings,

    (m*, s*) = argmax_{m, s} goodput(N, K, m, s) = throughput(N, K, m, s) * E(K m s),

and the replicas take (m*, s*) only if it is predicted ``ADAPT_MIN_GAIN`` better than the
current configuration.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Any

import torch

from pollux_local.core.types import BatchBounds, BatchChoice, GradStats
from pollux_local.errors import PolluxError
from pollux_local.torch.collectives import broadcast_pair

log = logging.getLogger("pollux_local.torch")

#: A change of (m, s) at an epoch boundary is taken only above this predicted goodput gain.
ADAPT_MIN_GAIN = 1.05


def validated_bounds(
    base_batch: int,
    max_batch: int | None,
    min_local: int,
    max_local: int | None,
    accumulation: bool,
    replicas: int,
) -> BatchBounds:
    """The job's batch bounds (``PolluxError`` naming the first bad value); ``max_batch``
    defaults to ``base_batch``, and K * min_local <= max_batch must hold on K replicas."""
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


def max_local(bounds: BatchBounds) -> int:
    """The largest micro-batch: ``max_local``, else ``max_batch``."""
    return int(bounds.max_local or bounds.max_batch)


def initial_choice(
    bounds: BatchBounds, replicas: int, local_batch: int | None, accum_steps: int | None
) -> tuple[int, int]:
    """(m, s) to start with on K = ``replicas``.

    The scheduler's ``local_batch``/``accum_steps`` when given (checked against the bounds:
    ``PolluxError``); otherwise, with M = max(M0, K * min_local),
    s = ceil(max(M // K, min_local) / max_local) (1 without accumulation) and
    m = min(max(M // (K s), min_local), max_local).
    """
    k = replicas
    largest = max_local(bounds)
    if local_batch is not None:
        m, s = local_batch, accum_steps or 1
        if not bounds.min_local <= m <= largest:
            raise PolluxError(
                f"POLLUX_LOCAL_BATCH={m} is outside the job's local batch bounds "
                f"[{bounds.min_local}, {largest}]"
            )
        if s > 1 and not bounds.accumulation:
            raise PolluxError(f"POLLUX_ACCUM_STEPS={s} but the job disables accumulation")
        if k * m * s > bounds.max_batch:
            raise PolluxError(
                f"{k} replicas x local batch {m} x {s} steps exceeds max_batch {bounds.max_batch}"
            )
        return m, s
    target = max(bounds.base_batch, k * bounds.min_local)
    per_replica = max(target // k, bounds.min_local)
    steps = math.ceil(per_replica / largest) if bounds.accumulation else 1
    m = min(max(target // (k * steps), bounds.min_local), largest)
    return m, steps


def best_choice(
    rows: Sequence[dict[str, Any]],
    stats: GradStats | None,
    bounds: BatchBounds,
    nodes: int,
    replicas: int,
    current: tuple[int, int],
) -> BatchChoice | None:
    """The goodput-optimal (m*, s*) on (N, K) = (``nodes``, ``replicas``) when it beats the
    ``current`` (m, s) by more than ``ADAPT_MIN_GAIN``; ``None`` otherwise, and while there
    are no statistics or timings, or the timings cannot be fitted.

    The throughput model is fitted to the job's profile ``rows`` (report rows) through
    ``core.fitting.fit_points``, with its measured correction.
    """
    if stats is None or not rows:
        return None
    # imported here: the fit needs scipy, which a job that never adapts does not load
    from pollux_local.core.fitting import fit_points, points_from_rows
    from pollux_local.core.goodput import GoodputModel

    try:
        fitted = fit_points(points_from_rows(rows))
    except ValueError as exc:
        log.warning("cannot fit the throughput model: %s", exc)
        return None
    model = GoodputModel(fitted.params, stats, bounds, fitted.correction)
    best = model.best_choice(nodes, replicas)
    now = float(model.goodput(nodes, replicas, current[0], current[1]))
    proposed = float(model.goodput(nodes, replicas, best.local_batch, best.accum_steps))
    if proposed > ADAPT_MIN_GAIN * now:
        return best
    return None


def agreed_choice(
    proposal: BatchChoice | None,
    current: tuple[int, int],
    replicas: int,
    device: torch.device,
) -> tuple[int, int] | None:
    """Rank 0's ``proposal`` on every replica (the others pass ``None``); ``None`` when the
    configuration stays ``current``."""
    m, s = (proposal.local_batch, proposal.accum_steps) if proposal else (current[0], 0)
    if replicas > 1:
        m, s = broadcast_pair(m, s, device)
    if s > 0 and (m, s) != current:
        return m, s
    return None
