"""The daemon's state kept whole: the database checked before use (quick_check, schema
versions and migrations, an empty file where history was expected), its files private from
the first byte, and failed writes that leave jobs consistent (cancel, hold, a scheduling pass).
"""

from __future__ import annotations

import asyncio
import logging
import os
import sqlite3
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pollux_local.api.errors import InternalError
from pollux_local.api.messages import Cancel, Hold
from pollux_local.api.spec import JobSpec
from pollux_local.core.baselines import FifoPolicy
from pollux_local.daemon.handlers import control
from pollux_local.daemon.state import (
    MIGRATIONS,
    SCHEMA_VERSION,
    StateError,
    StateStore,
    open_state,
)
from pollux_local.daemon.statedir import prepare_state_dir
from tests.paths import REPO_ROOT
from tests.scheduler_harness import Harness

pytestmark = pytest.mark.timeout(120)


def add(store: StateStore, name: str = "j") -> int:
    return store.add_job(
        name=name, owner_uid=1, owner_gid=1, owner_name="ann",
        spec={"argv": ["x"], "workdir": "/tmp"}, priority=0, submit_time=1.0, env={"SECRET": "1"},
    ).id  # fmt: skip


def mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


def one_line(exc: BaseException) -> str:
    text = str(exc)
    assert "\n" not in text and text
    return text


# --- files: private from the first byte, never through a symlink --------------------------------


def test_database_and_its_wal_and_shm_are_0600_whatever_the_umask(tmp_path: Path) -> None:
    before = os.umask(0o022)
    try:
        store = StateStore(tmp_path / "state.db")
        add(store)
        names = ("state.db", "state.db-wal", "state.db-shm")
        assert {name: mode(tmp_path / name) for name in names} == dict.fromkeys(names, 0o600)
        store.close()
    finally:
        os.umask(before)


