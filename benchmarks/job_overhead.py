"""Per-step cost of the job library's measurements, with confidence intervals; restart time.

    python benchmarks/job_overhead.py [--json] [--rounds R] [--steps N] [--no-restart]

Overhead.  Each replica (1, then 2 CPU replicas; OMP_NUM_THREADS=1, ``torch.set_num_threads(1)``,
each rank pinned to one core with ``os.sched_setaffinity``) holds three copies (four with
``--with-split``) of the probe model (an MLP, ``--features``/``--hidden``, batch
``--base-batch``) in one process and trains them step by step, interleaved:

* ``plain``: an ordinary loop (plain DDP at 2 replicas), no pollux_local;
* ``off``: ``ElasticTrainer`` with the gradient-noise measurement off (one measuring step at
  the start, none after);
* ``on``: ``ElasticTrainer`` as a job runs it (measurement spaced by ``measuring.py``);
* ``split`` (``--with-split``, one replica): as ``on``, but measuring steps dealt out as two
  half micro-batches (the way one replica measured before ``gradstats.SmallBatchGradNorm``, and
  still does for models it does not cover), for a before/after comparison in the same run.

A round is ``--steps`` optimizer steps of each arm, interleaved one step at a time in an
order drawn afresh for every step (each order of the arms equally often), so that load from
other processes on the shared machine, and the cache left behind by the step before, hit
every arm alike.  The ``on`` and ``off`` arms are two trainers that swap roles every round
(one turned on goes on measuring where it stopped): whatever sets one copy of the model apart
from the other, such as where its memory lies, falls on both arms alike (before the swap, the
two arms' ordinary steps, the same work, differed by up to 0.5% within one run).  Per round
the ratios of the arms' summed times on/off (the cost of the measurement: the headline, goal
<= 1%), off/plain (the rest of the library) and on/plain are taken (split/off and on/split
too with ``--with-split``); the median over ``--rounds`` rounds is reported with a
distribution-free 95% confidence interval (order statistics of the binomial:
[x_(j), x_(n+1-j)], no assumption on the ratios' distribution).  The headline clock
is rank 0's process CPU time for one replica and wall clock for two (a step there also waits
for the other rank); the other clock is in ``detail``.  A round holds a whole number of
measuring periods at the default spacing, so the median of round ratios does not hide their
cost; the mean ratio (total on / total off) is printed beside it.  Beside the ratio of summed
times, the ``typical`` ratio (``measurement_typical_pct``) compares blocks whose steps each
count at the median of their kind (measuring or not, :func:`typical_block_time`): the same
cost, without the single steps' scheduling noise.

``--device cuda`` runs the replicas on GPUs (one each): the batches are copied to the device
as a job copies them, every timed step ends with ``torch.cuda.synchronize`` (in every arm
alike) and the headline clock is the wall clock.  A synchronisation after every step hides
what one inside a step costs (the device has to drain its queue anyway); ``--per-block``
times each arm's ``--steps`` steps as one block instead, synchronising only at the block's end
as a job's loop runs, the arms' blocks in a fresh random order every round.

Restart.  ``restart_s``: from SIGTERM to a 1-replica job until the first optimizer step of its
2-replica restart (checkpoint, exit 75, start two fresh processes, restore, first step), split
into its parts (``detail.restart_parts_s``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pollux_local.launch.base import pick_master_port

if TYPE_CHECKING:  # the job library (torch) is imported by the workers only
    from pollux_local.torch import ElasticTrainer

REPO = Path(__file__).resolve().parents[1]
PROBE = [sys.executable, "-m", "pollux_local.torch.probe"]
ARMS = ("plain", "off", "on")
#: The least spacing of the measuring arms' measuring steps.
STATS_INTERVAL = 8
WITH_SPLIT = (*ARMS, "split")


def _envs(replicas: int, extra: dict[str, str]) -> list[dict[str, str]]:
    port = str(pick_master_port())
    envs = []
    for rank in range(replicas):
        env = dict(os.environ)
        env.update(
            OMP_NUM_THREADS="1",
            PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
            RANK=str(rank),
            WORLD_SIZE=str(replicas),
            LOCAL_RANK=str(rank),
            LOCAL_WORLD_SIZE=str(replicas),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=port,
            POLLUX_PG_TIMEOUT_S="120",
            **extra,
        )
        for key in ("POLLUX_JOB_DIR", "POLLUX_CHECKPOINT_DIR", "POLLUX_DAEMON_SOCKET"):
            if key not in extra:
                env.pop(key, None)
        envs.append(env)
    return envs


# ----------------------------------------------------------------------------- statistics
def median_ci(values: list[float], level: float = 0.95) -> tuple[float, float, float]:
    """(median, low, high): the sample median and the distribution-free confidence interval
    [x_(j), x_(n+1-j)] of the population median, with the largest j whose coverage
    P(j <= B <= n - j), B ~ Binomial(n, 1/2), is at least ``level``."""
    xs = sorted(values)
    n = len(xs)
    if n == 0:
        raise ValueError("no values")
    pmf = [math.comb(n, i) / 2**n for i in range(n + 1)]
    j = 0
    for cand in range(1, n // 2 + 1):
        if sum(pmf[cand : n - cand + 1]) >= level:
            j = cand
        else:
            break
    if j == 0:
        return statistics.median(xs), xs[0], xs[-1]  # too few values for the level
    return statistics.median(xs), xs[j - 1], xs[n - j]


def _summary(ratios: list[float]) -> dict[str, float]:
    """Median overhead in % with its 95% interval and the interval's width (points of %)."""
    med, low, high = median_ci(ratios)
    return {
        "pct": round(100 * (med - 1), 2),
        "ci_low": round(100 * (low - 1), 2),
        "ci_high": round(100 * (high - 1), 2),
        "ci_width": round(100 * (high - low), 2),
    }


