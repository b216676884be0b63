"""The pure scheduling pass on hand-made snapshots: no daemon, no store, no clock."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from pollux_local.core.baselines import FifoPolicy
from pollux_local.core.schedule import (
    ActionKind,
    Constraint,
    Dependency,
    Holding,
    JobInput,
    JobPhase,
    Limits,
    NodeInput,
    Outcome,
    Plan,
    Snapshot,
    run_pass,
)
from pollux_local.core.types import Decision, JobView, NodeView, Placement

GIB = 1 << 30
TWO_NODES = (NodeInput("a", ("cpu:0", "cpu:1")), NodeInput("b", ("cpu:0", "cpu:1")))


class Answers:
    """A policy answering fixed placements, remembering which jobs it was shown."""

    name = "answers"

    def __init__(self, placements: Mapping[str, Placement]) -> None:
        self.placements = dict(placements)
        self.seen: list[str] = []

    def decide(
        self,
        jobs: Sequence[JobView],
        nodes: Sequence[NodeView],
        now: float,
        rng: np.random.Generator,
    ) -> Decision:
        self.seen = [job.id for job in jobs]
        return Decision(placements={job.id: self.placements.get(job.id, ()) for job in jobs})


def run(jobs: Sequence[JobInput], policy: object = None, **kw: object) -> Plan:
    snapshot = Snapshot(
        jobs=jobs,
        nodes=kw.pop("nodes", TWO_NODES),  # type: ignore[arg-type]
        now=100.0,
        limits=kw.pop("limits", Limits()),  # type: ignore[arg-type]
        holdings=kw.pop("holdings", ()),  # type: ignore[arg-type]
    )
    return run_pass(snapshot, policy or FifoPolicy(), np.random.default_rng(0))  # type: ignore[arg-type]


def running(job_id: int, allocation: dict[str, list[str]], **kw: object) -> JobInput:
    return JobInput(id=job_id, phase=JobPhase.RUNNING, allocation=allocation, **kw)  # type: ignore[arg-type]


def test_a_dependency_not_yet_succeeded_keeps_a_job_from_the_policy() -> None:
    policy = Answers({"2": (1, 0)})
    waits = JobInput(id=2, after=(Dependency(1, Outcome.PENDING, "running"),))
    plan = run([waits], policy)
    assert policy.seen == [] and plan.actions == ()
    assert plan.reasons == {2: "waiting: after job 1 (running)"}
    failed = JobInput(id=2, after=(Dependency(1, Outcome.FAILED, "failed"),))
    assert run([failed]).reasons == {2: "waiting: dependency 1 failed"}
    ready = JobInput(id=2, after=(Dependency(1, Outcome.SUCCEEDED, "succeeded"),))
    assert [a.kind for a in run([ready]).actions] == [ActionKind.START]


def test_an_array_runs_at_most_its_max_running_tasks() -> None:
    task = {"array_id": "7", "array_max_running": 1}
    jobs = [running(7, {"a": ["cpu:0"]}, **task), JobInput(id=8, **task)]  # type: ignore[arg-type]
    plan = run(jobs)
    assert plan.for_job(8) is None
    assert plan.reasons[8] == "waiting: array 7 has 1 tasks running, its --max-running is 1"


def test_an_arrays_task_still_stopping_counts_in_its_max_running() -> None:
    """A cancelled task deaf to SIGTERM still runs until its grace ends: the next task of an
    array with ``--max-running 1`` waits for it (a review saw two run at once)."""
    held = Holding(job_id=7, owner="ann", devices={"a": ["cpu:0"]}, array_id="7")
    nodes = (NodeInput("a", ("cpu:0", "cpu:1"), stopping={"cpu:0": 7}),)
    task = JobInput(id=8, owner="ann", array_id="7", array_max_running=1)
    plan = run([task], nodes=nodes, holdings=(held,))
    assert plan.actions == ()
    assert plan.reasons[8] == "waiting: array 7 has 1 tasks running, its --max-running is 1"
    free = run([task], nodes=nodes, holdings=(Holding(job_id=7, owner="ann", devices={}),))
    assert free.actions  # a stopping job of no array does not count


def test_a_stopping_job_counts_in_its_owners_device_cap() -> None:
    held = Holding(job_id=9, owner="ann", devices={"a": ["cpu:0"]})
    nodes = (NodeInput("a", ("cpu:0", "cpu:1"), stopping={"cpu:0": 9}),)
    plan = run(
        [JobInput(id=10, owner="ann")],
        nodes=nodes,
        limits=Limits(max_devices_per_user=1),
        holdings=(held,),
    )
    assert plan.actions == ()
    assert plan.reasons[10] == (
        "waiting: ann's jobs hold 1 devices (job(s) 9 still stopping), this job needs 1 more,"
        " a user may hold 1 ([limits] max_devices_per_user)"
    )
    # another user starts, but never on the device the stopping job still holds
    other = run([JobInput(id=11, owner="bob")], nodes=nodes, holdings=(held,))
    assert other.actions[0].allocation == {"a": ["cpu:1"]}


def test_a_job_never_runs_outside_its_constraint() -> None:
    only_b = JobInput(id=1, constraint=Constraint(nodes=frozenset({"b"})))
    plan = run([only_b], Answers({"1": (1, 0)}))  # the policy ignores the constraint
    assert plan.actions == ()
    assert plan.reasons[1] == "waiting: needs 1 device, 4 free"
    start = run([only_b]).actions[0]  # FIFO keeps it
    assert start.kind is ActionKind.START and start.allocation == {"b": ["cpu:0"]}


def test_a_rigid_job_runs_on_exactly_its_size() -> None:
    rigid = JobInput(id=1, elastic=False, min_devices=2, batch_size=32)
    plan = run([rigid], Answers({"1": (1, 0)}))
    assert plan.actions == () and plan.reasons[1] == "waiting: needs 2 devices, 4 free"
    assert run([rigid], Answers({"1": (2, 1)})).actions == ()  # three devices: none
    (exact,) = run([rigid], Answers({"1": (2, 0)})).actions
    assert exact.allocation == {"a": ["cpu:0", "cpu:1"]} and exact.batch is None
    # once running it keeps its devices whatever the policy says
    kept = running(1, {"b": ["cpu:0", "cpu:1"]}, elastic=False, min_devices=2)
    plan = run([kept], Answers({"1": (0, 0)}))
    assert plan.actions == () and plan.unchanged == (1,)


def test_a_shared_job_joins_a_device_running_shared_jobs() -> None:
    nodes = (NodeInput("a", ("cpu:0", "cpu:1"), memory=16 * GIB),)
    first = running(1, {"a": ["cpu:0"]}, shared=True, elastic=False, gpu_memory=4 * GIB)
    joiner = JobInput(id=2, shared=True, elastic=False, gpu_memory=4 * GIB)
    elastic = JobInput(id=3, max_devices=2)
    policy = Answers({"3": (2,)})
    plan = run([first, joiner, elastic], policy, nodes=nodes)
    assert policy.seen == ["3"]  # shared jobs are packed outside the policy
    join = plan.for_job(2)
    assert join is not None and join.kind is ActionKind.START
    assert join.allocation == {"a": ["cpu:0"]}
    assert "sharing it with job(s) 1 (2 jobs, 8.0G of 16.0G declared)" in join.reason
    # the device running shared jobs is never offered to the elastic job: it gets the other
    elastic_start = plan.for_job(3)
    assert elastic_start is not None and elastic_start.allocation == {"a": ["cpu:1"]}


def test_the_pass_answers_for_every_waiting_job() -> None:
    jobs = [JobInput(id=i, min_devices=2, submit_time=float(i)) for i in range(1, 5)]
    plan = run(jobs)
    started = {a.job_id for a in plan.actions}
    assert started == {1, 2}
    assert set(plan.reasons) == {3, 4}
    holders = "needs 2 devices, 0 free; job 1 (default) holds 2; job 2 (default) holds 2"
    assert plan.reasons[3] == f"waiting: queued behind an earlier job; {holders}"
    # a queued job waiting out a back-off says so
    later = run([JobInput(id=5, retry_after=160.0)])
    assert later.reasons == {5: "waiting: retry in 1m00s (back-off after a crash)"}


def test_a_resize_changes_only_the_devices_it_must() -> None:
    """A shrinking job keeps its first devices (its lowest ranks': the replicas that stay
    keep theirs), a growing one keeps all of its own, and a newcomer takes what is left."""
    from pollux_local.core.schedule.placement import assign_devices
    from pollux_local.core.schedule.snapshot import NodeInput

    node = NodeInput(name="vm", devices=("cpu:0", "cpu:1", "cpu:2", "cpu:3"))
    shrunk = assign_devices({5: (1,), 1: (1,)}, {1: {"vm": ["cpu:3", "cpu:1"]}}, [node])
    # the newcomer (5) comes first and would have taken cpu:1 by the lowest-free rule
    assert shrunk[1] == {"vm": ["cpu:3"]} and shrunk[5] == {"vm": ["cpu:0"]}
    grown = assign_devices({1: (3,)}, {1: {"vm": ["cpu:2", "cpu:1"]}}, [node])
    assert grown[1] == {"vm": ["cpu:2", "cpu:1", "cpu:0"]}


def test_a_pass_without_explanations_decides_the_same() -> None:
    """``Snapshot.explain`` off (the simulator's pass): the same actions, allocations and
    batches, without predicted figures or reason words."""
    from pollux_local.core import BatchBounds, GoodputModel, GradStats, ThroughputParams
    from pollux_local.core.policy import GoodputPolicy

    params = ThroughputParams(
        alpha_c=0.02, beta_c=0.0007, alpha_r=0.08, beta_r=0.01, alpha_n=0.15, beta_n=0.02,
        gamma=2.0,
    )  # fmt: skip
    bounds = BatchBounds(base_batch=64, max_batch=4096, min_local=8, max_local=256)
    model = GoodputModel(params, GradStats(sqr=0.5, var=2.0), bounds)
    jobs = [
        running(1, {"a": ["cpu:0"]}, model=model, batch_size=64),
        JobInput(id=2, model=model, batch_size=64),
        JobInput(id=3, elastic=False, min_devices=4),
    ]
    plans = {
        explain: run_pass(
            Snapshot(jobs=jobs, nodes=TWO_NODES, now=100.0, explain=explain),
            GoodputPolicy(),
            np.random.default_rng(0),
        )
        for explain in (True, False)
    }
    told, quiet = plans[True], plans[False]
    assert told.actions and any(a.prediction for a in told.actions), told
    assert any(a.reason for a in told.actions)
    assert [(a.kind, a.job_id, a.allocation, a.batch) for a in quiet.actions] == [
        (a.kind, a.job_id, a.allocation, a.batch) for a in told.actions
    ]
    assert quiet.unchanged == told.unchanged
    assert all(a.prediction == {} and a.reason == "" for a in quiet.actions)
    assert quiet.reasons == {} and quiet.predictions == {}


def test_a_job_larger_than_the_devices_open_to_jobs_says_which_are_withheld() -> None:
    """Reserved or drained devices may be given back (a reload, ``resume``): the job waits,
    saying how many devices are open to jobs and how many are withheld."""
    from pollux_local.core.policy import GoodputPolicy

    nodes = (
        NodeInput("a", ("cpu:0", "cpu:1"), withheld=frozenset({"cpu:1"})),
        NodeInput("b", ("cpu:0", "cpu:1")),
    )
    wide = JobInput(id=1, min_devices=4)
    for policy in (FifoPolicy(), GoodputPolicy(), Answers({})):
        plan = run([wide], policy, nodes=nodes)
        assert plan.actions == ()
        assert plan.reasons[1] == (
            "waiting: needs 4 devices; 3 are open to jobs (1 reserved or drained)"
        )
    # counted on the nodes its constraint allows: node a alone, one device withheld
    only_a = JobInput(id=2, min_devices=2, constraint=Constraint(nodes=frozenset({"a"})))
    assert run([only_a], nodes=nodes).reasons[2] == (
        "waiting: needs 2 devices; 1 is open to jobs (1 reserved or drained)"
    )
    # a job that fits the open devices waits as before
    fits = run([running(3, {"b": ["cpu:0", "cpu:1"]}), JobInput(id=4, min_devices=3)], nodes=nodes)
    assert "open to jobs" not in fits.reasons[4]
