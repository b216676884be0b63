"""The Slurm launcher: every incarnation of a job is one job step of the daemon's allocation,
started with ``srun`` by a keeper (``keeper.py``) that records its end."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shlex
import shutil
import sys
import weakref
from pathlib import Path

import psutil

from pollux_local.api.launch import LAUNCH_VARIABLES, PER_RANK_VARIABLES
from pollux_local.api.states import ExitCode
from pollux_local.errors import PolluxError
from pollux_local.launch.base import LaunchSpec, NodeHealth, ReplicaSlot, incarnation
from pollux_local.launch.local import JOB_OPEN_FILES, replica_env
from pollux_local.launch.slurm.allocation import (
    Allocation,
    Runner,
    SlurmNode,
    node_lost,
    node_state,
    run_slurm,
)
from pollux_local.launch.slurm.step import (
    SlurmStepGroup,
    end_orphaned_step,
    exits_prefix,
    read_record,
)

log = logging.getLogger("pollux_local.launch.slurm")

#: The prefixes of the variables ``srun`` reads as options (its "input environment").
SRUN_INPUT_PREFIXES = ("SLURM_", "SRUN_")

#: Each task takes its ranks from Slurm's step environment, then runs the job's command.
RANK_WRAPPER = (
    # $1: the working directory, entered as the user, or nothing runs (exit 252, as on the
    # daemon's machine and SSH nodes): slurmstepd runs a task it cannot chdir in /tmp
    'cd -- "$1" || { printf "cannot enter working directory %s\\n" "$1" >&2;'
    f" exit {int(ExitCode.WORKDIR)}; }}; exits=$2; shift 2"
    # a command that cannot run is said as the other launchers say it (127)
    ' && { case "$1" in */*) [ -f "$1" ] && [ -x "$1" ];;'
    ' *) command -v -- "$1" >/dev/null 2>&1;; esac'
    ' || { why="No such file or directory";'
    ' case "$1" in */*) [ -e "$1" ] && why="Permission denied";; esac;'
    ' printf "cannot execute %s: %s\\n" "$1" "$why" >&2; exit 127; }; }'
    ' && RANK="$SLURM_PROCID" LOCAL_RANK="$SLURM_LOCALID" NODE_RANK="$SLURM_NODEID"'
    ' GROUP_RANK="$SLURM_NODEID" ROLE_RANK="$SLURM_PROCID"'
    " && export RANK LOCAL_RANK NODE_RANK GROUP_RANK ROLE_RANK"
    # $2: where the task's own end is written ($2<rank>), for the keeper: srun may end 255
    # while every task exited 0.  So the command runs as the shell's child, not in its place;
    # the shell catches what Slurm sends the whole step with a trap that does nothing (the
    # command gets it itself; a caught signal is the default again in the command, where an
    # ignored one stayed ignored, and a command run with "&" has SIGINT and SIGQUIT ignored
    # and /dev/null for stdin) and ends as the command did, of its signal too: not of one
    # that stops rather than ends (an exit 147 stopped the shell, SIGSTOP, for good)
    ' && { trap : TERM INT HUP USR1 USR2; "$@"; code=$?;'
    ' [ -z "$exits" ] || printf "%s\\n" "$code" 2>/dev/null >"$exits$SLURM_PROCID";'
    ' if [ "$code" -gt 128 ] && [ "$code" -le 192 ]; then'
    " case $((code - 128)) in 17|18|19|20|21|22|23|28) ;; *)"
    ' trap - TERM INT HUP USR1 USR2; kill -"$((code - 128))" $$;; esac; fi; exit "$code"; }'
)


#: The keeper's source (standard library only), run as a script.
KEEPER = Path(__file__).with_name("keeper.py")


def step_name(spec: LaunchSpec) -> str:
    """The name of the step of one incarnation of a job (how its keeper finds the step's id:
    a step of an earlier incarnation, still ending, has another name)."""
    return f"pollux-{spec.job_id}.{incarnation(spec)}"


class SlurmLauncher:
    """Starts replica groups as job steps of the allocation (implements ``Launcher``)."""

    def __init__(
        self,
        allocation: Allocation,
        run_dir: Path,
        *,
        run: Runner = run_slurm,
        python: str = sys.executable,
    ) -> None:
        self.allocation = allocation
        self.nodes = {node.name: node for node in allocation.nodes}
        self.run_dir = Path(run_dir)
        self._run = run
        self.python = python
        #: nodes where a step that lost another node may still hold its share: Slurm keeps
        #: such a step completing (and its CPUs and GPUs taken) until the allocation ends
        self.stale: set[str] = set()
        #: job id -> the group of its latest start, while anything holds it (its watcher
        #: does until it ends): a later start of the job supersedes it
        self._groups: weakref.WeakValueDictionary[str, SlurmStepGroup] = (
            weakref.WeakValueDictionary()
        )

    def record_path(self, job_id: str) -> Path:
        return self.run_dir / f"slurm-{job_id}.json"

    def _node(self, name: str) -> SlurmNode:
        try:
            return self.nodes[name]
        except KeyError:
            raise PolluxError(
                f"node {name!r} is not in Slurm job {self.allocation.job_id}"
            ) from None

    def srun_argv(self, spec: LaunchSpec) -> list[str]:
        """The ``srun`` command of one incarnation: its exact nodes and tasks per node, the
        GPUs each node's tasks share (Slurm binds them and sets ``CUDA_VISIBLE_DEVICES``), the
        rank wrapper around the job's command."""
        slots = sorted(spec.slots, key=lambda s: s.rank)
        by_node: dict[str, list[ReplicaSlot]] = {}
        for slot in slots:
            by_node.setdefault(self._node(slot.node).name, []).append(slot)
        srun = shutil.which("srun")
        if srun is None:
            raise PolluxError("`srun` not found: the Slurm launcher needs Slurm's client tools")
        argv = [
            srun,
            f"--jobid={self.allocation.job_id}",
            f"--job-name={step_name(spec)}",
            f"--nodes={len(by_node)}",
            f"--ntasks={len(slots)}",
            "--exact",
            "--kill-on-bad-exit=1",
            "--export=ALL",
            f"--chdir={spec.workdir}",
            f"--output={spec.log_dir}/rank%t.log",
            "--open-mode=append",
        ]
        if self.stale & set(by_node):
            # let the step share what the dead step of a lost node still holds there
            argv.append("--overlap")
        counts = {len(node_slots) for node_slots in by_node.values()}
        gpus = all(slot.device.startswith("cuda") for slot in slots)
        if len(counts) == 1:
            per_node = counts.pop()
            argv += [f"--nodelist={','.join(by_node)}", f"--ntasks-per-node={per_node}"]
            if gpus:
                argv.append(f"--gres=gpu:{per_node}")
        else:  # ranks placed one by one, in rank order
            argv += ["--distribution=arbitrary", f"--nodelist={','.join(s.node for s in slots)}"]
            if gpus:
                argv.append("--gpus-per-task=1")
        wrapper = RANK_WRAPPER
        if spec.umask is not None:  # the submitter's (an int: nothing of the user's in the text)
            wrapper = f"umask {int(spec.umask) & 0o777:04o} && {wrapper}"
        return [
            *argv, "/bin/sh", "-c", wrapper, "pollux-rank", str(spec.workdir), exits_prefix(spec),
            *spec.argv,
        ]  # fmt: skip

    def step_env(self, spec: LaunchSpec) -> dict[str, str]:
        """What every task gets (srun exports it): the launch environment common to all
        ranks, ``MASTER_ADDR`` rank 0's node when the step spans nodes; the per-rank
        variables come from the wrapper, ``CUDA_VISIBLE_DEVICES`` from Slurm."""
        slots = sorted(spec.slots, key=lambda s: s.rank)
        env = {
            k: v
            for k, v in replica_env(spec, slots[0]).items()
            if k not in PER_RANK_VARIABLES or k == "LOCAL_WORLD_SIZE"
        }
        per_node = {sum(1 for s in slots if s.node == slot.node) for slot in slots}
        if len(per_node) != 1:
            env.pop("LOCAL_WORLD_SIZE", None)
        if len({slot.node for slot in slots}) > 1:
            env["MASTER_ADDR"] = self._node(slots[0].node).address
        # srun works in the daemon's cluster and allocation, with the options above alone:
        # none of the variables srun reads as options (SLURM_*, SRUN_*) that the job's
        # environment kept from the shell it was submitted in (an salloc's SLURM_NTASKS, an
        # SLURM_OVERLAP, an SLURM_CONF naming another cluster); srun sets each task's own; the
        # launch contract's own (an array task's SLURM_ARRAY_TASK_ID) are the daemon's, kept
        env = {
            k: v
            for k, v in env.items()
            if not k.startswith(SRUN_INPUT_PREFIXES) or k in LAUNCH_VARIABLES  # the daemon's
        }
        if "SLURM_CONF" in os.environ:
            env["SLURM_CONF"] = os.environ["SLURM_CONF"]
        return env

    async def launch(self, spec: LaunchSpec) -> SlurmStepGroup:
        """Start ``spec`` as one job step (through its keeper)."""
        if not spec.slots:
            raise PolluxError(f"job {spec.job_id}: nothing to launch (no replica slots)")
        if spec.run_as is not None and os.geteuid() == 0:
            raise PolluxError(
                "a daemon in a Slurm allocation runs jobs as the allocation's owner; "
                f"it will not run {spec.run_as}'s job as root"
            )
        record = self.record_path(spec.job_id)
        watching = self._groups.pop(spec.job_id, None)
        if watching is not None:  # an earlier start still watched: it stops watching first
            watching.supersede()
        earlier = read_record(record)
        if earlier is not None and earlier.get("state") != "ended":
            # a start of a daemon killed before it recorded it (the job is queued again with
            # the same incarnation), or a step whose keeper died: ended before this one, never
            # left running beside it, nor its keeper's end taken for this one's (review s73)
            token = str(earlier.get("token") or "")
            name = f"pollux-{spec.job_id}.{token.rpartition(':')[2]}"
            await end_orphaned_step(self._run, earlier, name)
        record.unlink(missing_ok=True)
        srun = self.srun_argv(spec)
        order: dict[str, object] = {
            "srun": srun,
            "env": self.step_env(spec),
            "record": str(record),
            "log": str(record.with_suffix(".srun.log")),
            "token": f"{spec.job_id}:{spec.env.get('POLLUX_RESTARTS', '0')}",
            "slurm_job": self.allocation.job_id,
            "step_name": step_name(spec),
            "open_files": JOB_OPEN_FILES,
            "exits": exits_prefix(spec),
            "tasks": len(spec.slots),
        }
        log.debug("job %s: %s", spec.job_id, shlex.join(srun))
        keeper = await asyncio.create_subprocess_exec(
            self.python, str(KEEPER), stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
            start_new_session=True, cwd="/",
        )  # fmt: skip
        assert keeper.stdin is not None
        keeper.stdin.write(json.dumps(order).encode() + b"\n")
        await keeper.stdin.drain()
        keeper.stdin.close()
        asyncio.ensure_future(keeper.wait())  # reaped when it ends
        try:
            started: float | None = psutil.Process(keeper.pid).create_time()
        except psutil.Error:
            started = None
        group = SlurmStepGroup(spec, record, keeper.pid, started, self._run, self.stale)
        self._groups[spec.job_id] = group
        return group

    async def recover(self, spec: LaunchSpec, token: str) -> SlurmStepGroup | None:
        """The incarnation ``token`` of a job recorded as running when the daemon stopped,
        from its keeper's record; ``None`` when there is none, or when it was a step of
        another allocation (the job is queued again and resumes from its checkpoint)."""
        record = read_record(self.record_path(spec.job_id))
        if record is None or record.get("token") != token:
            return None
        if str(record.get("slurm_job")) != self.allocation.job_id:
            # a step of an earlier allocation (its walltime ended, or it was cancelled): it
            # is over with that allocation, or is ended now; the job is queued again
            if record.get("state") != "ended" and record.get("step"):
                with contextlib.suppress(PolluxError):
                    await asyncio.to_thread(self._run, ["scancel", str(record["step"])])
            log.info(
                "job %s: its step %s belonged to Slurm job %s, not this allocation",
                spec.job_id, record.get("step"), record.get("slurm_job"),
            )  # fmt: skip
            self.record_path(spec.job_id).unlink(missing_ok=True)
            return None
        pid = int(record.get("keeper_pid") or 0)
        started = float(record["started"]) if record.get("started") else None
        path = self.record_path(spec.job_id)
        group = SlurmStepGroup(spec, path, pid, started, self._run, self.stale)
        self._groups[spec.job_id] = group
        return group

    async def check_node(self, node: str) -> NodeHealth:
        """Up unless Slurm reports the node down, failed or not responding."""
        devices = list(self._node(node).devices)
        try:
            state = await asyncio.to_thread(node_state, node, self._run)
        except PolluxError as exc:
            return NodeHealth(node=node, reachable=False, error=str(exc))
        if node_lost(state):
            return NodeHealth(node=node, reachable=False, error=f"Slurm reports it {state}")
        return NodeHealth(node=node, reachable=True, devices=devices)

    async def close(self) -> None:
        """Nothing to close: the steps run on under their keepers."""
