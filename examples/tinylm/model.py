"""TinyLM: a small byte-level causal transformer trained on CPython's own stdlib sources.

An autoprec example model. The text is a fixed list of pure-Python standard-library
modules read from the running interpreter's install (no download). The model is a
2-block pre-norm transformer (d_model 256, 4 heads, context 128, vocab 256 bytes).
No `evaluate` is defined, so autoprec scores it by -(mean eval loss).

Run it with:

    autoprec search examples/tinylm/model.py --budget 0.02

The trained weights are cached under $AUTOPREC_CACHE (default
~/.cache/autoprec/examples), keyed by a hash of the training hyper-parameters and
of the training text.
"""

import stdlib_text  # beside this file: the text both example language models read
import torch
from stdlib_text import FILES, SPLITS
from torch import nn
from torch.nn import functional as F

HPARAMS = {
    "files": FILES,
    "bytes_per_file": 24_000,
    "eval_frac": 0.1,
    "d_model": 256,
    "n_heads": 4,
    "n_layers": 2,
    "seq_len": 128,
    "batch": 16,
    "n_train_batches": 8,
    "n_eval_batches": 4,
    "steps": 300,
    "lr": 2e-3,
    "weight_decay": 0.1,
    "warmup": 20,
    "seed": 0,
}


# ---------------------------------------------------------------- data (stdlib_text.py: the text, windows, training)


def batches(split):
    """Fixed, non-overlapping windows: 8 train batches or 4 eval batches of 16 x 128 bytes."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
    train, evals = stdlib_text.text(HPARAMS["bytes_per_file"], HPARAMS["eval_frac"])
    stream, n = (train, HPARAMS["n_train_batches"]) if split == "train" else (evals, HPARAMS["n_eval_batches"])
    return stdlib_text.fixed_batches(stream, n, HPARAMS["batch"], HPARAMS["seq_len"])


# ---------------------------------------------------------------- model


class Attention(nn.Module):
    def __init__(self, d, n_heads):
        super().__init__()
        self.n_heads = n_heads
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.n_heads, d // self.n_heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class MLP(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc = nn.Linear(d, 4 * d)
        self.act = nn.GELU()
        self.proj = nn.Linear(4 * d, d)

    def forward(self, x):
        return self.proj(self.act(self.fc(x)))


class Block(nn.Module):
    def __init__(self, d, n_heads):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = Attention(d, n_heads)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = MLP(d)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyLM(nn.Module):
    def __init__(
        self,
        d=HPARAMS["d_model"],
        n_heads=HPARAMS["n_heads"],
        n_layers=HPARAMS["n_layers"],
        seq_len=HPARAMS["seq_len"],
        vocab=256,
    ):
        super().__init__()
        self.tok_emb = nn.Embedding(vocab, d)
        self.pos_emb = nn.Embedding(seq_len, d)
        self.blocks = nn.ModuleList(Block(d, n_heads) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear):
                nn.init.zeros_(m.bias)

    def forward(self, ids):
        x = self.tok_emb(ids) + self.pos_emb(torch.arange(ids.shape[1], device=ids.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def loss_fn(model, batch):
    ids, targets = batch
    logits = model(ids).float()  # the loss is always computed in fp32
    return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))


# ---------------------------------------------------------------- training + cache


def build_model():
    """The trained fp32 TinyLM (trains once, about a minute on 2 CPU cores, then loads from the cache)."""
    return stdlib_text.trained("tinylm", TinyLM, loss_fn, HPARAMS)
