"""Warm resizes (``torch/resizing.py``) with real gloo processes on CPU: an elastic job grown
1 -> 2 and shrunk 2 -> 1 in place ends bit for bit where the same resize done as a
checkpoint-restart at the same step ends (same step count, same sample sequence, same
weights); a joiner that never comes makes the job fall back to a checkpoint-restart."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from pollux_local.api.resize import ResizeOrder  # noqa: E402
from pollux_local.api.states import ExitCode  # noqa: E402
from pollux_local.launch.base import pick_master_port  # noqa: E402
from pollux_local.launch.warm import write_order  # noqa: E402
from tests.paths import REPO_ROOT  # noqa: E402
from tests.torch.test_distributed import load_model, step_sequence  # noqa: E402

PROBE = [sys.executable, "-m", "pollux_local.torch.probe"]
#: deterministic: fixed (m, s), every step measures (the agreement is at every step)
ARGS = ["--no-adapt", "--stats-interval", "1", "--stats-budget", "0", "--epochs", "2"]
LOCAL_BATCH = 16


def replica(
    tmp: Path, rank: int, world: int, port: int, args: list[str], **extra: str
) -> subprocess.Popen[bytes]:
    env = dict(os.environ)
    env.update(
        OMP_NUM_THREADS="1",
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        POLLUX_JOB_ID="probe",
        POLLUX_JOB_DIR=str(tmp / "job"),
        POLLUX_CHECKPOINT_DIR=str(tmp / "ckpt"),
        POLLUX_PG_TIMEOUT_S="30",
        POLLUX_DEVICE="cpu",
        POLLUX_LOCAL_BATCH=str(LOCAL_BATCH),
        PYTHONPATH=str(REPO_ROOT),
    )
    env.update(extra)
    err = (tmp / f"rank{rank}-{port}.err").open("w")
    return subprocess.Popen(
        PROBE + ARGS + args, env=env, cwd=REPO_ROOT, stderr=err, stdout=subprocess.DEVNULL
    )


def codes(procs: list[subprocess.Popen[bytes]], tmp: Path) -> list[int]:
    result = []
    for proc in procs:
        try:
            result.append(proc.wait(timeout=120))
        except subprocess.TimeoutExpired:
            for other in procs:
                other.kill()
            raise
    if any(code not in (0, ExitCode.RESCALE) for code in result):
        for path in tmp.glob("*.err"):
            print(path.name, path.read_text()[-3000:], file=sys.stderr)
    return result


def run_warm(
    tmp: Path,
    before: int,
    after: int,
    at_step: int,
    kept: int | None = None,
    ranks: tuple[int, ...] | None = None,
) -> tuple[list[int], Path]:
    """``before`` replicas, an order to go to ``after`` placed after step ``at_step``
    (keeping the ``kept`` lowest ranks, or the ``ranks`` named, renumbered: the others leave
    and joiners take the ranks after them)."""
    tmp.mkdir(parents=True)
    (tmp / "job").mkdir()
    order_file = tmp / "job" / "resize.json"
    out = tmp / "final.pt"
    port, new_port = pick_master_port(), pick_master_port()
    order = ResizeOrder(
        generation=1,
        world_size=after,
        master_addr="127.0.0.1",
        master_port=new_port,
        local_batch=LOCAL_BATCH,
        kept=kept,
        ranks=ranks,
    )
    write_order(order_file.with_name("resize.json.next1"), order)
    common = {"POLLUX_RESIZE_FILE": str(order_file)}
    log = ["--out", str(out), "--log-samples", str(tmp / "samples"), "--order-at-step"]
    procs = [
        replica(tmp, rank, before, port, [*log, str(at_step)], **common) for rank in range(before)
    ]
    procs += [
        replica(tmp, rank, after, new_port, log[:4], POLLUX_RESIZE_JOIN="1", **common)
        for rank in range(
            len(ranks) if ranks is not None else kept if kept is not None else before, after
        )
    ]
    return codes(procs, tmp), out


#: cold runs by (before, after, at_step): a move and a handover at the same step compare
#: against the same checkpoint-restart, run once
_COLD: dict[tuple[int, int, int], tuple[list[int], list[int], Path]] = {}


def run_cold(tmp: Path, before: int, after: int, at_step: int) -> tuple[list[int], list[int], Path]:
    """The same resize as a checkpoint-restart: SIGTERM after ``at_step``, then ``after``
    (run once per resize and step: its results and sample log are read, never changed)."""
    key = (before, after, at_step)
    if key not in _COLD:
        _COLD[key] = _run_cold(tmp, before, after, at_step)
    return _COLD[key]


def _run_cold(
    tmp: Path, before: int, after: int, at_step: int
) -> tuple[list[int], list[int], Path]:
    tmp.mkdir(parents=True)
    out = tmp / "final.pt"
    log = ["--out", str(out), "--log-samples", str(tmp / "samples")]
    port = pick_master_port()
    first = codes(
        [
            replica(tmp, rank, before, port, [*log, "--signal-at-step", str(at_step)])
            for rank in range(before)
        ],
        tmp,
    )
    port = pick_master_port()
    second = codes([replica(tmp, rank, after, port, log) for rank in range(after)], tmp)
    return first, second, out


@pytest.mark.parametrize(
    ("before", "after", "kept", "ranks", "at_step"),
    [
        (1, 2, None, None, 5),
        (2, 1, None, None, 5),
        (2, 2, 1, None, 5),
        (2, 2, None, (1,), 5),
        (1, 2, None, None, 32),  # after the last step of epoch 0 (512 samples, M = 16)
        (2, 2, None, (1,), 16),  # the same at M = 32
    ],
)
def test_warm_resize_is_bit_identical_to_a_checkpoint_restart(
    tmp_path: Path,
    before: int,
    after: int,
    kept: int | None,
    ranks: tuple[int, ...] | None,
    at_step: int,
) -> None:
    """A grow, a shrink, a move (rank 1 leaves, a joiner becomes rank 1), and a handover
    (rank 0 leaves, rank 1 becomes rank 0 and sends the state to a joiner, rank 1); mid-epoch,
    and at an epoch's very end, where the replicas that stay begin the next epoch as the
    joiners (and a restarted job) begin their first: choosing (m, s) together."""
    warm = run_warm(tmp_path / "warm", before, after, at_step=at_step, kept=kept, ranks=ranks)
    warm_codes, warm_out = warm
    cold = run_cold(tmp_path / "cold", before, after, at_step=at_step)
    cold_first, cold_second, cold_out = cold
    stayed = len(ranks) if ranks is not None else kept if kept is not None else min(before, after)
    joined = after - stayed
    assert warm_codes == [0] * (before + joined)  # a leaving replica exits 0
    assert cold_first == [ExitCode.RESCALE] * before and cold_second == [0] * after
    warm, cold = torch.load(warm_out, weights_only=False), torch.load(cold_out, weights_only=False)
    assert warm["steps"] == cold["steps"] > at_step
    assert warm["progress"] == cold["progress"]
    # the loader's position: the same samples at every step, on the same number of replicas
    assert step_sequence(tmp_path / "warm" / "samples") == step_sequence(
        cold_out.parent / "samples"
    )
    warm_model, cold_model = load_model(warm_out), load_model(cold_out)
    for name, tensor in cold_model.items():
        assert torch.equal(warm_model[name], tensor), name  # bit for bit
    # the warm run really resized in place: no checkpoint was written, nothing restarted
    assert not (tmp_path / "warm" / "ckpt").exists() or not any(
        (tmp_path / "warm" / "ckpt").iterdir()
    )


def test_a_joiner_that_never_comes_falls_back_to_a_checkpoint(tmp_path: Path) -> None:
    """Grow 1 -> 2 with no joiner: rank 0 times out forming the group, checkpoints the state
    it holds and exits 75; restarted at 2 replicas it ends where the cold resize ends."""
    tmp = tmp_path / "fallback"
    tmp.mkdir()
    (tmp / "job").mkdir()
    order_file = tmp / "job" / "resize.json"
    order = ResizeOrder(
        generation=1,
        world_size=2,
        master_addr="127.0.0.1",
        master_port=pick_master_port(),
        local_batch=LOCAL_BATCH,
    )
    write_order(order_file.with_name("resize.json.next1"), order)
    out = tmp / "final.pt"
    log = ["--out", str(out), "--log-samples", str(tmp / "samples")]
    first = codes(
        [
            replica(
                tmp,
                0,
                1,
                pick_master_port(),
                [*log, "--order-at-step", "5"],
                POLLUX_RESIZE_FILE=str(order_file),
                POLLUX_PG_TIMEOUT_S="3",
            )
        ],
        tmp,
    )
    assert first == [ExitCode.RESCALE]
    port = pick_master_port()
    assert codes([replica(tmp, rank, 2, port, log) for rank in range(2)], tmp) == [0, 0]
    _, _, cold_out = run_cold(tmp_path / "cold", 1, 2, at_step=5)
    fallback, cold = load_model(out), load_model(cold_out)
    for name, tensor in cold.items():
        assert torch.equal(fallback[name], tensor), name
    assert step_sequence(tmp / "samples") == step_sequence(cold_out.parent / "samples")


def test_a_grow_ordered_after_the_last_step_leaves_the_job_finished(tmp_path: Path) -> None:
    """The order comes after the replica that stays took its last look at it (its job
    ended): the joiner, whose group never forms, exits 0 once its rendezvous times out, so
    the job ends succeeded with the uninterrupted run's steps (not failed by the joiner)."""
    tmp = tmp_path / "late"
    (tmp / "job").mkdir(parents=True)
    order_file = tmp / "job" / "resize.json"
    out = tmp / "final.pt"
    new_port = pick_master_port()
    common = {"POLLUX_RESIZE_FILE": str(order_file)}
    stayer = replica(tmp, 0, 1, pick_master_port(), ["--out", str(out)], **common)
    assert codes([stayer], tmp) == [0]
    order = ResizeOrder(
        generation=1,
        world_size=2,
        master_addr="127.0.0.1",
        master_port=new_port,
        local_batch=LOCAL_BATCH,
    )
    write_order(order_file, order)  # too late: nobody reads it
    joiner = replica(
        tmp, 1, 2, new_port, [], POLLUX_RESIZE_JOIN="1", POLLUX_PG_TIMEOUT_S="3", **common
    )
    assert codes([joiner], tmp) == [0]
    assert (tmp / "job" / "resize-ready-1-1").exists()  # it did come as a joiner
    assert "did not join warm resize 1" in next(tmp.glob("rank1-*.err")).read_text()
    assert torch.load(out, weights_only=False)["steps"] == 64  # 2 epochs of 512 at M = 16


