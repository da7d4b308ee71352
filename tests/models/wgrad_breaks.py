"""A scale-invariant embedding whose `proj` layer's weight gradient breaks in fp8 while its forward does not; used by
the tests and results/cpu-xeon-amx-2core/wgrad-profile.

Half the samples are quiet (a gain of 1e-6, as a near-silent clip): `proj` is bias-free and its output is normalised,
so a quiet sample's embedding is a loud one's, and its output gradient is a million times larger, in proportion. Its
weight gradient (gradient x input, summed over the batch) gets as much from the quiet rows as from the loud ones. fp8
scales `proj`'s input with one scale per tensor (tensorwise) or per column over the batch (rowwise's weight-gradient
GEMM): the quiet rows fall below e4m3's smallest subnormal and flush to zero, so the weight gradient loses their half.
The forward loses them too, but they carry a 1e-12 share of the output's energy; the input gradient (output gradient
x weight) never reads the input."""

import torch
from torch import nn

QUIET = 1e-6  # a quiet sample's gain: 1e-6 of the loudest input is below e4m3's range under one scale (2^-9 / 448)


class Embedder(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(64, 256)
        self.proj = nn.Linear(256, 512, bias=False)  # bias-free: its output scales with the sample's gain
        self.head = nn.Linear(512, 16)

    def forward(self, x, gain):
        h = torch.relu(self.inp(x)) * gain[:, None]
        e = nn.functional.normalize(self.proj(h), dim=-1)  # the embedding's direction, whatever the gain
        return self.head(e)


def build_model():
    torch.manual_seed(0)
    return Embedder()


def batches(split):
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    g = torch.Generator().manual_seed(0 if split == "train" else 1)
    out = []
    for _ in range(2):
        gain = torch.where(torch.arange(32) % 2 == 0, 1.0, QUIET)  # every other sample quiet
        out.append((torch.randn(32, 64, generator=g), gain, torch.randint(0, 16, (32,), generator=g)))
    return out


def loss_fn(model, batch):
    x, gain, y = batch
    return nn.functional.cross_entropy(model(x, gain).float(), y)
