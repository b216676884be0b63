"""Measured model profiles: the "ground truth" a simulated job runs against.

A profile folder (``models/<app>/``) holds ``placements.csv`` (step and sync times per
placement and micro-batch), ``scalability.csv`` (the same over (nodes, replicas, micro-batch)
for larger jobs) and ``validation-<M>.csv`` (per epoch at fixed batch M: cumulative progress,
iterations and the gradient statistics ``grad_sqr``/``grad_var``).

Interpolation rules:

* step/sync time of a placement seen in ``placements.csv`` (placements are rings, so the lookup
  key is the lexicographically smallest rotation of the non-empty node counts): linear in m
  between the measured micro-batches (clamped at the ends);
* a placement that was never measured: piecewise-linear over (nodes, replicas, m) through all
  measured points (per-placement means plus ``scalability.csv``), nodes capped at the largest
  measured, nearest measured point outside their hull;
* gradient statistics at batch M and epoch e: linear in M between the two nearest validated
  batch sizes (M clamped to the validated range), row e;
* epoch e (1-based) ends when progress reaches the smallest row-e progress over all files.

Profiles of several device types (a heterogeneous cluster) sit side by side in one folder as
``placements-<type>.csv`` and ``scalability-<type>.csv``, sharing the validation files
(:func:`load_typed_profiles`).
"""

from __future__ import annotations

import csv
import functools
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np
from scipy.interpolate import LinearNDInterpolator, NearestNDInterpolator

from pollux_local.core.types import BatchBounds
from pollux_local.errors import PolluxError


@dataclass(frozen=True)
class AppDefaults:
    """Facts about an application that its files do not carry."""

    epochs: int | None = None
    max_local: int | None = None
    #: A job of this application always trains at this total batch (and on one device).
    fixed_batch: int | None = None


#: Training lengths of the published applications (epochs to completion) and overrides.
KNOWN_APPS: dict[str, AppDefaults] = {
    "bert": AppDefaults(epochs=2),
    "cifar10": AppDefaults(epochs=100),
    "deepspeech2": AppDefaults(epochs=80),
    "imagenet": AppDefaults(epochs=90),
    "ncf": AppDefaults(epochs=10, fixed_batch=32768),
    "yolov3": AppDefaults(epochs=50, max_local=8),
}


def _read_csv(path: Path, columns: tuple[str, ...]) -> dict[str, np.ndarray]:
    """Read the named numeric columns of a CSV file (strings for ``placement``)."""
    try:
        with path.open(newline="") as handle:
            reader = csv.DictReader(handle)
            missing = [c for c in columns if c not in (reader.fieldnames or [])]
            if missing:
                raise PolluxError(f"{path}: missing column(s) {', '.join(missing)}")
            rows = list(reader)
    except OSError as exc:
        raise PolluxError(f"cannot read {path}: {exc.strerror or exc}") from exc
    if not rows:
        raise PolluxError(f"{path}: no data rows")
    out: dict[str, np.ndarray] = {}
    for col in columns:
        values = [row[col] for row in rows]
        if col == "placement":
            if not all(v.isdigit() for v in values):
                raise PolluxError(f"{path}: a placement is not a string of digits")
            out[col] = np.array(values)
            continue
        try:
            out[col] = np.array([float(v) for v in values])
        except ValueError as exc:
            raise PolluxError(f"{path}: non-numeric value in column {col!r}") from exc
    return out


@functools.lru_cache(maxsize=4096)
def ring_key(counts: tuple[int, ...]) -> tuple[int, ...]:
    """The lexicographically smallest rotation of the non-empty per-node device counts
    (remembered: a simulation asks for the same few placements on every step)."""
    ring = tuple(c for c in counts if c > 0)
    if not ring:
        return ()
    return min(ring[i:] + ring[:i] for i in range(len(ring)))


