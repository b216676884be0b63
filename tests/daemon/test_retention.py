"""Each user's newest ``[limits] max_ended_per_user`` ended jobs are kept; older ones go, with
their decisions, history and announced ends and the stored commands no job names any more.
Kept whatever their age: jobs an active job waits for, every task of an array with an
active task, and a job whose end is not announced yet."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from pollux_local.api.spec import JobSpec
from pollux_local.api.states import DecisionKind, JobState
from pollux_local.daemon.state import DecisionEntry, StateStore


def add(store: StateStore, uid: int, now: float, **spec: object) -> int:
    job = store.add_job(
        name=f"j{now:g}", owner_uid=uid, owner_gid=uid, owner_name=f"u{uid}",
        spec=JobSpec(argv=["train", str(now)], workdir="/", **spec),  # type: ignore[arg-type]
        priority=0, submit_time=now, env={"SEED": str(now)},
    )  # fmt: skip
    return job.id


def end(store: StateStore, job_id: int, now: float) -> None:
    store.transition(job_id, JobState.CANCELLED, now, DecisionEntry(DecisionKind.CANCELLED, "cancelled"),
                     end_time=now)  # fmt: skip
    store.add_history(job_id, now, 1.0, 2.0)


def announce_all(store: StateStore) -> None:
    store.mark_announced(*[entry.seq for entry in store.pending_ends(10_000)])


def test_each_users_oldest_ended_jobs_beyond_the_cap_are_removed(tmp_path: Path) -> None:
    store = StateStore(tmp_path / "state.db")
    mine = [add(store, 1001, float(t)) for t in range(10)]
    theirs = [add(store, 1002, 100.0 + t) for t in range(3)]
    for number, job_id in enumerate(mine + theirs):
        end(store, job_id, 1000.0 + number)
    announce_all(store)
    (blobs_before,) = store.db.execute("SELECT COUNT(*) FROM blobs").fetchone()

    removed = store.prune_ended(keep_per_user=4)
    assert sorted(removed) == mine[:6]  # the six oldest of uid 1001; uid 1002 under the cap
    assert [store.get_job(i) is None for i in mine] == [True] * 6 + [False] * 4
    assert all(store.get_job(i) is not None for i in theirs)
    for table in ("decisions", "history", "job_ends"):
        (left,) = store.db.execute(
            f"SELECT COUNT(*) FROM {table} WHERE job_id IN ({','.join('?' * 6)})", mine[:6]
        ).fetchone()
        assert left == 0, table
    (blobs_after,) = store.db.execute("SELECT COUNT(*) FROM blobs").fetchone()
    assert blobs_after == blobs_before - 12  # each removed job's own command and environment
    kept = store.get_job(mine[-1])
    assert kept is not None and kept.env == {"SEED": "9.0"}  # a kept job still reads whole
    assert store.prune_ended(keep_per_user=4) == []
    assert store.prune_ended(keep_per_user=0) == []  # 0: everything kept


def test_jobs_that_must_stay_are_kept_whatever_their_age(tmp_path: Path) -> None:
    store = StateStore(tmp_path / "state.db")
    waited = add(store, 1001, 1.0)
    array_first = add(store, 1001, 2.0)
    array_spec = {"array_id": str(array_first), "array_index": 1}
    array_ended = add(store, 1001, 3.0, **array_spec)
    unannounced = add(store, 1001, 4.0)
    plain = add(store, 1001, 5.0)
    for number, job_id in enumerate((waited, array_ended, plain)):
        end(store, job_id, 10.0 + number)
    announce_all(store)
    end(store, unannounced, 20.0)  # its end not announced yet
    newer = [add(store, 1001, 30.0 + t) for t in range(3)]
    for number, job_id in enumerate(newer):
        end(store, job_id, 40.0 + number)
    announce_all_but = [e.seq for e in store.pending_ends(100) if e.job_id != unannounced]
    store.mark_announced(*announce_all_but)
    waiter = add(store, 1001, 50.0, after=[str(waited)])  # queued, waits for ``waited``
    add(store, 1001, 51.0, array_id=str(array_first), array_index=2)  # the array's live task
    # array_first itself is queued (a task of the array): nothing else is active

    removed = store.prune_ended(keep_per_user=1)
    assert removed == [waited, plain] + newer[:2]
    for job_id in (array_ended, unannounced):
        assert store.get_job(job_id) is not None
    # what waits for a removed job reads how it ended, for as long as it waits
    assert store.get_job(waited) is None
    assert store.states_of([waited]) == {waited: JobState.CANCELLED}
    store.transition(waiter, JobState.CANCELLED, 60.0, None, end_time=60.0)
    announce_all(store)
    store.prune_ended(keep_per_user=100)  # removes nothing: the outcome goes all the same
    assert store.states_of([waited]) == {}  # nobody waits for it now


def test_old_jobs_made_to_stay_do_not_shield_the_newer_ones_behind_them(tmp_path: Path) -> None:
    """An owner whose oldest ended jobs must stay (40 whose ends are not announced yet) still
    has everything else beyond the cap removed, in batches, oldest first; before, each batch
    looked at the oldest ones only, kept them all and removed nothing, for ever."""
    store = StateStore(tmp_path / "state.db")
    ids = [add(store, 1001, float(t)) for t in range(100)]
    for number, job_id in enumerate(ids):
        end(store, job_id, 1000.0 + number)
    store.mark_announced(*[e.seq for e in store.pending_ends(1000) if e.job_id not in ids[:40]])
    assert store.prune_ended(keep_per_user=10, batch=30) == ids[40:70]
    assert store.prune_ended(keep_per_user=10, batch=30) == ids[70:90]
    assert store.prune_ended(keep_per_user=10, batch=30) == []
    assert all(store.get_job(i) is not None for i in ids[:40] + ids[90:])


def test_a_long_after_list_keeps_outcomes_not_rows(tmp_path: Path) -> None:
    """A held job waiting for a thousand ended jobs kept their thousand rows past the count
    cap, for as long as it stayed held (a third review: up to a thousand active jobs of a
    thousand ids each, about 1 GB per user).  They go like any other now; each leaves its id
    and state, which is all that waits for them reads: the waiter's verdict is the same."""
    from pollux_local.daemon.scheduler import after_summary

    store = StateStore(tmp_path / "state.db")
    ids = [add(store, 1001, float(t)) for t in range(100)]
    for number, job_id in enumerate(ids):
        store.transition(job_id, JobState.SUCCEEDED, 1000.0 + number, None, end_time=1000.0)
    announce_all(store)
    pending = add(store, 1001, 1500.0)
    waiter = add(store, 1001, 2000.0, after=[*map(str, ids[:40]), str(pending)])
    job = store.get_job(waiter)
    assert job is not None
    before = after_summary(job, store.states_of(map(int, job.spec.after)))
    assert store.prune_ended(keep_per_user=10) == ids[:90]
    assert all(store.get_job(i) is None for i in ids[:90])
    (outcomes,) = store.db.execute("SELECT COUNT(*) FROM dependency_outcomes").fetchone()
    assert outcomes == 40  # those waited for only
    after = after_summary(job, store.states_of(map(int, job.spec.after)))
    assert after == before and after.pending == () and after.after[0].job_id == pending


