"""Who is in a user's group as the daemon gives it to the pass: its owner's jobs alone, what
name another user's job kept (``scheduler.in_own_group``)."""

from __future__ import annotations

from pollux_local.core.schedule import Holding, JobInput, Limits
from pollux_local.daemon.scheduler import group_limits, in_own_group
from pollux_local.daemon.state import GroupRecord
from tests.core.test_groups import started
from tests.core.test_schedule_pass import run


def test_a_users_group_caps_and_pauses_its_owners_jobs_alone() -> None:
    # alice's group "x", paused and capped; bob's jobs still name it (they joined an admin's
    # group "x" that the config has since dropped)
    stored = [GroupRecord("x", 1001, "alice", 0, 0, True, 0.0)]
    caps = Limits(groups=group_limits([], stored))
    assert caps.groups["x"].owner == "alice"
    bobs = JobInput(id=1, owner="bob", group="x")
    alices = JobInput(id=2, owner="alice", group="x")
    assert in_own_group(bobs, caps).group is None
    assert in_own_group(alices, caps) is alices
    stop = Holding(job_id=3, owner="bob", devices={"a": ["cpu:0"]}, group="x")
    assert in_own_group(stop, caps).group is None
    plan = run([in_own_group(job, caps) for job in (bobs, alices)], limits=caps)
    assert started(plan) == [1]
    assert plan.reasons[2] == "waiting: group x is paused"
