"""Digits: a wide MLP classifier on scikit-learn's bundled 8x8 digits dataset.

An autoprec example model. The dataset ships inside scikit-learn (no download).
The MLP is deliberately wide (1024 units) so that the precision tuner has layers
where bf16 matmuls can pay off; it is small enough to train in seconds on a CPU.

Run it with:

    autoprec search examples/digits/model.py --budget 0.01

The trained weights are cached under $AUTOPREC_CACHE (default
~/.cache/autoprec/examples), keyed by a hash of the training hyper-parameters.
"""

import hashlib
import json
import os
import tempfile

import torch
from torch import nn

HPARAMS = {
    "hidden": 1024,
    "epochs": 10,
    "lr": 1e-3,
    "weight_decay": 0.01,
    "batch": 256,
    "n_eval": 360,
    "seed": 0,
    "split_seed": 0,
}
SPLITS = ("train", "eval")


# ---------------------------------------------------------------- data

_DATA = None


def _data():
    """Standardised (x_train, y_train, x_eval, y_eval): a fixed seeded shuffle, last 360 are eval."""
    global _DATA
    if _DATA is None:
        from sklearn.datasets import load_digits

        x, y = load_digits(return_X_y=True)
        perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(HPARAMS["split_seed"]))
        x = torch.tensor(x, dtype=torch.float32)[perm]
        y = torch.tensor(y, dtype=torch.long)[perm]
        n = len(x) - HPARAMS["n_eval"]
        # train statistics only; std floored at 1 pixel unit so near-constant pixels stay small
        mean, std = x[:n].mean(0), x[:n].std(0).clamp_min(1.0)
        x = (x - mean) / std
        _DATA = (x[:n], y[:n], x[n:], y[n:])
    return _DATA


def batches(split):
    """Fixed batches: train in rows of 256 (6 batches), eval in two halves of 180."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
    x_tr, y_tr, x_ev, y_ev = _data()
    x, y, bs = (x_tr, y_tr, HPARAMS["batch"]) if split == "train" else (x_ev, y_ev, 180)
    return [(x[i : i + bs], y[i : i + bs]) for i in range(0, len(x), bs)]


# ---------------------------------------------------------------- model


class MLP(nn.Module):
    def __init__(self, hidden=HPARAMS["hidden"]):
        super().__init__()
        self.fc1 = nn.Linear(64, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.fc3 = nn.Linear(hidden, hidden)
        self.head = nn.Linear(hidden, 10)
        self.act = nn.GELU()

    def forward(self, x):
        x = self.act(self.fc1(x))
        x = self.act(self.fc2(x))
        x = self.act(self.fc3(x))
        return self.head(x)


def loss_fn(model, batch):
    x, y = batch
    return nn.functional.cross_entropy(model(x).float(), y)


@torch.no_grad()
def evaluate(model):
    """Accuracy on the eval split, in [0, 1]."""
    device = next(model.parameters()).device
    correct = total = 0
    for x, y in batches("eval"):
        pred = model(x.to(device)).argmax(-1).cpu()
        correct += (pred == y).sum().item()
        total += len(y)
    return correct / total


# ---------------------------------------------------------------- training + cache


def _cache_path(name, hparams):
    root = os.environ.get("AUTOPREC_CACHE") or os.path.expanduser("~/.cache/autoprec/examples")
    digest = hashlib.sha256(json.dumps(hparams, sort_keys=True).encode()).hexdigest()[:12]
    return os.path.join(root, f"{name}-{digest}.pt")


def _save_atomic(state, path):
    if any(t.is_meta for t in state.values()):  # built under the meta device: no values, never cached
        raise ValueError(f"{path}: refusing to cache weights on the meta device (they hold no values)")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(state, f)
        os.replace(tmp, path)  # atomic: concurrent builders never see a partial file
    except BaseException:
        os.unlink(tmp)
        raise


def _train():
    torch.manual_seed(HPARAMS["seed"])
    model = MLP()
    opt = torch.optim.AdamW(model.parameters(), lr=HPARAMS["lr"], weight_decay=HPARAMS["weight_decay"])
    x, y, _, _ = _data()
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(HPARAMS["seed"]))
    x, y = x[order], y[order]  # one fixed shuffle, same order every epoch
    bs = HPARAMS["batch"]
    model.train()
    for _ in range(HPARAMS["epochs"]):
        for i in range(0, len(x), bs):
            loss = loss_fn(model, (x[i : i + bs], y[i : i + bs]))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
    return model


def build_model():
    """The trained fp32 MLP (trains once, ~a few seconds, then loads from the cache)."""
    path = _cache_path("digits", HPARAMS)
    model = MLP()
    if torch.get_default_device().type == "meta":  # autoprec predict and verify: shapes and names only
        return model.eval()
    if os.path.exists(path):
        model.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
    else:
        model = _train()
        _save_atomic(model.state_dict(), path)
    return model.eval()
