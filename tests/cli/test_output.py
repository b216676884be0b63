"""Output that reads, from the real CLI against real daemons: ``status`` notes whole (on the
row, or wrapped under it to ``$COLUMNS``), ``show`` the batch bounds the trainer declared, and
a daemon refusing CUDA devices NVML does not see unless ``--force``."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest

from pollux_local import api
from pollux_local.api.states import JobState
from pollux_local.cli import main, query
from pollux_local.errors import PolluxError
from tests.daemon_process import REPO_ROOT, DaemonFactory, DaemonProcess, wait_for
from tests.fake_nvml import A100_40GB, BOX_VARIABLE, SHIM_DIR, FakeBox

FIFO = '[scheduler]\npolicy = "fifo"\ninterval_s = 0.3\n'


def pollux(*args: str, columns: int | None, env: dict[str, str] | None = None) -> str:
    """The real CLI's output (piped, as a test reads it), with ``$COLUMNS`` or without."""
    environ = {**os.environ, "PYTHONPATH": str(REPO_ROOT), **(env or {})}
    environ.pop("COLUMNS", None)
    if columns is not None:
        environ["COLUMNS"] = str(columns)
    done = subprocess.run(
        [sys.executable, "-m", "pollux_local", *args],
        capture_output=True, text=True, timeout=60, env=environ,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout


def waiting_script(tmp_path: Path) -> Path:
    script = tmp_path / "hold.sh"
    script.write_text("#!/bin/sh\nwhile [ ! -e go ]; do sleep 0.1; done\n")
    script.chmod(0o755)
    return script


def test_status_shows_a_long_waiting_reason_whole(
    daemon_factory: DaemonFactory, tmp_path: Path
) -> None:
    daemon = daemon_factory(devices="cpu:1", config=FIFO)
    script = waiting_script(tmp_path)
    holder = daemon.client.call(api.Submit(argv=[str(script)], workdir=str(tmp_path))).id
    waiter = daemon.client.call(api.Submit(argv=[str(script)], workdir=str(tmp_path))).id

    def long_reason() -> str | None:
        reason = daemon.client.call(api.Show(id=waiter)).job.reason
        return reason if f"job {holder}" in reason and len(reason) > 80 else None

    reason = wait_for(long_reason, 30, "the waiting job's reason")
    sd = ("--state-dir", str(daemon.state_dir))

    def row_of(lines: list[str], job_id: str) -> int:
        return next(i for i, line in enumerate(lines) if line.split()[:1] == [job_id])

    # wide: on the job's row, whole
    wide = pollux("status", *sd, columns=250).splitlines()
    assert wide[row_of(wide, waiter)].endswith(f"  {reason}")
    # piped without $COLUMNS: no width, on the row too
    assert reason in pollux("status", *sd, columns=None)
    # narrow: under the row, indented, every line within 60 columns, nothing cut
    narrow = pollux("status", *sd, columns=60).splitlines()
    row = row_of(narrow, waiter)
    assert "waiting" not in narrow[row]
    under = []
    for line in narrow[row + 1 :]:
        if not line.startswith("    "):
            break
        under.append(line)
    assert len(under) >= 2 and all(len(line) <= 60 for line in under)
    assert " ".join(line.strip() for line in under) == " ".join(reason.split())
    assert "…" not in "\n".join(narrow)
    (tmp_path / "go").touch()


TRAINER = textwrap.dedent(
    """
    import pathlib, time
    import torch
    from pollux_local.torch import ElasticTrainer

    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    trainer = ElasticTrainer(model, optimizer, base_batch=32, max_batch=256,
                             report_interval_s=0.2)
    data = torch.utils.data.TensorDataset(torch.randn(512, 4), torch.randn(512))
    loader = trainer.loader(data, seed=0)
    for epoch in trainer.epochs(1000):
        for xb, yb in loader:
            trainer.step(((trainer.model(xb).squeeze(1) - yb) ** 2).mean())
            time.sleep(0.01)
        if pathlib.Path("stop").exists():
            break
    trainer.close()
    """
)


def test_show_gives_the_bounds_the_trainer_declared(
    daemon_factory: DaemonFactory, tmp_path: Path
) -> None:
    daemon = daemon_factory(devices="cpu:1", config=FIFO)
    (tmp_path / "train.py").write_text(TRAINER)
    job_id = daemon.client.call(
        api.Submit(
            argv=[sys.executable, "train.py"], workdir=str(tmp_path), elastic=True,
            env={"PYTHONPATH": str(REPO_ROOT), "OMP_NUM_THREADS": "1"},
        )
    ).id  # fmt: skip

    def reported() -> api.JobDetail | None:
        job = daemon.client.call(api.Show(id=job_id)).job
        if job.state.value in ("failed", "cancelled"):
            raise AssertionError(job.reason)
        return job if job.report is not None and job.report.bounds is not None else None

    job = wait_for(reported, 90, "the trainer's first report")
    assert job.batch_bounds.batch_size == 32 and job.batch_bounds.max_batch_size == 256
    shown = pollux("show", job_id, "--state-dir", str(daemon.state_dir), columns=None)
    (line,) = [line for line in shown.splitlines() if line.strip().startswith("batch ")]
    assert "(base 32, max 256, local 1.." in line, line
    (tmp_path / "stop").touch()


def fake_box(tmp_path: Path) -> dict[str, str | None]:
    """A daemon's environment on a box NVML describes as one A100 (``cuda:0``)."""
    box = FakeBox.of(A100_40GB).write(tmp_path / "box.json")
    return {"PYTHONPATH": f"{SHIM_DIR}{os.pathsep}{REPO_ROOT}", BOX_VARIABLE: str(box)}


def test_a_daemon_refuses_cuda_devices_nvml_does_not_see_unless_forced(
    daemon_factory: DaemonFactory, tmp_path: Path
) -> None:
    env = fake_box(tmp_path)
    refused = daemon_factory(devices="cuda:0,1", env=env, start=False)
    with pytest.raises(RuntimeError, match=r"--devices: cuda:1 not seen by NVML") as info:
        refused.start()
    assert "daemon --force schedules them anyway" in str(info.value)
    # the same in a config's node of this machine
    config = '[nodes.box]\ndevices = "cuda:0,1"\n\n[nodes.far]\nhost = "far.example"\n'
    config += 'devices = "cuda:0,1,2"\n'  # a remote node's devices are not checked from here
    from_file = daemon_factory(config=config, env=env, start=False)
    with pytest.raises(RuntimeError, match=r"nodes: cuda:1 not seen by NVML"):
        from_file.start()
    # forced: it starts, schedules both, and says so in its log and on stderr
    forced: DaemonProcess = daemon_factory("--force", devices="cuda:0,1", env=env)
    warning = "--devices: cuda:1 not seen by NVML on this machine (1 GPU(s) seen"
    assert warning in forced.output()  # stderr
    assert warning in (forced.state_dir / "daemon.log").read_text()
    nodes = forced.client.call(api.Nodes()).nodes  # the A100, and the GPU NVML cannot type
    assert sorted(d for node in nodes for d in node.devices) == ["cuda:0", "cuda:1"]
    # the GPUs NVML sees need nothing
    seen = daemon_factory(devices="cuda:0", env=env)
    assert "not seen by NVML" not in seen.output()


def test_the_config_check_in_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from pollux_local.daemon import config

    monkeypatch.setattr(config, "discover_gpus", lambda: [])  # no driver
    with pytest.raises(PolluxError, match="^--devices: cuda:0, cuda:1 not seen by NVML") as info:
        config.load_config(None, "cuda:0,1")
    assert "\n" not in str(info.value)
    forced = config.load_config(None, "cuda:0,1", force=True)
    assert forced.nodes[0].devices == ("cuda:0", "cuda:1")
    assert forced.warnings and "scheduling them anyway (--force)" in forced.warnings[0]
    assert config.load_config(None, "cpu:2").warnings == ()


def test_logs_of_a_job_that_has_not_started_says_why_on_stderr(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``logs 7`` of a queued job printed nothing at all (and ``logs -f`` waited without a
    word); it now says, once and on stderr, that the job has not started and why."""
    state = JobState.QUEUED

    class Daemon:
        def call(self, request: object) -> object:
            if isinstance(request, api.Show):
                reason = "waiting: needs 2 devices, 0 free; job 6 (ann) holds 2"
                return SimpleNamespace(job=SimpleNamespace(
                    state=state, reason=reason, start_time=None))  # fmt: skip
            return SimpleNamespace(data="", offset=0, size=0, state=state)

    monkeypatch.setattr(query, "client_for", lambda args: Daemon())
    assert main(["logs", "--state-dir", str(tmp_path), "7"]) == 0
    out, err = capsys.readouterr()
    assert out == ""
    assert (
        err
        == "job 7 has not started: queued: waiting: needs 2 devices, 0 free; job 6 (ann) holds 2\n"
    )
    state = JobState.SUCCEEDED  # an ended job's empty log: nothing to add
    assert main(["logs", "--state-dir", str(tmp_path), "7"]) == 0
    assert capsys.readouterr() == ("", "")
