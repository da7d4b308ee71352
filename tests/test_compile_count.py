"""How many graphs a compiled profile and a compiled search build, bounded (benchmarks/compile_count.py counts the GPU
suite's; benchmarks/GPU_PLAN.md prices a device call from them): each graph is seconds of inductor on a GPU, so a
change that compiles per step, per layer instead of per shape, or per round would blow a device call's minutes.
Counted with a backend that captures each graph as dynamo does and runs it eagerly: no inductor here."""

from __future__ import annotations

import collections
from pathlib import Path

import pytest
import torch
from short_timing import FAST_PROFILE, TINY

from autoprec.tune import SearchConfig, load_task, prepare
from autoprec.tune._core._space import space_from_dict
from autoprec.tune._search._out_dir import load_or_profile
from autoprec.tune._search._pipeline import search

MODELS = Path(__file__).parent / "models"
FORMATS = ["fp32", "bf16", "fp8"]


@pytest.fixture
def graphs(monkeypatch):
    """Each graph torch.compile builds from now on, counted by the stage name in `stage[0]`."""
    count: collections.Counter[str] = collections.Counter()
    stage = ["setup"]
    real = torch.compile

    def counting(gm, example_inputs):
        count[stage[0]] += 1
        return gm.forward

    monkeypatch.setattr(torch, "compile", lambda model=None, **kw: real(model, **{**kw, "backend": counting}))
    return count, stage


@pytest.mark.slow
def test_a_compiled_profile_and_search_build_about_one_graph_per_shape_and_format_and_per_candidate(
    graphs, tmp_path, no_gpu_contract
):
    """Counted as benchmarks/compile_count.py counts, without --gpu-contract: its stand-in for CUDA's autocast query is
    a Python function torch.compile breaks its graph on, which adds graphs CUDA's own query does not."""
    count, stage = graphs
    workload = prepare(load_task(MODELS / "overflow_mlp.py"), "cpu")
    space = space_from_dict({"default": ["fp32", "bf16"], "layers": {"Linear": FORMATS}, "trials": 6})
    config = SearchConfig(budget=1.0, compile=True, timing=TINY, final_timing=TINY, profile=FAST_PROFILE, progress=False,
                          predict_speed=False)  # fmt: skip
    shapes = {tuple(m.weight.shape) for m in workload.model.modules() if isinstance(m, torch.nn.Linear)}
    stage[0] = "profile"
    load_or_profile(workload, space, tmp_path, config)
    # each Linear shape once per format it can run (fp8 needs both dimensions divisible by 16: head has 4 outputs)
    assert 0 < count["profile"] <= len(shapes) * len(FORMATS)  # 8 here: head's fp8 is ruled out
    stage[0] = "search"
    result = search(workload, space, config, tmp_path)
    # every trial beside a fresh fp32 baseline, then the re-measure's candidates: the model whole (no repeated blocks),
    # one graph each (16 here), never one per step, round or batch
    timed = len(result.trials) + len(result.finals.names)
    assert 0 < count["search"] <= 2 * timed
