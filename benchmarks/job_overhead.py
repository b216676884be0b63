"""Per-step overhead of pollux_local.torch and the time a rescale restart costs.

    python benchmarks/job_overhead.py [--json] [--steps N] [--repeats R]

* ``overhead_pct_1`` / ``overhead_pct_2``: extra cost per optimizer step of the probe model
  (an MLP, ``--features``/``--hidden``, batch ``--base-batch``) trained through
  ``ElasticTrainer`` (gradient statistics, progress, profiling, reporting all on) over the
  same model in a plain loop (plain DDP at 2 replicas), at 1 and 2 CPU replicas with
  OMP_NUM_THREADS=1.  Both loops run in the same processes in alternating blocks of
  ``--steps`` steps (which one goes first alternates too), and the median over ``--blocks``
  block pairs of the time ratio is taken: the machine is shared, and load that drifts between
  separate runs swamps a 1% difference.  The headline figures use process CPU time (all
  threads of rank 0, gloo's included); wall-clock figures are in ``detail``.
* ``restart_s``: from SIGTERM to a 1-replica job until the first optimizer step of its 2-replica
  restart (checkpoint, exit 75, start two fresh processes, restore, first step), split into
  its parts (``detail.restart_parts_s``); the rendezvous part includes waiting for the slower
  replica's imports.  ``bare_import_torch_s`` is a lone ``import torch`` for comparison.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pollux_local.launch.base import pick_master_port

REPO = Path(__file__).resolve().parents[1]
PROBE = [sys.executable, "-m", "pollux_local.torch.probe"]


def _envs(replicas: int, extra: dict[str, str]) -> list[dict[str, str]]:
    port = str(pick_master_port())
    envs = []
    for rank in range(replicas):
        env = dict(os.environ)
        env.update(
            OMP_NUM_THREADS="1",
            PYTHONPATH=str(REPO),
            RANK=str(rank),
            WORLD_SIZE=str(replicas),
            LOCAL_RANK=str(rank),
            LOCAL_WORLD_SIZE=str(replicas),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=port,
            POLLUX_PG_TIMEOUT_S="60",
            **extra,
        )
        envs.append(env)
    return envs


def _run(replicas: int, args: list[str], extra: dict[str, str]) -> list[dict[str, float]]:
    procs = [
        subprocess.Popen(PROBE + args, env=env, cwd=REPO, stdout=subprocess.PIPE, text=True)
        for env in _envs(replicas, extra)
    ]
    out, _ = procs[0].communicate(timeout=600)
    for p in procs[1:]:
        p.wait(timeout=600)
    if any(p.returncode != 0 for p in procs):
        raise SystemExit(f"probe failed: {[p.returncode for p in procs]}")
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def overhead(replicas: int, model_args: list[str], steps: int, blocks: int) -> dict[str, float]:
    """Elastic vs plain step cost from the probe's alternating-block mode (``--mode ab``)."""
    args = model_args + ["--mode", "ab", "--time-steps", str(steps), "--blocks", str(blocks)]
    return _run(replicas, args, {})[-1]


def import_torch_s() -> float:
    code = "import time; t = time.perf_counter(); import torch; print(time.perf_counter() - t)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return float(out.stdout.strip())


def restart(model_args: list[str]) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        job_dir = Path(tmp) / "job"
        extra = {"POLLUX_CHECKPOINT_DIR": str(Path(tmp) / "ckpt"), "POLLUX_JOB_DIR": str(job_dir)}
        args = model_args + ["--epochs", "1000"]
        env = _envs(1, extra)[0]
        first = subprocess.Popen(PROBE + args, env=env, cwd=REPO, stdout=subprocess.DEVNULL)
        deadline = time.monotonic() + 120
        while not (job_dir / "report.json").exists():  # written after the first step
            if time.monotonic() > deadline or first.poll() is not None:
                raise SystemExit("the first incarnation never started training")
            time.sleep(0.1)
        time.sleep(2.0)
        t_signal = time.time()
        first.send_signal(signal.SIGTERM)
        code = first.wait(timeout=120)
        stop_s = time.time() - t_signal
        if code != 75:
            raise SystemExit(f"the stopped job exited {code}, expected 75")
        extra["POLLUX_PROBE_T_START"] = repr(t_signal)
        procs = [
            subprocess.Popen(PROBE + args, env=e, cwd=REPO, stdout=subprocess.PIPE, text=True)
            for e in _envs(2, extra)
        ]
        assert procs[0].stdout is not None
        phases: dict[str, float] | None = None
        for line in procs[0].stdout:
            if '"first_step_after_s"' in line:
                phases = json.loads(line)
                break
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            p.wait(timeout=120)
        if phases is None:
            raise SystemExit("the restarted job never reported its first step")
        return {"restart_s": phases["first_step_after_s"], "stop_s": stop_s, **phases}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--steps", type=int, default=16, help="steps per block")
    parser.add_argument("--blocks", type=int, default=40)
    parser.add_argument("--features", type=int, default=512)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--base-batch", type=int, default=128)
    args = parser.parse_args()
    model_args = [
        "--features",
        str(args.features),
        "--hidden",
        str(args.hidden),
        "--classes",
        "10",
        "--samples",
        "8192",
        "--base-batch",
        str(args.base_batch),
        "--no-adapt",
    ]
    one = overhead(1, model_args, args.steps, args.blocks)
    two = overhead(2, model_args, args.steps, args.blocks)
    rs = restart(model_args)
    imp = import_torch_s()
    parts = {
        "sigterm_to_exit": rs["stop_s"],
        "python start and imports (torch, scipy, pollux_local)": rs["imports_done"] - rs["stop_s"],
        "data, model, process-group rendezvous, checkpoint restore": rs["trainer_ready"]
        - rs["imports_done"],
        "first step": rs["first_step_after_s"] - rs["trainer_ready"],
    }
    result = {
        "overhead_pct_1": round(one["overhead_cpu_pct"], 2),
        "overhead_pct_2": round(two["overhead_cpu_pct"], 2),
        "restart_s": round(rs["restart_s"], 2),
        "detail": {
            "overhead_wall_pct_1": round(one["overhead_wall_pct"], 2),
            "overhead_wall_pct_2": round(two["overhead_wall_pct"], 2),
            "restart_parts_s": {k: round(v, 2) for k, v in parts.items()},
            "bare_import_torch_s": round(imp, 2),
            "restart_dominated_by": max(parts, key=lambda k: parts[k]),
        },
    }
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key}: {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
