"""Operations: ``pollux-local service`` (the systemd units), journald lines on stderr, SIGHUP
reading the config again without stopping a job, and the Prometheus endpoint; against a real
daemon on CPU devices."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from pollux_local.cli.service import daemon_program, render_unit, systemd_word
from pollux_local.client import Client
from pollux_local.daemon.metrics import DaemonSnapshot, PrometheusEndpoint
from pollux_local.daemon.statedir import JournalFormatter, stderr_is_journal
from pollux_local.errors import PolluxError
from tests.daemon_process import DaemonFactory, DaemonProcess, wait_for
from tests.labinstall import world_readable_tempdir
from tests.paths import REPO_ROOT

pytestmark = pytest.mark.timeout(120)

DEPLOY = REPO_ROOT / "deploy"
NODE = "ws"


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``pollux-local ARGS`` run by the interpreter running the tests."""
    environ = {**os.environ, "PYTHONPATH": str(REPO_ROOT), **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "pollux_local", *args],
        capture_output=True, text=True, timeout=60, env=environ,
    )  # fmt: skip


def unit_values(text: str) -> dict[str, list[str]]:
    """A unit's ``Key=value`` lines (comments left out), each key's values in order."""
    values: dict[str, list[str]] = {}
    for line in text.splitlines():
        if "=" in line and not line.startswith(("#", ";", "[")):
            key, _, value = line.partition("=")
            values.setdefault(key, []).append(value)
    return values


# --- the systemd units -------------------------------------------------------------------------


def test_system_unit_runs_this_installation_as_the_lab_daemon() -> None:
    done = cli("service", "--system")
    assert done.returncode == 0, done.stderr
    unit = unit_values(done.stdout)
    program = daemon_program()
    assert program == [str(Path(sys.executable).parent / "pollux-local")]  # the venv's script
    assert shlex.split(unit["ExecStart"][0]) == [
        *program, "daemon", "--config", "/etc/pollux-local/config.toml",
        "--state-dir", "/var/lib/pollux-local",
    ]  # fmt: skip
    assert unit["ExecReload"] == ["/bin/kill -HUP $MAINPID"]
    assert unit["Restart"] == ["on-failure"] and unit["KillMode"] == ["process"]
    assert unit["StateDirectory"] == ["pollux-local"] and unit["UMask"] == ["0022"]
    assert "User" not in unit  # root: each job runs as its submitter
    assert unit["ProtectSystem"] == ["full"] and unit["ProtectKernelTunables"] == ["yes"]
    for taken_from_jobs in ("ProtectHome", "PrivateTmp", "PrivateDevices", "NoNewPrivileges"):
        assert taken_from_jobs not in unit, taken_from_jobs
    assert unit["WantedBy"] == ["multi-user.target"]
    # ExecStart's program is a runnable pollux-local
    version = subprocess.run([program[0], "--version"], capture_output=True, text=True, timeout=60)
    assert version.returncode == 0 and version.stdout.startswith("pollux-local "), version


def test_user_unit_runs_a_personal_daemon_in_the_users_state_dir(tmp_path: Path) -> None:
    done = cli("service", "--user", "--devices", "cpu:2")
    assert done.returncode == 0, done.stderr
    unit = unit_values(done.stdout)
    assert shlex.split(unit["ExecStart"][0]) == [
        *daemon_program(), "daemon", "--state-dir", "%S/pollux-local", "--devices", "cpu:2",
    ]  # fmt: skip
    assert unit["ExecReload"] == ["/bin/kill -HUP $MAINPID"]
    assert unit["Restart"] == ["on-failure"] and unit["WantedBy"] == ["default.target"]
    for absent in ("User", "StateDirectory", "ProtectSystem"):
        assert absent not in unit, absent
    refused = cli("service", "--user", "--devices", "gpu:1")
    assert refused.returncode != 0 and "--devices" in refused.stderr

    # --write: where systemd looks for the user's units
    config_home = tmp_path / "config"
    written = cli("service", "--user", "--write", env={"XDG_CONFIG_HOME": str(config_home)})
    path = config_home / "systemd" / "user" / "pollux-local.service"
    assert written.returncode == 0 and f"wrote {path}" in written.stdout, written
    assert path.read_text() == cli("service", "--user").stdout
    assert oct(path.stat().st_mode & 0o777) == "0o644"
    again = cli("service", "--user", "--write", env={"XDG_CONFIG_HOME": str(config_home)})
    assert f"unchanged: {path}" in again.stdout


