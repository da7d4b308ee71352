"""fp8 recipes against bf16 for the Linears of real models, forward + backward, in a bf16 root.

    python benchmarks/fp8_linear.py [--device cuda] [--compile] [--models gpt2,llama] [--rounds 7] [--csv FILE]
    python benchmarks/fp8_linear.py --smoke                      # the same path on a CPU, tiny shapes, seconds

Each row is one nn.Linear(K, N) (no bias) of a model, run forward and backward on an (M x K) input as that model's
step runs it: GPT-2-small's five Linear shapes at M 4096 (its 16 x 256 tokens) and the Llama example's five
(examples/llama, full size) at M 16384 (its 8 x 2048 tokens). Every candidate runs in a bf16 root, as a model whose
other layers are bf16 runs them: the input arrives in bf16, the output stays in it, so a recipe whose high-precision
GEMM is not fp8 runs it in bf16, never in strict fp32. Formats: bf16 (the baseline), fp8 (tensorwise), fp8-rowwise
and fp8-fwd-dgrad (fp8 forward and input gradient, the weight gradient in bf16), those this device runs; the others
are listed with the reason. Timed interleaved by autoprec.tune._measure._timing.interleaved_times, each candidate a held step
(Step.kernels): on a GPU each sample is the GPU's busy time by CUDA events over a block of steps queued behind a
spin kernel, so a lone layer's launch overhead is not in it (inside a model's step the host issues a layer while the
GPU runs the ones before); the host's issuing time is printed beside, for reference. torchao's fp8 is meant to run under
torch.compile, which fuses its casts: --compile compiles every candidate (on CUDA the default). Without fp8 kernels
(a CPU, a GPU below compute capability 8.9) torchao emulates fp8: the numbers then say nothing of fp8's speed.
Printed, and with --csv written one row per shape and format; not asserted.
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

import torch
from torch import nn

# This checkout's autoprec, whatever the working directory (a script's sys.path starts at benchmarks/).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import add_device_flag, fmt_timing, parse_device, print_header  # noqa: E402

from autoprec import Policy, apply_policy  # noqa: E402
from autoprec.formats import Format  # noqa: E402
from autoprec.tune._core._config import TimingConfig, compile_setting  # noqa: E402
from autoprec.tune._measure._timing import Step, interleaved_times  # noqa: E402
from autoprec.tune._measure._trainer import compile_scope  # noqa: E402

BASELINE = "bf16"
FP8 = ("fp8", "fp8-rowwise", "fp8-fwd-dgrad")
# (name, M, [(layer, K, N)]): each model's Linear shapes at its step's tokens
MODELS = {
    "gpt2": (
        4096,
        [("c_attn", 768, 2304), ("attn.c_proj", 768, 768), ("c_fc", 768, 3072), ("mlp.c_proj", 3072, 768), ("lm_head", 768, 256)],
    ),
    "llama": (
        16384,
        [
            ("q_proj/o_proj", 2048, 2048),
            ("k_proj/v_proj", 2048, 512),
            ("gate_proj/up_proj", 2048, 8192),
            ("down_proj", 8192, 2048),
            ("lm_head", 2048, 256),
        ],
    ),  # fmt: skip
}
SMOKE = {"tiny": (64, [("square", 64, 64), ("wide", 64, 128)])}  # --smoke: multiples of 16 (fp8's requirement)


def candidate(m: int, k: int, n: int, fmt: str, device: torch.device, compile_it: bool) -> Step:
    """One training-shaped forward + backward of Linear(k, n) in `fmt` inside a bf16 root, on a bf16 (m x k) input."""
    torch.manual_seed(0)
    layers = {"": BASELINE} if fmt == BASELINE else {"": BASELINE, "0": fmt}
    model = apply_policy(nn.Sequential(nn.Linear(k, n, bias=False)).to(device), Policy(layers=layers))
    run = torch.compile(model) if compile_it else model
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16, requires_grad=True)
    grad_out = torch.randn(m, n, device=device, dtype=torch.bfloat16)

    def step() -> None:
        model.zero_grad(set_to_none=True)
        x.grad = None
        out = run(x)
        out.backward(grad_out.to(out.dtype))

    # The layer's kernels alone (the stream held while the host queues each block): a lone layer's launch overhead
    # is no cost of its format, and inside a model's step the host issues it while the GPU runs the layers before.
    return Step(step, model, kernels=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_device_flag(parser)
    parser.add_argument("--models", default="gpt2,llama", help=f"comma-separated, of {', '.join(MODELS)}")
    parser.add_argument(
        "--compile", action=argparse.BooleanOptionalAction, default=None, help="torch.compile every candidate (default: on CUDA)"
    )
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--smoke", action="store_true", help="two tiny shapes, 2 rounds: the path on a CPU in seconds")
    parser.add_argument("--csv", type=Path, help="also write the rows to this CSV file")
    args = parser.parse_args()
    device = parse_device(args.device)
    compile_it = compile_setting(args.compile, device)
    if args.smoke:
        models, rounds = SMOKE, min(args.rounds, 2)
    else:
        names = [s.strip() for s in args.models.split(",") if s.strip()]
        unknown = [s for s in names if s not in MODELS]
        if unknown or not names:
            raise SystemExit(f"--models must name some of {', '.join(MODELS)}, but got {args.models!r}")
        models, rounds = {name: MODELS[name] for name in names}, args.rounds
    print_header("fp8_linear: each model's Linear(K, N) on an (M x K) bf16 input, forward + backward, in a bf16 root", device)
    fp8 = [f for f in FP8 if Format(f).spec.device_problem(device) is None]
    for f in FP8:
        if f not in fp8:
            print(f"{f}: not run here: {Format(f).spec.device_problem(device)}")
    formats = (BASELINE, *fp8)
    print(f"torch.compile: {'on' if compile_it else 'off'}; {rounds} rounds; ms per step on the device (host ms issuing it)")
    print(f"{'model':>6} {'layer':>18} {'M':>6} {'K':>5} {'N':>5}  " + "  ".join(f"{f:>34s}" for f in formats)
          + "   speedup over bf16: " + ", ".join(fp8))  # fmt: skip
    rows = []
    config = TimingConfig(
        warmup=2, rounds=rounds, min_block_s=0.05, max_steps_per_block=200, warmup_s=0.5 if not args.smoke else 0.0
    )
    for model_name, (m, shapes) in models.items():
        for layer, k, n in shapes:
            with compile_scope(compile_it, len(formats)):  # every candidate compiled, none left eager
                work = {fmt: candidate(m, k, n, fmt, device, compile_it) for fmt in formats}
                times = interleaved_times(work, device, config)
            base = times[BASELINE].median_ms
            cells = "  ".join(
                f"{fmt_timing(times[f]):>26s} {'' if times[f].host_ms is None else f'({times[f].host_ms:.3f})':>7s}"
                for f in formats
            )
            speedups = ", ".join(f"x{base / times[f].median_ms:.2f}" for f in fp8)
            print(f"{model_name:>6} {layer:>18} {m:>6} {k:>5} {n:>5}  {cells}   {speedups}", flush=True)
            for f in formats:
                t = times[f]
                rows.append({
                    "model": model_name, "layer": layer, "m": m, "k": k, "n": n, "format": f,
                    "device_ms": t.median_ms, "spread": t.spread, "host_ms": t.host_ms,
                    "speedup_over_bf16": base / t.median_ms, "rounds": len(t.samples_ms), "device": str(device),
                })  # fmt: skip
            if args.csv:  # after every shape: a run stopped at a deadline keeps what it measured
                with args.csv.open("w", newline="") as fh:
                    writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
                    writer.writeheader()
                    writer.writerows(rows)
    print("speedup > 1: that fp8 recipe is faster than bf16; inside the spreads, the difference is noise")


if __name__ == "__main__":
    main()
