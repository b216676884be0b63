"""In-process tests of pollux_local.torch: sampler, estimator, checkpoints, bad input, reports,
learning-rate scaling and batch adaptation (one process, no process group)."""

from __future__ import annotations

import json
import math
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from pollux_local.api import wire  # noqa: E402
from pollux_local.api.messages import Report, ReportReply, Request  # noqa: E402
from pollux_local.api.report import JobReport  # noqa: E402
from pollux_local.api.states import ExitCode  # noqa: E402
from pollux_local.core.types import GradStats  # noqa: E402
from pollux_local.errors import PolluxError  # noqa: E402
from pollux_local.torch import (  # noqa: E402
    CheckpointStore,
    ElasticSampler,
    ElasticTrainer,
    GradNoiseEstimator,
    LaunchEnvironment,
    job_environment,
    two_batch_estimate,
)
from pollux_local.torch.checkpoint import load_file  # noqa: E402
from pollux_local.torch.gradstats import squared_norm  # noqa: E402
from pollux_local.torch.measuring import (  # noqa: E402
    MAX_STATS_INTERVAL,
    MeasuringSchedule,
    typical_time,
)
from pollux_local.torch.report import Reporter  # noqa: E402

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(autouse=True)
def sigterm_restored() -> Iterator[None]:
    """Puts back this process's SIGTERM handler after each test (a trainer with checkpoints
    installs its own, and one that stops ignores SIGTERM)."""
    previous = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, previous)


# ----------------------------------------------------------------------------- sampler
@settings(max_examples=40, deadline=None)
@given(
    samples=st.integers(1, 97),
    configs=st.lists(
        st.tuples(st.integers(1, 4), st.integers(1, 9), st.integers(1, 3), st.booleans()),
        min_size=1,
        max_size=6,
    ),
)
def test_sampler_visits_each_sample_once_whatever_the_scale(
    samples: int, configs: list[tuple[int, int, int, bool]]
) -> None:
    sampler = ElasticSampler(samples, seed=3)
    seen: list[int] = []
    step = 0
    while True:
        k, m, s, split = configs[step % len(configs)]
        plan = sampler.plan_step(k, m, s, split)
        if plan is None:
            break
        for micro in plan.micro:
            for idx, w in zip(micro.indices, micro.weights, strict=True):
                if w > 0:
                    seen.extend(idx.tolist())
                    # every real sample carries the same weight 1/N in the averaged gradient
                    assert w / (k * len(idx)) == pytest.approx(1.0 / plan.total)
        assert plan.total <= k * m * s
        sampler.advance(plan.total)
        step += 1
    assert sorted(seen) == list(range(samples))
    assert seen == sampler.permutation().tolist()


def test_sampler_permutation_depends_on_seed_and_epoch_only() -> None:
    a, b = ElasticSampler(50, seed=1), ElasticSampler(50, seed=1)
    assert a.permutation().tolist() == b.permutation().tolist()
    first = a.permutation().tolist()
    a.next_epoch()
    assert a.permutation().tolist() != first
    assert sorted(a.permutation().tolist()) == list(range(50))


def test_sampler_rejects_bad_configuration() -> None:
    with pytest.raises(PolluxError, match="empty"):
        ElasticSampler(0)
    with pytest.raises(PolluxError, match="positive"):
        ElasticSampler(10).plan_step(1, 0, 1)
    sampler = ElasticSampler(10)
    with pytest.raises(PolluxError, match="10 samples"):
        ElasticSampler(11).load_state_dict(sampler.state_dict())


def test_a_checkpoint_at_an_epochs_end_resumes_at_the_next_epoch() -> None:
    # a stop right after an epoch's last step saves the position at its end: resuming there
    # would hand the job's loop an epoch with no batch (its `loss` then never set)
    sampler = ElasticSampler(10)
    sampler.epoch = 3
    sampler.advance(10)
    resumed = ElasticSampler(10)
    resumed.load_state_dict(sampler.state_dict())
    assert (resumed.epoch, resumed.position, resumed.remaining) == (4, 0, 10)
    sampler.position = 7  # mid-epoch: resumed where it was
    resumed.load_state_dict(sampler.state_dict())
    assert (resumed.epoch, resumed.position) == (3, 7)
    # a replica staying through a warm resize at an epoch's end keeps that epoch's end: its
    # loop, in that epoch, ends it (jumping to the next epoch inside it served the next
    # epoch's samples under the last epoch's number)
    sampler.position = 10
    stays = ElasticSampler(10)
    stays.load_state_dict(sampler.state_dict(), resume=False)
    assert (stays.epoch, stays.position, stays.remaining) == (3, 10, 0)


