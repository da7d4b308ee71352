"""What autoprec's per-module autocast costs: an all-bf16 policy against hand-written torch.autocast.

    python benchmarks/overhead.py [--device cuda] [--width 256] [--depth 4] [--batch 64] [--rounds 15] [--compile]

Every candidate takes full training steps (forward, backward, AdamW step) on its own copy of the same
fp32 model, timed interleaved by autoprec.tune._measure._timing.interleaved_times. Printed, not asserted; the goal is
the all-bf16 policy at most 3% slower than torch.autocast around the whole model. --compile: every model
under torch.compile (applied after the policy), as GPU training runs.
"""

from __future__ import annotations

import argparse
import copy
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

# This checkout's autoprec, whatever the working directory (a script's sys.path starts at benchmarks/).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import add_device_flag, fmt_timing, parse_device, print_header  # noqa: E402

from autoprec import Policy, apply_policy  # noqa: E402
from autoprec.tune._core._config import TimingConfig
from autoprec.tune._measure._timing import interleaved_times  # noqa: E402
from autoprec.tune._measure._trainer import compile_scope  # noqa: E402


class Block(nn.Module):
    """A transformer-style MLP block: LayerNorm, Linear, GELU, Linear, residual."""

    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


def build(width: int, depth: int, classes: int = 16) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[Block(width) for _ in range(depth)], nn.LayerNorm(width), nn.Linear(width, classes))


def linear_names(model: nn.Module) -> list[str]:
    return [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]


def step_fn(
    model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor], autocast: bool, compiled: bool = False
) -> Callable[[], None]:
    """One training step; `autocast` wraps forward and loss the way a hand-written AMP loop does."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model = torch.compile(model) if compiled else model
    x, y = batch
    dev = x.device.type

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        with torch.autocast(dev, dtype=torch.bfloat16, enabled=autocast):
            loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_device_flag(parser)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--compile", action="store_true", help="torch.compile every model (after the policy)")
    args = parser.parse_args()
    device = parse_device(args.device)
    print_header("overhead: all-bf16 policy vs torch.autocast(bfloat16) around the whole model", device)

    base = build(args.width, args.depth).to(device)
    names = linear_names(base)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(args.batch, args.width, generator=g)
    batch = (x.to(device), torch.randint(0, 16, (args.batch,), generator=g).to(device))
    policies = {
        # What `search` writes for uniform bf16: the root and every tunable layer, so only the root is wrapped.
        "policy all-bf16": Policy(layers=dict.fromkeys(["", *names], "bf16")),
        # No root entry: every Linear gets its own autocast region, the worst case for per-module overhead.
        "policy bf16 per layer": Policy(layers=dict.fromkeys(names, "bf16")),
    }
    c = args.compile
    print(f"model: {args.depth} MLP blocks of width {args.width} ({len(names)} Linear layers), batch {args.batch}; "
          f"torch.compile: {'on' if c else 'off'}")  # fmt: skip
    with compile_scope(c, 5):  # every candidate compiled, none left eager
        work = {
            "fp32": step_fn(copy.deepcopy(base), batch, autocast=False, compiled=c),
            "torch.autocast bf16": step_fn(copy.deepcopy(base), batch, autocast=True, compiled=c),
            # The baseline again: how far apart one configuration measures from itself (the noise floor).
            "torch.autocast bf16 again": step_fn(copy.deepcopy(base), batch, autocast=True, compiled=c),
            **{n: step_fn(apply_policy(copy.deepcopy(base), p), batch, autocast=False, compiled=c) for n, p in policies.items()},
        }
        times = interleaved_times(work, device, TimingConfig(warmup=3, rounds=args.rounds, min_block_s=0.1))
    ref = times["torch.autocast bf16"].median_ms
    for name, t in times.items():
        print(f"  {name:24s} {fmt_timing(t)}   x{t.median_ms / ref:.3f} of torch.autocast")
    ratio = times["policy all-bf16"].median_ms / ref
    noise = abs(times["torch.autocast bf16 again"].median_ms / ref - 1)
    verdict = "within" if ratio <= 1.03 else "over"
    print(
        f"all-bf16 policy / torch.autocast = {ratio:.3f} ({verdict} the 3% goal); "
        f"the baseline measured twice differs by {noise:.1%}: differences below that are noise"
    )


if __name__ == "__main__":
    main()