def block_time(steps: list[list[float]], clock: int) -> float:
    """A block's time on one clock (0: wall, 1: CPU): the sum over its steps."""
    return math.fsum(step[clock] for step in steps)


def typical_block_time(steps: list[list[float]], clock: int) -> float:
    """A block's time with each step's noise replaced by its kind's median,
    n_meas * median(measuring steps) + n_rest * median(other steps).

    The measurement adds a fixed amount of work to the steps that measure; that shifts their
    median by the same amount, so this keeps its cost.  What it drops is the scheduling noise
    of single steps (two ranks, their gloo threads and the machine's other processes sharing
    two cores: some steps find the other rank waiting, some wait for it), which the sum
    carries whole: on two replicas the spread of the per-block ratio is about 1.7x smaller
    (a measured 80-block run: 2.1% against 3.7%).  A cost that came as rare long stalls would
    not show here; the sum and the mean ratio beside it would show it."""
    kinds: dict[int, list[float]] = {}
    for step in steps:
        kinds.setdefault(int(step[2]), []).append(step[clock])
    return math.fsum(len(times) * statistics.median(times) for times in kinds.values())


# ----------------------------------------------------------------------------- worker
def probe_trainer(
    model: Any, lr: float, base_batch: int, stats_interval: int, stats_budget: float | None
) -> ElasticTrainer:
    """An ``ElasticTrainer`` of ``model`` (SGD with momentum) as these benchmarks time it: no
    adaptation, no reports, checkpoints or signal handler."""
    import torch

    from pollux_local.torch import ElasticTrainer

    return ElasticTrainer(
        model,
        torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9),
        base_batch=base_batch,
        adapt=False,
        report_interval_s=3600.0,
        checkpoint_interval_s=None,
        handle_sigterm=False,
        stats_interval=stats_interval,
        stats_budget=stats_budget,
    )


class EpochBatches:
    """A trainer's batches epoch after epoch (its one loader, iterated again at its end)."""

    def __init__(self, trainer: Any, data: Any) -> None:
        self.loader = trainer.loader(data)
        self.batches = iter(self.loader)

    def __next__(self) -> Any:
        try:
            return next(self.batches)
        except StopIteration:
            self.batches = iter(self.loader)
            return next(self.batches)


def train_steps(
    trainer: Any, batches: EpochBatches, count: int, after: Callable[[], None] | None = None
) -> None:
    """``count`` optimizer steps of the probe (cross-entropy) with ``trainer``, the batches
    copied to its device as a job copies them; ``after`` runs after every micro-batch."""
    import torch.nn.functional as F

    done = 0
    while done < count:
        xb, yb, _ = next(batches)
        xb, yb = xb.to(trainer.device), yb.to(trainer.device)
        stepped = trainer.step(F.cross_entropy(trainer.model(xb), yb))
        if after is not None:
            after()
        done += stepped


