"""``status`` in pages, filtered in SQL: by default the active jobs and those finished in the
last 24 hours; ``all``, ``user``, ``states``, ``limit`` and ``before_id``; ``more`` and
``hidden`` say what was left out.  10,000 jobs of history cost little."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from pathlib import Path

import msgspec
import pytest

from pollux_local.api import wire
from pollux_local.api.errors import InvalidRequest
from pollux_local.api.messages import (
    ArrayTask,
    Cancel,
    DeleteGroup,
    Hold,
    ListGroups,
    Logs,
    Nodes,
    PauseGroup,
    Ping,
    Release,
    Report,
    ResumeGroup,
    SetGroup,
    Show,
    Status,
    StatusReply,
    Submit,
    Usage,
)
from pollux_local.api.report import JobReport
from pollux_local.api.states import JobState
from pollux_local.client import job_list
from pollux_local.daemon.auth import Peer
from pollux_local.daemon.config import DaemonConfig, NodeConfig
from pollux_local.daemon.context import Context
from pollux_local.daemon.dispatch import dispatch, in_turns
from pollux_local.daemon.handlers import query
from pollux_local.daemon.pacing import LoopShare
from pollux_local.daemon.readmodel import MetricHistory
from pollux_local.daemon.scheduler import ModelCache
from pollux_local.daemon.state import StateStore

NOW = 1_000_000.0
DAY = 24 * 3600.0


def fill(
    store: StateStore, count: int, finished_every: int = 1, ended_days_ago: float = 2.0
) -> None:
    """``count`` jobs alternating between ann and bob; every ``finished_every``-th one
    succeeded ``ended_days_ago`` days ago, the others queued."""
    rows = []
    for i in range(count):
        done = i % finished_every == 0
        rows.append(
            (
                f"job-{i}",
                1000 + i % 2,
                1000 + i % 2,
                ("ann", "bob")[i % 2],
                (JobState.SUCCEEDED if done else JobState.QUEUED).value,
                '{"argv": ["x"], "workdir": "/tmp", "min_gpus": 1}',
                NOW - 3 * DAY + i,
                NOW - ended_days_ago * DAY if done else None,
            )
        )
    store.db.executemany(
        "INSERT INTO jobs (name, owner_uid, owner_gid, owner_name, state, spec, submit_time,"
        " end_time) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
        rows,
    )


def context(store: StateStore) -> Context:
    return Context(
        peer=Peer(1, 1000, 1000),
        store=store,
        executor=None,  # type: ignore[arg-type]  (status reads the store only)
        config=DaemonConfig(nodes=(NodeConfig("n0", ("cpu:0",)),)),
        state_dir=store.path.parent,
        clock=lambda: NOW,
        models=ModelCache(),
        metrics=MetricHistory(),
        mutex=asyncio.Lock(),
        wake=lambda: None,
        daemon_uid=0,
        policy_name="fifo",
    )


def status(ctx: Context, request: Status) -> StatusReply:
    return asyncio.run(query.status(ctx, request))


def count_turns(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count the turns handlers give the event loop (``asyncio.sleep``): ``[count]``."""
    turns = [0]
    real_sleep = asyncio.sleep

    async def counted(delay: float) -> None:
        turns[0] += 1
        await real_sleep(delay)

    monkeypatch.setattr(asyncio, "sleep", counted)
    return turns


def ids(reply: object) -> list[int]:
    return [int(job.id) for job in reply.jobs]  # type: ignore[attr-defined]


