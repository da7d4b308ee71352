"""Byte-level text from CPython's own standard-library sources, for the example language models.

A fixed list of pure-Python modules read from the running interpreter's install (no download): the first
`1 - eval_frac` of each file trains, the rest evaluates. Shared by model.py (TinyLM) and moe12.py, with the training recipe and the weights cache they share.
"""

import hashlib
import json
import math
import os
import tempfile

import torch
from torch import nn

# Modules present (as plain .py files) in every CPython 3.10-3.13 install.
FILES = sorted(
    [
        "argparse.py",
        "calendar.py",
        "csv.py",
        "difflib.py",
        "fractions.py",
        "heapq.py",
        "json/decoder.py",
        "json/encoder.py",
        "pprint.py",
        "shlex.py",
        "string.py",
        "textwrap.py",
    ]
)
SPLITS = ("train", "eval")

_CACHE = {}


def text(bytes_per_file, eval_frac):
    """(train_bytes, eval_bytes) as int64 tensors of byte values."""
    key = (bytes_per_file, eval_frac)
    if key not in _CACHE:
        root = os.path.dirname(os.__file__)
        train, evals = [], []
        for name in FILES:
            with open(os.path.join(root, name), "rb") as f:
                data = f.read(bytes_per_file)
            cut = int(len(data) * (1 - eval_frac))
            train.append(data[:cut])
            evals.append(data[cut:])
        _CACHE[key] = tuple(torch.frombuffer(bytearray(b"".join(p)), dtype=torch.uint8).long() for p in (train, evals))
    return _CACHE[key]


def digest(parts):
    """A short hash of the text, for cache keys: other Python versions ship other sources."""
    return hashlib.sha256(b"".join(t.to(torch.uint8).numpy().tobytes() for t in parts)).hexdigest()[:16]


def windows(stream, starts, seq_len):
    """(input_ids, target_ids) for windows of seq_len+1 bytes starting at `starts`."""
    idx = starts[:, None] + torch.arange(seq_len + 1)
    chunk = stream[idx]
    return chunk[:, :-1], chunk[:, 1:]


def fixed_batches(stream, n_batches, batch, seq_len):
    """`n_batches` batches of non-overlapping windows spread evenly over the whole stream."""
    stride = (len(stream) - seq_len - 1) // (n_batches * batch)
    starts = torch.arange(n_batches * batch) * stride
    return [windows(stream, starts[i * batch : (i + 1) * batch], seq_len) for i in range(n_batches)]


def cache_path(name, hparams):
    root = os.environ.get("AUTOPREC_CACHE") or os.path.expanduser("~/.cache/autoprec/examples")
    key = hashlib.sha256(json.dumps(hparams, sort_keys=True).encode()).hexdigest()[:12]
    return os.path.join(root, f"{name}-{key}.pt")


def save_atomic(state, path):
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


def train(make_model, loss_fn, h, device="cpu"):
    """AdamW on seeded random windows of the train split, warmup then cosine decay, gradients clipped at 1.
    `h`: the hyper-parameters (seed, lr, weight_decay, steps, warmup, batch, seq_len, bytes_per_file, eval_frac).
    On CUDA the steps run under bf16 autocast (minutes for a GPT-2-small-sized model); the weights stay fp32."""
    torch.manual_seed(h["seed"])
    gen = torch.Generator().manual_seed(h["seed"])
    model = make_model().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=h["lr"], weight_decay=h["weight_decay"], betas=(0.9, 0.95))
    steps, warmup = h["steps"], h["warmup"]
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps))
    )
    stream, _ = text(h["bytes_per_file"], h["eval_frac"])
    model.train()
    low = torch.device(device).type == "cuda"
    for _ in range(steps):
        starts = torch.randint(len(stream) - h["seq_len"] - 1, (h["batch"],), generator=gen)
        batch = tuple(t.to(device) for t in windows(stream, starts, h["seq_len"]))
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=low):
            loss = loss_fn(model, batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
    return model.cpu()


def trained(name, make_model, loss_fn, h, device="cpu"):
    """The model trained by `train` (on `device`), from the cache under $AUTOPREC_CACHE (default
    ~/.cache/autoprec/examples) when there, keyed by a hash of the hyper-parameters, the text and, for weights
    trained off the CPU, the device type; on the CPU, in eval mode. Under the meta device (autoprec predict and
    verify want shapes and names only), the bare model: nothing trained or loaded."""
    if torch.get_default_device().type == "meta":
        return make_model().eval()
    kind = torch.device(device).type
    key = {**h, "text": digest(text(h["bytes_per_file"], h["eval_frac"]))}
    path = cache_path(name, key if kind == "cpu" else {**key, "trained_on": kind})
    if os.path.exists(path):
        model = make_model()  # built only here: train() builds its own (a 1.2B model takes a while to initialise)
        model.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
    else:
        model = train(make_model, loss_fn, h, device)
        save_atomic(model.state_dict(), path)
    return model.eval()
