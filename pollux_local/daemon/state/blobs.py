"""Environments and commands stored once, by content (blobs), decoded once per blob."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterable, Sequence
from typing import Any

import msgspec

from pollux_local.api.states import (
    ACTIVE_STATES,
    JobState,
)
from pollux_local.daemon.commands import StoredEnvironment, environment_bytes
from pollux_local.daemon.state.base import StoreBase
from pollux_local.daemon.state.records import BLOB_CACHE_BYTES, JobRecord, blob_text, row_to_job

#: Environments whose sizes ``stored_environment`` remembers (all forgotten past it).
ENV_SIZES_KEPT = 4096


def owner_blobs_sql(states: Sequence[str]) -> str:
    """SQL of the blobs (commands and environments) an owner's jobs in ``states`` name; its
    parameters: the owner, the states, the owner, the states."""
    mine = f"owner_uid = ? AND state IN ({','.join('?' * len(states))})"
    return f"SELECT argv_ref FROM jobs WHERE {mine} UNION SELECT env_ref FROM jobs WHERE {mine}"


class Blobs(StoreBase):
    """Content-addressed blobs and reading a job row through them."""

    def stored_bytes(self, owner_uid: int) -> int:
        """Bytes of the commands and environments that ``owner_uid``'s queued, held and
        running jobs keep in the state (each blob once, however many jobs share it) and of the
        jobs' own rows (settings and names: one per job, an array's tasks each): what
        ``[limits] max_stored_per_user`` bounds.  Read from the index ``jobs_owner_kept``
        (migration 6), whose expression the rows' sum below must match: without it every row
        was read in full (86 ms for 1,000 jobs with long ``--notify`` lists, now 1 ms).  Asked
        only when a request adds something (:meth:`unkept_bytes`)."""
        return self.kept_bytes(owner_uid, ACTIVE_STATES)

    def kept_bytes(self, owner_uid: int, states: Iterable[JobState]) -> int:
        """Bytes ``owner_uid``'s jobs in ``states`` keep: the blobs they name (each once) and
        their rows (settings and names), read from the index ``jobs_owner_kept``."""
        wanted = sorted(state.value for state in states)
        marks = ",".join("?" * len(wanted))
        mine = f"owner_uid = ? AND state IN ({marks})"
        (blobs,) = self.db.execute(
            f"SELECT COALESCE(SUM(size), 0) FROM blobs WHERE digest IN ({owner_blobs_sql(wanted)})",
            (owner_uid, *wanted, owner_uid, *wanted),
        ).fetchone()
        (inline,) = self.db.execute(  # rows written before blobs keep their environment inline
            f"SELECT COALESCE(SUM(LENGTH(env)), 0) FROM jobs WHERE {mine} AND env_ref IS NULL",
            (owner_uid, *wanted),
        ).fetchone()
        (rows_bytes,) = self.db.execute(  # each job's own row: its settings and name
            f"SELECT COALESCE(SUM(LENGTH(spec) + LENGTH(name)), 0) FROM jobs WHERE {mine}",
            (owner_uid, *wanted),
        ).fetchone()
        return int(blobs) + int(inline) + int(rows_bytes)

    def unkept_bytes(
        self, owner_uid: int, adding: Sequence[list[str] | dict[str, str] | str]
    ) -> int:
        """Bytes of the blobs among ``adding`` (values, or the digests of stored ones) that
        none of ``owner_uid``'s queued, held or running jobs keeps yet (each once): what storing
        them would add.  One indexed lookup a blob (migration 6), so a request that adds nothing new
        (a release, an edit of the priority) costs no read of the owner's jobs: a release of 1,000
        held jobs each counting all of them held the daemon 75-104 s."""
        wanted = sorted(state.value for state in ACTIVE_STATES)
        marks = ",".join("?" * len(wanted))
        new: dict[str, int] = {}
        for value in adding:
            if isinstance(value, str):  # a stored blob, by its digest
                digest = value
                found = self.db.execute("SELECT size FROM blobs WHERE digest = ?", (digest,))
                size_row = found.fetchone()
                size = int(size_row[0]) if size_row is not None and size_row[0] is not None else 0
            else:
                digest, text = blob_text(value)
                size = len(text)
            if digest in new:
                continue
            row = self.db.execute(
                "SELECT 1 FROM jobs WHERE argv_ref = ? AND owner_uid = ?"
                f" AND state IN ({marks}) UNION ALL SELECT 1 FROM jobs WHERE env_ref = ?"
                f" AND owner_uid = ? AND state IN ({marks}) LIMIT 1",
                (digest, owner_uid, *wanted, digest, owner_uid, *wanted),
            ).fetchone()
            if row is None:
                new[digest] = size
        return sum(new.values())

    def _put_blob(self, value: list[str] | dict[str, str]) -> str:
        """Store ``value`` (JSON) under the SHA-256 of its text, once; its digest."""
        digest, text = blob_text(value)
        self.db.execute(
            "INSERT OR IGNORE INTO blobs (digest, data, size) VALUES (?, ?, ?)",
            (digest, text.decode(), len(text)),
        )
        return digest

    def _drop_unreferenced(self, refs: set[str]) -> None:
        """Delete the blobs among ``refs`` that no job references any more (and their decoded
        copies): every path that removes a job or replaces its command or environment calls
        this in its transaction, so nothing is left that no job can reach (the indexes of
        migration 6 make the check one lookup a blob)."""
        if not refs:
            return
        wanted = sorted(refs)
        slots = ",".join("?" * len(wanted))
        still = {
            str(ref)
            for row in self.db.execute(
                f"SELECT argv_ref FROM jobs WHERE argv_ref IN ({slots})"
                f" UNION SELECT env_ref FROM jobs WHERE env_ref IN ({slots})",
                (*wanted, *wanted),
            )
            for ref in row
        }
        gone = [ref for ref in wanted if ref not in still]
        if gone:
            self.db.execute(
                f"DELETE FROM blobs WHERE digest IN ({','.join('?' * len(gone))})", gone
            )
        for ref in gone:
            cached = self._blobs.pop(ref, None)
            if cached is not None:
                self._blob_bytes -= cached[1]

    def stored_environment(self, job_id: int) -> StoredEnvironment:
        """Job ``job_id``'s environment as its checks need it: its blob's digest and its bytes
        as exec counts them, measured once per environment (the jobs that share one, an
        array's tasks or a job's restarts, share its digest), not once per job."""
        digest = self._env_ref(job_id)
        size = self._env_sizes.get(digest)
        if size is None:
            env = self._blob(digest)
            size = environment_bytes(env) if isinstance(env, dict) else 0
            if len(self._env_sizes) >= ENV_SIZES_KEPT:
                self._env_sizes.clear()
            self._env_sizes[digest] = size
        return StoredEnvironment(digest, size)

    def _env_ref(self, job_id: int) -> str:
        """The blob of job ``job_id``'s environment; a row written before blobs has its inline
        environment moved into one (and then references it)."""
        row = self.db.execute("SELECT env_ref, env FROM jobs WHERE id = ?", (job_id,)).fetchone()
        if row is None:
            return self._put_blob({})
        if row[0] is not None:
            return str(row[0])
        digest = self._put_blob(json.loads(row[1] or "{}"))
        self.db.execute("UPDATE jobs SET env_ref = ?, env = '{}' WHERE id = ?", (digest, job_id))
        return digest

    def _blob(self, digest: str) -> Any:
        """A blob's decoded value, from the in-memory cache when there (``None``: no such
        blob).  Callers copy what they keep."""
        cached = self._blobs.get(digest)
        if cached is not None:
            self._blobs.move_to_end(digest)
            return cached[0]
        row = self.db.execute("SELECT data FROM blobs WHERE digest = ?", (digest,)).fetchone()
        if row is None:
            return None
        text = str(row[0])
        value = msgspec.json.decode(text)
        self._blobs[digest] = (value, len(text))
        self._blob_bytes += len(text)
        while self._blob_bytes > BLOB_CACHE_BYTES and len(self._blobs) > 1:
            _, (_, size) = self._blobs.popitem(last=False)
            self._blob_bytes -= size
        return value

    def _job(self, row: sqlite3.Row) -> JobRecord:
        """A row as a :class:`JobRecord`, its command (and environment, when the row has the
        column) read from their blobs."""
        job = row_to_job(row)
        present = set(row.keys())
        if "argv_ref" in present and row["argv_ref"] is not None:
            argv = self._blob(row["argv_ref"])
            job.spec = msgspec.structs.replace(
                job.spec, argv=list(argv) if isinstance(argv, list) else ["?"]
            )
        if "env_ref" in present and row["env_ref"] is not None:
            env = self._blob(row["env_ref"])
            job.env = dict(env) if isinstance(env, dict) else {}
        return job
