"""Who may act for a job's owner: an admin manages the queue but does not choose the command a
job runs as another user or read its environment; a uid that ``userdel`` freed and a new
account now holds is not the old owner (``auth.is_owner``, ``auth.may_act_for``)."""

from __future__ import annotations

import asyncio
import grp
import pwd
from dataclasses import replace
from pathlib import Path

import pytest

from pollux_local.api.errors import PermissionDenied
from pollux_local.api.messages import (
    DeleteGroup,
    Edit,
    Hold,
    PauseGroup,
    SetGroup,
    SetPriority,
    Show,
    Submit,
)
from pollux_local.daemon.context import Context
from pollux_local.daemon.executor.launchspec import owner_gone
from pollux_local.daemon.handlers import control, groups, query, resubmit, submit
from pollux_local.daemon.state import StateStore
from tests.daemon.test_limits import ALICE, context

pytestmark = pytest.mark.timeout(120)


def _admin(store: StateStore) -> Context:
    """User nobody, a member of the admin group (nogroup, its primary group)."""
    nobody = pwd.getpwnam("nobody")
    group = grp.getgrgid(nobody.pw_gid).gr_name
    return context(store, nobody.pw_uid, admin_group=group)


def test_an_admin_may_hold_and_reprioritise_but_not_change_what_runs(tmp_path: Path) -> None:
    store = StateStore(tmp_path / "state.db")
    alice, admin = context(store, ALICE), _admin(store)
    job = submit.submit(
        alice, Submit(argv=["/bin/true"], workdir="/", hold=True, env={"HF_TOKEN": "secret"})
    )
    with pytest.raises(PermissionDenied) as caught:
        asyncio.run(resubmit.edit(admin, Edit(id=job.id, argv=["/bin/sh", "-c", "id"])))
    line = str(caught.value)
    assert "change its command" in line and "\n" not in line
    stored = store.get_job(int(job.id))
    assert stored is not None and stored.spec.argv == ["/bin/true"]
    # the queue is the admin's to manage
    asyncio.run(resubmit.edit(admin, Edit(id=job.id, time_limit_s=300)))
    asyncio.run(control.hold(admin, Hold(id=job.id)))
    control.set_priority(admin, SetPriority(id=job.id, priority=5))
    # the environment (tokens) is shown to the owner and root, not to the admin group
    assert query.show(admin, Show(id=job.id)).job.env is None
    assert query.show(alice, Show(id=job.id)).job.env == {"HF_TOKEN": "secret"}
    assert query.show(context(store, 0), Show(id=job.id)).job.env == {"HF_TOKEN": "secret"}
    # the owner changes the command
    asyncio.run(resubmit.edit(alice, Edit(id=job.id, argv=["/bin/echo", "hi"])))
    stored = store.get_job(int(job.id))
    assert stored is not None and stored.spec.argv == ["/bin/echo", "hi"]
    store.close()


def test_a_reused_uid_is_not_the_old_owner(tmp_path: Path) -> None:
    """A job's owner is its uid under the account name it was submitted as: the next account
    ``useradd`` gives the freed uid can neither change nor read the job, and the job does
    not start as them."""
    store = StateStore(tmp_path / "state.db")
    alice = context(store, ALICE)
    job = submit.submit(
        alice, Submit(argv=["/bin/true"], workdir="/", hold=True, env={"HF_TOKEN": "secret"})
    )
    # the account that submitted it was another, since deleted: uid 41000 was "alice-before"
    store.db.execute("UPDATE jobs SET owner_name = 'alice-before' WHERE id = ?", (int(job.id),))
    with pytest.raises(PermissionDenied, match="belongs to alice-before"):
        control.set_priority(alice, SetPriority(id=job.id, priority=-1))
    with pytest.raises(PermissionDenied):
        asyncio.run(resubmit.edit(alice, Edit(id=job.id, argv=["/bin/sh"])))
    assert query.show(alice, Show(id=job.id)).job.env is None
    record = store.get_job(int(job.id))
    assert record is not None and owner_gone(record) == "owner uid 41000 no longer exists"
    # a uid that an account of another name holds now
    nobody = pwd.getpwnam("nobody")
    taken = replace(record, owner_uid=nobody.pw_uid, owner_name="nobody-before")
    why = owner_gone(taken)
    assert why is not None and "now belongs to nobody" in why and "nobody-before" in why
    assert owner_gone(replace(taken, owner_name="nobody")) is None
    store.close()


def test_a_reused_uid_does_not_own_the_old_accounts_groups(tmp_path: Path) -> None:
    """A user's own group is theirs as their jobs are: uid and account name."""
    store = StateStore(tmp_path / "state.db")
    alice = context(store, ALICE)
    # the group of the account that held uid 41000 before
    store.put_group(
        "sweep", owner_uid=ALICE, owner_name="alice-before", max_devices=None, max_running=2,
        time=1.0,
    )  # fmt: skip
    with pytest.raises(PermissionDenied, match="is alice-before's"):
        groups.set_group(alice, SetGroup(name="sweep", max_running=9))
    with pytest.raises(PermissionDenied, match="is alice-before's"):
        groups.pause_group(alice, PauseGroup(name="sweep"))
    with pytest.raises(PermissionDenied, match="is alice-before's"):
        groups.delete_group(alice, DeleteGroup(name="sweep"))
    with pytest.raises(PermissionDenied, match="group sweep is alice-before's"):
        submit.submit(alice, Submit(argv=["/bin/true"], workdir="/", hold=True, group="sweep"))
    store.close()