def test_unit_paths_are_quoted_and_a_state_dir_elsewhere_is_the_daemons_to_make(
    tmp_path: Path,
) -> None:
    odd = tmp_path / "lab 50%"
    done = cli("service", "--system", "--state-dir", str(odd), "--config", "cfg.toml")
    assert done.returncode == 0, done.stderr
    unit = unit_values(done.stdout)
    exec_start = unit["ExecStart"][0]
    assert f'--state-dir "{str(odd).replace("%", "%%")}"' in exec_start
    assert f"--config {Path.cwd() / 'cfg.toml'}" in exec_start  # made absolute
    assert "StateDirectory" not in unit  # not under /var/lib: the daemon makes it
    assert systemd_word("a$b") == "a$$b" and systemd_word('say "hi"') == '"say \\"hi\\""'


def test_deploy_units_are_the_commands_output_for_the_lab_install() -> None:
    program = ["/opt/pollux-local/bin/pollux-local"]
    assert (DEPLOY / "pollux-local.service").read_text() == render_unit("system", program)
    assert (DEPLOY / "pollux-local-user.service").read_text() == render_unit("user", program)


def test_daemon_program_falls_back_to_python_dash_m(tmp_path: Path, monkeypatch: Any) -> None:
    python = tmp_path / "bin" / "python"
    python.parent.mkdir()
    python.symlink_to(sys.executable)
    monkeypatch.setattr(sys, "executable", str(python))
    assert daemon_program() == [str(python), "-m", "pollux_local"]  # no script beside it
    script = python.parent / "pollux-local"
    script.write_text("#!/usr/bin/env python3\n")  # another interpreter's script
    script.chmod(0o755)
    assert daemon_program() == [str(python), "-m", "pollux_local"]
    script.write_text(f"#!{python}\n")
    assert daemon_program() == [str(script)]


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="needs systemd-analyze")
@pytest.mark.parametrize("scope", ["system", "user"])
def test_units_pass_systemd_analyze_verify(tmp_path: Path, scope: str) -> None:
    path = tmp_path / "pollux-local.service"
    done = cli("service", f"--{scope}", "--output", str(path))
    assert done.returncode == 0, done.stderr
    runtime = tmp_path / "runtime"
    runtime.mkdir(mode=0o700)
    verify = subprocess.run(
        ["systemd-analyze", *(["--user"] if scope == "user" else []), "verify", str(path)],
        capture_output=True, text=True, timeout=60,
        env={**os.environ, "XDG_RUNTIME_DIR": str(runtime)},
    )  # fmt: skip
    assert verify.returncode == 0, verify.stdout + verify.stderr
    assert verify.stdout + verify.stderr == "", verify.stdout + verify.stderr  # no warning


# --- a real daemon with a config file ----------------------------------------------------------


def write_config(path: Path, devices: str, extra: str = "") -> None:
    path.write_text(f"[scheduler]\ninterval_s = 1\n\n[nodes.{NODE}]\ndevices = {devices}\n{extra}")


@pytest.fixture()
def root() -> Iterator[Path]:
    """A directory every user may enter (the socket is reached by user nobody too)."""
    base = world_readable_tempdir("pollux-ops-")
    try:
        yield base
    finally:
        shutil.rmtree(base, ignore_errors=True)


def start_daemon(daemons: DaemonFactory, root: Path, config: Path) -> DaemonProcess:
    """A daemon on ``config`` (a file, which a test may change and reload) with its state in
    ``root`` (world-readable: the units' tests run as other users)."""
    return daemons(config=config, state_dir=root / "state")


