"""The step-time predictor (autoprec/tune/_measure/_predict.py) against the H200 probe's measurements: the tables of
results/h200/probe/predict_vs_measured.md, computed, never typed.

    python benchmarks/predict_h200_probe.py

Whole steps: examples/llama/model.py at its full size (AUTOPREC_LLAMA_SIZE=full: 16,384 tokens a step), traced on the
meta device as `autoprec predict` traces it, under the policies in results/h200/probe/predict/ (the candidates of
results/h200/probe/c_llama.csv, the same layers as benchmarks/gpu_probe.py's stage c chose), against c_llama.csv and
results/h200/probe/search2/finalists.csv; GPT-2-small (examples/gpt2, 4,096 tokens a step) against the GPU busy
time of results/h200/probe/a_gpt2.csv's `held` rows.

Per layer: the Llama model's Linear shapes at M = 16,384 against results/h200/probe/search1-stopped/profile.csv,
priced as the profile times a layer (autoprec/tune/_measure/_profiler.py, `_time_layer`): the layer alone, forward and
backward, on leaf input tensors (no producer kernel computes a tensorwise amax for it); a bf16 layer under a bf16
root, its inputs in bf16; fp32 and the fp8 formats with no autocast around them, on the fp32 inputs the profile's fp32
reference pass recorded.
A second ratio prices the same layer as the whole step does: under the bf16 root, its input and output gradient
written by other kernels of the step.
"""

from __future__ import annotations

import csv
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from autoprec.policy import ROOT as MODEL_ROOT  # noqa: E402
from autoprec.policy import Policy, load_policy  # noqa: E402
from autoprec.tune._core._targets import target_named  # noqa: E402
from autoprec.tune._measure import _predict as predictor  # noqa: E402
from autoprec.tune._measure._step_shapes import traced  # noqa: E402
from autoprec.tune._measure._task import load_task  # noqa: E402

PROBE = ROOT / "results" / "h200" / "probe"
SEARCH = ROOT / "results" / "h200" / "probe" / "search2"
POLICIES = PROBE / "predict"
TARGET = target_named("h200")

# (policy file, c_llama.csv's candidate, finalists.csv's candidate or None)
CANDIDATES = (
    ("uniform_bf16.json", "uniform bf16", "uniform bf16"),
    ("torchao_tensorwise_filter.json", "torchao tensorwise (filter)", "fp8 everywhere (torchao filter)"),
    ("torchao_rowwise_filter.json", "torchao rowwise (filter)", None),
    ("fp8_ffn_only.json", "fp8 FFN only", None),
)
# the profile's layer timed for each shape (the others of the shape share its time: profile.csv's timed_as)
SHAPES = (
    ("q_proj, o_proj", "layers.0.self_attn.q_proj", 2048, 2048),
    ("k_proj, v_proj", "layers.0.self_attn.k_proj", 2048, 512),
    ("gate_proj, up_proj", "layers.0.mlp.gate_proj", 2048, 8192),
)
FORMATS = ("fp32", "bf16", "fp8", "fp8-rowwise", "fp8-fwd-dgrad")
TOKENS = 16384.0


def example_step(path: str, variable: str, size: str) -> predictor.Step:
    """The example's step on the meta device at `size`, as `autoprec predict` traces it."""
    os.environ[variable] = size
    return traced(load_task(ROOT / path)).step


def rows(path: Path) -> list[dict[str, str]]:
    with path.open(newline="", encoding="utf-8") as fh:
        return list(csv.DictReader(fh))


def error(predicted: float, measured: float) -> str:
    return f"{100 * (predicted / measured - 1):+.1f}%"