def worker(args: argparse.Namespace) -> int:
    """One replica of the interleaved A/B/C run (see the module docstring)."""
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    cores = sorted(os.sched_getaffinity(0))
    # one core per rank; a lone replica takes the last core (away from core 0's interrupts)
    os.sched_setaffinity(0, {cores[rank % len(cores)] if world > 1 else cores[-1]})

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel

    from pollux_local.torch.probe import make_data, make_model

    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)
    device = torch.device(args.device)
    on_gpu = device.type == "cuda"
    data = make_data(args.samples, args.features, args.classes, args.seed)
    x, y, _ = data.tensors

    def trainer() -> ElasticTrainer:
        model = make_model(args.features, args.hidden, args.classes, args.seed)
        return probe_trainer(model, args.lr, args.base_batch, STATS_INTERVAL, args.stats_budget)

    arms = WITH_SPLIT if args.with_split and world == 1 else ARMS
    # Two trainers swap the on and off roles every round, so that whatever sets one copy of
    # the model apart from the other (where its memory lies) falls on both arms alike.
    trainers = {"a": trainer(), "b": trainer()}
    role = {"on": "a", "off": "b"}
    if "split" in arms:
        trainers["split"] = trainer()
        trainers["split"]._small_norm = None  # measuring steps split, as before
        role["split"] = "split"
    paused: dict[str, tuple[int, int]] = {}

    def measure(name: str, on: bool) -> None:
        """Turn a trainer's measurement on or off; turned on again it goes on where it
        stopped (its spacing, and the steps since its last measuring step)."""
        chosen, schedule = trainers[name], trainers[name]._schedule
        if on:
            chosen.stats_interval, chosen.stats_budget = STATS_INTERVAL, args.stats_budget
            schedule.interval, schedule.since = paused.pop(name, (schedule.interval, 0))
        else:
            paused[name] = (schedule.interval, schedule.since)
            chosen.stats_interval, chosen.stats_budget = 10**9, None
            schedule.interval = 10**9

    model_p: torch.nn.Module = make_model(args.features, args.hidden, args.classes, args.seed)
    model_p = model_p.to(device)
    if world > 1:
        model_p = DistributedDataParallel(model_p)
    opt_p = torch.optim.SGD(model_p.parameters(), lr=args.lr, momentum=0.9)
    perm = torch.randperm(len(data), generator=torch.Generator().manual_seed(args.seed))
    local = args.base_batch // world
    cursor = 0

    def plain_steps(n: int) -> None:
        nonlocal cursor
        for _ in range(n):
            if cursor + args.base_batch > len(data):
                cursor = 0
            idx = perm[cursor + rank * local : cursor + (rank + 1) * local]
            cursor += args.base_batch
            xb, yb = x[idx].to(device), y[idx].to(device)
            torch.autograd.backward(F.cross_entropy(model_p(xb), yb))
            opt_p.step()
            opt_p.zero_grad(set_to_none=True)

    batches = {name: EpochBatches(t, data) for name, t in trainers.items()}

    def elastic_steps(name: str, n: int) -> None:
        train_steps(trainers[name], batches[name], n)

    def run_arm(arm: str, n: int) -> None:
        if arm == "plain":
            plain_steps(n)
        else:
            elastic_steps(role[arm], n)

    def measuring(arm: str) -> int:
        """Whether the arm's last step was a measuring step (as its schedule marked it)."""
        return int(arm in role and trainers[role[arm]]._schedule.measuring)

    for arm in arms:  # warm-up, every trainer measuring: each settles its spacing
        run_arm(arm, args.warmup)
    orders = list(itertools.permutations(arms))
    rng = random.Random(args.seed)  # the same order on every rank
    rows: list[dict[str, Any]] = []
    cycle: list[tuple[str, ...]] = []
    for number in range(args.rounds):
        role["on"], role["off"] = ("a", "b") if number % 2 == 0 else ("b", "a")
        measure(role["on"], True)
        measure(role["off"], False)
        # per arm, one (wall s, CPU s, measured) triple per step
        row: dict[str, Any] = {arm: [] for arm in arms}
        if world > 1:
            dist.barrier()
        if args.per_block:
            # each arm's block of steps as a whole, the arms in a fresh random order
            if on_gpu:
                torch.cuda.synchronize(device)
            for arm in rng.sample(arms, len(arms)):
                t, c = time.perf_counter(), time.process_time()
                measured = 0
                for _ in range(args.steps):
                    run_arm(arm, 1)
                    measured += measuring(arm)
                if on_gpu:
                    torch.cuda.synchronize(device)
                row[arm].append((time.perf_counter() - t, time.process_time() - c, measured))
        for _ in range(0 if args.per_block else args.steps):
            # one step of each arm, in an order drawn afresh from the six (each equally often)
            if not cycle:
                cycle = orders[:]
                rng.shuffle(cycle)
            for arm in cycle.pop():
                t, c = time.perf_counter(), time.process_time()
                run_arm(arm, 1)
                if on_gpu:  # a step's time includes its device work
                    torch.cuda.synchronize(device)
                wall, cpu = time.perf_counter() - t, time.process_time() - c
                row[arm].append((wall, cpu, measuring(arm)))
        rows.append(row)
        if rank == 0 and len(rows) % 50 == 0:
            print(f"{world} replica(s): {len(rows)}/{args.rounds} rounds", file=sys.stderr)
    if rank == 0:
        spacing = {
            name: paused.get(name, (t._schedule.interval, 0))[0] for name, t in trainers.items()
        }
        print(json.dumps({"rows": rows, "spacing": spacing}), flush=True)
    for each in trainers.values():
        each.close()
    if world > 1 and dist.is_initialized():
        dist.destroy_process_group()
    return 0


