"""Two device types on one machine, for real: CPU-backed devices of two declared speeds (the
slow type declares a slowdown; the job library stretches its steps by it), a rigid job holding
the fast device, an elastic job started on the slow one, and the scheduler moving that job to
the fast type once it frees up (checkpoint-restart), after which it finishes."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from pollux_local import api
from tests.daemon_process import DaemonFactory, DaemonProcess, wait_for
from tests.paths import STEADY_JOB as STEADY

pytestmark = pytest.mark.timeout(300)


@pytest.fixture()
def daemon(daemon_factory: DaemonFactory) -> DaemonProcess:
    return daemon_factory(
        config="[scheduler]\ninterval_s = 1\nrestart_cost_s = 2\n\n[daemon]\nstop_grace_s = 20\n\n"
        '[nodes.quick]\ndevices = ["cpu:0"]\ntype = "quick"\n\n'
        '[nodes.sluggish]\nhost = "localhost"\ndevices = ["cpu:1"]\ntype = "sluggish"\n'
        "slowdown = 4\n"
    )


def show(daemon: DaemonProcess, job_id: str) -> api.ShowReply:
    return daemon.client.call(api.Show(id=job_id))


def test_an_elastic_job_moves_to_the_faster_type_when_it_frees_up(
    daemon: DaemonProcess, tmp_path: Path
) -> None:
    blocker = tmp_path / "blocker.sh"
    blocker.write_text("#!/bin/sh\nsleep 15\n")
    blocker.chmod(0o755)
    held = daemon.client.call(
        api.Submit(
            argv=[str(blocker)], workdir=str(tmp_path), constraint=api.Constraint(nodes=["quick"])
        )
    ).id
    wait_for(lambda: show(daemon, held).job.state.value == "running", 30, "the blocker to start")
    elastic = daemon.client.call(
        api.Submit(
            argv=[
                sys.executable,
                "-u",
                str(STEADY / "train.py"),
                "--max-epochs",
                "150",
                "--pause",
                "0.004",
            ],
            workdir=str(STEADY),
            elastic=True,
            min_gpus=1,
            max_gpus=1,
            name="steady",
        )  # fmt: skip
    ).id
    first = wait_for(
        lambda: (j := show(daemon, elastic).job).state.value == "running" and j, 60, "a start"
    )
    assert first.devices == {"sluggish": ["cpu:1"]} and first.device_type == "sluggish"

    def moved() -> api.ShowReply | None:
        reply = show(daemon, elastic)
        if reply.job.state.value in ("failed", "succeeded"):
            raise AssertionError(
                f"the job ended {reply.job.state.value} without moving: {reply.job.reason}\n"
                f"{[(d.kind, d.reason) for d in reply.decisions]}\n{daemon.output()[-6000:]}"
            )
        if time.monotonic() - started > 110:
            raise AssertionError(
                f"no move yet: {reply.job.state.value} {reply.job.devices} {reply.job.reason}\n"
                f"{[(d.kind, d.reason) for d in reply.decisions]}\n{daemon.output()[-6000:]}"
            )
        return reply if reply.job.devices == {"quick": ["cpu:0"]} else None

    started = time.monotonic()
    reply = wait_for(moved, 120, "the job to move to the quick device")
    assert time.monotonic() - started < 120
    kinds = [d.kind for d in reply.decisions]
    assert "resize" in kinds, kinds  # moved by checkpoint-restart, not restarted from scratch
    assert reply.job.device_type == "quick"
    done = wait_for(
        lambda: (j := show(daemon, elastic).job).state.value in ("succeeded", "failed") and j,
        180,
        "the job to end",
    )
    assert done.state.value == "succeeded", done.reason
    # it measured both types, each row tagged with its type
    assert done.report is not None
    types = {row.device_type for row in done.report.profile}
    assert types == {"quick", "sluggish"}
