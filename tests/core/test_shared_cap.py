"""How many shared jobs one device runs: the admin's cap (``Limits.max_jobs_per_device``,
``[devices] max_jobs_per_device``) together with the memory they declared, on the pure pass."""

from __future__ import annotations

from pollux_local.core.schedule import ActionKind, JobInput, JobPhase, Limits, NodeInput
from pollux_local.core.sharing import (
    DEFAULT_MAX_JOBS_PER_DEVICE,
    SharedDevice,
    choose_shared_device,
)
from tests.core.test_schedule_pass import run

GIB = 1 << 30
BOX = (NodeInput("box", ("cpu:0",), memory=16 * GIB),)


def shared(job_id: int, memory: int = GIB, **kw: object) -> JobInput:
    return JobInput(id=job_id, elastic=False, shared=True, gpu_memory=memory, **kw)  # type: ignore[arg-type]


def on_box(job: JobInput) -> JobInput:
    return JobInput(**{**job.__dict__, "phase": JobPhase.RUNNING, "allocation": {"box": ["cpu:0"]}})


def test_four_small_jobs_share_one_device_when_the_admin_allows_four() -> None:
    jobs = [shared(i) for i in range(1, 6)]
    plan = run(jobs, nodes=BOX, limits=Limits(max_jobs_per_device=4))
    starts = {a.job_id: a.allocation for a in plan.actions if a.kind is ActionKind.START}
    assert starts == {i: {"box": ["cpu:0"]} for i in range(1, 5)}
    # the fifth fits by memory (5G of 16G) but not under the cap, and its reason says so
    assert "box[cpu:0] runs 4 shared jobs" in plan.reasons[5]
    assert "[devices] max_jobs_per_device = 4" in plan.reasons[5]
    # next pass, the four running: it still waits, for the same reason, and nothing moves
    later = run(
        [on_box(j) for j in jobs[:4]] + [jobs[4]], nodes=BOX, limits=Limits(max_jobs_per_device=4)
    )
    assert later.actions == ()
    assert later.reasons[5].startswith("waiting: box[cpu:0] runs 4 shared jobs, the most")
    # a cap of 5 lets it join the four
    five = run(
        [on_box(j) for j in jobs[:4]] + [jobs[4]], nodes=BOX, limits=Limits(max_jobs_per_device=5)
    )
    (start,) = five.actions
    assert (start.job_id, start.allocation) == (5, {"box": ["cpu:0"]})
    assert "(5 jobs, 5.0G of 16.0G declared)" in start.reason


def test_memory_bounds_the_packing_below_the_cap() -> None:
    jobs = [shared(i, 6 * GIB) for i in range(1, 5)]
    plan = run(jobs, nodes=BOX, limits=Limits(max_jobs_per_device=8))
    starts = {a.job_id for a in plan.actions if a.kind is ActionKind.START}
    assert starts == {1, 2}  # 6G + 6G of 16G; a third 6G does not fit
    assert "max_jobs_per_device" not in plan.reasons[3]  # the cap is not what holds it


def test_the_slowdown_model_orders_the_devices_a_job_may_join() -> None:
    crowded = SharedDevice(("n", "cuda:0"), jobs=3, used=3 * GIB, total=16 * GIB)
    quiet = SharedDevice(("n", "cuda:1"), jobs=1, used=12 * GIB, total=16 * GIB)
    # best fit alone would pick the crowded one (12G left there vs 3G): the job adds more
    # work beside one job than beside three
    assert choose_shared_device([crowded, quiet], GIB, 0.25, max_jobs=8) == quiet
    # with no interference every device gains a whole job: then the best fit
    roomy = SharedDevice(("n", "cuda:2"), jobs=1, used=2 * GIB, total=16 * GIB)
    assert choose_shared_device([crowded, roomy], GIB, 0.0, max_jobs=8) == crowded
    assert choose_shared_device([crowded, roomy], GIB, 0.25, max_jobs=8) == roomy
    assert choose_shared_device([crowded, quiet], 5 * GIB, 0.25, max_jobs=8) == crowded
    assert choose_shared_device([crowded], GIB, 0.25, max_jobs=3) is None
    assert DEFAULT_MAX_JOBS_PER_DEVICE == Limits().max_jobs_per_device == 4
