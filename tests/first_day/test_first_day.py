"""A researcher's first day, end to end on CPU devices: their own torchrun-style DDP script, in
their own venv (which does not contain pollux-local), submitted as they would submit it.

* ``submit --gpus 2 ddp_snapshot.py`` trains on two ranks under the venv's Python, with
  torchrun's environment (``is_torchelastic_launched()``), and leaves its snapshot in the
  submit directory; ``wait`` returns its outcome.
* the same script submitted with no size runs as exactly one replica, and is never restarted
  while elastic jobs arrive and leave beside it.
* ``examples/ddp_before.py`` submitted as it is runs as one distributed job.
"""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
from pathlib import Path

import pytest

from tests.daemon_process import DaemonFactory, DaemonProcess, quick_config
from tests.paths import REPO_ROOT, STEADY_JOB

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

SCRIPT = Path(__file__).with_name("ddp_snapshot.py")
ELASTIC = STEADY_JOB


@pytest.fixture(scope="module")
def researcher_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A venv of the researcher's own: torch (and scikit-learn) importable, pollux-local not.
    Made without pip from the base interpreter; the test environment's packages are reached
    through a ``.pth`` line (its site-packages as a plain path: the editable install of
    pollux-local there is a ``.pth`` hook of its own, which such a path does not run)."""
    root = tmp_path_factory.mktemp("researcher") / "venv"
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", "--without-pip", str(root)], check=True, timeout=120)
    python = root / "bin" / "python"
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    ours = [p for p in site.getsitepackages() if Path(p, "torch").is_dir()]
    assert ours, "torch is not installed in the test environment"
    Path(purelib, "lab_packages.pth").write_text(ours[0] + "\n")
    check = subprocess.run(
        [str(python), "-c", "import torch, sklearn\ntry:\n import pollux_local\nexcept "
         "ImportError:\n print('without pollux-local')"],
        capture_output=True, text=True, cwd=root, env={"PATH": "/usr/bin:/bin"}, timeout=120,
    )  # fmt: skip
    assert check.stdout.strip() == "without pollux-local", check.stderr
    return root


@pytest.fixture
def daemon(daemon_factory: DaemonFactory) -> DaemonProcess:
    return daemon_factory(devices="cpu:3", config=quick_config(restart_cost_s=2), interval=1)


def cli(
    venv: Path, daemon: DaemonProcess, cwd: Path, *args: str, check: bool = True
) -> subprocess.CompletedProcess[str]:
    """``pollux-local ARGS`` typed in a shell where the researcher's venv is active."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(
        VIRTUAL_ENV=str(venv),
        PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', os.defpath)}",
        POLLUX_LOCAL_STATE_DIR=str(daemon.state_dir),
        OMP_NUM_THREADS="1",
    )
    result = subprocess.run(
        [sys.executable, "-m", "pollux_local", *args],
        capture_output=True, text=True, cwd=cwd, env=env, timeout=240,
    )  # fmt: skip
    if check:
        assert result.returncode == 0, result.stdout + result.stderr
    return result


def log(daemon: DaemonProcess, job_id: str, rank: int = 0) -> str:
    reply = daemon.client.request("logs", id=job_id, rank=rank, max_bytes=1 << 20)
    return str(reply["data"])


