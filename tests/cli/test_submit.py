"""What ``pollux-local submit`` asks the daemon for: the submitter's own Python, the command
forms users know from sbatch and pueue, rigid versus elastic jobs (no daemon needed)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from pollux_local.api.errors import PolluxError
from pollux_local.cli import build_parser
from pollux_local.cli.submit import build_submit_request
from pollux_local.submission import submitter_python
from tests.api.test_torchrun import LAUNCHERS


def request(*argv: str):  # type: ignore[no-untyped-def]
    return build_submit_request(build_parser().parse_args(["submit", *argv]))


@pytest.fixture
def venv(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fake activated venv whose ``python`` is a symlink to this interpreter."""
    root = tmp_path / "env"
    (root / "bin").mkdir(parents=True)
    (root / "bin" / "python").symlink_to(sys.executable)
    monkeypatch.setenv("VIRTUAL_ENV", str(root))
    monkeypatch.setenv("PATH", f"{root / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}")
    return root


@pytest.fixture
def plain(tmp_path: Path) -> Path:
    path = tmp_path / "plain.py"
    path.write_text("import torch.distributed as dist\nprint(dist.is_torchelastic_launched())\n")
    return path


@pytest.fixture
def elastic(tmp_path: Path) -> Path:
    path = tmp_path / "elastic.py"
    path.write_text("from pollux_local.torch import ElasticTrainer\n")
    return path


def test_a_script_runs_under_the_active_venv_unresolved(venv: Path, plain: Path) -> None:
    submit = request(str(plain), "--lr", "0.1")
    assert submit.argv == [str(venv / "bin" / "python"), "-u", str(plain), "--lr", "0.1"]
    assert submit.env["VIRTUAL_ENV"] == str(venv)


def test_conda_and_path_are_looked_at_in_order(tmp_path: Path) -> None:
    conda = tmp_path / "conda"
    (conda / "bin").mkdir(parents=True)
    (conda / "bin" / "python").symlink_to(sys.executable)
    assert submitter_python({"CONDA_PREFIX": str(conda), "PATH": "/nowhere"}) == str(
        conda / "bin" / "python"
    )
    found = submitter_python({"PATH": str(conda / "bin")})
    assert found == str(conda / "bin" / "python")  # `python` when there is no python3
    with pytest.raises(PolluxError, match="no python found"):
        submitter_python({"PATH": str(tmp_path / "empty")})


def test_python_option_is_taken_as_given(venv: Path, plain: Path, tmp_path: Path) -> None:
    link = tmp_path / "mypython"
    link.symlink_to(sys.executable)
    assert request("--python", str(link), str(plain)).argv[0] == str(link)
    with pytest.raises(PolluxError, match="not an executable"):
        request("--python", str(tmp_path / "missing"), str(plain))


def test_command_forms(venv: Path, plain: Path) -> None:
    spelled = request("python3", str(plain), "x")
    assert spelled.argv[1:] == [str(plain), "x"] and os.path.basename(spelled.argv[0]) == "python3"
    program = request("sleep", "5")
    assert os.path.basename(program.argv[0]) == "sleep" and program.argv[1:] == ["5"]
    with pytest.raises(PolluxError, match="no program of that name"):
        request("surely-not-a-program-here")


def test_torchrun_as_the_command_is_refused_naming_the_form_that_runs(
    venv: Path, plain: Path
) -> None:
    """``submit torchrun --nproc-per-node 2 train.py`` (as a torchrun user types it) ran
    torchrun inside a one-device job: its two ranks shared that device."""
    for launcher in (["torchrun"], ["python", "-m", "torch.distributed.run"],
                     ["python3", "-m", "torch.distributed.launch"]):  # fmt: skip
        with pytest.raises(PolluxError) as refused:
            request(*launcher, "--nproc-per-node", "2", str(plain), "--lr", "0.1")
        said = str(refused.value)
        assert said.startswith(f"{launcher[0] if len(launcher) == 1 else 'python -m '}"), said
        assert f"pollux-local submit --gpus N {plain} ..." in said, said
    assert request("python", "-m", "http.server").argv[1:] == ["-m", "http.server"]


