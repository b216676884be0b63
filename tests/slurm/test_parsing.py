"""What the Slurm launcher reads from Slurm's tools, without a cluster: ``srun``'s report of
its tasks' ends (the keeper) and an allocation's nodes and GPUs (``scontrol``'s answers as a
real 22.05 gave them on the test bed, typed and untyped)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import pytest

from pollux_local.errors import PolluxError
from pollux_local.launch.slurm.allocation import node_lost, read_allocation
from pollux_local.launch.slurm.keeper import group_code, task_exits

#: srun's stderr of a step whose task 1 exited 3, with --kill-on-bad-exit
KILLED_ON_BAD_EXIT = """\
srun: error: slurmb-h2: task 1: Exited with exit code 3
srun: launch/slurm: _step_signal: Terminating StepId=1.0
slurmstepd-slurmb-h1: error: *** STEP 1.0 ON slurmb-h1 CANCELLED AT 2026-11-25T21:16:44 ***
srun: error: slurmb-h1: task 0: Terminated
srun: Force Terminated StepId=1.0
"""


def test_the_first_failing_task_is_the_steps_code_and_each_rank_keeps_its_own() -> None:
    codes, order = task_exits(KILLED_ON_BAD_EXIT)
    assert codes == {1: 3, 0: -15} and order == [1, 0]
    assert group_code(codes, order, srun_code=143) == 3


def test_a_checkpoint_stop_of_every_rank_is_75_and_a_clean_end_is_0() -> None:
    text = "srun: error: slurmb-h1: tasks 0-1: Exited with exit code 75\n"
    codes, order = task_exits(text)
    assert codes == {0: 75, 1: 75}
    assert group_code(codes, order, srun_code=75) == 75
    assert group_code({}, [], srun_code=0) == 0


def test_a_killed_task_is_its_signal_and_a_step_that_never_started_is_sruns_code() -> None:
    codes, order = task_exits("srun: error: slurmb-h2: task 1: Killed\n")
    assert codes == {1: -9} and group_code(codes, order, 137) == -9
    text = "srun: error: Unable to create step for job 16: Job/step already completing\n"
    assert task_exits(text) == ({}, [])
    assert group_code({}, [], srun_code=1) == 1


JOB_DETAIL = """\
JobId=5 JobName=interactive
   NumNodes=2 NumCPUs=4 NumTasks=4 CPUs/Task=1 ReqB:S:C:T=0:0:*:*
   JOB_GRES=gpu:a100:6
     Nodes=gpu01 CPU_IDs=0-1 Mem=0 GRES=gpu:a100:4(IDX:0-3)
     Nodes=gpu02 CPU_IDs=0,2 Mem=0 GRES=gpu:a100:2(IDX:1-2)
     Nodes=cpu07 CPU_IDs=0-3 Mem=0 GRES=
