"""The step-time predictor's calibration and validation points (autoprec/tune/_measure/_predict.py; docs/planning.md).

    python benchmarks/predict_points.py            # print the validation table (markdown)
    python benchmarks/predict_points.py --fit      # fit the calibration on the fitted points; print it
    python benchmarks/predict_points.py --write    # rewrite docs/planning.md's table from the code

Every measured number here comes from /work/shared/anchors/training-speedups.md's rows (with their sources) or from
results/h200/fp8_linear.txt; nothing else. Each point says whether the calibration was fitted on it. The Llama-3-8B
points price examples/llama3_8b/model.py's shapes (d_model 4096, 32 layers, 32 heads, 8 KV heads, FFN 14336,
vocabulary 128,256, sequence 8192, one sequence per GPU per step) with the optimizer's work split over the run's GPUs
(FSDP, whose all-gathers and reduce-scatters the predictor prices where the compute does not hide them).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import re
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from autoprec.formats import Format  # noqa: E402
from autoprec.policy import ROOT as MODEL_ROOT  # noqa: E402
from autoprec.policy import Policy  # noqa: E402
from autoprec.tune._core._targets import target_named  # noqa: E402
from autoprec.tune._measure import _predict as predictor  # noqa: E402
from autoprec.tune._measure._step_shapes import traced  # noqa: E402
from benchmarks.models import decoder  # noqa: E402

DOC = ROOT / "docs" / "planning.md"
BEGIN, END = "<!-- validation table: benchmarks/predict_points.py --write -->", "<!-- end of validation table -->"
FP8_LINEAR = "results/h200/fp8_linear.txt"
ANCHORS = "anchors: training-speedups.md"


def linear_step(n: int) -> predictor.Step:
    """results/h200/fp8_linear.txt's workload: one Linear(n, n) on an (n x n) input, forward and backward, nothing
    else (no optimizer step)."""
    return predictor.Step((predictor.LinearShape("0", n, n, float(n), produced=False),))


@dataclasses.dataclass(frozen=True)
class Point:
    """One measured or published result: `measured` the speedup over bf16 (or, with `ms`, a step time), `fitted`
    whether the calibration was fitted on it."""

    name: str
    target: str
    measured: float
    source: str
    fitted: bool
    compute: Callable[[predictor.Calibration], float]
    fmt: str  # the format the point lowers its Linears to: its kernels are its regime's (predictor.regime_band)
    width: int  # the model's width (d_model; a lone Linear's features): its regime's
    tp: bool = False  # trained with tensor parallelism: its regime's
    async_tp: bool = False  # and asynchronous TP: its regime's
    moe: bool = False  # an MoE whose grouped experts do much of the matmul work: its regime's
    experts: bool = False  # the MoE's grouped experts lowered: its regime's
    unit: str = "x"  # "x": a speedup over bf16; "ms": a step time
    note: str = ""
    # the fitted point it computes exactly as (another publication of the same run): shown, but no test of the
    # predictor, so neither held out nor in the band
    repeats: str = ""
    # why the run is outside what the predictor prices (its routing unbalanced): shown with its error, not held out
    excluded: str = ""

    @property
    def held_out(self) -> bool:
        return not (self.fitted or self.repeats or self.excluded)


def _linear_ratio(fmt: str, n: int = 8192) -> Callable[[predictor.Calibration], float]:
    def compute(cal: predictor.Calibration) -> float:
        step, target = linear_step(n), target_named("h200")
        bf16 = predictor.predict(step, Policy(layers={"0": "bf16"}), target, cal).ms  # an fp32 caller, as the benchmark's
        return bf16 / predictor.predict(step, Policy(layers={"0": fmt}), target, cal).ms

    return compute


def _linear_ms(fmt: str, n: int = 8192) -> Callable[[predictor.Calibration], float]:
    def compute(cal: predictor.Calibration) -> float:
        return predictor.predict(linear_step(n), Policy(layers={"0": fmt}), target_named("h200"), cal).ms

    return compute


def _decoder(
    fmt: str,
    target: str,
    gpus: int,
    shape: decoder.Shape = decoder.LLAMA3_8B,
    tail: int = 0,
    tp: int = 1,
    checkpointing: bool = False,
    experts: str | None = None,
    ep: int = 1,
    skip: tuple[str, ...] = (),
    async_tp: bool = False,
    fp8_all_gather: bool = False,
) -> Callable[[predictor.Calibration], float]:
    """A decoder (benchmarks/models/decoder.py; Llama-3-8B's by default) with every Linear but the output layer, an
    MoE's router and those named `skip` (by their last name: "wk") in `fmt` (the float8 and MX converters' usual
    filter; `fmt` "bf16": none) but the last `tail` blocks', the rest bf16, over uniform bf16, the optimizer split
    over `gpus` data-parallel ranks (and `tp` tensor-parallel ones, asynchronous where `async_tp`); an MoE's grouped
    experts in `experts` (None: bf16), spread over `ep` expert-parallel ranks; tensorwise-fp8 weights gathered in fp8
    where `fp8_all_gather`."""

    def compute(cal: predictor.Calibration) -> float:
        step = dataclasses.replace(
            decoder_step(shape),
            shards=gpus,
            tensor_parallel=tp,
            async_tp=async_tp,
            checkpointing=checkpointing,
            expert_parallel=ep,
            fp8_all_gather=fp8_all_gather,
        )
        layers: dict[str, str] = {MODEL_ROOT: "bf16"}
        first_bf16 = shape.layers - tail
        kept = ("router", *skip)
        for s in step.linears:
            block = s.name.split(".")[1] if s.name.startswith("layers.") else None
            if s.name != "output" and s.name.rsplit(".", 1)[-1] not in kept and (block is None or int(block) < first_bf16):
                layers[s.name] = fmt
        grouped = None if experts is None else Format(experts)
        return predictor.speedup(step, Policy(layers=layers), target_named(target), cal, experts=grouped)

    return compute


@functools.cache
def decoder_step(shape: decoder.Shape) -> predictor.Step:
    return decoder.step(shape)


H200_PROBE = ROOT / "results" / "h200" / "probe"


@functools.cache
def probe_llama_step() -> predictor.Step:
    """examples/llama/model.py at its full size (2048 wide, 16,384 tokens a step), as the H200 probe trained it and as
    `autoprec predict` traces it; one GPU."""
    import os

    from autoprec.tune._measure._task import load_task

    before = os.environ.get("AUTOPREC_LLAMA_SIZE")
    os.environ["AUTOPREC_LLAMA_SIZE"] = "full"
    try:
        return traced(load_task(ROOT / "examples" / "llama" / "model.py")).step
    finally:
        if before is None:
            del os.environ["AUTOPREC_LLAMA_SIZE"]
        else:
            os.environ["AUTOPREC_LLAMA_SIZE"] = before


def _probe_ratio(policy_file: str) -> Callable[[predictor.Calibration], float]:
    """The probe's Llama under results/h200/probe/predict/`policy_file` (c_llama.csv's candidate) over uniform bf16."""

    def compute(cal: predictor.Calibration) -> float:
        from autoprec.policy import load_policy

        policy = load_policy(H200_PROBE / "predict" / policy_file)
        return predictor.speedup(probe_llama_step(), policy, target_named("h200"), cal)

    return compute


def _probe_measured(candidate: str) -> float:
    """c_llama.csv's uniform bf16 median step over `candidate`'s (the H200 probe, compiled, 11 interleaved rounds)."""
    import csv

    with (H200_PROBE / "c_llama.csv").open(newline="", encoding="utf-8") as fh:
        # the step as training runs it (autoprec's clock), not the GPU's busy time alone (stage c's held rows)
        ms = {r["candidate"]: float(r["median_ms"]) for r in csv.DictReader(fh) if r["method"] == "autoprec"}
    return round(ms["uniform bf16"] / ms[candidate], 3)


# GB200 runs of torchtitan's NVFP4 converter (PR #3914, nvfp4.md): sequences of 2048, 32 per GPU
LLAMA3_8B_GB200 = dataclasses.replace(decoder.LLAMA3_8B, seq=2048, batch=32)
TITAN_NVFP4 = "torchtitan PR #3914 / nvfp4.md (4x GB200; published_points.md A44-A48)"
AO_PR940 = "pytorch/ao PR #940 message (8x H100, no fp8 all-gather; published_points.md A14-A16)"
NANOCHAT = "karpathy/nanochat dev/LOG.md 2026-02-02 (8x H100; published_points.md A21-A22)"
PROBE_C = "results/h200/probe/c_llama.csv (this project's H200 run, compiled, 11 interleaved rounds)"
PROBE_NOTE = "the host issues a step in 55-59 ms beside the GPU's 65-74: near host-bound"
SCOUT = "torchao moe_training README, Llama4 Scout end-to-end with torchtitan (4x B200; published_points.md A38-A40)"
# Llama-4-Scout cut to 2 blocks, 8 sequences of 8192 a GPU (FSDP 4, expert parallelism 4)
SCOUT_2 = dataclasses.replace(decoder.LLAMA4_SCOUT, layers=2, batch=8)
# Why the 2-block runs are shown but not counted: lowering the experts saved 0.38 s of the bf16 run's 1.33 s step
# (49,381 tokens a second a GPU, 65,536 a step), about 8x what the experts' grouped GEMMs take balanced at their
# measured rate (2 layers x 3 GEMMs of 65,536 rows at B35's 39.2 ms for 128,000: 0.12 s in bf16, 0.05 s saved). The
# cause is not confirmed. The routing was not forced to balance (torchtitan's _debug_force_load_balance defaulted to
# False and the commands set no flag; its bias-based balancing starts from a new router), but with expert
# parallelism 4 an imbalance alone can make a rank's experts at most 4x as busy: slow grouped GEMMs on skewed groups
# (pytorch/pytorch#163425) or the kernels of the time may add the rest
UNBALANCED = "the experts took about 8x their balanced time (a new, unforced router suspected; the cause unconfirmed)"
SCOUT_GB200 = "torchao moe_training README case study / pytorch.org MXFP8 MoE blog (256 GB200; published_points.md A49-A50)"
# Llama-4-Scout's 48 blocks trained on 256 GB200s, 1 sequence of 8192 a GPU, expert parallelism 16, MXFP8 on the
# experts and every Linear but the output, the router, wk and wv (the runs' filter)
SCOUT_48 = dataclasses.replace(decoder.LLAMA4_SCOUT, batch=1)
SCOUT_SKIP = ("wk", "wv")
ASYNC_TP = "torchtitan benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md, vanilla TP rows (published_points.md A5-A10)"
ASYNC_TP_ON = (
    "torchtitan benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md, async TP rows (published_points.md A7-A8, A11-A12)"
)
# Llama-3-70B at torchtitan's TP benchmark: 16 sequences of 8192 a data-parallel rank (its tensor-parallel group)
LLAMA3_70B = decoder.Shape(dim=8192, layers=80, heads=64, kv_heads=8, ffn=28672, vocab=128256, seq=8192, batch=16)


# torchtitan's H100 TP benchmark (asyncTP_llama3_h100_2025-06; published_points.md A5-A12): each run's tokens a
# second a GPU, by model, async TP or vanilla, and format; and each model's shape, data-parallel ranks and checkpointing
TITAN_TP_TPS = {
    ("8B", False): {"bf16": 4378, "fp8": 5078.1, "fp8-rowwise": 3708.5},
    ("8B", True): {"bf16": 4809.4, "fp8": 5570.1, "fp8-rowwise": 3914.9},
    ("70B", False): {"bf16": 597.3, "fp8": 809.8, "fp8-rowwise": 599.6},
    ("70B", True): {"bf16": 652.4, "fp8": 942.4, "fp8-rowwise": 624.8},
}
TITAN_TP_RUNS = {"8B": (dataclasses.replace(decoder.LLAMA3_8B, batch=12), 8, False), "70B": (LLAMA3_70B, 32, True)}
_FORMAT_NAMES = {"fp8": "fp8 tensorwise", "fp8-rowwise": "fp8 rowwise"}


def _titan_tp(model: str, fmt: str, overlapped: bool, note: str) -> Point:
    """A point of torchtitan's TP benchmark: `fmt` over the same run's bf16, FSDP x 8 tensor-parallel ranks, async TP
    where `overlapped`."""
    shape, gpus, checkpointing = TITAN_TP_RUNS[model]
    tps = TITAN_TP_TPS[model, overlapped]
    return Point(
        f"Llama-3-{model}, FSDP {gpus} x {'async ' if overlapped else ''}TP 8, {_FORMAT_NAMES[fmt]}",
        "h100",
        round(tps[fmt] / tps["bf16"], 3),
        ASYNC_TP_ON if overlapped else ASYNC_TP,
        False,
        _decoder(fmt, "h100", gpus, shape, tp=8, checkpointing=checkpointing, async_tp=overlapped),
        fmt,
        shape.dim,
        tp=True,
        async_tp=overlapped,
        note=note,
    )


L8 = decoder.LLAMA3_8B
POINTS = (
    Point("Linear(8192) fwd+bwd, fp32", "h200", 64.473, FP8_LINEAR, True, _linear_ms("fp32"), "fp32", 8192, unit="ms"),
    Point("Linear(8192) fwd+bwd, bf16", "h200", 5.252, FP8_LINEAR, True, _linear_ms("bf16"), "bf16", 8192, unit="ms"),
    Point("Linear(8192), fp8 tensorwise", "h200", 1.51, FP8_LINEAR, True, _linear_ratio("fp8"), "fp8", 8192),
    Point("Linear(8192), fp8 rowwise", "h200", 1.26, FP8_LINEAR, True, _linear_ratio("fp8-rowwise"), "fp8-rowwise", 8192),
    Point(
        "Llama-3-8B, 8 GPUs, fp8 tensorwise",
        "h100",
        1.25,
        ANCHORS + " (torchao float8 training)",
        True,
        _decoder("fp8", "h100", 8, fp8_all_gather=True),
        "fp8",
        L8.dim,
        note="with fp8 all-gather",
    ),
    Point(
        "Llama-3-8B, 4 GPUs, NVFP4 with a bf16 tail (blocks 27-31)",
        "gb200",
        1.37,
        TITAN_NVFP4,
        True,
        _decoder("nvfp4", "gb200", 4, LLAMA3_8B_GB200, tail=5),
        "nvfp4",
        L8.dim,
        note="sequences of 2048, 32 a GPU",
    ),
    Point(
        "Linear(8192), fp8 rowwise_with_gw_hp",
        "h200",
        0.21,
        FP8_LINEAR,
        False,
        _linear_ratio("fp8-rowwise-gw-hp"),
        "fp8-rowwise-gw-hp",
        8192,
    ),
    Point("Linear(8192), fp8 fprop only", "h200", 0.12, FP8_LINEAR, False, _linear_ratio("fp8-fwd"), "fp8-fwd", 8192),
    Point(
        "Linear(8192), fp8 fprop+dgrad", "h200", 1.22, FP8_LINEAR, False, _linear_ratio("fp8-fwd-dgrad"), "fp8-fwd-dgrad", 8192
    ),
    Point(
        "Linear(8192), fp8 rowwise fprop only",
        "h200",
        0.12,
        FP8_LINEAR,
        False,
        _linear_ratio("fp8-rowwise-fwd"),
        "fp8-rowwise-fwd",
        8192,
    ),
    Point(
        "Linear(8192), fp8 rowwise fprop+dgrad",
        "h200",
        1.20,
        FP8_LINEAR,
        False,
        _linear_ratio("fp8-rowwise-fwd-dgrad"),
        "fp8-rowwise-fwd-dgrad",
        8192,
    ),
    Point(
        "Llama-3-8B, 8 GPUs, fp8 rowwise",
        "h100",
        1.10,
        ANCHORS + " (torchao float8 training)",
        False,
        _decoder("fp8-rowwise", "h100", 8),
        "fp8-rowwise",
        L8.dim,
    ),
    Point(
        "Llama-3-8B, 8 GPUs, fp8 (over compiled bf16)",
        "h100",
        1.28,
        ANCHORS + " (torchtitan llama3_h100_202412)",
        False,
        _decoder("fp8", "h100", 8),
        "fp8",
        L8.dim,
        repeats="Llama-3-8B, 8 GPUs, fp8 tensorwise (h100)",
    ),
    Point(
        "Llama-3-8B, 8 GPUs, fp8 tensorwise (no fp8 all-gather)",
        "h100",
        1.17,
        AO_PR940,
        False,
        _decoder("fp8", "h100", 8),
        "fp8",
        L8.dim,
        note="an older torchao than the fitted point's, gathering in bf16",
    ),
    Point(
        "Llama-3-8B, 8 GPUs, fp8 rowwise (axiswise)",
        "h100",
        1.13,
        AO_PR940,
        False,
        _decoder("fp8-rowwise", "h100", 8),
        "fp8-rowwise",
        L8.dim,
    ),
    Point(
        "Llama-3-8B, 8 GPUs, fp8 rowwise_with_gw_hp",
        "h100",
        1.03,
        AO_PR940,
        False,
        _decoder("fp8-rowwise-gw-hp", "h100", 8),
        "fp8-rowwise-gw-hp",
        L8.dim,
    ),
    Point(
        "Llama-3-8B, 8 GPUs, fp8 tensorwise",
        "b200",
        1.254,
        ANCHORS + " (torchao float8 training)",
        False,
        _decoder("fp8", "b200", 8),
        "fp8",
        L8.dim,
        note="power-limited GPUs: the datasheet's rates are not reached",
    ),
    Point(
        "Llama-3-8B, 8 GPUs, MXFP8",
        "b200",
        1.20,
        ANCHORS + " (torchao float8 training)",
        False,
        _decoder("mxfp8", "b200", 8),
        "mxfp8",
        L8.dim,
        note="power-limited GPUs",
    ),
    Point(
        "Llama-3-8B, 8 GPUs, fp8 rowwise",
        "b200",
        1.04,
        ANCHORS + " (torchao float8 training)",
        False,
        _decoder("fp8-rowwise", "b200", 8),
        "fp8-rowwise",
        L8.dim,
        note="power-limited GPUs",
    ),
    Point(
        "Llama-3-8B, 4 GPUs, MXFP8",
        "gb200",
        1.281,
        TITAN_NVFP4,
        False,
        _decoder("mxfp8", "gb200", 4, LLAMA3_8B_GB200),
        "mxfp8",
        L8.dim,
        note="sequences of 2048, 32 a GPU",
    ),
    Point(
        "Llama-3-8B, 4 GPUs, NVFP4 (every block)",
        "gb200",
        1.449,
        TITAN_NVFP4,
        False,
        _decoder("nvfp4", "gb200", 4, LLAMA3_8B_GB200),
        "nvfp4",
        L8.dim,
        note="sequences of 2048, 32 a GPU",
    ),
    Point(
        "Qwen3-8B, 4 GPUs, MXFP8",
        "gb200",
        1.319,
        TITAN_NVFP4,
        False,
        _decoder("mxfp8", "gb200", 4, decoder.QWEN3_8B),
        "mxfp8",
        4096,
    ),
    Point(
        "Qwen3-8B, 4 GPUs, NVFP4 with a bf16 tail (blocks 30-35)",
        "gb200",
        1.278,
        TITAN_NVFP4,
        False,
        _decoder("nvfp4", "gb200", 4, decoder.QWEN3_8B, tail=6),
        "nvfp4",
        4096,
    ),
    Point(
        "nanochat d26 (1664 wide), 8 GPUs, fp8 tensorwise",
        "h100",
        1.17,
        NANOCHAT,
        False,
        _decoder("fp8", "h100", 8, decoder.NANOCHAT_D26),
        "fp8",
        decoder.NANOCHAT_D26.dim,
        note="sliding-window attention priced as full causal",
    ),
    Point(
        "nanochat d26 (1664 wide), 8 GPUs, fp8 rowwise",
        "h100",
        0.90,
        NANOCHAT,
        False,
        _decoder("fp8-rowwise", "h100", 8, decoder.NANOCHAT_D26),
        "fp8-rowwise",
        decoder.NANOCHAT_D26.dim,
        note="sliding-window attention priced as full causal",
    ),
    Point(
        "Llama (examples/llama, 2048 wide), 1 GPU, torchao tensorwise filter",
        "h200",
        _probe_measured("torchao tensorwise (filter)"),
        PROBE_C,
        False,
        _probe_ratio("torchao_tensorwise_filter.json"),
        "fp8",
        2048,
        note=PROBE_NOTE,
    ),
    Point(
        "Llama (examples/llama, 2048 wide), 1 GPU, torchao rowwise filter",
        "h200",
        _probe_measured("torchao rowwise (filter)"),
        PROBE_C,
        False,
        _probe_ratio("torchao_rowwise_filter.json"),
        "fp8-rowwise",
        2048,
        note=PROBE_NOTE,
    ),
    Point(
        "Llama (examples/llama, 2048 wide), 1 GPU, fp8 FFN only",
        "h200",
        _probe_measured("fp8 FFN only"),
        PROBE_C,
        False,
        _probe_ratio("fp8_ffn_only.json"),
        "fp8",
        2048,
        note=PROBE_NOTE,
    ),
    Point(
        "Llama-4-Scout (2 blocks), 4 GPUs, MXFP8 Linears",
        "b200",
        1.053,
        SCOUT,
        False,
        _decoder("mxfp8", "b200", 4, SCOUT_2, ep=4),
        "mxfp8",
        SCOUT_2.dim,
        moe=True,
        note="the router and output in bf16",
        excluded=UNBALANCED,
    ),
    Point(
        "Llama-4-Scout (2 blocks), 4 GPUs, MXFP8 experts",
        "b200",
        1.404,
        SCOUT,
        False,
        _decoder("bf16", "b200", 4, SCOUT_2, experts="mxfp8", ep=4),
        "mxfp8",
        SCOUT_2.dim,
        moe=True,
        experts=True,
        note="the grouped GEMMs at their measured share",
        excluded=UNBALANCED,
    ),
    Point(
        "Llama-4-Scout (2 blocks), 4 GPUs, MXFP8 Linears and experts",
        "b200",
        1.433,
        SCOUT,
        False,
        _decoder("mxfp8", "b200", 4, SCOUT_2, experts="mxfp8", ep=4),
        "mxfp8",
        SCOUT_2.dim,
        moe=True,
        experts=True,
        excluded=UNBALANCED,
    ),
    Point(
        "Llama-4-Scout, 256 GPUs (FSDP, EP 16), MXFP8 experts and Linears",
        "gb200",
        1.20,
        SCOUT_GB200,
        False,
        _decoder("mxfp8", "gb200", 256, SCOUT_48, experts="mxfp8", ep=16, skip=SCOUT_SKIP),
        "mxfp8",
        SCOUT_48.dim,
        moe=True,
        experts=True,
        note="1 sequence a GPU, as torchao's table says; torchtitan's mxfp8.md says 10",
    ),
    Point(
        "Llama-4-Scout, 256 GPUs (FSDP, EP 16), MXFP8 experts and Linears, full checkpointing",
        "gb200",
        1.302,
        SCOUT_GB200,
        False,
        _decoder("mxfp8", "gb200", 256, SCOUT_48, checkpointing=True, experts="mxfp8", ep=16, skip=SCOUT_SKIP),
        "mxfp8",
        SCOUT_48.dim,
        moe=True,
        experts=True,
        note="a newer torch and torchao than the row above",
    ),
    _titan_tp("8B", "fp8", False, "12 sequences a data-parallel rank; selective checkpointing priced as none"),
    _titan_tp("8B", "fp8-rowwise", False, "rowwise with TP is slow in torchtitan (its issue #1207), not in the predictor"),
    Point(
        "Llama-3-8B, FSDP 2 x TP 2, fp8 rowwise",
        "h100",
        0.965,
        "pytorch/torchtitan#1207 (4x H100; published_points.md A13)",
        False,
        _decoder("fp8-rowwise", "h100", 2, tp=2),
        "fp8-rowwise",
        L8.dim,
        tp=True,
    ),
    _titan_tp("70B", "fp8", False, "full checkpointing"),
    _titan_tp("70B", "fp8-rowwise", False, "full checkpointing"),
    _titan_tp("8B", "fp8", True, "over async TP's bf16; selective checkpointing priced as none"),
    _titan_tp("8B", "fp8-rowwise", True, "over async TP's bf16"),
    _titan_tp("70B", "fp8", True, "over async TP's bf16; full checkpointing"),
    _titan_tp("70B", "fp8-rowwise", True, "over async TP's bf16; full checkpointing"),
)


def async_gains(cal: predictor.Calibration = predictor.CALIBRATION) -> dict[tuple[str, str], tuple[float, float]]:
    """Each (model, format) of torchtitan's TP benchmark: the predicted step-time gain of async TP over vanilla TP and
    the measured one (docs/planning.md says where they part)."""
    out = {}
    for model, (shape, gpus, checkpointing) in TITAN_TP_RUNS.items():
        step = dataclasses.replace(decoder_step(shape), shards=gpus, tensor_parallel=8, checkpointing=checkpointing)
        for fmt in TITAN_TP_TPS[model, False]:
            layers: dict[str, str] = {MODEL_ROOT: "bf16"}
            layers.update({s.name: fmt for s in step.linears if s.name != "output"})
            policy, target = Policy(layers=layers), target_named("h100")
            vanilla, overlapped = (
                predictor.predict(dataclasses.replace(step, async_tp=a), policy, target, cal).ms for a in (False, True)
            )
            out[model, fmt] = (vanilla / overlapped, TITAN_TP_TPS[model, True][fmt] / TITAN_TP_TPS[model, False][fmt])
    return out


@dataclasses.dataclass(frozen=True)
class Absolute:
    """A published or measured bf16 step beside the predictor's absolute time for it: `tokens` one GPU's per step,
    `rate` its tokens a second (a published tokens-per-second per GPU; for this project's run, tokens over the
    measured step)."""

    name: str
    target: str
    step: Callable[[], predictor.Step]
    tokens: float
    rate: float
    source: str

    @property
    def measured_ms(self) -> float:
        return 1e3 * self.tokens / self.rate

    def predicted_ms(self, cal: predictor.Calibration = predictor.CALIBRATION) -> float:
        return predictor.predict(self.step(), predictor.baseline(), target_named(self.target), cal).ms


def _laid(shape: decoder.Shape, gpus: int, **layout: Any) -> Callable[[], predictor.Step]:
    return lambda: dataclasses.replace(decoder_step(shape), shards=gpus, **layout)


def _titan_tp_bf16(model: str, overlapped: bool, source: str) -> Absolute:
    """torchtitan's TP benchmark's bf16 run: one GPU's share of its data-parallel rank's tokens (TPS per GPU counts
    them over the tensor-parallel ranks)."""
    shape, gpus, checkpointing = TITAN_TP_RUNS[model]
    layout = "FSDP {} x {}TP 8{}".format(gpus, "async " if overlapped else "", ", full checkpointing" if checkpointing else "")
    return Absolute(
        f"Llama-3-{model}, {layout}",
        "h100",
        _laid(shape, gpus, tensor_parallel=8, checkpointing=checkpointing, async_tp=overlapped),
        shape.batch * shape.seq / 8,
        TITAN_TP_TPS[model, overlapped]["bf16"],
        source,
    )


_PROBE_BF16_MS = 73.7095  # c_llama.csv's uniform bf16 median (read and checked by the test)
ABSOLUTE = (
    Absolute("Llama-3-8B, 8 GPUs (FSDP)", "h100", _laid(L8, 8), 8192, 6150, "published_points.md A1"),
    Absolute("Llama-3-8B, 8 GPUs (FSDP), an older torchao", "h100", _laid(L8, 8), 8192, 6294, "published_points.md A14"),
    Absolute("Llama-3-8B, 8 GPUs (FSDP), power-limited", "b200", _laid(L8, 8), 8192, 8307.5, "published_points.md A34"),
    Absolute(
        "Llama-3-8B, 4 GPUs, sequences of 2048", "gb200", _laid(LLAMA3_8B_GB200, 4), 65536, 21919, "published_points.md A44"
    ),
    Absolute("Qwen3-8B, 4 GPUs", "gb200", _laid(decoder.QWEN3_8B, 4), 32768, 20913, "published_points.md A47"),
    Absolute("nanochat d26, 8 GPUs", "h100", _laid(decoder.NANOCHAT_D26, 8), 65536, 630_000 / 8, "published_points.md A21"),
    _titan_tp_bf16("8B", False, "published_points.md A9"),
    _titan_tp_bf16("8B", True, "published_points.md A11"),
    _titan_tp_bf16("70B", False, "published_points.md A5"),
    Absolute(
        "Llama-4-Scout, 256 GPUs (FSDP, EP 16)",
        "gb200",
        _laid(SCOUT_48, 256, expert_parallel=16),
        8192,
        6169,
        "published_points.md A49 (1 sequence a GPU)",
    ),
    Absolute(
        "Llama (examples/llama, 2048 wide), 1 GPU",
        "h200",
        probe_llama_step,
        16384,
        16384 / (_PROBE_BF16_MS / 1e3),
        "results/h200/probe/c_llama.csv",
    ),
)


def absolute_markdown(cal: predictor.Calibration = predictor.CALIBRATION) -> str:
    """The bf16 step as published or measured beside the predictor's absolute time for it."""
    lines = [
        "",
        "Absolute bf16 step times (one GPU's step; the published tokens a second a GPU turned into it), which no "
        "point above tests:",
        "",
        "| run | target | measured ms | predicted ms | measured / predicted | source |",
        "|---|---|---|---|---|---|",
    ]
    for a in ABSOLUTE:
        predicted = a.predicted_ms(cal)
        lines.append(
            f"| {a.name} | {a.target} | {a.measured_ms:,.0f} | {predicted:,.0f} | {a.measured_ms / predicted:.2f}x | {a.source} |"
        )
    return "\n".join(lines) + "\n"


