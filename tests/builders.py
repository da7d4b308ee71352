"""Records built by hand for the tests of what reads them (choosing, reporting): only the fields a test is about
are given, the rest take values of a candidate that ran cleanly. And `small_task`, a model.py around a given model;
`WithNoFp16Kernel`, a model with a layer type that cannot run in fp16; `WithLoRA`, one with a Linear subclass fp8 would
change (`LoRALinear`) and one it would not (`TaggedLinear`); `tiny_mixtral`, a model.py of a Hugging Face Mixtral MoE;
`te_installed`, the Transformer Engine version importlib.metadata reports (it does not install on a CPU)."""

import torch

from autoprec.tune._core._records import Finals, Measurement


def measurement(candidate: str, **fields) -> Measurement:
    values = dict(metric=1.0, metric_drop=0.0, runs=True, feasible=True, step_ms=10.0, skipped=0, steps=10,
                  effective_step_ms=10.0, spread=0.01, speedup=1.0)  # fmt: skip
    return Measurement(candidate=candidate, **{**values, **fields})


def finals(*rows: dict) -> Finals:
    """finals({"candidate": "fp32", "speedup": 1.0}, ...)."""
    return Finals(measurement(**row) for row in rows)


def made_up_peak(trainer) -> int:
    """A stand-in for Trainer.peak_memory on tests/models/overflow_mlp.py (exact, no device needed): 4000 bytes per
    fp32 layer and 2000 per lowered one, so the more layers are lowered the smaller the peak."""
    root = trainer.policy.layers.get("", "fp32")
    formats = [trainer.policy.layers.get(name, root) for name in ("fc1", "big", "head")]
    return sum(4000 if str(getattr(f, "value", f)) == "fp32" else 2000 for f in formats)


def small_task(model_code: str) -> str:
    """A model.py: `model_code` (defining build_model) with one seeded batch of 4 x 8 features, 4 classes."""
    return (
        "import torch\nfrom torch import nn\n\n" + model_code + "\n"
        "def batches(split):\n    g = torch.Generator().manual_seed(0)\n"
        "    return [(torch.randn(4, 8, generator=g), torch.randint(0, 4, (4,), generator=g))]\n\n"
        "def loss_fn(model, batch):\n    return nn.functional.cross_entropy(model(batch[0]), batch[1])\n"
    )


def fp8_mlp_task() -> str:
    """A model.py whose Linears fp8 runs (64 -> 256 -> 64, dimensions that are multiples of 16), one seeded batch of
    32 rows: the predictor's layout tests."""
    return (
        "import torch\nfrom torch import nn\n\n"
        "def build_model():\n    return nn.Sequential(nn.Linear(64, 256), nn.Linear(256, 64))\n\n"
        "def batches(split):\n    return [torch.randn(32, 64, generator=torch.Generator().manual_seed(0))]\n\n"
        "def loss_fn(model, batch):\n    return model(batch).square().mean()\n"
    )


def tiny_mixtral(hidden: int, inter: int, layers: int, experts: int, top_k: int) -> str:
    """A model.py of a tiny transformers Mixtral (4 heads, 2 key-value heads, vocabulary 128), one train batch of 4 x 16
    tokens: its experts are fused 3-D weights run by torch._grouped_mm, no nn.Linear."""
    return f"""
import torch
from transformers import MixtralConfig, MixtralForCausalLM


def build_model():
    torch.manual_seed(0)
    return MixtralForCausalLM(MixtralConfig(
        hidden_size={hidden}, intermediate_size={inter}, num_hidden_layers={layers}, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts={experts}, num_experts_per_tok={top_k}, vocab_size=128,
        max_position_embeddings=64,
    ))


def batches(split):
    g = torch.Generator().manual_seed(0 if split == "train" else 1)
    return [torch.randint(0, 128, (4, 16), generator=g)]


def loss_fn(model, batch):
    return model(input_ids=batch, labels=batch).loss
"""


