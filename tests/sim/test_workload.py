"""Reading workload traces: good rows come back sorted, bad input names the problem."""

from __future__ import annotations

from pathlib import Path

import pytest

from pollux_local.errors import PolluxError
from pollux_local.sim.workload import read_workload

HEADER = "name,time,application,num_replicas,batch_size\n"


def _write(tmp_path: Path, body: str, header: str = HEADER) -> Path:
    path = tmp_path / "w.csv"
    path.write_text(header + body)
    return path


def test_reads_and_sorts_by_submission_time(tmp_path: Path) -> None:
    jobs = read_workload(_write(tmp_path, "b,50,cifar10,2,256\na,10,bert,1,12\n\n"))
    assert [(j.name, j.time, j.application, j.num_replicas, j.batch_size) for j in jobs] == [
        ("a", 10.0, "bert", 1, 12),
        ("b", 50.0, "cifar10", 2, 256),
    ]


def test_published_workload_has_160_jobs(artifact_dir: Path) -> None:
    jobs = read_workload(artifact_dir / "workloads" / "workload-1.csv")
    assert len(jobs) == 160
    assert all(jobs[i].time <= jobs[i + 1].time for i in range(len(jobs) - 1))


@pytest.mark.parametrize(
    ("body", "header", "message"),
    [
        ("a,0,cifar10,1\n", HEADER, r"w\.csv:2: malformed row: expected 5 fields, got 4"),
        ("a,soon,cifar10,1,128\n", HEADER, r":2: submission time 'soon' is not a number"),
        ("a,-5,cifar10,1,128\n", HEADER, r":2: submission time must be >= 0"),
        ("a,0,cifar10,two,128\n", HEADER, r":2: num_replicas 'two' is not an integer"),
        ("a,0,cifar10,1,0\n", HEADER, r":2: batch_size must be positive"),
        ("a,0,cifar10,1,128\na,5,bert,1,12\n", HEADER, r":3: duplicate job name 'a'"),
        ("a,0,,1,128\n", HEADER, r":2: empty application"),
        (
            "a,0,cifar10,1\n",
            "name,time,application,num_replicas\n",
            r"missing column\(s\) batch_size",
        ),
        ("", HEADER, r"no jobs in workload"),
        ("", "", r"empty workload file"),
    ],
)
def test_bad_input_is_one_clear_error(tmp_path: Path, body: str, header: str, message: str) -> None:
    with pytest.raises(PolluxError, match=message) as info:
        read_workload(_write(tmp_path, body, header))
    assert "\n" not in str(info.value)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(PolluxError, match="cannot read workload"):
        read_workload(tmp_path / "absent.csv")
