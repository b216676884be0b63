"""Digits convnet: a two-layer CNN classifying 8x8 handwritten digits.

Data: the UCI optical-recognition digits set (1,797 images, 10 classes) that scikit-learn
ships inside its package (``sklearn.datasets.load_digits``; nothing is downloaded).  A fixed
seeded split keeps 360 images for testing.  Target (job.toml): test accuracy >= 0.97, reached
in well under a minute on one CPU core.

Run alone (``python jobs/digits_cnn/train.py``) or under pollux-local
(``pollux-local submit jobs/digits_cnn/job.toml``).  ``--max-epochs`` shortens it for tests.
Exit code 0 when the target is reached, 3 when it is missed, 75 when stopped for a rescale.
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


def load_digits_tensors(seed: int) -> tuple[TensorDataset, TensorDataset]:
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(digits.target, dtype=torch.long)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    test, train = order[:360], order[360:]
    return TensorDataset(x[train], y[train]), TensorDataset(x[test], y[test])


class DigitsNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = torch.nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = torch.nn.Conv2d(16, 32, 3, padding=1)
        self.fc1 = torch.nn.Linear(32 * 4 * 4, 64)
        self.fc2 = torch.nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


@torch.no_grad()
def accuracy(model: torch.nn.Module, data: TensorDataset, device: torch.device) -> float:
    model.eval()
    x, y = data.tensors
    correct = (model(x.to(device)).argmax(dim=1) == y.to(device)).sum().item()
    model.train()
    return correct / len(y)


def main() -> int:
    parser = argparse.ArgumentParser(description="digits convnet (pollux-local example job)")
    parser.add_argument("--max-epochs", type=int, default=40)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    train, test = load_digits_tensors(args.seed)
    model = DigitsNet()
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
                f"progress {trainer.progress:.0f} batch {trainer.total_batch} "
                f"(m={trainer.local_batch} s={trainer.accum_steps} K={trainer.replicas})",
                flush=True,
            )
        if SPEC.target.reached(acc):
            break
    trainer.close()
    if trainer.rank == 0:
        print(SPEC.target.final_line(acc), flush=True)
    return 0 if SPEC.target.reached(acc) else 3


if __name__ == "__main__":
    sys.exit(main())
