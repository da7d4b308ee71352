"""fp8 recipes against bf16 (and fp32) for one nn.Linear, forward + backward, at a few square shapes.

    python benchmarks/fp8_linear.py [--device cuda] [--full] [--shapes 256,1024] [--compile] [--rounds 7]

Each shape n runs an (n x n) input through Linear(n, n) and back (input and weight gradients), with the
format set by an autoprec policy, timed interleaved by autoprec.tune._timing.interleaved_times. Without fp8
kernels (any CPU, GPUs below compute capability 8.9) torchao emulates fp8 and is slow, so on the CPU the
default shapes are small; --full runs 256 to 8192 anywhere. torchao's fp8 is meant to run under
torch.compile, which fuses its casts: --compile compiles every candidate (inductor). Every fp8 format the
registry has (tensorwise, rowwise, rowwise with a high-precision weight gradient, mxfp8) runs where this
device can run it (mxfp8 nowhere yet); the others are listed with the reason. Printed, not asserted.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch import nn

# This checkout's autoprec, whatever the working directory (a script's sys.path starts at benchmarks/).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import add_device_flag, fmt_timing, parse_device, print_header  # noqa: E402

from autoprec import Policy, apply_policy  # noqa: E402
from autoprec.formats import fp8_formats  # noqa: E402
from autoprec.tune._config import TimingConfig
from autoprec.tune._timing import interleaved_times  # noqa: E402
from autoprec.tune._trainer import compile_scope  # noqa: E402

FULL_SHAPES = (256, 1024, 2048, 4096, 8192)
CPU_SHAPES = (256, 1024, 2048)  # emulated fp8 at 4096+ takes minutes per shape on a small CPU


def parse_shapes(text: str) -> tuple[int, ...]:
    try:
        shapes = tuple(int(s) for s in text.split(",") if s.strip())
    except ValueError:
        raise SystemExit(f"--shapes must be comma-separated integers such as 256,1024, but got {text!r}") from None
    bad = [n for n in shapes if n <= 0 or n % 16]
    if not shapes or bad:
        raise SystemExit(f"--shapes must be positive multiples of 16 (fp8's requirement), but got {text!r}")
    return shapes


def candidate(n: int, fmt: str, device: torch.device, compile_it: bool):
    """One training-shaped forward + backward of Linear(n, n) in `fmt`."""
    torch.manual_seed(0)
    model = apply_policy(nn.Sequential(nn.Linear(n, n)).to(device), Policy(layers={"0": fmt}))
    run = torch.compile(model) if compile_it else model
    x = torch.randn(n, n, device=device, requires_grad=True)
    grad_out = torch.randn(n, n, device=device)

    def step() -> None:
        model.zero_grad(set_to_none=True)
        x.grad = None
        run(x).backward(grad_out)

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_device_flag(parser)
    parser.add_argument("--full", action="store_true", help=f"shapes {FULL_SHAPES} even on the CPU")
    parser.add_argument("--shapes", type=parse_shapes, help="comma-separated sizes n (each a multiple of 16)")
    parser.add_argument("--compile", action="store_true", help="torch.compile every candidate (inductor)")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    device = parse_device(args.device)
    shapes = args.shapes or (FULL_SHAPES if args.full or device.type == "cuda" else CPU_SHAPES)
    print_header("fp8_linear: one Linear(n, n) on an (n x n) input, forward + backward, per format", device)
    print(f"shapes: {', '.join(map(str, shapes))}; torch.compile: {'on' if args.compile else 'off'}")
    fp8 = [f.value for f in fp8_formats() if f.spec.device_problem(device) is None]
    for f in fp8_formats():
        if f.value not in fp8:
            print(f"{f.value}: not run here: {f.spec.device_problem(device)}")
    formats = ("fp32", "bf16", *fp8)
    print(f"{'n':>6}  " + "  ".join(f"{f:>30s}" for f in formats) + "   speedup over bf16: " + ", ".join(fp8))
    config = TimingConfig(warmup=2, rounds=args.rounds, min_block_s=0.05, max_steps_per_block=20)
    for n in shapes:
        with compile_scope(args.compile, len(formats)):  # every candidate compiled, none left eager
            work = {fmt: candidate(n, fmt, device, args.compile) for fmt in formats}
            times = interleaved_times(work, device, config)
        speedups = ", ".join(f"x{times['bf16'].median_ms / times[f].median_ms:.2f}" for f in fp8)
        cells = "  ".join(f"{fmt_timing(times[f]):>30s}" for f in formats)
        print(f"{n:>6}  {cells}   {speedups}", flush=True)
    print("speedup > 1: that fp8 recipe is faster than bf16; inside the spreads, the difference is noise")


if __name__ == "__main__":
    main()