def test_default_window_filters_and_pages(tmp_path: Path) -> None:
    store = StateStore(tmp_path / "state.db")
    fill(store, 10, finished_every=2)  # even ids-1 finished two days ago, odd ones queued
    recent = store.add_job(
        name="recent", owner_uid=1000, owner_gid=1000, owner_name="ann",
        spec={"argv": ["x"], "workdir": "/tmp"}, priority=0, submit_time=NOW - 100,
    )  # fmt: skip
    store.transition(recent.id, JobState.FAILED, NOW - 3600, None, end_time=NOW - 3600)
    ctx = context(store)

    default = status(ctx, Status())
    assert ids(default) == [2, 4, 6, 8, 10, 11]  # active, and what finished within 24 h
    assert default.hidden == 5 and default.more == 0 and default.next_before_id is None

    every = status(ctx, Status(all=True))
    assert ids(every) == list(range(1, 12)) and every.hidden == 0

    annes = status(ctx, Status(all=True, user="ann"))
    assert {j.owner for j in annes.jobs} == {"ann"} and len(annes.jobs) == 6
    assert ids(status(ctx, Status(user="nobody-here"))) == []

    finished = status(ctx, Status(all=True, states=[JobState.SUCCEEDED, JobState.FAILED]))
    assert ids(finished) == [1, 3, 5, 7, 9, 11]
    recent_failed = status(ctx, Status(states=[JobState.FAILED]))
    assert ids(recent_failed) == [11] and recent_failed.hidden == 0

    # pages: the newest first, each oldest first, a cursor to the next
    page = status(ctx, Status(all=True, limit=4))
    assert ids(page) == [8, 9, 10, 11] and page.more == 7 and page.next_before_id == "8"
    page = status(ctx, Status(all=True, limit=4, before_id=page.next_before_id))
    assert ids(page) == [4, 5, 6, 7] and page.more == 3 and page.next_before_id == "4"
    page = status(ctx, Status(all=True, limit=4, before_id="4"))
    assert ids(page) == [1, 2, 3] and page.more == 0 and page.next_before_id is None
    store.close()


def test_status_fields_are_checked_strictly() -> None:
    for bad, field in [
        ({"limit": 0}, "$.limit"),
        ({"limit": 10_001}, "$.limit"),
        ({"states": ["sleeping"]}, "$.states"),
        ({"states": []}, "$.states"),
        ({"before_id": "x"}, "$.before_id"),
        ({"user": ""}, "$.user"),
        ({"all": "yes"}, "$.all"),
    ]:
        body = msgspec.json.encode({"v": 1, "type": "status", **bad})
        with pytest.raises(InvalidRequest, match=field.replace("$", r"\$")):
            wire.decode_request(body)
    # replies from daemons before paging decode, the new fields at their defaults
    reply = wire.decode_reply(b'{"v": 1, "ok": true, "jobs": []}', Status.Reply)
    assert (reply.more, reply.hidden, reply.next_before_id) == (0, 0, None)  # type: ignore[attr-defined]


def test_ten_thousand_jobs_of_history_cost_little(tmp_path: Path) -> None:
    store = StateStore(tmp_path / "state.db")
    fill(store, 10_000, finished_every=1)  # all finished two days ago
    fill(store, 20, finished_every=1000)  # a few active ones, and one finished
    ctx = context(store)
    queries: list[str] = []
    store.db.set_trace_callback(queries.append)
    status(ctx, Status())
    status(ctx, Status(all=True, user="ann", states=[JobState.QUEUED]))
    store.db.set_trace_callback(None)
    for sql in queries:  # the indexes find the rows: no walk through every job
        plan = [str(row[-1]) for row in store.db.execute("EXPLAIN QUERY PLAN " + sql)]
        assert not any(step.startswith("SCAN jobs") for step in plan), (sql, plan)
    status(ctx, Status())  # warm
    took = []
    for _ in range(5):
        began = time.perf_counter()
        reply = status(ctx, Status())
        took.append(time.perf_counter() - began)
    assert len(reply.jobs) == 19 and reply.hidden == 10_001
    assert sorted(took)[2] < 0.05, f"status over 10,000 finished jobs took {sorted(took)[2]:.3f} s"
    page = status(ctx, Status(all=True, limit=100))
    assert len(page.jobs) == 100 and page.more == 10_020 - 100
    store.close()


