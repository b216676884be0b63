"""A job whose owner's Unix account is gone (``userdel``, or a uid given to a new account since)
cannot run again: a restart, an edit or a release of it is refused in one line, nothing
changed (``jobrules.check_owner``, through ``submit.validate_jobs``); one still queued fails
when a pass would start it, once, and the pass goes on (``launchspec.owner_gone``)."""

from __future__ import annotations

import asyncio
import os
from dataclasses import replace
from pathlib import Path

import pytest

from pollux_local.api.errors import Conflict
from pollux_local.api.messages import Edit, Release, Restart
from pollux_local.api.states import JobState
from pollux_local.core.baselines import FifoPolicy
from pollux_local.daemon.auth import account_name
from pollux_local.daemon.context import Context
from pollux_local.daemon.handlers import control, resubmit
from pollux_local.daemon.jobrules import check_owner
from pollux_local.daemon.state import StateStore
from tests.daemon.test_limits import ALICE, context
from tests.daemon.test_limits import accounts as known
from tests.scheduler_harness import Harness

pytestmark = pytest.mark.timeout(120)

#: carol's uid: her account was deleted (no passwd entry has it, in the tests' user database
#: too); dave's uid: his account was deleted and uid 41003 given to a new account, erin
CAROL, DAVE = 41002, 41003


def accounts(uid: int) -> str | None:
    return "erin" if uid == DAVE else known(uid)


def _root(store: StateStore) -> Context:
    """Root (an admin, who may act for any owner), with the tests' users."""
    return replace(context(store, 0), accounts=accounts)


def _job(store: StateStore, uid: int, name: str, state: JobState | None = None) -> int:
    job = store.add_job(
        name="j", owner_uid=uid, owner_gid=uid, owner_name=name,
        spec={"argv": ["/bin/true"], "workdir": "/"}, priority=0, submit_time=1.0,
        held=state == JobState.HELD,
    ).id  # fmt: skip
    if state in (JobState.CANCELLED, JobState.FAILED):
        store.transition(job, state, 2.0, None, end_time=2.0)
    return job


def _refused(line: str, job_id: int) -> None:
    assert line.startswith(f"job {job_id} cannot run again: ") and "\n" not in line
    assert line.endswith("; cancel it or ask an admin")


def test_a_restart_of_a_job_whose_owner_is_gone_is_refused(tmp_path: Path) -> None:
    store = StateStore(tmp_path / "state.db")
    root = _root(store)
    gone = _job(store, CAROL, "carol", JobState.FAILED)
    with pytest.raises(Conflict) as caught:
        resubmit.restart(root, Restart(id=str(gone)))
    _refused(str(caught.value), gone)
    assert f"owner uid {CAROL} no longer exists" in str(caught.value)
    assert store.count_jobs() == 1  # no copy queued
    # a uid a new account holds now: not the job's owner, who is gone
    taken = _job(store, DAVE, "dave", JobState.CANCELLED)
    with pytest.raises(Conflict, match=f"owner dave is gone: uid {DAVE} now belongs to erin"):
        resubmit.restart(root, Restart(id=str(taken)))
    assert store.count_jobs() == 2
    # an owner who is here: restarted
    again = resubmit.restart(root, Restart(id=str(_job(store, ALICE, "uid41000", JobState.FAILED))))
    assert store.get_job(int(again.id)).state == JobState.QUEUED  # type: ignore[union-attr]
    store.close()


def test_an_edit_of_a_job_whose_owner_is_gone_is_refused_and_changes_nothing(
    tmp_path: Path,
) -> None:
    store = StateStore(tmp_path / "state.db")
    root = _root(store)
    for state in (JobState.HELD, JobState.QUEUED):
        job_id = _job(store, CAROL, "carol", state)
        before = store.get_job(job_id)
        with pytest.raises(Conflict) as caught:
            asyncio.run(resubmit.edit(root, Edit(id=str(job_id), time_limit_s=60.0)))
        _refused(str(caught.value), job_id)
        after = store.get_job(job_id)
        assert after is not None and before is not None
        assert (after.state, after.spec) == (before.state, before.spec)
    store.close()


def test_a_release_of_a_job_whose_owner_is_gone_is_refused_the_others_released(
    tmp_path: Path,
) -> None:
    store = StateStore(tmp_path / "state.db")
    root = _root(store)
    gone = _job(store, CAROL, "carol", JobState.HELD)
    with pytest.raises(Conflict) as caught:
        asyncio.run(control.release(root, Release(id=str(gone))))
    _refused(str(caught.value), gone)
    assert store.get_job(gone).state == JobState.HELD  # type: ignore[union-attr]
    # release --all --user: that job refused, with its line; another of the user's released
    taken = _job(store, DAVE, "dave", JobState.HELD)
    theirs = _job(store, ALICE, "uid41000", JobState.HELD)
    reply = asyncio.run(control.release(root, Release(all=True, user="dave")))
    assert reply.ids == [] and list(reply.refused) == [str(taken)]
    _refused(reply.refused[str(taken)], taken)
    reply = asyncio.run(control.release(root, Release(all=True, user="uid41000")))
    assert reply.ids == [str(theirs)] and reply.refused == {}
    assert store.get_job(taken).state == JobState.HELD  # type: ignore[union-attr]
    assert store.get_job(theirs).state == JobState.QUEUED  # type: ignore[union-attr]
    store.close()


def test_the_daemon_reads_the_user_database_by_default() -> None:
    """Unfaked, the check is the user database's (uid 41002 has no passwd entry here), and
    the daemon's own user's jobs (which run as it) are never refused."""
    assert Context.__dataclass_fields__["accounts"].default is account_name
    with pytest.raises(Conflict, match=f"job 7 cannot run again: owner uid {CAROL} no longer"):
        check_owner(7, CAROL, "carol")
    check_owner(7, os.geteuid(), "whoever")  # the daemon's own user


def test_a_queued_job_whose_owner_went_fails_once_at_its_start_and_the_pass_goes_on(
    tmp_path: Path,
) -> None:
    async def main() -> None:
        harness = Harness(tmp_path / "state", [2], FifoPolicy(), interval_s=1.0)
        orphan = harness.submit(owner="carol")
        harness.store.db.execute("UPDATE jobs SET owner_uid = ? WHERE id = ?", (CAROL, orphan))
        fine = harness.submit()
        await harness.tick(1.0)
        job = harness.job(orphan)
        assert job.state == JobState.FAILED
        assert job.reason == f"owner uid {CAROL} no longer exists"
        assert harness.job(fine).state == JobState.RUNNING
        await harness.tick(1.0)  # never tried again
        assert harness.job(orphan).state == JobState.FAILED
        assert list(harness.launcher.launches) == [harness.job(fine).job_id]

    asyncio.run(main())