# The parameters fitted (a gemm key, a Calibration field, or "casts.<kind>") with their bounds, and those tied to a
# fitted one (assumed equal: no point measures them apart).
FITTED = {
    "fp32": (0.05, 1.0),
    "bf16": (0.05, 1.0),
    "fp8-tensorwise": (0.05, 1.0),
    "fp8-rowwise": (0.05, 1.0),
    "nvfp4": (0.05, 1.0),
    "fusion": (0.05, 1.0),
    "tiles": (0.0, 500.0),
    "contraction": (0.0, 8192.0),
    "casts.tensorwise": (0.05, 1.0),
    "casts.rowwise": (0.05, 1.0),
}
TIED = {"fp16": "bf16", "mxfp8": "fp8-tensorwise"}
# The end-to-end points weigh this many GEMM-level shapes each in the fit (there are 6 against 108 + 6 shapes)
E2E_WEIGHT = 3.0


def calibration(values: dict[str, float], base: predictor.Calibration = predictor.CALIBRATION) -> predictor.Calibration:
    gemm = dict(base.gemm)
    gemm.update({k: v for k, v in values.items() if k in gemm})
    gemm.update({k: gemm[v] for k, v in TIED.items()})
    casts = dict(base.casts)
    casts.update({k.split(".", 1)[1]: v for k, v in values.items() if k.startswith("casts.")})
    fields = {k: v for k, v in values.items() if k in ("fusion", "tiles", "contraction")}
    return dataclasses.replace(base, gemm=gemm, casts=casts, **fields)