def test_the_cap_is_a_setting_of_its_own(tmp_path: Path) -> None:
    import pytest

    from pollux_local.api.errors import PolluxError
    from pollux_local.daemon.config import load_config

    path = tmp_path / "config.toml"
    path.write_text("[limits]\n")
    assert load_config(path, devices="cpu:1").max_ended_per_user == 10_000
    path.write_text("[limits]\nmax_ended_per_user = 0\n")
    assert load_config(path, devices="cpu:1").max_ended_per_user == 0
    path.write_text("[limits]\nmax_ended_per_user = -1\n")
    with pytest.raises(PolluxError, match="max_ended_per_user must be between 0 and"):
        load_config(path, devices="cpu:1")


def test_the_ids_of_removed_jobs_are_those_given_and_gone(tmp_path: Path) -> None:
    """What ``jobs/`` may hold a directory for that no job has any more: an id given and
    removed; never one above the highest id given (a directory there is no removed job's)."""
    store = StateStore(tmp_path / "state.db")
    ids = [add(store, 1001, float(t)) for t in range(4)]
    for number, job_id in enumerate(ids):
        end(store, job_id, 1000.0 + number)
    announce_all(store)
    removed = store.prune_ended(keep_per_user=2)
    assert removed == ids[:2]
    later = ids[-1] + 1
    assert store.removed_ids([*ids, later, later + 7]) == ids[:2]
    assert store.removed_ids([]) == []


