"""The trainer's data loader: this replica's micro-batches, sized step by step."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import Dataset, TensorDataset, default_collate

from pollux_local.errors import PolluxError

if TYPE_CHECKING:
    from pollux_local.torch.trainer import ElasticTrainer


class ElasticLoader:
    """Yields this replica's micro-batches; the trainer decides their sizes step by step."""

    def __init__(
        self,
        trainer: ElasticTrainer,
        dataset: Dataset[Any],
        collate_fn: Callable[[list[Any]], Any] | None,
    ) -> None:
        self.trainer = trainer
        self.dataset = dataset
        self.collate_fn = collate_fn or default_collate

    def _fetch(self, indices: torch.Tensor) -> Any:
        if isinstance(self.dataset, TensorDataset):
            return tuple(t[indices] for t in self.dataset.tensors)
        return self.collate_fn([self.dataset[i] for i in indices.tolist()])

    def __iter__(self) -> Iterator[Any]:
        trainer = self.trainer
        trainer._epoch_start()
        while True:
            plan = trainer._next_plan()
            if plan is None:
                break
            for index, micro in enumerate(plan.micro):
                batch = self._fetch(micro.indices[trainer.rank])
                trainer._begin_micro(plan, index)
                yield batch
                if trainer._micro is not None:
                    raise PolluxError("trainer.step(loss) must be called for every batch")
        trainer._epoch_end()