"""
NODES = {
    "gpu01": "NodeName=gpu01 CPUTot=8 Gres=gpu:a100:4 NodeAddr=10.0.0.1 RealMemory=512000"
    " State=MIXED",
    "gpu02": "NodeName=gpu02 CPUTot=8 Gres=gpu:a100:4 NodeAddr=gpu02 RealMemory=1 State=IDLE",
    "cpu07": "NodeName=cpu07 CPUTot=4 NodeAddr=10.0.0.7 RealMemory=64000 State=DOWN*",
}


def fake_scontrol(argv: Sequence[str]) -> str:
    if list(argv[:3]) == ["scontrol", "show", "hostnames"]:
        return {"gpu[01-02],cpu07": "gpu01\ngpu02\ncpu07\n"}.get(argv[3], argv[3] + "\n")
    if list(argv[:4]) == ["scontrol", "show", "job", "-d"]:
        return JOB_DETAIL
    if list(argv[:4]) == ["scontrol", "show", "node", "-o"]:
        return "\n".join(NODES[name] for name in argv[4].split(",")) + "\n"
    raise AssertionError(argv)


def test_an_allocations_nodes_hold_its_gpus_typed_by_their_gres_or_its_cpus() -> None:
    env = {"SLURM_JOB_ID": "5", "SLURM_JOB_NODELIST": "gpu[01-02],cpu07"}
    allocation = read_allocation(env, fake_scontrol)
    assert allocation.job_id == "5"
    gpu01, gpu02, cpu07 = allocation.nodes
    assert (gpu01.name, gpu01.address, gpu01.gpu_type, gpu01.devices) == (
        "gpu01", "10.0.0.1", "a100", ("cuda:0", "cuda:1", "cuda:2", "cuda:3"),
    )  # fmt: skip
    assert gpu01.memory == 512000 << 20
    assert gpu02.devices == ("cuda:0", "cuda:1") and gpu02.memory is None
    assert cpu07.gpu_type is None and cpu07.devices == ("cpu:0", "cpu:1", "cpu:2", "cpu:3")


def test_outside_an_allocation_the_launcher_says_what_is_missing() -> None:
    with pytest.raises(PolluxError, match="SLURM_JOB_ID is not set"):
        read_allocation({}, fake_scontrol)


@pytest.mark.parametrize(
    ("state", "lost"),
    [("IDLE", False), ("MIXED", False), ("MIXED+DRAIN", False), ("DOWN*", True),
     ("MIXED+NOT_RESPONDING", True), ("IDLE*", True), ("FAIL", True)],
)  # fmt: skip
def test_down_failed_and_unresponsive_nodes_count_as_lost(state: str, lost: bool) -> None:
    assert node_lost(state) is lost


def test_a_step_is_named_by_its_incarnation_and_runs_in_the_daemons_cluster(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The keeper finds its step by name: an earlier incarnation's step, still ending, must
    not be taken for it.  And the step runs where the daemon's Slurm is, whatever
    ``SLURM_CONF`` (or other option of srun's) the job's environment names."""
    from pollux_local.launch.base import LaunchSpec, ReplicaSlot
    from pollux_local.launch.slurm.launcher import SlurmLauncher, step_name

    allocation = read_allocation(
        {"SLURM_JOB_ID": "5", "SLURM_JOB_NODELIST": "cpu07"}, fake_scontrol
    )
    launcher = SlurmLauncher(allocation, tmp_path, run=fake_scontrol)

    def spec(restarts: str) -> LaunchSpec:
        env = {"POLLUX_RESTARTS": restarts, "SLURM_CONF": "/home/mallory/slurm.conf",
               "SLURM_OVERLAP": "1", "SLURM_NTASKS": "64", "SRUN_CPUS_PER_TASK": "32",
               "HOME": "/home/mallory", "SLURM_ARRAY_JOB_ID": "7",
               "SLURM_ARRAY_TASK_ID": "3"}  # fmt: skip
        slot = ReplicaSlot(rank=0, node="cpu07", device="cpu:0", local_rank=0, node_rank=0)
        return LaunchSpec(job_id="7", argv=["t"], workdir=tmp_path, env=env, slots=[slot],
                          log_dir=tmp_path)  # fmt: skip

    assert step_name(spec("0")) != step_name(spec("1"))
    assert step_name(spec("../x")) == step_name(spec("0")) == "pollux-7.0"
    monkeypatch.setenv("SLURM_CONF", "/etc/slurm/slurm.conf")
    assert launcher.step_env(spec("0"))["SLURM_CONF"] == "/etc/slurm/slurm.conf"
    monkeypatch.delenv("SLURM_CONF")
    env = launcher.step_env(spec("0"))
    # what the job kept from the shell it was submitted in never becomes an option of srun;
    # the launch contract's own (an array task's index, set by the daemon) stays
    assert sorted(k for k in env if k.startswith(("SLURM_", "SRUN_"))) == [
        "SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID",
    ]  # fmt: skip
    assert (env["SLURM_ARRAY_TASK_ID"], env["HOME"]) == ("3", "/home/mallory")


