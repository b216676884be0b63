"""How many ended jobs the state keeps: each user's newest ``[limits] max_ended_per_user``.

Ended jobs were kept for ever, and one user could make about 1,300 a second (held arrays,
cancelled): the database grew by a megabyte a second on root's disk.  Beyond the cap, a
user's oldest ended jobs are removed with their decisions, history samples and announced
ends, and the stored commands and environments no job names any more.  Kept whatever their
age: a job an active job waits for (``--after``), every task of an array that still has an
active task, and a job whose end is not yet announced (notifications).  The daemon then
removes a removed job's directory (``jobfiles.remove_job_dir``, as its owner)."""

from __future__ import annotations

import json

from pollux_local.api.states import ACTIVE_STATES, TERMINAL_STATES
from pollux_local.daemon.state.base import StoreBase

#: The most ended jobs one call removes (a pass's worth of work stays small).
PRUNE_BATCH = 500


class Retention(StoreBase):
    """Removing what is beyond each user's cap of ended jobs."""

    def removed_ids(self, candidates: list[int]) -> list[int]:
        """Those of ``candidates`` that were given to a job whose record is gone: not above
        the highest id ever given (ids are never given twice) and not a job's now."""
        row = self.db.execute("SELECT seq FROM sqlite_sequence WHERE name = 'jobs'").fetchone()
        highest = int(row[0]) if row is not None else 0
        present = {int(job_id) for (job_id,) in self.db.execute("SELECT id FROM jobs")}
        return [i for i in candidates if i <= highest and i not in present]

    def prune_ended(self, keep_per_user: int, batch: int = PRUNE_BATCH) -> list[int]:
        """Remove each user's ended jobs beyond their newest ``keep_per_user`` (by end time),
        at most ``batch`` in all, but none that must stay (the module's docstring); the ids
        removed.  ``keep_per_user`` 0 keeps every job."""
        if keep_per_user <= 0:
            return []
        ended = sorted(state.value for state in TERMINAL_STATES)
        marks = ",".join("?" * len(ended))
        over = self.db.execute(
            f"SELECT owner_uid, COUNT(*) FROM jobs WHERE state IN ({marks})"
            " GROUP BY owner_uid HAVING COUNT(*) > ?",
            (*ended, keep_per_user),
        ).fetchall()
        if not over:
            return []
        waited_for, live_arrays = self._kept_by_active_jobs()
        unannounced = {
            int(job_id)
            for (job_id,) in self.db.execute("SELECT job_id FROM job_ends WHERE notified = 0")
        }
        kept_ids = json.dumps(sorted(waited_for | unannounced))
        kept_arrays = json.dumps(sorted(live_arrays))
        doomed: list[int] = []
        for owner_uid, _count in over:
            room = batch - len(doomed)
            if room <= 0:
                break
            # the owner's ended jobs but the newest ``keep_per_user``, oldest first, less
            # those that must stay (left out by the query: however many an owner makes stay,
            # the ones behind them are still reached)
            rows = self.db.execute(
                "SELECT id FROM (SELECT id, end_time, submit_time,"
                " json_extract(spec, '$.array_id') AS array_id FROM jobs"
                f" WHERE owner_uid = ? AND state IN ({marks})"
                " ORDER BY COALESCE(end_time, submit_time) DESC, id DESC LIMIT -1 OFFSET ?)"
                " WHERE id NOT IN (SELECT value FROM json_each(?))"
                " AND (array_id IS NULL OR CAST(array_id AS TEXT)"
                " NOT IN (SELECT value FROM json_each(?)))"
                " ORDER BY COALESCE(end_time, submit_time), id LIMIT ?",
                (owner_uid, *ended, keep_per_user, kept_ids, kept_arrays, room),
            ).fetchall()
            doomed.extend(int(job_id) for (job_id,) in rows)
        if doomed:
            self._remove_jobs(doomed)
        return doomed

    def _kept_by_active_jobs(self) -> tuple[set[int], set[str]]:
        """The ids active jobs wait for, and the arrays that have an active task."""
        active = sorted(state.value for state in ACTIVE_STATES)
        marks = ",".join("?" * len(active))
        waited_for: set[int] = set()
        arrays: set[str] = set()
        for array_id, job_id in self.db.execute(
            f"SELECT json_extract(spec, '$.array_id'), value FROM jobs"
            " LEFT JOIN json_each(jobs.spec, '$.after')"
            f" WHERE state IN ({marks})",
            active,
        ):
            if array_id is not None:
                arrays.add(str(array_id))
            if job_id is not None:
                try:
                    waited_for.add(int(job_id))
                except (TypeError, ValueError):
                    continue
        return waited_for, arrays

    def _remove_jobs(self, ids: list[int]) -> None:
        """Delete the jobs ``ids`` and what belongs to them only, in one transaction."""
        marks = ",".join("?" * len(ids))
        with self.transaction():
            refs = {
                str(ref)
                for row in self.db.execute(
                    f"SELECT env_ref, argv_ref FROM jobs WHERE id IN ({marks})", ids
                )
                for ref in row
                if ref is not None
            }
            for table, column in (
                ("decisions", "job_id"),
                ("history", "job_id"),
                ("job_ends", "job_id"),
                ("jobs", "id"),
            ):
                self.db.execute(f"DELETE FROM {table} WHERE {column} IN ({marks})", ids)
            if refs:
                wanted = sorted(refs)
                slots = ",".join("?" * len(wanted))
                still = {
                    str(ref)
                    for row in self.db.execute(
                        f"SELECT env_ref, argv_ref FROM jobs WHERE env_ref IN ({slots})"
                        f" OR argv_ref IN ({slots})",
                        (*wanted, *wanted),
                    )
                    for ref in row
                    if ref is not None
                }
                gone = [ref for ref in wanted if ref not in still]
                if gone:
                    slots = ",".join("?" * len(gone))
                    self.db.execute(f"DELETE FROM blobs WHERE digest IN ({slots})", gone)
        for ref in refs:  # the decoded copies, if any
            cached = self._blobs.pop(ref, None)
            if cached is not None:
                self._blob_bytes -= cached[1]
