"""Shared fixtures: where the artifact data lives (read in place, never copied)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
ARTIFACT_DIR = Path(
    os.environ.get("POLLUX_ARTIFACT_DIR", REPO_ROOT.parent / "shared" / "data" / "pollux-artifact")
)


@pytest.fixture(scope="session")
def artifact_dir() -> Path:
    if not (ARTIFACT_DIR / "models").is_dir():
        pytest.skip(f"artifact data not found at {ARTIFACT_DIR}")
    return ARTIFACT_DIR