def shapes_fitted() -> tuple[list[tuple[int, int, int]], list[int]]:
    """The GEMM-level shapes the fit reads (benchmarks/predict_shapes.py `fitted`): half of torchao's H100 rowwise heat
    map and half of the squares (their indices in SQUARES); the other halves are held out."""
    from benchmarks import predict_shapes as ps

    return [k for k in sorted(ps.heat_map()) if ps.fitted(k)], [ps.SQUARES.index(s) for s in ps.FITTED_SQUARES]


def fit() -> predictor.Calibration:
    """The calibration that fits the fitted points and shapes (log error, least squares; each end-to-end point weighs
    E2E_WEIGHT shapes), from the current one as the start."""
    from scipy.optimize import least_squares

    from benchmarks import predict_shapes as ps

    fitted = [p for p in POINTS if p.fitted]
    heat, squares = shapes_fitted()
    measured = ps.heat_map()
    steps = {k: ps.layer_step(*k) for k in heat} | {(s, s, s): ps.layer_step(s, s, s) for s in (ps.SQUARES[i] for i in squares)}
    start = predictor.CALIBRATION
    names = list(FITTED)

    def unpack(x) -> predictor.Calibration:
        return calibration(dict(zip(names, map(float, x))), start)

    def layer(step: predictor.Step, fmt: str, cal: predictor.Calibration) -> float:
        return predictor.speedup(step, Policy(layers={MODEL_ROOT: "bf16", "1": fmt}), target_named("h100"), cal)

    def residuals(x):
        cal = unpack(x)
        out = [E2E_WEIGHT * math.log(p.compute(cal) / p.measured) for p in fitted]
        out += [math.log(layer(steps[k], "fp8-rowwise", cal) / measured[k]) for k in heat]
        for i in squares:
            s = ps.SQUARES[i]
            out.append(math.log(layer(steps[s, s, s], "fp8", cal) / ps.SQUARE_TENSORWISE[i]))
            out.append(math.log(layer(steps[s, s, s], "fp8-rowwise", cal) / ps.SQUARE_ROWWISE[i]))
        return out

    def now(name: str) -> float:
        if name.startswith("casts."):
            return start.casts[name.split(".", 1)[1]]
        return start.gemm[name] if name in start.gemm else getattr(start, name)

    lower, upper = zip(*FITTED.values())
    found = least_squares(residuals, [now(k) for k in names], bounds=(lower, upper), xtol=1e-10, ftol=1e-10)
    return unpack([round(v, 3) if v < 10 else round(v, 1) for v in found.x])


