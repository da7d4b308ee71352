"""A tiny classifier whose gradients are too small for fp16 without loss scaling; used by tests and results/.

The loss is weighted by 2^-24 (as a minor term of a multi-task loss can be), so every gradient is ~1e-9:
below fp16's smallest subnormal (2^-24, 6e-8), fp16 flushes it to zero and the layer stops learning,
unless a GradScaler lifts it first. The weights start untrained, so a few training steps move the
accuracy a lot: train mode (`--mode train`) sees the difference.
"""

import torch
from torch import nn

LOSS_WEIGHT = 2.0**-24


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(32, 64)
        self.fc2 = nn.Linear(64, 64)
        self.head = nn.Linear(64, 4)

    def forward(self, x):
        h = torch.relu(self.fc1(x))
        h = torch.relu(self.fc2(h))
        return self.head(h)


def build_model():
    torch.manual_seed(0)
    return Net()


def _data(seed, n):
    """Four classes, each a Gaussian blob around its own random centre in 32 dimensions."""
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(4, 32, generator=torch.Generator().manual_seed(7))
    y = torch.randint(0, 4, (n,), generator=g)
    return centres[y] + 1.5 * torch.randn(n, 32, generator=g), y


def batches(split):
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    x, y = _data(0 if split == "train" else 1, 256)
    return [(x[i : i + 64], y[i : i + 64]) for i in range(0, 256, 64)]


def loss_fn(model, batch):
    x, y = batch
    return LOSS_WEIGHT * nn.functional.cross_entropy(model(x).float(), y)


def optimizer(model):
    # Adam is invariant to the gradient's scale once eps is below it; the default eps (1e-8) is not.
    return torch.optim.Adam(model.parameters(), lr=3e-3, eps=1e-30)


@torch.no_grad()
def evaluate(model):
    """Accuracy on the eval split."""
    correct = total = 0
    for x, y in batches("eval"):
        correct += int((model(x).argmax(-1) == y).sum())
        total += len(y)
    return correct / total
