"""A Llama-style decoder of any published shape, for the step-time predictor's validation points
(benchmarks/predict_points.py): built on the meta device for its shapes (no weights, no memory) and traced as
`autoprec predict` traces a model file. examples/llama3_8b/model.py is one of these shapes as a model file; this one
takes the shape as an argument (Qwen3-8B, nanochat d26, Llama-3-8B at another sequence length).

The blocks: RMSNorm, rotary embedding, grouped-query attention (fused, causal), and either SwiGLU (w1, w3 -> w2) or,
with `gated=False`, nanochat's relu^2 MLP (c_fc -> c_proj), or, with `experts`, a Mixture-of-Experts FFN (a router
Linear, routed experts run by torch._grouped_mm, a shared SwiGLU expert); an untied output layer.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn
from torch.nn import functional as F


@dataclasses.dataclass(frozen=True)
class Shape:
    """A decoder's published shape and the tokens one GPU takes per step (`batch` sequences of `seq`)."""

    dim: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    seq: int
    batch: int = 1
    gated: bool = True  # SwiGLU; False: relu^2 (nanochat)
    experts: int = 0  # routed experts of a Mixture-of-Experts FFN (0: a dense FFN), each `ffn` wide
    top_k: int = 1
    shared_ffn: int = 0  # a shared expert's width beside the routed ones (0: none)


# Llama-4-Scout (17B active, 16 experts): every block an MoE of 16 experts, top-1, and a shared expert, 8192 wide
LLAMA4_SCOUT = Shape(
    dim=5120, layers=48, heads=40, kv_heads=8, ffn=8192, vocab=202048, seq=8192, experts=16, top_k=1, shared_ffn=8192
)
LLAMA3_8B = Shape(dim=4096, layers=32, heads=32, kv_heads=8, ffn=14336, vocab=128256, seq=8192)
QWEN3_8B = Shape(dim=4096, layers=36, heads=32, kv_heads=8, ffn=12288, vocab=151936, seq=2048, batch=16)
NANOCHAT_D26 = Shape(dim=1664, layers=26, heads=13, kv_heads=13, ffn=6656, vocab=32768, seq=2048, batch=32, gated=False)


class _Attention(nn.Module):
    def __init__(self, s: Shape):
        super().__init__()
        self.s, self.head_dim = s, s.dim // s.heads
        self.wq = nn.Linear(s.dim, s.heads * self.head_dim, bias=False)
        self.wk = nn.Linear(s.dim, s.kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(s.dim, s.kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(s.heads * self.head_dim, s.dim, bias=False)

    def forward(self, x, cos, sin):
        b, t, _ = x.shape
        q = self.wq(x).view(b, t, self.s.heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, t, self.s.kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, t, self.s.kv_heads, self.head_dim).transpose(1, 2)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, self.s.dim))


def _rotate(x, cos, sin):
    a, b = x.chunk(2, dim=-1)
    return torch.cat((a * cos - b * sin, a * sin + b * cos), dim=-1)


