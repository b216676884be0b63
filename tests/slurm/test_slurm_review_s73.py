"""Review s73: a step whose keeper is gone is not left running beside the job's next start."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from tests.daemon_process import DaemonFactory, wait_for

from .conftest import SlurmAllocation, daemon_config
from .test_slurm_daemon import job, steps_of

pytestmark = pytest.mark.timeout(150)


def test_a_step_whose_keeper_died_is_ended_before_the_job_runs_again(
    allocation: SlurmAllocation, daemon_factory: DaemonFactory, tmp_path: Path
) -> None:
    """The keeper (the daemon's child that runs srun) SIGKILLed (the OOM killer on the login
    node, say) while its step runs: the job counts the incarnation as lost and starts again;
    the old step, srun still attached to it, must not run on beside the new one (the job would
    run twice at once, on the same checkpoint)."""
    daemon = daemon_factory(
        config=daemon_config(tmp_path), env=allocation.environ(), timeout_s=60, cwd=tmp_path
    )
    starts = tmp_path / "starts"
    argv = ["/bin/sh", "-c", f'echo "$POLLUX_RESTARTS" >> {starts}; sleep 25']
    reply = daemon.client.request(
        "submit", argv=argv, workdir=str(tmp_path), env={"PATH": "/usr/bin:/bin"},
        min_gpus=1, max_gpus=1, name="s73",
    )  # fmt: skip
    job_id = str(reply["id"])
    wait_for(lambda: f"pollux-{job_id}.0" in steps_of(allocation), 60, "the first step")
    record = json.loads((daemon.state_dir / "run" / "slurm" / f"slurm-{job_id}.json").read_text())
    os.kill(int(record["keeper_pid"]), signal.SIGKILL)
    # the job is started again (incarnation 1) ...
    wait_for(lambda: job(daemon, job_id)["restarts"] >= 2 or
             job(daemon, job_id)["state"] in ("failed", "succeeded"), 60, "a second start")  # fmt: skip
    time.sleep(3.0)
    running = steps_of(allocation)
    # ... and the first incarnation's step no longer runs beside it
    shown = job(daemon, job_id)
    assert f"pollux-{job_id}.0" not in running, (
        running,
        starts.read_text(),
        shown["state"],
        shown["restarts"],
        shown["reason"],
    )
    daemon.client.request("cancel", ids=[job_id])


def test_a_start_of_an_incarnation_already_started_ends_the_earlier_step_first(
    allocation: SlurmAllocation, tmp_path: Path
) -> None:
    """A daemon killed after its keeper started a step but before it recorded the start
    leaves the job queued with the same incarnation: the restarted daemon starts it again, as
    a step of the same name, with the same record.  The earlier step must not run on beside it
    (the job twice at once), nor its keeper's end be taken for the new step's."""
    import asyncio

    from pollux_local.launch.base import LaunchSpec, ReplicaSlot
    from pollux_local.launch.slurm import SlurmLauncher, read_allocation

    run = tmp_path / "run"
    run.mkdir()
    logs = tmp_path / "job"
    logs.mkdir()
    starts = tmp_path / "starts"
    launcher = SlurmLauncher(read_allocation(dict(allocation.environ())), run)  # type: ignore[arg-type]
    slot = ReplicaSlot(rank=0, node=allocation.nodes[0], device="cuda:0", local_rank=0,
                       node_rank=0)  # fmt: skip
    # the first start runs 12 s and exits 11, the second exits 12 at once
    script = (
        f"echo start >> {starts}; n=$(wc -l < {starts});"
        f' [ "$n" -gt 1 ] || {{ sleep 12; echo end >> {starts}; }}; exit $((10 + n))'
    )
    spec = LaunchSpec(job_id="73", argv=["/bin/sh", "-c", script], workdir=tmp_path,
                      env={"PATH": "/usr/bin:/bin", "POLLUX_RESTARTS": "0"}, slots=[slot],
                      log_dir=logs)  # fmt: skip

    async def scenario() -> tuple[int, list[str], dict[str, str]]:
        await launcher.launch(spec)  # the start the killed daemon never recorded
        await asyncio.to_thread(
            wait_for, lambda: "pollux-73.0" in steps_of(allocation), 60, "the first step"
        )
        again = await launcher.launch(spec)  # the restarted daemon's
        code = await asyncio.wait_for(again.wait(), 90)
        await asyncio.sleep(2.0)
        return code, starts.read_text().split(), steps_of(allocation)

    code, lines, running = asyncio.run(scenario())
    # the second start's own end (12), not the first's (11) taken from its keeper's record
    # the earlier step was ended before the new one ran (it never reached its end) ...
    assert lines == ["start", "start"], lines
    # ... and the new start's end is its own
    assert code == 12, (code, lines)
    assert "pollux-73.0" not in running, running


def test_a_power_cut_after_a_finished_step_before_its_keeper_wrote_its_end_does_not_run_it_again(
    allocation: SlurmAllocation, daemon_factory: DaemonFactory, tmp_path: Path
) -> None:
    """A job's only task exits 0 (leaving a child behind) and its rank wrapper writes that
    end; a power cut before the keeper wrote the step's (the daemon, the keeper and its srun
    SIGKILLed; both helpers stopped before the task ends, so that the cut falls there): the
    job has finished, is recorded so and is not run again.  A keeper gone without an end
    was taken for a lost step (255): the job failed, or ran a second time (a retry)."""
    marker = tmp_path / "runs"
    daemon = daemon_factory(
        config=daemon_config(tmp_path), env=allocation.environ(), timeout_s=60, cwd=tmp_path
    )
    argv = ["/bin/sh", "-c", f"echo run >> {marker}; sleep 30 & sleep 2; exit 0"]
    reply = daemon.client.request(
        "submit", argv=argv, workdir=str(tmp_path), env={"PATH": "/usr/bin:/bin"},
        min_gpus=1, max_gpus=1, name="cut", retries=1,
    )  # fmt: skip
    job_id = str(reply["id"])
    wait_for(marker.exists, 60, "the job to run")
    path = daemon.state_dir / "run" / "slurm" / f"slurm-{job_id}.json"
    record = json.loads(path.read_text())
    helpers = [int(record["keeper_pid"]), int(record["srun_pid"])]
    for pid in helpers:
        os.kill(pid, signal.SIGSTOP)
    exit_file = daemon.state_dir / "jobs" / job_id / ".exit-0-rank0"
    wait_for(exit_file.exists, 30, "the task's own end")
    daemon.kill()
    for pid in helpers:
        os.kill(pid, signal.SIGKILL)
    assert json.loads(path.read_text())["state"] != "ended"
    daemon.start(timeout_s=60)
    shown = wait_for(
        lambda: (j := job(daemon, job_id))["state"] in ("succeeded", "failed") and j,
        90,
        "the job's end",
    )
    assert shown["state"] == "succeeded", (shown["reason"], daemon.output())
    time.sleep(3.0)  # a second run would have begun by now
    assert marker.read_text().split() == ["run"]
    assert job(daemon, job_id)["state"] == "succeeded"
    assert f"pollux-{job_id}.0" not in steps_of(allocation)
