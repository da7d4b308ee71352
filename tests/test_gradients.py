"""autoprec/tune/_measure/_gradients.py: exact per-scale underflow/overflow fractions, the hooks, and the loss-scale advice."""

from __future__ import annotations

import math
from pathlib import Path

import pandas as pd
import pytest
import torch

from autoprec.tune import load_task, prepare
from autoprec.tune._measure._gradients import (
    BF16,
    E4M3,
    E5M2,
    FP16,
    SCALES_LOG2,
    Histogram,
    LayerGradients,
    ScaleAdvice,
    advise,
    collect,
    layer_range,
    scale_table,
)

MODELS = Path(__file__).parent / "models"


def test_format_ranges_come_from_finfo():
    assert (FP16.min_subnormal_log2, FP16.min_normal_log2, FP16.max_value) == (-24, -14, 65504.0)
    assert (E4M3.min_subnormal_log2, E4M3.min_normal_log2, E4M3.max_value) == (-9, -6, 448.0)
    assert (E5M2.min_subnormal_log2, E5M2.min_normal_log2, E5M2.max_value) == (-16, -14, 57344.0)
    assert (BF16.min_subnormal_log2, BF16.min_normal_log2) == (-133, -126)
    assert FP16.max_value == FP16.max_mantissa * 2.0**FP16.max_log2 and 1 <= FP16.max_mantissa < 2


def brute_force(values: torch.Tensor, rng, k: int) -> dict[str, float]:
    a = values.double().abs()
    a = a[(a > 0) & torch.isfinite(a)] * 2.0**k
    return {
        "underflow": float((a < 2.0**rng.min_subnormal_log2).double().mean()),
        "subnormal": float((a < 2.0**rng.min_normal_log2).double().mean()),
        "overflow": float((a > rng.max_value).double().mean()),
    }


def test_histogram_fractions_are_exact_at_every_scale():
    torch.manual_seed(0)
    x = torch.exp2(torch.empty(20_000).uniform_(-45, 20)) * torch.randn(20_000).sign()
    # values on and next to every threshold, where a binned count would be off by one bin
    edges = [65504.0, 65505.0, 448.0, 449.0, 57344.0, 57345.0, 2.0**-24, 2.0**-25, 2.0**-14, 0.0, math.inf]
    x = torch.cat([x, torch.tensor(edges)])
    h = Histogram()
    h.add(x[:7000])
    h.add(x[7000:])  # accumulates across tensors
    assert (h.numel, h.zeros, h.nonfinite) == (len(x), 1, 1)
    for rng in (FP16, E4M3, E5M2, BF16):
        for k in (0, 1, 7, 16, 24):
            assert h.fractions(rng, k) == pytest.approx(brute_force(x, rng, k), abs=1e-12), (rng.name, k)


def test_thresholds_are_strict():
    h = Histogram()
    h.add(torch.tensor([2.0**-24, 2.0**-25, 65504.0, 65505.0]))
    assert h.below(-24) == 1 and h.above(FP16) == 1  # 2^-24 and 65504 are representable
    assert h.below(-24, scale_log2=1) == 0 and h.above(FP16, scale_log2=1) == 2


def test_fp8_dynamic_scaling_underflow_is_relative_to_the_tensors_max():
    h = Histogram()
    h.add(torch.tensor([1.0, 1e-6, 1e-9]))
    # amax 1 maps to 448 (e4m3): below 2^-9 / 448 ~ 4.4e-6 flushes; e5m2 reaches 2^-16 / 57344 ~ 2.7e-10
    assert h.dynamic_underflow == {"fp8_e4m3": 2, "fp8_e5m2": 0}


