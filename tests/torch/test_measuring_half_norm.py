"""The one-replica measuring step without a split: ``gradstats.HalfBatchNorm`` gives the same
g_small as a separate backward over the first half of the samples, and the trainer falls back
to the split step where the hooks cannot see every gradient."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from torch.utils.data import TensorDataset  # noqa: E402

from pollux_local.torch import ElasticTrainer, LaunchEnvironment  # noqa: E402
from pollux_local.torch.gradstats import HalfBatchNorm  # noqa: E402

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


def _half_gradient_sq(
    model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, pre: dict[int, torch.Tensor]
) -> float:
    """|g_A|^2 by a separate backward over the first half A (what a split step measures)."""
    model.zero_grad()
    half = x.shape[0] // 2
    loss = F.cross_entropy(model(x[:half]).reshape(-1, 3), y[:half].reshape(-1))
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
    hooks sum, rescaled as the trainer rescales it, is the half batch's own."""
    gen = torch.Generator().manual_seed(5)
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(width, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    rows = 10
    shape = (rows, 4, width) if sequence else (rows, width)
    x = torch.randn(*shape, generator=gen)
    y = torch.randint(0, 3, shape[:-1], generator=gen)
    pre = (
        {id(p): torch.rand(p.shape, generator=gen) + 0.5 for p in model.parameters()}
        if preconditioned
        else {}
    )
    expected = _half_gradient_sq(model, x, y, pre)

    norm = HalfBatchNorm.for_model(model)
    assert norm is not None
    norm.arm(rows, (lambda p: pre[id(p)]) if preconditioned else None)
    weight = 0.75  # a loss weight, as the sampler gives
    (weight * F.cross_entropy(model(x).reshape(-1, 3), y.reshape(-1))).backward()
    found = norm.result()
    assert found is not None and not norm.armed
    summed, half = found
    assert half == rows // 2
    scale = rows / (half * weight)
    assert float(summed) * scale**2 == pytest.approx(expected, rel=1e-4)


def test_models_the_hooks_cannot_cover_are_refused() -> None:
    conv = torch.nn.Sequential(torch.nn.Conv1d(2, 2, 3), torch.nn.Flatten(), torch.nn.Linear(4, 2))
    batchnorm = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.BatchNorm1d(3, affine=False))
    for model in (conv, batchnorm):
        assert HalfBatchNorm.for_model(model) is None
    frozen_conv = torch.nn.Sequential(
        torch.nn.Conv1d(2, 2, 3), torch.nn.Flatten(), torch.nn.Linear(4, 2)
    )
    frozen_conv[0].requires_grad_(False)
    assert HalfBatchNorm.for_model(frozen_conv) is not None


def test_a_layer_called_twice_in_a_step_gives_no_measurement() -> None:
    """A layer applied twice (its two uses' cross terms are not in the sum), or to rows that
    are not the step's samples: no measurement."""
    layer = torch.nn.Linear(3, 3)
    norm = HalfBatchNorm.for_model(torch.nn.Sequential(layer, torch.nn.ReLU(), layer))
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


def _measurements(model: torch.nn.Module, split: bool) -> tuple[list[tuple[float, ...]], int]:
    """Every step measured for one epoch; the raw (small_sq, small_b, big_sq, big_b) of each,
    and the number of optimizer steps whose plan was split."""
    trainer = ElasticTrainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.05),
        base_batch=16,
        env=LaunchEnvironment(),
        adapt=False,
        stats_interval=1,
        stats_budget=None,
        report_interval_s=1e9,
        checkpoint_interval_s=None,
        handle_sigterm=False,
    )
    if split:
        trainer._half_norm = None
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


def test_the_trainer_measures_without_splitting_and_as_the_split_step_did() -> None:
    """One replica, no accumulation: every step measured, none split; each measurement is
    the one the split step makes of the same samples (to rounding), so the estimate keeps
    the split step's unbiasedness."""

    def model() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))

    hooked, hooked_splits = _measurements(model(), split=False)
    split, split_splits = _measurements(model(), split=True)
    assert hooked_splits == 0 and split_splits == len(split) == 10
    assert len(hooked) == len(split)
    for a, b in zip(hooked, split, strict=True):
        assert a[1] == b[1] == 8 and a[3] == b[3] == 16
        assert a[0] == pytest.approx(b[0], rel=1e-3)
        assert a[2] == pytest.approx(b[2], rel=1e-3)


def test_a_weight_used_outside_its_layer_falls_back_to_splitting() -> None:
    """The first hooked measurement is checked against |.grad|^2 over all rows; a model
    whose gradients the hooks miss measures with split steps from then on."""
    torch.manual_seed(0)
    raw, split_steps = _measurements(Tied(), split=False)
    assert split_steps == 9  # the first (checked) step measured nothing, the nine others split
    assert len(raw) == 9
