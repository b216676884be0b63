"""The outbox of job ends: written with the end itself, announced once (``notify``)."""

from __future__ import annotations

from pollux_local.api.states import (
    JobState,
)
from pollux_local.daemon.state.history import History
from pollux_local.daemon.state.records import JobEnd


class Outbox(History):
    """Job ends waiting to be announced."""

    def pending_ends(self, limit: int = 100) -> list[JobEnd]:
        """Job ends not yet announced, oldest first."""
        rows = self.db.execute(
            "SELECT id, job_id, time, state, reason FROM job_ends WHERE notified = 0"
            " ORDER BY id LIMIT ?",
            (limit,),
        ).fetchall()
        return [
            JobEnd(
                seq=int(row[0]),
                job_id=int(row[1]),
                time=float(row[2]),
                state=JobState(row[3]),
                reason=str(row[4]),
            )
            for row in rows
        ]

    def pending_ends_by_owner(self, per_owner: int) -> dict[int, tuple[int, list[JobEnd]]]:
        """Job ends not yet announced, by the uid of the job's owner: ``(how many are
        pending, the oldest per_owner of them)``, so that one owner's many ends never hide
        another's (the ends of a job no longer stored come under uid -1)."""
        rows = self.db.execute(
            "SELECT id, job_id, time, state, reason, owner_uid, rank, pending FROM ("
            " SELECT e.id, e.job_id, e.time, e.state, e.reason,"
            "  COALESCE(j.owner_uid, -1) AS owner_uid,"
            "  ROW_NUMBER() OVER (PARTITION BY COALESCE(j.owner_uid, -1) ORDER BY e.id) AS rank,"
            "  COUNT(*) OVER (PARTITION BY COALESCE(j.owner_uid, -1)) AS pending"
            " FROM job_ends e LEFT JOIN jobs j ON j.id = e.job_id WHERE e.notified = 0"
            ") WHERE rank <= ? ORDER BY id",
            (per_owner,),
        ).fetchall()
        by_owner: dict[int, tuple[int, list[JobEnd]]] = {}
        for row in rows:
            end = JobEnd(
                seq=int(row[0]),
                job_id=int(row[1]),
                time=float(row[2]),
                state=JobState(row[3]),
                reason=str(row[4]),
            )
            by_owner.setdefault(int(row[5]), (int(row[7]), []))[1].append(end)
        return by_owner

    def drop_oldest_ends(self, owner_uid: int, keep: int) -> int:
        """Mark announced (never to be sent) the pending ends of ``owner_uid``'s jobs but the
        newest ``keep``; how many."""
        cursor = self.db.execute(
            "UPDATE job_ends SET notified = 1 WHERE id IN ("
            " SELECT e.id FROM job_ends e JOIN jobs j ON j.id = e.job_id"
            " WHERE e.notified = 0 AND j.owner_uid = ? ORDER BY e.id DESC LIMIT -1 OFFSET ?)",
            (owner_uid, keep),
        )
        return int(cursor.rowcount)

    def mark_announced(self, *seqs: int) -> None:
        """Mark the ends ``seqs`` announced (500 to a statement)."""
        for start in range(0, len(seqs), 500):
            chunk = seqs[start : start + 500]
            self.db.execute(
                f"UPDATE job_ends SET notified = 1 WHERE id IN ({','.join('?' * len(chunk))})",
                chunk,
            )