# ----------------------------------------------------------------------------- estimator
def test_two_batch_estimate_is_exact_on_expectations() -> None:
    sqr, trace = 3.0, 40.0
    small = sqr + trace / 8
    big = sqr + trace / 32
    got_sqr, got_trace = two_batch_estimate(small, 8, big, 32)
    assert got_sqr == pytest.approx(sqr)
    assert got_trace == pytest.approx(trace)
    with pytest.raises(ValueError):
        two_batch_estimate(small, 32, big, 32)


def test_estimator_smooths_with_bias_correction_and_round_trips() -> None:
    est = GradNoiseEstimator(base_batch=16, smoothing=0.9, min_samples=1)
    assert est.stats is None
    est.update(3.0 + 40 / 8, 8, 3.0 + 40 / 32, 32)
    assert est.stats == GradStats(sqr=pytest.approx(3.0), var=pytest.approx(40 / 16))
    est.update(5.0 + 40 / 8, 8, 5.0 + 40 / 32, 32)
    assert 3.0 < est.stats.sqr < 5.0  # type: ignore[union-attr]
    other = GradNoiseEstimator(base_batch=32, min_samples=1)
    other.load_state_dict(est.state_dict())
    assert other.stats.var == pytest.approx(est.stats.var / 2)  # type: ignore[union-attr]


def test_estimator_withholds_untrusted_statistics() -> None:
    """Too few measurements, or a smoothed |G|^2 <= 0, give no statistics (base learning rate,
    no large-batch gain); a negative smoothed variance reads as 0."""
    est = GradNoiseEstimator(base_batch=16, smoothing=0.5, min_samples=3)
    for _ in range(2):
        est.update(3.0 + 40 / 8, 8, 3.0 + 40 / 32, 32)
    assert est.stats is None  # two samples < min_samples
    est.update(3.0 + 40 / 8, 8, 3.0 + 40 / 32, 32)
    assert est.stats is not None and est.stats.sqr == pytest.approx(3.0)
    noisy = GradNoiseEstimator(base_batch=16, min_samples=1)
    noisy.update(1.0 + 40 / 8, 8, -2.0 + 40 / 32, 32)  # |G|^2 estimate below zero
    assert noisy.stats is None
    calm = GradNoiseEstimator(base_batch=16, min_samples=1)
    calm.update(2.0, 8, 3.0, 32)  # the small batch's norm below the big one's: var < 0
    assert calm.stats is not None and calm.stats.var == 0.0


# ----------------------------------------------------------------------------- checkpoints
def test_checkpoint_round_trip_and_pruning(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, keep=2)
    for step in (1, 2, 3):
        store.save(step, {"step": step, "t": torch.arange(3) * step})
    assert [s for s, _ in store.files()] == [3, 2]
    payload, path = store.load_latest()  # type: ignore[misc]
    assert payload["step"] == 3 and torch.equal(payload["t"], torch.arange(3) * 3)
    assert not list(tmp_path.glob(".*tmp*"))
    (tmp_path / ".ckpt-0000000009.pt.tmp.1").write_bytes(b"half")
    store.save(4, {"step": 4})
    assert not list(tmp_path.glob(".*tmp*"))


