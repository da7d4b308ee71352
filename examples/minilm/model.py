"""A MiniLM-class sentence encoder (transformers' BertModel in all-MiniLM-L6-v2's shape: 6 layers, hidden 384, 12
heads, MLP 1536; built from a config, nothing downloaded) with a projection head: 37 Linears, as many as the
MiniLM search of issue 14 had. It learns to retrieve: a 48-byte window of CPython source (the query) must find
its key, the window 12 bytes further on (36 bytes shared), among every eval key, by the cosine of the embeddings.
The metric is top-1 retrieval accuracy; the loss the in-batch contrastive loss sentence encoders train with.

    autoprec search examples/minilm/model.py --budget 0.01 --trials 16     # at most 1 point of accuracy

The vocabulary is bytes (256 tokens, not MiniLM's 30522 word pieces), so its embedding is small: the Linears, what
autoprec tunes, are MiniLM's. The weights come from a short training run on first use (a few minutes on a CPU),
cached under $AUTOPREC_CACHE (default ~/.cache/autoprec/examples).
"""

import os
import sys

import torch
import transformers

_TINYLM = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tinylm")
sys.path.insert(0, _TINYLM)
try:
    import stdlib_text  # the text and the weights cache the other examples use
finally:
    sys.path.remove(_TINYLM)

HPARAMS = {"bytes_per_file": 24_000, "eval_frac": 0.2, "seq_len": 48, "hidden": 384, "layers": 6, "heads": 12,
           "intermediate": 1536, "shift": 12, "batch": 32, "n_train_batches": 4, "n_eval_batches": 4, "steps": 120,
           "lr": 5e-4, "temperature": 0.05, "seed": 0}  # fmt: skip
SPLITS = ("train", "eval")


class Encoder(torch.nn.Module):
    """BertModel, mean pooling over the tokens, a Linear projection: the sentence embedding."""

    def __init__(self):
        super().__init__()
        config = transformers.BertConfig(
            vocab_size=256, hidden_size=HPARAMS["hidden"], num_hidden_layers=HPARAMS["layers"],
            num_attention_heads=HPARAMS["heads"], intermediate_size=HPARAMS["intermediate"],
            max_position_embeddings=HPARAMS["seq_len"],
        )  # fmt: skip
        self.bert = transformers.BertModel(config, add_pooling_layer=False)
        self.head = torch.nn.Linear(HPARAMS["hidden"], HPARAMS["hidden"])

    def forward(self, input_ids):
        hidden = self.bert(input_ids=input_ids).last_hidden_state
        return self.head(hidden.mean(dim=1))


def _pairs(split, n, generator):
    """n (query, key) pairs from `split`'s text: a window of seq_len bytes, and the window `shift` bytes on."""
    train, evals = stdlib_text.text(HPARAMS["bytes_per_file"], HPARAMS["eval_frac"])
    stream, length, shift = (train if split == "train" else evals), HPARAMS["seq_len"], HPARAMS["shift"]
    starts = torch.randint(len(stream) - length - shift, (n,), generator=generator)
    idx = starts[:, None] + torch.arange(length + shift)
    chunk = stream[idx]
    return {"query": chunk[:, :length], "key": chunk[:, shift:]}


def batches(split):
    """Fixed batches (a seeded draw): 4 of 32 pairs per split."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
    g = torch.Generator().manual_seed(1 if split == "train" else 2)
    return [_pairs(split, HPARAMS["batch"], g) for _ in range(HPARAMS[f"n_{split}_batches"])]


def _embed(model, ids):
    return torch.nn.functional.normalize(model(ids).float(), dim=-1)


def loss_fn(model, batch):
    """In-batch contrastive loss (InfoNCE, both directions): each query's key against the batch's other keys."""
    q, k = _embed(model, batch["query"]), _embed(model, batch["key"])
    logits = q @ k.T / HPARAMS["temperature"]
    labels = torch.arange(len(q), device=logits.device)
    return (torch.nn.functional.cross_entropy(logits, labels) + torch.nn.functional.cross_entropy(logits.T, labels)) / 2


@torch.no_grad()
def evaluate(model):
    """Top-1 retrieval accuracy: each eval query against all 128 eval keys (higher is better)."""
    device = next(model.parameters()).device
    data = batches("eval")
    q = torch.cat([_embed(model, b["query"].to(device)) for b in data])
    k = torch.cat([_embed(model, b["key"].to(device)) for b in data])
    hits = (q @ k.T).argmax(dim=1).cpu() == torch.arange(len(q))
    return float(hits.float().mean())


def build_model():
    """The trained fp32 encoder (AdamW on fresh random pairs; trains once, then loads from the cache)."""
    path = stdlib_text.cache_path("minilm", HPARAMS)
    torch.manual_seed(HPARAMS["seed"])
    model = Encoder()
    if torch.get_default_device().type == "meta":  # autoprec predict and verify: shapes and names only
        return model.eval()
    if os.path.exists(path):
        model.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
        return model.eval()
    opt = torch.optim.AdamW(model.parameters(), lr=HPARAMS["lr"], weight_decay=0.01)
    g = torch.Generator().manual_seed(HPARAMS["seed"])
    model.train()
    for _ in range(HPARAMS["steps"]):
        loss = loss_fn(model, _pairs("train", HPARAMS["batch"], g))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    stdlib_text.save_atomic(model.state_dict(), path)
    return model.eval()
