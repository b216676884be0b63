#!/usr/bin/env bash
# The checks that need a GPU, in one run of about six minutes on one NVIDIA GPU:
#   1. what the machine has (nvidia-smi, torch) and what the daemon's NVML discovery finds;
#   2. the gradient-noise measurement's per-step cost on the GPU (benchmarks/job_overhead.py
#      --device cuda, one replica), on the small probe MLP (a launch-bound step) and on a larger
#      one (a compute-bound step);
#   3. the main demo (scripts/demo.py) on this machine's GPUs: a local daemon, every job in jobs/.
#
#   bash benchmarks/gpu_check.sh OUT_DIR
#
# Each part writes its output to OUT_DIR and is cut off at its own time limit, so that one part
# that hangs leaves the others' figures.  PYTHON names the interpreter (default: python3); it
# needs torch with CUDA and the packages of pyproject.toml's dependencies that the daemon and
# the job library import (numpy, scipy, psutil, msgspec, nvidia-ml-py).
set -u
out="${1:?usage: bash benchmarks/gpu_check.sh OUT_DIR}"
cd "$(dirname "$0")/.."
mkdir -p "$out"
py="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"

part() {  # part NAME LIMIT_S COMMAND...: run, keep its output, say how it ended
    local name=$1 limit=$2
    shift 2
    local t0=$SECONDS
    timeout "$limit" "$@" >"$out/$name.txt" 2>&1
    echo "== $name: exit $? after $((SECONDS - t0)) s"
    tail -n 40 "$out/$name.txt"
}

part machine 60 bash -c "nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv;
  $py -c 'import torch; print(torch.__version__, torch.cuda.is_available(), torch.cuda.get_device_name(0))';
  $py -c 'from pollux_local.daemon import gpus; print(gpus.discover())'"
part overhead_probe 150 "$py" benchmarks/job_overhead.py --device cuda --replicas 1 \
    --no-restart --json --rounds 200
part overhead_large 150 "$py" benchmarks/job_overhead.py --device cuda --replicas 1 \
    --no-restart --json --rounds 120 --features 4096 --hidden 8192 --base-batch 256
part demo 180 "$py" scripts/demo.py --interval 5 --timeout 150 --state-dir "/tmp/gpu-check-demo"
