"""A Hugging Face BERT classifier (transformers' BertForSequenceClassification, built from a config: nothing
downloaded): which of four CPython standard-library modules a 64-byte window of source comes from. Written the
way HF users write it: batches are dicts and the loss is `model(**batch).loss`; the metric is accuracy.

    autoprec search examples/hf_bert/model.py --budget 0.02     # at most 2 points of accuracy

Its Linears (attention, MLP, pooler, classifier) are the layers. The weights come from a short training run on
first use (under a minute on a CPU), cached under $AUTOPREC_CACHE (default ~/.cache/autoprec/examples).
"""

import math
import os
import sys

import torch
import transformers

_TINYLM = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tinylm")
sys.path.insert(0, _TINYLM)
try:
    import stdlib_text  # the weights cache the other examples use
finally:
    sys.path.remove(_TINYLM)

CLASSES = ["argparse.py", "calendar.py", "csv.py", "difflib.py"]
HPARAMS = {
    "classes": CLASSES,
    "bytes_per_file": 16_000,
    "eval_frac": 0.2,
    "seq_len": 64,
    "hidden": 128,
    "layers": 2,
    "heads": 4,
    "batch": 32,
    "n_train_batches": 4,
    "n_eval_batches": 4,
    "steps": 300,
    "lr": 1e-3,
    "seed": 0,
}
SPLITS = ("train", "eval")


def _streams():
    """Per class, (train bytes, eval bytes) as int64 tensors: the first 80% of each file trains."""
    root = os.path.dirname(os.__file__)
    out = []
    for name in CLASSES:
        with open(os.path.join(root, name), "rb") as f:
            data = torch.frombuffer(bytearray(f.read(HPARAMS["bytes_per_file"])), dtype=torch.uint8).long()
        cut = int(len(data) * (1 - HPARAMS["eval_frac"]))
        out.append((data[:cut], data[cut:]))
    return out


def _windows(split, n, generator):
    """n windows of seq_len bytes with their class, drawn from `split` (train or eval) with `generator`."""
    streams = [s[0] if split == "train" else s[1] for s in _streams()]
    labels = torch.randint(len(CLASSES), (n,), generator=generator)
    ids = torch.stack([
        streams[c][(s := int(torch.randint(len(streams[c]) - HPARAMS["seq_len"], (1,), generator=generator))):s + HPARAMS["seq_len"]]
        for c in labels.tolist()
    ])  # fmt: skip
    return {"input_ids": ids, "labels": labels}


def batches(split):
    """Fixed batches (a seeded draw): 4 of 32 windows per split."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
    g = torch.Generator().manual_seed(1 if split == "train" else 2)
    return [_windows(split, HPARAMS["batch"], g) for _ in range(HPARAMS[f"n_{split}_batches"])]


def loss_fn(model, batch):
    return model(**batch).loss


def evaluate(model):
    """Accuracy on the eval batches (higher is better)."""
    device = next(model.parameters()).device
    correct = total = 0
    for b in batches("eval"):
        logits = model(input_ids=b["input_ids"].to(device)).logits
        correct += int((logits.argmax(-1).cpu() == b["labels"]).sum())
        total += len(b["labels"])
    return correct / total


def untrained():
    torch.manual_seed(HPARAMS["seed"])
    config = transformers.BertConfig(
        vocab_size=256, hidden_size=HPARAMS["hidden"], num_hidden_layers=HPARAMS["layers"], num_attention_heads=HPARAMS["heads"],
        intermediate_size=4 * HPARAMS["hidden"], max_position_embeddings=HPARAMS["seq_len"], num_labels=len(CLASSES),
    )  # fmt: skip
    return transformers.BertForSequenceClassification(config)


def build_model():
    """The trained fp32 classifier (AdamW on fresh random windows, cosine decay; trains once, then loads)."""
    path = stdlib_text.cache_path("hf-bert", HPARAMS)
    model = untrained()
    if torch.get_default_device().type == "meta":  # autoprec predict and verify: shapes and names only
        return model.eval()
    if os.path.exists(path):
        model.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
        return model.eval()
    opt = torch.optim.AdamW(model.parameters(), lr=HPARAMS["lr"], weight_decay=0.01)
    steps = HPARAMS["steps"]
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps)))
    g = torch.Generator().manual_seed(HPARAMS["seed"])
    model.train()
    for _ in range(steps):
        loss = loss_fn(model, _windows("train", HPARAMS["batch"], g))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
    stdlib_text.save_atomic(model.state_dict(), path)
    return model.eval()
