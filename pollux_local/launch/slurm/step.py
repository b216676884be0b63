"""A job incarnation running as one Slurm job step (:class:`SlurmStepGroup`), watched through
the record its keeper writes (``keeper.py``): the same object serves a step this daemon
started and one a restarted daemon finds running."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import psutil

from pollux_local.api.states import ExitCode
from pollux_local.errors import PolluxError
from pollux_local.launch.base import LaunchSpec, incarnation, settles
from pollux_local.launch.slurm.allocation import Runner, node_lost, node_state
from pollux_local.launch.slurm.keeper import group_code, recorded_exits

log = logging.getLogger("pollux_local.launch.slurm")

#: How often a step's record is read while it runs.
POLL_S = 0.25
#: How long a stop waits after ``scancel`` of the step for its end (beyond Slurm's KillWait).
KILL_WAIT_S = 40.0


def exits_prefix(spec: LaunchSpec, number: int | None = None) -> str:
    """Where each task of the incarnation writes how it ended (``PREFIX<rank>``: its code,
    one line), in the job's log directory, as the user: read by the keeper when srun names
    no task but does not end 0 (``keeper.recorded_exits``), and by the daemon when the
    keeper is gone without the step's end (:meth:`SlurmStepGroup._keeper_gone`).
    ``number``: the incarnation's (``spec``'s by default)."""
    number = incarnation(spec) if number is None else number
    return f"{spec.log_dir}/.exit-{number}-rank"


def read_record(path: Path) -> dict[str, Any] | None:
    """A keeper's record, or ``None`` when there is none (or it cannot be read)."""
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and record.get("version") == 1 else None


def _alive(pid: int, since: float | None) -> bool:
    """Whether ``pid`` still runs and is the process started at ``since`` (not a reused pid)."""
    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE:
            return False
        return since is None or abs(proc.create_time() - since) < 2.0
    except psutil.Error:
        return False


async def end_orphaned_step(run: Runner, record: Mapping[str, Any] | None, name: str) -> None:
    """End what a keeper that is gone (SIGKILLed, the OOM killer) or no longer watched (a
    start a killed daemon never recorded) left running: its ``srun`` (in the keeper's session,
    not ended with it) and the step called ``name``; the step waited for (``KILL_WAIT_S``).
    Else the job's next start ran beside it, on the same checkpoint, its keeper's end was
    taken for the next incarnation's, or a job recorded as failed kept its devices (review
    s73)."""
    record = record or {}
    keeper = int(record.get("keeper_pid") or 0)
    started = float(record.get("started") or 0.0)
    if keeper > 0 and _alive(keeper, started or None):
        with contextlib.suppress(OSError):
            if os.getpgid(keeper) == keeper:  # it leads its session: srun is in its group
                os.killpg(keeper, signal.SIGKILL)
    srun_pid = int(record.get("srun_pid") or 0)
    if srun_pid > 0:  # before the look-up, so that it cannot make the step after it
        with contextlib.suppress(psutil.Error):
            proc = psutil.Process(srun_pid)
            if (  # that srun, not another step's given its pid since
                proc.name() == "srun"
                and proc.create_time() >= started - 2.0
                and f"--job-name={name}" in proc.cmdline()
            ):
                proc.kill()
    slurm_job = str(record.get("slurm_job") or "")
    deadline = time.monotonic() + KILL_WAIT_S
    while slurm_job.isdigit() and time.monotonic() < deadline:
        try:
            out = await asyncio.to_thread(
                run, ["squeue", "-h", "-s", "-j", slurm_job, "-o", "%i %j"]
            )
        except PolluxError as exc:
            if "invalid job id" in str(exc).lower() or "not found" in str(exc):
                return  # the allocation is gone, and its steps with it (or no Slurm here)
            # a loaded slurmctld that did not answer (a socket timeout): asked again, never
            # taken for "no such step" (the next start then ran beside it)
            log.info("step %s of Slurm job %s: asked again: %s", name, slurm_job, exc)
            await asyncio.sleep(1.0)
            continue
        steps = [
            parts[0]
            for line in out.splitlines()
            if len(parts := line.split(None, 1)) == 2 and parts[1].strip() == name
        ]
        if not steps:
            return
        for step in steps:
            with contextlib.suppress(PolluxError):
                await asyncio.to_thread(run, ["scancel", step])
        await asyncio.sleep(1.0)
    log.warning("step %s of Slurm job %s did not end", name, slurm_job)


