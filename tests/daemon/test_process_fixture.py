"""The one way the tests start a real daemon (``tests/daemon_process.py``): the factory gives
each daemon its own state, passes devices, interval and config through, restarts one on its
state, and stops every daemon it started."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pollux_local import api
from tests.daemon_process import DaemonFactory, DaemonProcess, daemon_environ
from tests.paths import REPO_ROOT

pytestmark = pytest.mark.timeout(120)


def test_the_environment_puts_this_checkout_first_and_takes_changes_and_removals(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("POLLUX_LOCAL_STATE_DIR", "/somewhere")
    environ = daemon_environ({"POLLUX_LOCAL_STATE_DIR": None, "EXTRA": "1"})
    assert environ["PYTHONPATH"] == str(REPO_ROOT) and environ["OMP_NUM_THREADS"] == "1"
    assert "POLLUX_LOCAL_STATE_DIR" not in environ and environ["EXTRA"] == "1"
    assert daemon_environ({"PYTHONPATH": "/shim"})["PYTHONPATH"] == "/shim"
    assert os.environ["POLLUX_LOCAL_STATE_DIR"] == "/somewhere"  # this process's is untouched


def test_the_factory_starts_daemons_on_their_own_state_and_stops_every_one(
    tmp_path: Path,
) -> None:
    with DaemonFactory(tmp_path) as daemons:
        fifo = daemons(devices="cpu:1", interval=30, config='[scheduler]\npolicy = "fifo"\n')
        wide = daemons(devices="cpu:3", interval=30)
        assert (fifo.state_dir, wide.state_dir) == (tmp_path / "state", tmp_path / "state-2")
        assert (tmp_path / "state.toml").read_text() == '[scheduler]\npolicy = "fifo"\n'
        assert [len(n.devices) for n in fifo.client.call(api.Nodes()).nodes] == [1]
        assert [len(n.devices) for n in wide.client.call(api.Nodes()).nodes] == [3]
        assert fifo.client.request("ping")["policy"] == "fifo"
        held = fifo.client.call(api.Submit(argv=["true"], workdir=str(tmp_path), hold=True)).id
        # a restart on the same state, after a crash, finds the job
        fifo.kill()
        again = daemons(devices="cpu:1", interval=30, state_dir=fifo.state_dir)
        assert [j.id for j in again.client.call(api.Status()).jobs] == [held]
        started: list[DaemonProcess] = list(daemons.started)
        assert all(d.running() for d in (wide, again))
    assert len(started) == 3 and not any(d.running() for d in started)


def test_a_daemon_built_without_starting_starts_when_asked(daemon_factory: DaemonFactory) -> None:
    daemon = daemon_factory(devices="cpu:1", interval=30, start=False)
    assert not daemon.running() and daemon.proc is None
    daemon.start()
    assert daemon.running() and daemon in daemon_factory.started