def overhead(replicas: int, args: argparse.Namespace) -> dict[str, Any]:
    """Run ``replicas`` workers; the three comparisons' medians and intervals (CPU time and
    wall clock), the measuring steps per block and the spacing the schedule settled on."""
    argv = [sys.executable, str(Path(__file__).resolve()), "--worker"]
    keys = (
        "rounds",
        "steps",
        "warmup",
        "features",
        "hidden",
        "base_batch",
        "stats_budget",
        "device",
    )
    for key in keys:
        argv += [f"--{key.replace('_', '-')}", str(getattr(args, key))]
    if args.with_split:
        argv.append("--with-split")
    if args.per_block:
        argv.append("--per-block")
    procs = [
        subprocess.Popen(argv, env=env, cwd=REPO, stdout=subprocess.PIPE, text=True)
        for env in _envs(replicas, {"POLLUX_DEVICE": args.device})
    ]
    out, _ = procs[0].communicate(timeout=3600)
    for p in procs[1:]:
        p.wait(timeout=600)
    if any(p.returncode != 0 for p in procs):
        raise SystemExit(f"overhead worker failed: {[p.returncode for p in procs]}")
    last = [line for line in out.splitlines() if line.startswith("{")][-1]
    if args.keep_steps:
        Path(args.keep_steps).write_text(last)
    result = json.loads(last)
    rows = result["rows"]
    figures: dict[str, Any] = {}
    pairs = [("on", "off"), ("off", "plain"), ("on", "plain")]
    if "split" in rows[0]:
        pairs += [("split", "off"), ("on", "split")]
    for clock, index in (("cpu", 1), ("wall", 0)):
        for num, den in pairs:
            ratios = [block_time(r[num], index) / block_time(r[den], index) for r in rows]
            summary = _summary(ratios)
            total = sum(block_time(r[num], index) for r in rows) / sum(
                block_time(r[den], index) for r in rows
            )
            summary["mean_pct"] = round(100 * (total - 1), 2)
            figures[f"{num}/{den} {clock}"] = summary
            typical = [
                typical_block_time(r[num], index) / typical_block_time(r[den], index) for r in rows
            ]
            figures[f"{num}/{den} {clock} typical"] = _summary(typical)
    for arm in ("on", "split"):
        if arm in rows[0]:
            figures[f"{arm}: measuring steps per block"] = statistics.mean(
                sum(step[2] for step in r[arm]) for r in rows
            )
    figures["spacing"] = result["spacing"]
    figures["step_ms_plain"] = round(
        1000 * statistics.median(block_time(r["plain"], 0) for r in rows) / args.steps, 2
    )
    figures["rounds"] = len(rows)
    return figures


