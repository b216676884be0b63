"""The one-replica measuring step without a split: ``gradstats.SmallBatchGradNorm`` gives the
squared norm a separate backward over the first quarter of the samples gives, the estimate
stays unbiased, and the trainer falls back to the split step where the hooks cannot see every
gradient."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from torch.utils.data import TensorDataset  # noqa: E402

from pollux_local.torch import ElasticTrainer, LaunchEnvironment  # noqa: E402
from pollux_local.torch.gradstats import SmallBatchGradNorm  # noqa: E402

pytestmark = pytest.mark.timeout(60)

F = torch.nn.functional


class Tied(torch.nn.Module):
    """A weight used inside its layer and again outside it (what the hooks cannot see)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = torch.nn.Linear(6, 6)
        self.out = torch.nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inner(x))
        return self.out(F.linear(h, self.inner.weight))


def _small_gradient_sq(
    model: torch.nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    pre: dict[int, torch.Tensor],
    small: int,
) -> float:
    """|g_A|^2 by a separate backward over the first ``small`` samples A."""
    model.zero_grad()
    loss = F.cross_entropy(model(x[:small]).reshape(-1, 3), y[:small].reshape(-1))
    loss.backward()
    total = 0.0
    for p in model.parameters():
        assert p.grad is not None
        g = p.grad.double() / pre[id(p)].double() if id(p) in pre else p.grad.double()
        total += float(g.square().sum())
    model.zero_grad()
    return total


@pytest.mark.parametrize("sequence", [False, True])
@pytest.mark.parametrize("preconditioned", [False, True])
@pytest.mark.parametrize("width", [4, 64])
def test_hooks_give_the_first_halfs_gradient_norm(
    sequence: bool, preconditioned: bool, width: int
) -> None:
    """Rows of samples (and of a sample's positions), through the Gram matrices (few rows)
    and the direct product (many), with and without a preconditioner: the squared norm the
    hooks sum, rescaled as the trainer rescales it, is the first quarter's own."""
    gen = torch.Generator().manual_seed(5)
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(width, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    rows = 12
    shape = (rows, 4, width) if sequence else (rows, width)
    x = torch.randn(*shape, generator=gen)
    y = torch.randint(0, 3, shape[:-1], generator=gen)
    pre = (
        {id(p): torch.rand(p.shape, generator=gen) + 0.5 for p in model.parameters()}
        if preconditioned
        else {}
    )
    expected = _small_gradient_sq(model, x, y, pre, rows // 4)

    norm = SmallBatchGradNorm.for_model(model)
    assert norm is not None
    norm.arm(rows, (lambda p: pre[id(p)]) if preconditioned else None)
    weight = 0.75  # a loss weight, as the sampler gives
    (weight * F.cross_entropy(model(x).reshape(-1, 3), y.reshape(-1))).backward()
    found = norm.result()
    assert found is not None and not norm.armed
    terms, small = found
    assert small == rows // 4 == 3
    scale = rows / (small * weight)
    assert sum(float(term) for term in terms) * scale**2 == pytest.approx(expected, rel=1e-4)


def test_models_the_hooks_cannot_cover_are_refused() -> None:
    conv = torch.nn.Sequential(torch.nn.Conv1d(2, 2, 3), torch.nn.Flatten(), torch.nn.Linear(4, 2))
    batchnorm = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.BatchNorm1d(3, affine=False))
    for model in (conv, batchnorm):
        assert SmallBatchGradNorm.for_model(model) is None
    frozen_conv = torch.nn.Sequential(
        torch.nn.Conv1d(2, 2, 3), torch.nn.Flatten(), torch.nn.Linear(4, 2)
    )
    frozen_conv[0].requires_grad_(False)
    assert SmallBatchGradNorm.for_model(frozen_conv) is not None


def test_a_layer_called_twice_in_a_step_gives_no_measurement() -> None:
    """A layer applied twice (its two uses' cross terms are not in the sum), or to rows that
    are not the step's samples: no measurement."""
    layer = torch.nn.Linear(3, 3)
    norm = SmallBatchGradNorm.for_model(torch.nn.Sequential(layer, torch.nn.ReLU(), layer))
    assert norm is not None
    norm.arm(4, None)
    layer(torch.relu(layer(torch.randn(4, 3)))).sum().backward()
    assert norm.result() is None
    norm.arm(4, None)
    layer(torch.randn(3, 4, 3)).sum().backward()  # sequence-first rows
    assert norm.result() is None


def _dataset(samples: int, width: int) -> TensorDataset:
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(samples, width, generator=gen)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0).long()
    return TensorDataset(x, y, torch.arange(samples))


