"""``daemon.pacing.UserPacer``: one call in flight per user, at most N a minute."""

from __future__ import annotations

import pytest

from pollux_local.api.errors import LimitExceeded
from pollux_local.daemon.pacing import UserPacer


def test_one_call_in_flight_per_user_and_a_budget_per_minute() -> None:
    now = [1000.0]
    pacer = UserPacer("estimate", 3, lambda: now[0], unlimited=frozenset({0}))
    with pacer.slot(1000):
        with pytest.raises(LimitExceeded, match="one at a time per user"), pacer.slot(1000):
            pass
        with pacer.slot(1001):  # another user is not held up
            pass
    for _ in range(2):
        with pacer.slot(1000):
            now[0] += 1.0
    full = r"at most 3 a minute per user; try again in 58 s"
    with pytest.raises(LimitExceeded, match=full), pacer.slot(1000):
        pass
    now[0] += 58.0  # the first call leaves the window
    with pacer.slot(1000):
        pass
    for _ in range(10):  # root is not paced
        with pacer.slot(0):
            pass
