"""Shared fixtures of the TUI tests: a real daemon's recorded replies and an app factory."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ["TZ"] = "UTC"  # decision times are shown in local time: keep snapshots stable
time.tzset()

from pollux_local.tui.app import PolluxApp  # noqa: E402
from pollux_local.tui.recording import Recording, load_recording  # noqa: E402
from pollux_local.tui.source import FixedSource  # noqa: E402

#: The replies of a real daemon (``record_replies.py`` makes it).
FIXTURE = Path(__file__).resolve().parent / "fixtures" / "daemon_replies.json"
#: "Now" for the tests: the recording's times are shifted so that it was taken then.
FIXED_NOW = 1_732_323_000.0


@pytest.fixture(scope="session")
def recording() -> Recording:
    return load_recording(FIXTURE)


@pytest.fixture
def source(recording: Recording) -> FixedSource:
    return FixedSource(recording, now=FIXED_NOW)


@pytest.fixture
def make_app() -> Callable[..., PolluxApp]:
    def make(source: Any, **kwargs: Any) -> PolluxApp:
        kwargs.setdefault("clock", lambda: FIXED_NOW)
        kwargs.setdefault("workdir", "/work/lab")
        return PolluxApp(source, **kwargs)

    return make
