"""Only pollux_local.tui imports textual: the daemon, CLI, core, ... never do."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

PROBE = r"""
import importlib, json, pkgutil, sys
import pollux_local
skipped = ("pollux_local.tui", "pollux_local.torch", "pollux_local.__main__")
imported, failed = [], {}
for info in pkgutil.walk_packages(pollux_local.__path__, "pollux_local."):
    if info.name.startswith(skipped):
        continue
    try:
        importlib.import_module(info.name)
        imported.append(info.name)
    except ImportError as exc:  # a module whose optional dependency is missing here
        failed[info.name] = str(exc)
from pollux_local.cli import build_parser
build_parser()  # registers every sub-command, including `tui`
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("textual", "plotext"))
print("RESULT:" + json.dumps({"imported": imported, "failed": failed, "heavy": heavy}))
"""


@pytest.mark.timeout(120)
def test_headless_modules_never_import_textual() -> None:
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    out = subprocess.run(
        [sys.executable, "-c", PROBE],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert out.returncode == 0, out.stderr
    line = next(x for x in out.stdout.splitlines() if x.startswith("RESULT:"))
    result = json.loads(line[len("RESULT:") :])
    imported = set(result["imported"])
    assert {"pollux_local.client", "pollux_local.cli", "pollux_local.core.types"} <= imported
    assert any(name.startswith("pollux_local.daemon.") for name in imported)
    assert result["heavy"] == [], (
        f"textual/plotext imported by a headless module: {result['heavy']}"
    )


def test_cli_tui_refuses_without_a_terminal(capsys: pytest.CaptureFixture[str]) -> None:
    from pollux_local.cli import main

    assert main(["tui", "--refresh", "0"]) == 2
    assert "--refresh must be positive" in capsys.readouterr().err
    assert main(["tui"]) == 2  # pytest's stdout is not a tty
    assert "needs a terminal" in capsys.readouterr().err