def test_corrupt_newest_checkpoint_falls_back_and_is_kept(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    store.save(1, {"step": 1})
    newest = store.save(2, {"step": 2})
    data = bytearray(newest.read_bytes())
    data[-10] ^= 0xFF
    newest.write_bytes(bytes(data))
    payload, path = store.load_latest()  # type: ignore[misc]
    assert payload["step"] == 1
    assert (tmp_path / (newest.name + ".corrupt")).exists()
    # a later save does not remove the good one it fell back to until a newer good one exists
    store.save(2, {"step": 2})
    assert [s for s, _ in store.files()] == [2, 1]


def test_all_checkpoints_corrupt_or_missing_is_a_clear_error(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    path = store.save(5, {"step": 5})
    path.write_bytes(path.read_bytes()[:20])
    with pytest.raises(PolluxError, match="no usable checkpoint"):
        store.load_latest()
    with pytest.raises(PolluxError, match="does not exist"):
        load_file(tmp_path / "nope.pt")
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint at all")
    with pytest.raises(PolluxError, match="not a pollux-local checkpoint"):
        load_file(tmp_path / "junk.pt")
    assert CheckpointStore(tmp_path / "empty").load_latest() is None


# ----------------------------------------------------------------------------- bad input
def _model_opt() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


@pytest.mark.parametrize(
    ("kwargs", "env", "message"),
    [
        ({"base_batch": 0}, LaunchEnvironment(), "base_batch must be a positive"),
        ({"base_batch": -4}, LaunchEnvironment(), "base_batch must be a positive"),
        ({"base_batch": 32, "max_batch": 16}, LaunchEnvironment(), "below the base batch"),
        (
            {"base_batch": 8, "min_local": 16, "max_local": 4},
            LaunchEnvironment(),
            "below the minimum",
        ),
        (
            {"base_batch": 8, "max_batch": 16, "min_local": 8},
            LaunchEnvironment(world_size=4, rank=0),
            "cannot hold on 4 replicas",
        ),
        (
            {"base_batch": 8, "max_local": 16},
            LaunchEnvironment(local_batch=32),
            "outside the job's local",
        ),
        ({"base_batch": 8, "lr_rule": "cubic"}, LaunchEnvironment(), "unknown lr_rule"),
    ],
)
def test_bad_batch_input_is_a_clear_error(
    kwargs: dict[str, object], env: LaunchEnvironment, message: str
) -> None:
    model, opt = _model_opt()
    with pytest.raises(PolluxError, match=message):
        ElasticTrainer(model, opt, env=env, **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        ({"RANK": "x"}, "RANK must be an integer"),
        ({"WORLD_SIZE": "2", "RANK": "2"}, "outside 0..1"),
        ({"POLLUX_LOCAL_BATCH": "0"}, "POLLUX_LOCAL_BATCH must be positive"),
        ({"POLLUX_PG_TIMEOUT_S": "soon"}, "POLLUX_PG_TIMEOUT_S"),
        ({"POLLUX_DEVICE": "tpu"}, "POLLUX_DEVICE"),
    ],
)
def test_bad_launch_environment_is_a_clear_error(environ: dict[str, str], message: str) -> None:
    with pytest.raises(PolluxError, match=message):
        job_environment(environ)


def test_launch_environment_is_read() -> None:
    env = job_environment(
        {
            "RANK": "1",
            "WORLD_SIZE": "4",
            "LOCAL_RANK": "1",
            "LOCAL_WORLD_SIZE": "2",
            "POLLUX_JOB_ID": "j7",
            "POLLUX_RESTARTS": "3",
            "POLLUX_CHECKPOINT_DIR": "/tmp/x",
            "POLLUX_LOCAL_BATCH": "24",
            "POLLUX_ACCUM_STEPS": "2",
        }
    )
    assert (env.rank, env.world_size, env.num_nodes, env.restarts) == (1, 4, 2, 3)
    assert (env.local_batch, env.accum_steps, env.job_id) == (24, 2, "j7")
    assert env.checkpoint_dir == "/tmp/x"
    assert job_environment({}).distributed is False


# ----------------------------------------------------------------------------- one-process training
def _dataset(n: int = 64) -> torch.utils.data.TensorDataset:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(n, 4, generator=gen)
    return torch.utils.data.TensorDataset(x, (x[:, 0] > 0).long(), torch.arange(n))


def _train(trainer: ElasticTrainer, epochs: int, stop_at: int | None = None) -> list[int]:
    seen = []
    loader = trainer.loader(_dataset())
    for _ in trainer.epochs(epochs):
        for x, y, idx in loader:
            seen.extend(idx.tolist())
            loss = torch.nn.functional.cross_entropy(trainer.model(x), y)
            if trainer.step(loss) and trainer.steps == stop_at:
                trainer.request_stop()
    return seen


def test_stop_checkpoints_exits_75_and_resumes_exactly(tmp_path: Path) -> None:
    model, opt = _model_opt()
    ref = ElasticTrainer(model, opt, base_batch=8, env=LaunchEnvironment(), report_interval_s=1e9)
    ref_seen = _train(ref, 2)

    model, opt = _model_opt()
    first = ElasticTrainer(
        model, opt, base_batch=8, env=LaunchEnvironment(), checkpoint_dir=tmp_path
    )
    with pytest.raises(SystemExit) as exc:
        _train(first, 2, stop_at=11)
    assert exc.value.code == ExitCode.RESCALE
    # Once it is leaving, a late SIGTERM (a peer's flag can come before the signal) is ignored
    # rather than killing the exit at interpreter shutdown.
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
    model, opt = _model_opt()
    second = ElasticTrainer(
        model, opt, base_batch=8, env=LaunchEnvironment(), checkpoint_dir=tmp_path
    )
    assert second.steps == 11 and second.epoch == 1
    seen_first = ref_seen[: 11 * 8]
    seen = seen_first + _train(second, 2)
    assert seen == ref_seen
    for a, b in zip(ref.module.parameters(), second.module.parameters(), strict=True):
        assert torch.allclose(a, b, atol=1e-6)
    assert second.progress == pytest.approx(ref.progress)


def test_restore_skips_a_corrupt_newest_checkpoint(tmp_path: Path) -> None:
    model, opt = _model_opt()
    trainer = ElasticTrainer(
        model, opt, base_batch=8, env=LaunchEnvironment(), checkpoint_dir=tmp_path
    )
    _train(trainer, 1)
    good = trainer.checkpoint()
    trainer.steps += 1
    bad = trainer.checkpoint()
    assert good is not None and bad is not None
    bad.write_bytes(b"PLXCKPT1" + b"\0" * 40)
    model, opt = _model_opt()
    again = ElasticTrainer(
        model, opt, base_batch=8, env=LaunchEnvironment(), checkpoint_dir=tmp_path
    )
    assert again.steps == trainer.steps - 1
    with pytest.raises(PolluxError, match="does not exist"):
        again.restore_from(tmp_path / "missing.pt")


def test_user_state_and_scheduler_are_checkpointed(tmp_path: Path) -> None:
    model, opt = _model_opt()
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    trainer = ElasticTrainer(
        model,
        opt,
        base_batch=8,
        env=LaunchEnvironment(),
        checkpoint_dir=tmp_path,
        lr_scheduler=sched,
        state={"best": 0.75},
    )
    opt.step()
    sched.step()
    trainer.state["best"] = 0.9
    trainer.checkpoint()
    model, opt = _model_opt()
    sched2 = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    again = ElasticTrainer(
        model,
        opt,
        base_batch=8,
        env=LaunchEnvironment(),
        checkpoint_dir=tmp_path,
        lr_scheduler=sched2,
    )
    assert again.state["best"] == 0.9
    assert opt.param_groups[0]["lr"] == pytest.approx(0.05)


def test_adascale_scales_the_learning_rate_and_counts_progress() -> None:
    model, opt = _model_opt()
    trainer = ElasticTrainer(
        model,
        opt,
        base_batch=8,
        max_batch=64,
        adapt=False,
        env=LaunchEnvironment(local_batch=32),
        min_stats_samples=1,
    )
    seen_lr = []
    original = opt.step

    def recording_step(*args: object, **kwargs: object) -> object:
        seen_lr.append(opt.param_groups[0]["lr"])
        return original(*args, **kwargs)

    opt.step = recording_step  # type: ignore[method-assign]
    _train(trainer, 3)
    stats = trainer.grad_stats
    assert stats is not None
    assert max(seen_lr) > 0.1 and max(seen_lr) <= 0.1 * 4 + 1e-9
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1)  # the base lr is left untouched
    assert 1.0 < trainer.progress / trainer.steps <= 4.0


