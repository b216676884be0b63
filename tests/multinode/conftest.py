"""Fixtures of the multi-node tests: one namespace test bed per session, SSH nodes for it."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from pollux_local.launch.ssh import SshLauncher, SshNodeConfig

from .testbed import Testbed, TestHost, missing_requirements

REPO_ROOT = Path(__file__).resolve().parents[2]
GLOO_JOB = Path(__file__).with_name("gloo_job.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    reason = missing_requirements()
    here = Path(__file__).parent
    for item in items:
        if Path(str(item.fspath)).is_relative_to(here):
            item.add_marker(pytest.mark.multinode)
            if reason:
                item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="session")
def testbed() -> Iterator[Testbed]:
    bed = Testbed(n_hosts=2).up()
    try:
        yield bed
    finally:
        bed.down()


def ssh_nodes(bed: Testbed) -> list[SshNodeConfig]:
    return [
        SshNodeConfig(
            name=host.name,
            host=host.name,
            devices=("cpu:0", "cpu:1"),
            address=host.address,
            gloo_ifname=host.ifname,
            ssh_options=bed.ssh_options(),
            workdir=str(bed.dir / f"work-{host.name}"),
            python="/usr/bin/python3",
        )
        for host in bed.hosts
    ]


@pytest.fixture()
def launcher(testbed: Testbed, tmp_path: Path) -> SshLauncher:
    # A short control dir: socket paths are limited to ~104 bytes.
    control = testbed.dir / "ctl"
    return SshLauncher(ssh_nodes(testbed), control_dir=control, failure_grace_s=3.0)


def job_env(checkpoint_dir: Path, world: int, port: int) -> dict[str, str]:
    """The environment the daemon would build for a job (common part)."""
    return {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": os.environ.get("HOME", "/root"),
        "PYTHONPATH": str(REPO_ROOT),
        "OMP_NUM_THREADS": "1",
        "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "POLLUX_CHECKPOINT_DIR": str(checkpoint_dir),
        "POLLUX_PG_TIMEOUT_S": "20",
        "POLLUX_DEVICE": "cpu",
    }


PYTHON = sys.executable


def node_table(bed: Testbed, host: TestHost, devices: str, root: Path) -> list[str]:
    """The daemon config's ``[nodes."NAME"]`` table of a test bed host (workdir under
    ``root``)."""
    options = ", ".join(json.dumps(o) for o in bed.ssh_options())
    return [
        f'[nodes."{host.name}"]',
        f'host = "{host.name}"',
        f'devices = "{devices}"',
        f'address = "{host.address}"',
        f'gloo_ifname = "{host.ifname}"',
        f"ssh_options = [{options}]",
        'python = "/usr/bin/python3"',
        f'workdir = "{root / ("work-" + host.name)}"',
    ]
