"""A tiny classifier whose middle layer's output overflows fp16 (|x| ~ 1e5 > 65504); used by the tests."""

import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(32, 64)
        self.big = nn.Linear(64, 64)  # scaled up: fp16 turns its output into inf
        self.head = nn.Linear(64, 4)  # 4 outputs: not divisible by 16, so never fp8
        with torch.no_grad():
            self.big.weight.mul_(1e5)

    def forward(self, x):
        h = torch.relu(self.fc1(x))
        h = self.big(h) / 1e5
        return self.head(torch.relu(h))


def build_model():
    torch.manual_seed(0)
    return Net()


def batches(split):
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    g = torch.Generator().manual_seed(0 if split == "train" else 1)
    return [(torch.randn(16, 32, generator=g), torch.randint(0, 4, (16,), generator=g)) for _ in range(3)]


def loss_fn(model, batch):
    x, y = batch
    return nn.functional.cross_entropy(model(x).float(), y)


def evaluate(model):
    correct = total = 0
    for x, y in batches("eval"):
        pred = model(x).argmax(-1)
        correct += int((pred == y).sum())
        total += len(y)
    return correct / total
