"""Interpolation of the measured profiles against known rows of the artifact's files."""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
import pytest

from pollux_local.core.types import BatchChoice, split_batch
from pollux_local.errors import PolluxError
from pollux_local.sim.profiles import (
    AppProfile,
    load_profiles,
    packed_counts,
    ring_key,
)


def _rows(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as handle:
        return list(csv.DictReader(handle))


@pytest.fixture(scope="module")
def cifar(artifact_dir: Path) -> AppProfile:
    return load_profiles(artifact_dir / "models", {"cifar10"})["cifar10"]


def test_ring_key_is_smallest_rotation_without_empty_nodes() -> None:
    assert ring_key((0, 3, 0, 1)) == (1, 3)
    assert ring_key((2, 3, 1)) == (1, 2, 3)
    assert ring_key((1, 3, 2)) == (1, 3, 2)  # a different ring, not a permutation of it
    assert ring_key((0, 0)) == ()


def test_measured_placement_rows_are_returned_exactly(
    cifar: AppProfile, artifact_dir: Path
) -> None:
    rows = _rows(artifact_dir / "models" / "cifar10" / "placements.csv")
    for row in rows[::97]:
        counts = tuple(int(c) for c in row["placement"])
        step, sync = cifar.step_sync_time(counts, int(row["local_bsz"]))
        assert step == pytest.approx(float(row["step_time"]), rel=1e-12)
        assert sync == pytest.approx(float(row["sync_time"]), rel=1e-12)


def test_rotated_and_spread_placements_use_the_same_ring(cifar: AppProfile) -> None:
    # "13" is measured: 1 device on one node, 3 on another; node order and empty nodes don't matter
    assert cifar.step_sync_time((0, 3, 0, 1), 64) == cifar.step_sync_time((1, 3), 64)


def test_local_batch_is_interpolated_linearly(cifar: AppProfile, artifact_dir: Path) -> None:
    rows = [
        r
        for r in _rows(artifact_dir / "models" / "cifar10" / "placements.csv")
        if r["placement"] == "4"
    ]
    lo, hi = rows[2], rows[3]
    m_lo, m_hi = int(lo["local_bsz"]), int(hi["local_bsz"])
    mid = (m_lo + m_hi) // 2
    w = (mid - m_lo) / (m_hi - m_lo)
    step, sync = cifar.step_sync_time((4,), mid)
    assert step == pytest.approx((1 - w) * float(lo["step_time"]) + w * float(hi["step_time"]))
    assert sync == pytest.approx((1 - w) * float(lo["sync_time"]) + w * float(hi["sync_time"]))


def test_unmeasured_placement_hits_scalability_rows(cifar: AppProfile, artifact_dir: Path) -> None:
    rows = _rows(artifact_dir / "models" / "cifar10" / "scalability.csv")
    row = next(r for r in rows if r["num_nodes"] == "8" and r["num_replicas"] == "16")
    step, sync = cifar.step_sync_time((2,) * 8, int(row["local_bsz"]))
    assert step == pytest.approx(float(row["step_time"]), rel=1e-6)
    assert sync == pytest.approx(float(row["sync_time"]), rel=1e-6)


def test_unmeasured_placement_between_points_is_finite_and_positive(cifar: AppProfile) -> None:
    step, sync = cifar.step_sync_time((4, 4, 4, 4, 4, 4, 4, 3), 100)
    assert np.isfinite([step, sync]).all()
    assert step > sync > 0


def test_grad_stats_at_validated_batch_and_between(cifar: AppProfile, artifact_dir: Path) -> None:
    v256 = _rows(artifact_dir / "models" / "cifar10" / "validation-256.csv")
    v512 = _rows(artifact_dir / "models" / "cifar10" / "validation-512.csv")
    epoch = 7
    assert cifar.grad_stats(256, epoch) == pytest.approx(
        (float(v256[epoch]["grad_sqr"]), float(v256[epoch]["grad_var"]))
    )
    sqr, var = cifar.grad_stats(320, epoch)  # a quarter of the way from 256 to 512
    assert sqr == pytest.approx(
        0.75 * float(v256[epoch]["grad_sqr"]) + 0.25 * float(v512[epoch]["grad_sqr"])
    )
    assert var == pytest.approx(
        0.75 * float(v256[epoch]["grad_var"]) + 0.25 * float(v512[epoch]["grad_var"])
    )
    # outside the validated range: clamped to the nearest file
    assert cifar.grad_stats(64, epoch) == cifar.grad_stats(128, epoch)


def test_gain_is_one_at_base_batch_and_at_most_linear(cifar: AppProfile) -> None:
    assert cifar.gain(cifar.base_batch, 3) == pytest.approx(1.0)
    for batch in (256, 1024, 4096):
        gain = cifar.gain(batch, 3)
        assert 1.0 <= gain <= batch / cifar.base_batch


def test_epoch_targets_are_the_smallest_progress_over_files(
    cifar: AppProfile, artifact_dir: Path
) -> None:
    folder = artifact_dir / "models" / "cifar10"
    tables = [_rows(p) for p in sorted(folder.glob("validation-*.csv"))]
    for epoch in (1, 2, 50, 100):
        expected = min(float(t[epoch - 1]["progress"]) for t in tables)
        assert cifar.epoch_target[epoch] == pytest.approx(expected)
    assert cifar.epoch_target[0] == 0.0
    assert cifar.epochs == 100


def test_application_constants(artifact_dir: Path) -> None:
    profiles = load_profiles(artifact_dir / "models")
    got = {
        name: (p.base_batch, p.max_batch, p.min_local, p.max_local, p.epochs)
        for name, p in profiles.items()
    }
    assert got["bert"] == (12, 384, 4, 12, 2)
    assert got["cifar10"] == (128, 4096, 32, 1024, 100)
    assert got["yolov3"] == (8, 512, 4, 8, 50)
    assert got["ncf"][:2] == (256, 32768)
    assert profiles["ncf"].fixed_batch == 32768


def test_split_batch_respects_bounds(cifar: AppProfile) -> None:
    bounds = cifar.bounds
    assert split_batch(2048, 1, bounds) == BatchChoice(1024, 2, 1)
    assert split_batch(2048, 6, bounds) == BatchChoice(342, 1, 6)
    choice = split_batch(4096, 3, bounds)
    assert choice.local_batch <= 1024 and choice.total_batch <= 4096
    assert packed_counts(10, 4) == (4, 4, 2)
    assert packed_counts(8, 4) == (4, 4)


def test_missing_folder_and_unknown_application(tmp_path: Path, artifact_dir: Path) -> None:
    with pytest.raises(PolluxError, match="models folder not found"):
        load_profiles(tmp_path / "nope")
    with pytest.raises(PolluxError, match="unknown application.*resnet"):
        load_profiles(artifact_dir / "models", {"resnet"})