def test_older_world_readable_files_are_made_private(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    StateStore(path).close()
    path.chmod(0o644)
    StateStore(path).close()
    assert mode(path) == 0o600


def test_a_symlinked_database_or_state_dir_is_refused(tmp_path: Path) -> None:
    real = tmp_path / "elsewhere.db"
    StateStore(real).close()
    (tmp_path / "state.db").symlink_to(real)
    with pytest.raises(StateError, match="is a symlink") as caught:
        StateStore(tmp_path / "state.db")
    one_line(caught.value)

    target = tmp_path / "real-state"
    target.mkdir()
    link = tmp_path / "state-link"
    link.symlink_to(target)
    with pytest.raises(Exception, match="is a symlink") as refused:
        prepare_state_dir(link)
    assert str(link) in one_line(refused.value)
    assert not (target / "jobs").exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")
def test_a_state_dir_of_another_user_is_refused(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir()
    os.chown(state, 65534, 65534)
    with pytest.raises(Exception, match="belongs to uid 65534") as refused:
        prepare_state_dir(state)
    one_line(refused.value)


def test_state_dir_is_0755_and_group_or_other_write_is_removed(tmp_path: Path) -> None:
    before = os.umask(0o077)
    try:
        prepare_state_dir(tmp_path / "new" / "state")
    finally:
        os.umask(before)
    assert mode(tmp_path / "new" / "state") == 0o755
    assert mode(tmp_path / "new" / "state" / "jobs") == 0o755
    (tmp_path / "new" / "state").chmod(0o777)
    prepare_state_dir(tmp_path / "new" / "state")
    assert mode(tmp_path / "new" / "state") == 0o755


# --- integrity and schema versions ---------------------------------------------------------------


def test_a_file_that_is_not_a_database_is_refused_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    path.write_bytes(b"definitely not SQLite " * 300)
    path.chmod(0o600)
    with pytest.raises(StateError) as caught:
        StateStore(path)
    line = one_line(caught.value)
    assert str(path) in line and "damaged" in line and "--reset-state" in line


def test_a_damaged_page_is_found_by_quick_check(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    store = StateStore(path)
    for i in range(300):
        add(store, f"job-{i}-" + "x" * 200)
    store.db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    store.close()
    data = bytearray(path.read_bytes())
    page = 4096
    assert len(data) > 6 * page
    for offset in range(3 * page, 5 * page, 64):  # scribble over two b-tree pages
        data[offset : offset + 8] = b"\xde\xad\xbe\xef" * 2
    path.write_bytes(bytes(data))
    with pytest.raises(StateError) as caught:
        StateStore(path)
    line = one_line(caught.value)
    assert str(path) in line and "damaged" in line and "restore it from a backup" in line


def test_schema_version_and_migrations_in_order(tmp_path: Path) -> None:
    assert [number for number, _, _ in MIGRATIONS] == list(range(1, SCHEMA_VERSION + 1))
    store = StateStore(tmp_path / "new.db")
    assert store.version == SCHEMA_VERSION == 9
    assert store.schema_version() == SCHEMA_VERSION
    store.close()

    # a database written before versions were recorded: version 1's tables, no version row
    old = tmp_path / "old.db"
    db = sqlite3.connect(old)
    db.executescript(MIGRATIONS[0][2])
    db.execute(
        "INSERT INTO jobs (name, owner_uid, owner_gid, owner_name, state, spec, submit_time)"
        " VALUES ('kept', 1, 1, 'ann', 'succeeded', '{}', 1.0)"
    )
    db.commit()
    db.close()
    old.chmod(0o600)
    store = StateStore(old)
    assert store.version == SCHEMA_VERSION
    indexes = {r[0] for r in store.db.execute("SELECT name FROM sqlite_master WHERE type='index'")}
    assert {"jobs_end_time", "jobs_owner", "jobs_state"} <= indexes
    assert [job.name for job in store.jobs()] == ["kept"]
    # version 3: typed device-seconds, the outbox of job ends, the drained devices
    assert store.jobs()[0].device_seconds == {}
    assert store.pending_ends() == [] and store.withheld() == []
    # version 8: the outcomes of removed jobs waited for (none yet)
    assert tuple(store.db.execute("SELECT COUNT(*) FROM dependency_outcomes").fetchone()) == (0,)
    store.close()


def test_a_database_older_than_schema_versions_logs_its_migrations(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A database with tables but no recorded version (written before versions were) is
    upgraded with a line per step, as any older one; a new empty database stays quiet."""
    with caplog.at_level(logging.INFO, logger="pollux_local.daemon"):
        StateStore(tmp_path / "new.db").close()
    assert [r.getMessage() for r in caplog.records if "schema" in r.getMessage()] == []
    old = tmp_path / "old.db"
    db = sqlite3.connect(old)
    db.executescript(MIGRATIONS[0][2])
    db.close()
    old.chmod(0o600)
    with caplog.at_level(logging.INFO, logger="pollux_local.daemon"):
        StateStore(old).close()
    said = [r.getMessage() for r in caplog.records if "schema" in r.getMessage()]
    assert len(said) == SCHEMA_VERSION, said  # every step, the first one too
    assert said[0].startswith(f"state database {old}: schema 0 -> 1 (")
    assert said[-1].startswith(f"state database {old}: schema {SCHEMA_VERSION - 1} -> ")


def test_migration_6_removes_the_blobs_no_job_references(tmp_path: Path) -> None:
    """Before version 6 an edit left its job's old command behind for ever (a user filled
    the disk at 22 MB/s editing one held job); the upgrade removes what no job references."""
    path = tmp_path / "state.db"
    store = StateStore(path)
    job = store.add_job(
        name="j", owner_uid=1, owner_gid=1, owner_name="ann",
        spec=JobSpec(argv=["train"], workdir="/"), priority=0, submit_time=0.0, env={"A": "1"},
    )  # fmt: skip
    store.db.executescript(
        "INSERT INTO blobs (digest, data, size) VALUES ('orphan', '[\"old\"]', 7);"
        "DROP INDEX jobs_argv_ref; DROP INDEX jobs_env_ref; DROP INDEX jobs_owner_kept;"
        "UPDATE meta SET value = '5' WHERE key = 'schema_version';"
    )
    store.close()
    store = StateStore(path)
    assert store.version == SCHEMA_VERSION  # through 6, and on
    indexes = {r[0] for r in store.db.execute("SELECT name FROM sqlite_master WHERE type='index'")}
    assert {"jobs_argv_ref", "jobs_env_ref", "jobs_owner_kept", "blobs_size"} <= indexes
    digests = {row[0] for row in store.db.execute("SELECT digest FROM blobs")}
    assert "orphan" not in digests and len(digests) == 2  # the job's command and environment
    got = store.get_job(job.id)
    assert got is not None and got.spec.argv == ["train"] and got.env == {"A": "1"}
    store.close()


def test_a_database_from_a_newer_version_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    store = StateStore(path)
    store.db.execute("UPDATE meta SET value = '99' WHERE key = 'schema_version'")
    store.close()
    with pytest.raises(StateError) as caught:
        StateStore(path)
    line = one_line(caught.value)
    assert "schema version 99" in line and f"knows ({SCHEMA_VERSION})" in line


def test_an_empty_database_where_history_was_expected_is_refused(tmp_path: Path) -> None:
    state = tmp_path / "state"
    prepare_state_dir(state)
    (state / "jobs" / "7").mkdir()
    (state / "jobs" / "7" / "rank0.log").write_text("old job\n")
    (state / "state.db").write_bytes(b"")
    with pytest.raises(StateError) as caught:
        open_state(state)
    line = one_line(caught.value)
    assert "is empty (0 bytes)" in line and "jobs/ holds 1 entry" in line
    assert "--reset-state" in line
    (state / "state.db").unlink()
    with pytest.raises(StateError, match="is missing"):
        open_state(state)  # deleted by hand, the job directories left: refused too

    # an empty file and nothing else is a fresh start
    fresh = tmp_path / "fresh"
    prepare_state_dir(fresh)
    (fresh / "state.db").write_bytes(b"")
    open_state(fresh).close()


def test_reset_state_sets_the_refused_state_aside_and_starts_empty(tmp_path: Path) -> None:
    state = tmp_path / "state"
    prepare_state_dir(state)
    (state / "jobs" / "3").mkdir()
    (state / "state.db").write_bytes(b"garbage, not a database" * 100)
    with pytest.raises(StateError):
        open_state(state)
    store = open_state(state, reset=True)
    try:
        aside = store.set_aside_to
        assert aside is not None and aside.parent == state and aside.name.startswith("reset-")
        assert (aside / "state.db").read_bytes().startswith(b"garbage")
        assert (aside / "jobs" / "3").is_dir()
        assert list((state / "jobs").iterdir()) == [] and store.jobs() == []
        assert mode(aside) == 0o700 and mode(state / "state.db") == 0o600
    finally:
        store.close()
    # a healthy database is never reset
    again = open_state(state, reset=True)
    assert again.set_aside_to is None
    again.close()


def test_the_daemon_refuses_a_damaged_database_in_one_line(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir()
    (state / "state.db").write_bytes(b"not a database" * 500)
    (state / "state.db").chmod(0o600)
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), OMP_NUM_THREADS="1")
    done = subprocess.run(
        [sys.executable, "-m", "pollux_local", "daemon", "--state-dir", str(state),
         "--devices", "cpu:1"],
        capture_output=True, text=True, env=env, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    errors = [line for line in done.stderr.splitlines() if "error" in line]
    assert len(errors) == 1 and str(state / "state.db") in errors[0], done.stderr
    assert "Traceback" not in done.stderr
    assert not (state / "daemon.sock").exists()


# --- failed writes leave jobs consistent ---------------------------------------------------------


class FailingWrites:
    """A job's write (``update_job`` or ``transition``) raising
    ``sqlite3.OperationalError`` for the changes ``when`` picks (``times`` times at most)."""

    def __init__(self, store: StateStore, when: Any, times: int = 1) -> None:
        self.store = store
        self.when = when
        self.left = times
        self.original = store._write_job

    def __call__(self, job_id: int, changes: dict[str, Any]) -> None:
        if self.left and self.when(changes):
            self.left -= 1
            raise sqlite3.OperationalError("disk I/O error")
        self.original(job_id, changes)

    def __enter__(self) -> FailingWrites:
        self.store._write_job = self  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        self.store._write_job = self.original  # type: ignore[method-assign]


async def settle(harness: Harness) -> None:
    """Let the executor's background stops and exit handlers run."""
    for _ in range(20):
        await asyncio.sleep(0)


@pytest.fixture()
def harness(tmp_path: Path) -> Iterator[Harness]:
    made = Harness(tmp_path / "state", [1], FifoPolicy())
    yield made
    made.store.close()


@pytest.mark.asyncio
@pytest.mark.parametrize("verb", ["cancel", "hold"])
async def test_a_failed_state_write_refuses_the_request_and_changes_nothing(
    harness: Harness, verb: str
) -> None:
    job_id = harness.submit()
    await harness.tick()
    assert harness.job(job_id).state == "running"
    group = harness.launcher.launches[str(job_id)][-1]
    ctx = harness.context()
    request = Cancel(ids=[str(job_id)]) if verb == "cancel" else Hold(id=str(job_id))
    handler = control.cancel if verb == "cancel" else control.hold
    with (
        FailingWrites(harness.store, lambda changes: "state" in changes),
        pytest.raises(InternalError) as caught,
    ):
        await handler(ctx, request)  # type: ignore[operator]
    line = one_line(caught.value)
    assert f"could not {verb} job {job_id}" in line and "left as it was" in line
    # nothing changed: still recorded as running, its replicas still running, tracked
    assert harness.job(job_id).state == "running" and harness.job(job_id).placement
    assert group.poll() is None and job_id in harness.executor.groups
    await harness.tick(1.0)
    assert harness.executor.groups[job_id] is group  # not restarted twice, not lost

    # the same request without the failure: recorded, then stopped
    await handler(ctx, request)  # type: ignore[operator]
    expected = "cancelled" if verb == "cancel" else "held"
    assert harness.job(job_id).state == expected
    await settle(harness)
    assert group.poll() == 75 and job_id not in harness.executor.groups
    assert job_id not in harness.executor.stopping and not harness.job(job_id).placement


@pytest.mark.asyncio
async def test_a_write_failing_after_the_stop_still_leaves_no_process_and_no_ghost(
    harness: Harness,
) -> None:
    first = harness.submit()
    second = harness.submit()
    await harness.tick()
    group = harness.launcher.launches[str(first)][-1]
    ctx = harness.context()
    # the accounting written once the replicas are stopped fails (twice: and its retry)
    failing = FailingWrites(harness.store, lambda changes: "attained_gpu_s" in changes, times=2)
    with failing:
        reply = await control.cancel(ctx, Cancel(ids=[str(first)]))
        await settle(harness)
    assert reply.cancelled == [str(first)]
    assert harness.job(first).state == "cancelled" and group.poll() == 75
    assert first not in harness.executor.groups and first not in harness.executor.stopping
    # the device is free: the next job starts on the next pass
    await harness.tick(1.0)
    assert harness.job(second).state == "running"


@pytest.mark.asyncio
async def test_a_write_failing_in_a_pass_is_logged_and_repaired_next_pass(
    harness: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    job_id = harness.submit()
    loop = harness.loop
    # the record of the start fails: the replicas run, the store still says queued
    with (
        FailingWrites(harness.store, lambda changes: changes.get("state") == "running"),
        pytest.raises(sqlite3.OperationalError),
    ):
        await loop.schedule_once()
    orphan = harness.launcher.launches[str(job_id)][-1]
    assert harness.job(job_id).state == "queued" and orphan.poll() is None

    with caplog.at_level(logging.WARNING, logger="pollux_local.daemon"):
        await harness.tick(1.0)
        await settle(harness)
    assert orphan.poll() == 75, "the unrecorded replicas were not stopped"
    assert "does not record" in caplog.text
    assert job_id not in harness.executor.stopping  # its end was handled: devices released
    await harness.tick(1.0)
    assert harness.job(job_id).state == "running"
    assert len(harness.launcher.launches[str(job_id)]) == 2
    assert harness.executor.groups[job_id] is harness.launcher.launches[str(job_id)][-1]

    # the other way round: recorded as running, no replicas (a lost record of an exit)
    harness.executor.groups.pop(job_id)
    harness.executor.watchers.pop(job_id).cancel()
    await settle(harness)
    await harness.tick(1.0)
    assert harness.job(job_id).state == "running"
    assert len(harness.launcher.launches[str(job_id)]) == 3
    kinds = [d["kind"] for d in harness.decisions(job_id)]
    assert "requeued" in kinds


@pytest.mark.asyncio
async def test_the_loop_retries_soon_after_a_database_error(
    harness: Harness, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from pollux_local.daemon import loop as loop_module

    monkeypatch.setattr(loop_module, "RETRY_S", 0.05)
    monkeypatch.setattr(loop_module, "COALESCE_S", 0.0)
    passes: list[int] = []
    original = harness.loop.schedule_once

    async def flaky() -> None:
        passes.append(1)
        if len(passes) == 1:
            raise sqlite3.OperationalError("database is locked")
        await original()

    monkeypatch.setattr(harness.loop, "schedule_once", flaky)
    harness.submit()
    harness.loop.wake()
    with caplog.at_level(logging.ERROR, logger="pollux_local.daemon"):
        task = asyncio.ensure_future(harness.loop.run())
        for _ in range(100):
            if len(passes) >= 2:
                break
            await asyncio.sleep(0.02)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    assert len(passes) >= 2, "no pass after the failed one (it waited a whole interval)"
    assert "database error" in caplog.text and harness.loop.write_failures == 1