def test_a_page_read_in_parts_is_the_page_read_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A page longer than ``READ_CHUNK`` is read in parts, the event loop turning between two
    (a 10,000-job page holds no other request up for its whole time); what comes back is
    what one read gives: the same jobs, ``more``, ``hidden`` and cursor."""
    store = StateStore(tmp_path / "state.db")
    fill(store, 40, finished_every=3)  # every third finished two days ago (hidden by default)
    ctx = context(store)
    requests = [
        Status(),
        Status(all=True),
        Status(all=True, limit=10),
        Status(limit=7),
        Status(all=True, limit=9, before_id="30"),
        Status(limit=5, before_id="30"),
        Status(all=True, user="bob", limit=6),
    ]
    whole = [status(ctx, request) for request in requests]
    monkeypatch.setattr(query, "READ_CHUNK", 2)
    turns = count_turns(monkeypatch)
    for request, expected in zip(requests, whole, strict=True):
        assert status(ctx, request) == expected, request
    assert whole[1].jobs and len(whole[1].jobs) == 40
    assert whole[5].hidden > 0 and whole[5].more > 0  # the counts were exercised
    assert turns[0] >= 40 // 2  # the loop turned between the parts
    store.close()


def test_rows_a_job_swells_end_the_page_before_the_frame_limit(tmp_path: Path) -> None:
    """A job's row holds what it reported: 64 metrics whose names are control characters
    take 25 KB of JSON.  Review s60 filled a default page of 1,000 with 990 such rows (held
    array tasks, one report each): 25 MB, over the 16 MiB frame, and every ``status`` of
    everyone failed.  A page now ends once its rows take ``MAX_PAGE_BYTES``; the next page
    has the rest, each job once."""
    store = StateStore(tmp_path / "state.db")
    fill(store, 700, finished_every=10**6)  # all queued but the first (hidden: 2 days old)
    metrics = {"\x01" * 62 + f"{chr(65 + i // 26)}{chr(97 + i % 26)}": 1.0 for i in range(64)}
    report = msgspec.json.encode({"metrics": metrics}).decode()
    store.db.execute("UPDATE jobs SET report = ?", (report,))
    ctx = context(store)
    row = wire.encoded_size(status(ctx, Status(limit=1)).jobs[0])
    assert row > 20_000  # as swollen as the review's
    seen: list[int] = []
    request = Status()
    pages = 0
    while True:
        reply = status(ctx, request)
        pages += 1
        assert len(wire.encode_reply(reply)) <= wire.MAX_FRAME_BYTES
        seen[:0] = ids(reply)
        if not reply.more:
            break
        assert reply.next_before_id == reply.jobs[0].id
        request = Status(before_id=reply.next_before_id)
    assert seen == list(range(2, 701)) and pages == 3
    store.close()


def test_one_users_held_jobs_push_no_other_users_running_job_off_the_list(
    tmp_path: Path,
) -> None:
    """Review s60: the default page is the newest 1,000 jobs, so one user's 1,000 held tasks
    (their whole allowance) left another user's running job off everyone's ``status``, the
    terminal view's list and the owner's own screen.  What they list
    (``client.job_list``) is now every active job, and the newest finished ones of the day;
    ``--limit N`` is still the newest N, however many pages that takes."""
    store = StateStore(tmp_path / "state.db")
    fill(store, 3, finished_every=10**6)  # job 1 finished two days ago; 2 and 3 queued
    store.db.execute("UPDATE jobs SET state = ?, owner_name = 'bob' WHERE id = 2", ("running",))
    finished = store.add_job(
        name="today", owner_uid=1000, owner_gid=1000, owner_name="bob",
        spec={"argv": ["x"], "workdir": "/tmp"}, priority=0, submit_time=NOW - 100,
    )  # fmt: skip
    store.transition(finished.id, JobState.FAILED, NOW - 60, None, end_time=NOW - 60)
    rows = [
        (f"held-{i}", 1001, 1001, "mallory", JobState.HELD.value, '{"argv": ["x"]}', NOW)
        for i in range(1000)
    ]
    store.db.executemany(
        "INSERT INTO jobs (name, owner_uid, owner_gid, owner_name, state, spec, submit_time)"
        " VALUES (?, ?, ?, ?, ?, ?, ?)",
        rows,
    )
    ctx = context(store)

    def call(request: Status) -> StatusReply:
        return status(ctx, request)

    assert 2 not in ids(call(Status()))  # one page of the newest: the running job is off it
    listed = job_list(call)
    assert ids(listed)[:3] == [2, 3, 4] and len(listed.jobs) == 1003
    assert listed.hidden == 1 and listed.more == 0
    assert ids(job_list(call, states=[JobState.RUNNING])) == [2]
    assert ids(job_list(call, states=[JobState.FAILED, JobState.SUCCEEDED])) == [4]
    assert ids(job_list(call, every=True, states=[JobState.SUCCEEDED])) == [1]
    newest = job_list(call, limit=1500)  # more than one request may ask for
    assert ids(newest) == list(range(2, 1005)) and newest.more == 0 and newest.hidden == 1
    assert len(job_list(call, limit=10).jobs) == 10
    store.close()


def test_status_is_served_in_its_users_turn(tmp_path: Path) -> None:
    """Requests go through the daemon's ``LoopShare`` (``dispatch.in_turns``): a user's
    second ``status`` waits for the first's share; a ``ping`` never waits."""
    store = StateStore(tmp_path / "state.db")
    fill(store, 5)
    ticks = [0.0]

    def clock() -> float:  # each look at the clock: 1 s later
        ticks[0] += 1.0
        return ticks[0]

    slept: list[float] = []

    async def sleep(seconds: float) -> None:
        slept.append(seconds)

    share = LoopShare(0.1, clock, sleep=sleep)
    ctx = dataclasses.replace(context(store), read_share=share)

    async def main() -> None:
        await dispatch(ctx, Ping())
        await dispatch(ctx, Ping())
        assert slept == []
        await dispatch(ctx, Status())
        await dispatch(ctx, Status(all=True))

    asyncio.run(main())
    assert len(slept) == 1 and slept[0] > 0
    assert all(in_turns(read) for read in (Logs(id="1"), Usage(), Nodes()))
    store.close()


