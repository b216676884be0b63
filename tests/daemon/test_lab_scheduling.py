"""Issue 20's scheduling features against a real daemon on CPU devices: dependencies, arrays
with ``max_running``, time limits, reserved and drained devices, constraints, accounting.

Jobs are rigid shell scripts (``sleep``, ``exit``), submitted through the typed client."""

from __future__ import annotations

import contextlib
import json
import sqlite3
import threading
import time
from pathlib import Path

import pytest

from pollux_local import api
from tests.daemon_process import DaemonFactory, DaemonProcess, wait_for


def start_daemon(daemons: DaemonFactory, devices: str, extra_config: str = "") -> DaemonProcess:
    """A FIFO daemon scheduling every 0.3 s that never retries a job, and ``extra_config``."""
    return daemons(
        devices=devices,
        config='[scheduler]\npolicy = "fifo"\ninterval_s = 0.3\n\n[daemon]\nstop_grace_s = 2\n'
        "max_retries = 0\n" + extra_config,
    )


@pytest.fixture()
def root(tmp_path: Path) -> Path:
    return tmp_path


def script(root: Path, name: str, body: str) -> str:
    path = root / name
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
    return str(path)


def submit(daemon: DaemonProcess, argv: list[str], workdir: Path, **fields: object) -> str:
    reply = daemon.client.call(api.Submit(argv=argv, workdir=str(workdir), **fields))  # type: ignore[arg-type]
    return reply.id


def show(daemon: DaemonProcess, job_id: str) -> api.JobDetail:
    return daemon.client.call(api.Show(id=job_id)).job


def wait_state(
    daemon: DaemonProcess, job_id: str, *states: str, timeout_s: float = 60
) -> api.JobDetail:
    def reached() -> api.JobDetail | None:
        job = show(daemon, job_id)
        return job if job.state.value in states else None

    try:
        found: api.JobDetail = wait_for(reached, timeout_s, f"job {job_id} to be {states}")
    except AssertionError as exc:
        job = show(daemon, job_id)
        raise AssertionError(
            f"{exc}; it is {job.state.value} ({job.reason})\n{daemon.output()}"
        ) from None
    return found


@pytest.fixture()
def daemon(daemon_factory: DaemonFactory) -> DaemonProcess:
    return start_daemon(daemon_factory, "cpu:3")


def test_a_chain_where_the_middle_fails_fails_the_rest_with_the_reason(
    daemon: DaemonProcess, root: Path
) -> None:
    ok = script(root, "ok.sh", "sleep 1\n")
    bad = script(root, "bad.sh", "exit 3\n")
    a = submit(daemon, [ok], root)
    b = submit(daemon, [bad], root, after=[a])
    c = submit(daemon, [ok], root, after=[b])
    d = submit(daemon, [ok], root, after=[c])  # a dependent's dependent fails too
    any_end = submit(daemon, [ok], root, after=[b], after_any=True)  # runs however b ends
    one_of = submit(daemon, [ok], root, after=[b, a], after_one=True)  # a succeeds: it runs
    none_of = submit(daemon, [ok], root, after=[b, c], after_one=True)  # neither will
    with pytest.raises(api.InvalidRequest, match="cannot be combined"):
        submit(daemon, [ok], root, after=[a], after_any=True, after_one=True)
    waiting = show(daemon, b)
    assert waiting.state.value == "queued" or waiting.state.value in ("running", "failed")
    if waiting.state.value == "queued":
        assert waiting.reason.startswith("waiting: after job") or waiting.reason == ""
    assert wait_state(daemon, a, "succeeded").state.value == "succeeded"
    assert wait_state(daemon, b, "failed").start_time is not None  # b ran, and failed
    c_job = wait_state(daemon, c, "failed")
    assert c_job.reason == f"dependency {b} failed" and c_job.start_time is None
    d_job = wait_state(daemon, d, "failed")
    assert d_job.reason == f"dependency {c} failed" and d_job.start_time is None
    assert wait_state(daemon, any_end, "succeeded").start_time is not None
    assert wait_state(daemon, one_of, "succeeded").start_time is not None
    none_job = wait_state(daemon, none_of, "failed")
    assert none_job.reason == f"no dependency succeeded (dependency {b} failed)"
    assert none_job.start_time is None


