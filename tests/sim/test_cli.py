"""``pollux-local simulate``: JSON output, readable summary, one-line errors with exit 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pollux_local.cli import main

pytestmark = pytest.mark.timeout(120)

TRACE = (
    "name,time,application,num_replicas,batch_size\n"
    "bert-0,0,bert,2,24\n"
    "cifar10-1,30,cifar10,4,512\n"
    "bert-2,200,bert,1,12\n"
)


@pytest.fixture
def trace(tmp_path: Path) -> Path:
    path = tmp_path / "trace.csv"
    path.write_text(TRACE)
    return path


@pytest.mark.parametrize("policy", ["fifo", "tiresias", "optimus"])
def test_json_output(
    trace: Path, artifact_dir: Path, policy: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(
        [
            "simulate",
            str(trace),
            "--models",
            str(artifact_dir / "models"),
            "--policy",
            policy,
            "--nodes",
            "2",
            "--json",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    data = json.loads(out)
    assert data["policy"] == policy
    assert data["jobs"] == data["completed"] == 3
    assert data["avg_jct_s"] > 0 and data["p99_jct_s"] >= data["avg_jct_s"]
    assert data["makespan_s"] >= data["p99_jct_s"] * 0.99
    for key in (
        "restarts_per_job",
        "max_finish_time_fairness",
        "decision_ms_median",
        "decision_ms_p95",
        "wall_s",
    ):
        assert isinstance(data[key], float)


def test_readable_summary(
    trace: Path, artifact_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(
        ["simulate", str(trace), "--models", str(artifact_dir / "models"), "--policy", "fifo"]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert "average JCT" in out and "3/3 completed" in out


def test_options_change_the_result(
    trace: Path, artifact_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = [
        "simulate",
        str(trace),
        "--models",
        str(artifact_dir / "models"),
        "--policy",
        "fifo",
        "--json",
    ]
    main(base)
    plain = json.loads(capsys.readouterr().out)
    main([*base, "--restart-cost", "300", "--interval", "120"])
    slower = json.loads(capsys.readouterr().out)
    assert slower["avg_jct_s"] > plain["avg_jct_s"] + 270


@pytest.mark.parametrize(
    ("content", "extra", "message"),
    [
        (TRACE + "bad,1,cifar10\n", [], "malformed row"),
        (TRACE + "x,5,resnet,1,8\n", [], "unknown application(s) resnet"),
        (TRACE, ["--nodes", "0"], "impossible cluster size: 0 nodes"),
        (
            TRACE,
            ["--gpus-per-node", "1", "--nodes", "2"],
            "impossible cluster size: job cifar10-1 needs 4 GPUs",
        ),
        (TRACE, ["--interval", "0"], "scheduling interval must be positive"),
    ],
)
def test_bad_input_exit_2(
    tmp_path: Path,
    artifact_dir: Path,
    capsys: pytest.CaptureFixture[str],
    content: str,
    extra: list[str],
    message: str,
) -> None:
    path = tmp_path / "w.csv"
    path.write_text(content)
    code = main(
        [
            "simulate",
            str(path),
            "--models",
            str(artifact_dir / "models"),
            "--policy",
            "fifo",
            *extra,
        ]
    )
    err = capsys.readouterr().err
    assert code == 2
    assert message in err
    assert len(err.strip().splitlines()) == 1


def test_missing_models_folder(
    trace: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["simulate", str(trace), "--models", str(tmp_path / "none"), "--policy", "fifo"])
    err = capsys.readouterr().err
    assert code == 2
    assert "models folder not found" in err and len(err.strip().splitlines()) == 1


def test_default_models_folder_is_found_from_the_repository(
    trace: Path,
    artifact_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from pollux_local.cli import simulate

    if simulate.default_models_dir() is None:
        pytest.skip("artifact is not at ../shared/data/pollux-artifact relative to the repository")
    monkeypatch.chdir(tmp_path)  # not relative to here: falls back to the repository root
    assert main(["simulate", str(trace), "--policy", "tiresias", "--nodes", "2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["completed"] == 3


def test_progress_bar_draws_on_one_line() -> None:
    import io

    from pollux_local.cli.simulate import _ProgressBar

    stream = io.StringIO()
    bar = _ProgressBar(stream, width=10)
    bar(60.0, 0, 4)
    bar(120.0, 2, 4)
    bar.close()
    text = stream.getvalue()
    assert "\r[----------] 0/4" in text
    assert "\r[#####-----] 2/4" in text
    assert text.endswith("\n") and text.count("\n") == 1
