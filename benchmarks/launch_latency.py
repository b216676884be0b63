"""Launch latency on this machine vs over SSH, and the time to detect a dead node and resume.

Needs root (it builds the namespace test bed of tests/multinode/testbed.py).  Prints figures:

    OMP_NUM_THREADS=1 python benchmarks/launch_latency.py [--reps 10]

* launch round trip: ``launch()`` of a replica running ``true`` until the group reports its
  exit, through the local launcher, over SSH with a fresh login (no shared connection), and
  over SSH through the shared connection (the daemon's normal case);
* dead node: a two-host gloo job; one host's link is cut; time until the group reports the node
  unreachable (exit 255), and until the job, relaunched from its checkpoint on the other host,
  has taken its first step again.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests" / "multinode"))

from testbed import Testbed, missing_requirements  # noqa: E402

from pollux_local.launch.base import LaunchSpec, ReplicaSlot  # noqa: E402
from pollux_local.launch.local import LocalLauncher  # noqa: E402
from pollux_local.launch.ssh import SshLauncher, SshNodeConfig  # noqa: E402

JOB = REPO / "tests" / "multinode" / "gloo_job.py"


def spec_for(
    node: str, workdir: Path, argv: list[str], env: dict[str, str], job: str
) -> LaunchSpec:
    return LaunchSpec(
        job_id=job,
        argv=argv,
        workdir=workdir,
        env=env,
        slots=[ReplicaSlot(0, node, "cpu:0", 0, 0)],
        log_dir=workdir / "logs" / job,
    )


async def round_trip(launcher: object, spec: LaunchSpec) -> float:
    start = time.perf_counter()
    group = await launcher.launch(spec)  # type: ignore[attr-defined]
    code = await asyncio.wait_for(group.wait(), 60)
    if code != 0:
        raise RuntimeError(f"replica exited with {code}")
    return time.perf_counter() - start


def summary(samples: list[float]) -> str:
    ms = sorted(1000 * s for s in samples)
    return f"median {statistics.median(ms):7.1f} ms   min {ms[0]:7.1f}   max {ms[-1]:7.1f}   (n={len(ms)})"


async def latency(bed: Testbed, ssh: SshLauncher, work: Path, reps: int) -> None:
    env = {"PATH": "/usr/bin:/bin"}
    host = bed.hosts[0].name
    local = LocalLauncher({"local": ["cpu:0"]})
    local_s = [
        await round_trip(local, spec_for("local", work, ["true"], env, f"l{i}"))
        for i in range(reps)
    ]
    cold_s = []
    for i in range(max(3, reps // 3)):
        await ssh.close()
        cold_s.append(await round_trip(ssh, spec_for(host, work, ["true"], env, f"c{i}")))
    warm_s = [
        await round_trip(ssh, spec_for(host, work, ["true"], env, f"w{i}")) for i in range(reps)
    ]
    print("launch round trip (start a replica running `true`, see it exit):")
    print(f"  local                    {summary(local_s)}")
    print(f"  ssh, fresh login         {summary(cold_s)}")
    print(f"  ssh, shared connection   {summary(warm_s)}")


async def dead_node(bed: Testbed, ssh: SshLauncher, work: Path, reps: int) -> None:
    h1, h2 = bed.hosts
    detect_s, end_s, resume_s = [], [], []
    for rep in range(reps):
        ckpt = work / f"dead{rep}" / "ckpt"
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "PYTHONPATH": str(REPO),
            "OMP_NUM_THREADS": "1",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(29700 + rep),
            "POLLUX_CHECKPOINT_DIR": str(ckpt),
            "POLLUX_PG_TIMEOUT_S": "20",
        }
        argv = [sys.executable, str(JOB), "--steps", "100000", "--step-sleep", "0.05"]
        spec = LaunchSpec(
            job_id=f"dead{rep}",
            argv=argv,
            workdir=work,
            env=env,
            slots=[ReplicaSlot(0, h1.name, "cpu:0", 0, 0), ReplicaSlot(1, h2.name, "cpu:0", 0, 1)],
            log_dir=work / "logs" / f"dead{rep}",
        )
        group = await ssh.launch(spec)
        while not (ckpt / "model.pt").exists():
            await asyncio.sleep(0.2)
        await asyncio.sleep(1.0)
        bed.cut_link(h2)
        cut = time.perf_counter()
        cut_mono = time.monotonic()
        try:
            code = await asyncio.wait_for(group.wait(), 120)
            ended = time.perf_counter() - cut
            assert code == 255 and group.failed_at is not None, code
            detected = group.failed_at - cut_mono
            resumed_spec = spec_for(
                h1.name, work, argv, dict(env, MASTER_PORT=str(29750 + rep)), f"dead{rep}"
            )
            resumed = await ssh.launch(resumed_spec)
            marker = ckpt / "incarnations.jsonl"
            while len(marker.read_text().splitlines()) < 2:
                await asyncio.sleep(0.05)
            resumed_after = time.perf_counter() - cut
            await resumed.stop(10)
            first, second = (json.loads(x) for x in marker.read_text().splitlines()[:2])
            assert second["start_step"] > 0 and second["world"] == 1, (first, second)
        finally:
            bed.restore_link(h2)
        detect_s.append(detected)
        end_s.append(ended)
        resume_s.append(resumed_after)
        await ssh.close()
    print(
        f"dead node (link cut; ssh keepalive {ssh.alive_interval_s} s x {ssh.alive_count_max}, "
        f"bound {ssh.detect_dead_link_s} s):"
    )
    print(f"  cut -> node unreachable  {summary(detect_s)}")
    print(
        f"  cut -> group ended (255) {summary(end_s)}   (+ up to {ssh.failure_grace_s:g} s"
        " for the surviving ranks to stop)"
    )
    print(f"  cut -> resumed, stepping {summary(resume_s)}   (includes `import torch`)")


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--dead-reps", type=int, default=2)
    args = parser.parse_args()
    reason = missing_requirements()
    if reason:
        print(f"skipped: {reason}")
        return 0
    with Testbed(2) as bed, tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        nodes = [
            SshNodeConfig(
                name=h.name,
                host=h.name,
                address=h.address,
                gloo_ifname=h.ifname,
                ssh_options=bed.ssh_options(),
                workdir=str(work / f"node-{h.name}"),
                python="/usr/bin/python3",  # root's `python3` here is a slow pyenv shim
            )
            for h in bed.hosts
        ]
        ssh = SshLauncher(nodes, control_dir=bed.dir / "ctl")
        await latency(bed, ssh, work, args.reps)
        await dead_node(bed, ssh, work, args.dead_reps)
        await ssh.close()
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