def sleeper(daemon: DaemonProcess, **fields: Any) -> str:
    reply = daemon.client.request("submit", argv=["/bin/sleep", "600"], workdir="/tmp", **fields)
    return str(reply["id"])


def running_pids(daemon: DaemonProcess, job_id: str) -> list[int] | None:
    job = daemon.client.request("show", id=job_id)["job"]
    if job["state"] != "running" or not job["pids"]:
        return None
    return sorted(p["pid"] for p in job["pids"])


def node_devices(daemon: DaemonProcess) -> list[str]:
    done = cli("nodes", "--json", "--state-dir", str(daemon.state_dir))
    assert done.returncode == 0, done.stderr
    (node,) = [n for n in json.loads(done.stdout)["nodes"] if n["name"] == NODE]
    return list(node["devices"])


def log_lines(daemon: DaemonProcess, needle: str) -> list[str]:
    text = (daemon.state_dir / "daemon.log").read_text()
    return [line for line in text.splitlines() if needle in line]


def reload(daemon: DaemonProcess, needle: str, count: int = 1) -> list[str]:
    """SIGHUP, then wait for the ``count``-th log line holding ``needle``."""
    os.kill(daemon.pid, signal.SIGHUP)
    return wait_for(
        lambda: (lines := log_lines(daemon, needle)) and len(lines) >= count and lines,
        15,
        f"{needle!r} in the daemon's log",
    )


def submit_as_nobody(socket_path: Path, **fields: Any) -> dict[str, Any]:
    """A submit from user nobody (a forked child that drops to it): ``{"id": …}`` or
    ``{"error": …}``."""
    nobody = 65534
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            os.close(read_end)
            os.setgroups([])
            os.setgid(nobody)
            os.setuid(nobody)
            try:
                out = {"id": Client(socket_path).request("submit", **fields)["id"]}
            except PolluxError as exc:
                out = {"error": str(exc)}
            os.write(write_end, json.dumps(out).encode())
        finally:
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as fh:
        data = fh.read()
    os.waitpid(pid, 0)
    return dict(json.loads(data))


@pytest.mark.skipif(os.geteuid() != 0, reason="submits as user nobody: needs root")
def test_sighup_takes_new_devices_and_limits_while_a_job_runs(
    root: Path, daemon_factory: DaemonFactory
) -> None:
    config = root / "config.toml"
    write_config(config, '"cpu:2"', "\n[limits]\nmax_priority = 0\n")
    daemon = start_daemon(daemon_factory, root, config)
    try:
        job = sleeper(daemon)
        pids = wait_for(lambda: running_pids(daemon, job), 30, f"job {job} running")
        assert node_devices(daemon) == ["cpu:0", "cpu:1"]
        ask = {"argv": ["/bin/true"], "workdir": "/tmp", "hold": True, "priority": 5}
        refused = submit_as_nobody(daemon.client.socket_path, **ask)
        assert "priority 5 is above 0" in refused.get("error", ""), refused

        write_config(config, '"cpu:3"', "\n[limits]\nmax_priority = 5\n")
        (line,) = reload(daemon, "reloaded")
        assert f"node {NODE}: cpu:0,cpu:1, type cpu -> cpu:0,cpu:1,cpu:2" in line, line
        assert "max_priority 0 -> 5" in line, line
        assert node_devices(daemon) == ["cpu:0", "cpu:1", "cpu:2"]
        accepted = submit_as_nobody(daemon.client.socket_path, **ask)
        assert "id" in accepted, accepted
        # the new device is given out: a job asking for all three starts once the first ends
        wide = sleeper(daemon, min_gpus=3)
        time.sleep(2.5)  # passes run every second
        assert running_pids(daemon, job) == pids  # the same processes: never stopped
        daemon.client.request("cancel", ids=[job])
        wait_for(lambda: running_pids(daemon, wide), 30, f"job {wide} on three devices")
        assert daemon.client.request("show", id=wide)["job"]["devices"] == {
            NODE: ["cpu:0", "cpu:1", "cpu:2"]
        }
    finally:
        daemon.stop()
    assert daemon.proc is not None and daemon.proc.returncode == 0, daemon.output()


