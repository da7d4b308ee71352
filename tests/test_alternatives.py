"""The alternatives every result is measured beside: what each one is, and what is left out and why."""

from pathlib import Path

import torch
from torch import nn

from autoprec.formats import Format
from autoprec.tune import load_task, prepare
from autoprec.tune._core._config import ProfileConfig
from autoprec.tune._core._names import BF16, BF16_GRAPHS, FP8_EVERYWHERE, FP8_ROWWISE_EVERYWHERE, FP32, GREEDY, TF32
from autoprec.tune._core._space import space_from_dict
from autoprec.tune._decide._alternatives import alternatives, torchao_fp8_layers
from autoprec.tune._measure._choices import build_choices
from autoprec.tune._measure._profiler import profile

MODELS = Path(__file__).parent / "models"
SPACE = space_from_dict({"default": ["fp32", "bf16"], "layers": {"Linear": ["fp32", "bf16"]}, "trials": 3})


class Wide(nn.Module):
    """One Linear past torchao's tensorwise thresholds (N = 2048 > 1024), one below them, one not divisible by
    16, and a MultiheadAttention whose out_proj is a Linear it never calls."""

    def __init__(self):
        super().__init__()
        self.up = nn.Linear(64, 2048)
        self.down = nn.Linear(2048, 64)
        self.odd = nn.Linear(2048, 2050)
        self.attn = nn.MultiheadAttention(2048, 8)


def test_fp8_everywhere_takes_the_linears_torchaos_own_filter_accepts():
    layers, looked_at = torchao_fp8_layers(Wide(), torch.device("cpu"))
    assert layers == ["up"]  # down: K 2048 <= 4096 and N 64 <= 1024; odd: not divisible by 16; attn.out_proj: never called
    assert looked_at == 3


def test_fp8_rowwise_everywhere_takes_the_linears_torchaos_rowwise_filter_accepts():
    """torchao's rowwise thresholds are its own (N > 2048, K > 1024, not both N <= 4096 and K <= 2048): `up` (N 2048)
    passes the tensorwise filter but not this one, which takes only the large square layer."""
    model = Wide()
    model.large = nn.Linear(4096, 4096)
    layers, looked_at = torchao_fp8_layers(model, torch.device("cpu"), "rowwise")
    assert layers == ["large"] and looked_at == 4


def test_on_a_cpu_the_alternatives_are_fp32_bf16_and_greedy_with_reasons_for_the_rest(no_gpu_contract):
    """TF32 is CUDA's; fp8 everywhere would run torchao's emulation on a CPU, or the space may offer no fp8."""
    workload = prepare(load_task(MODELS / "overflow_mlp.py"), "cpu")
    tiny = ProfileConfig(
        batches=1, timing=ProfileConfig().timing.__class__(warmup=0, rounds=1, min_block_s=0.0, warmup_s=0.0, min_steps=1)
    )
    prof = profile(workload, SPACE, tiny, progress=False)
    choices = build_choices(prof, SPACE, 0.05, workload.device)
    alts = alternatives(workload.model, workload.device, prof, choices, 0.05)
    assert list(alts.candidates) == [FP32, BF16, GREEDY]
    assert "CUDA" in alts.notes[TF32]
    assert "no fp8 kernels" in alts.notes[FP8_EVERYWHERE] and "no fp8 kernels" in alts.notes[FP8_ROWWISE_EVERYWHERE]
    only_rowwise = alternatives(workload.model, workload.device, prof, choices, 0.05, offered=frozenset({Format.FP8_ROWWISE}))
    assert "offers no `fp8` layer" in only_rowwise.notes[FP8_EVERYWHERE]
    assert "no fp8 kernels" in only_rowwise.notes[FP8_ROWWISE_EVERYWHERE]  # offered, but emulation here
    fp32 = alts.candidates[FP32]
    assert not fp32.tf32 and {f.value for f in fp32.policy.layers.values()} == {"fp32"}
    assert {f.value for f in alts.candidates[BF16].policy.layers.values()} == {"bf16"}
    assert not any(c.cuda_graphs for c in alts.candidates.values())
    # --cuda-graphs (its device checked by search_config): uniform bf16 again, compiled with CUDA graphs
    graphs = alternatives(workload.model, workload.device, prof, choices, 0.05, cuda_graphs=True).candidates
    assert list(graphs) == [FP32, BF16, BF16_GRAPHS, GREEDY]
    assert graphs[BF16_GRAPHS].cuda_graphs and graphs[BF16_GRAPHS].policy == graphs[BF16].policy


def test_with_fp8_kernels_fp8_everywhere_is_torchaos_layers_under_a_bf16_root(monkeypatch):
    monkeypatch.setattr("autoprec.formats.has_fp8_kernels", lambda device: True)  # as on an H100
    workload = prepare(load_task(MODELS / "overflow_mlp.py"), "cpu")
    tiny = ProfileConfig(
        batches=1, timing=ProfileConfig().timing.__class__(warmup=0, rounds=1, min_block_s=0.0, warmup_s=0.0, min_steps=1)
    )
    prof = profile(workload, SPACE, tiny, progress=False)
    choices = build_choices(prof, SPACE, 0.05, workload.device)
    filtered = {"tensorwise": ["fc1", "big"], "rowwise": ["big"]}  # each recipe's own filter
    monkeypatch.setattr(
        "autoprec.tune._decide._alternatives.torchao_fp8_layers", lambda model, device, recipe: (filtered[recipe], 3)
    )
    alts = alternatives(workload.model, workload.device, prof, choices, 0.05)
    assert {n: f.value for n, f in alts.candidates[FP8_EVERYWHERE].policy.layers.items()} == {
        "": "bf16",
        "fc1": "fp8",
        "big": "fp8",
    }
    assert {n: f.value for n, f in alts.candidates[FP8_ROWWISE_EVERYWHERE].policy.layers.items()} == {
        "": "bf16",
        "big": "fp8-rowwise",
    }
    assert not alts.candidates[FP8_EVERYWHERE].policy.fsdp_fp8_all_gather  # one device: nothing to all-gather
    # trained sharded: torchao's tensorwise recipe all-gathers in fp8, as torchtitan's float8 guide runs it; rowwise cannot
    sharded = alternatives(workload.model, workload.device, prof, choices, 0.05, fp8_all_gather=True).candidates
    assert sharded[FP8_EVERYWHERE].policy.fsdp_fp8_all_gather and not sharded[FP8_ROWWISE_EVERYWHERE].policy.fsdp_fp8_all_gather
    assert sharded[FP8_EVERYWHERE].policy.layers == alts.candidates[FP8_EVERYWHERE].policy.layers
    monkeypatch.setattr("autoprec.tune._decide._alternatives.torchao_fp8_layers", lambda model, device, recipe: ([], 3))
    alts = alternatives(workload.model, workload.device, prof, choices, 0.05)
    assert FP8_EVERYWHERE not in alts.candidates and "converts none of the model's 3 Linears" in alts.notes[FP8_EVERYWHERE]
    assert "rowwise size filter" in alts.notes[FP8_ROWWISE_EVERYWHERE]
