"""Groups in the store (the ``groups`` table, schema 5): the groups users made for their own
jobs (their owner and caps) and the pause of every group, an admin's (``[groups.NAME]``: a
row with no owner, holding only its pause) as well as a user's, so that a pause outlives a
restart.  A group's name is unique among them all.

A user's row whose name the config then gives an admin's group keeps two pauses apart in its
``paused`` column: its owner's (bit 1, :data:`OWNERS_PAUSE`: their hidden group's, which
comes back with it when the config drops the name) and the admin's group's (bit 2,
:data:`ADMINS_PAUSE`).  A user's pause used to pause the admin's group for everyone's jobs,
and an admin's pause stayed on the user's group."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from pollux_local.api.states import ACTIVE_STATES, JobState
from pollux_local.daemon.state.base import StoreBase

_COLUMNS = "name, owner_uid, owner_name, max_devices, max_running, paused, time"
#: The bits of a user's row's ``paused``: its owner's pause, and the pause of the admin's
#: group of the same name (a row with no owner: any bit is the admin's pause).
OWNERS_PAUSE = 1
ADMINS_PAUSE = 2


@dataclass(frozen=True)
class GroupRecord:
    """One row: a user's group (``owner_uid`` set) or an admin's group's pause (no owner);
    ``time`` is its last change.  ``paused``: the pause of the group the row is (a user's:
    its owner's or an admin's pause of it); ``admins_paused``: the pause of the admin's group
    of this name, where the config has one (a user's group of the name is then hidden, and
    its own pause holds nothing)."""

    name: str
    owner_uid: int | None
    owner_name: str | None
    max_devices: int | None
    max_running: int | None
    paused: bool
    time: float
    admins_paused: bool = False


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

    def set_group_paused(self, name: str, paused: bool, time: float, *, admins: bool) -> None:
        """Pause or resume a group: with ``admins``, the admin's group ``name`` (a row with no
        owner is made for it; on a user's row hidden under that name, its
        :data:`ADMINS_PAUSE` bit), else the user's group ``name`` (its
        :data:`OWNERS_PAUSE` bit)."""
        with self.transaction():
            if admins:
                self.db.execute(
                    f"INSERT INTO groups ({_COLUMNS}) VALUES (?, NULL, NULL, NULL, NULL, ?, ?)"
                    " ON CONFLICT(name) DO UPDATE SET paused = CASE WHEN owner_uid IS NULL"
                    f" THEN excluded.paused ELSE (paused & {OWNERS_PAUSE}) | ? END,"
                    " time = excluded.time",
                    (name, int(paused), time, ADMINS_PAUSE if paused else 0),
                )
            else:
                self.db.execute(
                    f"UPDATE groups SET paused = (paused & {ADMINS_PAUSE}) | ?, time = ?"
                    " WHERE name = ?",
                    (OWNERS_PAUSE if paused else 0, time, name),
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
    flags = int(paused)
    return GroupRecord(
        name=str(name),
        owner_uid=None if owner_uid is None else int(owner_uid),
        owner_name=None if owner_name is None else str(owner_name),
        max_devices=None if max_devices is None else int(max_devices),
        max_running=None if max_running is None else int(max_running),
        paused=bool(flags if owner_uid is None else flags & OWNERS_PAUSE),
        time=float(time),
        admins_paused=bool(flags if owner_uid is None else flags & ADMINS_PAUSE),
    )
