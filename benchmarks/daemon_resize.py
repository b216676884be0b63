"""Resizes through a real daemon, in place and by checkpoint-restart, as the daemon measures
them (``daemon/resizes.py``: from its ask, or for a warm resize its order, to the job's
first step at the new size).

Each run starts a daemon of the working tree on ``cpu:2`` (``[scheduler] warm_resize`` on or
off, a pass every second), submits an elastic probe job (``pollux_local.torch.probe``: total
batch fixed at 32, a sleep per sample so that two replicas step twice as fast) that the
policy gives both devices, then ``--cycles`` times submits a short job (the policy shrinks the
probe to one device for it) and waits until it has ended (the probe grows back).  Warm and
cold runs alternate (``--rounds`` of each).  Printed per run: the daemon's median downtime of
the job's newest resizes (it keeps 8 of each kind) and how many there were.

    OMP_NUM_THREADS=1 python benchmarks/daemon_resize.py --cycles 5 --rounds 2

With ``--ssh`` (as root, with ``scripts/testbed-up`` done) the two devices are those of an SSH
node instead: a network-namespace host of the test bed (``tests/multinode/testbed.py``), so
that the node agent's resizes are timed the same way.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.daemon_runner import start_daemon  # noqa: E402
from pollux_local.client import Client  # noqa: E402
from tests.multinode.testbed import Testbed  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
PROBE = ["-m", "pollux_local.torch.probe", "--base-batch", "32", "--max-batch", "32"]
PROBE += ["--no-adapt", "--samples", "2048"]


def ssh_node(bed: Testbed, root: Path) -> str:
    """The test bed's host as the daemon's only node, with two CPU devices."""
    host = bed.hosts[0]
    options = ", ".join(json.dumps(o) for o in bed.ssh_options())
    return (
        f'[nodes."{host.name}"]\nhost = "{host.name}"\ndevices = "cpu:2"\n'
        f'address = "{host.address}"\ngloo_ifname = "{host.ifname}"\n'
        f'ssh_options = [{options}]\npython = "/usr/bin/python3"\n'
        f'workdir = "{root / "node-work"}"\n'
    )


def start(state: Path, warm: bool, bed: Testbed | None) -> tuple[subprocess.Popen[bytes], Client]:
    state.parent.mkdir(parents=True, exist_ok=True)
    config = state.parent / f"{state.name}.toml"
    text = f"[scheduler]\nrestart_cost_s = 2\nwarm_resize = {str(warm).lower()}\n"
    if bed is not None:
        text += ssh_node(bed, state.parent)
    config.write_text(text)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    devices = None if bed is not None else "cpu:2"
    daemon = start_daemon(
        state, policy="goodput", interval_s=1, env=env, config=config, devices=devices
    )
    return daemon, Client(state / "daemon.sock")


def submit(client: Client, workdir: Path, args: list[str], name: str) -> str:
    return str(
        client.request(
            "submit", argv=[sys.executable, *PROBE, *args], workdir=str(workdir),
            elastic=True, min_gpus=1, max_gpus=2, batch_size=32, max_batch_size=32,
            name=name, env={"PYTHONPATH": str(REPO)},
        )["id"]
    )  # fmt: skip


def job(client: Client, job_id: str) -> dict[str, Any]:
    found: dict[str, Any] = client.request("show", id=job_id)["job"]
    if found["state"] in ("failed", "cancelled", "succeeded"):
        raise RuntimeError(f"job {job_id} {found['state']}: {found['reason']}")
    return found


def devices(found: dict[str, Any]) -> int:
    if found["state"] != "running":
        return 0
    return sum(len(d) for d in found["devices"].values())


def wait(predicate: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.1)


def one_run(
    root: Path, warm: bool, cycles: int, pause: str, bed: Testbed | None = None
) -> dict[str, Any]:
    state = root / ("warm" if warm else "cold")
    daemon, client = start(state, warm, bed)
    try:
        probe = submit(client, root, ["--epochs", "100000", "--pause", pause], "probe")
        wait(
            lambda: devices(j := job(client, probe)) == 2 and j["report"] is not None,
            180, "the probe on both devices",
        )  # fmt: skip
        for cycle in range(cycles):
            other = submit(client, root, ["--epochs", "1", "--samples", "256"], f"o{cycle}")
            wait(lambda: devices(job(client, probe)) == 1, 120, "a shrink")
            wait(
                lambda o=other: client.request("show", id=o)["job"]["state"] == "succeeded",  # type: ignore[misc]
                180, "the short job",
            )  # fmt: skip
            wait(lambda: devices(job(client, probe)) == 2, 120, "a grow")
        found = job(client, probe)
        client.request("cancel", ids=[probe])
        kind = "warm" if warm else "cold"
        return {
            "mode": kind,
            "median_downtime_s": found[f"resize_{kind}_s"],
            "resizes": found[f"resizes_{kind}"],
            "other_kind": found[f"resizes_{'cold' if warm else 'warm'}"],
        }
    finally:
        daemon.terminate()
        daemon.wait(timeout=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cycles", type=int, default=5, help="shrink-grow cycles per run")
    parser.add_argument("--rounds", type=int, default=1, help="warm and cold runs each")
    parser.add_argument("--pause", default="0.002", help="probe's seconds per sample")
    parser.add_argument("--ssh", action="store_true", help="on an SSH node of the test bed")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    runs: list[dict[str, Any]] = []
    with contextlib.ExitStack() as stack:
        tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="pollux-bench-"))
        os.chmod(tmp, 0o755)
        bed = stack.enter_context(Testbed(n_hosts=1)) if args.ssh else None
        for round_ in range(args.rounds):
            order = (True, False) if round_ % 2 == 0 else (False, True)
            for warm in order:
                run = one_run(Path(tmp) / f"r{round_}", warm, args.cycles, args.pause, bed)
                runs.append(run)
                if not args.json:
                    print(json.dumps(run), flush=True)
    summary = {
        kind: statistics.median(
            r["median_downtime_s"] for r in runs if r["mode"] == kind and r["median_downtime_s"]
        )
        for kind in ("warm", "cold")
        if any(r["mode"] == kind and r["median_downtime_s"] for r in runs)
    }
    if "warm" in summary and "cold" in summary:
        summary["warm_over_cold"] = summary["warm"] / summary["cold"]
    print(json.dumps({"runs": runs, "median_of_runs_s": summary}, indent=None if args.json else 1))


if __name__ == "__main__":
    main()
