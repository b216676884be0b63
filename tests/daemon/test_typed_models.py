"""Device types in the daemon's models: profile rows tagged with the type they were measured
on, one model per type, the speed ratio between types, and what the policy is shown."""

from __future__ import annotations

import numpy as np
import pytest

from pollux_local.api.launch import LaunchEnvironment
from pollux_local.api.report import MemoryPoint
from pollux_local.api.states import JobState
from pollux_local.core.schedule import NodeInput
from pollux_local.daemon.scheduler import ModelCache, plan_round
from pollux_local.daemon.state import JobRecord
from pollux_local.torch.profile import ProfileRecorder
from tests.daemon.test_scheduler import FixedPolicy

RNG = np.random.default_rng(0)


def rows(device_type: str, step_1: float) -> list[dict[str, object]]:
    """A profile measured on ``device_type``: one device takes ``step_1`` s for 32 examples."""
    out = []
    for k in (1, 2):
        for m in (16, 32):
            step = step_1 * m / 32 * (1.0 + 0.1 * (k - 1))
            out.append(
                {"nodes": 1, "replicas": k, "local_batch": m, "compute_s": step * 0.9,
                 "step_s": step, "count": 5, "device_type": device_type}
            )  # fmt: skip
    return out


def job(job_id: int, profile: list[dict[str, object]], argv: str = "train.py") -> JobRecord:
    return JobRecord(
        id=job_id, name="j", owner_uid=1, owner_gid=1, owner_name="ann", state=JobState.QUEUED,
        spec={"argv": [argv], "workdir": "/", "min_gpus": 1, "max_gpus": 4, "batch_size": 32,
              "max_batch_size": 256},
        report={"profile": profile, "grad_stats": {"sqr": 1.0, "var": 2.0},
                "bounds": {"base_batch": 32, "max_batch": 256, "min_local": 8, "max_local": 64}},
    )  # fmt: skip


def test_one_model_per_type_each_from_its_own_rows() -> None:
    cache = ModelCache()
    record = job(1, rows("fast", 0.1) + rows("slow", 0.3))
    models = cache.models_by_type(record, ["fast", "slow", "none"])
    assert set(models) == {"fast", "slow"}
    fast, slow = (
        models[t].best_goodput(np.array([1]), np.array([1]))[0][0] for t in ("fast", "slow")
    )
    assert fast / slow == pytest.approx(3.0, rel=0.05)


def test_type_rates_measured_learned_across_kinds_or_declared() -> None:
    cache = ModelCache()
    both = job(1, rows("fast", 0.1) + rows("slow", 0.4), argv="a.py")
    cache.models_by_type(both, ["fast", "slow"])
    rates = cache.type_rates(both, ["fast", "slow"], {})
    assert rates["fast"] == pytest.approx(320.0) and rates["slow"] == pytest.approx(80.0)
    # another kind measured only on "fast": "slow" from the ratio the first kind showed
    only_fast = job(2, rows("fast", 0.2), argv="b.py")
    cache.models_by_type(only_fast, ["fast", "slow"])
    learned = cache.type_rates(only_fast, ["fast", "slow"], {})
    assert learned["slow"] == pytest.approx(learned["fast"] / 4)
    # nothing learned: the declared slowdowns (CPU-backed devices) give the ratio
    fresh = ModelCache()
    alone = job(3, rows("fast", 0.2), argv="c.py")
    fresh.models_by_type(alone, ["fast", "slow"])
    declared = fresh.type_rates(alone, ["fast", "slow"], {"fast": 1.0, "slow": 2.0})
    assert declared["slow"] == pytest.approx(declared["fast"] / 2)
    assert fresh.type_rates(alone, ["fast", "slow"], {}) == {"fast": pytest.approx(160.0)}


def test_a_two_type_cluster_shows_the_policy_types_and_per_type_models() -> None:
    nodes = [
        NodeInput("a", ("cpu:0",), device_type="fast"),
        NodeInput("b", ("cpu:1",), device_type="slow", slowdown=3.0),
    ]
    policy = FixedPolicy({"1": (0, 1)})
    plan = plan_round(policy, [job(1, rows("fast", 0.1))], nodes, ModelCache(), 1.0, RNG)
    assert [n.device_type for n in policy.seen_nodes] == ["fast", "slow"]
    (view,) = policy.seen_jobs
    assert view.models_by_type is not None and set(view.models_by_type) == {"fast"}
    assert view.type_rates is not None and view.type_rates["slow"] == pytest.approx(
        view.type_rates["fast"] / 3
    )
    # placed on a type it has no model of: it starts with the batch it asked for
    (action,) = plan.actions
    assert action.batch is not None and action.batch.total_batch == 32
    # one type only: untyped, as before
    single = [NodeInput("a", ("cpu:0", "cpu:1"), device_type="cpu")]
    policy = FixedPolicy({"1": (2,)})
    plan_round(policy, [job(1, rows("cpu", 0.1))], single, ModelCache(), 1.0, RNG)
    assert policy.seen_nodes[0].device_type == "" and policy.seen_jobs[0].models_by_type is None


def test_the_job_side_tags_its_rows_and_reads_its_type_and_slowdown() -> None:
    recorder = ProfileRecorder("fast")
    recorder.add_compute((1, 1, 16), 0.1)
    recorder.add_step((1, 1, 16), 0.1)
    state = recorder.state_dict()
    moved = ProfileRecorder("slow")
    moved.load_state_dict(state)
    moved.add_compute((1, 1, 16), 0.3)
    moved.add_step((1, 1, 16), 0.3)
    observed = moved.observations()
    assert [(r["device_type"], r["step_s"]) for r in observed] == [("fast", 0.1), ("slow", 0.3)]
    assert [r["device_type"] for r in moved.observations("slow")] == ["slow"]
    env = LaunchEnvironment(device_type="slow", device_slowdown=3.0).common_environ()
    assert env["POLLUX_DEVICE_TYPE"] == "slow" and env["POLLUX_DEVICE_SLOWDOWN"] == "3"
    back = LaunchEnvironment.from_environ(env)
    assert (back.device_type, back.device_slowdown) == ("slow", 3.0)


def test_the_local_batch_is_bounded_by_what_fits_each_types_memory() -> None:
    gib = 1 << 30
    record = job(1, rows("big", 0.1) + rows("small", 0.2))
    assert record.report is not None
    # measured peaks: 1 GiB + 0.25 GiB per example of local batch
    record.report.memory = [
        MemoryPoint(device_type="big", local_batch=m, peak_bytes=gib + m * gib // 4,
                    total_bytes=80 * gib)
        for m in (8, 16)
    ]  # fmt: skip
    cache = ModelCache()
    models = cache.models_by_type(record, ["big", "small"], {"big": 80 * gib, "small": 4 * gib})
    assert models["big"].bounds.max_local == 64  # the job's own bound: memory is no limit
    small = models["small"].bounds.max_local
    assert 1 <= small < 16  # at most what 4 GiB holds, with a safety margin
    assert 1 * gib + small * gib // 4 <= 4 * gib
    # a device where not even the smallest local batch (8) fits: no model of that type
    tiny = cache.models_by_type(record, ["big", "small"], {"big": 80 * gib, "small": 2 * gib})
    assert "small" not in tiny and "big" in tiny
