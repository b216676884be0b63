"""Character transformer: a 2-layer causal transformer language model over characters.

Data: the English help texts of the Python documentation that every CPython installation ships
as ``pydoc_data.topics`` (about 465,000 characters; nothing is downloaded).  Characters are
mapped to their code points below 128 (anything else to one "other" symbol); the text is cut
into windows of 64 characters; the last 10% of the text is held out for validation.
Target (job.toml): validation loss <= 1.75 nats per character (the character unigram
entropy of this text is about 3.2), a few minutes on one CPU core.

Adam is used, so the gradient statistics are preconditioned and the learning rate follows the
square-root rule.  ``--max-epochs`` shortens the run for tests.  Exit code 0 when the target is
reached, 3 when it is missed, 75 when stopped for a rescale.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

from pollux_local.torch import ElasticTrainer, load_training_spec

SPEC = load_training_spec(Path(__file__).with_name("job.toml"))
CONTEXT = 64
VOCAB = 128


def load_text_windows() -> tuple[TensorDataset, torch.Tensor]:
    """Training windows (input, next-character target) and the validation character stream."""
    from pydoc_data.topics import topics

    text = "\n".join(topics[key] for key in sorted(topics))
    codes = torch.tensor([min(ord(c), VOCAB - 1) for c in text], dtype=torch.long)
    split = int(0.9 * len(codes))
    train, val = codes[:split], codes[split:]
    count = (len(train) - 1) // CONTEXT
    windows = train[: count * CONTEXT + 1]
    x = windows[:-1].view(count, CONTEXT)
    y = windows[1:].view(count, CONTEXT)
    return TensorDataset(x, y), val


class CharTransformer(torch.nn.Module):
    def __init__(self, width: int = 128, layers: int = 2, heads: int = 4) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, width)
        self.position = torch.nn.Parameter(torch.zeros(CONTEXT, width))
        layer = torch.nn.TransformerEncoderLayer(
            width, heads, dim_feedforward=4 * width, dropout=0.0, batch_first=True, norm_first=True
        )
        self.blocks = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = torch.nn.LayerNorm(width)
        self.head = torch.nn.Linear(width, VOCAB)
        mask = torch.triu(torch.full((CONTEXT, CONTEXT), float("-inf")), diagonal=1)
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[1]
        h = self.embed(x) + self.position[:n]
        h = self.blocks(h, mask=self.mask[:n, :n], is_causal=True)
        return self.head(self.norm(h))


@torch.no_grad()
def validation_loss(model: torch.nn.Module, val: torch.Tensor, device: torch.device) -> float:
    model.eval()
    count = (len(val) - 1) // CONTEXT
    x = val[: count * CONTEXT].view(count, CONTEXT).to(device)
    y = val[1 : count * CONTEXT + 1].view(count, CONTEXT).to(device)
    total = 0.0
    for start in range(0, count, 256):
        logits = model(x[start : start + 256])
        total += F.cross_entropy(
            logits.reshape(-1, VOCAB), y[start : start + 256].reshape(-1), reduction="sum"
        ).item()
    model.train()
    return total / (count * CONTEXT)


def main() -> int:
    parser = argparse.ArgumentParser(description="character transformer LM (pollux-local job)")
    parser.add_argument("--max-epochs", type=int, default=6)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--max-samples", type=int, default=None, help="train on the first N windows (smoke tests)"
    )
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    train, val = load_text_windows()
    if args.max_samples is not None:
        train = TensorDataset(*(t[: args.max_samples] for t in train.tensors))
        val = val[: 64 * CONTEXT + 1]
    model = CharTransformer()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    trainer = ElasticTrainer(model, optimizer, lr_rule="sqrt", **SPEC.trainer_kwargs())
    loader = trainer.loader(train, seed=args.seed)
    device = trainer.device
    warmup = 100.0  # base-batch iterations; schedules follow progress, not raw steps
    total = args.max_epochs * len(train) / SPEC.base_batch

    def schedule(_: int) -> float:
        p = trainer.progress
        if p < warmup:
            return (p + 1) / warmup
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(p / total, 1.0)))

    trainer.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)

    metric = float("inf")
    for epoch in trainer.epochs(args.max_epochs):
        for x, y in loader:
            logits = trainer.model(x.to(device))
            loss = F.cross_entropy(logits.reshape(-1, VOCAB), y.to(device).reshape(-1))
            if trainer.step(loss, clip_grad_norm=1.0):
                trainer.lr_scheduler.step()
        metric = validation_loss(trainer.module, val, device)
        trainer.report_metrics(loss=loss.item(), val_loss=metric)
        if trainer.rank == 0:
            print(
                f"epoch {epoch} loss {loss.item():.4f} val_loss {metric:.4f} "
                f"progress {trainer.progress:.0f} batch {trainer.total_batch} "
                f"(m={trainer.local_batch} s={trainer.accum_steps} K={trainer.replicas})",
                flush=True,
            )
        if SPEC.target.reached(metric):
            break
    if math.isinf(metric):
        metric = validation_loss(trainer.module, val, device)
    trainer.close()
    if trainer.rank == 0:
        print(SPEC.target.final_line(metric), flush=True)
    return 0 if SPEC.target.reached(metric) else 3


if __name__ == "__main__":
    sys.exit(main())
