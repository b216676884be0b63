"""The one batch-split rule, ``core.types.split_batches`` / ``split_batch``, and its reverse."""

from __future__ import annotations

import math

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from pollux_local.core import BatchBounds, GoodputModel, GradStats, ThroughputParams
from pollux_local.core.types import BatchChoice, split_batch, split_batches

PARAMS = ThroughputParams(
    alpha_c=0.02, beta_c=0.0007, alpha_r=0.08, beta_r=0.01, alpha_n=0.15, beta_n=0.02, gamma=2.0
)


@st.composite
def bounds_strategy(draw: st.DrawFn) -> BatchBounds:
    base = draw(st.integers(1, 512))
    max_batch = base * draw(st.integers(1, 128)) + draw(st.integers(0, 31))
    min_local = draw(st.integers(1, 64))
    max_local = draw(st.none() | st.integers(min_local, 4096))
    return BatchBounds(base, max_batch, min_local, max_local, draw(st.booleans()))


def _reference(total: int, k: int, b: BatchBounds) -> tuple[int, int]:
    """The rule of the docstring, written out with integers."""
    total = min(total, b.max_batch)
    m_max = b.max_local or b.max_batch
    s = max(1, -(-total // (k * m_max))) if b.accumulation else 1
    m = -(-total // (k * s))
    if k * m * s > b.max_batch:
        m = b.max_batch // (k * s)
    return min(max(m, b.min_local), m_max), s


@settings(max_examples=300, deadline=None)
@given(b=bounds_strategy(), k=st.integers(1, 256), data=st.data())
def test_split_is_the_stated_rule_and_keeps_the_bounds(b: BatchBounds, k: int, data) -> None:
    total = data.draw(st.integers(1, 2 * b.max_batch))
    choice = split_batch(total, k, b)
    assert (choice.local_batch, choice.accum_steps) == _reference(total, k, b)
    assert choice.replicas == k
    if k * b.min_local <= total <= b.max_batch and b.min_local <= b.largest_local:
        assert b.min_local <= choice.local_batch <= b.largest_local
        # M_max holds unless m_min per replica cannot be met at the steps m_max requires
        s = choice.accum_steps
        assert choice.total_batch <= b.max_batch or b.max_batch // (k * s) < b.min_local
        if b.accumulation:  # the fewest steps that keep m <= m_max
            assert choice.accum_steps == max(1, math.ceil(total / (k * b.largest_local)))
        else:
            assert choice.accum_steps == 1


@settings(max_examples=100, deadline=None)
@given(b=bounds_strategy())
def test_candidates_are_split_by_the_rule(b: BatchBounds) -> None:
    """The goodput model's candidates (its totals split by the rule) keep the rule's bounds."""
    model = GoodputModel(PARAMS, GradStats(sqr=1.0, var=2.0), b)
    k = np.arange(1, 65)
    local, steps, feasible = model.candidates(k)
    for row in np.flatnonzero(feasible)[:8]:
        kk = int(k[row])
        for m, s in zip(local[row], steps[row], strict=True):
            assert b.min_local <= m <= b.largest_local
            assert kk * m * s <= b.max_batch or b.max_batch // (kk * s) < b.min_local


def test_vectorised_and_scalar_agree_and_broadcast() -> None:
    b = BatchBounds(base_batch=128, max_batch=4096, min_local=32, max_local=1024)
    totals = np.array([[128.0, 2048.0, 4096.0, 5000.0]])
    k = np.array([[1], [3], [6]])
    local, steps = split_batches(totals, k, b)
    assert local.shape == steps.shape == (3, 4)
    for i, kk in enumerate(k[:, 0]):
        for j, total in enumerate(totals[0]):
            choice = split_batch(float(total), int(kk), b)
            assert (choice.local_batch, choice.accum_steps) == (local[i, j], steps[i, j])
    assert split_batch(2048, 1, b) == BatchChoice(1024, 2, 1)
    assert split_batch(2048, 6, b) == BatchChoice(342, 1, 6)
    # ceil(4096 / 6) = 683 would make K * m * s = 4098 > M_max: m = floor(4096 / 6)
    assert split_batch(4096, 3, b) == BatchChoice(682, 2, 3)
    assert split_batch(9000, 3, b) == split_batch(4096, 3, b)  # M above M_max counts as M_max


def test_total_batch_is_the_reverse() -> None:
    assert BatchChoice(local_batch=64, accum_steps=3, replicas=4).total_batch == 768
    b = BatchBounds(base_batch=64, max_batch=1024, min_local=8, max_local=64)
    assert split_batch(768, 4, b) == BatchChoice(64, 3, 4)
