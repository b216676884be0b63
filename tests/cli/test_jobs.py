"""The job commands against a live daemon: output shapes and one-line errors for bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from pollux_local.cli import main
from pollux_local.client import resolve_state_dir
from tests.daemon_process import DaemonFactory

pytestmark = pytest.mark.timeout(90)


@pytest.fixture(scope="module")
def state_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    # FIFO with a long interval: jobs here are held or never need to run long
    with DaemonFactory(tmp_path_factory.mktemp("cli")) as daemons:
        config = '[scheduler]\npolicy = "fifo"\ninterval_s = 30\n'
        yield daemons(devices="cpu:2", config=config).state_dir


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "train.py"
    path.write_text("print('hi')\n")
    return path


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def one_line_error(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    code, out, err = run(capsys, *argv)
    assert code != 0, out
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pollux-local: error: "), err
    return lines[0]


def test_submit_status_show_hold_release_cancel(capsys, state_dir: Path, script: Path) -> None:  # type: ignore[no-untyped-def]
    sd = ("--state-dir", str(state_dir))
    script.write_text("import time\ntime.sleep(60)\n")  # released, still running at the cancel
    code, out, _ = run(capsys, "submit", *sd, "--json", "--hold", "--name", "mine",
                       "--batch-size", "64", "--env", "A=1", str(script), "--lr", "3")  # fmt: skip
    assert code == 0
    job_id = json.loads(out)["id"]
    code, out, _ = run(capsys, "status", *sd, "--json")
    job = {j["id"]: j for j in json.loads(out)["jobs"]}[job_id]
    assert (job["name"], job["state"], job["gpus"], job["batch_size"]) == ("mine", "held", 0, 64)
    code, out, _ = run(capsys, "ls", *sd)
    assert code == 0 and "mine" in out and "held" in out and out.startswith("ID")
    code, out, _ = run(capsys, "show", *sd, "--json", job_id)
    shown = json.loads(out)["job"]
    assert shown["argv"][-3:] == [str(script.resolve()), "--lr", "3"]
    assert shown["env"]["A"] == "1" and "POLLUX_LOCAL_STATE_DIR" not in shown["env"]
    assert run(capsys, "priority", *sd, job_id, "5")[0] == 0
    code, out, _ = run(capsys, "show", *sd, job_id)
    assert code == 0 and "priority" in out and "held" in out
    assert run(capsys, "release", *sd, job_id)[0] == 0
    assert "is not held" in one_line_error(capsys, "release", *sd, job_id)
    code, out, _ = run(capsys, "cancel", *sd, job_id)
    assert code == 0 and f"cancelled job {job_id}" in out
    code, out, _ = run(capsys, "cancel", *sd, job_id)
    assert "had already cancelled" in out
    code, out, _ = run(capsys, "nodes", *sd, "--json")
    node = json.loads(out)["nodes"][0]
    assert node["up"] and node["devices"] == ["cpu:0", "cpu:1"]
    code, out, _ = run(capsys, "logs", *sd, job_id)
    assert code == 0


def test_spec_file(capsys, state_dir: Path, tmp_path: Path, script: Path) -> None:  # type: ignore[no-untyped-def]
    script.write_text("from pollux_local.torch import ElasticTrainer\n")  # an elastic job
    spec = tmp_path / "job.toml"
    spec.write_text(
        '[job]\nname = "spec-job"\nscript = "train.py"\nargs = ["--epochs", 2]\n'
        "min_gpus = 1\nmax_gpus = 2\nbatch_size = 32\nmax_batch_size = 256\n"
        '[job.env]\nFOO = "bar"\n[target]\nmetric = "accuracy"\nvalue = 0.9\nmode = "max"\n'
    )
    code, out, _ = run(capsys, "submit", "--state-dir", str(state_dir), "--json", "--hold",
                       "--spec", str(spec))  # fmt: skip
    assert code == 0
    job_id = json.loads(out)["id"]
    code, out, _ = run(capsys, "show", "--state-dir", str(state_dir), "--json", job_id)
    job = json.loads(out)["job"]
    assert job["name"] == "spec-job" and job["argv"][-2:] == ["--epochs", "2"]
    assert job["max_gpus"] == 2 and job["env"]["FOO"] == "bar"
    assert job["target"] == {"metric": "accuracy", "value": 0.9, "mode": "max"}
    run(capsys, "cancel", "--state-dir", str(state_dir), job_id)


def test_bad_input_is_one_clear_line(capsys, state_dir: Path, tmp_path: Path, script: Path) -> None:  # type: ignore[no-untyped-def]
    sd = ("--state-dir", str(state_dir))
    assert "does not exist" in one_line_error(capsys, "submit", *sd, str(tmp_path / "nope.py"))
    bad = tmp_path / "bad.toml"
    bad.write_text("[job\nscript=")
    assert "not valid TOML" in one_line_error(capsys, "submit", *sd, "--spec", str(bad))
    bad.write_text('[job]\nscript = "train.py"\nmin_gpus = "two"\n')
    assert "job.min_gpus must be a positive integer" in one_line_error(
        capsys, "submit", *sd, "--spec", str(bad)
    )
    bad.write_text('[job]\nscirpt = "train.py"\n')
    assert "unknown key 'scirpt' in [job] (did you mean 'script'?)" in one_line_error(
        capsys, "submit", *sd, "--spec", str(bad)
    )
    error = one_line_error(
        capsys, "submit", *sd, "--elastic", "--min-gpus", "3", "--max-gpus", "2", str(script)
    )
    assert "greater than --max-gpus" in error
    error = one_line_error(capsys, "submit", *sd, "--min-gpus", "3", str(script))
    assert "give a rigid job its size with --gpus N" in error
    error = one_line_error(capsys, "submit", *sd, "--gpus", "3", str(script))
    assert "needs at least 3 device(s) but this daemon has 2" in error
    error = one_line_error(
        capsys, "submit", *sd, "--batch-size", "64", "--max-batch-size", "8", str(script)
    )
    assert "below batch_size" in error
    assert "no job with id '999'" in one_line_error(capsys, "show", *sd, "999")
    assert "no job with id 'abc'" in one_line_error(capsys, "cancel", *sd, "abc")
    assert "no job with id '999'" in one_line_error(capsys, "logs", *sd, "999")
    assert "KEY=VALUE" in one_line_error(capsys, "submit", *sd, "--env", "novalue", str(script))
    assert "no daemon is running" in one_line_error(capsys, "status", "--state-dir", str(tmp_path))


def test_state_dir_resolution(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("POLLUX_LOCAL_STATE_DIR", str(tmp_path / "env"))
    assert resolve_state_dir(str(tmp_path / "flag")) == tmp_path / "flag"
    assert resolve_state_dir() == tmp_path / "env"
    monkeypatch.delenv("POLLUX_LOCAL_STATE_DIR")
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "xdg"))
    assert resolve_state_dir() == tmp_path / "xdg" / "pollux-local"


def test_second_daemon_on_same_state_dir_is_refused(state_dir: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "pollux_local", "daemon", "--state-dir", str(state_dir),
         "--devices", "cpu:1"],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert result.returncode == 2
    assert "another daemon is already running" in result.stderr.strip().splitlines()[-1]


def test_status_filters_and_pages(
    capsys: pytest.CaptureFixture[str],
    state_dir: Path,
    script: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sd = ("--state-dir", str(state_dir))
    mine = []
    for i in range(3):
        code, out, _ = run(
            capsys, "submit", *sd, "--json", "--hold", "--name", f"pg{i}", str(script)
        )
        assert code == 0
        mine.append(json.loads(out)["id"])
    assert run(capsys, "cancel", *sd, mine[0])[0] == 0

    def listed(*args: str) -> dict:
        code, out, err = run(capsys, "status", *sd, "--json", *args)
        assert code == 0, err
        return dict(json.loads(out))

    newest = listed("--limit", "1")
    assert [j["id"] for j in newest["jobs"]] == [mine[2]] and newest["more"] >= 2
    code, out, _ = run(capsys, "status", *sd, "--limit", "1")
    assert code == 0 and "older job(s) not shown" in out.splitlines()[-1]
    held = listed("--state", "held")["jobs"]
    assert {j["state"] for j in held} == {"held"} and {mine[1], mine[2]} <= {j["id"] for j in held}
    both = listed("--state", "held,cancelled")["jobs"]
    assert {mine[0], mine[1], mine[2]} <= {j["id"] for j in both}
    assert mine[0] not in {j["id"] for j in listed("--active")["jobs"]}
    assert mine[0] in {j["id"] for j in listed()["jobs"]}  # finished in the last 24 h
    me = listed("--user", "root" if os.geteuid() == 0 else os.environ.get("USER", ""))["jobs"]
    assert {j["id"] for j in me} >= set(mine)
    assert listed("--user", "no-such-user-here")["jobs"] == []
    # --all without --limit fetches every page
    from pollux_local.cli import query

    every = listed("--all", "--limit", "10000")["jobs"]
    monkeypatch.setattr(query, "STATUS_PAGE", 2)
    paged = listed("--all")["jobs"]
    assert [j["id"] for j in paged] == [j["id"] for j in every] and len(every) >= 3
    assert "no state 'sleeping'" in one_line_error(capsys, "status", *sd, "--state", "sleeping")
    assert "expected 1 to 10000" in capsys_error(capsys, "status", *sd, "--limit", "0")


def capsys_error(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """argparse's usage error (exit 2) for bad option values."""
    with pytest.raises(SystemExit) as exited:
        main(list(argv))
    assert exited.value.code == 2
    return capsys.readouterr().err