def test_every_request_but_a_ping_and_a_jobs_report_is_served_in_turns() -> None:
    """A request's cost follows what it names (a ``cancel`` of 10,000 ids reads them as a
    page of ``status`` does; 100 ids, a 100-task array, a group's row cost tens of
    milliseconds each and a loop of them took the daemon): every request takes its user's
    turn (``dispatch.in_turns``), but a ping and a job's own report (limited apart)."""
    many = [str(i) for i in range(1, 10_001)]
    sub = {"argv": ["x"], "workdir": "/tmp"}
    for request in (
        Cancel(ids=many), Cancel(ids=["1"]), Cancel(arrays=["1"]), Hold(all=True),
        Hold(id="1"), Release(id="1"), Submit(**sub),  # type: ignore[arg-type]
        Submit(**sub, array=[ArrayTask(index=i) for i in range(100)]),  # type: ignore[arg-type]
        SetGroup(name="g"), DeleteGroup(name="g"), PauseGroup(name="g"),
        ResumeGroup(name="g"), ListGroups(), Status(), Show(id="1"),
    ):  # fmt: skip
        assert in_turns(request), request
    assert not in_turns(Ping())
    assert not in_turns(Report(job_id="1", report=JobReport()))


def test_a_status_row_names_the_first_jobs_waited_for_and_show_all(tmp_path: Path) -> None:
    """A page of rows that each wait for 1,000 jobs is not 1,000 ids a row (a review made
    every user's ``status`` a 16 MB reply): ``after_count`` says how many; ``show`` lists all."""
    from pollux_local.api.messages import SUMMARY_AFTER_IDS, Show

    store = StateStore(tmp_path / "state.db")
    waited = [str(i) for i in range(1, 1001)]
    spec = msgspec.json.encode(
        {"argv": ["x"], "workdir": "/tmp", "min_gpus": 1, "after": waited}
    ).decode()
    store.db.execute(
        "INSERT INTO jobs (name, owner_uid, owner_gid, owner_name, state, spec, submit_time)"
        " VALUES ('w', 1000, 1000, 'ann', ?, ?, ?)",
        (JobState.HELD.value, spec, NOW - 10),
    )
    ctx = context(store)
    [row] = status(ctx, Status()).jobs
    assert row.after == waited[:SUMMARY_AFTER_IDS] and row.after_count == 1000
    shown = query.show(ctx, Show(id=row.id)).job
    assert shown.after == waited and shown.after_count == 1000