def test_goodput_adaptation_grows_the_batch_when_noise_is_high() -> None:
    def adapted(var: float) -> tuple[int, int]:
        model, opt = _model_opt()
        trainer = ElasticTrainer(model, opt, base_batch=8, max_batch=128, env=LaunchEnvironment())
        for m in (4, 8, 16):  # fixed cost dominates: larger micro-batches are nearly free
            for _ in range(5):
                t = 0.010 + 0.0001 * m
                trainer.profile.add_compute((1, 1, m), t)
                trainer.profile.add_step((1, 1, m), t)
        for _ in range(trainer.estimator.min_samples):
            trainer.estimator.update(1.0 + var * 8 / 4, 4, 1.0 + var * 8 / 8, 8)
        trainer._adapt()
        return trainer.local_batch, trainer.accum_steps

    assert adapted(var=1000.0)[0] > 8  # noise scale 8000 >> M0: a bigger batch is efficient
    assert adapted(var=0.001) == (8, 1)  # no noise: every extra example is wasted


def test_report_file_schema_and_unreachable_daemon(tmp_path: Path) -> None:
    model, opt = _model_opt()
    env = LaunchEnvironment(
        job_id="r1", job_dir=str(tmp_path), daemon_socket=str(tmp_path / "none.sock")
    )
    trainer = ElasticTrainer(
        model, opt, base_batch=8, max_batch=32, env=env, report_interval_s=0, min_stats_samples=1
    )
    start = time.perf_counter()
    _train(trainer, 1)
    trainer.report_metrics(loss=0.5)
    trainer.close()
    assert time.perf_counter() - start < 20
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["version"] == 1 and report["job_id"] == "r1"
    assert report["bounds"] == {
        "base_batch": 8,
        "max_batch": 32,
        "min_local": 1,
        "max_local": 32,
        "accumulation": True,
    }
    assert report["batch"] == {"local_batch": 8, "accum_steps": 1, "replicas": 1}
    assert report["epoch"] == 1 and report["epochs"] == 1 and report["progress"] > 0
    assert report["metrics"] == {"loss": 0.5}
    assert {"sqr", "var"} <= set(report["grad_stats"])
    rows = report["profile"]
    assert rows and all(r["compute_s"] > 0 and r["step_s"] >= r["compute_s"] for r in rows)
    assert {r["local_batch"] for r in rows} <= {4, 8}


