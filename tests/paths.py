"""Where things are, for every test wherever its folder: the repository and shared fixtures."""

from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
#: The elastic job the TUI recordings, device-type and first-day tests train (a paced goodput job).
STEADY_JOB = REPO_ROOT / "tests" / "tui" / "fixtures" / "steady_job"


def job_checkpoint_dir(root: Path, state_dir: Path, job_id: str, timeout_s: float = 60.0) -> Path:
    """Where a daemon with ``checkpoint_root = ROOT`` keeps job ``job_id``'s checkpoints
    (``ROOT/<id>-<tag>``, keyed by the daemon's ``checkpoint.key``, which this waits for)."""
    import time

    from pollux_local.daemon.executor.launchspec import CHECKPOINT_KEY, checkpoint_name

    key_file = state_dir / CHECKPOINT_KEY
    deadline = time.monotonic() + timeout_s
    while not key_file.exists():
        if time.monotonic() > deadline:
            raise AssertionError(f"no {key_file} after {timeout_s:g} s")
        time.sleep(0.1)
    return root / checkpoint_name(job_id, key_file.read_bytes())
