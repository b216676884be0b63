"""Host memory and CPU limits as the daemon checks and applies them: the ``[limits]`` keys
(``default_mem``, ``max_mem``, ``default_cpus``, ``max_cpus``, ``cgroup_root``,
``cgroup_parent``), the one validation of a job's ``--mem``/``--cpus`` (caps, this machine's
size, remote nodes, cgroups that cannot be written) and the limits a launch gets (its own,
else the defaults; none on a remote node)."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import pytest

from pollux_local.api.errors import InvalidRequest, LimitExceeded
from pollux_local.api.spec import Constraint, JobSpec
from pollux_local.daemon.config import DaemonConfig, NodeConfig, load_config
from pollux_local.daemon.executor.launchspec import host_limits
from pollux_local.daemon.jobrules import check_job
from pollux_local.errors import PolluxError
from pollux_local.launch import cgroups

pytestmark = pytest.mark.timeout(60)


def spec(**fields: object) -> JobSpec:
    return JobSpec(argv=["true"], workdir="/", **fields)  # type: ignore[arg-type]


def test_the_limits_keys_are_read_and_checked(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text(
        '[limits]\ndefault_mem = "1G"\nmax_mem = "4G"\ndefault_cpus = 1\nmax_cpus = 1.5\n'
        'cgroup_root = "/sys/fs/cgroup"\ncgroup_parent = "/lab/pollux"\n'
    )
    config = load_config(path, "cpu:1")
    assert (config.default_host_memory, config.max_host_memory) == (1 << 30, 4 << 30)
    assert (config.default_cpus, config.max_cpus) == (1.0, 1.5)
    assert config.cgroup_parent == "/lab/pollux"
    defaults = load_config(None, "cpu:1")
    assert defaults.default_host_memory is None and defaults.max_cpus is None
    assert defaults.cgroup_root == cgroups.CGROUP_ROOT and defaults.cgroup_parent is None
    for text, fragment in [
        ('[limits]\ndefault_mem = "8G"\nmax_mem = "4G"\n', "default_mem is more than its cap"),
        ("[limits]\ndefault_cpus = 4\nmax_cpus = 2\n", "default_cpus is more than its cap"),
        ('[limits]\nmax_mem = "1M"\n', "max_mem must be at least 4.0M"),
        ("[limits]\nmax_cpus = 0\n", "max_cpus must be at least 0.01"),
        ('[limits]\ncgroup_parent = "lab"\n', "cgroup_parent must be an absolute path"),
        ('[limits]\ncgroup_parent = "/a/../b"\n', "cgroup_parent must be an absolute path"),
        (
            '[limits]\ndefault_memory = "1G"\n',
            "'default_memory' in [limits] (did you mean 'default_mem'?)",
        ),
    ]:
        path.write_text(text)
        with pytest.raises(PolluxError) as refused:
            load_config(path, "cpu:1")
        assert fragment in str(refused.value)


def writable() -> None:
    if os.geteuid() != 0:
        pytest.skip("writing cgroups needs root")
    support = cgroups.detect()
    if support.memory is None or support.cpu is None:
        pytest.skip(f"no writable memory and cpu cgroups here: {support.memory_why}")


def test_a_jobs_own_limits_are_checked_once_for_every_path() -> None:
    writable()
    local = DaemonConfig(nodes=(NodeConfig("here", ("cpu:0",)),), max_host_memory=1 << 30)
    assert check_job(spec(host_memory=64 << 20, cpus=0.5), local).host_memory == 64 << 20
    with pytest.raises(LimitExceeded, match=r"--mem 2G is more than 1G, .*\(\[limits\] max_mem\)"):
        check_job(spec(host_memory=2 << 30), local)
    capped = replace(local, max_cpus=1.0)
    with pytest.raises(LimitExceeded, match=r"--cpus 1.5 is more than 1, .*max_cpus"):
        check_job(spec(cpus=1.5), capped)
    cores = os.cpu_count() or 1
    with pytest.raises(InvalidRequest, match=f"more than this machine's {cores} CPUs"):
        check_job(spec(cpus=float(cores + 1)), local)
    with pytest.raises(InvalidRequest, match="more than this machine's memory"):
        check_job(spec(host_memory=1 << 50), replace(local, max_host_memory=None))


def test_a_job_that_may_run_on_a_remote_node_cannot_ask_for_limits() -> None:
    nodes = (NodeConfig("here", ("cpu:0",)), NodeConfig("box2", ("cpu:0",), host="box2"))
    config = DaemonConfig(nodes=nodes)
    with pytest.raises(InvalidRequest, match="^--mem: the job may be placed on remote node box2"):
        check_job(spec(host_memory=64 << 20), config)
    with pytest.raises(InvalidRequest, match="^--cpus: the job may be placed on remote node box2"):
        check_job(spec(cpus=1.0), config)
    writable()
    kept_here = spec(host_memory=64 << 20, constraint=Constraint(nodes=["here"]))
    assert check_job(kept_here, config).host_memory == 64 << 20


def test_not_writable_cgroups_refuse_the_options_and_drop_the_defaults(tmp_path: Path) -> None:
    root = str(tmp_path / "none")
    config = DaemonConfig(
        nodes=(NodeConfig("here", ("cpu:0",)),), cgroup_root=root, default_host_memory=1 << 30
    )
    with pytest.raises(InvalidRequest, match=r"^--mem: cgroups are not writable here \(no cgroup"):
        check_job(spec(host_memory=64 << 20), config)
    with pytest.raises(InvalidRequest, match=r"^--cpus: cgroups are not writable here"):
        check_job(spec(cpus=1.0), config)
    assert check_job(spec(), config).host_memory is None  # the default is applied at launch
    assert host_limits(spec(), config) is None  # ... where it cannot be enforced: dropped


def test_a_launch_gets_its_own_limits_else_the_defaults() -> None:
    writable()
    config = DaemonConfig(
        nodes=(NodeConfig("here", ("cpu:0",)),), default_host_memory=1 << 30, default_cpus=2.0
    )
    defaults = host_limits(spec(), config)
    assert defaults is not None and (defaults.memory, defaults.cpus) == (1 << 30, 2.0)
    own = host_limits(spec(host_memory=64 << 20), config)
    assert own is not None and (own.memory, own.cpus) == (64 << 20, 2.0)
    assert host_limits(spec(), DaemonConfig(nodes=config.nodes)) is None
