"""The rows of an application's measured placements, as the throughput fit takes them."""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np


def placement_rows(artifact_dir: Path, app: str) -> tuple[np.ndarray, ...]:
    """(nodes, replicas, local batch, compute s, step s) per row of ``models/APP/placements.csv``;
    compute = step - sync."""
    with (artifact_dir / "models" / app / "placements.csv").open(newline="") as handle:
        rows = list(csv.DictReader(handle))
    nodes = np.array([len(r["placement"]) for r in rows], dtype=float)
    reps = np.array([sum(int(c) for c in r["placement"]) for r in rows], dtype=float)
    local = np.array([float(r["local_bsz"]) for r in rows])
    step = np.array([float(r["step_time"]) for r in rows])
    sync = np.array([float(r["sync_time"]) for r in rows])
    return nodes, reps, local, step - sync, step
