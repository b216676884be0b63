"""How many ended jobs the state keeps: each user's newest ``[limits] max_ended_per_user``.

Ended jobs were kept for ever, and one user could make about 1,300 a second (held arrays,
cancelled): the database grew by a megabyte a second on root's disk.  Beyond the cap, a
user's oldest ended jobs are removed with their decisions, history samples and announced
ends, and the stored commands and environments no job names any more.  Kept whatever their
age: a job an active job waits for (``--after``), every task of an array that still has an
active task, a job whose end is not yet announced (notifications), and one whose processes
are still stopping (the daemon says which).  The daemon then removes a removed job's
directory (``jobfiles.remove_job_dir``, as its owner)."""

from __future__ import annotations

import time
from collections.abc import Iterable

from pollux_local.api.states import ACTIVE_STATES, TERMINAL_STATES
from pollux_local.daemon.state.blobs import Blobs

#: The most ended jobs one call removes (a pass's worth of work stays small).
PRUNE_BATCH = 500


class Retention(Blobs):
    """Removing what is beyond each user's cap of ended jobs."""

    def removed_ids(self, candidates: list[int]) -> list[int]:
        """Those of ``candidates`` that were given to a job whose record is gone: not above
        the highest id ever given (ids are never given twice) and not a job's now."""
        row = self.db.execute("SELECT seq FROM sqlite_sequence WHERE name = 'jobs'").fetchone()
        highest = int(row[0]) if row is not None else 0
        present = {int(job_id) for (job_id,) in self.db.execute("SELECT id FROM jobs")}
        return [i for i in candidates if i <= highest and i not in present]

    def prune_ended(
        self,
        keep_per_user: int,
        batch: int = PRUNE_BATCH,
        *,
        budget_s: float = 0.0,
        into: list[int] | None = None,
        live: Iterable[int] = (),
    ) -> list[int]:
        """Remove each user's ended jobs beyond their newest ``keep_per_user`` (by end time),
        ``batch`` at a time (each its own transaction), but none that must stay (the module's
        docstring); another batch follows a full one until ``budget_s`` has gone by (0: one
        batch).  The ids removed (also appended to ``into`` as each batch is committed, so
        that a failing batch loses none of the earlier ones).  ``keep_per_user`` 0 keeps every
        job.  ``live``: the jobs whose processes are not gone yet (a cancelled job in its stop
        grace), kept too.  What must stay is read once, by the database
        (:meth:`_set_aside_kept`): an owner may make 500 jobs wait for 1,000 ids each."""
        removed = into if into is not None else []
        first = len(removed)
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
        began = time.monotonic()
        self._set_aside_kept()
        self.db.executemany(
            "INSERT OR IGNORE INTO temp.prune_kept VALUES (?)", [(int(i),) for i in live]
        )
        while True:
            doomed: list[int] = []
            for owner_uid, _count in over:
                room = batch - len(doomed)
                if room <= 0:
                    break
                # the owner's ended jobs but the newest ``keep_per_user``, oldest first, less
                # those that must stay (left out by the query: however many an owner makes
                # stay, the ones behind them are still reached)
                rows = self.db.execute(
                    "SELECT id FROM (SELECT id, end_time, submit_time,"
                    " json_extract(spec, '$.array_id') AS array_id FROM jobs"
                    f" WHERE owner_uid = ? AND state IN ({marks})"
                    " ORDER BY COALESCE(end_time, submit_time) DESC, id DESC LIMIT -1 OFFSET ?)"
                    " WHERE id NOT IN (SELECT id FROM temp.prune_kept)"
                    " AND (array_id IS NULL OR CAST(array_id AS TEXT)"
                    " NOT IN (SELECT id FROM temp.prune_kept_arrays))"
                    " ORDER BY COALESCE(end_time, submit_time), id LIMIT ?",
                    (owner_uid, *ended, keep_per_user, room),
                ).fetchall()
                doomed.extend(int(job_id) for (job_id,) in rows)
            if doomed:
                self._remove_jobs(doomed)
                removed.extend(doomed)
            if len(doomed) < batch or time.monotonic() - began >= budget_s:
                return removed[first:]

    def _set_aside_kept(self) -> None:
        """Fill this connection's temporary tables of what must stay: the ids active jobs
        wait for and the jobs whose end is not announced (``prune_kept``), and the arrays
        that have an active task (``prune_kept_arrays``)."""
        active = sorted(state.value for state in ACTIVE_STATES)
        marks = ",".join("?" * len(active))
        db = self.db
        db.execute("CREATE TEMP TABLE IF NOT EXISTS prune_kept (id INTEGER PRIMARY KEY)")
        db.execute("CREATE TEMP TABLE IF NOT EXISTS prune_kept_arrays (id TEXT PRIMARY KEY)")
        db.execute("DELETE FROM temp.prune_kept")
        db.execute("DELETE FROM temp.prune_kept_arrays")
        db.execute(
            "INSERT OR IGNORE INTO temp.prune_kept SELECT CAST(waits.value AS INTEGER)"
            " FROM jobs, json_each(jobs.spec, '$.after') AS waits"
            f" WHERE jobs.state IN ({marks}) AND waits.value IS NOT NULL",
            active,
        )
        db.execute(
            "INSERT OR IGNORE INTO temp.prune_kept SELECT job_id FROM job_ends WHERE notified = 0"
        )
        db.execute(
            "INSERT OR IGNORE INTO temp.prune_kept_arrays"
            " SELECT CAST(json_extract(spec, '$.array_id') AS TEXT) FROM jobs"
            f" WHERE state IN ({marks}) AND json_extract(spec, '$.array_id') IS NOT NULL",
            active,
        )

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
            self._drop_unreferenced(refs)