def test_a_job_waits_with_the_reason_while_its_dependency_runs(
    daemon: DaemonProcess, root: Path
) -> None:
    slow = script(root, "slow.sh", "sleep 3\n")
    first = submit(daemon, [slow], root)
    second = submit(daemon, [slow], root, after=[first])
    wait_state(daemon, first, "running")
    expected = f"waiting: after job {first} (running)"
    job = wait_for(
        lambda: (j := show(daemon, second)).reason == expected and j,
        10,
        "the dependent's waiting reason",
    )
    assert job.state.value == "queued"
    cancelled = submit(daemon, [slow], root, hold=True)
    third = submit(daemon, [slow], root, after=[cancelled])
    daemon.client.call(api.Cancel(ids=[cancelled]))
    assert wait_state(daemon, third, "failed").reason == f"dependency {cancelled} was cancelled"


def test_an_array_of_six_never_runs_more_than_two_at_once(
    daemon: DaemonProcess, root: Path
) -> None:
    marks = root / "marks"
    marks.mkdir()
    task = script(
        root,
        "task.sh",
        f'echo "$POLLUX_ARRAY_ID $POLLUX_ARRAY_INDEX $SLURM_ARRAY_TASK_ID" > {marks}/$POLLUX_ARRAY_INDEX\n'
        "sleep 1\n",
    )
    reply = daemon.client.call(
        api.Submit(
            argv=[task],
            workdir=str(root),
            array=[api.ArrayTask(index=i) for i in (0, 2, 4, 6, 8, 10)],
            max_running=2,
        )
    )
    ids = reply.ids
    assert len(ids) == 6 and reply.id == ids[0]
    most = 0
    stop = threading.Event()

    def watch() -> None:
        nonlocal most
        while not stop.is_set():
            jobs = daemon.client.call(api.Status()).jobs
            running = sum(
                1 for j in jobs if j.id in ids and j.state.value in ("running", "rescaling")
            )
            most = max(most, running)
            time.sleep(0.05)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        for job_id in ids:
            wait_state(daemon, job_id, "succeeded", timeout_s=90)
    finally:
        stop.set()
        watcher.join()
    assert most == 2  # two at once, never three (the daemon has three devices)
    lines = sorted((marks / name).read_text().split() for name in map(str, (0, 2, 4, 6, 8, 10)))
    assert sorted(lines) == sorted([ids[0], str(i), str(i)] for i in (0, 2, 4, 6, 8, 10))
    summary = show(daemon, ids[3])
    assert summary.array_id == ids[0] and summary.array_index == 6


def test_a_job_is_stopped_at_its_time_limit_and_fails_with_the_reason(
    daemon: DaemonProcess, root: Path
) -> None:
    endless = script(root, "endless.sh", "trap '' TERM\nwhile true; do sleep 0.2; done\n")
    job_id = submit(daemon, [endless], root, time_limit_s=2.0)
    started = wait_state(daemon, job_id, "running")
    assert started.time_limit_s == 2.0
    ended = wait_state(daemon, job_id, "failed", timeout_s=30)
    assert ended.reason == "time limit 2s reached"
    assert ended.run_time_s == pytest.approx(2.0, abs=1.5)
    # the replicas are gone (SIGKILL after the grace: the script ignores SIGTERM)
    wait_for(lambda: not show(daemon, job_id).pids, 15, "the job's processes to be gone")