def test_a_job_queued_before_a_reload_that_tightens_a_limit_is_held_not_started(
    root: Path, daemon_factory: DaemonFactory
) -> None:
    """A release, an edit and a new submit are checked against the config in use; a job
    already queued must be too: one queued with ``--time 30m`` under ``max_time = 1h`` would
    otherwise start, after a reload to ``max_time = 10m``, with its 30 minutes (a review)."""
    config = root / "config.toml"
    write_config(config, '"cpu:1"', '\n[limits]\nmax_time = "1h"\n')
    daemon = start_daemon(daemon_factory, root, config)
    try:
        first = sleeper(daemon)
        wait_for(lambda: running_pids(daemon, first), 30, f"job {first} running")
        waiting = sleeper(daemon, time_limit_s=1800)
        write_config(config, '"cpu:1"', '\n[limits]\nmax_time = "10m"\n')
        reload(daemon, "reloaded")
        shown = wait_for(
            lambda: (job := daemon.client.request("show", id=waiting)["job"])["state"] == "held"
            and job,
            15, "the queued job to be held",
        )  # fmt: skip
        assert "max_time" in shown["reason"] and "config changed" in shown["reason"], shown
        daemon.client.request("cancel", ids=[first])
        time.sleep(2.5)  # passes run every second: the device is free, the job stays held
        assert daemon.client.request("show", id=waiting)["job"]["state"] == "held"
        edited = daemon.client.request("edit", id=waiting, time_limit_s=300)
        assert edited, edited
        daemon.client.request("release", id=waiting)
        wait_for(lambda: running_pids(daemon, waiting), 30, "the edited job to run")
    finally:
        daemon.stop()


def test_a_device_the_config_drops_stays_with_its_job_until_it_ends(
    root: Path, daemon_factory: DaemonFactory
) -> None:
    config = root / "config.toml"
    write_config(config, '"cpu:2"')
    daemon = start_daemon(daemon_factory, root, config)
    first, second = sleeper(daemon), sleeper(daemon)
    for job in (first, second):
        wait_for(lambda job=job: running_pids(daemon, job), 30, f"job {job} running")
    on_cpu1 = next(
        job
        for job in (first, second)
        if daemon.client.request("show", id=job)["job"]["devices"] == {NODE: ["cpu:1"]}
    )
    pids = running_pids(daemon, on_cpu1)

    write_config(config, '["cpu:0"]')
    (line,) = reload(daemon, "reloaded")
    assert f"kept until their jobs end: {NODE}:cpu:1" in line, line
    waiting = sleeper(daemon)
    time.sleep(2.5)  # passes run every second
    assert running_pids(daemon, on_cpu1) == pids  # still running, the same processes
    assert node_devices(daemon) == ["cpu:0", "cpu:1"]

    daemon.client.request("cancel", ids=[on_cpu1])
    wait_for(lambda: node_devices(daemon) == ["cpu:0"], 15, "cpu:1 dropped once free")
    time.sleep(1.5)
    assert daemon.client.request("show", id=waiting)["job"]["state"] == "queued"
    assert log_lines(daemon, "no job holds them any more")