def test_grown_and_shrunk_warm_several_times_it_ends_where_an_uninterrupted_run_ends(
    tmp_path: Path,
) -> None:
    """1 -> 2 -> 1 -> 2 -> 1 replicas warm (orders after steps 4, 8, 12, 16) against one
    replica throughout: the same steps and samples, and weights within 1e-5.  Not bit for bit:
    the total batch stays the base batch (m = 16: two accumulated micro-batches on one replica,
    one on each of two), so the learning rate and the samples are the same, but the gradient
    is summed in another order (two micro-batches accumulated, or two replicas' gradients
    all-reduced), which changes the last bits of each step."""
    tmp = tmp_path / "warm"
    (tmp / "job").mkdir(parents=True)
    order_file = tmp / "job" / "resize.json"
    sizes = [2, 1, 2, 1]
    ports = [pick_master_port() for _ in sizes]
    for generation, (size, port) in enumerate(zip(sizes, ports, strict=True), start=1):
        order = ResizeOrder(
            generation=generation,
            world_size=size,
            master_addr="127.0.0.1",
            master_port=port,
            local_batch=LOCAL_BATCH,
            accum_steps=2 // size,  # M = 32, the base batch, at either size
        )
        write_order(order_file.with_name(f"resize.json.next{generation}"), order)
    out = tmp / "final.pt"
    log = ["--out", str(out), "--log-samples", str(tmp / "samples")]
    common = {"POLLUX_RESIZE_FILE": str(order_file)}
    at = [*log, "--order-at-step", "4,8,12,16"]
    procs = [replica(tmp, 0, 1, pick_master_port(), at, POLLUX_ACCUM_STEPS="2", **common)]
    procs += [  # the joiners of generations 1 and 3 wait at their rendezvous
        replica(tmp, 1, 2, ports[g - 1], log, POLLUX_RESIZE_JOIN=str(g), **common) for g in (1, 3)
    ]
    assert codes(procs, tmp) == [0, 0, 0]
    ref_dir = tmp_path / "reference"
    ref_dir.mkdir()
    ref_out = ref_dir / "final.pt"
    ref_log = ["--out", str(ref_out), "--log-samples", str(ref_dir / "samples")]
    reference = replica(ref_dir, 0, 1, pick_master_port(), ref_log, POLLUX_ACCUM_STEPS="2")
    assert codes([reference], ref_dir) == [0]
    warm, ref = torch.load(out, weights_only=False), torch.load(ref_out, weights_only=False)
    assert warm["steps"] == ref["steps"] == 32
    assert step_sequence(tmp / "samples") == step_sequence(ref_dir / "samples")
    replicas_seen = {path.name.split(".")[1] for path in tmp.glob("samples.rank*")}
    assert replicas_seen == {"rank0", "rank1"}  # it did run on two replicas in between
    for name, tensor in ref["model"].items():
        torch.testing.assert_close(warm["model"][name], tensor, rtol=0, atol=1e-5)