def test_reserved_and_drained_devices_are_never_given_out(
    root: Path, daemon_factory: DaemonFactory
) -> None:
    proc = start_daemon(daemon_factory, "cpu:3", '\n[devices]\nreserved = ["cpu:1"]\n')
    slow = script(root, "slow.sh", "sleep 2\n")
    nodes = proc.client.call(api.Nodes()).nodes
    assert nodes[0].withheld == ["cpu:1"] and nodes[0].device_type == "cpu"
    name = nodes[0].name
    drained = proc.client.call(api.Drain(target="cpu:2")).withheld
    assert drained == [f"{name}:cpu:2"]
    first = submit(proc, [slow], root)
    second = submit(proc, [slow], root)
    held = wait_state(proc, first, "running").devices
    assert held == {name: ["cpu:0"]}
    waiting = wait_for(
        lambda: (j := show(proc, second)).reason.startswith("waiting") and j, 10, "a reason"
    )
    assert waiting.state.value == "queued" and "1 device" in waiting.reason
    proc.client.call(api.Resume(target=f"{name}:cpu:2"))
    assert wait_state(proc, second, "running").devices == {name: ["cpu:2"]}
    for job_id in (first, second):
        wait_state(proc, job_id, "succeeded")
    # a draining node: no new job, the running one goes on
    third = submit(proc, [script(root, "mid.sh", "sleep 2\n")], root)
    assert wait_state(proc, third, "running").devices == {name: ["cpu:0"]}
    proc.client.call(api.Drain(target=name))
    fourth = submit(proc, [slow], root)
    wait_state(proc, third, "succeeded")
    time.sleep(1.0)
    assert show(proc, fourth).state.value == "queued"
    proc.client.call(api.Resume(target=name))
    wait_state(proc, fourth, "succeeded")


def test_a_constraint_keeps_a_job_on_its_nodes(root: Path, daemon_factory: DaemonFactory) -> None:
    proc = daemon_factory(
        config='[scheduler]\npolicy = "fifo"\ninterval_s = 0.3\n\n'
        '[nodes.slow]\ndevices = "cpu:2"\ntype = "small"\n\n'
        '[nodes.fast]\nhost = "localhost"\ndevices = ["cpu:2", "cpu:3"]\ntype = "big"\n'
    )
    slow = script(root, "slow.sh", "sleep 1\n")
    on_big = submit(proc, [slow], root, constraint=api.Constraint(device_type="big"))
    job = wait_state(proc, on_big, "running")
    assert list(job.devices) == ["fast"] and job.device_type == "big"
    with pytest.raises(api.InvalidRequest, match="device type 'huge'"):
        submit(proc, [slow], root, constraint=api.Constraint(device_type="huge"))
    with pytest.raises(api.InvalidRequest, match="needs 3 device"):
        submit(proc, [slow], root, min_gpus=3, constraint=api.Constraint(nodes=["slow"]))
    wait_state(proc, on_big, "succeeded")


def test_usage_counts_each_users_device_hours_and_jobs(daemon: DaemonProcess, root: Path) -> None:
    ok = script(root, "ok.sh", "sleep 1\n")
    bad = script(root, "bad.sh", "sleep 1\nexit 2\n")
    jobs = [
        submit(daemon, [ok], root, min_gpus=2),
        submit(daemon, [bad], root),
        submit(daemon, [ok], root, hold=True),  # never runs: not counted
    ]
    wait_state(daemon, jobs[0], "succeeded")
    wait_state(daemon, jobs[1], "failed")
    reply = daemon.client.call(api.Usage())
    (me,) = reply.users
    ran = [show(daemon, job_id) for job_id in jobs[:2]]
    expected_hours = sum(j.run_time_s * (2 if j.id == jobs[0] else 1) for j in ran) / 3600
    assert me.jobs == 2 and me.succeeded == 1 and me.failed == 1
    assert me.device_hours == pytest.approx(expected_hours, rel=0.05)
    assert set(me.by_type) == {"cpu"} and reply.total.device_hours == me.device_hours
    assert daemon.client.call(api.Usage(user="nobody-here")).users == []
    later = daemon.client.call(api.Usage(since=time.time() + 3600))
    assert later.users == [] and later.total.jobs == 0
    raw = json.loads(json.dumps(daemon.client.request("usage")))
    assert raw["users"][0]["user"] == me.user and raw["users"][0]["jobs"] == 2


def test_a_notify_command_records_each_jobs_end(root: Path, daemon_factory: DaemonFactory) -> None:
    record = root / "ends.txt"
    proc = start_daemon(
        daemon_factory,
        "cpu:2",
        "\n[notify]\ncommand = 'echo \"$POLLUX_JOB_ID $POLLUX_JOB_STATE $POLLUX_JOB_OWNER"
        f" $POLLUX_JOB_REASON\" >> {record}'\n",
    )
    ok = script(root, "ok.sh", "exit 0\n")
    bad = script(root, "bad.sh", "exit 4\n")
    first = submit(proc, [ok], root)
    second = submit(proc, [bad], root)
    third = submit(proc, [ok], root, hold=True)
    proc.client.call(api.Cancel(ids=[third]))
    for job_id, state in ((first, "succeeded"), (second, "failed")):
        wait_state(proc, job_id, state)

    def lines() -> list[str] | None:
        found = record.read_text().splitlines() if record.exists() else []
        return found if len(found) >= 3 else None

    ends = sorted(wait_for(lines, 20, "three notifications"))
    owner = show(proc, first).owner
    assert ends == sorted(
        [
            f"{first} succeeded {owner} finished",
            f"{second} failed {owner} {show(proc, second).reason}",
            f"{third} cancelled {owner} cancelled",
        ]
    )
    time.sleep(1.0)  # and never twice
    assert len(record.read_text().splitlines()) == 3


