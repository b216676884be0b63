"""Shared fixtures of the TUI tests: canned cluster data and an app factory."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ["TZ"] = "UTC"  # decision times are shown in local time: keep snapshots stable
time.tzset()

from pollux_local.tui.app import PolluxApp  # noqa: E402
from pollux_local.tui.source import FixedSource, demo_data  # noqa: E402

FIXED_NOW = 1_732_323_000.0


@pytest.fixture
def source() -> FixedSource:
    return FixedSource(demo_data(n_jobs=12, n_nodes=3, devices_per_node=4, seed=0))


@pytest.fixture
def make_app() -> Callable[..., PolluxApp]:
    def make(source: Any, **kwargs: Any) -> PolluxApp:
        kwargs.setdefault("clock", lambda: FIXED_NOW)
        kwargs.setdefault("workdir", "/work/lab")
        return PolluxApp(source, **kwargs)

    return make
