"""GPT-2-small-class language model: 12 pre-norm blocks, 768 wide, 12 heads, tied embedding and head.

An autoprec example model of realistic size for a GPU: byte-level (vocabulary 256) on the same CPython
standard-library text as TinyLM (examples/tinylm/stdlib_text.py), so it needs no download; with a 256-byte
vocabulary instead of GPT-2's 50,257 tokens it has 85M parameters rather than 124M, the same blocks. No
`evaluate`: autoprec scores it by -(mean eval loss), so a budget of 0.02 allows the eval loss to rise by 0.02.

    autoprec search examples/gpt2/model.py --budget 0.02            # on a GPU: compiled by default

AUTOPREC_GPT2_SIZE picks the configuration: `small` (default), `1b` (24 blocks, 2048 wide, about 1.2B
parameters; a GPU only), `mini` (GPT-2-small's 12 pre-norm blocks and tied head, 128 wide, 4 heads, seq_len 64:
2.4M parameters, for CPU studies by depth such as benchmarks/block_study.py; its 600 training steps took 230 s on
2 shared AMD EPYC cores with one torch thread, the eval loss falling from 5.35 to 1.98 nats/byte) or `tiny`
(2 blocks, 64 wide: the GPU suite's --smoke run on a CPU). The weights
come from a short training run on first use (on a GPU when there is one: minutes for `small`; hours on a
CPU), cached under $AUTOPREC_CACHE (default ~/.cache/autoprec/examples).
"""

import os
import sys

import torch
from torch import nn
from torch.nn import functional as F

_TINYLM = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tinylm")
sys.path.insert(0, _TINYLM)
try:
    import stdlib_text  # the text, the training recipe and the weights cache TinyLM uses
finally:
    sys.path.remove(_TINYLM)

_COMMON = {"files": stdlib_text.FILES, "eval_frac": 0.1, "lr": 6e-4, "weight_decay": 0.1, "seed": 0}
SIZES = {
    "tiny": {
        "d_model": 64,
        "n_heads": 4,
        "n_layers": 2,
        "seq_len": 64,
        "batch": 8,
        "bytes_per_file": 8_000,
        "n_train_batches": 2,
        "n_eval_batches": 2,
        "steps": 40,
        "warmup": 5,
        "lr": 2e-3,
    },
    "mini": {  # GPT-2-small's block structure (12 pre-norm blocks, tied head), narrow: trains on 2 CPU cores
        "d_model": 128,
        "n_heads": 4,
        "n_layers": 12,
        "seq_len": 64,
        "batch": 16,
        "bytes_per_file": 24_000,
        "n_train_batches": 4,
        "n_eval_batches": 4,
        "steps": 600,
        "warmup": 30,
        "lr": 2e-3,
    },
    "small": {
        "d_model": 768,
        "n_heads": 12,
        "n_layers": 12,
        "seq_len": 256,
        "batch": 16,
        "bytes_per_file": 24_000,
        "n_train_batches": 8,
        "n_eval_batches": 4,
        "steps": 400,
        "warmup": 40,
    },
    "1b": {
        "d_model": 2048,
        "n_heads": 16,
        "n_layers": 24,
        "seq_len": 256,
        "batch": 16,
        "bytes_per_file": 24_000,
        "n_train_batches": 8,
        "n_eval_batches": 4,
        "steps": 200,
        "warmup": 20,
        "lr": 3e-4,
    },
}
SIZE = os.environ.get("AUTOPREC_GPT2_SIZE", "small")
if SIZE not in SIZES:
    raise ValueError(f"AUTOPREC_GPT2_SIZE must be one of {', '.join(SIZES)}, but got {SIZE!r}")
HPARAMS = {**_COMMON, **SIZES[SIZE]}


def batches(split):
    """Fixed, non-overlapping windows of the train or eval bytes."""
    if split not in stdlib_text.SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {stdlib_text.SPLITS}")
    train, evals = stdlib_text.text(HPARAMS["bytes_per_file"], HPARAMS["eval_frac"])
    stream, n = (train, HPARAMS["n_train_batches"]) if split == "train" else (evals, HPARAMS["n_eval_batches"])
    return stdlib_text.fixed_batches(stream, n, HPARAMS["batch"], HPARAMS["seq_len"])


class CausalSelfAttention(nn.Module):
    def __init__(self, d, n_heads):
        super().__init__()
        self.n_heads = n_heads
        self.c_attn = nn.Linear(d, 3 * d)  # GPT-2's names: c_attn, c_proj, c_fc
        self.c_proj = nn.Linear(d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.c_attn(x).view(b, t, 3, self.n_heads, d // self.n_heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, d, n_heads):
        super().__init__()
        self.ln_1 = nn.LayerNorm(d)
        self.attn = CausalSelfAttention(d, n_heads)
        self.ln_2 = nn.LayerNorm(d)
        self.c_fc = nn.Linear(d, 4 * d)
        self.c_proj = nn.Linear(4 * d, d)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.c_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, h=HPARAMS, vocab=256):
        super().__init__()
        d = h["d_model"]
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(h["seq_len"], d)
        self.h = nn.ModuleList(Block(d, h["n_heads"]) for _ in range(h["n_layers"]))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # tied, as in GPT-2
        for name, p in self.named_parameters():
            if p.dim() == 2:
                # GPT-2's init: residual projections scaled down by the depth
                std = 0.02 / (2 * h["n_layers"]) ** 0.5 if name.endswith("c_proj.weight") else 0.02
                nn.init.normal_(p, std=std)
            elif name.endswith(".bias"):
                nn.init.zeros_(p)

    def forward(self, ids):
        x = self.wte(ids) + self.wpe(torch.arange(ids.shape[1], device=ids.device))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def loss_fn(model, batch):
    ids, targets = batch
    logits = model(ids).float()  # the loss is always computed in fp32
    return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))


def build_model():
    """The trained fp32 GPT of the chosen size (trains once, on the GPU when there is one, then loads); on the meta
    device (`autoprec predict`), the untrained architecture: its shapes are all that is wanted there."""
    if torch.get_default_device().type == "meta":
        return GPT()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return stdlib_text.trained(f"gpt2-{SIZE}", GPT, loss_fn, HPARAMS, device)
