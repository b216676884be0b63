"""Counting what a test's state store loads."""

from __future__ import annotations

from typing import Any

from pollux_local.daemon.state import StateStore


def count_job_loads(store: StateStore) -> list[int]:
    """Each id ``store.get_job`` (a whole job, its environment included) is asked for from now
    on, in order."""
    loads: list[int] = []
    real_get = store.get_job

    def get_job(job_id: int) -> Any:
        loads.append(job_id)
        return real_get(job_id)

    store.get_job = get_job  # type: ignore[method-assign]
    return loads
