"""Shared fixtures: write a model.py from a source string, and a tiny valid model.py to start from.

Tests build broken variants of the tiny model by appending to its source: a later `def` replaces
an earlier one and `del name` removes a function, so each test shows only what it breaks:

    path = write_model(mlp_source + "\\ndef batches(split):\\n    return []\\n")
"""

from __future__ import annotations

import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest

# A valid model.py: Linear(16, 32) -> ReLU -> Linear(32, 32) -> Linear(32, 4), named fc1, act, fc2,
# head; two seeded batches of 8 per split; cross-entropy loss; no evaluate, so the default metric
# (-(mean eval loss)) applies.
MLP_SOURCE = '''\
"""A tiny MLP task for autoprec's tests: 16 features -> 4 classes, deterministic batches."""
from collections import OrderedDict

import torch
from torch import nn


def build_model():
    torch.manual_seed(0)
    return nn.Sequential(OrderedDict(
        fc1=nn.Linear(16, 32), act=nn.ReLU(), fc2=nn.Linear(32, 32), head=nn.Linear(32, 4),
    ))


def batches(split):
    g = torch.Generator().manual_seed(0 if split == "train" else 1)
    return [(torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)) for _ in range(2)]


def loss_fn(model, batch):
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)
'''


@pytest.fixture
def mlp_source() -> str:
    """The source of a small valid model.py (see MLP_SOURCE); append to it to break one thing."""
    return MLP_SOURCE


@pytest.fixture
def write_model(tmp_path: Path) -> Callable[..., Path]:
    """`write_model(source, name="model.py")` writes `source` (dedented) under tmp_path and returns its path.

    `name` may include folders ("digits/model.py"); they are created.
    """

    def write(source: str, name: str = "model.py") -> Path:
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(source), encoding="utf-8")
        return path

    return write