def _trainer(model: torch.nn.Module, base_batch: int) -> ElasticTrainer:
    return ElasticTrainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.05),
        base_batch=base_batch,
        env=LaunchEnvironment(),
        adapt=False,
        stats_interval=1,
        stats_budget=None,
        min_stats_samples=1,
        report_interval_s=1e9,
        checkpoint_interval_s=None,
        handle_sigterm=False,
    )


def _measurements(model: torch.nn.Module) -> tuple[list[tuple[float, ...]], int]:
    """Every step measured for one epoch; the raw (small_sq, small_b, big_sq, big_b) of each,
    and the number of optimizer steps whose plan was split."""
    trainer = _trainer(model, 16)
    raw: list[tuple[float, ...]] = []
    update = trainer.estimator.update

    def keep(small_sq: float, small_b: float, big_sq: float, big_b: float) -> None:
        raw.append((small_sq, small_b, big_sq, big_b))
        update(small_sq, small_b, big_sq, big_b)

    trainer.estimator.update = keep  # type: ignore[method-assign]
    loader = trainer.loader(_dataset(160, 6))
    split_steps = 0
    for _ in trainer.epochs(1):
        for x, y, _ in loader:
            micro = trainer._micro
            assert micro is not None
            split_steps += micro[0].split and micro[1] == 0
            trainer.step(F.cross_entropy(trainer.model(x), y))
    trainer.close()
    return raw, split_steps


def test_the_trainer_measures_linear_models_without_splitting() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    raw, split_steps = _measurements(model)
    assert split_steps == 0
    assert len(raw) == 10
    assert all(r[1] == 4 and r[3] == 16 for r in raw)


class LinearLoss(torch.nn.Module):
    """loss_r = w . x_r: the per-sample gradient is x_r whatever w, so |G|^2 = |mean x|^2
    and tr(S) is the summed variance of x, known from the data."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(dim, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x).mean()


@pytest.mark.parametrize("hooks", [True, False])
def test_the_estimate_recovers_known_statistics_with_hooks_or_split_steps(hooks: bool) -> None:
    """Unbiased either way: the smoothed |G|^2 and tr(S)/M0 of a task whose truth is known
    from its data are within 10% after one epoch measured at every step."""
    dim, samples, base = 2000, 2048, 32  # the probe's quadratic task (test_distributed)
    gen = torch.Generator().manual_seed(11)
    x = 0.2 + torch.randn(samples, dim, generator=gen)  # as the probe's quadratic task
    data = TensorDataset(x, torch.arange(samples))
    sqr = float(x.mean(0).square().sum())
    var = float(x.var(0, unbiased=False).sum()) / base
    trainer = _trainer(LinearLoss(dim), base)
    if not hooks:
        trainer._small_norm = None
    assert (trainer._small_norm is not None) == hooks
    loader = trainer.loader(data)
    for _ in trainer.epochs(1):
        for xb, _ in loader:
            trainer.step(trainer.model(xb))
    trainer.close()
    stats = trainer.estimator.smoothed
    assert stats is not None and trainer.estimator.samples == samples // base
    assert abs(stats.sqr - sqr) / sqr < 0.10, (stats, sqr, var)
    assert abs(stats.var - var) / var < 0.10, (stats, sqr, var)


def test_a_weight_used_outside_its_layer_falls_back_to_splitting() -> None:
    """The first hooked measurement is checked against |.grad|^2 over all rows; a model
    whose gradients the hooks miss measures with split steps from then on."""
    torch.manual_seed(0)
    raw, split_steps = _measurements(Tied())
    assert split_steps == 9  # the first (checked) step measured nothing, the nine others split
    assert len(raw) == 9
