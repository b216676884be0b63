"""A real Slurm cluster on this machine: ``slurmctld`` in the root namespace, one ``slurmd``
per network namespace (the namespaces of the SSH test bed, ``tests/multinode/testbed.py``),
GPUs as gres backed by fake device nodes.

``python3 tests/slurm/bed.py up|down`` (what ``scripts/slurm-testbed-up``/``-down`` run, as
root).  After ``up``, ``/etc/slurm/slurm.conf`` describes the cluster, so ``sinfo``,
``salloc -N 2`` and ``srun`` work from a root shell without extra environment; ``down`` stops
every daemon it started, deletes the namespaces and removes the config it wrote.

Layout: the namespaces are ``slurmb-h1``, ``slurmb-h2`` (hostnames and Slurm node names the
same), addresses ``10.217.0.11``/``.12``; the controller listens on ``10.217.0.1`` in the root
namespace (this machine's hostname), where ``srun`` runs too.  Each node declares 2 CPUs and
``gpu:testgpu:2`` (``gres.conf`` ``File=`` names two ``c 1 3`` device nodes: /dev/null twins,
so Slurm counts and binds them and sets ``CUDA_VISIBLE_DEVICES``; nothing can compute on them).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "multinode"))
import testbed  # noqa: E402  (the namespaces of the SSH test bed)

TAG = "slurmb"  # namespaces slurmb-h1.., links slurmb-*; removed by remove_leftovers("sl")
LEFTOVER_PREFIX = "sl"
SUBNET = "10.217.0"  # not the SSH bed's: both may be up at once
RUN = Path("/run/pollux-slurm-testbed")
CONF_DIR = Path("/etc/slurm")
MARK = "# written by pollux-local's scripts/slurm-testbed-up\n"
GPU_TYPE = "testgpu"
GPUS_PER_NODE = 2
N_NODES = 2
#: What ``up`` leaves for the tests: the node names, addresses, interface, GPU type.
INFO = RUN / "bed.json"


def _run(*argv: str, check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        said = (proc.stderr.strip() or proc.stdout.strip())[-400:]
        raise RuntimeError(f"{' '.join(argv[:6])} exited with {proc.returncode}: {said}")
    return proc


def _kill_pidfile(path: Path) -> None:
    with contextlib.suppress(OSError, ValueError):
        pid = int(path.read_text().split()[0])
        os.kill(pid, 15)
        for _ in range(50):
            os.kill(pid, 0)
            time.sleep(0.1)
        os.kill(pid, 9)


def _munge_works() -> bool:
    proc = subprocess.run(
        "munge -n | unmunge", shell=True, capture_output=True, text=True, timeout=10
    )
    return proc.returncode == 0


def start_munge() -> None:
    """A munge key (owner munge, 0400) and a running ``munged``."""
    key = Path("/etc/munge/munge.key")
    if not key.exists():
        _run("mungekey", "-c", "-k", str(key))
    shutil.chown(key, "munge", "munge")
    key.chmod(0o400)
    for folder in (Path("/run/munge"), Path("/var/lib/munge"), Path("/var/log/munge")):
        folder.mkdir(parents=True, exist_ok=True)
        shutil.chown(folder, "munge", "munge")
    Path("/run/munge").chmod(0o755)
    if _munge_works():
        return
    _run("runuser", "-u", "munge", "--", "/usr/sbin/munged", "--force")
    (RUN / "munged-started").touch()  # down stops it again
    for _ in range(50):
        if _munge_works():
            return
        time.sleep(0.1)
    raise RuntimeError("munged does not answer (see /var/log/munge/munged.log)")


def write_config(hosts: list[testbed.TestHost]) -> None:
    for name in ("slurm.conf", "gres.conf"):
        path = CONF_DIR / name
        if path.exists() and not path.read_text(errors="replace").startswith(MARK):
            raise RuntimeError(f"{path} is not the test bed's: this machine has a Slurm of its own")
    controller = socket.gethostname().split(".")[0]
    nodes = "\n".join(
        f"NodeName={h.name} NodeAddr={h.address} CPUs=2 RealMemory=2000"
        f" Gres=gpu:{GPU_TYPE}:{GPUS_PER_NODE} State=UNKNOWN"
        for h in hosts
    )
    (CONF_DIR / "slurm.conf").write_text(
        MARK
        + f"""ClusterName=pollux
SlurmctldHost={controller}({SUBNET}.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
MpiDefault=none
ProctrackType=proctrack/pgid
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
GresTypes=gpu
SchedulerType=sched/backfill
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
ReturnToService=2
SlurmdTimeout=10
SlurmctldTimeout=10
MessageTimeout=5
InactiveLimit=0
KillWait=5
MinJobAge=60
StateSaveLocation={RUN}/ctld
SlurmdSpoolDir={RUN}/spool/%n
SlurmctldPidFile={RUN}/slurmctld.pid
SlurmdPidFile={RUN}/slurmd-%n.pid
SlurmctldLogFile={RUN}/slurmctld.log
SlurmdLogFile={RUN}/slurmd-%n.log
{nodes}
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""
    )
    (CONF_DIR / "gres.conf").write_text(
        MARK
        + "".join(
            f"NodeName={h.name} Name=gpu Type={GPU_TYPE}"
            f" File={RUN}/dev/gpu[0-{GPUS_PER_NODE - 1}]\n"
            for h in hosts
        )
    )