@dataclasses.dataclass(frozen=True)
class Row:
    point: Point
    predicted: float

    @property
    def error(self) -> float:
        return self.predicted / self.point.measured - 1


def table(cal: predictor.Calibration = predictor.CALIBRATION) -> list[Row]:
    return [Row(p, p.compute(cal)) for p in POINTS]


def band(rows: list[Row]) -> tuple[float, int]:
    """The largest |error| over the points held out (neither fitted on nor repeating a fitted point's computation),
    rounded up to a whole percent, and how many there are."""
    held = [abs(r.error) for r in rows if r.point.held_out]
    return math.ceil(100 * max(held) - 1e-9) / 100, len(held)


# torchao's _auto_filter_for_recipe (torchao/float8/float8_linear_utils.py; the anchors file): the Linears (K
# in_features, N out_features) each recipe leaves in high precision because its roofline says fp8 does not pay.
def torchao_skips(fmt: str, k: int, n: int) -> bool:
    if fmt == "fp8":
        return k <= 4096 and n <= 1024
    return n <= 2048 or k <= 1024 or (n <= 4096 and k <= 2048)


FILTER_SIZES = (1024, 2048, 4096, 8192, 16384)
FILTER_TOKENS = 8192  # M: the rows per step of the Llama-3-8B runs above (one 8192-token sequence per GPU)


