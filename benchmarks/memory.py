"""Peak memory per training step of the examples in fp32, uniform bf16 and uniform fp16, as a search measures it.

    python benchmarks/memory.py [--device cpu|cuda] [--compile] [MODEL.py ...]   # default: the shipped examples

Each candidate trains a few steps (AdamW, or the model.py's optimizer), then one more step is measured by
autoprec.tune._core._memory (the state plus the step's rise; see that module for what each device's measurement sees).
Printed as a markdown table; results/<device>/memory/summary.md holds a run.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from common import add_device_flag, parse_device, print_header  # noqa: E402

from autoprec import Policy  # noqa: E402
from autoprec.formats import Format  # noqa: E402
from autoprec.tensors import map_tensors  # noqa: E402
from autoprec.tune import load_task, prepare  # noqa: E402
from autoprec.tune._core import _memory as memory  # noqa: E402
from autoprec.tune._core._tables import markdown_table  # noqa: E402
from autoprec.tune._measure._trainer import Trainer, compile_scope, largest_batch  # noqa: E402

EXAMPLES = ["examples/digits/model.py", "examples/tinylm/model.py", "examples/minilm/model.py"]
POLICIES = {"fp32": Policy(), "uniform bf16": Policy(layers={"": Format.BF16}), "uniform fp16": Policy(layers={"": Format.FP16})}


def _first_shape(batch: object) -> str:
    shapes: list[torch.Size] = []
    map_tensors(batch, lambda t: shapes.append(t.shape) or t)
    return "x".join(map(str, shapes[0])) if shapes else "?"


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("models", nargs="*", default=EXAMPLES, help="model.py files (default: the shipped examples)")
    parser.add_argument("--compile", action="store_true", help="the model under torch.compile, as a compiled search measures")
    add_device_flag(parser)
    args = parser.parse_args()
    device = parse_device(args.device)
    print(f"`python benchmarks/memory.py {' '.join(sys.argv[1:])}`".replace(" `", "`"))
    print_header(f"peak memory per training step ({'compiled' if args.compile else 'eager'})", device)
    print(f"source: {memory.source(device) or memory.not_measured(device)}\n")
    headers = ["model", "batch", "state", *(f"{name}" for name in POLICIES), *(f"{n} vs fp32" for n in POLICIES if n != "fp32")]
    rows = []
    for path in args.models:
        workload = prepare(load_task(ROOT / path), device)
        peaks, state = {}, 0
        for name, policy in POLICIES.items():
            with compile_scope(args.compile, 1) if args.compile else contextlib.nullcontext():
                trainer = Trainer(workload, policy, compiled=args.compile)
                for _ in range(2):  # the optimizer state exists and a compiled model is compiled
                    trainer.step()
                peaks[name] = trainer.peak_memory()
                state = memory.state_bytes(trainer.state())
        changes = [memory.format_change(memory.saving(peaks[n], peaks["fp32"])) for n in POLICIES if n != "fp32"]
        batch = _first_shape(workload.train[largest_batch(workload)])  # the batch Trainer.peak_memory measures
        rows.append(
            [workload.task.name, batch, memory.human_bytes(state), *(memory.human_bytes(p) for p in peaks.values()), *changes]
        )
        print(f"{workload.task.name}: " + ", ".join(f"{n} {memory.human_bytes(p)}" for n, p in peaks.items()), file=sys.stderr)
    print(markdown_table(headers, rows))
    print("\nstate: parameters, buffers and optimizer state (the same in every format: the weights stay fp32); "
          "vs fp32: the change of the peak from all-fp32's.")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