def test_a_cancel_of_hundreds_of_jobs_gives_the_others_turns(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cancel of a 1000-task array held the event loop for a second in one piece: it now
    gives way every ``control.GIVE_WAY_EVERY`` jobs."""
    from pollux_local.api.messages import Cancel
    from pollux_local.daemon.handlers import control

    store = StateStore(tmp_path / "state.db")
    fill(store, 600, finished_every=10**9)  # all queued but the first
    stopped: list[int] = []

    class Executor:
        async def stop_job(self, job_id: int, intent: object) -> None:
            stopped.append(job_id)

    # as root (an admin): uid 1000 may be another account on this machine than "ann"
    ctx = dataclasses.replace(context(store), peer=Peer(1, 0, 0))
    ctx = dataclasses.replace(ctx, executor=Executor())  # type: ignore[arg-type]
    ids = [str(i) for i in range(3, 601, 2)]  # ann's queued jobs
    turns = count_turns(monkeypatch)
    statements: list[str] = []
    store.db.set_trace_callback(statements.append)
    synced: list[int] = []
    monkeypatch.setattr(store, "make_durable", lambda: synced.append(len(statements)))
    reply = asyncio.run(control.cancel(ctx, Cancel(ids=ids)))
    assert len(reply.cancelled) == len(ids) == len(stopped)
    assert turns[0] >= len(ids) // control.GIVE_WAY_EVERY
    # one sync for the whole request, after the last change (not an fsync per job)
    assert "PRAGMA synchronous=FULL" not in statements
    assert synced == [len(statements)]


def test_a_job_that_ends_while_a_long_cancel_gives_way_is_skipped(tmp_path: Path) -> None:
    """The exits taken in while a cancel gave way may end jobs it has not reached yet: they
    are listed as skipped, and the cancel goes on (it failed half done, "it is succeeded")."""
    from pollux_local.api.messages import Cancel
    from pollux_local.daemon.handlers import control

    store = StateStore(tmp_path / "state.db")
    fill(store, 400, finished_every=10**9)
    ids = [i for i in range(3, 401, 2)]  # ann's: 199 jobs
    for job_id in ids:
        store.transition(job_id, JobState.RUNNING, NOW, None)
    victim = ids[100]

    class Executor:
        async def stop_job(self, job_id: int, intent: object) -> None:
            pass

    async def scenario() -> object:
        async def ends() -> None:  # an exit taken in at the first turn the cancel gives
            store.transition(victim, JobState.SUCCEEDED, NOW, None, end_time=NOW)

        asyncio.ensure_future(ends())
        # as root (an admin): uid 1000 may be another account on this machine than "ann"
        ctx = dataclasses.replace(context(store), peer=Peer(1, 0, 0))
        ctx = dataclasses.replace(ctx, executor=Executor())  # type: ignore[arg-type]
        return await control.cancel(ctx, Cancel(ids=[str(i) for i in ids]))

    reply = asyncio.run(scenario())
    assert [s.id for s in reply.skipped] == [str(victim)]  # type: ignore[attr-defined]
    assert len(reply.cancelled) == len(ids) - 1  # type: ignore[attr-defined]