def filter_grid(cal: predictor.Calibration = predictor.CALIBRATION) -> list[tuple[str, int, int, bool, float]]:
    """(format, K, N, torchao skips it, the predictor's speedup of that Linear alone over bf16 on an H100), for
    fp8 tensorwise and rowwise over FILTER_SIZES, M = FILTER_TOKENS, under a bf16 model root."""
    out = []
    target = target_named("h100")
    for fmt in ("fp8", "fp8-rowwise"):
        for k in FILTER_SIZES:
            for n in FILTER_SIZES:
                step = predictor.Step((predictor.LinearShape("l", k, n, float(FILTER_TOKENS)),))
                value = predictor.speedup(step, Policy(layers={MODEL_ROOT: "bf16", "l": fmt}), target, cal)
                out.append((fmt, k, n, torchao_skips(fmt, k, n), value))
    return out


def filter_markdown(grid: list[tuple[str, int, int, bool, float]]) -> str:
    lines = []
    for fmt in ("fp8", "fp8-rowwise"):
        cells = [g for g in grid if g[0] == fmt]
        agree = [g for g in cells if (g[4] <= 1.0) == g[3]]
        lines.append("")
        lines.append(
            f"{fmt} on h100, M = {FILTER_TOKENS} (rows: K in_features; columns: N out_features; the "
            f"predicted speedup of the Linear alone over bf16, * where torchao's filter skips it): the "
            f"predictor agrees with the filter on {len(agree)} of {len(cells)} shapes"
        )
        lines.append("")
        lines.append("| K \\ N | " + " | ".join(map(str, FILTER_SIZES)) + " |")
        lines.append("|---" * (len(FILTER_SIZES) + 1) + "|")
        for k in FILTER_SIZES:
            row = [g for g in cells if g[1] == k]
            lines.append(f"| {k} | " + " | ".join(f"{g[4]:.2f}{'*' if g[3] else ''}" for g in row) + " |")
    return "\n".join(lines)