def test_one_owner_whose_removal_hangs_holds_up_only_their_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The directories of removed jobs go by a task per owner: one owner stopping the
    removal that runs as them (a ``SIGSTOP``) delays only their own; at the stop every
    removal still running is called off."""
    import asyncio
    import dataclasses
    import os

    from pollux_local.core.baselines import FifoPolicy
    from pollux_local.daemon import loop as loop_module
    from tests.scheduler_harness import Harness

    harness = Harness(tmp_path / "d", [1], FifoPolicy())
    harness.loop.config = dataclasses.replace(harness.config, max_ended_per_user=1)
    store = harness.store
    ids = {uid: [add(store, uid, float(uid * 10 + t)) for t in range(3)] for uid in (1001, 1002)}
    for job_id in [*ids[1001], *ids[1002]]:
        end(store, job_id, 1000.0 + job_id)
        directory = tmp_path / "d" / "jobs" / str(job_id)
        directory.mkdir(parents=True)
        os.chown(directory, store.get_job(job_id).owner_uid, 0)  # type: ignore[union-attr]
    announce_all(store)
    removed: list[int] = []
    stalled = asyncio.Event()

    async def fake_remove(jobs_dir: Path, job_id: int) -> str | None:
        if job_id in ids[1001]:
            await stalled.wait()  # 1001 stopped their find: never comes back
        removed.append(job_id)
        return None

    monkeypatch.setattr(loop_module, "remove_job_dir", fake_remove)

    async def main() -> None:
        harness.loop.prune_ended()
        for _ in range(20):
            await asyncio.sleep(0)
        assert removed == ids[1002][:2]  # bob's two oldest, while ann's first hangs
        harness.loop.stop()
        await asyncio.sleep(0)
        assert all(task.done() for task in harness.loop._dir_removers.values())

    asyncio.run(main())


def test_a_backlog_beyond_the_cap_is_removed_in_batches_pass_after_pass(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ended jobs made faster than one batch a minute (a user's loop of held arrays and
    cancels made 1,300 a second) are removed batch after batch within a pass's budget, and
    while a batch comes back full the next pass removes more after ``PRUNE_AGAIN_S`` (or
    more, at most a share of the daemon's time)."""
    import dataclasses

    from pollux_local.core.baselines import FifoPolicy
    from pollux_local.daemon import loop as loop_module
    from pollux_local.daemon.state import retention
    from tests.scheduler_harness import Harness

    harness = Harness(tmp_path / "d", [1], FifoPolicy())
    harness.loop.config = dataclasses.replace(harness.config, max_ended_per_user=10)
    store = harness.store
    ids = [add(store, 1001, float(t)) for t in range(130)]
    for job_id in ids:
        end(store, job_id, 1000.0 + job_id)
    announce_all(store)
    monkeypatch.setattr(retention, "PRUNE_BATCH", 25)  # the store's batch
    monkeypatch.setattr(loop_module, "PRUNE_BATCH", 25)
    real, remove = store.prune_ended, store._remove_jobs
    batches: list[int] = []

    def in_batches_of_25(keep_per_user: int, **kwargs: Any) -> list[int]:
        return real(keep_per_user, batch=25, **kwargs)

    def counted(ids: list[int]) -> None:
        batches.append(len(ids))
        remove(ids)

    monkeypatch.setattr(store, "prune_ended", in_batches_of_25)
    monkeypatch.setattr(store, "_remove_jobs", counted)
    monkeypatch.setattr(loop_module, "PRUNE_BUDGET_S", 60.0)
    harness.loop.prune_ended()
    assert batches == [25, 25, 25, 25, 20] and not harness.loop.prune_soon
    assert [store.get_job(i) is None for i in ids] == [True] * 120 + [False] * 10

    more = [add(store, 1001, 2000.0 + t) for t in range(60)]
    for job_id in more:
        end(store, job_id, 3000.0 + job_id)
    announce_all(store)
    monkeypatch.setattr(loop_module, "PRUNE_BUDGET_S", 0.0)  # one batch a pass
    harness.loop._next_prune = 0.0
    began = time.monotonic()
    harness.loop.prune_ended()
    assert harness.loop._next_prune >= began + loop_module.PRUNE_AGAIN_S
    # one batch: the 10 kept before (the oldest now) and the 15 oldest new ones
    assert harness.loop.prune_soon and store.get_job(more[14]) is None
    assert store.get_job(more[15]) is not None  # left to the next pass, soon


