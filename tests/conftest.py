"""Shared fixtures: where the artifact data lives (read in place, never copied), real daemons
(``daemon_factory``) and the lab install."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.daemon_process import DaemonFactory
from tests.labinstall import LabInstall, missing_tools, run_lab_install, world_readable_tempdir
from tests.paths import REPO_ROOT

ARTIFACT_DIR = Path(
    os.environ.get("POLLUX_ARTIFACT_DIR", REPO_ROOT.parent / "shared" / "data" / "pollux-artifact")
)


@pytest.fixture(scope="session")
def artifact_dir() -> Path:
    if not (ARTIFACT_DIR / "models").is_dir():
        pytest.skip(f"artifact data not found at {ARTIFACT_DIR}")
    return ARTIFACT_DIR


# --- real daemons ---------------------------------------------------------------------------


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