def regime_bands(rows: list[Row]) -> dict[tuple[int, str, str], tuple[float, int]]:
    """Each regime's band (predictor.BANDS): the largest |error| over the held-out points of a width class that run a
    kernel, rounded up to a whole percent, and how many there are."""
    errors: dict[tuple[int, str, str], list[float]] = {}
    for r in rows:
        if not r.point.held_out:
            continue
        low = next((lo for lo, hi in predictor.WIDTH_CLASSES if lo <= r.point.width <= hi), None)
        if low is None:
            raise ValueError(f"{r.point.name}: {r.point.width} wide is in no width class {predictor.WIDTH_CLASSES}")
        parallel = ("tp-async" if r.point.async_tp else "tp") if r.point.tp else "dp"
        layout = ("moe-experts" if r.point.experts else "moe") if r.point.moe else parallel
        for kernel in predictor.format_kernels(Format(r.point.fmt)):
            errors.setdefault((low, kernel, layout), []).append(abs(r.error))
    return {key: (math.ceil(100 * max(e) - 1e-9) / 100, len(e)) for key, e in sorted(errors.items())}


def _kind(p: Point) -> str:
    if p.fitted:
        return "fitted"
    if p.repeats:
        return f"repeats {p.repeats}"
    return f"shown, not counted: {p.excluded}" if p.excluded else "held out"


