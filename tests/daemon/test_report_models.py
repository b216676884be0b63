"""Reports and the models fitted from them, without a daemon: one owner's reports never reach
another owner's model, a model is refitted only when its points change, the pools stay
bounded whatever is reported, and one rule says who may report for a job."""

from __future__ import annotations

import asyncio
import dataclasses
import os
from pathlib import Path

import msgspec
import pytest

from pollux_local.api.errors import PermissionDenied
from pollux_local.api.messages import Show
from pollux_local.api.report import JobReport
from pollux_local.core.pool import ProfilePool
from pollux_local.daemon.auth import Peer
from pollux_local.daemon.config import DaemonConfig, NodeConfig
from pollux_local.daemon.context import Context
from pollux_local.daemon.handlers import query
from pollux_local.daemon.readmodel import MetricHistory
from pollux_local.daemon.reports import ReportPace, check_reporter, pace_of
from pollux_local.daemon.scheduler import POOL_KINDS, POOL_POINTS, ModelCache
from pollux_local.daemon.state import JobRecord, StateStore


def job(job_id: int, owner: int, state: str = "running", **spec: object) -> JobRecord:
    base = {"argv": ["python", "train.py"], "workdir": "/lab", "batch_size": 64, **spec}
    return JobRecord(
        id=job_id, name=f"j{job_id}", owner_uid=owner, owner_gid=owner,
        owner_name=f"u{owner}", state=state, spec=base, submit_time=0.0,
    )  # fmt: skip


def report(points: list[tuple[int, int, int, float]], epoch: int = 3) -> JobReport:
    return msgspec.convert({
        "version": 1,
        "bounds": {"base_batch": 64, "max_batch": 1024, "min_local": 8, "max_local": 256},
        "profile": [
            {
                "nodes": n,
                "replicas": k,
                "local_batch": m,
                "compute_s": t,
                "step_s": t * 1.2,
                "count": 10,
            }
            for n, k, m, t in points
        ],  # fmt: skip
        "grad_stats": {"sqr": 1.0, "var": 4.0},
        "epoch": epoch,
    }, JobReport)  # fmt: skip


HONEST = [(1, 1, 32, 0.05), (1, 1, 64, 0.09), (1, 2, 32, 0.05)]


def test_another_owners_reports_of_the_same_kind_never_change_a_jobs_model() -> None:
    cache = ModelCache()
    bobs = job(1, owner=2001)
    bobs.report = report(HONEST, epoch=0)  # its first epoch: the kind's starting statistics
    before = cache.model_for(bobs)
    assert before is not None and cache.fitted_points(bobs) == 3
    # the same command, folder and batch, another owner, invented throughput elsewhere
    alices = job(2, owner=2002)
    alices.report = report([(1, 4, m, 1e-4) for m in (8, 16, 128, 256)], epoch=0)
    assert cache.model_for(alices) is not None
    after = cache.model_for(bobs)
    assert after is not None and after.params == before.params
    assert cache.fitted_points(bobs) == 3 and cache.fitted_points(alices) == 4
    # the owner's own jobs of the kind still pool their points (and starting statistics)
    bobs_second = job(3, owner=2001)
    pooled = cache.model_for(bobs_second)
    assert pooled is not None and pooled.params == before.params
    assert cache.fitted_points(bobs_second) == 3


def test_a_model_is_refitted_only_when_its_points_change() -> None:
    cache = ModelCache()
    first, second = job(1, owner=2001), job(2, owner=2001)
    first.report, second.report = report(HONEST), report([(1, 1, 32, 0.06)])
    for _ in range(20):  # passes with nothing new: no fit after the first pass or two
        assert cache.model_for(first) is not None and cache.model_for(second) is not None
        # a pass reads every report from the store anew
        first.report = msgspec.json.decode(msgspec.json.encode(first.report), type=JobReport)
    # first, second (pooling a new point); not first again: its kind's pool changed, but
    # not its merged points (its own point wins over the one second pooled)
    assert cache.fit_count == 2
    second.report = report([(1, 1, 32, 0.06), (1, 4, 32, 0.07)])
    cache.model_for(second)
    cache.model_for(first)  # its merged points changed (a new configuration): refitted once
    cache.model_for(first)
    assert cache.fit_count == 4


def test_pools_stay_bounded_whatever_is_reported() -> None:
    cache = ModelCache()
    flooder = job(1, owner=2002)
    for start in range(0, 20 * 200, 200):  # 4,000 distinct configurations over 20 reports
        flooder.report = report([(1, 1, m, 0.01 * m) for m in range(start + 1, start + 201)])
        cache.model_for(flooder)
    assert cache.fitted_points(flooder) <= POOL_POINTS + 200
    pool = cache.pool(2002)
    for kind in range(POOL_KINDS + 30):
        other = job(100 + kind, owner=2002, argv=["python", f"t{kind}.py"])
        other.report = report(HONEST)
        cache.model_for(other)
    assert len(pool.kinds()) == POOL_KINDS
    assert cache.pool(2001).kinds() == []  # another owner's pool untouched