def spacing_figure(args: argparse.Namespace) -> dict[str, Any]:
    """How measuring every k steps changes the gradient-noise estimate's error.

    The probe model trains ``--spacing-steps`` steps on a fresh data set (65,536 samples, no
    memorising) with a measurement on every step, once per learning rate of
    ``--spacing-lr-scales`` (x the probe's 0.05: another rate moves the statistics at another
    pace against their noise); each step's raw two-batch estimate is kept.  Replaying every
    k-th of them (each of the k offsets) through ``GradNoiseEstimator`` gives the estimate a job
    measuring every k steps would hold at every step.  It is compared with the truth of that
    step, the mean of the raw estimates within +-100 steps (a centred average of 201
    measurements: its own noise is a third of the EMA's), over the steps from 640 on (so that
    k = 128 has 5 measurements).  Printed per k: the share of steps whose error is within the
    estimate's own 95% band (1.96 ``stderr``), and the median error in standard errors, for
    |G|^2 and for var = tr(S)/M0."""
    rank_core = sorted(os.sched_getaffinity(0))[-1]
    os.sched_setaffinity(0, {rank_core})
    import torch

    torch.set_num_threads(1)
    figure: dict[str, Any] = {}
    for scale in (float(x) for x in args.spacing_lr_scales.split(",")):
        raw = _every_step_estimates(args, args.lr * scale)
        figure[f"lr x{scale:g}"] = _replay_spacings(raw, args.base_batch)
    return figure


def _every_step_estimates(
    args: argparse.Namespace, lr: float
) -> list[tuple[float, float, float, float]]:
    """The probe trained ``--spacing-steps`` steps at ``lr``, measuring every step: each
    step's (small norm, small batch, big norm, big batch)."""
    import torch
    import torch.nn.functional as F

    from pollux_local.torch import ElasticTrainer, LaunchEnvironment
    from pollux_local.torch.probe import make_data, make_model

    data = make_data(65536, args.features, args.classes, args.seed)
    model = make_model(args.features, args.hidden, args.classes, args.seed)
    trainer = ElasticTrainer(
        model,
        torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9),
        base_batch=args.base_batch,
        adapt=False,
        env=LaunchEnvironment(),
        report_interval_s=3600.0,
        checkpoint_interval_s=None,
        handle_sigterm=False,
        stats_interval=1,
        stats_budget=None,
    )
    raw: list[tuple[float, float, float, float]] = []
    update = trainer.estimator.update

    def keep(small_sq: float, small_b: float, big_sq: float, big_b: float) -> None:
        raw.append((small_sq, small_b, big_sq, big_b))
        update(small_sq, small_b, big_sq, big_b)

    trainer.estimator.update = keep  # type: ignore[method-assign,assignment]
    loader = trainer.loader(data)
    while len(raw) < args.spacing_steps:
        for xb, yb, _ in loader:
            trainer.step(F.cross_entropy(trainer.model(xb), yb))
            if len(raw) >= args.spacing_steps:
                break
    trainer.close()
    return raw


