"""MLP8: eight Linear layers of mixed widths on scikit-learn's bundled digits, for benchmarks/search_optimum.py.

Small enough that every policy of its 8 layers in 3 formats (3^8 = 6561) can be measured, and mixed enough
(wide and narrow layers, one 512x512) that the layers differ in what lowering them gains and costs. No
`evaluate`: the metric is -(mean eval loss), which moves in small steps where accuracy would not.
"""

import importlib.util
import os
from collections import OrderedDict
from pathlib import Path

import torch
from torch import nn

WIDTHS = (64, 256, 64, 512, 512, 128, 256, 32, 10)  # in -> 8 Linear layers -> 10 classes
HPARAMS = {"widths": WIDTHS, "epochs": 12, "lr": 1e-3, "weight_decay": 0.01, "batch": 128, "n_eval": 360, "seed": 0}
SPLITS = ("train", "eval")


def _digits():
    """examples/digits/model.py, whose data split (standardised, the last 360 of a seeded shuffle) this reuses."""
    path = Path(__file__).parents[2] / "examples" / "digits" / "model.py"
    spec = importlib.util.spec_from_file_location("_mlp8_digits", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_DIGITS = _digits()


def batches(split):
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
    x_tr, y_tr, x_ev, y_ev = _DIGITS._data()
    x, y, bs = (x_tr, y_tr, HPARAMS["batch"]) if split == "train" else (x_ev, y_ev, 180)
    return [(x[i : i + bs], y[i : i + bs]) for i in range(0, len(x), bs)]


def _model():
    layers = OrderedDict()
    for i, (a, b) in enumerate(zip(WIDTHS, WIDTHS[1:])):
        layers[f"fc{i}"] = nn.Linear(a, b)
        if i < len(WIDTHS) - 2:
            layers[f"act{i}"] = nn.GELU()
    return nn.Sequential(layers)


def loss_fn(model, batch):
    x, y = batch
    return nn.functional.cross_entropy(model(x).float(), y)


def build_model():
    """Trained fp32 weights (a few seconds), cached beside the other examples' under $AUTOPREC_CACHE."""
    import hashlib
    import json

    root = os.environ.get("AUTOPREC_CACHE") or os.path.expanduser("~/.cache/autoprec/examples")
    path = os.path.join(root, f"mlp8-{hashlib.sha256(json.dumps(HPARAMS).encode()).hexdigest()[:12]}.pt")
    torch.manual_seed(HPARAMS["seed"])
    model = _model()
    if os.path.exists(path):
        model.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
        return model.eval()
    opt = torch.optim.AdamW(model.parameters(), lr=HPARAMS["lr"], weight_decay=HPARAMS["weight_decay"])
    x, y, _, _ = _DIGITS._data()
    for _ in range(HPARAMS["epochs"]):
        for i in range(0, len(x), HPARAMS["batch"]):
            loss = loss_fn(model, (x[i : i + HPARAMS["batch"]], y[i : i + HPARAMS["batch"]]))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
    os.makedirs(root, exist_ok=True)
    torch.save(model.state_dict(), path)
    return model.eval()