def test_a_broken_config_on_sighup_keeps_the_one_in_use(
    root: Path, daemon_factory: DaemonFactory
) -> None:
    config = root / "config.toml"
    write_config(config, '"cpu:2"')
    daemon = start_daemon(daemon_factory, root, config)
    try:
        config.write_text("[nodes.ws\ndevices = ")  # not TOML
        (line,) = reload(daemon, "reload:")
        assert "keeping the config in use" in line and str(config) in line, line
        write_config(config, '"cpu:2"', "\n[limits]\nmax_prioritty = 3\n")  # a typo
        lines = reload(daemon, "reload:", count=2)
        assert len(lines) == 2 and "did you mean 'max_priority'" in lines[1], lines
        # each failure is one line: the next line of the log is a line of its own
        text = (daemon.state_dir / "daemon.log").read_text().splitlines()
        stamp = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d")
        assert all(stamp.match(line) for line in text), text
        assert daemon.client.request("ping")
        assert node_devices(daemon) == ["cpu:0", "cpu:1"]

        write_config(config, '"cpu:1"')  # a good one is taken again
        reload(daemon, "reloaded")
        assert node_devices(daemon) == ["cpu:0"]
    finally:
        daemon.stop()
    assert daemon.proc is not None and daemon.proc.returncode == 0, daemon.output()


# --- journald -----------------------------------------------------------------------------------


