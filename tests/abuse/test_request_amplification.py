"""A small request that makes the daemon do or keep much more than it says.

Each of these was a hole: one user, with a frame of a few kilobytes, could stall the daemon's
event loop for everyone, or store far more than ``[limits] max_stored_per_user`` counts, or break
``status`` for every user.  The handlers are called directly, as the server calls them, on a
real state database.

* a job's name made from its command (no ``--name``) is a name as ``--name`` takes it: control
  characters replaced, at most 128 characters, an array task's ``[i]`` included;
* ``cancel`` naming one job ten thousand times loads it once (and cancels it once); an array
  named many times is walked once;
* ``--after`` naming one job a thousand times is one query;
* an array's tasks each keep their settings (``--notify``, ``--after``) in their own row: those
  rows count against ``max_stored_per_user``.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import msgspec
import pytest

from pollux_local.api.errors import LimitExceeded, PermissionDenied
from pollux_local.api.messages import (
    JOB_NAME_MAX,
    ArrayTask,
    Cancel,
    JobName,
    Release,
    Submit,
)
from pollux_local.api.states import JobState
from pollux_local.daemon.context import Context
from pollux_local.daemon.handlers import control, submit
from pollux_local.daemon.state import StateStore
from tests.daemon.test_limits import ALICE, BOB
from tests.daemon.test_limits import context as limits_context
from tests.store_spy import count_job_loads

pytestmark = pytest.mark.timeout(120)


class _Executor:
    """What ``cancel`` asks of the executor: stopping a job (none of these runs)."""

    def __init__(self) -> None:
        self.stopped: list[int] = []

    async def stop_job(self, job_id: int, intent: object) -> None:
        self.stopped.append(job_id)


def context(
    store: StateStore, uid: int, executor: _Executor | None = None, **config: Any
) -> Context:
    return limits_context(store, uid, executor or _Executor(), **config)


def held(argv: list[str], **fields: Any) -> Submit:
    return Submit(argv=argv, workdir="/", hold=True, **fields)


def is_job_name(name: str) -> bool:
    try:
        msgspec.convert(name, JobName)
    except msgspec.ValidationError:
        return False
    return True


def test_a_name_made_from_the_command_is_a_name_submit_takes(tmp_path: Path) -> None:
    store = StateStore(tmp_path / "state.db")
    alice = context(store, ALICE)
    hostile = "/tmp/x\x1b]2;owned\x07\x1b[2J\u202e.py"
    cases = {
        "escapes": ["/usr/bin/python3", "-u", hostile],
        "long": ["/" + "A" * 131_070],
        "empty": ["/"],
    }
    names = {}
    for label, argv in cases.items():
        reply = submit.submit(alice, held(argv))
        names[label] = store.get_job(int(reply.id)).name  # type: ignore[union-attr]
    assert names["escapes"] == "x?]2;owned??[2J?.py", names["escapes"]
    assert names["long"] == "A" * JOB_NAME_MAX
    assert names["empty"] == "job"
    # an array's tasks: base[i] whole, within the length, its index kept
    reply = submit.submit(
        alice, held(["/" + "B" * 500], array=[ArrayTask(index=i) for i in (0, 7, 1234)])
    )
    tasks = [store.get_job(int(i)).name for i in reply.ids]  # type: ignore[union-attr]
    assert [t[-6:] for t in tasks] == ["BBB[0]", "BBB[7]", "[1234]"], tasks
    assert all(len(t) == JOB_NAME_MAX for t in tasks)
    for name in [*names.values(), *tasks]:
        assert is_job_name(name), name
    store.close()


def test_cancel_loads_a_job_named_many_times_once(tmp_path: Path) -> None:
    store = StateStore(tmp_path / "state.db")
    executor = _Executor()
    alice = context(store, ALICE, executor)
    own = submit.submit(alice, held(["/bin/true"])).id
    array = submit.submit(alice, held(["/bin/true"], array=[ArrayTask(index=i) for i in range(3)]))
    bobs = submit.submit(context(store, BOB), held(["/bin/true"])).id
    loads = count_job_loads(store)
    many = Cancel(ids=[own] * 10_000, arrays=[array.id] * 100)
    reply = asyncio.run(control.cancel(alice, many))
    assert sorted(reply.cancelled, key=int) == sorted({own, *array.ids}, key=int)
    assert sorted(executor.stopped) == sorted(int(i) for i in {own, *array.ids})
    assert len(loads) <= 1, f"{len(loads)} full loads for one job and one array"  # the array's head
    # another user's job named many times: refused, as named once, and nothing changed
    loads.clear()
    with pytest.raises(PermissionDenied, match="belongs to"):
        asyncio.run(control.cancel(alice, Cancel(ids=[bobs] * 10_000)))
    assert len(loads) == 0
    assert store.get_job(int(bobs)).state == JobState.HELD  # type: ignore[union-attr]
    # the request's bounds: more ids than that is refused when it is read
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"ids": [own] * 10_001}, Cancel)
    store.close()


def test_after_naming_one_job_many_times_is_one_query(tmp_path: Path) -> None:
    store = StateStore(tmp_path / "state.db")
    alice = context(store, ALICE)
    first = submit.submit(alice, held(["/bin/true"])).id
    queries: list[int] = []
    states_of = store.states_of

    def counted(ids: Any) -> Any:
        wanted = list(ids)
        queries.append(len(wanted))
        return states_of(wanted)

    store.states_of = counted  # type: ignore[method-assign]
    store.get_job = None  # type: ignore[assignment,method-assign]  # must not be needed
    reply = submit.submit(alice, held(["/bin/true"], after=[first] * 1000))
    assert reply.id
    assert queries == [1], queries
    store.close()


def test_an_arrays_settings_count_against_what_a_user_may_keep(tmp_path: Path) -> None:
    store = StateStore(tmp_path / "state.db")
    alice = context(store, ALICE, max_stored_per_user=1024 * 1024)
    urls = [f"https://example.org/{i}/" + "u" * 2000 for i in range(16)]
    tasks = [ArrayTask(index=i) for i in range(1000)]
    with pytest.raises(LimitExceeded) as caught:
        submit.submit(alice, held(["/bin/true"], notify=urls, array=tasks))
    line = str(caught.value)
    assert "max_stored_per_user" in line and "settings" in line and "\n" not in line
    assert store.count_jobs() == 0
    # the same settings on a few tasks fit, and what they keep is counted from then on
    submit.submit(alice, held(["/bin/true"], notify=urls, array=tasks[:10]))
    kept = store.stored_bytes(ALICE)
    assert kept > 10 * 16 * 2000, kept
    # another user is not charged for them
    assert store.stored_bytes(BOB) == 0
    store.close()


def test_a_release_of_every_held_job_counts_what_they_keep_not_once_a_job(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``release --all`` of 1,000 held jobs with long ``--notify`` lists counted everything
    the owner's jobs keep once a job (every row read in full, 1,000 times): another user's
    ``ping`` waited 75-104 s.  A release adds nothing new, so nothing is counted; the jobs are
    released a part at a time, the event loop served between two parts."""
    store = StateStore(tmp_path / "state.db")
    alice = context(store, ALICE)
    urls = [f"https://example.org/{i}/" + "u" * 2000 for i in range(16)]
    tasks = [ArrayTask(index=i) for i in range(250)]
    submit.submit(alice, held(["/bin/true"], notify=urls, array=tasks))
    counted: list[int] = []
    real = store.stored_bytes
    monkeypatch.setattr(store, "stored_bytes", lambda uid: counted.append(uid) or real(uid))
    turns: list[int] = []
    real_give_way = control.give_way

    async def give_way() -> None:
        turns.append(1)
        await real_give_way()

    monkeypatch.setattr(control, "give_way", give_way)
    reply = asyncio.run(control.release(alice, Release(all=True)))
    assert len(reply.ids) == 250 and not reply.refused
    assert counted == []  # nothing new: nothing counted
    assert len(turns) >= 250 // control.CHANGE_PART
    assert store.count_active(ALICE) == 250
    # a submit that adds a new command counts once
    submit.submit(alice, held(["/bin/false"]))
    assert counted == [ALICE]
    store.close()
