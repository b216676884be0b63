"""The store's connection: opened, checked (``quick_check``), migrated; one transaction
at a time."""

from __future__ import annotations

import contextlib
import logging
import os
import sqlite3
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pollux_local.daemon.state.files import (
    StateConnection,
    StateError,
    create_private_file,
    what_to_do,
)
from pollux_local.daemon.state.schema import MIGRATIONS, SCHEMA_VERSION

log = logging.getLogger("pollux_local.daemon")


class StoreBase:
    """The connection: opened, checked and migrated; transactions.

    Opening it creates the file 0600 when absent, checks it (``quick_check``) and brings its
    schema up to :data:`SCHEMA_VERSION`; :class:`StateError` when it cannot be used."""

    def __init__(self, path: Path) -> None:
        self.path = path
        #: decoded blobs by digest (value, bytes of text), least recently used first
        self._blobs: OrderedDict[str, tuple[Any, int]] = OrderedDict()
        self._blob_bytes = 0
        self._env_sizes: dict[str, int] = {}  # environment digest -> exec bytes
        #: (owner, bytes cap) -> (ended jobs, newest ended id) when their ended jobs were last
        #: found within the cap (``Retention.prune_ended`` counts again only what changed)
        self._ended_seen: dict[tuple[int, int], tuple[int, int]] = {}
        create_private_file(path)
        try:
            self.db = sqlite3.connect(
                str(path), isolation_level=None, timeout=30.0, factory=StateConnection
            )
            self.db._state_path = str(path)
        except sqlite3.Error as exc:
            raise StateError(f"cannot open the state database {path}: {exc}") from None
        try:
            self.db.row_factory = sqlite3.Row
            self._check_integrity()
            self.db.execute("PRAGMA journal_mode=WAL")
            self.db.execute("PRAGMA synchronous=NORMAL")
            self.version = self._migrate()
        except StateError:
            self.db.close()
            raise
        except sqlite3.DatabaseError as exc:
            self.db.close()
            raise StateError(
                f"the state database {path} is damaged ({exc}); {what_to_do(path)}"
            ) from None
        create_private_file(path)  # the -wal and -shm SQLite made: checked, and 0600
        #: where :func:`open_state` moved a refused database (``None``: nothing was moved)
        self.set_aside_to: Path | None = None

    def _check_integrity(self) -> None:
        """``PRAGMA quick_check``: :class:`StateError` naming the first problem found."""
        rows = [str(row[0]) for row in self.db.execute("PRAGMA quick_check").fetchall()]
        problems = [row for row in rows if row != "ok"]
        if problems:
            more = f" and {len(problems) - 1} more problem(s)" if len(problems) > 1 else ""
            raise StateError(
                f"the state database {self.path} is damaged ({problems[0][:200]}{more});"
                f" {what_to_do(self.path)}"
            )

    def schema_version(self) -> int:
        """The version the database reached: ``meta.schema_version``, else 0 (an empty
        database, or one written before versions were recorded: migration 1 creates only what
        is missing)."""
        if "meta" in self._tables():
            row = self.db.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
            if row is not None:
                try:
                    return int(row[0])
                except (TypeError, ValueError):
                    raise StateError(
                        f"the state database {self.path} records schema version {row[0]!r},"
                        f" not a number; {what_to_do(self.path)}"
                    ) from None
        return 0

    def _tables(self) -> set[str]:
        """The names of the database's tables."""
        rows = self.db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")
        return {str(row[0]) for row in rows}

    def _migrate(self) -> int:
        """Apply the migrations the database lacks, in order, each in one transaction."""
        version = self.schema_version()
        if version > SCHEMA_VERSION:
            raise StateError(
                f"the state database {self.path} has schema version {version}, newer than this"
                f" pollux-local knows ({SCHEMA_VERSION}): run the version that wrote it (or a"
                f" newer one); starting with --reset-state would set its history aside"
            )
        # an upgrade is logged, of a database written before versions were recorded too
        # (version 0, with its jobs); a new database says nothing of its tables
        upgrading = version > 0 or "jobs" in self._tables()
        for number, what, sql in MIGRATIONS:
            if number <= version:
                continue
            if upgrading:
                log.info(
                    "state database %s: schema %d -> %d (%s)", self.path, version, number, what
                )
            try:
                if callable(sql):
                    self.db.execute("BEGIN IMMEDIATE")
                    sql(self.db)
                    self.db.execute(
                        "INSERT OR REPLACE INTO meta (key, value) VALUES ('schema_version', ?)",
                        (str(number),),
                    )
                    self.db.execute("COMMIT")
                else:
                    self.db.executescript(
                        f"BEGIN IMMEDIATE;\n{sql}\nINSERT OR REPLACE INTO meta (key, value)"
                        f" VALUES ('schema_version', '{number}');\nCOMMIT;"
                    )
            except sqlite3.Error:
                if self.db.in_transaction:
                    self.db.execute("ROLLBACK")
                raise
            version = number
        return version

    def close(self) -> None:
        self.db.close()

    def make_durable(self) -> None:
        """Every commit made so far is on the disk once this returns: the write-ahead log
        (where WAL keeps them) is fsynced.  For a batch of changes committed without a sync
        each (a cancel of a thousand jobs), before the user is told."""
        try:
            fd = os.open(f"{self.path}-wal", os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return  # nothing in a log: all of it is in the database file
        try:
            os.fsync(fd)
        except OSError as exc:  # the changes stand; a power cut could still undo them
            log.error("state database %s: its log could not be synced: %s", self.path, exc)
        finally:
            os.close(fd)

    @contextlib.contextmanager
    def durably(self) -> Iterator[None]:
        """The block's commits are on the disk before they return (``synchronous=FULL``, then
        ``NORMAL`` again): what a user was told (a submit, a cancel), and every change of a
        job's state (a job's end: its run file is removed next), outlive a power cut."""
        self.db.execute("PRAGMA synchronous=FULL")
        try:
            yield
        finally:
            self.db.execute("PRAGMA synchronous=NORMAL")

    @contextlib.contextmanager
    def transaction(self) -> Iterator[None]:
        """``BEGIN IMMEDIATE`` ... ``COMMIT``; on any failure the transaction is rolled back
        if it is still open (a ``COMMIT`` refused for a full disk has already ended it) and
        the original error is raised, never one of the rollback's."""
        self.db.execute("BEGIN IMMEDIATE")
        try:
            yield
            self.db.execute("COMMIT")
        except BaseException:
            if self.db.in_transaction:
                with contextlib.suppress(sqlite3.Error):
                    self.db.execute("ROLLBACK")
            raise