def test_a_job_whose_processes_still_stop_is_kept(tmp_path: Path) -> None:
    """A cancelled job in its stop grace has ended in the store but not on its devices: its
    record (whose owner its devices still count against) and directory stay until it is gone."""
    store = StateStore(tmp_path / "state.db")
    ids = [add(store, 1001, float(t)) for t in range(6)]
    for number, job_id in enumerate(ids):
        end(store, job_id, 1000.0 + number)
    announce_all(store)
    assert store.prune_ended(keep_per_user=2, live=[ids[0]]) == ids[1:4]
    assert store.get_job(ids[0]) is not None


def test_a_replaced_command_or_environment_goes_unless_another_job_shares_it(
    tmp_path: Path,
) -> None:
    """An edit (``update_job``) of a held job's command or environment removes the blob it
    replaced, unless another job references it: a user editing one held job in a loop once
    grew the database by 22 MB/s, for ever."""
    store = StateStore(tmp_path / "state.db")
    first = add(store, 1001, 1.0)
    twin = add(store, 1001, 1.0)  # the same command and environment: shared blobs

    def blobs() -> int:
        return int(store.db.execute("SELECT COUNT(*) FROM blobs").fetchone()[0])

    assert blobs() == 2
    for number in range(5):
        spec = JobSpec(argv=["train", "x" * 1000, str(number)], workdir="/")
        store.update_job(first, spec=spec, env={"SEED": str(number)})
        # the twin's two, the first job's new two; the replaced ones went (but the twin's)
        assert blobs() == 4
    store.update_job(twin, spec=JobSpec(argv=["other"], workdir="/"))
    assert blobs() == 4  # the twin's old command went, its environment stays
    got = store.get_job(first)
    assert got is not None and got.spec.argv[-1] == "4" and got.env == {"SEED": "4"}
    store.update_job(first, priority=3)  # no command or environment: nothing goes
    assert blobs() == 4


def add_fat(store: StateStore, uid: int, now: float, megabytes: int, **spec: object) -> int:
    """A job whose environment, its own, is ``megabytes`` MB (a new one each job)."""
    job = store.add_job(
        name=f"j{now:g}", owner_uid=uid, owner_gid=uid, owner_name=f"u{uid}",
        spec=JobSpec(argv=["train"], workdir="/", **spec),  # type: ignore[arg-type]
        priority=0, submit_time=now, env={"PAD": f"{now:g}" + "x" * (megabytes << 20)},
    )  # fmt: skip
    return job.id


