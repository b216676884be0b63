"""A wide rigid job of one user, queued first, against another user's stream of narrow rigid
jobs (review s65): the goodput policy admits whoever fits (``policy.search.Search._admit``),
so while alice keeps one or two one-device rigid jobs running, overlapping, bob's four-device
rigid job on a four-device machine never starts, though she holds half the machine at most.
Now, once a job has waited ``RESERVE_AFTER_S`` for devices, a rigid job that would keep its
devices waits behind it (``Waiting("reserved")``), saying so."""

from __future__ import annotations

import numpy as np

from pollux_local.core.names import make_policy
from pollux_local.core.policy.objective import RESERVE_AFTER_S
from pollux_local.core.schedule import (
    ActionKind,
    JobInput,
    JobPhase,
    Limits,
    NodeInput,
    Snapshot,
    run_pass,
)

NODE = NodeInput(name="ws", devices=("cpu:0", "cpu:1", "cpu:2", "cpu:3"))


def test_a_stream_of_narrow_rigid_jobs_does_not_starve_another_users_wide_one() -> None:
    """Passes every 10 minutes; each of alice's jobs runs two.  Until bob's job has waited
    ``RESERVE_AFTER_S`` her new jobs fill the devices he cannot use yet; after, they wait
    behind his, saying so, and his starts as soon as hers have ended."""
    policy = make_policy("goodput")
    bobs = JobInput(id=2, owner="bob", submit_time=0.0, min_devices=4, elastic=False)
    running = {1: ({"ws": ["cpu:0"]}, 0)}  # alice's: job -> (devices, pass it started in)
    queued = [3]  # alice submits one more one-device job every pass
    started_before = 0
    for now_pass in range(1, 60):
        now = 600.0 * now_pass
        running = {j: r for j, r in running.items() if now_pass - r[1] < 2}
        alices = [
            JobInput(id=job_id, owner="alice", phase=JobPhase.RUNNING, allocation=where,
                     submit_time=600.0 * (job_id - 2), min_devices=1, elastic=False,
                     last_start=now - 10.0)
            for job_id, (where, _) in running.items()
        ]  # fmt: skip
        waiting = [
            JobInput(id=job_id, owner="alice", submit_time=600.0 * (job_id - 2), min_devices=1,
                     elastic=False)
            for job_id in queued
        ]  # fmt: skip
        snapshot = Snapshot(jobs=[bobs, *alices, *waiting], nodes=[NODE], now=now, limits=Limits())
        plan = run_pass(snapshot, policy, np.random.default_rng(0))
        starts = {a.job_id: a.allocation for a in plan.actions if a.kind is ActionKind.START}
        if bobs.id in starts:
            assert now >= RESERVE_AFTER_S and now <= RESERVE_AFTER_S + 3 * 600.0, now
            assert started_before > 0  # before, the devices he could not use were used
            return
        for job_id in queued:
            if job_id in starts:
                running[job_id] = (starts[job_id], now_pass)
                started_before += now < RESERVE_AFTER_S
            elif now >= RESERVE_AFTER_S:  # it waits behind his job, and says so
                reason = plan.reasons.get(job_id, "")
                assert "starts only after job 2 (bob), which waits for 4" in reason, reason
        queued = [j for j in queued if j not in starts] + [max(queued) + 1]
    raise AssertionError("bob's four-device job never started in 59 passes")


def test_the_wait_is_counted_from_when_the_job_was_last_queued() -> None:
    """Held for hours, then released a minute ago, a wide job has waited a minute: the narrow
    rigid jobs behind it still fill the devices it cannot use (a hold does not skip the
    two hours); queued two hours ago, they wait behind it."""
    policy = make_policy("goodput")
    now = 50_000.0
    alices = JobInput(id=1, owner="alice", phase=JobPhase.RUNNING, allocation={"ws": ["cpu:0"]},
                      submit_time=0.0, min_devices=1, elastic=False, last_start=now - 60)  # fmt: skip
    narrow = JobInput(id=3, owner="alice", submit_time=now - 30, min_devices=1, elastic=False)
    for queued_since, starts in ((now - 60.0, True), (now - RESERVE_AFTER_S, False)):
        wide = JobInput(id=2, owner="bob", submit_time=0.0, queued_since=queued_since,
                        min_devices=4, elastic=False)  # fmt: skip
        snapshot = Snapshot(jobs=[wide, alices, narrow], nodes=[NODE], now=now, limits=Limits())
        plan = run_pass(snapshot, policy, np.random.default_rng(0))
        started = {a.job_id for a in plan.actions if a.kind is ActionKind.START}
        assert (3 in started) == starts, (queued_since, plan.reasons)


def test_one_users_long_queue_takes_turns_with_another_users_job() -> None:
    """alice queued 40 one-device rigid jobs, bob one after them, on four devices, all of them
    alike in priority and service (none has run).  Admission went by queue order alone, so
    bob's job started only once every one of hers had (6,600 s with ten-minute jobs; a
    thousand of them would be days); now the owners take turns: his starts in the first pass
    beside her first three, and her jobs keep their order among themselves."""
    policy = make_policy("goodput")
    alices = [
        JobInput(id=job_id, owner="alice", submit_time=float(job_id), min_devices=1, elastic=False)
        for job_id in range(1, 41)
    ]
    bobs = JobInput(id=41, owner="bob", submit_time=41.0, min_devices=1, elastic=False)
    snapshot = Snapshot(jobs=[*alices, bobs], nodes=[NODE], now=100.0, limits=Limits())
    plan = run_pass(snapshot, policy, np.random.default_rng(0))
    starts = {a.job_id for a in plan.actions if a.kind is ActionKind.START}
    assert starts == {1, 2, 3, 41}, starts
    # once hers run, his next one waits for a device like anyone's, no one preempted
    running = [
        JobInput(id=job_id, owner="alice", phase=JobPhase.RUNNING, submit_time=float(job_id),
                 allocation={"ws": [f"cpu:{job_id - 1}"]}, min_devices=1, elastic=False,
                 last_start=90.0)
        for job_id in range(1, 5)
    ]  # fmt: skip
    snapshot = Snapshot(jobs=[*running, *alices[4:], bobs], nodes=[NODE], now=100.0,
                        limits=Limits())  # fmt: skip
    plan = run_pass(snapshot, policy, np.random.default_rng(0))
    assert not [a for a in plan.actions if a.kind is not ActionKind.KEEP], plan.actions