def _replay_spacings(
    raw: list[tuple[float, float, float, float]], base_batch: int
) -> dict[str, Any]:
    """The errors of the estimate at each spacing k (every k-th measurement, each offset)."""
    from pollux_local.torch.gradstats import GradNoiseEstimator, two_batch_estimate

    n, half, start = len(raw), 100, 640
    estimates = [two_batch_estimate(*r) for r in raw]
    truth = {
        "sqr": [e[0] for e in estimates],
        "var": [e[1] / base_batch for e in estimates],
    }
    for name, series in truth.items():
        truth[name] = [statistics.fmean(series[max(0, t - half) : t + half + 1]) for t in range(n)]
    figure: dict[str, Any] = {
        "steps": n,
        "var_truth_at": {t: round(truth["var"][t], 3) for t in (half, n // 2, n - half - 1)},
    }
    for k in (1, 2, 4, 8, 16, 32, 64, 128):
        within = {"sqr": 0, "var": 0}
        errors: dict[str, list[float]] = {"sqr": [], "var": []}
        for offset in range(k):
            est = GradNoiseEstimator(base_batch, min_samples=1)
            for t in range(n):
                if t % k == offset:
                    est.update(*raw[t])
                if not start <= t < n - half:
                    continue
                got, err = est.smoothed, est.stderr
                assert got is not None and err is not None
                for name in ("sqr", "var"):
                    error = abs(getattr(got, name) - truth[name][t])
                    within[name] += error <= 1.96 * getattr(err, name)
                    errors[name].append(error / getattr(err, name))
        figure[f"k={k}"] = {
            f"{name} within band": round(within[name] / len(errors[name]), 3)
            for name in ("sqr", "var")
        } | {
            f"{name} median error / stderr": round(statistics.median(errors[name]), 2)
            for name in ("sqr", "var")
        }
    return figure


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
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument(
        "--rounds", type=int, default=300, help="rounds of interleaved blocks, one per arm"
    )
    parser.add_argument("--steps", type=int, default=64, help="optimizer steps per block")
    parser.add_argument("--warmup", type=int, default=128, help="steps per arm before timing")
    parser.add_argument("--replicas", default="1,2", help="replica counts to measure")
    parser.add_argument("--features", type=int, default=512)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--base-batch", type=int, default=128)
    parser.add_argument(
        "--stats-budget",
        type=float,
        default=0.005,
        help="the 'on' arm's budget (the trainer's default)",
    )
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="where the replicas compute (cuda: one GPU per replica, timed by the wall clock)",
    )
    parser.add_argument(
        "--per-block",
        action="store_true",
        help="time each arm's block of --steps steps as a whole (no synchronisation per step)",
    )
    parser.add_argument("--no-restart", action="store_true", help="skip the restart timing")
    parser.add_argument(
        "--keep-steps", metavar="PATH", help="write every step's times (JSON) to PATH"
    )
    parser.add_argument(
        "--with-split",
        action="store_true",
        help="one replica: a fourth arm measuring with split steps (the way before)",
    )
    parser.add_argument(
        "--spacing", action="store_true", help="only the estimate's error against k"
    )
    parser.add_argument("--spacing-steps", type=int, default=2560)
    parser.add_argument(
        "--spacing-lr-scales",
        default="1,0.25",
        help="--spacing: the learning rates trained at, x the probe's (comma-separated)",
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--samples", type=int, default=8192, help=argparse.SUPPRESS)
    parser.add_argument("--classes", type=int, default=10, help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--lr", type=float, default=0.05, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    if args.spacing:
        figure = spacing_figure(args)
        print(
            json.dumps(figure) if args.json else "\n".join(f"{k}: {v}" for k, v in figure.items())
        )
        return 0
    result: dict[str, Any] = {}
    detail: dict[str, Any] = {}
    for replicas in (int(r) for r in args.replicas.split(",")):
        figures = overhead(replicas, args)
        # one replica: its CPU time is its cost; two: a step also waits for the other rank
        clock = "cpu" if replicas == 1 and args.device == "cpu" else "wall"
        result[f"clock_{replicas}"] = clock
        for name, key in (
            ("measurement", f"on/off {clock}"),
            ("measurement_typical", f"on/off {clock} typical"),
            ("library", f"on/plain {clock}"),
        ):
            result[f"{name}_pct_{replicas}"] = figures[key]["pct"]
            result[f"{name}_ci95_{replicas}"] = [figures[key]["ci_low"], figures[key]["ci_high"]]
        if "split/off cpu" in figures:
            before = figures["split/off cpu"]
            result[f"measurement_split_pct_{replicas}"] = before["pct"]
            result[f"measurement_split_ci95_{replicas}"] = [before["ci_low"], before["ci_high"]]
        detail[f"replicas_{replicas}"] = figures
    result["machine_load_1min"] = round(os.getloadavg()[0], 2)
    if not args.no_restart:
        model_args = [
            *("--features", str(args.features), "--hidden", str(args.hidden)),
            *("--classes", "10", "--samples", "8192", "--base-batch", str(args.base_batch)),
            "--no-adapt",
        ]
        rs = restart(model_args)
        parts = {
            "sigterm_to_exit": rs["stop_s"],
            "python start and imports (torch, scipy, pollux_local)": rs["imports_done"]
            - rs["stop_s"],
            "data, model, process-group rendezvous, checkpoint restore": rs["trainer_ready"]
            - rs["imports_done"],
            "first step": rs["first_step_after_s"] - rs["trainer_ready"],
        }
        result["restart_s"] = round(rs["restart_s"], 2)
        detail["restart_parts_s"] = {k: round(v, 2) for k, v in parts.items()}
        detail["bare_import_torch_s"] = round(import_torch_s(), 2)
    result["detail"] = detail
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            if key != "detail":
                print(f"{key}: {value}")
        for key, value in detail.items():
            print(f"{key}: {json.dumps(value)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