class _Experts(nn.Module):
    """The routed experts as torchtitan and transformers 5 run them: fused 3-D weights, torch._grouped_mm over the
    tokens sorted by expert. The routing is balanced (each expert takes an equal share), as a trained router's load
    balancing or a benchmark's forced balance makes it: the trace needs shapes, not the router's values."""

    def __init__(self, s: Shape):
        super().__init__()
        self.s = s
        self.w13 = nn.Parameter(torch.empty(s.experts, s.dim, 2 * s.ffn))
        self.w2 = nn.Parameter(torch.empty(s.experts, s.ffn, s.dim))

    def forward(self, routed):
        """`routed`: the tokens sorted by expert (top-k: each token once per expert it goes to)."""
        rows = routed.shape[0]
        offs = torch.arange(1, self.s.experts + 1, device=routed.device, dtype=torch.int32) * (rows // self.s.experts)
        gate, up = torch._grouped_mm(routed, self.w13, offs=offs).chunk(2, dim=-1)
        return torch._grouped_mm(F.silu(gate) * up, self.w2, offs=offs)


class _MoE(nn.Module):
    def __init__(self, s: Shape):
        super().__init__()
        self.router = nn.Linear(s.dim, s.experts, bias=False)
        self.experts = _Experts(s)
        self.shared = _FFN(s.dim, s.shared_ffn, gated=True) if s.shared_ffn else None

    def forward(self, h):
        b, t, d = h.shape
        k = self.experts.s.top_k
        tokens = h.reshape(b * t, d)
        # as torchtitan routes: the top-k experts by sigmoid score, the tokens permuted into expert order (a gather),
        # scaled by their scores before the experts (Llama-4), and scattered back (an index_add)
        scores, chosen = torch.sigmoid(self.router(tokens)).topk(k, dim=-1)
        order = chosen.reshape(-1).argsort(stable=True)
        source = order // k
        routed = tokens.index_select(0, source) * scores.reshape(-1, 1).index_select(0, order)
        out = torch.zeros_like(tokens).index_add(0, source, self.experts(routed))
        if self.shared is not None:
            out = out + self.shared(tokens)
        return out.view(b, t, d)


class _FFN(nn.Module):
    def __init__(self, dim: int, ffn: int, gated: bool):
        super().__init__()
        self.w1 = nn.Linear(dim, ffn, bias=False)
        self.w3 = nn.Linear(dim, ffn, bias=False) if gated else None
        self.w2 = nn.Linear(ffn, dim, bias=False)

    def forward(self, h):
        inner = F.silu(self.w1(h)) * self.w3(h) if self.w3 is not None else F.relu(self.w1(h)).square()
        return self.w2(inner)


class _Block(nn.Module):
    def __init__(self, s: Shape):
        super().__init__()
        self.attention_norm = nn.RMSNorm(s.dim)
        self.attention = _Attention(s)
        self.ffn_norm = nn.RMSNorm(s.dim)
        if s.experts:
            self.moe = _MoE(s)
        else:  # the dense FFN's Linears directly under the block, as examples/llama3_8b names them
            self.w1 = nn.Linear(s.dim, s.ffn, bias=False)
            self.w3 = nn.Linear(s.dim, s.ffn, bias=False) if s.gated else None
            self.w2 = nn.Linear(s.ffn, s.dim, bias=False)

    def forward(self, x, cos, sin):
        x = x + self.attention(self.attention_norm(x), cos, sin)
        h = self.ffn_norm(x)
        if hasattr(self, "moe"):
            return x + self.moe(h)
        inner = F.silu(self.w1(h)) * self.w3(h) if self.w3 is not None else F.relu(self.w1(h)).square()
        return x + self.w2(inner)


class Decoder(nn.Module):
    def __init__(self, s: Shape):
        super().__init__()
        self.s = s
        self.tok_embeddings = nn.Embedding(s.vocab, s.dim)
        self.layers = nn.ModuleList(_Block(s) for _ in range(s.layers))
        self.norm = nn.RMSNorm(s.dim)
        self.output = nn.Linear(s.dim, s.vocab, bias=False)

    def forward(self, ids):
        half = self.s.dim // self.s.heads // 2
        freqs = torch.outer(torch.arange(ids.shape[1], device=ids.device).float(), torch.ones(half, device=ids.device))
        cos, sin = freqs.cos(), freqs.sin()
        x = self.tok_embeddings(ids)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.output(self.norm(x))


def step(s: Shape):
    """The predictor's Step of one GPU's training step of `s` (autoprec/tune/_measure/_step_shapes.py's trace_step)."""
    from autoprec.tune._measure._step_shapes import trace_step

    with torch.device("meta"):
        model = Decoder(s)
        ids = torch.zeros(s.batch, s.seq, dtype=torch.long)

    def run():
        logits = model(ids).float()
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), ids.reshape(-1))

    return trace_step(model, run)
