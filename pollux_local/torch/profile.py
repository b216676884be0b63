"""Timings of micro-batches per configuration (nodes, replicas, local batch).

``compute_s`` is the mean time of a micro-batch that does not synchronise (forward + backward),
``step_s`` the mean time of one that does (its compute plus the all-reduce, overlapped).  With
one replica nothing synchronises and both are the same measurement.  With several replicas and
no accumulation there is no non-synchronising micro-batch; its compute time is then taken as
the time until the last gradient bucket was ready (the backward pass is done; only
communication remains).  These are the observations ``core.throughput.fit_throughput`` takes.
"""

from __future__ import annotations

from typing import Any

Key = tuple[int, int, int]


class ProfileRecorder:
    """Running sums of micro-batch times, keyed by (nodes, replicas, local_batch)."""

    def __init__(self) -> None:
        self._data: dict[Key, list[float]] = {}

    def _entry(self, key: Key) -> list[float]:
        return self._data.setdefault(key, [0.0, 0.0, 0.0, 0.0])

    def add_compute(self, key: Key, seconds: float) -> None:
        if seconds > 0:
            entry = self._entry(key)
            entry[0] += seconds
            entry[1] += 1

    def add_step(self, key: Key, seconds: float) -> None:
        if seconds > 0:
            entry = self._entry(key)
            entry[2] += seconds
            entry[3] += 1

    def observations(self) -> list[dict[str, Any]]:
        """Rows of the report's ``profile`` list (configurations with both kinds of timing)."""
        rows = []
        for (nodes, replicas, local), (c_sum, c_n, s_sum, s_n) in sorted(self._data.items()):
            if c_n == 0 or s_n == 0:
                continue
            rows.append(
                {
                    "nodes": nodes,
                    "replicas": replicas,
                    "local_batch": local,
                    "compute_s": c_sum / c_n,
                    "step_s": max(s_sum / s_n, c_sum / c_n),
                    "count": int(s_n),
                }
            )
        return rows

    def state_dict(self) -> dict[str, Any]:
        return {"entries": [[list(k), list(v)] for k, v in self._data.items()]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._data = {}
        for key, values in state.get("entries", []):
            k = (int(key[0]), int(key[1]), int(key[2]))
            self._data[k] = [float(v) for v in values]
