"""Shared fixtures: where the artifact data lives (read in place, never copied), real daemons
(``daemon_factory``) and the lab install."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.daemon_process import DaemonFactory, log_tail
from tests.labinstall import LabInstall, missing_tools, run_lab_install, world_readable_tempdir
from tests.paths import REPO_ROOT

TESTS = Path(__file__).resolve().parent

ARTIFACT_DIR = Path(
    os.environ.get("POLLUX_ARTIFACT_DIR", REPO_ROOT.parent / "shared" / "data" / "pollux-artifact")
)


@pytest.fixture(scope="session")
def artifact_dir() -> Path:
    if not (ARTIFACT_DIR / "models").is_dir():
        pytest.skip(f"artifact data not found at {ARTIFACT_DIR}")
    return ARTIFACT_DIR


# --- running in parallel (``pytest -n 2 --dist loadgroup``) --------------------------------

#: Test files whose tests must share one pytest-xdist worker with each other, by what they
#: share: the SSH test bed of ``tests/multinode`` (one fixed subnet) and the Slurm cluster of
#: ``tests/slurm``; and the job cgroups ``BASE/pollux-local/job-<id>-<n>``, where ``BASE`` is
#: the daemon's own cgroup, the same for every worker: two daemons of these files running job 1
#: at once would take each other's group for a stale one.  Every other file is a group of its
#: own, so that its module fixtures (users, a tmux session) are made once, on one worker.
SHARED_GROUPS = {
    "tests/multinode": "ssh-testbed",
    "tests/slurm": "slurm-testbed",
    "tests/daemon/test_host_limits.py": "cgroups",
    "tests/abuse/test_host_limits.py": "cgroups",
    "tests/launch/test_cgroups.py": "cgroups",
}


def xdist_group(path: Path) -> str:
    """The ``xdist_group`` of the tests in ``path``: a shared group, or the file's own."""
    relative = path.resolve().relative_to(TESTS.parent).as_posix()
    for prefix, group in SHARED_GROUPS.items():
        if relative == prefix or relative.startswith(prefix + "/"):
            return group
    return relative


#: The longest groups, handed out first so that no worker is left with one at the end.
FIRST = ("ssh-testbed", "slurm-testbed")


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the marks
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    groups: dict[pytest.Item, str] = {}
    for item in items:
        groups[item] = xdist_group(Path(str(item.fspath)))
        item.add_marker(pytest.mark.xdist_group(groups[item]))
    items.sort(key=lambda item: FIRST.index(groups[item]) if groups[item] in FIRST else len(FIRST))


# --- real daemons ---------------------------------------------------------------------------


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """A failed test that started real daemons shows the end of each one's log beside its
    failure: a failure in a full run (CI) is read from its output alone."""
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    if report.when != "call" or not report.failed:
        return
    values = getattr(item, "funcargs", {}).values()
    for factory in {id(v): v for v in values if isinstance(v, DaemonFactory)}.values():
        for daemon in factory.started:
            tail = log_tail(daemon.state_dir / "daemon.log", 40)
            report.sections.append((f"daemon log {daemon.state_dir} (its end)", tail))


@pytest.fixture
def daemon_factory(tmp_path: Path) -> Iterator[DaemonFactory]:
    """Start real daemons (``daemon_factory(devices="cpu:2", config=TEXT, interval=1)``, see
    :class:`tests.daemon_process.DaemonFactory`) under ``tmp_path``; every one is stopped at
    teardown."""
    with DaemonFactory(tmp_path) as factory:
        yield factory


# --- the lab install: one shared interpreter for the multi-user tests -----------------------


@pytest.fixture(scope="session")
def lab_install() -> Iterator[LabInstall]:
    """``scripts/lab-install`` run once per session into a world-readable prefix under /tmp
    (removed at the end): the interpreter and ``pollux-local`` every test user runs, and the
    daemon of the multi-user tests too.  Skipped unless root."""
    if os.geteuid() != 0:
        pytest.skip("the lab install and its test users need root")
    missing = missing_tools()
    if missing:
        pytest.skip(f"the lab install needs {', '.join(missing)}")
    base = world_readable_tempdir("pollux-lab-")
    try:
        yield run_lab_install(base / "venv")
    finally:
        shutil.rmtree(base, ignore_errors=True)