def test_what_a_users_ended_jobs_keep_is_bounded_in_bytes_too(tmp_path: Path) -> None:
    """Ended jobs keep their commands and environments (for ``restart``), which
    ``max_stored_per_user`` counts only while jobs are active: a user could submit a 4 MB
    environment, new each time, and cancel it, and 10,000 of those kept (the count's cap) are
    40 GB on root's disk.  Past their newest that keep ``keep_bytes_per_user``, a user's ended
    jobs go (oldest first), and another user's are not touched."""
    store = StateStore(tmp_path / "state.db")
    fat = [add_fat(store, 1001, float(t), 1) for t in range(8)]
    small = [add(store, 1002, 100.0 + t) for t in range(3)]
    for number, job_id in enumerate(fat + small):
        end(store, job_id, 1000.0 + number)
    announce_all(store)
    add(store, 1001, 2000.0, after=[str(fat[0])])  # queued, waits for the oldest
    assert store.ended_bytes(1001) > 8 << 20

    removed = store.prune_ended(keep_per_user=10_000, keep_bytes_per_user=3 << 20)
    assert removed == fat[:6]  # the newest two (and their rows) fit 3 MB
    assert all(store.get_job(i) is not None for i in [*fat[6:], *small])
    assert store.states_of([fat[0]]) == {fat[0]: JobState.CANCELLED}  # for what waits for it
    assert store.ended_bytes(1001) < 3 << 20  # the two newest
    (blob_bytes,) = store.db.execute("SELECT SUM(size) FROM blobs").fetchone()
    assert blob_bytes < 4 << 20  # the removed environments went with their jobs
    assert store.prune_ended(keep_per_user=10_000, keep_bytes_per_user=3 << 20) == []
    # 0: no bound but the count
    assert store.prune_ended(keep_per_user=10_000, keep_bytes_per_user=0) == []


def sharing_one_environment(store: StateStore, jobs: int, ended: int) -> list[int]:
    """``jobs`` jobs of uid 1001 naming one 2 MB environment, the first ``ended`` of them
    ended (and announced), the others queued."""
    shared = {"PAD": "y" * (2 << 20)}
    ids = []
    for t in range(jobs):
        job = store.add_job(
            name=f"j{t}", owner_uid=1001, owner_gid=1001, owner_name="u1001",
            spec=JobSpec(argv=["train"], workdir="/"), priority=0, submit_time=float(t),
            env=shared,
        )  # fmt: skip
        ids.append(job.id)
    for number, job_id in enumerate(ids[:ended]):
        end(store, job_id, 100.0 + number)
    announce_all(store)
    return ids


def test_an_environment_an_active_job_keeps_is_not_counted_against_the_ended_ones(
    tmp_path: Path,
) -> None:
    """The ended jobs' bytes are what removing them could free: a blob an active job of the
    user also names stays whatever becomes of them, and is not counted."""
    store = StateStore(tmp_path / "state.db")
    sharing_one_environment(store, jobs=5, ended=4)
    assert store.ended_bytes(1001) < 1 << 20  # the rows only: ids[4], queued, names the blob
    assert store.prune_ended(keep_per_user=10_000, keep_bytes_per_user=1 << 20) == []


def test_the_ended_bytes_cap_is_a_setting_of_its_own(tmp_path: Path) -> None:
    from pollux_local.daemon.config import load_config

    path = tmp_path / "config.toml"
    path.write_text("[limits]\n")
    assert load_config(path, devices="cpu:1").max_ended_stored_per_user == 256 << 20
    path.write_text('[limits]\nmax_ended_stored_per_user = "1G"\n')
    assert load_config(path, devices="cpu:1").max_ended_stored_per_user == 1 << 30
    path.write_text("[limits]\nmax_ended_stored_per_user = 0\n")
    assert load_config(path, devices="cpu:1").max_ended_stored_per_user == 0


