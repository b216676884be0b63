"""The lab install as docs/deploy.md describes it: ``scripts/lab-install``, the systemd units
and the config file in ``deploy/``, and an upgrade that keeps the daemon's state."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from pollux_local.daemon.config import DaemonConfig, load_config
from tests.labinstall import (
    LabDaemon,
    LabInstall,
    LabUser,
    run_lab_install,
    wait_until,
    world_readable_tempdir,
)
from tests.paths import REPO_ROOT

DEPLOY = REPO_ROOT / "deploy"
SYSTEM_UNIT = DEPLOY / "pollux-local.service"
USER_UNIT = DEPLOY / "pollux-local-user.service"
CONFIG = DEPLOY / "config.toml"
DEFAULT_PREFIX = "/opt/pollux-local"

pytestmark = [pytest.mark.timeout(180)]


@pytest.fixture()
def scratch() -> Iterator[Path]:
    base = world_readable_tempdir("pollux-deploy-")
    try:
        yield base
    finally:
        shutil.rmtree(base, ignore_errors=True)


def exec_start(unit: Path) -> str:
    (line,) = [ln for ln in unit.read_text().splitlines() if ln.startswith("ExecStart=")]
    return line.removeprefix("ExecStart=")


# --- the config file -------------------------------------------------------------------------------


def test_example_config_loads_with_the_documented_defaults() -> None:
    config = load_config(CONFIG, devices="cpu:1")
    defaults = DaemonConfig(nodes=config.nodes)
    assert config.admin_group == "pollux-admin"
    for key in ("policy", "interval_s", "p", "restart_cost_s", "max_retries", "backoff_s",
                "stop_grace_s", "pg_timeout_s", "node_retry_s", "checkpoint_root", "allow_group",
                "max_priority", "max_user_connections", "max_user_bytes"):  # fmt: skip
        assert getattr(config, key) == getattr(defaults, key), key
    # every key the daemon reads from [scheduler], [daemon] and [limits] is shown (some
    # commented out), and in docs/deploy.md's table
    text = CONFIG.read_text()
    deploy_doc = (REPO_ROOT / "docs" / "deploy.md").read_text()
    for key in ("policy", "interval_s", "p", "restart_cost_s", "admin_group", "allow_group",
                "max_retries", "backoff_s", "stop_grace_s", "pg_timeout_s", "node_retry_s",
                "checkpoint_root", "max_priority", "connections_per_user",
                "mib_in_flight_per_user"):  # fmt: skip
        assert re.search(rf"^#? ?{key} = ", text, re.MULTILINE), key
        assert f"`{key}`" in deploy_doc, key


def test_units_run_the_lab_install_with_the_documented_paths() -> None:
    system = shlex.split(exec_start(SYSTEM_UNIT))
    assert system == [f"{DEFAULT_PREFIX}/bin/pollux-local", "daemon", "--config",
                      "/etc/pollux-local/config.toml", "--state-dir", "/var/lib/pollux-local"]  # fmt: skip
    user = shlex.split(exec_start(USER_UNIT))
    assert user == [
        f"{DEFAULT_PREFIX}/bin/pollux-local",
        "daemon",
        "--state-dir",
        "%S/pollux-local",
    ]
    assert "StateDirectory=pollux-local" in SYSTEM_UNIT.read_text()
    for unit in (SYSTEM_UNIT, USER_UNIT):  # the daemon stops its jobs; supervisors outlive it
        assert "KillMode=process" in unit.read_text()
    deploy_doc = (REPO_ROOT / "docs" / "deploy.md").read_text()
    for name in ("scripts/lab-install", SYSTEM_UNIT.name, USER_UNIT.name, "config.toml"):
        assert name in deploy_doc, name


# --- the lab install (root) ------------------------------------------------------------------------


def test_lab_install_is_a_copy_every_user_can_run_without_torch(lab_install: LabInstall) -> None:
    print(f"lab install: {lab_install.seconds:.1f} s")
    writable = [
        str(path)
        for path in [lab_install.prefix, *lab_install.prefix.rglob("*")]
        if not path.is_symlink() and path.lstat().st_mode & 0o022
    ]
    assert not writable, f"group- or world-writable: {writable[:5]}"
    probe = (
        "import importlib.util, pollux_local, msgspec; "
        "print(pollux_local.__file__); print(importlib.util.find_spec('torch') is None)"
    )
    done = subprocess.run(
        ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", "--",
         str(lab_install.python), "-c", probe],
        capture_output=True, text=True, timeout=60, cwd="/", env={"PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    location, no_torch = done.stdout.split()
    assert location.startswith(str(lab_install.prefix)), location  # not the checkout
    assert no_torch == "True", "torch was installed into the lab venv"


def test_system_unit_exec_start_serves_the_lab(lab_install: LabInstall, scratch: Path) -> None:
    # The unit's exact command line, with the lab install's prefix and this test's paths.
    config_dir, state_dir = scratch / "etc", scratch / "state"
    config_dir.mkdir()
    (config_dir / "config.toml").write_text(CONFIG.read_text())
    argv = shlex.split(
        exec_start(SYSTEM_UNIT)
        .replace(DEFAULT_PREFIX, str(lab_install.prefix))
        .replace("/etc/pollux-local", str(config_dir))
        .replace("/var/lib/pollux-local", str(state_dir))
    )
    assert argv[0] == str(lab_install.cli)
    daemon = LabDaemon(lab_install, state_dir, argv=argv)
    daemon.start()
    try:
        ping = daemon.client.request("ping")
        assert ping["state_dir"] == str(state_dir)
        assert stat.S_IMODE(state_dir.stat().st_mode) == 0o755
        user = LabUser(lab_install, "pxdep")
        try:
            # a user points the CLI at the lab's daemon with POLLUX_LOCAL_STATE_DIR
            done = user.cli("status", env={"POLLUX_LOCAL_STATE_DIR": str(state_dir)})
            assert done.returncode == 0 and done.stdout.strip() == "no jobs", done
        finally:
            user.remove()
    finally:
        daemon.stop()
    assert daemon.proc is not None and daemon.proc.returncode == 0, daemon.output()


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="needs systemd-analyze")
@pytest.mark.parametrize("unit", [SYSTEM_UNIT, USER_UNIT], ids=lambda p: p.name)
def test_units_pass_systemd_analyze_verify(
    lab_install: LabInstall, scratch: Path, unit: Path
) -> None:
    # verify checks that ExecStart's program exists: point it at the lab install
    name = "pollux-local.service"
    (scratch / name).write_text(unit.read_text().replace(DEFAULT_PREFIX, str(lab_install.prefix)))
    runtime = scratch / "runtime"
    runtime.mkdir(mode=0o700)
    scope = ["--user"] if unit == USER_UNIT else []
    done = subprocess.run(
        ["systemd-analyze", *scope, "verify", str(scratch / name)],
        capture_output=True, text=True, timeout=60,
        env={**os.environ, "XDG_RUNTIME_DIR": str(runtime)},
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout + done.stderr == "", done.stdout + done.stderr  # not even a warning


def test_upgrade_in_place_keeps_the_state_and_links_the_cli(
    lab_install: LabInstall, scratch: Path
) -> None:
    state_dir = scratch / "state"
    daemon = LabDaemon(lab_install, state_dir, "--devices", "cpu:1").start()
    try:
        job_id = daemon.client.request("submit", argv=["/bin/true"], workdir="/tmp", hold=True,
                                       name="before-upgrade")["id"]  # fmt: skip
    finally:
        daemon.stop()

    # the same script again over the same prefix: the upgrade, with --link into a bin dir
    bin_dir = scratch / "bin"
    again = run_lab_install(lab_install.prefix, "--bin-dir", str(bin_dir))
    print(f"upgrade in place: {again.seconds:.1f} s")
    link = bin_dir / "pollux-local"
    assert link.is_symlink() and link.resolve() == lab_install.cli.resolve()

    daemon = LabDaemon(lab_install, state_dir, "--devices", "cpu:1").start()
    try:
        job = wait_until(lambda: daemon.client.request("show", id=str(job_id))["job"], 10, "job")
        assert (job["name"], job["state"]) == ("before-upgrade", "held")
        done = subprocess.run([str(link), "status", "--state-dir", str(state_dir)],
                              capture_output=True, text=True, timeout=60)  # fmt: skip
        assert done.returncode == 0 and "before-upgrade" in done.stdout, done
    finally:
        daemon.stop()