def test_a_bounded_pool_keeps_its_first_points_and_versions_change_with_them() -> None:
    pool = ProfilePool(max_points=2, max_kinds=1)
    assert pool.add("k", {(1, 1, 8): (0.1, 0.1), (1, 1, 16): (0.2, 0.2), (1, 1, 32): (0.4, 0.4)})
    assert set(pool.points_for("k", {})) == {(1, 1, 8), (1, 1, 16)}
    version = pool.version("k")
    assert not pool.add("k", {(1, 1, 8): (0.1, 0.1)}) and pool.version("k") == version
    assert pool.add("k", {(1, 1, 8): (0.3, 0.3)}) and pool.version("k") != version
    pool.add("other", {(1, 1, 8): (0.1, 0.1)})
    assert pool.kinds() == ["other"] and pool.version("k") == 0


def test_only_the_jobs_user_root_or_the_daemon_may_report_for_it() -> None:
    daemon_uid = os.geteuid()
    running = job(7, owner=2001)
    assert check_reporter(running, 2001, daemon_uid)
    assert check_reporter(running, 0, daemon_uid)
    with pytest.raises(PermissionDenied, match="job 7 belongs to u2001; only its own"):
        check_reporter(running, 2002, 12345)
    assert check_reporter(job(8, owner=2001, state="rescaling"), 2001, daemon_uid)
    # no process of a job that is not placed runs: its reports are not taken (review s60)
    for state in ("queued", "held", "cancelled", "succeeded"):
        assert not check_reporter(job(9, owner=2001, state=state), 2001, daemon_uid), state
    # unless they are still stopping (preempted, held while running): their last reports
    stopping = dataclasses.replace(job(10, owner=2001, state="queued"), pids=[{"pid": 5}])
    assert check_reporter(stopping, 2001, daemon_uid)
    ended = dataclasses.replace(job(11, owner=2001, state="cancelled"), pids=[{"pid": 5}])
    assert not check_reporter(ended, 2001, daemon_uid)


def test_one_users_many_jobs_share_a_budget_of_reports() -> None:
    """A thousand jobs of one user, each at the per-job pace, were 583 database writes a
    second; now one user's reports together are taken at USER_REPORTS_PER_S (a burst above
    it), and another user's are not affected."""
    pace = ReportPace(interval_s=0.5, per_user_s=20.0, burst=40.0)
    now = 50.0
    taken = 0
    for step in range(100):  # one second: 1,000 jobs of uid 2001, 10 reports each ms apart
        for job_id in range(step * 10, step * 10 + 10):
            taken += pace.take(job_id, 2001, now=now + step * 0.01)
    assert 40 <= taken <= 40 + 20 + 1, taken  # the burst, then the rate
    assert pace.take(5000, 2002, now=now + 1.0)  # another user's job: its own budget
    later = now + 10.0  # refilled (to the burst, not beyond)
    assert sum(pace.take(6000 + i, 2001, now=later) for i in range(100)) == 40


def test_a_jobs_reports_are_taken_at_most_every_half_second_per_daemon() -> None:
    pace = ReportPace(interval_s=0.5)
    assert pace.take(1, now=10.0) and pace.take(2, now=10.1)
    assert not pace.take(1, now=10.4) and not pace.take(1, now=10.45)
    assert pace.take(1, now=10.5)
    for job_id in range(3, 2000):  # old entries are dropped as it grows
        pace.take(job_id, now=100.0 + job_id)
    assert len(pace._taken) <= 1025

    class Store:  # what the daemon keys its pace by: its store
        pass

    one, other = Store(), Store()
    assert pace_of(one) is pace_of(one) and pace_of(one) is not pace_of(other)


def test_a_show_of_another_users_jobs_fits_nothing_and_spends_no_budget(tmp_path: Path) -> None:
    """``show`` is a read: bob's ``show`` of alice's jobs ran their fits on the daemon's event
    loop, spent alice's budget of fits for the pass and changed the slots and pools a pass
    uses from its thread (review s63).  It shows the model the passes fitted, no other."""
    store = StateStore(tmp_path / "state.db")
    cache = ModelCache()
    ctx = Context(
        peer=Peer(1, 1000, 1000), store=store,
        executor=None,  # type: ignore[arg-type]  (show reads the store and the models only)
        config=DaemonConfig(nodes=(NodeConfig("n0", ("cpu:0",)),)), state_dir=tmp_path,
        clock=lambda: 0.0, models=cache, metrics=MetricHistory(), mutex=asyncio.Lock(),
        wake=lambda: None, daemon_uid=0, policy_name="fifo",
    )  # fmt: skip
    alices = []
    for i in range(10):
        added = store.add_job(
            name=f"a{i}", owner_uid=2001, owner_gid=2001, owner_name="alice",
            spec={"argv": ["python", f"train{i}.py"], "workdir": "/lab", "batch_size": 64},
            priority=0, submit_time=0.0,
        )  # fmt: skip
        store.update_job(added.id, report=report([(1, 1, 32, 0.05 + i / 1000), *HONEST[1:]]))
        alices.append(added.id)
    for job_id in alices:
        assert query.show(ctx, Show(id=str(job_id))).job.model is None  # no pass fitted it
    assert cache.fit_count == 0 and not cache._spent and not cache._fits
    first = store.get_job(alices[0])
    assert first is not None
    fitted = cache.model_for(first)  # a pass fits it
    assert fitted is not None and cache.fit_count == 1
    shown = query.show(ctx, Show(id=str(first.id))).job.model
    assert shown is not None and shown.params == fitted.params.to_dict()
    assert shown.fitted_points == 3 and cache.fit_count == 1
