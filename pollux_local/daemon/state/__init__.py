"""The daemon's durable state: jobs and the decision log in SQLite (WAL).

Every acknowledged submit and every change of a job's state (a start, an end, a cancel, a
hold) is committed with ``synchronous=FULL`` before anything follows from it (a request
that changes many jobs syncs the write-ahead log once before it answers, ``make_durable``),
so nothing submitted is lost and nothing finished runs again when the daemon (or the
machine) dies: a job's end is on the disk before its run file is removed.  Other updates (reports,
predictions, priorities) use WAL with ``synchronous=NORMAL``: safe against the process being
killed, at most the last few lost on a power cut.

Opening the database (:class:`StateStore`, :func:`open_state`) checks it before anything uses
it, each problem refused as one line naming the file and what to do (:class:`StateError`):

* the file is created 0600 before SQLite opens it (its ``-wal`` and ``-shm`` take its mode), it
  must be a plain file of the daemon's user (not a symlink), and older files are made 0600;
* ``PRAGMA quick_check`` must pass: a damaged database is never served from;
* ``meta.schema_version`` says which of :data:`MIGRATIONS` were applied; the missing ones are
  applied in order, each in one transaction; a database from a newer version is refused;
* an empty (0-byte) or missing ``state.db`` beside a ``jobs/`` directory that has entries or a
  ``state.db-wal`` is refused: job history was expected there (:func:`missing_history`).

With ``reset=True`` (``pollux-local daemon --reset-state``) a database refused for any of these
reasons is moved aside, with its ``-wal``/``-shm`` and ``jobs/``, into
``STATE_DIR/reset-<time>/`` (nothing is deleted) and the daemon starts with no job history; a
healthy database is left alone.
"""

from __future__ import annotations

import os
from pathlib import Path

from pollux_local.api.states import ACTIVE_STATES, TERMINAL_STATES, JobState
from pollux_local.daemon.state.files import (
    CHECKPOINT_KEY,
    SIDE_FILES,
    StateDiskFull,
    StateError,
    create_private_file,
    disk_full_error,
    missing_history,
    new_database,
    set_aside,
)
from pollux_local.daemon.state.groups import GroupRecord, Groups
from pollux_local.daemon.state.jobs import Jobs
from pollux_local.daemon.state.records import (
    STATES,
    DecisionEntry,
    IllegalTransition,
    JobEnd,
    JobRecord,
    stored_row,
)
from pollux_local.daemon.state.retention import REMOVED_ARGV, Retention
from pollux_local.daemon.state.schema import (
    DECISIONS_LIMIT,
    HISTORY_LIMIT,
    MIGRATIONS,
    SCHEMA_VERSION,
)

__all__ = [
    "GroupRecord",
    "REMOVED_ARGV",
    "DECISIONS_LIMIT",
    "HISTORY_LIMIT",
    "JobEnd",
    "SIDE_FILES",
    "create_private_file",
    "disk_full_error",
    "missing_history",
    "set_aside",
    "ACTIVE_STATES",
    "MIGRATIONS",
    "SCHEMA_VERSION",
    "STATES",
    "TERMINAL_STATES",
    "JobRecord",
    "DecisionEntry",
    "IllegalTransition",
    "JobState",
    "StateDiskFull",
    "StateError",
    "StateStore",
    "open_state",
    "stored_row",
]


class StateStore(Jobs, Groups, Retention):
    """SQLite-backed store; one instance per daemon, used from the event-loop thread only.

    Opening it creates the file 0600 when absent, checks it (``quick_check``) and brings its
    schema up to :data:`SCHEMA_VERSION`; :class:`StateError` when it cannot be used.  Its
    parts, one module each: :mod:`.base` (the connection), :mod:`.blobs`, :mod:`.history`
    (decisions, history, usage, withheld devices), :mod:`.outbox` (job ends), :mod:`.jobs`
    (jobs and :meth:`transition`), :mod:`.groups` (users' groups, every group's pause),
    :mod:`.retention` (how many ended jobs are kept);
    :mod:`.schema` and :mod:`.files` below them."""


def open_state(state_dir: Path, reset: bool = False, name: str = "state.db") -> StateStore:
    """The daemon's store in ``state_dir``, checked (:class:`StateStore`,
    :func:`missing_history`).  With ``reset``, a database refused for any reason is first moved
    aside (:func:`set_aside`; ``store.set_aside_to`` says where) and a new one started."""
    path = state_dir / name
    try:
        problem = missing_history(state_dir, name)
        if problem is not None:
            raise StateError(problem)
        if new_database(state_dir, name) and os.path.lexists(state_dir / CHECKPOINT_KEY):
            # the key of a history that is gone (its database removed by hand): the new
            # database's job 1 must not get old job 1's checkpoint directory
            set_aside(state_dir, name, key_only=True)
        store = StateStore(path)
    except StateError:
        if not reset:
            raise
        aside = set_aside(state_dir, name)
        store = StateStore(path)
        store.set_aside_to = aside
    return store