def markdown(rows: list[Row]) -> str:
    lines = [
        "| point | target | measured | predicted | error | fitted / held out | source |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        p = r.point
        value = (lambda v: f"{v:.3f} ms") if p.unit == "ms" else (lambda v: f"{v:.2f}x")
        note = f" ({p.note})" if p.note else ""
        lines.append(
            f"| {p.name}{note} | {p.target} | {value(p.measured)} | {value(r.predicted)} | {100 * r.error:+.1f}% | "
            f"{_kind(p)} | {p.source} |"
        )
    err, n = band(rows)
    held = [abs(r.error) for r in rows if r.point.held_out]
    lines.append("")
    lines.append(
        f"Held out: {n} points, median |error| {100 * statistics.median(held):.1f}%, the largest {100 * err:.0f}%. Each "
        "prediction states its regime's band (the model's width class, the kernels its policy runs, and the layout: "
        "data-parallel, tensor-parallel (vanilla or asynchronous), or an MoE):"
    )
    lines.append("")
    lines.append("| width | kernel | layout | band | held-out points |")
    lines.append("|---|---|---|---|---|")
    for (low, kernel, layout), (e, count) in regime_bands(rows).items():
        high = dict(predictor.WIDTH_CLASSES)[low]
        lines.append(f"| {low}-{high} | {kernel} | {predictor.LAYOUTS[layout]} | +-{100 * e:.0f}% | {count} |")
    return "\n".join(lines) + "\n" + filter_markdown(filter_grid()) + "\n" + absolute_markdown()


def doc_table(text: str) -> str:
    found = re.search(re.escape(BEGIN) + r"\n(.*?)\n" + re.escape(END), text, re.S)
    if found is None:
        raise SystemExit(f"{DOC}: no validation table between {BEGIN!r} and {END!r}")
    return found.group(1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fit", action="store_true", help="fit the calibration on the fitted points and print it")
    parser.add_argument("--write", action="store_true", help="rewrite docs/planning.md's table")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.fit:
        print(fit())
        return
    text = markdown(table())
    if args.write:
        doc = DOC.read_text(encoding="utf-8")
        DOC.write_text(doc.replace(doc_table(doc), text), encoding="utf-8")
    print(text)


if __name__ == "__main__":
    main()