class AppProfile:
    """One application's measured behaviour, with the interpolations the simulator needs."""

    def __init__(
        self,
        name: str,
        folder: Path,
        defaults: AppDefaults | None = None,
        device_type: str | None = None,
    ) -> None:
        self.name = name
        self.folder = folder
        #: the device type whose ``placements-<type>.csv`` this reads (``None``: untyped files)
        self.device_type = device_type
        suffix = f"-{device_type}" if device_type else ""
        if defaults is None:
            known = KNOWN_APPS.get(name, AppDefaults())
            # typed profiles carry their own memory limits (largest micro-batch measured)
            defaults = (
                AppDefaults(epochs=known.epochs, fixed_batch=known.fixed_batch)
                if device_type
                else known
            )
        placements = _read_csv(
            folder / f"placements{suffix}.csv", ("placement", "local_bsz", "step_time", "sync_time")
        )
        self._scalability = _read_csv(
            folder / f"scalability{suffix}.csv",
            ("num_nodes", "num_replicas", "local_bsz", "step_time", "sync_time"),
        )
        self._by_ring: dict[tuple[int, ...], tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        keys = [tuple(int(ch) for ch in p) for p in placements["placement"]]
        for key in sorted(set(keys)):
            mask = np.array([k == key for k in keys])
            order = np.argsort(placements["local_bsz"][mask], kind="stable")
            self._by_ring[ring_key(key)] = (
                placements["local_bsz"][mask][order],
                placements["step_time"][mask][order],
                placements["sync_time"][mask][order],
            )
        self._placement_rows = (keys, placements)

        files = sorted(folder.glob("validation-*.csv"))
        batches: list[int] = []
        tables: list[dict[str, np.ndarray]] = []
        for path in files:
            try:
                batches.append(int(path.stem.split("-", 1)[1]))
            except ValueError as exc:
                raise PolluxError(f"{path}: cannot read the batch size from the name") from exc
            tables.append(
                _read_csv(path, ("progress", "iteration", "grad_sqr", "grad_var")),
            )
        if not tables:
            raise PolluxError(f"{folder}: no validation-<batch>.csv files")
        order = np.argsort(batches)
        self.validated_batches = np.array(batches, dtype=float)[order]
        rows = min(len(t["progress"]) for t in tables)
        self.epochs = min(defaults.epochs or rows, rows)
        stacked = [tables[i] for i in order]
        self._progress = np.stack([t["progress"][:rows] for t in stacked])
        self._iteration = np.stack([t["iteration"][:rows] for t in stacked])
        self._sqr = np.stack([t["grad_sqr"][:rows] for t in stacked])
        self._var = np.stack([t["grad_var"][:rows] for t in stacked])
        #: ``epoch_target[e]``: progress at which epoch e ends (``epoch_target[0] = 0``).
        self.epoch_target = np.concatenate([[0.0], self._progress.min(axis=0)[: self.epochs]])

        self.base_batch = int(self.validated_batches[0])
        self.max_batch = int(self.validated_batches[-1])
        self.min_local = int(placements["local_bsz"].min())
        self.max_local = int(defaults.max_local or placements["local_bsz"].max())
        self.fixed_batch = defaults.fixed_batch
        self.max_measured_nodes = int(
            max(self._scalability["num_nodes"].max(), max(len(k) for k in keys))
        )
        self._time_cache: dict[tuple[tuple[int, ...], int], tuple[float, float]] = {}
        #: the same answers by the placement and batch as asked (before ``ring_key``)
        self._times_asked: dict[tuple[tuple[int, ...], int], tuple[float, float]] = {}
        self._grad_cache: dict[tuple[int, int], tuple[float, float]] = {}

    def max_local_for(self, counts: tuple[int, ...]) -> int:
        """The largest micro-batch that fits on a placement (memory): the largest measured on
        that placement, else on any larger measured shape (at least as many nodes and
        replicas), else the application's largest."""
        key = ring_key(counts)
        measured = self._by_ring.get(key)
        if measured is not None:
            return int(measured[0].max())
        scal = self._scalability
        wider = (scal["num_nodes"] >= len(key)) & (scal["num_replicas"] >= sum(key))
        if wider.any():
            return int(scal["local_bsz"][wider].max())
        return self.max_local

    def max_local_for_replicas(self, replicas: int) -> int | None:
        """The largest micro-batch measured on any placement of ``replicas`` devices (``None``
        when no placement of that size was measured)."""
        keys, rows = self._placement_rows
        sizes = np.array([sum(k) for k in keys])
        mask = sizes == replicas
        return int(rows["local_bsz"][mask].max()) if mask.any() else None

    @cached_property
    def single_device_rate(self) -> float:
        """Examples/s on one device at the largest measured micro-batch: largest local batch /
        largest step time over the one-device rows (a short single-device profile)."""
        keys, rows = self._placement_rows
        mask = np.array([sum(k) == 1 for k in keys])
        if not mask.any():
            raise PolluxError(f"{self.folder}: no single-device measurement")
        return float(rows["local_bsz"][mask].max() / rows["step_time"][mask].max())

    @property
    def bounds(self) -> BatchBounds:
        """The batch-size contract of a job of this application."""
        return BatchBounds(
            base_batch=self.base_batch,
            max_batch=self.max_batch,
            min_local=self.min_local,
            max_local=self.max_local,
            accumulation=True,
        )

    @cached_property
    def _nd_interpolators(self) -> tuple[LinearNDInterpolator, NearestNDInterpolator]:
        add = np.add.reduce
        keys, rows = self._placement_rows
        groups: dict[tuple[int, int, float], list[int]] = {}
        for i, (key, local) in enumerate(zip(keys, rows["local_bsz"].tolist(), strict=True)):
            groups.setdefault((len(key), sum(key), float(local)), []).append(i)
        points = [list(g) for g in groups]
        step, sync = rows["step_time"], rows["sync_time"]
        # each group's mean as ``np.mean`` computes it (the sum, then / its size)
        values = [
            [float(add(step[idx]) / len(idx)), float(add(sync[idx]) / len(idx))]
            for idx in groups.values()
        ]
        scal = self._scalability
        points += np.column_stack(
            [scal["num_nodes"], scal["num_replicas"], scal["local_bsz"]]
        ).tolist()
        values += np.column_stack([scal["step_time"], scal["sync_time"]]).tolist()
        pts = np.asarray(points, dtype=float)
        vals = np.asarray(values, dtype=float)
        return LinearNDInterpolator(pts, vals), NearestNDInterpolator(pts, vals)

    def step_sync_time(self, counts: tuple[int, ...], local_batch: int) -> tuple[float, float]:
        """True (step time, sync time) in seconds of one synchronising micro-batch step.

        ``counts`` are devices per node (zeros ignored); the compute time of a micro-batch that
        does not synchronise is step - sync.
        """
        asked = (counts, local_batch)
        hit = self._times_asked.get(asked)
        if hit is not None:
            return hit
        key = ring_key(counts)
        if not key:
            raise ValueError("a job with no devices has no step time")
        cache_key = (key, int(local_batch))
        hit = self._time_cache.get(cache_key)
        if hit is not None:
            self._times_asked[asked] = hit
            return hit
        measured = self._by_ring.get(key)
        if measured is not None:
            bsz, step, sync = measured
            result = (
                float(np.interp(local_batch, bsz, step)),
                float(np.interp(local_batch, bsz, sync)),
            )
        else:
            linear, nearest = self._nd_interpolators
            query = np.array([[min(len(key), self.max_measured_nodes), sum(key), local_batch]])
            value = linear(query)[0]
            if not np.all(np.isfinite(value)):
                value = nearest(query)[0]
            result = (float(value[0]), float(value[1]))
        self._time_cache[cache_key] = result
        self._times_asked[asked] = result
        return result

    def iteration_time(self, counts: tuple[int, ...], local_batch: int, accum_steps: int) -> float:
        """Seconds per iteration of s micro-batches: T = (s - 1) * (step - sync) + step."""
        step, sync = self.step_sync_time(counts, local_batch)
        return (accum_steps - 1) * (step - sync) + step

    def _bracket(self, batch: float) -> tuple[int, int, float]:
        """Indices of the validated batches around ``batch`` and the weight of the upper one."""
        vb = self.validated_batches
        batch = min(max(batch, vb[0]), vb[-1])
        hi = int(np.searchsorted(vb, batch, side="left"))
        if vb[hi] == batch:
            return hi, hi, 0.0
        lo = hi - 1
        return lo, hi, float((batch - vb[lo]) / (vb[hi] - vb[lo]))

    def grad_stats(self, batch: int, epoch: int) -> tuple[float, float]:
        """True (sqr, var) while training at total batch M during (0-based) epoch e."""
        cache_key = (int(batch), int(epoch))
        hit = self._grad_cache.get(cache_key)
        if hit is not None:
            return hit
        row = min(epoch, self._sqr.shape[1] - 1)
        lo, hi, w = self._bracket(batch)
        sqr = (1 - w) * self._sqr[lo, row] + w * self._sqr[hi, row]
        var = (1 - w) * self._var[lo, row] + w * self._var[hi, row]
        result = (float(sqr), float(var))
        self._grad_cache[cache_key] = result
        return result

    def gain(self, batch: int, epoch: int) -> float:
        """Progress per iteration at batch M: r = M/M0 * EFF(M) = (var + sqr) / (var/S + sqr)."""
        sqr, var = self.grad_stats(batch, epoch)
        scale = batch / self.base_batch
        return (var + sqr) / (var / scale + sqr)

    def gains(self, batch: int) -> np.ndarray:
        """:meth:`gain` at batch M in each epoch 0..epochs-1, as one array (the same values)."""
        rows = np.minimum(np.arange(self.epochs), self._sqr.shape[1] - 1)
        lo, hi, w = self._bracket(batch)
        sqr = (1 - w) * self._sqr[lo, rows] + w * self._sqr[hi, rows]
        var = (1 - w) * self._var[lo, rows] + w * self._var[hi, rows]
        scale = batch / self.base_batch
        return np.asarray((var + sqr) / (var / scale + sqr), dtype=np.float64)

    def iterations_after(self, batch: int, epochs_done: int) -> float:
        """Iterations a run at fixed batch M has taken after ``epochs_done`` epochs."""
        if epochs_done <= 0:
            return 0.0
        row = min(epochs_done, self._iteration.shape[1]) - 1
        lo, hi, w = self._bracket(batch)
        return float((1 - w) * self._iteration[lo, row] + w * self._iteration[hi, row])


def placement_rows(folder: Path) -> tuple[np.ndarray, ...]:
    """(nodes, replicas, local batch, compute s, step s) per row of ``folder/placements.csv``,
    the observations a throughput fit takes (compute = step - sync)."""
    rows = _read_csv(
        folder / "placements.csv", ("placement", "local_bsz", "step_time", "sync_time")
    )
    nodes = np.array([len(p) for p in rows["placement"]], dtype=float)
    replicas = np.array([sum(int(c) for c in p) for p in rows["placement"]], dtype=float)
    step = rows["step_time"]
    return nodes, replicas, rows["local_bsz"], step - rows["sync_time"], step


def packed_counts(replicas: int, devices_per_node: int) -> tuple[int, ...]:
    """Device counts of K replicas packed onto as few nodes as possible."""
    full, rest = divmod(replicas, devices_per_node)
    return (devices_per_node,) * full + ((rest,) if rest else ())


def load_profiles(models_dir: Path, names: set[str] | None = None) -> dict[str, AppProfile]:
    """Load the profiles in ``models_dir`` (only ``names`` when given)."""
    if not models_dir.is_dir():
        raise PolluxError(f"models folder not found: {models_dir}")
    available = {p.name: p for p in models_dir.iterdir() if (p / "placements.csv").is_file()}
    wanted = set(available) if names is None else names
    unknown = sorted(wanted - set(available))
    if unknown:
        raise PolluxError(
            f"unknown application(s) {', '.join(unknown)}: no profile in {models_dir}"
            f" (known: {', '.join(sorted(available)) or 'none'})"
        )
    return {name: AppProfile(name, available[name]) for name in sorted(wanted)}


def load_typed_profiles(
    models_dir: Path, device_types: Sequence[str], names: set[str]
) -> dict[str, dict[str, AppProfile]]:
    """Each application's profile per device type (``placements-<type>.csv`` and
    ``scalability-<type>.csv`` in ``models_dir/<app>/``): ``{app: {type: profile}}``."""
    if not models_dir.is_dir():
        raise PolluxError(f"models folder not found: {models_dir}")
    profiles: dict[str, dict[str, AppProfile]] = {}
    for name in sorted(names):
        folder = models_dir / name
        if not folder.is_dir():
            raise PolluxError(f"unknown application {name}: no folder {folder}")
        per_type: dict[str, AppProfile] = {}
        for device_type in device_types:
            if not (folder / f"placements-{device_type}.csv").is_file():
                have = sorted(
                    p.name[len("placements-") : -len(".csv")]
                    for p in folder.glob("placements-*.csv")
                )
                raise PolluxError(
                    f"no profile of {name} on device type {device_type!r} in {folder}"
                    f" (types there: {', '.join(have) or 'none'})"
                )
            per_type[device_type] = AppProfile(name, folder, device_type=device_type)
        profiles[name] = per_type
    return profiles
