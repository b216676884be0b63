"""The lab features on the command line: dependencies, arrays and sweeps, time limits,
notifications, constraints, restart and edit, usage, drain and resume.

First what the options become (the request sent, or one clear line refusing them), with no
daemon; then the commands against a real daemon on CPU devices, in states that do not depend on
scheduling (held or cancelled jobs), and one accounting test with jobs that ran.
"""

from __future__ import annotations

import datetime
import json
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from msgspec import UNSET

from pollux_local.api.errors import PolluxError
from pollux_local.api.messages import DeviceUsage, JobSummary, NodeRow, Submit, UsageReply
from pollux_local.api.spec import Constraint
from pollux_local.api.states import JobState
from pollux_local.cli import build_parser, main, parse
from pollux_local.cli.control import edit_request
from pollux_local.cli.format import group_arrays, node_line, status_table
from pollux_local.cli.submit import build_submit_request
from pollux_local.cli.usage import usage_table
from pollux_local.parsing import (
    compress_indices,
    parse_array,
    parse_constraint,
    parse_since,
    parse_time_limit,
)
from tests.daemon_process import DaemonFactory, DaemonProcess, wait_for

SLEEP = shutil.which("sleep") or "/bin/sleep"


def request(*argv: str) -> Submit:
    return build_submit_request(build_parser().parse_args(["submit", *argv]))


def one_line(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """The one error line a refused command prints (exit code not 0)."""
    code = main(list(argv))
    out, err = capsys.readouterr()
    assert code != 0, out
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pollux-local: error: "), err
    return lines[0]


def usage_error(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """argparse's refusal (exit 2) of options that cannot go together."""
    with pytest.raises(SystemExit) as exited:
        main(list(argv))
    assert exited.value.code == 2
    return capsys.readouterr().err


# --- arrays ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "indices", "cap"),
    [
        ("0-9", list(range(10)), None),
        ("0-9:2", [0, 2, 4, 6, 8], None),
        ("1,4,7", [1, 4, 7], None),
        ("0-3,8", [0, 1, 2, 3, 8], None),
        ("8, 0-3", [0, 1, 2, 3, 8], None),
        ("5", [5], None),
        ("0-15%4", list(range(16)), 4),
        ("0-9999", list(range(10_000)), None),
    ],
)
def test_array_specs(spec: str, indices: list[int], cap: int | None) -> None:
    assert parse_array(spec) == (indices, cap)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("", "is not an index or range"),
        ("a-b", "is not an index or range"),
        ("1-", "is not an index or range"),
        ("-3", "is not an index or range"),
        ("5-2", "ends before it starts"),
        ("0-9:0", "step of 0-9:0 must be at least 1"),
        ("1,2,1", "index 1 is given twice"),
        ("0-3,2", "index 2 is given twice"),
        ("0-10000", "more than 10000 tasks"),
        ("0-4999,5000-10000", "more than 10000 tasks"),
        ("2000000", "indices go up to 1000000"),
        ("0-3%0", "%N needs a whole number N of at least 1"),
        ("0-3%x", "%N needs a whole number"),
    ],
)
def test_bad_array_specs_are_one_line(
    capsys: pytest.CaptureFixture[str], spec: str, message: str
) -> None:
    with pytest.raises(PolluxError, match=message):
        parse_array(spec)
    assert message in one_line(capsys, "submit", "--array", spec, SLEEP, "1")


def test_indices_compress_back_to_ranges() -> None:
    assert compress_indices([8, 0, 1, 2, 3]) == "0-3,8"
    assert compress_indices([0, 2, 4]) == "0,2,4"
    assert compress_indices([5]) == "5"
    assert compress_indices(parse_array("0-99,200-299")[0]) == "0-99,200-299"


def test_array_requests() -> None:
    submit = request("--array", "0-5", "--max-running", "2", SLEEP, "1")
    assert [task.index for task in submit.array or []] == [0, 1, 2, 3, 4, 5]
    assert all(task.argv is None and task.name is None for task in submit.array or [])
    assert submit.max_running == 2 and submit.argv[1:] == ["1"]
    assert request("--array", "0-7%3", SLEEP, "1").max_running == 3
    single = request(SLEEP, "1")
    assert single.array is None and single.max_running is None