def every_format_profile():
    """A profile of tests/models/overflow_mlp.py in fp32, bf16, fp16 and fp8 with nothing ruled out for its speed
    (fp16 is slow on CPUs; fp8 is timed only where it has kernels): every measurement is there for a report or a figure to show."""
    from pathlib import Path

    from short_timing import FAST_PROFILE

    from autoprec.tune import load_task, prepare, profile
    from autoprec.tune._core._space import space_from_dict

    workload = prepare(load_task(Path(__file__).parent / "models" / "overflow_mlp.py"), "cpu")
    space = space_from_dict({"layers": {"Linear": ["fp32", "bf16", "fp16", "fp8"]}, "prune": {"slower_than": 1e9}})
    return profile(workload, space, FAST_PROFILE, progress=False)


class NoFp16Kernel(torch.nn.Module):
    """A layer type this device has no fp16 kernel for, as oneDNN's LSTM on a CPU with bf16 kernels but not fp16
    (issue 38): its forward fails under fp16 autocast, as the real one does, and runs in bf16. Offered in a search
    space by its import path (builders.NoFp16Kernel)."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(32, 32) / 6)

    def forward(self, x):
        if torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.float16:
            raise RuntimeError("could not create a primitive descriptor for the fp16 forward propagation primitive")
        return x @ self.weight


class WithNoFp16Kernel(torch.nn.Module):
    """32 features in, 16 out: `rnn`, a NoFp16Kernel, then a Linear `head`."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.rnn = NoFp16Kernel()
        self.head = torch.nn.Linear(32, 16)

    def forward(self, x):
        return self.head(torch.tanh(self.rnn(x)))


class LoRALinear(torch.nn.Linear):
    """A Linear with a low-rank adapter of its own, as LoRA writes it: parameters `lora_a`, `lora_b` and a forward
    that adds their product. torchao's Float8Linear would replace it by a plain Linear, dropping both (issue 37)."""

    def __init__(self, in_features: int, out_features: int, rank: int = 4):
        super().__init__(in_features, out_features)
        self.lora_a = torch.nn.Parameter(torch.randn(rank, in_features) / in_features**0.5)
        self.lora_b = torch.nn.Parameter(torch.randn(out_features, rank) / rank**0.5)  # not zero: the adapter shows

    def forward(self, x):
        return super().forward(x) + x @ self.lora_a.t() @ self.lora_b.t()


class TaggedLinear(torch.nn.Linear):
    """A Linear subclass that is a Linear: no forward, parameters, buffers or children of its own, only a plain
    attribute; fp8 converts it as it does nn.Linear."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__(in_features, out_features)
        self.tag = "mine"


class WithLoRA(torch.nn.Module):
    """32 features in, 16 out: `lora`, a LoRALinear, then `plain`, a TaggedLinear."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lora = LoRALinear(32, 32)
        self.plain = TaggedLinear(32, 16)

    def forward(self, x):
        return self.plain(torch.relu(self.lora(x)))


def gemm_sqnrs(fmt: str, root: str) -> dict[str, float]:
    """A 256x512 Linear in `fmt` (the rest of the model in `root`, as apply_policy puts it) against its fp32
    control, seeded: the SQNR (dB) of its output (fprop), input gradient (dgrad) and weight gradient (wgrad)."""
    import copy

    from autoprec import Policy, apply_policy
    from autoprec.tune._measure._metric import sqnr_db

    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(256, 512))
    low = apply_policy(copy.deepcopy(ref), Policy(layers={"": root, "0": fmt}))
    x = torch.randn(64, 256)
    x_ref, x_low = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_ref = ref(x_ref)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=root == "bf16"):  # as a training step runs the policy
        y = low(x_low)
    grad_out = torch.randn_like(y_ref)
    y_ref.backward(grad_out)
    y.float().backward(grad_out)
    assert low[0].weight.grad.dtype == torch.float32  # the master weight's gradient stays in its dtype
    return {
        "fprop": sqnr_db(y_ref, y.float()),
        "dgrad": sqnr_db(x_ref.grad, x_low.grad.float()),
        "wgrad": sqnr_db(ref[0].weight.grad, low[0].weight.grad),
    }


def te_installed(monkeypatch, version: str | None) -> None:
    """importlib.metadata.version reports Transformer Engine `version` (None: not installed) for the rest of the test:
    the exported files read its version there before they import anything of it."""
    import importlib.metadata

    real = importlib.metadata.version

    def version_of(name: str) -> str:
        if name != "transformer_engine":
            return real(name)
        if version is None:
            raise importlib.metadata.PackageNotFoundError(name)
        return version

    monkeypatch.setattr(importlib.metadata, "version", version_of)
