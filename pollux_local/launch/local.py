"""Run a job's replicas as processes of this machine.

Each incarnation's replicas share one new process group (so a stop reaches any helper
processes they fork), write stdout+stderr to ``log_dir/rank<rank>.log`` directly (so they
outlive the daemon), and get the torchrun variables plus ``CUDA_VISIBLE_DEVICES`` for GPUs.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Mapping, Sequence

from pollux_local.api.launch import replica_environ
from pollux_local.launch.base import (
    RESCALE_EXIT_CODE,
    LaunchSpec,
    NodeHealth,
    ReplicaGroup,
    ReplicaSlot,
)


def replica_env(spec: LaunchSpec, slot: ReplicaSlot) -> dict[str, str]:
    """The environment of one replica: the spec's common env plus the per-rank variables
    (``api.launch.replica_environ``: torchrun's whole contract)."""
    same_node = [other for other in spec.slots if other.node == slot.node]
    kind, _, index = slot.device.partition(":")
    common = {**spec.env, "WORLD_SIZE": str(len(spec.slots))}
    return replica_environ(
        common,
        rank=slot.rank,
        local_rank=slot.local_rank,
        node_rank=slot.node_rank,
        local_world_size=len(same_node),
        device="cuda" if kind == "cuda" else "cpu",
        device_index=index if kind == "cuda" else None,
    )


def combine_exit_codes(codes_in_exit_order: Sequence[int]) -> int:
    """A group's exit code: 0 if all succeeded, the first failure's code if any replica
    failed (neither 0 nor 75), else 75 (all checkpointed for a rescale)."""
    for code in codes_in_exit_order:
        if code not in (0, RESCALE_EXIT_CODE):
            return code
    if any(code == RESCALE_EXIT_CODE for code in codes_in_exit_order):
        return RESCALE_EXIT_CODE
    return 0


class LocalReplicaGroup:
    """The replicas of one incarnation running on this machine."""

    #: After one replica fails, how long the others get to stop before being killed.
    FAILURE_GRACE_S = 5.0

    def __init__(
        self, spec: LaunchSpec, procs: list[tuple[ReplicaSlot, asyncio.subprocess.Process]]
    ):
        self.spec = spec
        self._procs = procs
        self.pgid = procs[0][1].pid
        self.started = time.time()
        self._codes: list[int] = []
        self._done = asyncio.Event()
        self._stopping = False
        self._watchers = [asyncio.ensure_future(self._watch(proc)) for _, proc in procs]

    async def _watch(self, proc: asyncio.subprocess.Process) -> None:
        code = await proc.wait()
        self._codes.append(code)
        if code not in (0, RESCALE_EXIT_CODE) and not self._stopping:
            # A crashed replica leaves its peers blocked in collectives: stop them.
            asyncio.ensure_future(self.stop(self.FAILURE_GRACE_S))
        if len(self._codes) == len(self._procs):
            self._done.set()

    def poll(self) -> int | None:
        if not self._done.is_set():
            return None
        return combine_exit_codes(self._codes)

    async def wait(self) -> int:
        await self._done.wait()
        return combine_exit_codes(self._codes)

    def _signal_group(self, signum: int) -> None:
        """Signal the job's process group once (a second SIGTERM could land while a replica
        is already exiting after its checkpoint); each replica directly only if that fails."""
        try:
            os.killpg(self.pgid, signum)
            return
        except (ProcessLookupError, PermissionError):
            pass
        for _, proc in self._procs:
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signum)

    async def stop(self, grace_s: float) -> int:
        if self._done.is_set():
            return combine_exit_codes(self._codes)
        self._stopping = True
        self._signal_group(signal.SIGTERM)
        try:
            await asyncio.wait_for(asyncio.shield(self._done.wait()), grace_s)
        except TimeoutError:
            self._signal_group(signal.SIGKILL)
            await self._done.wait()
        return combine_exit_codes(self._codes)

    def pids(self) -> Mapping[int, int]:
        return {slot.rank: proc.pid for slot, proc in self._procs}


class LocalLauncher:
    """Starts replica groups on this machine."""

    def __init__(self, devices: Mapping[str, Sequence[str]] | None = None) -> None:
        self.devices = dict(devices or {})

    async def launch(self, spec: LaunchSpec) -> ReplicaGroup:
        spec.log_dir.mkdir(parents=True, exist_ok=True)
        user_kwargs: dict[str, object] = {}
        if spec.run_as is not None and os.geteuid() == 0:
            import pwd

            entry = pwd.getpwnam(spec.run_as)
            user_kwargs = {
                "user": entry.pw_uid,
                "group": entry.pw_gid,
                "extra_groups": os.getgrouplist(spec.run_as, entry.pw_gid),
            }
        procs: list[tuple[ReplicaSlot, asyncio.subprocess.Process]] = []
        pgid = 0
        try:
            for slot in sorted(spec.slots, key=lambda s: s.rank):
                log_path = spec.log_dir / f"rank{slot.rank}.log"
                with open(log_path, "ab", buffering=0) as log:
                    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
                    restarts = spec.env.get("POLLUX_RESTARTS", "0")
                    log.write(
                        f"--- {stamp} start #{restarts}: rank {slot.rank}/{len(spec.slots)}"
                        f" on {slot.node} {slot.device}\n".encode()
                    )
                    if user_kwargs and "user" in user_kwargs:
                        with contextlib.suppress(OSError):
                            os.chown(log_path, int(user_kwargs["user"]), -1)  # type: ignore[call-overload]
                    proc = await asyncio.create_subprocess_exec(
                        *spec.argv,
                        cwd=str(spec.workdir),
                        env=replica_env(spec, slot),
                        stdin=asyncio.subprocess.DEVNULL,
                        stdout=log,
                        stderr=asyncio.subprocess.STDOUT,
                        process_group=pgid,
                        **user_kwargs,  # type: ignore[arg-type]
                    )
                if pgid == 0:
                    pgid = proc.pid
                procs.append((slot, proc))
        except BaseException:
            for _, proc in procs:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
            raise
        return LocalReplicaGroup(spec, procs)

    async def check_node(self, node: str) -> NodeHealth:
        return NodeHealth(
            node=node,
            reachable=True,
            devices=tuple(self.devices.get(node, ())),
            load=os.getloadavg()[0],
        )