def test_an_owner_found_within_the_bytes_is_counted_again_once_their_ended_jobs_change(
    tmp_path: Path,
) -> None:
    """Counting an owner's ended bytes costs ~10 ms for 3,000 jobs: it is done again only
    for an owner whose ended jobs changed since they were last found within the cap."""
    store = StateStore(tmp_path / "state.db")
    first = add(store, 1001, 1.0)
    end(store, first, 10.0)
    announce_all(store)
    assert store.prune_ended(keep_per_user=10_000, keep_bytes_per_user=3 << 20) == []
    fat = [add_fat(store, 1001, 20.0 + t, 1) for t in range(4)]
    for number, job_id in enumerate(fat):
        end(store, job_id, 30.0 + number)
    announce_all(store)
    assert store.prune_ended(keep_per_user=10_000, keep_bytes_per_user=3 << 20) == [
        first,
        *fat[:2],
    ]


def test_an_edit_that_leaves_a_blob_to_the_ended_jobs_alone_has_them_counted_again(
    tmp_path: Path,
) -> None:
    """A held job and the owner's ended jobs share a 2 MB environment, which is not the ended
    jobs' to count while the held job names it.  Editing the held job's environment leaves
    the blob to the ended jobs alone, with their number unchanged: the edit itself has them
    counted again, so the cap holds at the next pass (not at the owner's next ended job)."""
    store = StateStore(tmp_path / "state.db")
    ids = sharing_one_environment(store, jobs=3, ended=2)
    assert store.prune_ended(keep_per_user=10_000, keep_bytes_per_user=1 << 20) == []
    store.update_job(ids[2], env={"PAD": "small"})  # the held job's edit
    assert store.ended_bytes(1001) > 2 << 20
    assert store.prune_ended(keep_per_user=10_000, keep_bytes_per_user=1 << 20) == ids[:2]


def test_an_owner_at_the_count_cap_is_counted_again_each_pass(tmp_path: Path) -> None:
    """An owner's ended bytes were remembered by (count, newest id) before the same pass
    removed some of their jobs by count: a held 200 kB job cancelled each pass, older than
    their newest ended job, brought back the same mark and was never counted (a review: 1 MB
    kept against a 300 kB cap).  An owner over the count cap is counted again next pass."""
    store = StateStore(tmp_path / "state.db")

    def add_held(now: float, argv: list[str]) -> int:
        return store.add_job(
            name=f"j{now:g}", owner_uid=1001, owner_gid=1001, owner_name="u1001",
            spec=JobSpec(argv=argv, workdir="/"), priority=0, submit_time=now, env={},
            held=True,
        ).id  # fmt: skip

    big = [add_held(float(t), ["x" * 200_000, str(t)]) for t in range(6)]
    small = [add(store, 1001, 10.0 + t) for t in range(5)]
    for number, job_id in enumerate(small):
        end(store, job_id, 20.0 + number)
    announce_all(store)
    for number, job_id in enumerate(big):
        end(store, job_id, 100.0 + 60 * number)
        announce_all(store)
        store.prune_ended(keep_per_user=5, keep_bytes_per_user=300_000)
        assert store.ended_bytes(1001) < 300_000


def test_ended_jobs_another_job_waits_for_go_past_the_bytes_their_outcomes_stay(
    tmp_path: Path,
) -> None:
    """An active job's ``--after`` kept the ended jobs it names: a held job naming 1,000 ended
    jobs, each with a new 4 MB environment, kept them past both caps for as long as it stayed
    held (a third review: 20 jobs of 480 KB kept against a cap of 2 MB).  Past the owner's
    bytes they go, and how each ended stays for the waiter."""
    store = StateStore(tmp_path / "state.db")
    fat = [add_fat(store, 1001, float(t), 1) for t in range(6)]
    for number, job_id in enumerate(fat):
        end(store, job_id, 100.0 + number)
    announce_all(store)
    waiting = add(store, 1001, 200.0, after=[str(i) for i in fat], after_any=True)
    assert store.ended_bytes(1001) > 6 << 20

    removed = store.prune_ended(keep_per_user=10_000, keep_bytes_per_user=2 << 20)
    assert removed == fat[:-1] or removed == fat[:-2], removed  # all but the newest that fit
    assert store.ended_bytes(1001) < 3 << 20
    assert store.states_of(fat) == {i: JobState.CANCELLED for i in fat}  # what the waiter reads
    assert store.get_job(fat[-1]).env["PAD"].startswith("5x")  # type: ignore[union-attr]
    assert store.get_job(waiting) is not None
    (blob_bytes,) = store.db.execute("SELECT SUM(size) FROM blobs").fetchone()
    assert blob_bytes < 3 << 20


