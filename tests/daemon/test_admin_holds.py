"""A hold an admin puts on another user's job is the admin's to lift: its owner may cancel or
edit the job, not release it (review s65: an owner undid an admin's hold at once)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from pollux_local.api.errors import PermissionDenied
from pollux_local.api.messages import Hold, Release
from pollux_local.daemon.auth import Peer, account_name, user_name
from pollux_local.daemon.config import DaemonConfig, NodeConfig
from pollux_local.daemon.context import Context
from pollux_local.daemon.handlers.control import hold, release
from pollux_local.daemon.readmodel import MetricHistory
from pollux_local.daemon.scheduler import ModelCache
from pollux_local.daemon.state import StateStore

USER = 54321  # not an admin: not root, not the daemon's user, in no admin group


def _accounts(uid: int) -> str | None:
    """The user database with USER in it (no passwd entry has its uid)."""
    return user_name(USER) if uid == USER else account_name(uid)


class _Executor:
    async def stop_job(self, job_id: int, intent: Any) -> None:
        return None


def _context(store: StateStore, uid: int, tmp_path: Path) -> Context:
    return Context(
        peer=Peer(1, uid, uid), store=store, executor=_Executor(),  # type: ignore[arg-type]
        config=DaemonConfig(nodes=(NodeConfig("n0", ("cpu:0",)),)), state_dir=tmp_path,
        clock=lambda: 100.0, models=ModelCache(), metrics=MetricHistory(), mutex=asyncio.Lock(),
        wake=lambda: None, daemon_uid=0, policy_name="fifo", accounts=_accounts,
    )  # fmt: skip


def test_only_an_admin_releases_what_an_admin_held(tmp_path: Path) -> None:
    store = StateStore(tmp_path / "state.db")
    theirs = _context(store, USER, tmp_path)
    admin = _context(store, 0, tmp_path)

    def job() -> int:
        return store.add_job(
            name="j", owner_uid=USER, owner_gid=USER, owner_name=user_name(USER),
            spec={"argv": ["x"], "workdir": "/"}, priority=0, submit_time=0.0,
        ).id  # fmt: skip

    def record(job_id: int) -> Any:
        found = store.get_job(job_id)
        assert found is not None
        return found

    first, second = job(), job()
    asyncio.run(hold(admin, Hold(id=str(first))))
    held = record(first)
    assert (held.state, store.admin_held(first), held.reason) == ("held", True, "held by an admin")
    with pytest.raises(PermissionDenied, match="held by an admin; only an admin may release"):
        asyncio.run(release(theirs, Release(id=str(first))))
    # their own hold is theirs to lift; --all leaves the admin's, saying why
    asyncio.run(hold(theirs, Hold(id=str(second))))
    assert store.admin_held(second) is False
    reply = asyncio.run(release(theirs, Release(all=True)))
    assert reply.ids == [str(second)] and "only an admin" in reply.refused[str(first)]
    assert record(first).state == "held"
    # a job its owner held and an admin holds too stays the admin's
    asyncio.run(hold(theirs, Hold(id=str(second))))
    asyncio.run(hold(admin, Hold(id=str(second))))
    assert store.admin_held(second) is True
    with pytest.raises(PermissionDenied):
        asyncio.run(release(theirs, Release(id=str(second))))
    for job_id in (first, second):
        asyncio.run(release(admin, Release(id=str(job_id))))
        assert (record(job_id).state, store.admin_held(job_id)) == ("queued", False)
        assert record(job_id).queued_since == 100.0  # it waits from its release
    # the admin's own job: an ordinary hold
    mine = store.add_job(
        name="j", owner_uid=0, owner_gid=0, owner_name="root", spec={"argv": ["x"], "workdir": "/"},
        priority=0, submit_time=0.0,
    ).id  # fmt: skip
    asyncio.run(hold(admin, Hold(id=str(mine))))
    assert store.admin_held(mine) is False
