"""Where things are, for every test wherever its folder: the repository and shared fixtures."""

from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
#: The elastic job the TUI recordings, device-type and first-day tests train (a paced goodput job).
STEADY_JOB = REPO_ROOT / "tests" / "tui" / "fixtures" / "steady_job"
