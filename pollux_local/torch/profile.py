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
#: A key with the device type the time was measured on ("" when untyped).
TypedKey = tuple[str, int, int, int]


class ProfileRecorder:
    """Running sums of micro-batch times, keyed by (device type, nodes, replicas,
    local_batch); ``device_type`` is the type the next times are measured on."""

    def __init__(self, device_type: str | None = None) -> None:
        self._data: dict[TypedKey, list[float]] = {}
        self.device_type = device_type or ""

    def _entry(self, key: Key) -> list[float]:
        return self._data.setdefault((self.device_type, *key), [0.0, 0.0, 0.0, 0.0])

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

    def observations(self, device_type: str | None = None) -> list[dict[str, Any]]:
        """Rows of the report's ``profile`` list (configurations with both kinds of timing);
        with ``device_type``, only those measured on that type."""
        rows = []
        for (kind, nodes, replicas, local), (c_sum, c_n, s_sum, s_n) in sorted(self._data.items()):
            if c_n == 0 or s_n == 0 or (device_type is not None and kind != device_type):
                continue
            row: dict[str, Any] = {
                "nodes": nodes,
                "replicas": replicas,
                "local_batch": local,
                "compute_s": c_sum / c_n,
                "step_s": max(s_sum / s_n, c_sum / c_n),
                "count": int(s_n),
            }
            if kind:
                row["device_type"] = kind
            rows.append(row)
        return rows

    def state_dict(self) -> dict[str, Any]:
        return {"entries": [[list(k), list(v)] for k, v in self._data.items()]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._data = {}
        for key, values in state.get("entries", []):
            # entries saved before types were recorded have no type
            typed = key if len(key) == 4 else ["", *key]
            k = (str(typed[0]), int(typed[1]), int(typed[2]), int(typed[3]))
            self._data[k] = [float(v) for v in values]