def test_default_and_longest_time_limits_restart_and_edit(
    root: Path, daemon_factory: DaemonFactory
) -> None:
    proc = start_daemon(
        daemon_factory, "cpu:2", '\n[limits]\ndefault_time = "10m"\nmax_time = "1h"\n'
    )
    ok = script(root, "ok.sh", "exit 0\n")
    held = submit(proc, [ok], root, hold=True)
    assert show(proc, held).time_limit_s == 600.0  # the daemon's default
    with pytest.raises(api.InvalidRequest, match=r"time limit 2h is longer than .* 1h"):
        submit(proc, [ok], root, time_limit_s=7200.0)
    # edit: a waiting job's command, size, time limit and priority
    proc.client.call(
        api.Edit(id=held, argv=[ok, "--fast"], min_gpus=2, time_limit_s=1800.0, priority=-3)
    )
    edited = show(proc, held)
    assert (edited.argv, edited.min_gpus, edited.time_limit_s, edited.priority) == (
        [ok, "--fast"],
        2,
        1800.0,
        -3,
    )
    # an edited command replaces the old one in the state: ten more edits leave no trace
    blobs = "SELECT COUNT(*) FROM blobs"
    with contextlib.closing(sqlite3.connect(proc.state_dir / "state.db")) as db:
        (before,) = db.execute(blobs).fetchone()
        for number in range(10):
            proc.client.call(api.Edit(id=held, argv=[ok, "x" * 10_000, str(number)]))
        proc.client.call(api.Edit(id=held, argv=[ok, "--fast"]))
        assert db.execute(blobs).fetchone() == (before,)
    with pytest.raises(api.InvalidRequest, match="longer than"):
        proc.client.call(api.Edit(id=held, time_limit_s=7200.0))
    with pytest.raises(api.InvalidRequest, match="needs at least 3 device"):
        proc.client.call(api.Edit(id=held, min_gpus=3))
    proc.client.call(api.Release(id=held))
    wait_state(proc, held, "succeeded")
    with pytest.raises(api.Conflict, match="only a queued or held job can be edited"):
        proc.client.call(api.Edit(id=held, priority=1))
    # restart: the same command, size and limit under a new id
    again = proc.client.call(api.Restart(id=held)).id
    assert again != held
    copy = show(proc, again)
    assert (copy.argv, copy.min_gpus, copy.time_limit_s) == ([ok, "--fast"], 2, 1800.0)
    wait_state(proc, again, "succeeded")
    with pytest.raises(api.Conflict, match="only a job that ended"):
        proc.client.call(api.Restart(id=submit(proc, [ok], root, hold=True)))


def test_cancel_array_reaches_restarted_tasks_and_an_empty_cancel_is_refused(
    daemon: DaemonProcess, root: Path
) -> None:
    quick = script(root, "quick.sh", "exit 0\n")
    ids = daemon.client.call(
        api.Submit(argv=[quick], workdir=str(root), array=[api.ArrayTask(index=i) for i in (0, 1)])
    ).ids
    for job_id in ids:
        wait_state(daemon, job_id, "succeeded")
    again = daemon.client.call(api.Restart(id=ids[1], hold=True)).id
    assert show(daemon, again).array_id == ids[0]  # still a task of its array
    reply = daemon.client.call(api.Cancel(arrays=[ids[0]]))
    assert reply.cancelled == [again]
    assert sorted(s.id for s in reply.skipped) == sorted(ids)
    with pytest.raises(api.InvalidRequest, match="name at least one job or array"):
        daemon.client.call(api.Cancel())