def test_stderr_lines_carry_syslog_priorities_when_it_is_the_journal(
    root: Path, monkeypatch: Any, daemon_factory: DaemonFactory
) -> None:
    config = root / "config.toml"
    write_config(config, '"cpu:1"')
    stderr_file = root / "state.out"  # where DaemonProcess sends the daemon's stderr
    stderr_file.touch()
    info = stderr_file.stat()
    monkeypatch.setenv("JOURNAL_STREAM", f"{info.st_dev}:{info.st_ino}")  # as systemd sets it
    daemon = start_daemon(daemon_factory, root, config)
    try:
        config.write_text("not toml [")
        reload(daemon, "reload:")
    finally:
        daemon.stop()
    lines = [line for line in stderr_file.read_text().splitlines() if line]
    assert lines and all(re.match(r"<[2-7]>", line) for line in lines), lines
    assert any(line.startswith("<6>serving ") for line in lines), lines
    assert any(line.startswith("<3>reload: ") for line in lines), lines
    assert not any(re.search(r"\d{4}-\d\d-\d\d \d\d:\d\d", line) for line in lines), lines
    # the daemon's own log keeps its timestamps, and stays private
    log = daemon.state_dir / "daemon.log"
    assert re.match(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d", log.read_text())
    assert log.stat().st_mode & 0o777 == 0o600


def test_journal_stream_must_be_stderr_itself(monkeypatch: Any) -> None:
    info = os.fstat(2)
    monkeypatch.setenv("JOURNAL_STREAM", f"{info.st_dev}:{info.st_ino}")
    assert stderr_is_journal()
    monkeypatch.setenv("JOURNAL_STREAM", f"{info.st_dev}:{info.st_ino + 1}")  # redirected
    assert not stderr_is_journal()
    monkeypatch.setenv("JOURNAL_STREAM", "garbage")
    assert not stderr_is_journal()
    try:
        raise ValueError("boom")
    except ValueError:
        record = logging.LogRecord("x", logging.ERROR, "", 0, "failed", None, sys.exc_info())
    text = JournalFormatter("%(message)s").format(record)
    assert text.startswith("<3>failed\n<3>Traceback")  # every line keeps its priority
    assert all(line.startswith("<3>") for line in text.splitlines())
    debug = logging.LogRecord("x", logging.DEBUG, "", 0, "detail", None, None)
    assert JournalFormatter("%(message)s").format(debug) == "<7>detail"


# --- Prometheus ---------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def scrape(
    port: int, path: str = "/metrics"
) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """The samples at ``http://127.0.0.1:PORT/metrics``: (name, sorted labels) -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as reply:
        text = reply.read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_prometheus_endpoint_shows_devices_jobs_and_the_queue(
    root: Path, daemon_factory: DaemonFactory
) -> None:
    pytest.importorskip("prometheus_client")
    port = free_port()
    config = root / "config.toml"
    metrics = f'\n[metrics]\nprometheus = "127.0.0.1:{port}"\n'
    reserved = f'\n[devices]\nreserved = ["{NODE}:cpu:2"]\n'
    write_config(config, '"cpu:3"', metrics + reserved)
    daemon = start_daemon(daemon_factory, root, config)
    running = sleeper(daemon)
    sleeper(daemon, hold=True)
    sleeper(daemon, min_gpus=2)  # queued: one device is free, the other reserved
    wait_for(lambda: running_pids(daemon, running), 30, "a running job")
    samples = wait_for(
        lambda: (s := scrape(port)).get(("pollux_local_scheduling_passes_total", ())) and s,
        15,
        "a scheduling pass",
    )
    node = (("device_type", "cpu"), ("node", NODE))
    assert samples[("pollux_local_devices", node)] == 3
    assert samples[("pollux_local_devices_in_use", node)] == 1
    assert samples[("pollux_local_devices_withheld", node)] == 1
    jobs = {labels[0][1]: v for (name, labels), v in samples.items() if name == "pollux_local_jobs"}
    assert jobs == {"queued": 1, "running": 1, "rescaling": 0, "held": 1, "succeeded": 0,
                    "failed": 0, "cancelled": 0}  # fmt: skip
    assert samples[("pollux_local_queue_length", ())] == 1
    job_labels = (("job", running), ("name", "sleep"), ("user", "root"))
    assert samples[("pollux_local_job_devices", job_labels)] == 1
    with pytest.raises(urllib.error.HTTPError) as missing:
        scrape(port, "/")
    assert missing.value.code == 404
    # bound to the configured address only
    listening = [
        c.laddr
        for c in psutil.Process(daemon.pid).net_connections("inet")
        if c.status == psutil.CONN_LISTEN
    ]
    assert [(a.ip, a.port) for a in listening] == [("127.0.0.1", port)]

    # a reload moves it
    moved = free_port()
    write_config(config, '"cpu:3"', f'\n[metrics]\nprometheus = "127.0.0.1:{moved}"\n')
    reload(daemon, "reloaded")
    moved_samples = scrape(moved)
    assert moved_samples[("pollux_local_devices", node)] == 3
    assert moved_samples[("pollux_local_devices_withheld", node)] == 0  # reserved no more
    with pytest.raises(urllib.error.URLError):
        scrape(port)


def test_without_prometheus_client_the_endpoint_is_one_log_line(
    monkeypatch: Any, caplog: Any
) -> None:
    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # import fails

    def snapshot() -> DaemonSnapshot:
        raise AssertionError("not scraped")

    with caplog.at_level(logging.WARNING, "pollux_local.daemon"):
        endpoint = asyncio.run(PrometheusEndpoint.start("127.0.0.1:0", snapshot))
    assert endpoint is None
    (record,) = caplog.records
    assert "pip install 'pollux-local[prometheus]'" in record.getMessage()


def test_the_guide_lists_every_metric_served() -> None:
    pytest.importorskip("prometheus_client")
    from pollux_local.daemon.metrics import DaemonCollector, NodeDevices, RunningJob

    snapshot = DaemonSnapshot(
        nodes=(NodeDevices(node="ws", device_type="gpu", total=4, in_use=2, withheld=1),),
        jobs_by_state={"running": 1, "queued": 3},
        running=(RunningJob(job="7", name="bert", user="alice", devices=2, goodput=812.5),),
        passes=9,
    )
    families = list(DaemonCollector(lambda: snapshot).collect())
    samples = {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in families
        for sample in family.samples
    }
    job = (("job", "7"), ("name", "bert"), ("user", "alice"))
    assert samples[("pollux_local_job_goodput", job)] == 812.5
    assert samples[("pollux_local_queue_length", ())] == 3
    assert samples[("pollux_local_scheduling_passes_total", ())] == 9
    guide = (REPO_ROOT / "docs" / "guide" / "admin.md").read_text()
    documented = set(re.findall(r"^\| `(pollux_local_[a-z_]+)`", guide, re.MULTILINE))
    assert documented == {name for name, _ in samples}


def test_effective_config_keeps_held_devices_reserved_until_released() -> None:
    from pollux_local.daemon.config import DaemonConfig, NodeConfig
    from pollux_local.daemon.reload import config_changes, effective_config

    old = DaemonConfig(
        nodes=(
            NodeConfig(name="ws", devices=("cuda:0", "cuda:1")),
            NodeConfig(name="box", devices=("cuda:0",), host="box"),
        )
    )
    renamed = DaemonConfig(nodes=(NodeConfig(name="ws2", devices=("cuda:0", "cuda:1")),))
    held = {"ws": {"cuda:1"}, "box": {"cuda:0"}}
    config, kept = effective_config(renamed, held, old)
    assert kept == {"ws": ["cuda:1"], "box": ["cuda:0"]}
    assert [(n.name, n.devices) for n in config.nodes] == [
        ("ws2", ("cuda:0", "cuda:1")), ("ws", ("cuda:1",)), ("box", ("cuda:0",)),
    ]  # fmt: skip
    assert config.node("box").host == "box"  # the node as it was
    # withheld from new jobs: the kept devices, and the same GPU under the local node's new name
    assert set(config.reserved) == {"ws:cuda:1", "box:cuda:0", "ws2:cuda:1"}
    assert "node box removed" in config_changes(old, renamed)
    # once released, the config is the file's
    assert effective_config(renamed, {}, config) == (renamed, {})
    assert effective_config(renamed, {"ws2": {"cuda:0"}}, config)[0] is renamed
    # a device moved to another local node while a job holds it under the first: reserved
    # under both (it is one device; a new job was placed on it under the other name)
    split = DaemonConfig(
        nodes=(NodeConfig(name="ws", devices=("cuda:0",)), NodeConfig("b", ("cuda:1",)))
    )
    moved, kept = effective_config(split, {"ws": {"cuda:1"}}, old)
    assert kept == {"ws": ["cuda:1"]}
    assert set(moved.reserved) == {"ws:cuda:1", "b:cuda:1"}


def test_a_reload_names_every_setting_of_the_config() -> None:
    # a key added to DaemonConfig and forgotten here would change silently on SIGHUP
    from dataclasses import fields

    from pollux_local.daemon.config import DaemonConfig
    from pollux_local.daemon.reload import NOT_SETTINGS, SETTINGS

    names = {f.name for f in fields(DaemonConfig)} - set(NOT_SETTINGS)
    assert names == set(SETTINGS), names.symmetric_difference(SETTINGS)


def test_a_full_disk_under_the_daemon_log_is_one_line_on_stderr(
    capsys: pytest.CaptureFixture[str],
) -> None:
    import errno

    from pollux_local.daemon.statedir import LogFileHandler

    class FullDisk(io.StringIO):
        full = True

        def write(self, text: str) -> int:
            if self.full:
                raise OSError(errno.ENOSPC, "No space left on device")
            return super().write(text)

    stream = FullDisk()
    handler = LogFileHandler(stream)
    record = logging.LogRecord("pollux_local", logging.INFO, __file__, 1, "a pass", None, None)
    for _ in range(5):
        handler.emit(record)
    err = capsys.readouterr().err
    assert err == "daemon.log: cannot write (No space left on device); lines go to stderr only\n"
    stream.full = False  # room again: lines are written, and a new failure is said again
    handler.emit(record)
    assert stream.getvalue() == "a pass\n"
    stream.full = True
    handler.emit(record)
    assert capsys.readouterr().err.count("cannot write") == 1


def test_sigusr2_writes_the_daemons_stacks_to_its_log_and_it_goes_on(
    daemon_factory: DaemonFactory,
) -> None:
    daemon = daemon_factory(devices="cpu:1")
    os.kill(daemon.pid, signal.SIGUSR2)
    # (the dump is written frame by frame: wait for the daemon's own frames, not its start)
    dumped = wait_for(
        lambda: "Current thread" in (out := daemon.output()) and "server.py" in out and out,
        10,
        "the stacks, the daemon's server among them",
    )
    assert 'File "' in dumped
    assert daemon.client.request("ping")  # still serving
    daemon.stop()
    assert "INFO stopping" in daemon.output() and "INFO stopped" in daemon.output()