def test_a_task_that_cannot_enter_its_working_directory_runs_nothing(tmp_path: Path) -> None:
    """slurmstepd runs a task whose ``--chdir`` it cannot enter in ``/tmp`` (review s62):
    there a job's relative paths, and ``python -m``'s first ``sys.path`` entry, are what
    anyone may plant.  The rank wrapper enters the directory itself, as the user, or the
    task exits 252 saying why, as a replica does on the daemon's machine and SSH nodes."""
    import subprocess

    from pollux_local.api.states import ExitCode
    from pollux_local.daemon.failures import permanent_cause
    from pollux_local.launch.slurm.launcher import RANK_WRAPPER

    env = {"PATH": "/usr/bin:/bin", "SLURM_PROCID": "1", "SLURM_LOCALID": "0",
           "SLURM_NODEID": "1"}  # fmt: skip
    missing = tmp_path / "not there"
    ran = subprocess.run(
        ["/bin/sh", "-c", RANK_WRAPPER, "pollux-rank", str(missing), "", "sh", "-c", "pwd"],
        cwd="/tmp", env=env, capture_output=True, text=True,
    )  # fmt: skip
    assert ran.returncode == ExitCode.WORKDIR == 252
    assert ran.stdout == "" and f"cannot enter working directory {missing}" in ran.stderr
    work = tmp_path / "work dir"
    work.mkdir()
    ran = subprocess.run(
        ["/bin/sh", "-c", RANK_WRAPPER, "pollux-rank", str(work), "", "sh", "-c",
         'pwd; echo "$RANK"'],
        cwd="/tmp", env=env, capture_output=True, text=True,
    )  # fmt: skip
    assert ran.returncode == 0 and ran.stdout.split("\n")[:2] == [str(work), "1"], ran
    # a command that cannot run says so as the other launchers do (a permanent failure)
    (work / "script.sh").write_text("echo hi\n")  # not executable
    for command, why in (("./missing", "No such file or directory"),
                         ("./script.sh", "Permission denied"),
                         ("no-such-program-x", "No such file or directory")):  # fmt: skip
        ran = subprocess.run(
            ["/bin/sh", "-c", RANK_WRAPPER, "pollux-rank", str(work), "", command],
            cwd="/tmp", env=env, capture_output=True, text=True,
        )  # fmt: skip
        line = ran.stderr.strip().splitlines()[-1]
        assert ran.returncode == 127 and line == f"cannot execute {command}: {why}", ran
        assert permanent_cause(line, on_cpu=True) == "its command cannot be run"


def test_the_step_starts_with_the_open_files_limit_a_job_started_by_hand_has(
    tmp_path: Path,
) -> None:
    """The daemon raises its own limit on open files; the local supervisor gives replicas
    back the limit it started with, and so does the keeper to ``srun``, which hands its
    limits on to the tasks (review s62: Slurm's tasks had the daemon's raised one)."""
    import json
    import resource
    import subprocess
    import sys

    from pollux_local.launch.local import JOB_OPEN_FILES
    from pollux_local.launch.slurm.launcher import KEEPER

    seen = tmp_path / "limit"
    order = {
        "srun": ["/bin/sh", "-c", f"ulimit -n > {seen}"], "env": {"PATH": "/usr/bin:/bin"},
        "record": str(tmp_path / "rec.json"), "log": str(tmp_path / "srun.log"),
        "token": "7:0", "slurm_job": "0", "step_name": "pollux-7.0", "open_files": 256,
    }  # fmt: skip

    def raised() -> None:  # as the daemon runs: its own limit raised
        _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))

    done = subprocess.run(
        [sys.executable, str(KEEPER)], input=json.dumps(order) + "\n", text=True,
        preexec_fn=raised, capture_output=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done
    assert seen.read_text().strip() == "256"
    assert JOB_OPEN_FILES > 0


def test_each_task_writes_how_it_ended_and_ends_as_its_command_did(tmp_path: Path) -> None:
    """The rank wrapper runs the command as its child and writes its code to
    ``EXITS<rank>`` (for the keeper: srun may end 255 when every task exited 0); it ends
    as the command did, of its signal too, and a TERM to the whole step (as Slurm sends
    it) reaches the command, whose own end (a checkpoint's 75) is the task's."""
    import signal
    import subprocess
    import time

    from pollux_local.launch.slurm.launcher import RANK_WRAPPER

    env = {"PATH": "/usr/bin:/bin", "SLURM_PROCID": "2", "SLURM_LOCALID": "0",
           "SLURM_NODEID": "0"}  # fmt: skip
    exits = str(tmp_path / "exit-rank")

    def task(command: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["/bin/sh", "-c", RANK_WRAPPER, "pollux-rank", str(tmp_path), exits,
             "sh", "-c", command],
            env=env, capture_output=True, text=True, timeout=30,
        )  # fmt: skip

    assert task('echo "rank $RANK"').returncode == 0
    assert (tmp_path / "exit-rank2").read_text() == "0\n"
    assert task("exit 3").returncode == 3 and (tmp_path / "exit-rank2").read_text() == "3\n"
    killed = task("kill -TERM $$")
    assert killed.returncode == -signal.SIGTERM, killed
    assert (tmp_path / "exit-rank2").read_text() == "143\n"
    # a stop of the step: Slurm signals every process of it, the shell and the command
    ready = tmp_path / "ready"
    proc = subprocess.Popen(
        ["/bin/sh", "-c", RANK_WRAPPER, "pollux-rank", str(tmp_path), exits, "sh", "-c",
         f"trap 'exit 75' TERM; touch {ready}; while :; do sleep 0.1; done"],
        env=env, start_new_session=True,
    )  # fmt: skip
    deadline = time.monotonic() + 20
    while not ready.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGTERM)
    assert proc.wait(timeout=20) == 75
    assert (tmp_path / "exit-rank2").read_text() == "75\n"


