"""Who is in a user's group as the daemon gives it to the pass: its owner's jobs alone, what
name another user's job kept (``scheduler.in_own_group``)."""

from __future__ import annotations

from pathlib import Path

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


def test_a_group_that_resurfaces_as_another_users_lets_the_jobs_in_it_leave(tmp_path: Path) -> None:
    """bob made group "x"; the admin's config then gave the name a group (bob's hidden under
    it) and alice's job joined that; the config drops it again and bob's comes back. alice's
    job is not in bob's group: her release (or edit, or restart) leaves it, where she may not
    name it anew; and bob may delete his group, which holds no job of his."""
    import asyncio

    import pytest

    from pollux_local.api.errors import PermissionDenied
    from pollux_local.api.spec import JobSpec
    from pollux_local.daemon.auth import Peer
    from pollux_local.daemon.config import DaemonConfig, NodeConfig
    from pollux_local.daemon.context import Context
    from pollux_local.daemon.handlers.groups import check_job_groups
    from pollux_local.daemon.readmodel import MetricHistory
    from pollux_local.daemon.scheduler import ModelCache
    from pollux_local.daemon.state import StateStore

    store = StateStore(tmp_path / "state.db")
    store.put_group("x", owner_uid=1002, owner_name="bob", max_devices=None,
                    max_running=None, time=0.0)  # fmt: skip
    ctx = Context(
        peer=Peer(1, 1001, 1001), store=store, executor=None,  # type: ignore[arg-type]
        config=DaemonConfig(nodes=(NodeConfig("n0", ("cpu:0",)),)), state_dir=tmp_path,
        clock=lambda: 0.0, models=ModelCache(), metrics=MetricHistory(), mutex=asyncio.Lock(),
        wake=lambda: None, daemon_uid=0, policy_name="fifo",
    )  # fmt: skip
    hers = JobSpec(argv=["x"], workdir="/", group="x")
    [kept] = check_job_groups(ctx, [hers], owner_uid=1001, owner_name="alice", kept="x")
    assert kept.group is None
    with pytest.raises(PermissionDenied, match="group x is bob's"):
        check_job_groups(ctx, [hers], owner_uid=1001, owner_name="alice")
    [his] = check_job_groups(ctx, [hers], owner_uid=1002, owner_name="bob", kept="x")
    assert his.group == "x"  # bob's own job stays in bob's group
    store.add_job(name="hers", owner_uid=1001, owner_gid=1001, owner_name="alice", spec=hers,
                  priority=0, submit_time=0.0, held=True)  # fmt: skip
    assert store.count_group_jobs("x", owner=1002) == 0 and store.count_group_jobs("x") == 1
    # ``status --group x`` (and so ``wait --group x``) selects bob's jobs alone, as ``groups``
    # and the pass count them
    from pollux_local.api.messages import Status
    from pollux_local.daemon.handlers.query import status

    store.add_job(name="his", owner_uid=1002, owner_gid=1002, owner_name="bob", spec=hers,
                  priority=0, submit_time=0.0, held=True)  # fmt: skip

    def names(request: Status) -> list[str]:
        return [job.name for job in asyncio.run(status(ctx, request)).jobs]

    assert names(Status(group="x")) == ["his"]
    assert names(Status(group="x", user="alice")) == []
    assert names(Status(group="x", user="bob")) == ["his"]
    assert names(Status(user="alice")) == ["hers"]  # her job is listed, in no group


def test_a_users_pause_of_a_group_the_config_then_claims_does_not_pause_the_admins(
    tmp_path: Path,
) -> None:
    """alice made group "short" and paused it (her own jobs wait); the admin's config then
    gives the name a group that everyone's jobs may join. Her pause is her hidden group's, not
    the admin's group's: it must not hold everyone's jobs there (before, it did, and only an
    admin could resume it). The admin's own pause of it holds them, and it does not leak into
    alice's group once the config drops the name again."""
    import asyncio

    from pollux_local.api.messages import PauseGroup, ResumeGroup, SetGroup
    from pollux_local.daemon.auth import Peer
    from pollux_local.daemon.config import DaemonConfig, GroupConfig, NodeConfig
    from pollux_local.daemon.context import Context
    from pollux_local.daemon.handlers.groups import group_rows, pause_group, resume_group, set_group
    from pollux_local.daemon.readmodel import MetricHistory
    from pollux_local.daemon.scheduler import ModelCache
    from pollux_local.daemon.state import StateStore

    store = StateStore(tmp_path / "state.db")
    nodes = (NodeConfig("n0", ("cpu:0",)),)

    class Idle:  # an executor with nothing stopping
        def still_stopping(self) -> dict[int, object]:
            return {}

    def context(uid: int, config: DaemonConfig) -> Context:
        return Context(
            peer=Peer(1, uid, uid), store=store, executor=Idle(),  # type: ignore[arg-type]
            config=config, state_dir=tmp_path, clock=lambda: 0.0, models=ModelCache(),
            metrics=MetricHistory(), mutex=asyncio.Lock(), wake=lambda: None,
            daemon_uid=0, policy_name="fifo",
        )  # fmt: skip

    def paused(config: DaemonConfig) -> tuple[bool, bool]:
        """Whether the pass and ``group list`` have group "short" paused."""
        limit = group_limits(config.groups, store.group_rows())["short"]
        (row,) = [row for row in group_rows(context(0, config)) if row.name == "short"]
        return limit.paused, row.paused

    without = DaemonConfig(nodes=nodes)
    alice = context(4242, without)
    set_group(alice, SetGroup(name="short"))
    pause_group(alice, PauseGroup(name="short"))
    assert paused(without) == (True, True)  # her own group: her jobs wait

    claimed = DaemonConfig(nodes=nodes, groups=(GroupConfig("short", max_running=2),))
    assert paused(claimed) == (False, False)  # the admin's group is not paused by her
    root = context(0, claimed)
    pause_group(root, PauseGroup(name="short"))
    assert paused(claimed) == (True, True)
    resume_group(root, ResumeGroup(name="short"))
    assert paused(claimed) == (False, False)
    pause_group(root, PauseGroup(name="short"))
    assert paused(without) == (True, True)  # her group again, with her own pause
    resume_group(alice, ResumeGroup(name="short"))
    assert paused(without) == (False, False)  # the admin's pause is not hers
    assert paused(claimed) == (True, True)  # nor hers the admin's