def test_a_ddp_script_runs_on_two_ranks_in_the_researchers_venv(
    researcher_venv: Path, daemon: DaemonProcess, tmp_path: Path
) -> None:
    work = tmp_path / "project"
    work.mkdir()
    shutil.copy(SCRIPT, work / "train.py")
    # --retries: a rigid job is run once unless asked, and torch's teardown can abort (below)
    submitted = cli(researcher_venv, daemon, work, "submit", "--json", "--gpus", "2",
                    "--retries", "2", "train.py", "--epochs", "3")  # fmt: skip
    job_id = json.loads(submitted.stdout)["id"]
    shown = daemon.client.request("show", id=job_id)["job"]
    assert shown["argv"][0] == str(researcher_venv / "bin" / "python")
    assert (shown["elastic"], shown["min_gpus"], shown["max_gpus"]) == (False, 2, 2)
    waited = cli(researcher_venv, daemon, work, "wait", job_id, check=False)
    assert waited.returncode == 0, waited.stdout + log(daemon, job_id)
    assert "start rank 0 of 2 torchelastic=True" in log(daemon, job_id, 0)
    assert "start rank 1 of 2 torchelastic=True" in log(daemon, job_id, 1)
    assert (work / "snapshot.pt").is_file()
    # one start on two ranks; torch's teardown can abort a gloo script at exit (code -6): a
    # start after such a crash resumes from the snapshot, still on two ranks, never resized
    kinds = [d["kind"] for d in daemon.client.request("show", id=job_id)["decisions"]]
    starts = (work / "starts.txt").read_text().splitlines()
    assert set(starts) == {"world 2"} and "resize" not in kinds, kinds
    assert len(starts) == 1 + kinds.count("crashed"), kinds


def test_a_script_without_a_size_runs_once_as_one_replica(
    researcher_venv: Path, daemon: DaemonProcess, tmp_path: Path
) -> None:
    work = tmp_path / "plain"
    work.mkdir()
    shutil.copy(SCRIPT, work / "train.py")
    plain = json.loads(
        cli(researcher_venv, daemon, work, "submit", "--json", "train.py", "--epochs", "12",
            "--pause", "1").stdout
    )["id"]  # fmt: skip
    # elastic jobs arrive and leave beside it (run by the test's own environment)
    others = []
    for steps in ("--max-epochs", "--max-epochs"):
        reply = daemon.client.request(
            "submit", argv=[sys.executable, "-u", str(ELASTIC / "train.py"), steps, "30",
                            "--pause", "0.002"],
            workdir=str(ELASTIC), elastic=True, max_gpus=3, name="elastic-neighbour",
        )  # fmt: skip
        others.append(str(reply["id"]))
    waited = cli(researcher_venv, daemon, work, "wait", plain, *others, check=False)
    assert waited.returncode == 0, waited.stdout + log(daemon, plain)
    assert (work / "starts.txt").read_text() == "world 1\n"  # one start, one replica
    shown = daemon.client.request("show", id=plain)
    assert shown["job"]["restarts"] == 0 and shown["job"]["gpus"] in (0, 1)
    starts = [d for d in shown["decisions"] if d["kind"] in ("start", "resize")]
    assert [d["kind"] for d in starts] == ["start"]


def test_the_ddp_example_runs_as_one_distributed_job(
    researcher_venv: Path, daemon: DaemonProcess, tmp_path: Path
) -> None:
    work = tmp_path / "example"
    work.mkdir()
    shutil.copy(REPO_ROOT / "examples" / "ddp_before.py", work / "ddp_before.py")
    job_id = json.loads(
        cli(researcher_venv, daemon, work, "submit", "--json", "--gpus", "2", "--retries", "2",
            "ddp_before.py").stdout
    )["id"]  # fmt: skip
    waited = cli(researcher_venv, daemon, work, "wait", job_id, check=False)
    assert waited.returncode == 0, waited.stdout + log(daemon, job_id)
    decisions = [d["kind"] for d in daemon.client.request("show", id=job_id)["decisions"]]
    assert "resize" not in decisions, decisions  # a rigid job is never resized
    for rank in (0, 1):
        text = log(daemon, job_id, rank)
        # each start (a `--- ` banner) trains its 5 epochs as one rank of a 2-rank job; torch's
        # teardown can abort a gloo script at exit (code -6), and the start after it repeats them
        starts = [line for line in text.splitlines() if line.startswith("--- ")]
        epochs = [line for line in text.splitlines() if line.startswith("epoch")]
        assert starts and len(epochs) == 5 * len(starts), text
