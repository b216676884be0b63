"""Groups in the store (the ``groups`` table, schema 5): the groups users made for their own
jobs (their owner and caps) and the pause of every group, an admin's (``[groups.NAME]``: a
row with no owner, holding only its pause) as well as a user's, so that a pause outlives a
restart.  A group's name is unique among them all."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from pollux_local.api.states import ACTIVE_STATES, JobState
from pollux_local.daemon.state.base import StoreBase

_COLUMNS = "name, owner_uid, owner_name, max_devices, max_running, paused, time"


@dataclass(frozen=True)
class GroupRecord:
    """One row: a user's group (``owner_uid`` set) or an admin's group's pause (no owner);
    ``time`` is its last change."""

    name: str
    owner_uid: int | None
    owner_name: str | None
    max_devices: int | None
    max_running: int | None
    paused: bool
    time: float


class Groups(StoreBase):
    """The ``groups`` table."""

    def group_rows(self) -> list[GroupRecord]:
        """Every row, by name."""
        rows = self.db.execute(f"SELECT {_COLUMNS} FROM groups ORDER BY name").fetchall()
        return [_record(row) for row in rows]

    def group_row(self, name: str) -> GroupRecord | None:
        row = self.db.execute(f"SELECT {_COLUMNS} FROM groups WHERE name = ?", (name,)).fetchone()
        return _record(row) if row is not None else None

    def count_groups(self, owner_uid: int) -> int:
        """How many groups ``owner_uid`` made."""
        row = self.db.execute(
            "SELECT COUNT(*) FROM groups WHERE owner_uid = ?", (owner_uid,)
        ).fetchone()
        return int(row[0])

    def put_group(
        self,
        name: str,
        *,
        owner_uid: int,
        owner_name: str,
        max_devices: int | None,
        max_running: int | None,
        time: float,
    ) -> GroupRecord:
        """Make a user's group or change its caps (its pause kept)."""
        with self.transaction():
            self.db.execute(
                f"INSERT INTO groups ({_COLUMNS}) VALUES (?, ?, ?, ?, ?, 0, ?)"
                " ON CONFLICT(name) DO UPDATE SET owner_uid = excluded.owner_uid,"
                " owner_name = excluded.owner_name, max_devices = excluded.max_devices,"
                " max_running = excluded.max_running, time = excluded.time",
                (name, owner_uid, owner_name, max_devices, max_running, time),
            )
        found = self.group_row(name)
        assert found is not None
        return found

    def set_group_paused(self, name: str, paused: bool, time: float) -> None:
        """Pause or resume a group (a row with no owner is made for an admin's group)."""
        with self.transaction():
            self.db.execute(
                f"INSERT INTO groups ({_COLUMNS}) VALUES (?, NULL, NULL, NULL, NULL, ?, ?)"
                " ON CONFLICT(name) DO UPDATE SET paused = excluded.paused, time = excluded.time",
                (name, int(paused), time),
            )

    def delete_group(self, name: str) -> None:
        with self.transaction():
            self.db.execute("DELETE FROM groups WHERE name = ?", (name,))

    def count_group_jobs(
        self,
        name: str,
        states: Iterable[JobState] = ACTIVE_STATES,
        *,
        owner: int | None = None,
        other_than: int | None = None,
    ) -> int:
        """The jobs naming group ``name`` in one of ``states`` (by default: not ended); with
        ``owner``, only that uid's; with ``other_than``, only those of other owners."""
        wanted = sorted(JobState(state).value for state in states)
        where, args = "", list[int]()
        if owner is not None:
            where, args = where + " AND owner_uid = ?", [*args, owner]
        if other_than is not None:
            where, args = where + " AND owner_uid != ?", [*args, other_than]
        row = self.db.execute(
            f"SELECT COUNT(*) FROM jobs WHERE state IN ({','.join('?' * len(wanted))})"
            f" AND json_extract(spec, '$.group') = ?{where}",
            (*wanted, name, *args),
        ).fetchone()
        return int(row[0])

    def group_job_counts(self, states: Iterable[JobState]) -> list[tuple[str, str, int]]:
        """(group, owner's name, jobs) of the jobs in ``states`` that name a group, counted
        by the database (no job is read)."""
        wanted = sorted(JobState(state).value for state in states)
        rows = self.db.execute(
            "SELECT json_extract(spec, '$.group') AS name, owner_name, COUNT(*) FROM jobs"
            f" WHERE state IN ({','.join('?' * len(wanted))}) AND name IS NOT NULL"
            " GROUP BY name, owner_name",
            wanted,
        ).fetchall()
        return [(str(name), str(owner), int(count)) for name, owner, count in rows]


def _record(row: Any) -> GroupRecord:
    name, owner_uid, owner_name, max_devices, max_running, paused, time = tuple(row)
    return GroupRecord(
        name=str(name),
        owner_uid=None if owner_uid is None else int(owner_uid),
        owner_name=None if owner_name is None else str(owner_name),
        max_devices=None if max_devices is None else int(max_devices),
        max_running=None if max_running is None else int(max_running),
        paused=bool(paused),
        time=float(time),
    )