def test_array_option_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert "--max-running is for arrays" in one_line(
        capsys, "submit", "--max-running", "2", SLEEP, "1"
    )
    assert "already caps the tasks running" in one_line(
        capsys, "submit", "--array", "0-3%2", "--max-running", "2", SLEEP, "1"
    )
    assert "at least 1" in one_line(
        capsys, "submit", "--array", "0-3", "--max-running", "0", SLEEP, "1"
    )


# --- sweeps --------------------------------------------------------------------------------


@pytest.fixture
def script(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A plain script, run by this interpreter (as if its venv were active)."""
    monkeypatch.setenv("VIRTUAL_ENV", sys.prefix)
    path = tmp_path / "train.py"
    path.write_text("print('hi')\n")
    return path


def write_spec(tmp_path: Path, job: str, sweep: str = "") -> Path:
    path = tmp_path / "job.toml"
    path.write_text(
        f'[job]\nscript = "train.py"\n{job}\n' + (f"[sweep]\n{sweep}\n" if sweep else "")
    )
    return path


def test_a_sweep_is_the_grid_of_its_values_in_key_order(tmp_path: Path, script: Path) -> None:
    spec = write_spec(
        tmp_path,
        'name = "grid"\nargs = ["--lr", "{lr}", "--seed", "{seed}", "--tag", "lr{lr}"]\n'
        "max_running = 2",
        'lr = [0.1, 0.01]\nseed = [1, 2, 3]\nextra = ["a"]',
    )
    with pytest.raises(PolluxError, match=r"\[sweep\] extra is not used in the args"):
        request("--spec", str(spec))
    spec = write_spec(
        tmp_path,
        'name = "grid"\nargs = ["--lr", "{lr}", "--seed", "{seed}", "--tag", "lr{lr}"]\n'
        "max_running = 2",
        "lr = [0.1, 0.01]\nseed = [1, 2, 3]",
    )
    submit = request("--spec", str(spec))
    tasks = submit.array or []
    assert [task.index for task in tasks] == list(range(6)) and submit.max_running == 2
    assert [task.argv[-5:] for task in tasks if task.argv] == [
        [lr, "--seed", seed, "--tag", f"lr{lr}"]
        for lr in ("0.1", "0.01")
        for seed in ("1", "2", "3")
    ]
    assert all(task.argv and task.argv[:3] == submit.argv[:3] for task in tasks)
    assert tasks[0].argv and tasks[0].argv[2] == str(script.resolve())
    assert [task.name for task in tasks][:2] == ["grid[lr=0.1,seed=1]", "grid[lr=0.1,seed=2]"]
    # the options win over the file: --max-running, and a command with its own arguments
    assert request("--spec", str(spec), "--max-running", "5").max_running == 5
    own = request("--spec", str(spec), str(script), "--only-lr", "{lr}", "{seed}")
    assert [t.argv[-2:] for t in own.array or [] if t.argv][-1] == ["0.01", "3"]


def test_sweep_mistakes_are_one_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, script: Path
) -> None:
    spec = write_spec(tmp_path, 'args = ["--lr", "{lr}", "--wd", "{wd}"]', "lr = [0.1, 0.2]")
    error = one_line(capsys, "submit", "--spec", str(spec))
    assert "the args use {wd}, which [sweep] does not define (sweep keys: lr)" in error
    spec = write_spec(tmp_path, 'args = ["{lr}"]', "lr = 0.1")
    assert "sweep.lr must be a non-empty list" in one_line(capsys, "submit", "--spec", str(spec))
    spec = write_spec(tmp_path, 'args = ["{lr}"]', "lr = [0.1, 0.1]")
    assert "sweep.lr lists a value twice" in one_line(capsys, "submit", "--spec", str(spec))
    spec = write_spec(tmp_path, 'args = ["{lr}"]\narray = "0-3"', "lr = [0.1]")
    assert "job.array and [sweep] both" in one_line(capsys, "submit", "--spec", str(spec))
    spec = write_spec(
        tmp_path, 'args = ["{a}{b}{c}"]', "a = %s\nb = %s\nc = %s" % ((list(range(30)),) * 3)
    )
    assert "more than 10000 tasks" in one_line(capsys, "submit", "--spec", str(spec))
    spec = write_spec(tmp_path, 'args = ["{lr}"]', "lr = [1, 2]")
    assert "both make an array" in one_line(capsys, "submit", "--spec", str(spec), "--array", "0-1")
    # without a [sweep], braces are the script's business
    plain = write_spec(tmp_path, 'args = ["{json}", "{}"]')
    assert request("--spec", str(plain)).argv[-2:] == ["{json}", "{}"]


# --- dependencies, time limits, notifications, constraints ----------------------------------


def test_scheduling_options_become_request_fields() -> None:
    submit = request(
        "--after", "3,4", "--after", "4,5", "--time", "1-00:00", "--notify", "ntfy://lab",
        "--notify", "json://localhost:9/x", "--notify-on", "failure",
        "--constraint", "nodes=box1,box2;type=a100", SLEEP, "1",
    )  # fmt: skip
    assert (submit.after, submit.after_any) == (["3", "4", "5"], False)
    assert submit.time_limit_s == 86400.0
    assert submit.notify == ["ntfy://lab", "json://localhost:9/x"]
    assert submit.notify_on == "failure"
    assert submit.constraint == Constraint(nodes=["box1", "box2"], device_type="a100")
    assert request("--after-any", "7", SLEEP, "1").after_any
    one_of = request("--after-one-of", "7,8", SLEEP, "1")
    assert (one_of.after, one_of.after_any, one_of.after_one) == (["7", "8"], False, True)
    plain = request(SLEEP, "1")
    assert (plain.after, plain.time_limit_s, plain.notify, plain.constraint) == ([], None, [], None)


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("30s", 30), ("10m", 600), ("2h", 7200), ("1h30m", 5400), ("1-00:00", 86400), ("90", 5400),
     ("1:30:00", 5400), ("2d", 172800)],
)  # fmt: skip
def test_time_limits(text: str, seconds: float) -> None:
    assert parse_time_limit(text) == seconds
    assert request("--time", text, SLEEP, "1").time_limit_s == seconds


def test_bad_scheduling_options_are_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert "--time: not a duration: 'soon'" in one_line(
        capsys, "submit", "--time", "soon", SLEEP, "1"
    )
    assert "at least 1s" in one_line(capsys, "submit", "--time", "0.5s", SLEEP, "1")
    assert "at most 366 days" in one_line(capsys, "submit", "--time", "400d", SLEEP, "1")
    assert "--after: 'x' is not a job id" in one_line(
        capsys, "submit", "--after", "3,x", SLEEP, "1"
    )
    assert "not a URL" in one_line(capsys, "submit", "--notify", "lab-channel", SLEEP, "1")
    assert "unknown key 'gpu'" in one_line(capsys, "submit", "--constraint", "gpu=2", SLEEP, "1")
    assert "expected KEY=VALUE" in one_line(capsys, "submit", "--constraint", "a100", SLEEP, "1")
    assert "two device types" in one_line(
        capsys, "submit", "--constraint", "type=a100", "--constraint", "type=h100", SLEEP, "1"
    )
    assert "not allowed with argument" in usage_error(
        capsys, "submit", "--after", "1", "--after-any", "2", SLEEP, "1"
    )
    assert "invalid choice" in usage_error(capsys, "submit", "--notify-on", "never", SLEEP, "1")


def test_constraint_forms() -> None:
    both = Constraint(nodes=["a", "b"], device_type="t")
    assert parse_constraint(["nodes=a,b;type=t"]) == both
    assert parse_constraint(["nodes=a", "nodes=b", "type=t"]) == both
    assert parse_constraint(["node=a,b", "type=t;"]) == both
    assert parse_constraint([]) is None


def test_job_toml_scheduling_keys(tmp_path: Path, script: Path) -> None:
    spec = write_spec(
        tmp_path,
        'after = [12, "13"]\nafter_any = true\ntime = "90m"\nnotify = ["ntfy://t"]\n'
        'notify_on = "failure"\nconstraint = { nodes = ["box1"], type = "a100" }\n'
        'array = "0-3"\nmax_running = 2',
    )
    submit = request("--spec", str(spec))
    assert (submit.after, submit.after_any, submit.time_limit_s) == (["12", "13"], True, 5400.0)
    assert (submit.notify, submit.notify_on) == (["ntfy://t"], "failure")
    assert submit.constraint == Constraint(nodes=["box1"], device_type="a100")
    assert [t.index for t in submit.array or []] == [0, 1, 2, 3] and submit.max_running == 2
    # an option wins over the file's key
    override = request("--spec", str(spec), "--time", "10m", "--after", "5")
    assert (override.time_limit_s, override.after, override.after_any) == (600.0, ["5"], False)
    text = write_spec(tmp_path, 'constraint = "nodes=box2;type=cpu"')
    assert request("--spec", str(text)).constraint == Constraint(nodes=["box2"], device_type="cpu")


# --- edit --------------------------------------------------------------------------------


def edit(*argv: str):  # type: ignore[no-untyped-def]
    return edit_request(parse(build_parser(), ["edit", *argv]))


def test_edit_requests() -> None:
    change = edit("12", "--time", "2h", "--priority", "3")
    assert (change.id, change.time_limit_s, change.priority) == ("12", 7200.0, 3)
    assert change.argv is UNSET and change.min_gpus is UNSET and change.max_gpus is UNSET
    assert edit("--time", "2h", "12").time_limit_s == 7200.0  # options before the id too
    assert edit("12", "--no-time").time_limit_s is None
    assert (edit("12", "--gpus", "2").min_gpus, edit("12", "--gpus", "2").max_gpus) == (2, 2)
    bounds = edit("12", "--min-gpus", "2", "--max-gpus", "any")
    assert (bounds.min_gpus, bounds.max_gpus) == (2, None)
    command = edit("12", "--priority", "1", "--", SLEEP, "--flag", "7")
    assert command.argv == [SLEEP, "--flag", "7"] and command.priority == 1
    # the command alone, right after the id (argparse drops that "--"), one with its own "--"
    assert edit("12", "--", SLEEP, "--flag", "7").argv == [SLEEP, "--flag", "7"]
    assert edit("12", "--", SLEEP, "--", "x").argv == [SLEEP, "--", "x"]
    assert edit("12", "--time", "1h", "--", SLEEP, "--", "x").argv == [SLEEP, "--", "x"]

    # the common options after the id too, as before it
    args = build_parser().parse_args(
        ["edit", "12", "--priority", "1", "--state-dir", "/s", "--json"]
    )
    late = edit_request(args)
    assert (late.priority, args.state_dir, args.json) == (1, "/s", True)


def test_edit_mistakes_are_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert "nothing to change" in one_line(capsys, "edit", "12")
    assert "give a new command after --" in one_line(capsys, "edit", "12", "train.py")
    assert "leave out --min-gpus" in one_line(
        capsys, "edit", "12", "--gpus", "2", "--min-gpus", "1"
    )
    assert "contradict" in one_line(capsys, "edit", "--no-time", "12", "--time", "1h")
    assert "not allowed with argument" in usage_error(
        capsys, "edit", "--no-time", "--time", "1h", "12"
    )
    assert "not a duration" in one_line(capsys, "edit", "12", "--time", "later")
    assert "no job with id 'x'" in one_line(capsys, "edit", "x", "--time", "1h")


# --- usage dates -------------------------------------------------------------------------


def test_since_forms() -> None:
    now = time.time()
    assert parse_since("7d", now) == pytest.approx(now - 7 * 86400)
    assert parse_since("12h", now) == pytest.approx(now - 12 * 3600)
    day = datetime.datetime(2024, 11, 1)
    assert parse_since("2024-11-01", now) == day.timestamp()
    assert parse_since("2024-11-01T08:30", now) == day.replace(hour=8, minute=30).timestamp()
    utc = datetime.datetime(2024, 11, 1, tzinfo=datetime.UTC).timestamp()
    assert parse_since("2024-11-01T00:00+00:00", now) == utc
    with pytest.raises(PolluxError, match="not a date"):
        parse_since("last tuesday", now)
    with pytest.raises(PolluxError, match="in the future"):
        parse_since("2999-01-01", now)


# --- what the tables show -----------------------------------------------------------------


def summary(job_id: str, state: JobState, **fields: Any) -> JobSummary:
    base: dict[str, Any] = dict(
        id=job_id, name=f"job{job_id}", owner="ada", state=state, gpus=0, devices={}, nodes=[],
        batch_size=None, local_batch=None, accum_steps=None, replicas=0, goodput=None,
        efficiency=None, speedup=None, progress=None, epoch=None, metrics={}, eta_s=None,
        min_gpus=1, max_gpus=1, priority=0, restarts=0, failures=0, submit_time=0.0,
        start_time=None, end_time=None, run_time_s=0.0, reason="",
    )  # fmt: skip
    base.update(fields)
    return JobSummary(target=None, **base)


def array_of(states: list[JobState], first: int = 12) -> list[JobSummary]:
    jobs = []
    for index, state in enumerate(states):
        held = {"gpus": 1, "devices": {"vm": [f"cpu:{index}"]}} if state == JobState.RUNNING else {}
        jobs.append(
            summary(
                str(first + index),
                state,
                name=f"sweep[{index}]",
                array_id=str(first),
                array_index=index,
                **held,
            )  # fmt: skip
        )
    return jobs


def test_status_groups_an_array_into_one_line() -> None:
    R, Q, S = JobState.RUNNING, JobState.QUEUED, JobState.SUCCEEDED
    tasks = array_of([R, R, Q, Q, Q, S])
    tasks[2].reason = "waiting: array 12 has 2 running (max 2)"
    jobs = [summary("11", JobState.FAILED, reason="exit 1"), *tasks,
            summary("18", JobState.HELD, reason="waiting: after job 12", after=["12"]),
            summary("19", R, time_limit_s=7200.0)]  # fmt: skip
    grouped = group_arrays(jobs)
    assert [getattr(item, "array_id", None) or item.id for item in grouped] == [  # type: ignore[union-attr]
        "11", "12", "18", "19",
    ]  # fmt: skip
    lines = status_table(jobs).splitlines()
    assert len(lines) == 5 and lines[0].split()[0] == "ID"
    array_line = lines[2]
    assert array_line.startswith("12[0-5]  sweep ")
    assert "2 running, 3 queued, 1 succeeded" in array_line
    assert "vm:0,1" in array_line and "has 2 running (max 2)" in array_line
    assert "waiting: after job 12" in lines[3] and "limit 2h" in lines[4]
    assert "exit 1" in lines[1]
    expanded = status_table(jobs, expand=True).splitlines()
    assert len(expanded) == 10 and expanded[2].startswith("12 ") and "sweep[0]" in expanded[2]


def test_usage_and_nodes_tables() -> None:
    def row(user: str, hours: dict[str, float], jobs: int) -> DeviceUsage:
        return DeviceUsage(user=user, device_hours=sum(hours.values()), by_type=hours, jobs=jobs,
                           succeeded=jobs - 1, failed=1, cancelled=0, running=0)  # fmt: skip

    reply = UsageReply(
        users=[row("ada", {"a100": 10.5, "cpu": 0.25}, 4), row("bo", {"cpu": 2.0}, 2)],
        total=row("*", {"a100": 10.5, "cpu": 2.25}, 6),
        since=None,
    )
    lines = usage_table(reply).splitlines()
    assert lines[0].split() == ["USER", "DEVICE-HOURS", "a100", "h", "cpu", "h", "USED", "h",
                                "MEDIAN", "WAIT", "JOBS", "SUCCEEDED", "FAILED", "CANCELLED",
                                "RUNNING"]  # fmt: skip
    assert lines[1].split() == ["ada", "10.75", "10.50", "0.25", "-", "-", "4", "3", "1", "0",
                                "0"]  # fmt: skip
    assert lines[2].split()[:4] == ["bo", "2.00", "0.00", "2.00"]
    assert lines[3].split()[:2] == ["total", "12.75"]
    node = NodeRow(name="box", host="box.lab", local=False, up=True, error=None,
                   devices=["cuda:0", "cuda:1"], busy=[], jobs={"cuda:0": "4"}, load=0.5,
                   device_type="a100", withheld=["cuda:1"], drained=False)  # fmt: skip
    assert "2 a100 device(s)" in node_line(node) and "cuda:0→job 4" in node_line(node)
    node.drained = True
    assert "up, drained" in node_line(node)


# --- against a real daemon -----------------------------------------------------------------


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    """A daemon on two CPU devices that schedules only every 30 s: its jobs here stay held,
    or are cancelled before it looks."""
    with DaemonFactory(tmp_path_factory.mktemp("lab")) as daemons:
        yield daemons(devices="cpu:2", interval=30)


def cli(capsys: pytest.CaptureFixture[str], daemon: DaemonProcess, *argv: str) -> str:
    """Run one command against ``daemon``; its output (the command must succeed)."""
    command, rest = argv[0], argv[1:]
    code = main([command, "--state-dir", str(daemon.state_dir), *rest])
    out, err = capsys.readouterr()
    assert code == 0, err
    return out


def cli_json(capsys: pytest.CaptureFixture[str], daemon: DaemonProcess, *argv: str) -> Any:
    return json.loads(cli(capsys, daemon, argv[0], "--json", *argv[1:]))


def test_an_array_is_submitted_listed_and_cancelled_whole(
    capsys: pytest.CaptureFixture[str], daemon: DaemonProcess
) -> None:
    sd = ("--state-dir", str(daemon.state_dir))
    submitted = cli_json(capsys, daemon, "submit", "--hold", "--array", "0-5", "--max-running",
                         "2", "--name", "arr", SLEEP, "30")  # fmt: skip
    ids = submitted["ids"]
    assert len(ids) == 6 and submitted["id"] == ids[0] and len(set(ids)) == 6
    jobs = {j["id"]: j for j in cli_json(capsys, daemon, "status")["jobs"]}
    assert [jobs[i]["array_id"] for i in ids] == [ids[0]] * 6
    assert [jobs[i]["array_index"] for i in ids] == list(range(6))
    assert [jobs[i]["name"] for i in ids][:2] == ["arr[0]", "arr[1]"]
    table = cli(capsys, daemon, "status")
    line = next(row for row in table.splitlines() if row.startswith(f"{ids[0]}[0-5]"))
    assert "6 held" in line and "arr" in line
    expanded = cli(capsys, daemon, "status", "--expand").splitlines()
    assert sum(row.split()[0] in ids for row in expanded[1:]) == 6
    shown = cli(capsys, daemon, "show", ids[3])
    assert f"array       {ids[0]}, task 3" in shown
    # one task alone, then the rest through the array's id
    assert f"cancelled job {ids[3]}" in cli(capsys, daemon, "cancel", ids[3])
    out = cli(capsys, daemon, "cancel", "--array", ids[0])
    assert out.count("cancelled job") == 5 and f"job {ids[3]} had already cancelled" in out
    states = {j["id"]: j["state"] for j in cli_json(capsys, daemon, "status")["jobs"]}
    assert {states[i] for i in ids} == {"cancelled"}
    assert "6 cancelled" in cli(capsys, daemon, "status")
    assert "is not an array" in one_line(capsys, "cancel", *sd, "--array", str(int(ids[0]) + 1))
    assert "cancel needs job ids or --array" in one_line(capsys, "cancel", *sd)


def test_a_sweep_runs_its_own_commands(
    capsys: pytest.CaptureFixture[str], daemon: DaemonProcess, tmp_path: Path, script: Path
) -> None:
    spec = write_spec(tmp_path, 'args = ["--lr", "{lr}", "--seed", "{seed}"]',
                      'lr = ["1e-3", "1e-4"]\nseed = [7, 8]')  # fmt: skip
    ids = cli_json(capsys, daemon, "submit", "--hold", "--spec", str(spec))["ids"]
    assert len(ids) == 4
    argvs = [cli_json(capsys, daemon, "show", i)["job"]["argv"][-4:] for i in ids]
    assert argvs == [["--lr", lr, "--seed", seed] for lr in ("1e-3", "1e-4") for seed in ("7", "8")]
    cli(capsys, daemon, "cancel", "--array", ids[0])


def test_edit_a_held_job_then_show_it(
    capsys: pytest.CaptureFixture[str], daemon: DaemonProcess
) -> None:
    sd = ("--state-dir", str(daemon.state_dir))
    job_id = cli_json(capsys, daemon, "submit", "--hold", "--time", "10m", SLEEP, "100")["id"]
    out = cli(capsys, daemon, "edit", job_id, "--time", "2h", "--priority", "-3", "--", SLEEP, "7")
    assert f"job {job_id} edited (command, time limit, priority), held" in out
    job = cli_json(capsys, daemon, "show", job_id)["job"]
    assert (job["time_limit_s"], job["priority"], job["argv"]) == (7200.0, -3, [SLEEP, "7"])
    assert job["state"] == "held"
    shown = cli(capsys, daemon, "show", job_id)
    assert "time limit  2h" in shown and f"command     {SLEEP} 7" in shown
    cli(capsys, daemon, "edit", job_id, "--no-time")
    assert cli_json(capsys, daemon, "show", job_id)["job"]["time_limit_s"] is None
    cli(capsys, daemon, "edit", "--gpus", "2", job_id)
    job = cli_json(capsys, daemon, "show", job_id)["job"]
    assert (job["min_gpus"], job["max_gpus"]) == (2, 2)
    assert "needs at least 3 device(s) but this daemon has 2" in one_line(
        capsys, "edit", *sd, job_id, "--gpus", "3"
    )
    cli(capsys, daemon, "cancel", job_id)
    assert "only a queued or held job can be edited" in one_line(
        capsys, "edit", *sd, job_id, "--time", "1h"
    )


def test_restart_gives_a_new_job_with_the_same_command(
    capsys: pytest.CaptureFixture[str], daemon: DaemonProcess
) -> None:
    sd = ("--state-dir", str(daemon.state_dir))
    old = cli_json(capsys, daemon, "submit", "--hold", "--name", "again", "--time", "5m",
                   "--env", "MARK=1", SLEEP, "3")["id"]  # fmt: skip
    assert "only a job that ended can be restarted" in one_line(capsys, "restart", *sd, old)
    cli(capsys, daemon, "cancel", old)
    reply = cli_json(capsys, daemon, "restart", "--hold", old)
    new = reply["id"]
    assert new != old and reply["state"] == "held" and "ids" not in reply
    before = cli_json(capsys, daemon, "show", old)["job"]
    after = cli_json(capsys, daemon, "show", new)["job"]
    for key in ("argv", "workdir", "name", "time_limit_s", "min_gpus", "max_gpus", "elastic"):
        assert after[key] == before[key], key
    assert after["env"]["MARK"] == "1"
    out = cli(capsys, daemon, "restart", old)
    assert out.startswith(f"job {old} restarted as job ") and out.strip().endswith("(queued)")
    cli(capsys, daemon, "cancel", new, out.split()[-2])


def test_dependencies_and_constraints_reach_the_daemon(
    capsys: pytest.CaptureFixture[str], daemon: DaemonProcess
) -> None:
    sd = ("--state-dir", str(daemon.state_dir))
    first = cli_json(capsys, daemon, "submit", "--hold", SLEEP, "1")["id"]
    second = cli_json(capsys, daemon, "submit", "--hold", "--after-any", first,
                      "--constraint", "type=cpu", SLEEP, "1")["id"]  # fmt: skip
    job = cli_json(capsys, daemon, "show", second)["job"]
    assert (job["after"], job["after_any"]) == ([first], True)
    assert job["constraint"] == {"nodes": [], "device_type": "cpu"}
    shown = cli(capsys, daemon, "show", second)
    assert f"depends     after any end of {first}" in shown and "constraint  type cpu" in shown
    assert "which does not exist" in one_line(capsys, "submit", *sd, "--after", "99999", SLEEP, "1")
    assert "device type 'a100'" in one_line(
        capsys, "submit", *sd, "--constraint", "type=a100", SLEEP, "1"
    )
    cli(capsys, daemon, "cancel", first, second)


def test_drain_and_resume(capsys: pytest.CaptureFixture[str], daemon: DaemonProcess) -> None:
    sd = ("--state-dir", str(daemon.state_dir))
    node = cli_json(capsys, daemon, "nodes")["nodes"][0]["name"]
    assert cli_json(capsys, daemon, "drain", "cpu:1")["withheld"] == [f"{node}:cpu:1"]
    assert f"withheld from new jobs: {node}:cpu:1" in cli(capsys, daemon, "drain", "cpu:1")
    assert cli_json(capsys, daemon, "resume", "cpu:1")["withheld"] == []
    assert "is not drained" in one_line(capsys, "resume", *sd, "cpu:1")
    assert "no node or device 'cuda:9'" in one_line(capsys, "drain", *sd, "cuda:9")
    assert "is not a node or device name" in one_line(capsys, "drain", *sd, "two words")


def test_usage_counts_the_jobs_that_ran(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, daemon_factory: DaemonFactory
) -> None:
    proc = daemon_factory(devices="cpu:2", interval=1, config="[daemon]\nmax_retries = 0\n")
    sd = ("--state-dir", str(proc.state_dir))
    empty = cli_json(capsys, proc, "usage")
    assert empty["users"] == [] and empty["total"]["jobs"] == 0
    ok = cli_json(capsys, proc, "submit", SLEEP, "1")["id"]
    bad = cli_json(capsys, proc, "submit", "--name", "fails", shutil.which("false") or "false")[
        "id"
    ]
    never = cli_json(capsys, proc, "submit", "--hold", SLEEP, "1")["id"]

    def ended() -> bool:
        jobs = {j["id"]: j["state"] for j in cli_json(capsys, proc, "status")["jobs"]}
        return jobs[ok] == "succeeded" and jobs[bad] == "failed"

    wait_for(ended, 60, "one job to succeed and one to fail")
    usage = cli_json(capsys, proc, "usage")
    me = usage["users"][0]
    assert len(usage["users"]) == 1 and set(me) == {
        "user", "device_hours", "by_type", "jobs", "succeeded", "failed", "cancelled",
        "running", "median_wait_s", "used_device_hours", "measured_device_hours", "account",
    }  # fmt: skip
    assert (me["jobs"], me["succeeded"], me["failed"], me["running"]) == (2, 1, 1, 0)
    assert set(me["by_type"]) == {"cpu"} and me["device_hours"] == pytest.approx(
        me["by_type"]["cpu"]
    )
    # sleep 1 on one device: about a second of device time
    assert 0.5 / 3600 < me["device_hours"] < 30 / 3600
    assert usage["total"]["user"] == "*" and usage["total"]["jobs"] == 2
    assert usage["since"] is None
    recent = cli_json(capsys, proc, "usage", "--since", "1d", "--user", me["user"])
    assert recent["since"] == pytest.approx(time.time() - 86400, abs=60)
    assert recent["users"][0]["jobs"] == 2
    assert cli_json(capsys, proc, "usage", "--user", "nobody-here")["users"] == []
    table = cli(capsys, proc, "usage").splitlines()
    assert table[0] == "usage (all history)" and table[1].split()[:3] == [
        "USER",
        "DEVICE-HOURS",
        "cpu",
    ]
    assert table[-1].split()[0] == "total" and table[-1].split()[-5:] == [
        "2",
        "1",
        "1",
        "0",
        "0",
    ]
    assert "in the future" in one_line(capsys, "usage", *sd, "--since", "2999-01-01")
    cli(capsys, proc, "cancel", never)
