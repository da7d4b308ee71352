"""MLP8: eight Linear layers of mixed widths on scikit-learn's bundled digits, for benchmarks/search_optimum.py.

Small enough that every policy of its 8 layers in 3 formats (3^8 = 6561) can be measured, and mixed enough
(wide and narrow layers, one 1024x1024) that the layers differ in what lowering them gains and costs. No
`evaluate`: the metric is -(mean eval loss), which moves in small steps where accuracy would not.
"""

import os
from collections import OrderedDict

import torch
from torch import nn

WIDTHS = (64, 512, 64, 1024, 1024, 128, 512, 32, 10)  # in -> 8 Linear layers -> 10 classes
HPARAMS = {"widths": WIDTHS, "epochs": 12, "lr": 1e-3, "weight_decay": 0.01, "batch": 256, "n_eval": 360, "seed": 0}
SPLITS = ("train", "eval")

_DATA = None


def _data():
    """Standardised (x_train, y_train, x_eval, y_eval): a fixed seeded shuffle, the last 360 evaluate."""
    global _DATA
    if _DATA is None:
        from sklearn.datasets import load_digits

        x, y = load_digits(return_X_y=True)
        perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(HPARAMS["seed"]))
        x, y = torch.tensor(x, dtype=torch.float32)[perm], torch.tensor(y, dtype=torch.long)[perm]
        n = len(x) - HPARAMS["n_eval"]
        mean, std = x[:n].mean(0), x[:n].std(0).clamp_min(1.0)
        x = (x - mean) / std
        _DATA = (x[:n], y[:n], x[n:], y[n:])
    return _DATA


def batches(split):
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
    x_tr, y_tr, x_ev, y_ev = _data()
    x, y, bs = (x_tr, y_tr, HPARAMS["batch"]) if split == "train" else (x_ev, y_ev, 180)
    return [(x[i:i + bs], y[i:i + bs]) for i in range(0, len(x), bs)]


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
    x, y, _, _ = _data()
    for _ in range(HPARAMS["epochs"]):
        for i in range(0, len(x), HPARAMS["batch"]):
            loss = loss_fn(model, (x[i:i + HPARAMS["batch"]], y[i:i + HPARAMS["batch"]]))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
    os.makedirs(root, exist_ok=True)
    torch.save(model.state_dict(), path)
    return model.eval()