class SlurmStepGroup:
    """One incarnation as a Slurm job step (see :class:`ReplicaGroup`)."""

    def __init__(
        self,
        spec: LaunchSpec,
        record_path: Path,
        keeper_pid: int,
        keeper_started: float | None,
        run: Runner,
        stale: set[str] | None = None,
    ) -> None:
        self.spec = spec
        self.record_path = record_path
        self.keeper_pid = keeper_pid
        self.keeper_started = keeper_started
        self._run = run
        #: the launcher's nodes where a step that lost a node may still hold resources
        self._stale = stale if stale is not None else set()
        self._code: int | None = None
        self._codes: dict[int, int] = {}
        #: the step's nodes Slurm reported lost when it ended (a task's own exit code, 255
        #: included, is the job's)
        self._lost: set[str] = set()
        #: One line explaining why the group failed, when it did (a lost node, ...).
        self.failure_reason: str | None = None
        self.failed_at: float | None = None
        self.started_at = time.monotonic()
        self._done = asyncio.Event()
        self._watcher = asyncio.ensure_future(self._watch())

    # -- watching --------------------------------------------------------------------------
    def supersede(self) -> None:
        """The job is being started again while this group still watches (a later start of
        the same incarnation writes the same record): this group ends as lost, its watcher
        stopped, touching nothing.  The later start ends what this one left
        (:func:`end_orphaned_step`); watched on, its keeper's end taken for lost would have
        ended the later start's step and keeper, both found by the record and step name
        they share."""
        if self._done.is_set():
            return
        if self._watcher is not asyncio.current_task():  # not when it found that itself
            self._watcher.cancel()
        self.failure_reason = "the job was started again while this start was watched"
        self._finish(int(ExitCode.NODE_LOST), {})

    def _own(self, record: Mapping[str, Any] | None) -> bool:
        """Whether ``record`` is this group's keeper's (not a later start's)."""
        return record is None or int(record.get("keeper_pid") or 0) in (0, self.keeper_pid)

    async def _watch(self) -> None:
        missing_since: float | None = None
        while True:
            record = read_record(self.record_path)
            if not self._own(record):
                self.supersede()
                return
            if record is not None and record.get("state") == "ended":
                await self._ended(record)
                break
            if not _alive(self.keeper_pid, self.keeper_started):
                # the keeper may have written its end just now
                record = read_record(self.record_path)
                if not self._own(record):
                    self.supersede()
                    return
                if record is not None and record.get("state") == "ended":
                    await self._ended(record)
                    break
                missing_since = missing_since or time.monotonic()
                if time.monotonic() - missing_since > 2.0:
                    await self._keeper_gone(record)
                    break
            await asyncio.sleep(POLL_S)

    async def _keeper_gone(self, record: Mapping[str, Any] | None) -> None:
        """The keeper is gone without the step's end (SIGKILLed, a power cut): what it left
        is ended (:func:`end_orphaned_step`).  Where every task had written its own end
        before (read first: not one that the ending caused), those ends are the result
        (:func:`~pollux_local.launch.base.settles`, the rule every launcher's recovery
        shares): a keeper killed between the step's end and its record lost the result of
        a job that had finished, taken for a lost step (255) and run again.  Otherwise the
        step counts as lost."""
        # the keeper's incarnation (a restarted daemon's spec names the job's next one)
        tail = str((record or {}).get("token") or "").rpartition(":")[2]
        number = int(tail) if tail.isdigit() else incarnation(self.spec)
        prefix = exits_prefix(self.spec, number)
        recorded = await asyncio.to_thread(recorded_exits, prefix, len(self.spec.slots))
        name = f"pollux-{self.spec.job_id}.{number}"
        await end_orphaned_step(self._run, record, name)
        if recorded is not None and settles((record or {}).get("state"), True, False):
            codes = {rank: code for rank, code in recorded.items() if code != 0}
            order = sorted(codes)
            log.info("job %s: its keeper died after its step's end: its tasks' ends taken",
                     self.spec.job_id)  # fmt: skip
            await self._ended(
                {"exit_code": group_code(codes, order, 0), "ranks": codes, "order": order}
            )
            return
        self.failure_reason = "the step's keeper ended without recording its end"
        self._finish(int(ExitCode.NODE_LOST), {})

    async def _ended(self, record: Mapping[str, Any]) -> None:
        codes = {int(rank): int(code) for rank, code in dict(record.get("ranks") or {}).items()}
        code = int(record.get("exit_code", ExitCode.NODE_LOST))
        if codes or code == 0:  # srun reports the ranks that did not exit 0
            for slot in self.spec.slots:
                codes.setdefault(slot.rank, 0)
        if record.get("failure"):
            self.failure_reason = str(record["failure"])
        if code not in (0, ExitCode.RESCALE):
            lost = await asyncio.to_thread(self._lost_nodes)
            if lost:
                self._lost = set(lost)
                for slot in self.spec.slots:
                    if slot.node in lost:
                        codes[slot.rank] = int(ExitCode.NODE_LOST)
                code = int(ExitCode.NODE_LOST)
                self._stale.update(s.node for s in self.spec.slots if s.node not in lost)
                self.failure_reason = "Slurm reports node(s) " + ", ".join(
                    f"{name} {state}" for name, state in lost.items()
                )
            elif self.failure_reason is None:
                failing = [r for r in record.get("order", ()) if codes.get(int(r)) == code]
                rank = int(failing[0]) if failing else None
                where = next((s.node for s in self.spec.slots if s.rank == rank), "?")
                self.failure_reason = (
                    f"rank {rank} on node {where} ended with {code}"
                    if rank is not None
                    else f"srun ended with {record.get('srun_code')}"
                )
        self._finish(code, codes)

    def _lost_nodes(self) -> dict[str, str]:
        """The step's nodes Slurm reports down, failed or not responding (name -> state)."""
        lost: dict[str, str] = {}
        for name in dict.fromkeys(slot.node for slot in self.spec.slots):
            try:
                state = node_state(name, self._run)
            except PolluxError:
                continue
            if node_lost(state):
                lost[name] = state
        return lost

    def _finish(self, code: int, codes: dict[int, int]) -> None:
        self._codes = codes
        self._code = code
        if code not in (0, ExitCode.RESCALE):
            self.failed_at = time.monotonic()
        self._done.set()

    # -- the ReplicaGroup interface ---------------------------------------------------------
    def poll(self) -> int | None:
        return self._code if self._done.is_set() else None

    def exit_codes(self) -> dict[int, int]:
        """rank -> status (``-N``: signal N) of every rank, once the step has ended."""
        return dict(self._codes)

    def lost_nodes(self) -> set[str]:
        """The step's nodes Slurm reported down, failed or not responding when it ended."""
        return set(self._lost)

    def unanswered_nodes(self) -> set[str]:
        """None: Slurm says what became of every node."""
        return set()

    async def wait(self) -> int:
        await self._done.wait()
        assert self._code is not None
        return self._code

    async def _wait_for(self, timeout_s: float) -> bool:
        try:
            await asyncio.wait_for(asyncio.shield(self._done.wait()), max(timeout_s, 0.0))
        except TimeoutError:
            return False
        return True

    async def _step_id(self, timeout_s: float) -> str | None:
        deadline = time.monotonic() + timeout_s
        while not self._done.is_set():
            record = read_record(self.record_path)
            if record is not None and record.get("step"):
                return str(record["step"])
            if time.monotonic() > deadline:
                return None
            await asyncio.sleep(POLL_S)
        return None

    async def _scancel(self, *args: str) -> None:
        with contextlib.suppress(PolluxError):
            await asyncio.to_thread(self._run, ["scancel", *args])

    async def stop(self, grace_s: float) -> int | None:
        """``scancel --signal=TERM`` of the step (a checkpoint and exit 75), ``scancel`` of
        it ``grace_s`` later (Slurm then kills what is left after its KillWait)."""
        if self._done.is_set():
            return await self.wait()
        step = await self._step_id(10.0)
        # the keeper is signalled only while it is the process started then (its pid, after a
        # daemon's restart, may be another's now), its group as long as it leads it
        if step is None and not self._done.is_set() and self._keeper_alive():
            # srun has not made its step yet: its keeper forwards SIGTERM to it
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(self.keeper_pid, signal.SIGTERM)
        elif step is not None:
            await self._scancel("--signal=TERM", step)
        if await self._wait_for(grace_s):
            return await self.wait()
        if step is not None:
            await self._scancel(step)
        elif self._keeper_alive():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.keeper_pid, signal.SIGKILL)
        if await self._wait_for(KILL_WAIT_S):
            return await self.wait()
        return None

    def _keeper_alive(self) -> bool:
        return _alive(self.keeper_pid, self.keeper_started)

    def pids(self) -> Mapping[int, int]:
        """rank -> pid: the ranks run on Slurm's nodes, out of sight; none known."""
        return {}

    async def forget(self) -> None:
        """Remove the keeper's record and srun's log (the end is in the daemon's store)."""
        self.record_path.unlink(missing_ok=True)
        self.record_path.with_suffix(".srun.log").unlink(missing_ok=True)
