"""A tiny classifier whose metric drifts while it trains with a layer below bf16: each training step adds, to a buffer
its state carries, the number of its layers apply_policy put below bf16, and evaluate() is minus that count over 100.
So a policy's damage grows with the run, as NVFP4's may, and stops where its layers are raised: tests/test_validate.py
checks the side-by-side run and its phase switch against that arithmetic."""

import torch
from torch import nn

from autoprec.apply import applied_summary

HIGH = ("fp32", "bf16")


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 32)
        self.head = nn.Linear(32, 4)
        self.register_buffer("drift", torch.zeros(()))

    def forward(self, x):
        if self.training:
            summary = applied_summary(self)
            records = summary.layers.values() if summary is not None else ()
            self.drift += sum(1 for r in records if str(r.format) not in HIGH)
        return self.head(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


def build_model():
    torch.manual_seed(0)
    return Net()


def batches(split):
    g = torch.Generator().manual_seed(0 if split == "train" else 1)
    return [(torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)) for _ in range(2)]


def loss_fn(model, batch):
    x, y = batch
    return nn.functional.cross_entropy(model(x).float(), y)


def evaluate(model):
    return -float(model.drift) / 100
