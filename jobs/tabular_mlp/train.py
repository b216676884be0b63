"""Tabular MLP: a three-layer perceptron diagnosing breast tumours from 30 measurements.

Data: the Wisconsin diagnostic breast-cancer set (569 cases, 2 classes) that scikit-learn
ships inside its package (``sklearn.datasets.load_breast_cancer``; nothing is downloaded).
Features are standardised with training-set statistics; a fixed seeded split keeps 114 cases
for testing.  Target (job.toml): test accuracy >= 0.95, reached in seconds on one CPU core.

``--max-epochs`` shortens the run for tests.  Exit code 0 when the target is reached, 3 when
it is missed, 75 when stopped for a rescale.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

from pollux_local.torch import ElasticTrainer, load_training_spec

SPEC = load_training_spec(Path(__file__).with_name("job.toml"))


def load_tables(seed: int) -> tuple[TensorDataset, TensorDataset]:
    from sklearn.datasets import load_breast_cancer

    table = load_breast_cancer()
    x = torch.tensor(table.data, dtype=torch.float32)
    y = torch.tensor(table.target, dtype=torch.long)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    test, train = order[:114], order[114:]
    mean, std = x[train].mean(dim=0), x[train].std(dim=0)
    x = (x - mean) / std
    return TensorDataset(x[train], y[train]), TensorDataset(x[test], y[test])


def make_model() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(30, 64),
        torch.nn.ReLU(),
        torch.nn.Linear(64, 64),
        torch.nn.ReLU(),
        torch.nn.Linear(64, 2),
    )


@torch.no_grad()
def accuracy(model: torch.nn.Module, data: TensorDataset, device: torch.device) -> float:
    x, y = data.tensors
    return (model(x.to(device)).argmax(dim=1) == y.to(device)).float().mean().item()


def main() -> int:
    parser = argparse.ArgumentParser(description="tabular MLP (pollux-local example job)")
    parser.add_argument("--max-epochs", type=int, default=30)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    train, test = load_tables(args.seed)
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    trainer = ElasticTrainer(model, optimizer, **SPEC.trainer_kwargs())
    loader = trainer.loader(train, seed=args.seed)
    device = trainer.device

    acc = accuracy(trainer.module, test, device)
    for epoch in trainer.epochs(args.max_epochs):
        for x, y in loader:
            loss = F.cross_entropy(trainer.model(x.to(device)), y.to(device))
            trainer.step(loss)
        acc = accuracy(trainer.module, test, device)
        trainer.report_metrics(loss=loss.item(), test_accuracy=acc)
        if trainer.rank == 0:
            print(
                f"epoch {epoch} loss {loss.item():.4f} test_accuracy {acc:.4f} "
                f"progress {trainer.progress:.0f} batch {trainer.total_batch}",
                flush=True,
            )
        # stop once the target holds two epochs running (one lucky epoch is not enough)
        if SPEC.target.reached(acc) and trainer.state.get("reached_before", False):
            break
        trainer.state["reached_before"] = SPEC.target.reached(acc)
    trainer.close()
    if trainer.rank == 0:
        print(SPEC.target.final_line(acc), flush=True)
    return 0 if SPEC.target.reached(acc) else 3


if __name__ == "__main__":
    sys.exit(main())