def test_reporter_never_raises_when_the_daemon_is_away(tmp_path: Path) -> None:
    reporter = Reporter("7", None, str(tmp_path / "missing.sock"))
    start = time.perf_counter()
    reporter.submit(JobReport())
    reporter.flush()
    assert time.perf_counter() - start < 3.0
    assert reporter.sent == 0


def test_generic_datasets_are_collated() -> None:
    model, opt = _model_opt()
    trainer = ElasticTrainer(model, opt, base_batch=4, env=LaunchEnvironment())
    data = [(torch.randn(4), i % 2) for i in range(10)]
    loader = trainer.loader(data)  # type: ignore[arg-type]
    sizes = []
    for _ in trainer.epochs(1):
        for x, y in loader:
            sizes.append(len(x))
            trainer.step(torch.nn.functional.cross_entropy(trainer.model(x), y))
    assert sum(sizes) == 10
    with pytest.raises(PolluxError, match="once for each batch"):
        trainer.step(torch.tensor(0.0, requires_grad=True))


def test_adam_statistics_are_preconditioned_and_finite() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    trainer = ElasticTrainer(
        model,
        opt,
        base_batch=8,
        env=LaunchEnvironment(),
        stats_interval=1,
        stats_budget=None,
        min_stats_samples=5,
    )
    assert trainer.precondition
    _train(trainer, 2)
    # every step measured (16 steps); |G|^2 of this tiny task is noise around 0, so the
    # smoothed values are checked, not the trusted ones
    stats, errors = trainer.estimator.smoothed, trainer.estimator.stderr
    assert trainer.estimator.samples == trainer.steps == 16
    assert stats is not None and errors is not None
    assert math.isfinite(stats.sqr) and math.isfinite(stats.var) and stats.var > 0
    assert 0 < errors.sqr < math.inf and 0 < errors.var < math.inf
    assert trainer._preconditioner(next(model.parameters())) is not None


