"""One name per policy: the goodput policy is ``goodput`` everywhere, ``pollux`` an alias."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pollux_local.cli import main
from pollux_local.cli.simulate import POLICIES, canonical_policy, make_policy
from pollux_local.core.policy import GoodputPolicy
from pollux_local.daemon.config import load_config

pytestmark = pytest.mark.timeout(120)


def test_the_goodput_policy_is_called_goodput() -> None:
    assert GoodputPolicy.name == "goodput"
    assert "goodput" in POLICIES and "pollux" not in POLICIES
    assert canonical_policy("pollux") == "goodput"
    assert canonical_policy("fifo") == "fifo"
    assert isinstance(make_policy("pollux"), GoodputPolicy)
    assert isinstance(make_policy("goodput"), GoodputPolicy)


@pytest.mark.parametrize("name", ["goodput", "pollux"])
def test_simulate_accepts_the_alias_and_prints_goodput(
    tmp_path: Path, artifact_dir: Path, name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "trace.csv"
    trace.write_text("name,time,application,num_replicas,batch_size\nbert-0,0,bert,2,24\n")
    models = str(artifact_dir / "models")
    code = main(["simulate", str(trace), "--models", models, "--policy", name, "--nodes", "1"])
    assert code == 0
    assert "policy              goodput" in capsys.readouterr().out
    args = ["simulate", str(trace), "--models", models, "--policy", name, "--nodes", "1", "--json"]
    assert main(args) == 0
    assert json.loads(capsys.readouterr().out)["policy"] == "goodput"


def test_simulate_rejects_an_unknown_policy(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        main(["simulate", str(tmp_path / "t.csv"), "--policy", "gandiva"])


@pytest.mark.parametrize("name", ["goodput", "pollux"])
def test_daemon_config_accepts_the_alias(tmp_path: Path, name: str) -> None:
    path = tmp_path / "c.toml"
    path.write_text(f'[scheduler]\npolicy = "{name}"\n[nodes.box]\ndevices = "cpu:1"\n')
    assert load_config(path).policy == "goodput"


def test_every_list_of_policies_reads_the_one_registry() -> None:
    """The simulator's choices, the typed ones, the daemon's and its factory all come from
    ``core.names.POLICIES``; every entry builds a policy of its own name."""
    from pollux_local.cli import simulate
    from pollux_local.core.names import POLICIES as REGISTRY
    from pollux_local.core.names import PolicySettings, policy_names
    from pollux_local.daemon import config
    from pollux_local.daemon.config import DaemonConfig
    from pollux_local.daemon.server import make_policy as daemon_policy

    assert tuple(REGISTRY) == simulate.POLICIES
    assert simulate.TYPED_POLICIES == ("goodput", "sia", "goodput-unaware")
    assert config.POLICIES == policy_names(daemon=True) == ("goodput", "fifo")
    for name, entry in REGISTRY.items():
        assert entry.factory(PolicySettings()).name == name and entry.description
    for name in config.POLICIES:
        assert daemon_policy(DaemonConfig(nodes=(), policy=name)).name == name
    assert daemon_policy(DaemonConfig(nodes=(), policy="goodput", p=0.5)).p == 0.5  # type: ignore[attr-defined]
