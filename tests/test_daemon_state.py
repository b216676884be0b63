"""SQLite state and TOML config: durability, errors that name the problem."""

from __future__ import annotations

import re
import sqlite3
from pathlib import Path

import pytest

from pollux_local.daemon.config import load_config, parse_devices
from pollux_local.daemon.state import StateStore
from pollux_local.errors import PolluxError


def add(store: StateStore, name: str) -> int:
    job = store.add_job(
        name=name, owner_uid=1, owner_gid=1, owner_name="ann",
        spec={"argv": ["x"], "workdir": "/tmp"}, priority=0, submit_time=1.0, env={"A": "1"},
    )  # fmt: skip
    return job.id


def test_jobs_survive_reopen_and_updates_round_trip(tmp_path: Path) -> None:
    store = StateStore(tmp_path / "s.db")
    ids = [add(store, f"j{i}") for i in range(3)]
    store.update_job(ids[1], state="running", placement={"n": ["cpu:0"]}, report={"progress": 2})
    store.record_decision(ids[1], 2.0, "start", "why", {"n": ["cpu:0"]}, {"replicas": 1})
    store.close()
    again = StateStore(tmp_path / "s.db")
    jobs = again.jobs()
    assert [j.name for j in jobs] == ["j0", "j1", "j2"]
    assert jobs[1].placement == {"n": ["cpu:0"]} and jobs[1].report == {"progress": 2}
    assert jobs[1].env is None  # listings leave the (large) environments out
    loaded = again.get_job(ids[1])
    assert loaded is not None and loaded.env == {"A": "1"}
    assert [j.id for j in again.jobs(["queued"])] == [ids[0], ids[2]]
    decisions = again.decisions(ids[1])
    assert decisions[0]["reason"] == "why" and decisions[0]["batch"] == {"replicas": 1}
    with pytest.raises(KeyError):
        again.update_job(ids[0], owner="mallory")


def test_database_is_in_wal_mode(tmp_path: Path) -> None:
    StateStore(tmp_path / "s.db").close()
    mode = sqlite3.connect(tmp_path / "s.db").execute("PRAGMA journal_mode").fetchone()[0]
    assert mode == "wal"


def test_parse_devices() -> None:
    assert parse_devices("cpu:2") == ("cpu:0", "cpu:1")
    assert parse_devices("cuda:0,3") == ("cuda:0", "cuda:3")
    assert parse_devices(["cuda:1"]) == ("cuda:1",)
    for bad in ("cpu:0", "cpu:x", "gpu:1", "cuda:0,0", "4"):
        with pytest.raises(PolluxError):
            parse_devices(bad)


def test_embedded_default_has_devices() -> None:
    config = load_config(None, "cpu:3")
    assert config.total_devices == 3 and config.nodes[0].is_local
    assert load_config(None).total_devices >= 1  # GPUs via NVML, else cpu:2


def test_config_file(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text(
        '[scheduler]\npolicy = "fifo"\ninterval_s = 2\n[daemon]\nmax_retries = 1\n'
        '[nodes.box]\ndevices = "cpu:2"\n'
        '[nodes.far]\nhost = "far.example"\ndevices = 4\ndevice_type = "cuda"\n'
    )
    config = load_config(path)
    assert config.policy == "fifo" and config.interval_s == 2 and config.max_retries == 1
    assert [n.name for n in config.nodes] == ["box", "far"]
    assert config.nodes[1].devices == ("cuda:0", "cuda:1", "cuda:2", "cuda:3")
    assert not config.nodes[1].is_local and config.nodes[0].is_local


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("[scheduler\n", "not valid TOML"),
        ('[scheduler]\npolicy = "best"\n', "policy must be one of"),
        ("[scheduler]\ninterval_s = -1\n", "interval_s must be at least"),
        ('[[nodes]]\nhost = "far"\n', "remote node needs 'devices'"),
        ("[bogus]\n", "unknown section"),
    ],
)
def test_bad_config_is_one_clear_line(tmp_path: Path, text: str, fragment: str) -> None:
    path = tmp_path / "c.toml"
    path.write_text(text)
    with pytest.raises(PolluxError, match=fragment) as info:
        load_config(path)
    assert "\n" not in str(info.value)


def test_missing_config(tmp_path: Path) -> None:
    with pytest.raises(PolluxError, match="does not exist"):
        load_config(tmp_path / "nope.toml")


def test_remote_nodes_reach_the_ssh_launcher(tmp_path: Path) -> None:
    from pollux_local.daemon.executor import make_ssh_launcher

    path = tmp_path / "c.toml"
    path.write_text(
        '[daemon]\ncheckpoint_root = "/shared/ckpt"\n'
        '[nodes.here]\ndevices = "cpu:1"\n'
        '[nodes.far]\nhost = "me@far"\ndevices = "cpu:2"\ngloo_ifname = "eth0"\n'
        'ssh_options = ["-p", "2222"]\n'
    )
    config = load_config(path)
    assert config.checkpoint_root == "/shared/ckpt"
    launcher = make_ssh_launcher(config, tmp_path)
    far = launcher.nodes["far"]  # type: ignore[attr-defined]
    assert (far.host, far.devices, far.gloo_ifname) == ("me@far", ("cpu:0", "cpu:1"), "eth0")
    assert far.ssh_options == ("-p", "2222") and "here" not in launcher.nodes  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("[scheduler]\ninterval = 5\n", "unknown key 'interval' in [scheduler] (did you mean 'interval_s'?)"),
        ("[daemon]\nmax_retry = 5\n", "unknown key 'max_retry' in [daemon] (did you mean 'max_retries'?)"),
        ("[limits]\nzzz = 1\n", "unknown key 'zzz' in [limits] (known: "),
    ],
)  # fmt: skip
def test_unknown_config_keys_are_refused_with_a_suggestion(
    tmp_path: Path, text: str, expected: str
) -> None:
    path = tmp_path / "config.toml"
    path.write_text(text)
    with pytest.raises(PolluxError, match=re.escape(expected)):
        load_config(path)
