"""The SSH launcher's node-side supervisor, run the way ``launch/ssh.py`` ships it to a node
(``python -u -c <source>``, the spec on stdin) but locally, without ssh or root."""

from __future__ import annotations

import ast
import base64
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from pollux_local.launch import node_agent
from pollux_local.launch.ssh import SETUP_FAILED_EXIT_CODE, node_agent_source

pytestmark = pytest.mark.timeout(60)


def test_the_shipped_source_is_the_module_and_needs_only_python_3_8_stdlib() -> None:
    source = node_agent_source()
    assert source == Path(node_agent.__file__).read_text(encoding="utf-8")
    tree = ast.parse(source, feature_version=(3, 8))
    imported: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            imported.add((node.module or "").split(".")[0])
    assert imported <= set(sys.stdlib_module_names) | {"__future__"}


def start_agent(spec: dict[str, Any]) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-u", "-c", node_agent_source()],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdin is not None
    proc.stdin.write(json.dumps(spec) + "\n")
    proc.stdin.flush()
    return proc


def next_line(proc: subprocess.Popen[str], kind: str) -> list[str]:
    """The next protocol line of ``kind`` (skipping ``LOG`` lines unless asked for)."""
    assert proc.stdout is not None
    while True:
        line = proc.stdout.readline()
        assert line, f"the agent ended before a {kind} line"
        parts = line.rstrip("\n").split(" ", 2)
        if parts[0] == kind:
            return parts


def lines_until_exits(proc: subprocess.Popen[str], count: int) -> list[list[str]]:
    """Every protocol line up to the ``count``-th ``EXIT`` line (stdin stays open: closing it
    would tell the agent that the daemon is gone)."""
    assert proc.stdout is not None
    lines: list[list[str]] = []
    while sum(parts[0] == "EXIT" for parts in lines) < count:
        line = proc.stdout.readline()
        assert line, f"the agent ended after {lines}"
        lines.append(line.rstrip("\n").split(" ", 2))
    return lines


def spec_for(tmp_path: Path, replicas: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {
        "node": "n1",
        "cwd": str(tmp_path),
        "node_workdir": str(tmp_path),
        "cwd_required": True,
        "user": None,
        "orphan_grace_s": 0.5,
        "replicas": [
            {"rank": rank, "log": str(tmp_path / "logs" / f"rank{rank}.log"), **r}
            for rank, r in enumerate(replicas)
        ],
        **extra,
    }


def test_replicas_start_with_their_environment_and_report_logs_and_exits(
    tmp_path: Path,
) -> None:
    spec = spec_for(
        tmp_path,
        [
            {
                "argv": ["/bin/sh", "-c", 'echo "value=$X"; exit 3'],
                "env": {"X": "a 'quoted' $value"},
                "banner": "--- start\n",
            },
            {"argv": [str(tmp_path / "missing-program")], "env": {}},
        ],
    )
    proc = start_agent(spec)
    lines = lines_until_exits(proc, 2)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0
    lines += [line.split(" ", 2) for line in out.splitlines()]
    assert ["EXIT", "1", "127"] in lines
    assert ["EXIT", "0", "3"] in lines
    assert any(parts[:2] == ["PID", "0"] for parts in lines)
    logged = b"".join(base64.b64decode(p[2]) for p in lines if p[:2] == ["LOG", "0"])
    assert logged == b"--- start\nvalue=a 'quoted' $value\n"
    assert (tmp_path / "logs" / "rank0.log").read_bytes() == logged
    assert "cannot start" in (tmp_path / "logs" / "rank1.log").read_text()


def test_a_missing_working_dir_fails_the_setup(tmp_path: Path) -> None:
    spec = spec_for(tmp_path, [{"argv": ["/bin/true"], "env": {}}])
    spec["cwd"] = str(tmp_path / "absent")
    proc = start_agent(spec)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == SETUP_FAILED_EXIT_CODE
    assert out.startswith("FAIL working directory ") and "node n1" in out


def test_term_signals_the_replicas_and_a_closed_stdin_kills_what_is_left(
    tmp_path: Path,
) -> None:
    spec = spec_for(
        tmp_path,
        [
            {"argv": ["/bin/sleep", "30"], "env": {}},
            {"argv": ["/bin/sh", "-c", "trap '' TERM; echo ready; sleep 30"], "env": {}},
        ],
    )
    proc = start_agent(spec)
    assert proc.stdin is not None
    while base64.b64decode(next_line(proc, "LOG")[2]) != b"ready\n":
        pass  # rank 1 ignores SIGTERM from now on
    proc.stdin.write("TERM\n")
    proc.stdin.flush()
    assert next_line(proc, "EXIT") == ["EXIT", "0", "143"]  # 128 + SIGTERM
    proc.stdin.close()  # the daemon is gone: SIGTERM (ignored here), then SIGKILL
    assert next_line(proc, "EXIT") == ["EXIT", "1", "137"]
    assert proc.wait(timeout=30) == 0


def test_the_exit_record_outlives_the_daemon_and_says_how_each_replica_ended(
    tmp_path: Path,
) -> None:
    record = tmp_path / "run" / "key" / "7.json"
    spec = spec_for(
        tmp_path,
        [
            {"argv": ["/bin/sh", "-c", "exit 0"], "env": {}},
            {"argv": ["/bin/sh", "-c", "trap '' TERM; echo ready; sleep 1; exit 0"], "env": {}},
        ],
        record={"path": str(record), "token": "7:0"},
        orphan_grace_s=10,
    )
    proc = start_agent(spec)
    assert proc.stdin is not None and proc.stdout is not None
    seen: list[list[str]] = []
    while ["EXIT", "0", "0"] not in seen or ["LOG", "1", "ready"] not in seen:
        parts = proc.stdout.readline().rstrip("\n").split(" ", 2)
        assert parts != [""], f"the agent ended after {seen}"
        if parts[0] == "LOG":
            parts[2] = base64.b64decode(parts[2]).decode().strip()
        seen.append(parts)
    running = json.loads(record.read_text())
    assert running["state"] == "running" and running["token"] == "7:0"
    proc.stdin.close()  # the daemon is gone; so is whoever read stdout
    proc.stdout.close()
    assert proc.wait(timeout=30) == 0
    ended = json.loads(record.read_text())
    assert ended["state"] == "ended" and ended["orphaned"] is True
    assert [(r["rank"], r["exit_code"]) for r in ended["replicas"]] == [(0, 0), (1, 0)]
    assert ended["exits"] == [0, 1]
    assert record.stat().st_mode & 0o777 == 0o600
    assert record.parent.stat().st_mode & 0o777 == 0o700