def test_fused_squared_norm_matches_the_per_parameter_sum() -> None:
    """One _foreach_div and one _foreach_norm give sum_i |g_i / p_i|^2 (p_i None: g_i as it
    is), in float32 whatever the gradients' dtype."""
    gen = torch.Generator().manual_seed(3)
    grads = [torch.randn(7, 5, generator=gen), torch.randn(11, generator=gen).half()]
    grads.append(torch.randn(3, 3, generator=gen))
    pre = [torch.rand(7, 5, generator=gen) + 0.1, None, torch.rand(3, 3, generator=gen) + 0.1]
    expected = sum(
        float((g.double() if p is None else g.double() / p.double()).square().sum())
        for g, p in zip(grads, pre, strict=True)
    )
    got = squared_norm(grads, pre)
    assert got.dtype == torch.float32 and got.dim() == 0
    assert float(got) == pytest.approx(expected, rel=1e-5)
    plain = sum(float(g.double().square().sum()) for g in grads)
    assert float(squared_norm(grads)) == pytest.approx(plain, rel=1e-5)


def test_estimator_band_covers_known_statistics() -> None:
    """Two-batch measurements of a known (|G|^2, tr(S)) with the noise of real ones: the
    smoothed estimate's 95% band (1.96 standard errors) holds the truth about 95% of the time,
    and its error shrinks as sqrt((1 - beta) / (1 + beta)) of one measurement's."""
    gen = torch.Generator().manual_seed(7)
    sqr, trace, small, big = 2.0, 300.0, 32, 64
    covered = {"sqr": 0, "var": 0}
    runs = 400
    for _ in range(runs):
        est = GradNoiseEstimator(base_batch=32, smoothing=0.9, min_samples=1)
        for _ in range(60):
            noise = torch.randn(2, generator=gen).tolist()
            small_sq = sqr + trace / small + 4.0 * noise[0]
            big_sq = sqr + trace / big + 2.0 * noise[1]
            est.update(small_sq, small, big_sq, big)
        got, err = est.smoothed, est.stderr
        assert got is not None and err is not None
        covered["sqr"] += abs(got.sqr - sqr) <= 1.96 * err.sqr
        covered["var"] += abs(got.var - trace / 32) <= 1.96 * err.var
    for name, count in covered.items():
        assert 0.90 <= count / runs <= 0.99, (name, count / runs)


def test_measuring_steps_come_every_k_steps_and_cuda_times_only_around_them() -> None:
    """``stats_interval`` k: steps 0, k, 2k, ... measure; where timing costs a device
    synchronisation only measuring steps and the step before each are timed; the budget
    rule spaces measuring steps so their extra cost stays within it, up to the cap."""
    schedule = MeasuringSchedule(stats_interval=4, stats_budget=None, replicas=1)
    measured, timed = [], []
    for step in range(12):
        if schedule.begin_step():
            measured.append(step)
        if schedule.timed():
            timed.append(step)
        schedule.end_step()
    assert measured == [0, 4, 8]
    assert timed == [0, 3, 4, 7, 8, 11]
    budget = MeasuringSchedule(stats_interval=2, stats_budget=0.01, replicas=1)
    for _ in range(4):  # a measuring step 10% slower than an ordinary one: k = 10
        budget.begin_step()
        budget.record_time(0.11 if budget.measuring else 0.10)
        budget.end_step()
    assert budget.interval == 10
    slow = MeasuringSchedule(stats_interval=2, stats_budget=0.01, replicas=1)
    for _ in range(3):  # a measuring step twice as long: 100 steps wanted, capped
        slow.begin_step()
        slow.record_time(0.2 if slow.measuring else 0.1)
        slow.end_step()
    assert slow.interval == MAX_STATS_INTERVAL
    # step times are means of the last ones without stretched steps: one ordinary step
    # stretched fivefold by another process does not move the spacing
    spiked = MeasuringSchedule(stats_interval=2, stats_budget=0.01, replicas=1)
    kinds = []
    for seconds in [0.11, 0.10, 0.11] + [0.10] * 3 + [0.50] + [0.10] * 5 + [0.11]:
        kinds.append(spiked.begin_step())
        spiked.record_time(seconds)
        spiked.end_step()
    assert [i for i, measuring in enumerate(kinds) if measuring] == [0, 2, 12]
    assert spiked.interval == 10


