"""The decision log, the per-job history of goodput and noise scale, accounting rows and
the devices withheld at run time."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from pollux_local.api.states import (
    DecisionKind,
    JobState,
)
from pollux_local.daemon.state.blobs import Blobs
from pollux_local.daemon.state.records import COLUMNS_WITHOUT_ENV, JobRecord
from pollux_local.daemon.state.schema import DECISIONS_LIMIT, HISTORY_LIMIT


class History(Blobs):
    """Decisions, history samples, usage rows, withheld devices."""

    # --- devices withheld at run time ---------------------------------------------------------

    def withheld(self) -> list[str]:
        """Nodes and devices drained at run time (``node`` or ``node:device``)."""
        rows = self.db.execute("SELECT target FROM withheld ORDER BY target").fetchall()
        return [str(row[0]) for row in rows]

    def set_withheld(self, target: str, withheld: bool, now: float) -> None:
        if withheld:
            self.db.execute(
                "INSERT OR IGNORE INTO withheld (target, time) VALUES (?, ?)", (target, now)
            )
        else:
            self.db.execute("DELETE FROM withheld WHERE target = ?", (target,))

    # --- accounting -------------------------------------------------------------------------

    def usage_rows(
        self,
        since: float | None,
        user: str | None,
        after_id: int | None = None,
        limit: int | None = None,
    ) -> list[JobRecord]:
        """The jobs that ran (or are running) and were submitted or ended since ``since``,
        without environments: what ``usage`` counts; in id order, the first ``limit`` (all:
        ``None``) above ``after_id``."""
        where = ["(attained_gpu_s > 0 OR last_start IS NOT NULL OR start_time IS NOT NULL)"]
        args: list[Any] = []
        if since is not None:
            where.append("(end_time IS NULL OR end_time >= ?)")
            args.append(since)
        if user is not None:
            where.append("owner_name = ?")
            args.append(user)
        if after_id is not None:
            where.append("id > ?")
            args.append(after_id)
        rows = self.db.execute(
            f"SELECT {COLUMNS_WITHOUT_ENV} FROM jobs WHERE {' AND '.join(where)} ORDER BY id"
            + (" LIMIT ?" if limit is not None else ""),
            (*args, limit) if limit is not None else args,
        ).fetchall()
        return [self._job(row) for row in rows]

    # --- decision log -------------------------------------------------------------------

    def record_decision(
        self,
        job_id: int,
        time: float,
        kind: DecisionKind,
        reason: str,
        placement: dict[str, list[str]] | None = None,
        batch: dict[str, Any] | None = None,
    ) -> None:
        """One line of a job's decision log (a state change writes its own through
        :meth:`transition`); the job's lines beyond the newest :data:`DECISIONS_LIMIT` go."""
        self.db.execute(
            "INSERT INTO decisions (time, job_id, kind, placement, batch, reason)"
            " VALUES (?, ?, ?, ?, ?, ?)",
            (
                time,
                job_id,
                DecisionKind(kind).value,
                json.dumps(placement or {}),
                json.dumps(batch or {}),
                reason,
            ),
        )
        self.db.execute(
            "DELETE FROM decisions WHERE job_id = ? AND id <= (SELECT id FROM decisions"
            " WHERE job_id = ? ORDER BY id DESC LIMIT 1 OFFSET ?)",
            (job_id, job_id, DECISIONS_LIMIT),
        )

    def decisions(self, job_id: int | None = None, limit: int = 50) -> list[dict[str, Any]]:
        if job_id is None:
            rows = self.db.execute(
                "SELECT * FROM decisions ORDER BY id DESC LIMIT ?", (limit,)
            ).fetchall()
        else:
            rows = self.db.execute(
                "SELECT * FROM decisions WHERE job_id = ? ORDER BY id DESC LIMIT ?",
                (job_id, limit),
            ).fetchall()
        return [
            {
                "time": row["time"],
                "job_id": str(row["job_id"]),
                "kind": row["kind"],
                "placement": json.loads(row["placement"]),
                "batch": json.loads(row["batch"]),
                "reason": row["reason"],
            }
            for row in reversed(rows)
        ]

    # --- per-job history of goodput and noise scale ----------------------------------------

    def add_history(
        self,
        job_id: int,
        time: float,
        goodput: float | None,
        noise_scale: float | None,
        limit: int = HISTORY_LIMIT,
    ) -> None:
        """Append one sample and drop the job's samples beyond the newest ``limit``."""
        self.db.execute(
            "INSERT INTO history (job_id, time, goodput, noise_scale) VALUES (?, ?, ?, ?)",
            (job_id, time, goodput, noise_scale),
        )
        self.db.execute(
            "DELETE FROM history WHERE job_id = ? AND id <= (SELECT id FROM history"
            " WHERE job_id = ? ORDER BY id DESC LIMIT 1 OFFSET ?)",
            (job_id, job_id, limit),
        )

    def history(self, job_id: int) -> list[dict[str, float | None]]:
        """The job's samples, oldest first: ``{"time", "goodput", "noise_scale"}``."""
        rows = self.db.execute(
            "SELECT time, goodput, noise_scale FROM history WHERE job_id = ? ORDER BY id",
            (job_id,),
        ).fetchall()
        return [
            {"time": row["time"], "goodput": row["goodput"], "noise_scale": row["noise_scale"]}
            for row in rows
        ]

    def ids_with_state(self, states: Sequence[str]) -> list[int]:
        marks = ",".join("?" * len(states))
        wanted = [JobState(state).value for state in states]
        rows = self.db.execute(f"SELECT id FROM jobs WHERE state IN ({marks})", wanted)
        return [int(row[0]) for row in rows]