@pytest.mark.parametrize(("launcher", "named"), LAUNCHERS)
def test_every_spelling_of_torchrun_is_refused_before_anything_is_sent(
    venv: Path, plain: Path, launcher: list[str], named: str
) -> None:
    """The interpreter's own options before ``-m`` (``python -u -m torch.distributed.run``,
    ``python3 -X utf8 -m ...``, ``-mtorch.distributed.run``, a full path) hid the launcher."""
    with pytest.raises(PolluxError) as refused:
        request(*launcher, "--nproc-per-node", "2", str(plain), "--lr", "0.1")
    said = str(refused.value)
    assert said.startswith(f"{named} would start ranks of its own inside the job"), said
    assert f"pollux-local submit --gpus N {plain} ..." in said, said


def test_python_running_code_or_a_script_that_names_the_launcher_is_sent(
    venv: Path, plain: Path
) -> None:
    code = request("python", "-c", "import sys", "-m", "torch.distributed.run")
    assert code.argv[1:] == ["-c", "import sys", "-m", "torch.distributed.run"]
    script = request("python", str(plain), "-m", "torch.distributed.run")
    assert script.argv[1:] == [str(plain), "-m", "torch.distributed.run"]


def test_a_bare_name_of_a_file_here_but_not_on_path_says_so(
    venv: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``submit run.sh`` with ``run.sh`` in the folder (not on PATH) is refused, as a shell
    refuses it, without saying there is no such file (it said so)."""
    (tmp_path / "run.sh").write_text("#!/bin/sh\necho hi\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(PolluxError) as refused:
        request("run.sh")
    assert str(refused.value) == (
        "run.sh: no program of that name on PATH (the file here: ./run.sh)"
    )


def test_options_before_the_script_and_everything_after_goes_to_it(
    venv: Path, elastic: Path
) -> None:
    submit = request("--max-gpus", "8", "--batch-size", "128", str(elastic), "--max-gpus", "3")
    assert submit.max_gpus == 8 and submit.batch_size == 128
    assert submit.argv[-2:] == ["--max-gpus", "3"]


def test_plain_scripts_are_rigid_at_one_device_unless_told(venv: Path, plain: Path) -> None:
    submit = request(str(plain))
    assert (submit.elastic, submit.min_gpus, submit.max_gpus) == (False, 1, 1)
    submit = request("--gpus", "2", "--preemptible", str(plain))
    assert (submit.elastic, submit.min_gpus, submit.max_gpus, submit.preemptible) == (
        False, 2, 2, True,
    )  # fmt: skip
    with pytest.raises(PolluxError, match="--gpus N"):
        request("--max-gpus", "4", str(plain))
    assert request("--elastic", "--max-gpus", "4", str(plain)).elastic


def test_a_job_files_max_gpus_is_not_dropped_from_a_plain_script(venv: Path, plain: Path) -> None:
    """A job.toml's ``max_gpus`` on a rigid script is refused as ``--max-gpus`` is (it was
    dropped: ``max_gpus = 2`` ran a DDP script on one device); its ``min_gpus`` is the size."""
    spec = plain.with_name("job.toml")
    spec.write_text('[job]\nscript = "plain.py"\nmax_gpus = 2\n')
    with pytest.raises(PolluxError, match=r"job.toml: job.max_gpus is for elastic jobs"):
        request("--spec", str(spec))
    assert request("--spec", str(spec), "--gpus", "2").min_gpus == 2  # the command line wins
    assert request("--spec", str(spec), "--elastic").max_gpus == 2
    spec.write_text('[job]\nscript = "plain.py"\nmin_gpus = 2\nmax_gpus = 2\n')
    submit = request("--spec", str(spec))
    assert (submit.elastic, submit.min_gpus, submit.max_gpus) == (False, 2, 2)


def test_job_library_scripts_are_elastic(venv: Path, elastic: Path) -> None:
    submit = request("--max-gpus", "4", str(elastic))
    assert (submit.elastic, submit.min_gpus, submit.max_gpus) == (True, 1, 4)
    assert not request("--rigid", str(elastic)).elastic
    with pytest.raises(PolluxError, match="leave out"):
        request("--gpus", "2", "--min-gpus", "1", str(elastic))