def test_ended_jobs_whose_ends_are_not_announced_keep_their_rows_not_their_bytes(
    tmp_path: Path,
) -> None:
    """A job whose end is not announced yet stays (its notification needs its row); past the
    owner's bytes it loses its command and environment."""
    from pollux_local.daemon.state import REMOVED_ARGV

    store = StateStore(tmp_path / "state.db")
    fat = [add_fat(store, 1001, float(t), 1) for t in range(6)]
    for number, job_id in enumerate(fat):
        end(store, job_id, 100.0 + number)
    assert store.prune_ended(keep_per_user=10_000, keep_bytes_per_user=2 << 20) == []
    slim = [i for i in fat if store.get_job(i).spec.argv == REMOVED_ARGV]  # type: ignore[union-attr]
    assert slim == fat[:-1] or slim == fat[:-2], slim
    assert store.ended_bytes(1001) < 3 << 20


def test_a_job_whose_command_was_removed_is_not_restarted(tmp_path: Path) -> None:
    """A restart of an ended job whose command and environment went (it was kept only until
    its end is announced) is refused in one line, before anything is checked or queued."""
    from pollux_local.api.errors import Conflict
    from pollux_local.api.messages import Restart
    from pollux_local.daemon.handlers.resubmit import restart

    store = StateStore(tmp_path / "state.db")
    fat = [add_fat(store, 1001, float(t), 1) for t in range(3)]
    for number, job_id in enumerate(fat):
        end(store, job_id, 100.0 + number)
    store.prune_ended(keep_per_user=10_000, keep_bytes_per_user=1 << 20)  # none announced

    class Ctx:  # what restart asks of the daemon before it checks the spec
        def job(self, job_id: int) -> Any:
            return store.get_job(job_id)

        def require_owner(self, job: Any, what: str) -> None:
            pass

    with pytest.raises(Conflict, match="command and environment were removed"):
        restart(Ctx(), Restart(id=str(fat[0])))  # type: ignore[arg-type]


def test_restarts_of_an_arrays_task_do_not_stay_past_the_cap(tmp_path: Path) -> None:
    """An array with an active task keeps its ended tasks, but a task restarted since (a newer
    task of the same index) is not one of them (review s70: ``restart --hold`` then
    ``cancel`` of one task, in a loop, while another task stayed held, grew a 2-task array to
    thousands of rows kept past ``max_ended_per_user``, for as long as that task was held)."""
    store = StateStore(tmp_path / "state.db")
    # the array's first task (its handle, job 1), queued for ever
    first = add(store, 1001, 1.0, array_id="1", array_index=0)
    assert first == 1
    spec = {"array_id": "1", "array_index": 1}
    copies = []
    for step in range(20):  # task 1, restarted and cancelled again and again
        copies.append(add(store, 1001, 2.0 + step, **spec))
        end(store, copies[-1], 2.5 + step)
    announce_all(store)
    removed = store.prune_ended(keep_per_user=1, budget_s=1.0)
    assert sorted(removed) == copies[:-1]  # the newest of task 1 stays with its array
    assert store.get_job(copies[-1]) is not None and store.get_job(first) is not None
    # by bytes too: what is superseded goes, not only its command
    again = StateStore(tmp_path / "again.db")
    first = add(again, 1001, 1.0, array_id="1", array_index=0)
    copies = []
    for step in range(20):
        copies.append(add(again, 1001, 2.0 + step, **spec))
        end(again, copies[-1], 2.5 + step)
    announce_all(again)
    removed = again.prune_ended(0, budget_s=1.0, keep_bytes_per_user=1)
    assert sorted(removed) == copies[:-1]
    assert again.get_job(copies[-1]) is not None and again.get_job(first) is not None
