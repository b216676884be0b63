"""Fixtures of the Slurm tests: the test bed of ``scripts/slurm-testbed-up`` (``bed.py``), a
real allocation of it (``salloc --no-shell``) and a daemon started inside that allocation.

The tests are skipped, with the reason, only when the test bed is not up and ``CI`` is not
set; under ``CI`` a missing test bed fails them."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.daemon_process import DaemonFactory, DaemonProcess

from . import bed

HERE = Path(__file__).parent


def missing_bed() -> str | None:
    """Why the Slurm test bed cannot be used here, or ``None`` when it is up."""
    if os.geteuid() != 0:
        return "the Slurm test bed needs root"
    if shutil.which("salloc") is None or shutil.which("srun") is None:
        return "Slurm's client tools are not installed (run scripts/slurm-testbed-up)"
    if bed.info() is None:
        return "the Slurm test bed is not up (run scripts/slurm-testbed-up as root)"
    proc = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=20)
    if proc.returncode != 0:
        return f"sinfo fails: {proc.stderr.strip()[:200]} (run scripts/slurm-testbed-up)"
    return None


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The tests here that need the test bed (the ``slurm_bed`` fixture, directly or not) are
    marked ``slurm``; without the test bed and without ``CI`` they are skipped."""
    reason = None if os.environ.get("CI") else missing_bed()
    for item in items:
        uses_bed = "slurm_bed" in getattr(item, "fixturenames", ())
        if Path(str(item.fspath)).is_relative_to(HERE) and uses_bed:
            item.add_marker(pytest.mark.slurm)
            if reason:
                item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="session")
def slurm_bed() -> dict[str, object]:
    """What ``scripts/slurm-testbed-up`` recorded (its absence: a skip, a failure under
    ``CI``)."""
    reason = missing_bed()
    if reason and os.environ.get("CI"):
        pytest.fail(reason)
    if reason:
        pytest.skip(reason)
    info = bed.info()
    assert info is not None
    return info


@dataclass(frozen=True)
class SlurmAllocation:
    job_id: str
    nodelist: str
    nodes: list[str]

    def cancel(self) -> None:
        """End the allocation (``scancel``): Slurm ends its steps."""
        subprocess.run(["scancel", self.job_id], capture_output=True, timeout=20)

    def environ(self) -> dict[str, str | None]:
        """What a process started inside the allocation finds in its environment."""
        return {"SLURM_JOB_ID": self.job_id, "SLURM_JOB_NODELIST": self.nodelist}


def make_allocation() -> SlurmAllocation:
    """A real allocation of both nodes, one GPU and one task each (so a 2-rank job spans
    them), made by ``salloc --no-shell``; ``--no-kill``: a failed node leaves the allocation
    rather than ending it.  :meth:`SlurmAllocation.cancel` ends it."""
    proc = subprocess.run(
        ["salloc", "--no-shell", "-N2", "--ntasks-per-node=1", "--gres=gpu:testgpu:1",
         "--no-kill", "--job-name=pollux-tests", "--immediate=20"],
        capture_output=True, text=True, timeout=40,
    )  # fmt: skip
    match = re.search(r"Granted job allocation (\d+)", proc.stderr)
    assert proc.returncode == 0 and match, proc.stderr
    job_id = match.group(1)
    try:
        nodelist = subprocess.run(
            ["squeue", "-h", "-j", job_id, "-o", "%N"], capture_output=True, text=True, timeout=20
        ).stdout.strip()
        nodes = subprocess.run(
            ["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=20
        ).stdout.split()
    except BaseException:
        subprocess.run(["scancel", job_id], capture_output=True, timeout=20)
        raise
    return SlurmAllocation(job_id, nodelist, nodes)


@pytest.fixture()
def allocation(slurm_bed: dict[str, object]) -> Iterator[SlurmAllocation]:
    """An allocation of the test bed (:func:`make_allocation`), cancelled at the end."""
    made = make_allocation()
    try:
        yield made
    finally:
        made.cancel()


@pytest.fixture()
def slurm_daemon(
    allocation: SlurmAllocation, daemon_factory: DaemonFactory, tmp_path: Path
) -> DaemonProcess:
    """A daemon inside the allocation (found from ``SLURM_JOB_ID``: no ``--launcher``)."""
    return daemon_factory(
        config=daemon_config(tmp_path), env=allocation.environ(), timeout_s=60, cwd=tmp_path
    )


def daemon_config(root: Path, policy: str = "fifo") -> str:
    return "\n".join(
        [
            "[scheduler]",
            f'policy = "{policy}"',
            "restart_cost_s = 1",
            "interval_s = 1",
            "[daemon]",
            f'checkpoint_root = "{root / "ckpt"}"',
            "pg_timeout_s = 20",
            "stop_grace_s = 15",
            "backoff_s = 0.5",
            "node_retry_s = 3",
            "",
        ]
    )