def test_hooks_see_weight_output_and_input_gradients_without_changing_them(write_model):
    # nn.ReLU(inplace=True) right after a tunable layer: a full backward hook would refuse it.
    src = """
        import torch
        from torch import nn
        def build_model():
            torch.manual_seed(0)
            return nn.Sequential(nn.Linear(8, 16), nn.ReLU(inplace=True), nn.Linear(16, 4))
        def batches(split):
            g = torch.Generator().manual_seed(0)
            return [(torch.randn(5, 8, generator=g), torch.randint(0, 4, (5,), generator=g))]
        def loss_fn(model, batch):
            return nn.functional.cross_entropy(model(batch[0]), batch[1])
    """
    workload = prepare(load_task(write_model(src)), "cpu")
    records = collect(workload, ["0", "2"])
    first, head = records["0"].tensors, records["2"].tensors
    assert first["input_grad"].numel == 0  # fed by data: no gradient flows out of the first layer
    assert first["weight_grad"].numel == 8 * 16 + 16 and first["output_grad"].numel == 5 * 16
    assert head["input_grad"].numel == 5 * 16 and head["output_grad"].numel == 5 * 4
    # the same weight gradients as a plain backward: the taps are identities
    model = workload.task.build_model()
    workload.task.loss_fn(model, workload.train[0]).backward()
    grads = torch.cat([p.grad.flatten() for p in model[2].parameters()]).abs()
    assert head["weight_grad"].amax == pytest.approx(float(grads.max()))
    assert workload.model[0].weight.grad is None  # the reference model is never touched


@pytest.fixture(scope="module")
def underflow():
    workload = prepare(load_task(MODELS / "underflow_mlp.py"), "cpu")
    return scale_table(collect(workload, ["fc1", "fc2", "head"]))


def test_tiny_gradients_underflow_fp16_without_scaling(underflow):
    fp16_all = underflow[(underflow["tensor"] == "all") & (underflow["format"] == "fp16")].set_index(["layer", "scale_log2"])
    for layer in ("fc1", "fc2", "head"):
        assert fp16_all.loc[(layer, 0), "underflow"] > 0.99  # ~1e-9 gradients: below 2^-24
        assert fp16_all.loc[(layer, 24), "underflow"] < 1e-3
    advice = advise(underflow)
    assert advice.low is not None and 12 <= advice.low <= 22 and advice.high == max(SCALES_LOG2)
    assert advice.search_range == (advice.low, 24) and not advice.unfit


def test_grad_ranges_table_is_long_form(underflow):
    assert list(underflow.columns) == ["layer", "tensor", "format", "scale_log2", "nonzero", "underflow", "subnormal", "overflow"]
    assert set(underflow["format"]) == {"fp16", "fp8_e4m3", "fp8_e5m2"}
    assert set(underflow["tensor"]) == {"weight_grad", "output_grad", "input_grad", "all"}
    assert len(underflow) == 3 * 4 * 3 * len(SCALES_LOG2)
    assert (underflow["subnormal"] >= underflow["underflow"]).all()


def test_overflow_model_range_is_bounded_by_its_head():
    workload = prepare(load_task(MODELS / "overflow_mlp.py"), "cpu")
    advice = advise(scale_table(collect(workload, ["fc1", "big", "head"])))
    # big's gradients are tiny (its output is divided by 1e5): it sets the low end; head's are the largest
    assert advice.low_limited_by == ("big",) and advice.high_limited_by == ("head",)
    assert 0 < advice.low <= advice.high < 24


def synthetic(layers: dict[str, list[float]]) -> pd.DataFrame:
    records = {}
    for name, values in layers.items():
        record = LayerGradients(name)
        record.tensors["weight_grad"].add(torch.tensor(values))
        records[name] = record
    return scale_table(records)


def test_layer_range_and_conflicting_layers():
    table = synthetic({"tiny": [2.0**-40] * 10, "huge": [2.0**10] * 10, "wild": [1e5]})
    assert layer_range(table, "tiny", 1e-3)[:2] == (16, 24)  # 2^-40 * 2^16 = 2^-24: fp16's smallest subnormal
    assert layer_range(table, "huge", 1e-3)[:2] == (0, 5)  # 2^10 * 2^6 = 65536 > 65504
    assert layer_range(table, "wild", 1e-3)[:2] == (None, None)  # overflows at 2^0
    advice = advise(table)
    assert (advice.low, advice.high, advice.unfit) == (16, 5, ("wild",))
    assert advice.search_range == (5, 5) and "no one scale suits every layer" in advice.note
    assert advise(table, ["tiny"]).search_range == (16, 24)
    assert advise(table, ["wild"]).search_range is None


def test_advice_round_trips_and_describes_itself():
    advice = advise(synthetic({"a": [2.0**-30], "b": [1.0]}))
    assert ScaleAdvice.from_dict(advice.to_dict()) == advice
    text = advice.describe()
    assert "recommended loss scale 2^6 .. 2^15" in text and "low end set by a" in text and "high end set by b" in text