def start_slurmd(name: str, netns: str) -> None:
    """``slurmd -N NAME`` (it daemonizes) in the node's network namespace, with its own
    hostname.  ``nsenter --net``, not ``ip netns exec``: the latter mounts a fresh /sys,
    without the cgroup filesystems slurmd's start-up needs."""
    _run(
        "nsenter", f"--net=/run/netns/{netns}", "unshare", "--uts", "sh", "-c",
        f"hostname {name}; exec slurmd -N {name}",
    )  # fmt: skip


def _wait_idle(names: list[str], timeout_s: float = 25) -> None:
    deadline = time.monotonic() + timeout_s
    states: dict[str, str] = {}
    resumed = False
    while time.monotonic() < deadline:
        out = _run("sinfo", "-h", "-N", "-o", "%N %T", check=False, timeout=10).stdout
        states = dict(line.split(None, 1) for line in out.splitlines() if " " in line)
        if all(states.get(n, "").rstrip("*") == "idle" for n in names):
            return
        if not resumed and all(states.get(n) for n in names) and time.monotonic() > deadline - 20:
            for name in names:
                if states.get(name, "").startswith(("down", "drain", "inval")):
                    _run("scontrol", "update", f"nodename={name}", "state=resume", check=False)
                    resumed = True
        time.sleep(0.3)
    raise RuntimeError(f"Slurm nodes not idle after {timeout_s:g} s: {states}")


def up() -> float:
    """Build the cluster; returns the seconds it took."""
    started = time.monotonic()
    down(quiet=True)
    bed = testbed.Testbed(n_hosts=N_NODES, tag=TAG, subnet=SUBNET)
    shutil.rmtree(bed.dir, ignore_errors=True)  # only its namespaces are used
    try:
        bed._network()
        for sub in ("ctld", "spool", "dev"):
            (RUN / sub).mkdir(parents=True, exist_ok=True)
        for i in range(GPUS_PER_NODE):
            os.mknod(RUN / "dev" / f"gpu{i}", 0o666 | 0o020000, os.makedev(1, 3))
        CONF_DIR.mkdir(parents=True, exist_ok=True)
        write_config(bed.hosts)
        start_munge()
        _run("slurmctld", "-i")
        for host in bed.hosts:
            (RUN / "spool" / host.name).mkdir(parents=True, exist_ok=True)
            start_slurmd(host.name, host.netns)
        _wait_idle([h.name for h in bed.hosts])
    except BaseException:
        down(quiet=True)
        raise
    INFO.write_text(
        json.dumps(
            {
                "nodes": [h.name for h in bed.hosts],
                "addresses": {h.name: h.address for h in bed.hosts},
                "netns": {h.name: h.netns for h in bed.hosts},
                "ifname": bed.hosts[0].ifname,
                "gpu_type": GPU_TYPE,
                "gpus_per_node": GPUS_PER_NODE,
            }
        )
    )
    return time.monotonic() - started


def down(quiet: bool = False) -> list[str]:
    """Stop what ``up`` started and remove what it made (also after a crashed run)."""
    removed: list[str] = []
    for pidfile in sorted(RUN.glob("slurmd-*.pid")):
        _kill_pidfile(pidfile)
        removed.append(pidfile.stem)
    if (RUN / "slurmctld.pid").exists():
        _kill_pidfile(RUN / "slurmctld.pid")
        removed.append("slurmctld")
    removed += testbed.remove_leftovers(LEFTOVER_PREFIX)
    if (RUN / "munged-started").exists():
        _kill_pidfile(Path("/run/munge/munged.pid"))
        removed.append("munged")
    for name in ("slurm.conf", "gres.conf"):
        path = CONF_DIR / name
        with contextlib.suppress(OSError):
            if path.read_text().startswith(MARK):
                path.unlink()
                removed.append(str(path))
    if RUN.exists():
        shutil.rmtree(RUN, ignore_errors=True)
        removed.append(str(RUN))
    if not quiet:
        print("slurm-testbed-down: removed", " ".join(removed) if removed else "nothing")
    return removed


def info() -> dict[str, object] | None:
    """What ``up`` recorded, or ``None`` when the test bed is not up."""
    try:
        data: dict[str, object] = json.loads(INFO.read_text())
    except (OSError, ValueError):
        return None
    return data


if __name__ == "__main__":
    if sys.argv[1:] == ["up"]:
        print(f"slurm-testbed-up: ready in {up():.1f} s")
    elif sys.argv[1:] == ["down"]:
        down()
    else:
        sys.exit("usage: bed.py up|down")
