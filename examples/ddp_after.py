"""The same script ported to pollux-local (the "after"): elastic, goodput-tuned, restartable.

Run alone (``python examples/ddp_after.py``) or under the daemon; the launcher's environment
sets the replicas, the batch configuration and the checkpoint directory.
"""

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch.utils.data import TensorDataset

from pollux_local.torch import ElasticTrainer

digits = load_digits()
data = TensorDataset(
    torch.tensor(digits.data, dtype=torch.float32) / 16, torch.tensor(digits.target)
)
model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
trainer = ElasticTrainer(model, optimizer, base_batch=32, max_batch=512)
loader = trainer.loader(data)

for epoch in trainer.epochs(5):
    for x, y in loader:
        loss = F.cross_entropy(trainer.model(x), y)
        trainer.step(loss)
    print(f"epoch {epoch} loss {loss.item():.4f}")
trainer.close()
