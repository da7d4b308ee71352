"""MoE12: a 12-block byte-level transformer with a two-expert MLP, trained on CPython's stdlib sources.

An autoprec example with many layers: each block has separate q, k, v and o projections, a router and
two experts (up and down each), 9 Linears a block and 109 with the head, the size at which a search
over one choice per layer no longer fits a few dozen trials. The router is Linear(d, 2): too narrow for
fp8, and the layer mixture-of-experts models usually keep in fp32. Every token goes through both experts,
weighted by the router's softmax (a dense mixture), so the model is deterministic and every layer trains.
No `evaluate` is defined, so autoprec scores it by -(mean eval loss).

Run it with:

    autoprec sweep examples/tinylm/moe12.py --budgets 0,0.002,0.005,0.01,0.02

The trained weights are cached under $AUTOPREC_CACHE (default ~/.cache/autoprec/examples), keyed by a
hash of the hyper-parameters and of the training text; training takes a few minutes on 2 CPU cores.
"""

import math

import stdlib_text  # beside this file: the text both example language models read
import torch
from stdlib_text import FILES, SPLITS
from torch import nn
from torch.nn import functional as F

HPARAMS = {
    "files": FILES,
    "bytes_per_file": 24_000,
    "eval_frac": 0.1,
    "d_model": 128,
    "n_heads": 4,
    "n_layers": 12,
    "n_experts": 2,
    "d_expert": 256,
    "seq_len": 64,
    "batch": 16,
    "n_train_batches": 8,
    "n_eval_batches": 4,
    "steps": 400,
    "lr": 2e-3,
    "weight_decay": 0.1,
    "warmup": 20,
    "seed": 0,
}


# ---------------------------------------------------------------- data (stdlib_text.py: the text, windows, training)


def batches(split):
    """Fixed, non-overlapping windows: 8 train batches or 4 eval batches of 16 x 64 bytes."""
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
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x):
        b, t, d = x.shape

        def heads(y):
            return y.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2)

        y = F.scaled_dot_product_attention(heads(self.q(x)), heads(self.k(x)), heads(self.v(x)), is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, d))


class Expert(nn.Module):
    def __init__(self, d, hidden):
        super().__init__()
        self.up = nn.Linear(d, hidden)
        self.down = nn.Linear(hidden, d)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


class Mixture(nn.Module):
    """Every expert on every token, weighted by the router's softmax."""

    def __init__(self, d, hidden, n_experts):
        super().__init__()
        self.router = nn.Linear(d, n_experts)
        self.experts = nn.ModuleList(Expert(d, hidden) for _ in range(n_experts))

    def forward(self, x):
        weights = self.router(x).float().softmax(dim=-1)
        out = torch.stack([e(x).float() for e in self.experts], dim=-1)
        return (out * weights.unsqueeze(-2)).sum(dim=-1).to(x.dtype)


class Block(nn.Module):
    def __init__(self, d, n_heads, hidden, n_experts):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = Attention(d, n_heads)
        self.ln2 = nn.LayerNorm(d)
        self.moe = Mixture(d, hidden, n_experts)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.moe(self.ln2(x))


class MoE12(nn.Module):
    def __init__(self, h=HPARAMS, vocab=256):
        super().__init__()
        d = h["d_model"]
        self.tok_emb = nn.Embedding(vocab, d)
        self.pos_emb = nn.Embedding(h["seq_len"], d)
        self.blocks = nn.ModuleList(Block(d, h["n_heads"], h["d_expert"], h["n_experts"]) for _ in range(h["n_layers"]))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear):
                nn.init.zeros_(m.bias)
        for block in self.blocks:  # residual projections scaled down with depth, as in GPT-2
            for m in (block.attn.o, *(e.down for e in block.moe.experts)):
                nn.init.normal_(m.weight, std=0.02 / math.sqrt(2 * h["n_layers"]))

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
    """The trained fp32 MoE12 (trains once, a few minutes on 2 CPU cores, then loads from the cache)."""
    return stdlib_text.trained("moe12", MoE12, loss_fn, HPARAMS)
