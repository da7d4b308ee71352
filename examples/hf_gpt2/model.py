"""A Hugging Face GPT-2 (transformers' GPT2LMHeadModel, built from a config: nothing downloaded), byte-level on the
CPython standard-library text the other language-model examples read, written the way HF users write it:
batches are dicts and the loss is `model(**batch).loss`.

An autoprec example of a transformers model: its attention and MLP matmuls are transformers' Conv1D, which the
default search space lists by import path (transformers.pytorch_utils.Conv1D), and the LM head a Linear. No
`evaluate`: the metric is -(mean eval loss).

    autoprec search examples/hf_gpt2/model.py --budget 0.02

Then train with the policy under HF Trainer (autoprec.integrations.transformers.PolicyTrainer): `train.py` beside
this file does it in a few lines. The weights come from a short training run on first use (about a minute on a
CPU), cached under $AUTOPREC_CACHE (default ~/.cache/autoprec/examples).
"""

import os
import sys

import torch
import transformers

_TINYLM = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tinylm")
sys.path.insert(0, _TINYLM)
try:
    import stdlib_text  # the text, the training recipe and the weights cache the other examples use
finally:
    sys.path.remove(_TINYLM)

HPARAMS = {
    "files": stdlib_text.FILES,
    "bytes_per_file": 12_000,
    "eval_frac": 0.1,
    "n_embd": 128,
    "n_head": 4,
    "n_layer": 2,
    "seq_len": 64,
    "batch": 16,
    "n_train_batches": 4,
    "n_eval_batches": 4,
    "steps": 200,
    "warmup": 20,
    "lr": 2e-3,
    "weight_decay": 0.1,
    "seed": 0,
}


def batches(split):
    """Dicts of input_ids and labels (HF shifts the labels inside the model), fixed windows of the text."""
    if split not in stdlib_text.SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {stdlib_text.SPLITS}")
    train, evals = stdlib_text.text(HPARAMS["bytes_per_file"], HPARAMS["eval_frac"])
    stream, n = (train, HPARAMS["n_train_batches"]) if split == "train" else (evals, HPARAMS["n_eval_batches"])
    return [
        {"input_ids": ids, "labels": ids} for ids, _ in stdlib_text.fixed_batches(stream, n, HPARAMS["batch"], HPARAMS["seq_len"])
    ]


def loss_fn(model, batch):
    return model(**batch).loss


def untrained():
    torch.manual_seed(HPARAMS["seed"])
    config = transformers.GPT2Config(
        vocab_size=256, n_positions=HPARAMS["seq_len"], n_embd=HPARAMS["n_embd"], n_layer=HPARAMS["n_layer"],
        n_head=HPARAMS["n_head"], bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


def build_model():
    """The trained fp32 model (trains once, then loads from the cache)."""

    def window_loss(model, window):  # the training recipe's batches are (input, next-byte) windows
        return model(input_ids=window[0], labels=window[0]).loss

    device = "cuda" if torch.cuda.is_available() else "cpu"
    return stdlib_text.trained("hf-gpt2", untrained, window_loss, HPARAMS, device)
