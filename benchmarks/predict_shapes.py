"""The step-time predictor against published GEMM-level measurements it was never fitted on, shape by shape.

    python benchmarks/predict_shapes.py              # the error table per published set, and the worst shapes

The sets (benchmarks/anchors/published_points.md, with their sources):
- B-1: torchao's H100 fp8 rowwise heat map, LayerNorm -> Linear -> Sigmoid forward and backward, compiled, the casts
  included, 216 shapes (M, K, N from 1024 to 32768), over the same layer in bf16;
- B3-B10: the same microbenchmark at square shapes 256 to 32768, fp8 tensorwise and rowwise (PR #940).

Each shape is priced as the predictor prices a model: the module traced on the meta device (trace_step), the Linear in
the format, LayerNorm and Sigmoid in bf16, no optimizer. The calibration is fitted on half of each set (`fitted`:
benchmarks/predict_points.py --fit) and this prints the errors of each half apart; it fits nothing.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from autoprec.policy import ROOT as MODEL_ROOT  # noqa: E402
from autoprec.policy import Policy  # noqa: E402
from autoprec.tune._core._targets import target_named  # noqa: E402
from autoprec.tune._measure import _predict as predictor  # noqa: E402
from autoprec.tune._measure._step_shapes import trace_step  # noqa: E402

SIZES = (1024, 2048, 4096, 8192, 16384, 32768)
# B-1, rows M then K, columns N = SIZES: torchao docs/static/fp8-rowwise-perf.png (transcribed; published_points.md)
ROWWISE_H100 = """
0.42 0.42 0.50 0.51 0.56 0.56|0.40 0.38 0.42 0.50 0.50 0.56|0.48 0.43 0.46 0.53 0.57 0.60|0.45 0.48 0.54 0.62 0.60 0.62
0.46 0.48 0.54 0.60 0.60 0.61|0.45 0.50 0.55 0.60 0.62 0.65|0.43 0.43 0.48 0.55 0.62 0.65|0.38 0.45 0.58 0.65 0.72 0.75
0.43 0.50 0.68 0.78 0.81 0.82|0.46 0.58 0.73 0.82 0.87 0.89|0.48 0.62 0.75 0.83 0.84 0.85|0.50 0.64 0.75 0.84 0.83 0.99
0.45 0.47 0.57 0.66 0.72 0.76|0.43 0.53 0.70 0.83 0.90 0.91|0.44 0.64 0.84 1.01 1.01 1.04|0.53 0.72 0.91 1.01 1.07 1.13
0.53 0.74 0.92 1.05 1.10 1.18|0.54 0.75 0.93 1.02 1.17 1.18|0.48 0.52 0.65 0.77 0.83 0.84|0.45 0.64 0.82 1.01 1.03 1.06
0.52 0.76 1.00 1.13 1.17 1.19|0.59 0.85 1.05 1.20 1.31 1.41|0.58 0.82 1.03 1.22 1.37 1.40|0.59 0.82 1.04 1.30 1.36 1.46
0.48 0.58 0.73 0.86 0.85 0.89|0.51 0.70 0.90 1.05 1.07 1.15|0.57 0.79 1.02 1.20 1.26 1.40|0.61 0.87 1.08 1.33 1.39 1.49
0.59 0.83 1.07 1.34 1.42 1.55|0.60 0.85 1.16 1.35 1.48 1.72|0.51 0.62 0.77 0.87 0.88 0.94|0.54 0.73 0.91 1.08 1.14 1.27
0.59 0.81 1.04 1.28 1.35 1.49|0.63 0.87 1.11 1.41 1.50 1.62|0.60 0.83 1.16 1.39 1.49 1.73|0.63 0.93 1.16 1.48 1.70 1.52
"""
SQUARES = (256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
# B3-B10 (PR #940's message): the same microbenchmark at M = K = N, over bf16
SQUARE_TENSORWISE = (0.466, 0.490, 0.734, 0.816, 1.236, 1.432, 1.803, 1.696)
SQUARE_ROWWISE = (0.398, 0.433, 0.706, 0.740, 1.222, 1.161, 1.440, 1.339)


FITTED_SQUARES = (1024, 4096, 16384)  # the squares the calibration is fitted on; 2048, 8192 and 32768 are held out


def fitted(shape: tuple[int, int, int]) -> bool:
    """Whether the calibration is fitted on this shape: a square of FITTED_SQUARES, or a heat-map cell whose size
    indices sum to an even number (a checkerboard: every row, column and size has fitted and held-out cells)."""
    m, k, n = shape
    if m == k == n and m in SQUARES:
        return m in FITTED_SQUARES
    return sum(SIZES.index(v) for v in shape) % 2 == 0


def heat_map() -> dict[tuple[int, int, int], float]:
    """B-1 as {(M, K, N): speedup over bf16}."""
    cells = [list(map(float, part.split())) for part in ROWWISE_H100.strip().replace("\n", "|").split("|")]
    assert len(cells) == len(SIZES) ** 2 and all(len(c) == len(SIZES) for c in cells), "36 (M, K) rows of 6"
    out = {}
    for i, row in enumerate(cells):
        m, k = SIZES[i // len(SIZES)], SIZES[i % len(SIZES)]
        for n, value in zip(SIZES, row):
            out[(m, k, n)] = value
    return out


def layer_step(m: int, k: int, n: int) -> predictor.Step:
    """LayerNorm(K) -> Linear(K, N) -> Sigmoid on an (M x K) input, traced on the meta device; forward and backward,
    no optimizer step (the microbenchmark times the layer alone)."""
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.LayerNorm(k), torch.nn.Linear(k, n), torch.nn.Sigmoid())
        x = torch.empty(m, k)
    step = trace_step(model, lambda: model(x).sum())
    return predictor.Step(step.linears, other_flops=step.other_flops, other_bytes=step.other_bytes, params=0.0)


def predicted(m: int, k: int, n: int, fmt: str, target: str = "h100") -> float:
    step = layer_step(m, k, n)
    low = Policy(layers={MODEL_ROOT: "bf16", "1": fmt})
    return predictor.speedup(step, low, target_named(target))


def errors(points: dict[tuple[int, int, int], float], fmt: str) -> list[tuple[tuple[int, int, int], float, float, float]]:
    """(shape, measured, predicted, relative error) per shape."""
    out = []
    for shape, measured in points.items():
        guess = predicted(*shape, fmt)
        out.append((shape, measured, guess, guess / measured - 1))
    return out


def summary(name: str, rows: list[tuple[tuple[int, int, int], float, float, float]]) -> str:
    errs = [abs(r[3]) for r in rows]
    slower = [r for r in rows if r[1] < 1.0]
    wrong_side = sum(1 for r in rows if (r[1] < 1.0) != (r[2] < 1.0))
    return (
        f"| {name} | {len(rows)} | {statistics.median(errs):.1%} | {max(errs):.1%} | "
        f"{sum(e <= 0.12 for e in errs) / len(errs):.0%} | {len(slower)} | {wrong_side} |"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worst", type=int, default=8, help="list this many of the worst shapes per set")
    args = parser.parse_args()
    sets = {
        "H100 fp8 rowwise heat map (B-1)": (heat_map(), "fp8-rowwise"),
        "H100 fp8 tensorwise, squares (B3-B10)": ({(s, s, s): v for s, v in zip(SQUARES, SQUARE_TENSORWISE)}, "fp8"),
        "H100 fp8 rowwise, squares (B3-B10)": ({(s, s, s): v for s, v in zip(SQUARES, SQUARE_ROWWISE)}, "fp8-rowwise"),
    }
    print("| set | shapes | median error | largest | within 12% | measured < 1x | predicted on the wrong side of 1x |")
    print("|---|---|---|---|---|---|---|")
    results = {name: errors(points, fmt) for name, (points, fmt) in sets.items()}
    for name, rows in results.items():
        for half, keep in (("fitted", True), ("held out", False)):
            part = [r for r in rows if fitted(r[0]) == keep]
            if part:
                print(summary(f"{name}, {half}", part))
    for name, rows in results.items():
        print(f"\n{name}, the worst {args.worst}: M x K x N, measured, predicted, error")
        for shape, measured, guess, err in sorted(rows, key=lambda r: -abs(r[3]))[: args.worst]:
            print(f"  {shape[0]} x {shape[1]} x {shape[2]}: {measured:.2f}x, {guess:.2f}x, {err:+.0%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
