"""Jobs: adding them (an array in one transaction), reading them, changing their columns,
and the one way their state changes (:meth:`Jobs.transition`)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Sequence
from typing import Any

import msgspec

from pollux_local.api.spec import JobSpec, decode_spec
from pollux_local.api.states import (
    ACTIVE_STATES,
    PLACED_STATES,
    TERMINAL_STATES,
    DecisionKind,
    JobState,
)
from pollux_local.daemon.state.outbox import Outbox
from pollux_local.daemon.state.records import (
    COLUMNS_WITHOUT_ENV,
    JOB_COLUMNS,
    DecisionEntry,
    IllegalTransition,
    JobRecord,
    column_value,
    stored_row,
)


class Jobs(Outbox):
    """Jobs and their state changes."""

    def add_job(
        self,
        *,
        name: str,
        owner_uid: int,
        owner_gid: int,
        owner_name: str,
        spec: JobSpec | dict[str, Any],
        priority: int,
        submit_time: float,
        held: bool = False,
        env: dict[str, str] | None = None,
        env_of: int | None = None,
    ) -> JobRecord:
        """Insert a job and commit durably (fsync) before returning."""
        job_spec = decode_spec(spec) if isinstance(spec, dict) else spec
        return self.add_jobs(
            name=[name],
            owner_uid=owner_uid,
            owner_gid=owner_gid,
            owner_name=owner_name,
            specs=[job_spec],
            priority=priority,
            submit_time=submit_time,
            held=held,
            env=env,
            env_of=env_of,
        )[0]

    def add_jobs(
        self,
        *,
        name: Sequence[str],
        owner_uid: int,
        owner_gid: int,
        owner_name: str,
        specs: Sequence[JobSpec],
        priority: int,
        submit_time: float,
        held: bool = False,
        env: dict[str, str] | None = None,
        env_of: int | None = None,
        array: bool = False,
    ) -> list[JobRecord]:
        """Insert jobs (one per spec) in one transaction and commit durably (fsync) before
        returning them (without their environment).  With ``array``, they are the tasks of
        one array: each spec's ``array_id`` is set to the first job's id.

        The environment (``env``, or with ``env_of`` the one job ``env_of`` has) and each
        command are stored once, as blobs named by their content: an array's tasks, and a
        job restarted a hundred times, reference one copy (:meth:`_put_blob`)."""
        state = JobState.HELD if held else JobState.QUEUED
        ids: list[int] = []
        with self.durably(), self.transaction():
            env_ref = self._env_ref(env_of) if env_of is not None else self._put_blob(env or {})
            argv_refs: dict[int, str] = {}  # id(argv) -> digest: tasks sharing one list
            for job_name, spec in zip(name, specs, strict=True):
                argv_ref = argv_refs.get(id(spec.argv))
                if argv_ref is None:
                    argv_ref = argv_refs[id(spec.argv)] = self._put_blob(spec.argv)
                cursor = self.db.execute(
                    "INSERT INTO jobs (name, owner_uid, owner_gid, owner_name, state, spec,"
                    " env, env_ref, argv_ref, priority, submit_time)"
                    " VALUES (?, ?, ?, ?, ?, ?, '{}', ?, ?, ?, ?)",
                    (
                        job_name,
                        owner_uid,
                        owner_gid,
                        owner_name,
                        state.value,
                        stored_row(spec),
                        env_ref,
                        argv_ref,
                        priority,
                        submit_time,
                    ),
                )
                ids.append(int(cursor.lastrowid or 0))
            if array and ids:
                for job_id, spec in zip(ids, specs, strict=True):
                    tagged = msgspec.structs.replace(spec, array_id=str(ids[0]))
                    self.db.execute(
                        "UPDATE jobs SET spec = ? WHERE id = ?", (stored_row(tagged), job_id)
                    )
        return self.jobs_by_id(ids)

    def jobs_by_id(self, ids: Sequence[int]) -> list[JobRecord]:
        """The jobs among ``ids`` that exist, in id order, without environments."""
        found: list[JobRecord] = []
        for start in range(0, len(ids), 500):
            chunk = list(ids[start : start + 500])
            rows = self.db.execute(
                f"SELECT {COLUMNS_WITHOUT_ENV} FROM jobs"
                f" WHERE id IN ({','.join('?' * len(chunk))}) ORDER BY id",
                chunk,
            ).fetchall()
            found.extend(self._job(row) for row in rows)
        return found

    def get_job(self, job_id: int) -> JobRecord | None:
        """One job, with its environment."""
        row = self.db.execute("SELECT * FROM jobs WHERE id = ?", (job_id,)).fetchone()
        return self._job(row) if row is not None else None

    def count_active(self, owner_uid: int) -> int:
        """The jobs ``owner_uid`` has queued, held or running: what ``[limits]
        max_queued_per_user`` bounds (the one count of what a user holds in the queue)."""
        wanted = sorted(state.value for state in ACTIVE_STATES)
        row = self.db.execute(
            "SELECT COUNT(*) FROM jobs WHERE owner_uid = ?"
            f" AND state IN ({','.join('?' * len(wanted))})",
            (owner_uid, *wanted),
        ).fetchone()
        return int(row[0])

    def jobs(self, states: Iterable[str] | None = None) -> list[JobRecord]:
        """Jobs (without their environments), in submission order."""
        if states is None:
            rows = self.db.execute(f"SELECT {COLUMNS_WITHOUT_ENV} FROM jobs ORDER BY id").fetchall()
        else:
            wanted = [JobState(state).value for state in states]
            marks = ",".join("?" * len(wanted))
            rows = self.db.execute(
                f"SELECT {COLUMNS_WITHOUT_ENV} FROM jobs WHERE state IN ({marks}) ORDER BY id",
                wanted,
            ).fetchall()
        return [self._job(row) for row in rows]

    def page_jobs(
        self,
        *,
        states: Iterable[str] | None = None,
        user: str | None = None,
        group: str | None = None,
        finished_since: float | None = None,
        before_id: int | None = None,
        limit: int = 1000,
        count: bool = True,
    ) -> tuple[list[JobRecord], int, int]:
        """``(jobs, more, hidden)``: the newest ``limit`` jobs (without environments) that
        match, newest first; ``more`` counts those that match but are older than the page, and
        ``hidden`` the finished jobs left out because they ended before ``finished_since``
        (both 0 without ``count``: a page read in parts is counted once, :meth:`page_counts`).

        Filters: ``states``; ``user`` (the owner's name); ``group`` (the job's ``--group``);
        ``finished_since`` (a time: finished jobs only if they ended since; active jobs
        always); ``before_id`` (ids below it, the next page).  The indexes on state, end time
        and owner do the work (migration 2)."""
        where, args = _page_filter(states, user, group, before_id)
        matching, matching_args = _matching(where, args, finished_since)
        clause = f" WHERE {' AND '.join(matching)}" if matching else ""
        # Filtered: find the matches through the indexes, then sort them (``+id``: not by
        # walking every row in id order, which the planner would otherwise pick for the LIMIT).
        order = "+id" if len(matching) > (before_id is not None) else "id"
        rows = self.db.execute(
            f"SELECT {COLUMNS_WITHOUT_ENV} FROM jobs{clause} ORDER BY {order} DESC LIMIT ?",
            (*matching_args, limit),
        ).fetchall()
        jobs = [self._job(row) for row in rows]
        if not count:
            return jobs, 0, 0
        last_id = jobs[-1].id if len(jobs) == limit else None
        more, hidden = self.page_counts(
            states=states,
            user=user,
            group=group,
            finished_since=finished_since,
            before_id=before_id,
            last_id=last_id,
        )
        return jobs, more, hidden

    def page_counts(
        self,
        *,
        states: Iterable[str] | None = None,
        user: str | None = None,
        group: str | None = None,
        finished_since: float | None = None,
        before_id: int | None = None,
        last_id: int | None = None,
    ) -> tuple[int, int]:
        """``(more, hidden)`` of :meth:`page_jobs` for a page whose oldest job is ``last_id``
        (``None``: the page was not full, nothing is older)."""
        where, args = _page_filter(states, user, group, before_id)
        more = 0
        if last_id is not None:
            matching, matching_args = _matching(where, args, finished_since)
            clause = f" WHERE {' AND '.join(matching)}" if matching else ""
            more = int(
                self.db.execute(
                    f"SELECT COUNT(*) FROM jobs{clause}{' AND' if clause else ' WHERE'} id < ?",
                    (*matching_args, last_id),
                ).fetchone()[0]
            )
        hidden = 0
        if finished_since is not None:
            terminal = [state.value for state in TERMINAL_STATES]
            old = [*where, f"state IN ({','.join('?' * len(terminal))})", "end_time < ?"]
            hidden = int(
                self.db.execute(
                    f"SELECT COUNT(*) FROM jobs WHERE {' AND '.join(old)}",
                    (*args, *terminal, finished_since),
                ).fetchone()[0]
            )
        return more, hidden

    def update_job(self, job_id: int, **changes: Any) -> None:
        """Change a job's columns other than its state (a state changes through
        :meth:`transition` only: ``ValueError`` here)."""
        if not changes:
            return
        if "state" in changes:
            raise ValueError("a job's state changes through StateStore.transition")
        with self.transaction():  # a replaced blob goes with the change, or neither
            self._write_job(job_id, changes)

    def transition(
        self,
        job_id: int,
        state: JobState,
        now: float,
        decision: DecisionEntry | None,
        *,
        only_from: Iterable[JobState] | None = None,
        durable: bool = True,
        admin_hold: bool | None = None,
        **changes: Any,
    ) -> bool:
        """Move job ``job_id`` to ``state``, with ``changes`` to its other columns, its
        ``decision`` line and, for an end, its entry in the outbox of ends, all in one
        transaction: either all are written or nothing is.

        A move the :class:`JobState` machine does not allow (``JobState.can_become``) raises
        :class:`IllegalTransition`, changing nothing.  With ``only_from``, a job found in
        another state is left as it is and ``False`` returned (a later record of how it ended
        is never overwritten); ``KeyError`` for a job that does not exist.  The end of an
        incarnation passes its exit here (``exit_code``, ``exit_signal``, ``replica_exits``)
        with the state it leads to, so that an end is never stored without its exit.  Committed with
        ``synchronous=FULL`` (:meth:`durably`) unless ``durable`` is false: a caller changing
        many jobs at once then calls :meth:`make_durable` once, before it answers.
        ``admin_hold`` (not ``None``) records in the same transaction whether the job is held
        by an admin (:meth:`set_admin_hold`)."""
        state = JobState(state)
        allowed = None if only_from is None else frozenset(JobState(s) for s in only_from)
        with self.durably() if durable else contextlib.nullcontext(), self.transaction():
            row = self.db.execute("SELECT state, reason FROM jobs WHERE id = ?", (job_id,))
            found = row.fetchone()
            if found is None:
                raise KeyError(f"no job {job_id}")
            before = JobState(found[0])
            if allowed is not None and before not in allowed:
                return False
            if not before.can_become(state):
                raise IllegalTransition(job_id, before, state)
            if state == JobState.QUEUED and before != JobState.QUEUED:
                changes.setdefault("queued_since", now)  # waiting from now (a release, ...)
            self._write_job(job_id, {"state": state, **changes})
            if admin_hold is not None:
                self._write_admin_hold(job_id, admin_hold)
            if state in TERMINAL_STATES:
                # a job's end and its entry in the outbox of ends (notifications) are one
                # transaction: an end is never recorded without being announced, nor twice
                reason = changes.get("reason", found[1])
                end_time = changes.get("end_time")
                self.db.execute(
                    "INSERT INTO job_ends (job_id, time, state, reason) VALUES (?, ?, ?, ?)",
                    (
                        job_id,
                        float(end_time) if end_time is not None else now,
                        state.value,
                        str(reason),
                    ),
                )
            if decision is not None:
                self.record_decision(
                    job_id, now, decision.kind, decision.reason, decision.placement,
                    decision.batch,
                )  # fmt: skip
        return True

    def _write_job(self, job_id: int, changes: dict[str, Any]) -> None:
        for name in changes:
            if name not in JOB_COLUMNS or name == "id":
                raise KeyError(f"no such job column {name!r}")
        columns = {name: column_value(name, value) for name, value in changes.items()}
        refs = [ref for key, ref in (("spec", "argv_ref"), ("env", "env_ref")) if key in changes]
        before = (
            self.db.execute(
                f"SELECT {', '.join(refs)}, owner_uid FROM jobs WHERE id = ?", (job_id,)
            ).fetchone()
            if refs
            else None
        )
        if "spec" in changes:  # the command is stored as a blob (shared with equal ones)
            spec = changes["spec"]
            spec = decode_spec(spec) if isinstance(spec, dict) else spec
            columns["spec"] = stored_row(spec)
            columns["argv_ref"] = self._put_blob(spec.argv)
        if "env" in changes:
            columns["env"], columns["env_ref"] = "{}", self._put_blob(changes["env"] or {})
        assignments = ", ".join(f"{name} = ?" for name in columns)
        values = list(columns.values())
        self.db.execute(f"UPDATE jobs SET {assignments} WHERE id = ?", (*values, job_id))
        if before is not None:  # a replaced command or environment no other job shares goes
            *replaced, owner_uid = before
            self._drop_unreferenced({str(ref) for ref in replaced if ref is not None})
            # what the owner's ended jobs keep may have changed (a blob an active job named
            # is its ended jobs' alone now): counted again at the next retention pass
            for key in [key for key in self._ended_seen if key[0] == owner_uid]:
                del self._ended_seen[key]

    def requeue_if_placed(self, job_id: int, reason: str, now: float) -> bool:
        """Queue the job again, without placement or processes, if it is still recorded as
        running or rescaling (a later record of how it ended is never overwritten), with a
        ``requeued`` decision."""
        try:
            return self.transition(
                job_id, JobState.QUEUED, now, DecisionEntry(DecisionKind.REQUEUED, reason),
                only_from=PLACED_STATES, placement={}, pids=[], last_start=None, reason=reason,
            )  # fmt: skip
        except KeyError:
            return False

    def set_admin_hold(self, job_id: int, held: bool) -> None:
        """Record whether the job's hold is an admin's (not its owner's): only an admin
        releases it (``handlers.control``).  Each hold sets it, each release clears it."""
        with self.transaction():
            self._write_admin_hold(job_id, held)

    def _write_admin_hold(self, job_id: int, held: bool) -> None:
        if held:
            self.db.execute("INSERT OR IGNORE INTO admin_holds (id) VALUES (?)", (job_id,))
        else:
            self.db.execute("DELETE FROM admin_holds WHERE id = ?", (job_id,))

    def admin_held(self, job_id: int) -> bool:
        """Whether the job's hold is an admin's (:meth:`set_admin_hold`)."""
        row = self.db.execute("SELECT 1 FROM admin_holds WHERE id = ?", (job_id,)).fetchone()
        return row is not None

    def array_tasks(self, array_id: int) -> list[JobRecord]:
        """Every task of the array whose first task is job ``array_id`` (restarted tasks
        included), in id order, without environments."""
        rows = self.db.execute(
            f"SELECT {COLUMNS_WITHOUT_ENV} FROM jobs WHERE id >= ?"
            " AND json_extract(spec, '$.array_id') = ? ORDER BY id",
            (array_id, str(array_id)),
        ).fetchall()
        return [self._job(row) for row in rows]

    def active_array_task(self, array_id: str, index: int) -> JobRecord | None:
        """The queued, held or running task of array ``array_id`` with index ``index`` (its
        oldest, should there be several), without its environment."""
        wanted = sorted(state.value for state in ACTIVE_STATES)
        row = self.db.execute(
            f"SELECT {COLUMNS_WITHOUT_ENV} FROM jobs WHERE id >= ?"
            f" AND state IN ({','.join('?' * len(wanted))})"
            " AND json_extract(spec, '$.array_id') = ?"
            " AND json_extract(spec, '$.array_index') = ? ORDER BY id LIMIT 1",
            (int(array_id), *wanted, array_id, index),
        ).fetchone()
        return self._job(row) if row is not None else None

    def states_of(self, ids: Iterable[int]) -> dict[int, JobState]:
        """The current state of each job that exists among ``ids``, and the end of each that
        retention removed while active jobs waited for it (``dependency_outcomes``: what
        ``--after`` needs of it)."""
        wanted = sorted(set(ids))
        found: dict[int, JobState] = {}
        for start in range(0, len(wanted), 500):
            chunk = wanted[start : start + 500]
            marks = ",".join("?" * len(chunk))
            rows = self.db.execute(
                f"SELECT id, state FROM jobs WHERE id IN ({marks}) UNION ALL"
                f" SELECT id, state FROM dependency_outcomes WHERE id IN ({marks})",
                (*chunk, *chunk),
            ).fetchall()
            found.update((int(row[0]), JobState(row[1])) for row in rows)
        return found

    def count_jobs(self) -> int:
        return int(self.db.execute("SELECT COUNT(*) FROM jobs").fetchone()[0])


def _page_filter(
    states: Iterable[str] | None, user: str | None, group: str | None, before_id: int | None
) -> tuple[list[str], list[Any]]:
    """The SQL terms (and their arguments) of a page's filters, finished-time aside."""
    where: list[str] = []
    args: list[Any] = []
    if states is not None:
        wanted = sorted({JobState(state).value for state in states})
        where.append(f"state IN ({','.join('?' * len(wanted))})" if wanted else "0")
        args.extend(wanted)
    if user is not None:
        where.append("owner_name = ?")
        args.append(user)
    if group is not None:
        where.append("json_extract(spec, '$.group') = ?")
        args.append(group)
    if before_id is not None:
        where.append("id < ?")
        args.append(before_id)
    return where, args


def _matching(
    where: list[str], args: list[Any], finished_since: float | None
) -> tuple[list[str], list[Any]]:
    """The filters with the finished-time window: active jobs always, finished ones only if
    they ended since ``finished_since`` (each term has its index: the OR is a union)."""
    if finished_since is None:
        return list(where), list(args)
    active = sorted(state.value for state in ACTIVE_STATES)
    marks = ",".join("?" * len(active))
    term = f"(state IN ({marks}) OR end_time IS NULL OR end_time >= ?)"
    return [*where, term], [*args, *active, finished_since]