def _keep(tmp_path: Path, srun: str, tasks: int) -> dict[str, object]:
    """The keeper's record after running ``srun`` (a shell command standing in for it)."""
    import json
    import subprocess
    import sys

    from pollux_local.launch.slurm.launcher import KEEPER

    order = {
        "srun": ["/bin/sh", "-c", srun], "env": {"PATH": "/usr/bin:/bin"},
        "record": str(tmp_path / "rec.json"), "log": str(tmp_path / "srun.log"),
        "token": "7:0", "slurm_job": "0", "step_name": "pollux-7.0",
        "exits": str(tmp_path / ".exit-0-rank"), "tasks": tasks,
    }  # fmt: skip
    done = subprocess.run(
        [sys.executable, str(KEEPER)], input=json.dumps(order) + "\n", text=True,
        capture_output=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done
    record = json.loads((tmp_path / "rec.json").read_text())
    assert isinstance(record, dict)
    return record


def test_a_step_srun_ends_255_whose_tasks_all_exited_0_is_a_success(tmp_path: Path) -> None:
    """srun names only the tasks that ended abnormally; when it names none and still ends
    255 (a node Slurm found not responding as the step ended), the step used to count as
    crashed and the job ran again, its finished work too.  The tasks' own records decide:
    all 0 is a success, a task's failure is the step's; without every task's record,
    srun's code stands."""
    import shlex

    from pollux_local.launch.slurm.launcher import RANK_WRAPPER

    def srun(*commands: str, code: int = 255) -> str:
        runs = [
            " ".join(shlex.quote(a) for a in (
                "env", f"SLURM_PROCID={rank}", "/bin/sh", "-c", RANK_WRAPPER, "pollux-rank",
                str(tmp_path), f"{tmp_path}/.exit-0-rank", "sh", "-c", command))
            for rank, command in enumerate(commands)
        ]  # fmt: skip
        return "; ".join([*runs, f"exit {code}"])

    record = _keep(tmp_path, srun("true", "true"), tasks=2)
    assert (record["exit_code"], record["srun_code"], record.get("recorded")) == (0, 255, True)
    assert not list(tmp_path.glob(".exit-*")), "the records are removed once read"
    record = _keep(tmp_path, srun("true", "exit 3"), tasks=2)
    assert (record["exit_code"], record["ranks"]) == (3, {"1": 3})
    # one task left no record (killed before it could write): srun's 255 stands
    lost = srun("true", "true").replace("exit 255", f"rm -f {tmp_path}/.exit-0-rank1; exit 255")
    record = _keep(tmp_path, lost, tasks=2)
    assert record["exit_code"] == 255 and "recorded" not in record
    # nor does a record left before the step (an earlier step of the same incarnation, ended
    # before it wrote the rest; review s73): it is removed when the keeper starts
    (tmp_path / ".exit-0-rank1").write_text("0\n")
    record = _keep(tmp_path, srun("true", code=255), tasks=2)
    assert record["exit_code"] == 255 and "recorded" not in record, record
    # srun named a task: its report is the step's, as before
    named = srun("true", "true", code=0).replace(
        "exit 0", "echo 'srun: error: h2: task 1: Exited with exit code 4' >&2; exit 4"
    )
    record = _keep(tmp_path, named, tasks=2)
    assert record["exit_code"] == 4 and "recorded" not in record


def test_the_rank_wrappers_command_gets_sigint_and_sigquit_as_on_other_launchers(
    tmp_path: Path,
) -> None:
    """The command starts with no signal ignored (as the local supervisor's replicas: SIGINT
    at its default), so a SIGINT of the step (srun's second Ctrl-C, a ``scancel -s INT``)
    reaches it; run with ``&`` it had SIGINT and SIGQUIT ignored and lived on (review s67).
    An exit of 147 (128 + SIGSTOP) is the task's exit, not a stop of the wrapper for good."""
    import subprocess

    from pollux_local.launch.slurm.launcher import RANK_WRAPPER

    env = {"PATH": "/usr/bin:/bin", "SLURM_PROCID": "0", "SLURM_LOCALID": "0",
           "SLURM_NODEID": "0"}  # fmt: skip
    exits = str(tmp_path / "exit-rank")
    shown = subprocess.run(
        ["/bin/sh", "-c", RANK_WRAPPER, "pollux-rank", str(tmp_path), exits,
         "grep", "^SigIgn:", "/proc/self/status"],
        env=env, capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert shown.returncode == 0, shown
    ignored = int(shown.stdout.split()[1], 16)
    assert not ignored & (1 << (2 - 1)), "SIGINT ignored in the command"
    assert not ignored & (1 << (3 - 1)), "SIGQUIT ignored in the command"
    stopped = subprocess.run(
        ["/bin/sh", "-c", RANK_WRAPPER, "pollux-rank", str(tmp_path), exits,
         "sh", "-c", "exit 147"],
        env=env, capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert stopped.returncode == 147
    assert (tmp_path / "exit-rank0").read_text() == "147\n"


def test_a_group_whose_record_another_keeper_wrote_ends_as_superseded_touching_nothing(
    tmp_path: Path,
) -> None:
    """A later start of the job wrote the keeper's record (the same path, another keeper's
    pid): the group still watching the earlier start ends as lost, and runs no Slurm command
    (a scancel by the step name the two starts share ended the later start's step)."""
    import asyncio
    import json
    import time

    from pollux_local.api.states import ExitCode
    from pollux_local.launch.base import LaunchSpec, ReplicaSlot
    from pollux_local.launch.slurm.step import SlurmStepGroup

    record = tmp_path / "slurm-7.json"
    later = {"version": 1, "token": "7:0", "keeper_pid": os.getppid(), "state": "running",
             "started": time.time(), "slurm_job": "5", "step": "5.1"}  # fmt: skip
    record.write_text(json.dumps(later))
    slot = ReplicaSlot(rank=0, node="cpu07", device="cpu:0", local_rank=0, node_rank=0)
    spec = LaunchSpec(job_id="7", argv=["t"], workdir=tmp_path, env={"POLLUX_RESTARTS": "0"},
                      slots=[slot], log_dir=tmp_path)  # fmt: skip
    ran: list[Sequence[str]] = []

    def run(argv: Sequence[str]) -> str:
        ran.append(argv)
        return ""

    async def scenario() -> tuple[int, str | None]:
        # its own keeper (this process) still runs: only the record says it is not watched
        group = SlurmStepGroup(spec, record, os.getpid(), None, run)
        return await asyncio.wait_for(group.wait(), 10), group.failure_reason

    code, reason = asyncio.run(scenario())
    assert code == ExitCode.NODE_LOST and reason is not None and "started again" in reason
    assert ran == [] and json.loads(record.read_text()) == later


def test_an_earlier_step_is_ended_even_when_squeue_does_not_answer_at_first() -> None:
    """A loaded slurmctld that times out on ``squeue``: the earlier start's step is looked up
    again, found and cancelled, not taken for gone (the next start then ran beside it); an
    allocation Slurm no longer knows ends the look-up at once."""
    import asyncio

    from pollux_local.launch.slurm.step import end_orphaned_step

    answers: list[str | PolluxError] = [
        PolluxError(
            "`squeue` failed: slurm_load_jobs error: Socket timed out on send/recv operation"
        ),
        PolluxError(
            "`squeue` failed: slurm_load_jobs error: Socket timed out on send/recv operation"
        ),
        "5.0 pollux-7.0\n5.1 pollux-8.0\n",
        "",
    ]
    ran: list[list[str]] = []

    def run(argv: Sequence[str]) -> str:
        ran.append(list(argv))
        if argv[0] == "scancel":
            return ""
        answer = answers.pop(0)
        if isinstance(answer, PolluxError):
            raise answer
        return answer

    asyncio.run(end_orphaned_step(run, {"slurm_job": "5"}, "pollux-7.0"))
    assert [argv for argv in ran if argv[0] == "scancel"] == [["scancel", "5.0"]]
    assert answers == []

    gone = PolluxError("`squeue` failed: slurm_load_jobs error: Invalid job id specified")
    ran.clear()
    answers[:] = [gone]
    asyncio.run(end_orphaned_step(run, {"slurm_job": "5"}, "pollux-7.0"))
    assert ran == [["squeue", "-h", "-s", "-j", "5", "-o", "%i %j"]]
