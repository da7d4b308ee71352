"""A Llama-style language model: RMSNorm, grouped-query attention, a SwiGLU feed-forward and rotary positions.

An autoprec example model whose step a GPU spends in GEMMs, so the layer choice pays: at the `full` size (d_model
2048, 16 heads sharing 4 key/value heads, FFN 8192, 6 blocks, 2048 tokens x 8 sequences a step: 16,384 tokens,
about 365M parameters, fits an 80 GB GPU) its FFN's GEMMs are large enough that fp8 saves more than its casts cost,
where GPT-2-small's (d_model 768) are not. Byte-level (vocabulary 256) on the CPython standard-library text TinyLM
reads (examples/tinylm/stdlib_text.py): no download. No `evaluate`: autoprec scores it by -(mean eval loss).

    autoprec search examples/llama/model.py --budget 0.02            # on a GPU: compiled by default

AUTOPREC_LLAMA_SIZE picks the configuration: `full` (default; a GPU only: its weights train on first use, about a
minute on an H100) or `tiny` (2 blocks, 64 wide, 4 heads sharing 2 key/value heads: the CPU tests and the device
script's --smoke). The weights come from a short training run on first use, cached under $AUTOPREC_CACHE (default
~/.cache/autoprec/examples).
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

_COMMON = {"files": stdlib_text.FILES, "eval_frac": 0.1, "lr": 3e-4, "weight_decay": 0.1, "seed": 0, "rope_base": 10000.0}
SIZES = {
    "tiny": {
        "d_model": 64,
        "n_heads": 4,
        "n_kv_heads": 2,
        "ffn": 176,  # about 8/3 of d_model, a multiple of 16 (fp8's requirement)
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
    "full": {
        "d_model": 2048,
        "n_heads": 16,
        "n_kv_heads": 4,
        "ffn": 8192,
        "n_layers": 6,
        "seq_len": 2048,
        "batch": 8,
        "bytes_per_file": 24_000,
        "n_train_batches": 2,
        "n_eval_batches": 1,
        "steps": 60,
        "warmup": 10,
    },
}
SIZE = os.environ.get("AUTOPREC_LLAMA_SIZE", "full")
if SIZE not in SIZES:
    raise ValueError(f"AUTOPREC_LLAMA_SIZE must be one of {', '.join(SIZES)}, but got {SIZE!r}")
HPARAMS = {**_COMMON, **SIZES[SIZE]}


def batches(split):
    """Fixed, non-overlapping windows of the train or eval bytes."""
    if split not in stdlib_text.SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {stdlib_text.SPLITS}")
    train, evals = stdlib_text.text(HPARAMS["bytes_per_file"], HPARAMS["eval_frac"])
    stream, n = (train, HPARAMS["n_train_batches"]) if split == "train" else (evals, HPARAMS["n_eval_batches"])
    return stdlib_text.fixed_batches(stream, n, HPARAMS["batch"], HPARAMS["seq_len"])


class RMSNorm(nn.Module):
    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        # in fp32 whatever the input's dtype, as Llama's reference does; the output in the input's dtype
        y = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * self.weight.float()).to(x.dtype)


def rotary(seq_len, head_dim, base):
    """cos and sin of the rotary angles, (seq_len, head_dim / 2) each."""
    inv = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv)
    return angles.cos(), angles.sin()


def rotate(x, cos, sin):
    """x (batch, heads, seq, head_dim) rotated pairwise (its halves as the pairs) by the angles."""
    a, b = x.float().chunk(2, dim=-1)
    return torch.cat((a * cos - b * sin, a * sin + b * cos), dim=-1).to(x.dtype)


class Attention(nn.Module):
    """Grouped-query attention: n_heads query heads share n_kv_heads key/value heads."""

    def __init__(self, d, n_heads, n_kv_heads):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, d // n_heads
        self.q_proj = nn.Linear(d, d, bias=False)  # Llama's names
        self.k_proj = nn.Linear(d, n_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(d, n_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(d, d, bias=False)

    def forward(self, x, cos, sin):
        b, t, d = x.shape
        q = self.q_proj(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = rotate(q, cos[:t], sin[:t]), rotate(k, cos[:t], sin[:t])
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, d))


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, d, ffn):
        super().__init__()
        self.gate_proj = nn.Linear(d, ffn, bias=False)
        self.up_proj = nn.Linear(d, ffn, bias=False)
        self.down_proj = nn.Linear(ffn, d, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, h):
        super().__init__()
        self.input_layernorm = RMSNorm(h["d_model"])
        self.self_attn = Attention(h["d_model"], h["n_heads"], h["n_kv_heads"])
        self.post_attention_layernorm = RMSNorm(h["d_model"])
        self.mlp = MLP(h["d_model"], h["ffn"])

    def forward(self, x, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Llama(nn.Module):
    def __init__(self, h=HPARAMS, vocab=256):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, h["d_model"])
        self.layers = nn.ModuleList(Block(h) for _ in range(h["n_layers"]))
        self.norm = RMSNorm(h["d_model"])
        self.lm_head = nn.Linear(h["d_model"], vocab, bias=False)
        cos, sin = rotary(h["seq_len"], h["d_model"] // h["n_heads"], h["rope_base"])
        self.register_buffer("cos", cos, persistent=False)  # recomputed, not saved with the weights
        self.register_buffer("sin", sin, persistent=False)
        for name, p in self.named_parameters():
            if p.dim() == 2:  # residual projections scaled down by the depth
                std = 0.02 / (2 * h["n_layers"]) ** 0.5 if name.endswith(("o_proj.weight", "down_proj.weight")) else 0.02
                nn.init.normal_(p, std=std)

    def forward(self, ids):
        x = self.embed_tokens(ids)
        for block in self.layers:
            x = block(x, self.cos, self.sin)
        return self.lm_head(self.norm(x))


def loss_fn(model, batch):
    ids, targets = batch
    logits = model(ids).float()  # the loss is always computed in fp32
    return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))


def build_model():
    """The trained fp32 model of the chosen size (trains once, on the GPU when there is one, then loads); on the meta
    device (autoprec predict and verify) the bare model, for its shapes and names."""
    if torch.get_default_device().type == "meta":
        return Llama()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return stdlib_text.trained(f"llama-{SIZE}", Llama, loss_fn, HPARAMS, device)


def parallelize(model, mesh):
    """FSDP2 as torchtitan shards a Llama: each block, then the model (its embedding, final norm and head), over the
    mesh of every rank. A search under torchrun (`torchrun --nproc_per_node N -m autoprec search
    examples/llama/model.py`) measures each candidate so, its policy applied first (docs/sharded.md)."""
    from torch.distributed.fsdp import fully_shard

    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
