"""How many ended jobs the state keeps: each user's newest ``[limits] max_ended_per_user``,
and of those the newest that keep ``[limits] max_ended_stored_per_user`` bytes.

Ended jobs were kept for ever, and one user could make about 1,300 a second (held arrays,
cancelled): the database grew by a megabyte a second on root's disk. Beyond the cap, a user's
oldest ended jobs are removed with their decisions, history samples and announced ends, and the
stored commands and environments no job names any more. Kept whatever their age: every task of
an array that still has an active task (not one restarted since: a newer task of its index), a
job whose end is not yet announced (notifications), and one whose processes are still stopping
(the daemon says which). A job an active job waits for (``--after``) goes like any other, but
how it ended stays (``dependency_outcomes``: an id and a state, read by ``states_of``) while an
active job names it: an ``--after`` list of a thousand ids kept a thousand rows. The daemon
then removes a removed job's directory (``jobfiles.remove_job_dir``, as its owner)."""

from __future__ import annotations

import time
from collections.abc import Iterable

from pollux_local.api.states import ACTIVE_STATES, TERMINAL_STATES
from pollux_local.daemon.state.blobs import Blobs, owner_blobs_sql

#: The most ended jobs one call removes (a pass's worth of work stays small).
PRUNE_BATCH = 500
#: The command an ended job keeps once its own was removed: it had to stay (another job waits
#: for it, or its end is not announced yet) but was beyond its owner's bytes; what waits for
#: it needs only how it ended.  ``restart`` refuses such a job.
REMOVED_ARGV = ["pollux-local: command removed (beyond [limits] max_ended_stored_per_user)"]


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
        keep_bytes_per_user: int = 0,
    ) -> list[int]:
        """Remove each user's ended jobs beyond their newest ``keep_per_user`` (by end time),
        ``batch`` at a time (each its own transaction), but none that must stay (the module's
        docstring); another batch follows a full one until ``budget_s`` has gone by (0: one
        batch).  The ids removed (also appended to ``into`` as each batch is committed, so
        that a failing batch loses none of the earlier ones).  ``keep_per_user`` 0 keeps every
        job.  ``keep_bytes_per_user``: also the ended jobs of a user beyond their newest that
        keep that many bytes (:meth:`ended_bytes`; 0: no such bound).  ``live``: the jobs whose
        processes are not gone yet (a cancelled job in its stop grace), kept too.  What must
        stay is read once, by the database (:meth:`_set_aside_kept`): an owner may make 500
        jobs wait for 1,000 ids each."""
        removed = into if into is not None else []
        first = len(removed)
        ended = sorted(state.value for state in TERMINAL_STATES)
        marks = ",".join("?" * len(ended))
        owners = {
            int(owner): (int(count), int(newest))
            for owner, count, newest in self.db.execute(
                f"SELECT owner_uid, COUNT(*), MAX(id) FROM jobs WHERE state IN ({marks})"
                " GROUP BY owner_uid",
                ended,
            )
        }
        over = [
            (owner, count)
            for owner, (count, _) in owners.items()
            if keep_per_user > 0 and count > keep_per_user
        ]
        heavy: list[int] = []
        if keep_bytes_per_user > 0:
            # counted again only for an owner whose ended jobs changed since (their number or
            # newest id): a count costs ~10 ms for 3,000 jobs, and most owners are quiet
            # (an owner over the count cap is not remembered: this pass removes some of their
            # jobs, and one ending with a lower id than their newest would then bring back
            # the same mark with other jobs behind it)
            seen = self._ended_seen
            counted = {owner for owner, _ in over}
            changed = [
                o for o, mark in owners.items() if seen.get((o, keep_bytes_per_user)) != mark
            ]
            for owner in changed:
                if self.ended_bytes(owner) > keep_bytes_per_user:
                    heavy.append(owner)
                elif owner not in counted:
                    seen[(owner, keep_bytes_per_user)] = owners[owner]
        if not over and not heavy:
            self._forget_outcomes()
            return []
        began = time.monotonic()
        self._set_aside_kept()
        self._set_aside_superseded()
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
                    " NOT IN (SELECT id FROM temp.prune_kept_arrays)"
                    " OR id IN (SELECT id FROM temp.prune_superseded))"
                    " ORDER BY COALESCE(end_time, submit_time), id LIMIT ?",
                    (owner_uid, *ended, keep_per_user, room),
                ).fetchall()
                doomed.extend(int(job_id) for (job_id,) in rows)
            for owner_uid in heavy:
                room = batch - len(doomed)
                if room <= 0:
                    break
                beyond, pinned = self._beyond_bytes(owner_uid, keep_bytes_per_user, set(doomed))
                doomed.extend(beyond[:room])
                self._slim(pinned)
            if doomed:
                self._remove_jobs(doomed)
                removed.extend(doomed)
            if len(doomed) < batch or time.monotonic() - began >= budget_s:
                return removed[first:]

    def _ended_rows(self, owner_uid: int) -> list[tuple[int, int, str | None, str | None]]:
        """``owner_uid``'s ended jobs, newest first (by end time): id, the bytes of its own row
        (its settings and name, and its environment where a row written before blobs keeps
        it inline) and its command's and environment's blobs."""
        ended = sorted(state.value for state in TERMINAL_STATES)
        return [
            (int(job_id), int(size), argv_ref, env_ref)
            for job_id, size, argv_ref, env_ref in self.db.execute(
                "SELECT id, LENGTH(spec) + LENGTH(name)"
                " + (CASE WHEN env_ref IS NULL THEN COALESCE(LENGTH(env), 0) ELSE 0 END),"
                " argv_ref, env_ref FROM jobs"
                f" WHERE owner_uid = ? AND state IN ({','.join('?' * len(ended))})"
                " ORDER BY COALESCE(end_time, submit_time) DESC, id DESC",
                (owner_uid, *ended),
            )
        ]

    def _blob_sizes(self, owner_uid: int) -> tuple[dict[str, int], set[str]]:
        """The sizes of the blobs ``owner_uid``'s ended jobs name, and the blobs their active
        jobs name (kept whatever becomes of the ended ones)."""
        active = sorted(state.value for state in ACTIVE_STATES)
        marks = ",".join("?" * len(active))
        kept = {
            str(ref)
            for row in self.db.execute(
                f"SELECT argv_ref, env_ref FROM jobs WHERE owner_uid = ? AND state IN ({marks})",
                (owner_uid, *active),
            )
            for ref in row
            if ref is not None
        }
        ended = sorted(state.value for state in TERMINAL_STATES)
        sizes = {
            str(digest): int(size)
            for digest, size in self.db.execute(
                f"SELECT digest, size FROM blobs WHERE digest IN ({owner_blobs_sql(ended)})",
                (owner_uid, *ended, owner_uid, *ended),
            )
        }
        return sizes, kept

    def ended_bytes(self, owner_uid: int) -> int:
        """Bytes ``owner_uid``'s ended jobs keep in the state: their rows, and each command or
        environment they name once, but those an active job of theirs names too (what
        ``[limits] max_ended_stored_per_user`` bounds: a user could submit 4 MB commands,
        each new, and cancel them, 10,000 kept, 40 GB).  Read from the index
        ``jobs_owner_kept``, as :meth:`stored_bytes` is."""
        ended = sorted(state.value for state in TERMINAL_STATES)
        active = sorted(state.value for state in ACTIVE_STATES)
        (shared,) = self.db.execute(  # blobs an active job of theirs keeps anyway
            f"SELECT COALESCE(SUM(size), 0) FROM blobs WHERE digest IN ({owner_blobs_sql(ended)})"
            f" AND digest IN ({owner_blobs_sql(active)})",
            (owner_uid, *ended, owner_uid, *ended, owner_uid, *active, owner_uid, *active),
        ).fetchone()
        return self.kept_bytes(owner_uid, TERMINAL_STATES) - int(shared)

    def _beyond_bytes(
        self, owner_uid: int, keep_bytes: int, doomed: set[int]
    ) -> tuple[list[int], list[int]]:
        """``owner_uid``'s ended jobs past their newest that keep ``keep_bytes`` (each blob
        counted with the newest job that names it), oldest first, less those that must stay
        (``temp.prune_kept``, ``temp.prune_kept_arrays``) and those in ``doomed``; and those
        past it that must stay (their end is not announced, a task of their array is
        active): their command and environment go, :meth:`_slim`."""
        sizes, seen = self._blob_sizes(owner_uid)
        must_stay = {int(i) for (i,) in self.db.execute("SELECT id FROM temp.prune_kept")}
        arrays = {str(a) for (a,) in self.db.execute("SELECT id FROM temp.prune_kept_arrays")}
        in_arrays = {
            int(job_id)
            for job_id, array_id in self.db.execute(
                "SELECT id, CAST(json_extract(spec, '$.array_id') AS TEXT) FROM jobs"
                " WHERE owner_uid = ? AND json_extract(spec, '$.array_id') IS NOT NULL",
                (owner_uid,),
            )
            if array_id in arrays
        }
        superseded = {int(i) for (i,) in self.db.execute("SELECT id FROM temp.prune_superseded")}
        staying = must_stay | (in_arrays - superseded) | doomed
        total = 0
        beyond: list[int] = []
        pinned: list[int] = []
        for job_id, size, argv_ref, env_ref in self._ended_rows(owner_uid):
            total += size
            for digest in (argv_ref, env_ref):
                if digest is not None and digest not in seen:
                    seen.add(digest)
                    total += sizes.get(digest, 0)
            if total > keep_bytes:
                if job_id not in staying:
                    beyond.append(job_id)
                elif job_id not in doomed:  # its end is not announced, or its array runs
                    pinned.append(job_id)
        return beyond[::-1], pinned

    def _refs_of(self, ids: list[int]) -> set[str]:
        """The blobs (commands and environments) the jobs ``ids`` name."""
        marks = ",".join("?" * len(ids))
        return {
            str(ref)
            for row in self.db.execute(
                f"SELECT env_ref, argv_ref FROM jobs WHERE id IN ({marks})", ids
            )
            for ref in row
            if ref is not None
        }

    def _slim(self, ids: list[int]) -> None:
        """Ended jobs ``ids`` that must stay keep their rows (their state and name, which is
        all an announcement or their array's status needs) but not their commands and
        environments: :data:`REMOVED_ARGV` and none, and the blobs no other job names go."""
        if not ids:
            return
        marks = ",".join("?" * len(ids))
        with self.transaction():
            refs = self._refs_of(ids)
            removed = self._put_blob(REMOVED_ARGV)
            empty = self._put_blob({})
            self.db.execute(
                f"UPDATE jobs SET argv_ref = ?, env_ref = ?, env = '{{}}' WHERE id IN ({marks})",
                (removed, empty, *ids),
            )
            self._drop_unreferenced(refs - {removed, empty})

    def _set_aside_kept(self) -> None:
        """Fill this connection's temporary tables of what must stay: the jobs whose end is
        not announced (``prune_kept``) and the arrays that have an active task
        (``prune_kept_arrays``); and of the ids active jobs wait for (``prune_waited``), whose
        outcomes are kept when they go (the outcomes no active job names any more go now)."""
        active = sorted(state.value for state in ACTIVE_STATES)
        marks = ",".join("?" * len(active))
        db = self.db
        db.execute("CREATE TEMP TABLE IF NOT EXISTS prune_kept (id INTEGER PRIMARY KEY)")
        db.execute("CREATE TEMP TABLE IF NOT EXISTS prune_kept_arrays (id TEXT PRIMARY KEY)")
        db.execute("CREATE TEMP TABLE IF NOT EXISTS prune_waited (id INTEGER PRIMARY KEY)")
        db.execute("CREATE TEMP TABLE IF NOT EXISTS prune_superseded (id INTEGER PRIMARY KEY)")
        db.execute("DELETE FROM temp.prune_kept")
        db.execute("DELETE FROM temp.prune_kept_arrays")
        db.execute("DELETE FROM temp.prune_waited")
        db.execute(
            "INSERT OR IGNORE INTO temp.prune_waited SELECT CAST(waits.value AS INTEGER)"
            " FROM jobs, json_each(jobs.spec, '$.after') AS waits"
            f" WHERE jobs.state IN ({marks}) AND waits.value IS NOT NULL",
            active,
        )
        db.execute(
            "DELETE FROM dependency_outcomes WHERE id NOT IN (SELECT id FROM temp.prune_waited)"
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

    def _set_aside_superseded(self) -> None:
        """Fill ``temp.prune_superseded``: the ended tasks of the arrays kept
        (``temp.prune_kept_arrays``) that were restarted since (a newer task of their index),
        which are not kept for their array; the array's first task is (it names the array:
        ``cancel --array``).  Restarts add tasks to an array: a restart and a cancel of one
        task in a loop, another task held, kept every copy for as long as it was held (review
        s70).  Read only by a removal, not by :meth:`_forget_outcomes`."""
        active = {state.value for state in ACTIVE_STATES}
        db = self.db
        db.execute("DELETE FROM temp.prune_superseded")
        newest: dict[tuple[str, object], int] = {}
        ended: list[tuple[int, str, object]] = []
        for job_id, array_id, index, state in db.execute(
            "SELECT id, CAST(json_extract(spec, '$.array_id') AS TEXT),"
            " json_extract(spec, '$.array_index'), state FROM jobs"
            " WHERE CAST(json_extract(spec, '$.array_id') AS TEXT)"
            " IN (SELECT id FROM temp.prune_kept_arrays) ORDER BY id"
        ):
            newest[(array_id, index)] = int(job_id)
            if state not in active and str(job_id) != array_id:
                ended.append((int(job_id), array_id, index))
        db.executemany(
            "INSERT OR IGNORE INTO temp.prune_superseded VALUES (?)",
            [(job_id,) for job_id, array_id, index in ended if newest[(array_id, index)] != job_id],
        )

    def _forget_outcomes(self) -> None:
        """Remove the outcomes no active job waits for any more (a pass that removes jobs does
        it in :meth:`_set_aside_kept`); nothing is read while there are none."""
        if self.db.execute("SELECT 1 FROM dependency_outcomes LIMIT 1").fetchone() is None:
            return
        self._set_aside_kept()

    def _remove_jobs(self, ids: list[int]) -> None:
        """Delete the jobs ``ids`` and what belongs to them only, in one transaction; how
        those that active jobs wait for ended is kept (``dependency_outcomes``)."""
        marks = ",".join("?" * len(ids))
        with self.transaction():
            refs = self._refs_of(ids)
            self.db.execute(
                "INSERT OR REPLACE INTO dependency_outcomes SELECT id, state FROM jobs"
                f" WHERE id IN ({marks}) AND id IN (SELECT id FROM temp.prune_waited)",
                ids,
            )
            for table, column in (
                ("decisions", "job_id"),
                ("history", "job_id"),
                ("job_ends", "job_id"),
                ("admin_holds", "id"),
                ("jobs", "id"),
            ):
                self.db.execute(f"DELETE FROM {table} WHERE {column} IN ({marks})", ids)
            self._drop_unreferenced(refs)
