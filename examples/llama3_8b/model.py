"""Llama-3-8B's shapes, for planning with `autoprec predict` (built on the meta device: no weights, no memory).

    autoprec predict examples/llama3_8b/model.py --target h100 --format fp8

The shapes: d_model 4096, 32 layers, 32 attention heads with 8 key/value heads (grouped-query attention), SwiGLU FFN
14336 wide, vocabulary 128,256, sequence 8192, one sequence per step (the published Llama-3-8B training runs' local
batch on each GPU). The blocks are Llama's (RMSNorm, rotary embedding, SwiGLU, an untied output layer); the weights
are random: this file is for shapes, not for training or a search (its batches are random token ids).
"""

import torch
from torch import nn
from torch.nn import functional as F

DIM, LAYERS, HEADS, KV_HEADS, FFN, VOCAB, SEQ, BATCH = 4096, 32, 32, 8, 14336, 128256, 8192, 1


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.head_dim = DIM // HEADS
        self.wq = nn.Linear(DIM, HEADS * self.head_dim, bias=False)
        self.wk = nn.Linear(DIM, KV_HEADS * self.head_dim, bias=False)
        self.wv = nn.Linear(DIM, KV_HEADS * self.head_dim, bias=False)
        self.wo = nn.Linear(HEADS * self.head_dim, DIM, bias=False)

    def forward(self, x, cos, sin):
        b, t, _ = x.shape
        q = self.wq(x).view(b, t, HEADS, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, t, KV_HEADS, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, t, KV_HEADS, self.head_dim).transpose(1, 2)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, DIM))


def rotate(x, cos, sin):
    a, b = x.chunk(2, dim=-1)
    return torch.cat((a * cos - b * sin, a * sin + b * cos), dim=-1)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention_norm = nn.RMSNorm(DIM)
        self.attention = Attention()
        self.ffn_norm = nn.RMSNorm(DIM)
        self.w1 = nn.Linear(DIM, FFN, bias=False)
        self.w3 = nn.Linear(DIM, FFN, bias=False)
        self.w2 = nn.Linear(FFN, DIM, bias=False)

    def forward(self, x, cos, sin):
        x = x + self.attention(self.attention_norm(x), cos, sin)
        h = self.ffn_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class Llama(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = nn.RMSNorm(DIM)
        self.output = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, ids):
        half = DIM // HEADS // 2
        freqs = torch.outer(torch.arange(ids.shape[1], device=ids.device).float(), torch.ones(half, device=ids.device))
        cos, sin = freqs.cos(), freqs.sin()
        x = self.tok_embeddings(ids)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.output(self.norm(x))


def build_model():
    return Llama()


def batches(split):
    g = torch.Generator().manual_seed(0 if split == "train" else 1)
    ids = torch.randint(VOCAB, (BATCH, SEQ + 1), generator=g)
    return [(ids[:, :-1], ids[:, 1:])]


def loss_fn(model, batch):
    ids, targets = batch
    logits = model(ids).float()
    return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))
