"""The one job.toml reader: what submit takes from it and what a train.py takes from it."""

from __future__ import annotations

from pathlib import Path

import pytest

from pollux_local.errors import PolluxError
from pollux_local.jobspec import Target, load_job_spec, load_training_spec

FULL = """
[job]
name = "n"
script = "train.py"
args = ["--epochs", 3]
workdir = "data"
min_gpus = 1
max_gpus = 4
batch_size = 32
max_batch_size = 512
min_local_batch = 8
max_local_batch = 128
priority = 2
env = { OMP_NUM_THREADS = "1" }

[target]
metric = "loss"
value = 1.5
mode = "min"
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "job.toml"
    path.write_text(text)
    return path


def test_full_spec_gives_submit_fields_and_training_view(tmp_path: Path) -> None:
    path = write(tmp_path, FULL)
    spec = load_job_spec(path)
    fields = spec.submit_fields()
    assert fields["script"] == str(tmp_path.resolve() / "train.py")
    assert fields["workdir"] == str(tmp_path.resolve() / "data")
    assert fields["args"] == ["--epochs", "3"] and fields["env"] == {"OMP_NUM_THREADS": "1"}
    assert fields["max_gpus"] == 4 and fields["batch_size"] == 32 and fields["priority"] == 2
    assert fields["target"] == {"metric": "loss", "value": 1.5, "mode": "min"}
    training = load_training_spec(path)
    assert training.trainer_kwargs() == {
        "base_batch": 32, "max_batch": 512, "min_local": 8, "max_local": 128,
    }  # fmt: skip
    assert training.target == Target(
        metric="loss", value=1.5, mode="min"
    ) and training.target.reached(1.4)


def test_minimal_spec_states_only_what_it_says(tmp_path: Path) -> None:
    spec = load_job_spec(write(tmp_path, '[job]\nscript = "t.py"\n'))
    fields = spec.submit_fields()
    assert "name" not in fields and "max_gpus" not in fields and fields["target"] is None
    with pytest.raises(PolluxError, match="batch_size is required"):
        spec.for_training()
    with_batch = load_job_spec(write(tmp_path, "[job]\nbatch_size = 16\n"))
    with pytest.raises(PolluxError, match=r"needs a \[target\] table"):
        with_batch.for_training()


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[jbo]\n", r"has no \[job\] table"),
        ('[job]\nscirpt = "x"\n', r"unknown key 'scirpt' in \[job\] \(did you mean 'script'\?\)"),
        (
            "[job]\nbatchsize = 8\n",
            r"unknown key 'batchsize' in \[job\] \(did you mean 'batch_size'",
        ),
        ('[job]\n[traget]\nmetric = "a"\n', r"unknown table \[traget\] \(did you mean \[target\]"),
        ('[job]\n[target]\nmetric = "a"\nvalue = 1\nmod = "max"\n', r"'mod' in \[target\]"),
        ('[job]\nmin_gpus = "two"\n', "job.min_gpus must be a positive integer"),
        ("[job]\nmin_gpus = true\n", "job.min_gpus must be a positive integer"),
        ('[job]\npriority = "high"\n', "job.priority must be an integer"),
        ("[job]\nmax_gpus = 0\n", "job.max_gpus must be a positive integer"),
        ("[job]\nmin_gpus = 3\nmax_gpus = 2\n", "max_gpus 2 is below min_gpus 3"),
        ("[job]\nbatch_size = 64\nmax_batch_size = 8\n", "max_batch_size 8 is below"),
        ("[job]\nmax_batch_size = 8\n", "max_batch_size needs batch_size"),
        ("[job]\nmin_local_batch = 8\nmax_local_batch = 4\n", "max_local_batch 4 is below"),
        ("[job]\nargs = [[1]]\n", "job.args must be a list of strings"),
        ('[job]\n[target]\nmetric = "a"\nvalue = 1\nmode = "up"\n', "mode must be 'max' or 'min'"),
        ('[job]\n[target]\nmetric = "a"\n', "needs a metric name and a numeric value"),
        ("[job]\ntarget = 1\n", r"unknown key 'target' in \[job\]"),
        ("[job\n", "not valid TOML"),
        ("[job]\ntime = 30\n", "job.time must be a string"),
        ('[job]\ntime = "soon"\n', "job.time: not a duration: 'soon'"),
        ('[job]\ntime = "400d"\n', "must be from 1s to 366 days"),
        ('[job]\nafter = ["x"]\n', "job.after must list job ids, got 'x'"),
        ("[job]\nafter = 3\n", "job.after must be a list"),
        ("[job]\nafter_any = true\n", "job.after_any needs job.after"),
        ("[job]\nafter_one = true\n", "job.after_one needs job.after"),
        ("[job]\nafter = [1]\nafter_any = true\nafter_one = true\n", "cannot both be true"),
        ("[job]\nafter = [1]\nafter_one = 1\n", "job.after_one must be true or false"),
        ('[job]\nnotify = ["lab"]\n', "job.notify must list URLs"),
        ('[job]\nnotify = ["ntfy://x"]\nnotify_on = "never"\n', "notify_on must be 'end' or"),
        ('[job]\nconstraint = { gpu = "a100" }\n', r"unknown key 'gpu' in \[job.constraint\]"),
        ('[job]\nconstraint = "gpu=a100"\n', "job.constraint: unknown key 'gpu'"),
        ("[job]\nconstraint = 3\n", "job.constraint must be a table or a string"),
        ("[job]\nmax_running = 0\n", "job.max_running must be a positive integer"),
        ('[job]\nargs = ["{lr}"]\n[sweep]\n"learning rate" = [1]\n', "must be a name"),
        ('[job]\nargs = ["{lr}"]\n[sweep]\nlr = []\n', "sweep.lr must be a non-empty list"),
        ('[job]\nargs = ["{lr}"]\n[sweep]\nlr = [[1]]\n', "sweep.lr must list strings or"),
        ('[job]\nargs = ["{lr}", "{x}"]\n[sweep]\nlr = [1]\n', r"use \{x\}, which \[sweep\] does"),
        ('[job]\nargs = ["--lr"]\n[sweep]\nlr = [1]\n', r"\[sweep\] lr is not used"),
        ("[job]\n[sweep]\n", r"\[sweep\] must be a table of value lists"),
    ],
)
def test_bad_specs_are_one_line_naming_the_file(tmp_path: Path, text: str, message: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(PolluxError, match=message) as caught:
        load_job_spec(path)
    assert str(path) in str(caught.value) and "\n" not in str(caught.value)


def test_submit_names_a_spec_without_a_script(capsys, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from pollux_local.cli import main

    path = write(tmp_path, "[job]\nbatch_size = 16\n")
    code = main(["submit", "--state-dir", str(tmp_path / "state"), "--spec", str(path)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.count("\n") == 0
    assert f"{path}: job.script is missing" in err


def test_scheduling_keys_and_the_sweep_table(tmp_path: Path) -> None:
    from pollux_local.api.spec import Constraint
    from pollux_local.jobspec import sweep_grid

    path = write(
        tmp_path,
        FULL.replace('priority = 2\n', 'priority = 2\ntime = "1h30m"\nafter = [4, "5", 4]\n'
                     'notify = ["ntfy://runs"]\nnotify_on = "failure"\n'
                     'constraint = { nodes = "box1", type = "a100" }\nmax_running = 3\n')
        .replace('args = ["--epochs", 3]', 'args = ["--epochs", 3, "--lr", "{lr}", "--aug={aug}"]')
        + '\n[sweep]\nlr = [0.1, 1e-3]\naug = [true, false, "mixup"]\n',
    )  # fmt: skip
    spec = load_job_spec(path)
    assert spec.time_limit_s == 5400.0 and spec.after == ("4", "5")
    assert (spec.notify, spec.notify_on, spec.max_running) == (("ntfy://runs",), "failure", 3)
    assert spec.constraint == Constraint(nodes=["box1"], device_type="a100")
    assert spec.sweep == (("lr", ("0.1", "0.001")), ("aug", ("true", "false", "mixup")))
    fields = spec.submit_fields()
    assert fields["sweep"] == {"lr": ["0.1", "0.001"], "aug": ["true", "false", "mixup"]}
    assert (fields["time_limit_s"], fields["after"], fields["after_any"]) == (
        5400.0,
        ["4", "5"],
        False,
    )
    grid = sweep_grid(spec.sweep)
    assert len(grid) == 6 and grid[0] == {"lr": "0.1", "aug": "true"}
    assert grid[3] == {"lr": "0.001", "aug": "true"}  # the first key varies slowest
    # a train.py reading the same file is not bothered by any of it
    assert load_training_spec(path).base_batch == 32


def test_a_typo_reads_the_same_in_a_job_file_and_the_daemon_config(tmp_path: Path) -> None:
    """One check of keys for every TOML file: the same line, naming the closest key."""
    from pollux_local.daemon.config import load_config

    job = write(tmp_path, '[job]\nscript = "t.py"\nmax_gpu = 2\n')
    config = tmp_path / "config.toml"
    config.write_text('[scheduler]\npolcy = "fifo"\n')
    with pytest.raises(PolluxError) as from_job:
        load_job_spec(job)
    with pytest.raises(PolluxError) as from_config:
        load_config(config)
    assert (
        str(from_job.value) == f"{job}: unknown key 'max_gpu' in [job] (did you mean 'max_gpus'?)"
    )
    assert str(from_config.value).endswith(
        "unknown key 'polcy' in [scheduler] (did you mean 'policy'?)"
    )


def test_the_decoded_spec_speaks_the_api_names(tmp_path: Path) -> None:
    """Every batch and device field of a job file is the ``api.Submit`` field of that name."""
    import msgspec

    from pollux_local.api.messages import Submit

    spec = load_job_spec(write(tmp_path, FULL))
    fields = spec.submit_fields()
    request_fields = set(Submit.__struct_fields__)
    assert set(fields) - {"script", "args", "sweep"} <= request_fields
    request = msgspec.convert(
        {k: v for k, v in fields.items() if k in request_fields} | {"argv": ["x"]}, Submit
    )
    assert (request.batch_size, request.max_batch_size) == (spec.batch_size, 512)
    assert (request.min_local_batch, request.max_local_batch) == (8, 128)
    assert request.target == spec.target
