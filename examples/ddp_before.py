"""A plain PyTorch DDP training script (the "before" of porting to pollux-local).

Run with torchrun, e.g. ``torchrun --nproc-per-node 2 examples/ddp_before.py``, or alone.
Data: scikit-learn's bundled digits set.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

digits = load_digits()
data = TensorDataset(
    torch.tensor(digits.data, dtype=torch.float32) / 16, torch.tensor(digits.target)
)
distributed = dist.is_torchelastic_launched()
if distributed:
    dist.init_process_group("gloo")
model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
if distributed:
    model = DistributedDataParallel(model)
sampler = DistributedSampler(data) if distributed else None
loader = DataLoader(data, batch_size=32, sampler=sampler, shuffle=sampler is None)

for epoch in range(5):
    if sampler is not None:
        sampler.set_epoch(epoch)
    for x, y in loader:
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
    print(f"epoch {epoch} loss {loss.item():.4f}")

if distributed:
    dist.destroy_process_group()