def whole_steps() -> list[str]:
    step = example_step("examples/llama/model.py", "AUTOPREC_LLAMA_SIZE", "full")
    c = {r["candidate"]: float(r["median_ms"]) for r in rows(PROBE / "c_llama.csv")}
    f = {r["candidate"]: float(r["step_ms"]) for r in rows(SEARCH / "finalists.csv")}
    predicted = {p: predictor.predict(step, load_policy(POLICIES / p), TARGET) for p, _, _ in CANDIDATES}
    base = predicted["uniform_bf16.json"].ms
    out = [
        f"Llama (examples/llama, full), {step.tokens:,.0f} tokens a step, {len(step.linears)} Linears, target h200:",
        "",
        "| candidate | run | measured ms | predicted ms | ms error | measured x bf16 | predicted x bf16 | x error |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for policy, name, final in CANDIDATES:
        ms = predicted[policy].ms
        for run, measured, bf16 in (
            ("c_llama.csv", c.get(name), c["uniform bf16"]),
            ("finalists.csv", f.get(final), f["uniform bf16"]),
        ):
            if measured is None:
                continue
            x, px = bf16 / measured, base / ms
            out.append(
                f"| {name} | {run} | {measured:.2f} | {ms:.2f} | {error(ms, measured)} | {x:.3f} | {px:.3f} | {error(px, x)} |"
            )
    fp32 = predictor.predict(step, Policy(layers={MODEL_ROOT: "fp32"}), TARGET).ms
    out.append(f"| fp32 (every layer) | finalists.csv | {f['fp32']:.1f} | {fp32:.1f} | {error(fp32, f['fp32'])} | - | - | - |")
    out += ["", "Predicted parts (ms):", "", "| candidate | " + " | ".join(predicted["uniform_bf16.json"].parts) + " |"]
    out.append("|---" * (len(predicted["uniform_bf16.json"].parts) + 1) + "|")
    for policy, name, _ in CANDIDATES:
        out.append(f"| {name} | " + " | ".join(f"{v:.2f}" for v in predicted[policy].parts.values()) + " |")
    return out


def layer_ms(k: int, n: int, fmt: str, *, in_step: bool) -> float:
    """One Linear(k, n) at TOKENS rows, forward and backward, in `fmt`: as the profile times it, or (`in_step`) as
    the whole step prices it."""
    shape = predictor.LinearShape("l", k, n, TOKENS, produced=in_step)
    if in_step or fmt == "bf16":
        layers = {MODEL_ROOT: "bf16", "l": fmt}
    else:
        layers = {"l": fmt}
    return predictor.predict(predictor.Step((shape,)), Policy(layers=layers), TARGET).ms


def per_layer() -> list[str]:
    measured = {
        (r["layer"], r["format"]): float(r["time_ms"])
        for r in rows(PROBE / "search1-stopped" / "profile.csv")
        if r["status"] == "ok" and r["time_ms"] and r["layer"] == r["timed_as"]
    }
    out = [
        f"Per layer, M = {TOKENS:,.0f}, forward + backward, target h200 (profile: GPU busy time, compiled):",
        "",
        "| layers (K -> N) | format | measured ms | predicted ms | ms error | measured bf16/fmt | predicted bf16/fmt | "
        "ratio error | predicted bf16/fmt in the step |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for names, layer, k, n in SHAPES:
        bf16, pbf16 = measured[(layer, "bf16")], layer_ms(k, n, "bf16", in_step=False)
        sbf16 = layer_ms(k, n, "bf16", in_step=True)
        for fmt in FORMATS:
            got, ms = measured[(layer, fmt)], layer_ms(k, n, fmt, in_step=False)
            ratio = "- | - | - | -"  # bf16 over itself
            if fmt != "bf16":
                predicted, in_step = pbf16 / ms, sbf16 / layer_ms(k, n, fmt, in_step=True)
                ratio = f"{bf16 / got:.3f} | {predicted:.3f} | {error(predicted, bf16 / got)} | {in_step:.3f}"
            out.append(f"| {names} ({k} -> {n}) | {fmt} | {got:.3f} | {ms:.3f} | {error(ms, got)} | {ratio} |")
    out += [
        "",
        "bf16 GEMM rate, forward + backward (6 M K N FLOPs over the layer's time; the h200 target's bf16 peak "
        f"{TARGET.tflops['bf16']:g} TFLOP/s):",
        "",
    ]
    for names, layer, k, n in SHAPES:
        flops = 6 * TOKENS * k * n
        got, ms = measured[(layer, "bf16")], layer_ms(k, n, "bf16", in_step=False)
        out.append(f"- {names}: measured {flops / got / 1e9:.0f} TFLOP/s, predicted {flops / ms / 1e9:.0f} TFLOP/s")
    # one block's six measured Linears (two of each shape; down_proj has no time in the profile)
    got = sum(2 * measured[(layer, "bf16")] for _, layer, _, _ in SHAPES)
    ms = sum(2 * layer_ms(k, n, "bf16", in_step=False) for _, _, k, n in SHAPES)
    out.append(
        f"- one block's q, k, v, o, gate and up in bf16 (down_proj has no time in the profile): measured {got:.3f} ms, "
        f"predicted {ms:.3f} ms ({error(ms, got)}); six blocks: measured {6 * got:.2f} ms, predicted {6 * ms:.2f} ms"
    )
    _, gate, k, n = SHAPES[2]
    saved = 12 * (measured[(gate, "bf16")] - measured[(gate, "fp8")])
    out.append(
        f"- gate_proj and up_proj in fp8 instead of bf16, 12 layers at layers.0.mlp.gate_proj's time: measured {saved:.2f} ms "
        f"saved, predicted {12 * (layer_ms(k, n, 'bf16', in_step=False) - layer_ms(k, n, 'fp8', in_step=False)):.2f} ms; "
        f"priced as in the step: {12 * (layer_ms(k, n, 'bf16', in_step=True) - layer_ms(k, n, 'fp8', in_step=True)):.2f} ms"
    )
    return out


def gpt2() -> list[str]:
    step = example_step("examples/gpt2/model.py", "AUTOPREC_GPT2_SIZE", "small")
    held = {r["candidate"]: float(r["median_ms"]) for r in rows(PROBE / "a_gpt2.csv") if r["method"] == "held"}
    out = [
        f"GPT-2-small (examples/gpt2, small), {step.tokens:,.0f} tokens a step, target h200, against the GPU busy time "
        "(a_gpt2.csv, method held):",
        "",
        "| candidate | measured busy ms | predicted ms | ms error |",
        "|---|---|---|---|",
    ]
    for name, fmt in (("fp32", "fp32"), ("uniform bf16", "bf16")):
        ms = predictor.predict(step, Policy(layers={MODEL_ROOT: fmt}), TARGET).ms
        out.append(f"| {name} | {held[name]:.2f} | {ms:.2f} | {error(ms, held[name])} |")
    return out


def main() -> None:
    torch.set_num_threads(1)
    print("\n".join(whole_steps() + [""] + per_layer() + [""] + gpt2()))
    print(f"\nThe band every prediction states: {predictor.band()}.")


if __name__ == "__main__":
    main()