def test_a_step_time_is_the_mean_of_the_steps_not_stretched() -> None:
    """Two-valued step times (some steps wait for the other rank, some do not) count at
    their mean, where a median would take one of the values; a step stretched to over
    three times the median is left out."""
    assert typical_time([0.06, 0.10, 0.06, 0.10, 0.50]) == pytest.approx(0.08)
    assert typical_time([0.06, 0.06, 0.14]) == pytest.approx(0.26 / 3)
    assert typical_time([0.2]) == pytest.approx(0.2)
    # measuring steps 0.01 s dearer on both kinds of step: about 11.5% extra at a mean of
    # 0.087 s, k = 10 to 13 at a 1% budget as the windows' ends fall; the difference of the
    # medians (0.06 against 0.07: 17%) would space them 17 apart
    schedule = MeasuringSchedule(stats_interval=2, stats_budget=0.01, replicas=1)
    plain = iter([0.06, 0.06, 0.14] * 40)
    measured = iter([0.07, 0.07, 0.15] * 10)
    for _ in range(90):
        schedule.begin_step()
        schedule.record_time(next(measured) if schedule.measuring else next(plain))
        schedule.end_step()
    assert 10 <= schedule.interval <= 13, schedule.interval


def test_reports_reach_a_daemon_socket_as_report_requests(tmp_path: Path) -> None:
    import socket
    import struct
    import threading

    path = str(tmp_path / "d.sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(4)
    server.settimeout(10)
    received: list[Request[Any]] = []

    def serve() -> None:
        conn, _ = server.accept()
        with conn:
            size = struct.unpack(">I", conn.recv(4, socket.MSG_WAITALL))[0]
            received.append(wire.decode_request(conn.recv(size, socket.MSG_WAITALL)))
            conn.sendall(wire.encode_reply(ReportReply(accepted=True)))

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    reporter = Reporter("9", None, path)
    reporter.submit(JobReport(progress=3.5))
    reporter.flush()
    thread.join(10)
    server.close()
    assert received == [Report(job_id="9", report=JobReport(progress=3.5))]
    assert reporter.sent == 1


def test_amp_scaler_leaves_statistics_and_updates_unchanged() -> None:
    def run(scaled: bool) -> tuple[GradStats, list[torch.Tensor]]:
        model, opt = _model_opt()
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0) if scaled else None
        trainer = ElasticTrainer(
            model,
            opt,
            base_batch=8,
            env=LaunchEnvironment(),
            scaler=scaler,
            stats_interval=1,
            stats_budget=None,
            min_stats_samples=1,
        )
        _train(trainer, 1)
        assert trainer.grad_stats is not None
        return trainer.grad_stats, [p.detach().clone() for p in model.parameters()]

    (plain_stats, plain_params), (amp_stats, amp_params) = run(False), run(True)
    assert amp_stats.sqr == pytest.approx(plain_stats.sqr, rel=1e-4)
    assert amp_stats.var == pytest.approx(plain_stats.var, rel=1e-4)
    for a, b in zip(plain_params, amp_params, strict=True):
        assert torch.allclose(a, b, atol=1e-6)


def test_the_job_side_reads_the_one_launch_environment() -> None:
    """``job_environment`` is ``api.LaunchEnvironment`` with its device resolved: the CPU
    when none is named and torch sees no CUDA, the declared slowdown kept on the CPU only."""
    env = job_environment({"POLLUX_DEVICE": "cpu", "POLLUX_DEVICE_SLOWDOWN": "2"})
    assert type(env) is LaunchEnvironment and env.device == "cpu"
    if not torch.cuda.is_available():
        assert job_environment({}).device == "cpu"
