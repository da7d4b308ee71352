"""How many graphs a compiled profile and a compiled search compile: what a GPU call's minutes go to.

    python benchmarks/compile_count.py [--model examples/gpt2/model.py] [--trials 6] [--out DIR]

On an H100 each graph torch.compile builds (a forward and its backward, through inductor) costs seconds; on the
device's 10-minute calls the count decides what fits (benchmarks/GPU_PLAN.md prices each part from it). This
runs the GPU suite's profile and search (its space, gpu_suite.GPU_SPACE, compiled, as on the GPU) on a CPU with a
counting backend that captures each graph as dynamo does and runs it eagerly, so it takes a minute, not the hour
inductor would on a CPU. Counted: the graphs dynamo hands a backend (one per compiled region and shape: a block
policy, a single-layer holder, a recompilation for a new batch shape). gpt2 runs at AUTOPREC_GPT2_SIZE=tiny (2
blocks): the profile's count is per distinct Linear shape and format, the same at every width and depth; a trial's
is per distinct block policy, at most the model's blocks (12 for GPT-2-small), which the table reports beside it.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

COUNT: collections.Counter[str] = collections.Counter()
STAGE = ["setup"]


def counting_backend(gm: torch.fx.GraphModule, example_inputs: list) -> object:
    """A torch.compile backend that counts the graph against the current stage and runs it as captured."""
    COUNT[STAGE[0]] += 1
    return gm.forward


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=ROOT / "examples" / "gpt2" / "model.py")
    parser.add_argument("--trials", type=int, default=6)
    parser.add_argument("--out", type=Path, help="folder for <model>.json, the counts (default: print only)")
    args = parser.parse_args()
    os.environ.setdefault("AUTOPREC_GPT2_SIZE", "tiny")
    real_compile = torch.compile

    def compile_counting(model=None, **kwargs):  # type: ignore[no-untyped-def]
        kwargs["backend"] = counting_backend
        return real_compile(model, **kwargs) if model is not None else real_compile(**kwargs)

    torch.compile = compile_counting  # type: ignore[assignment]  # nn.Module.compile reads it at call time too

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from gpu_suite import BUDGET, GPU_SPACE

    from autoprec.apply import repeated_blocks
    from autoprec.tune import SearchConfig, load_task, prepare
    from autoprec.tune._core._config import ProfileConfig, TimingConfig
    from autoprec.tune._core._space import space_from_dict
    from autoprec.tune._search._out_dir import load_or_profile
    from autoprec.tune._search._pipeline import search

    workload = prepare(load_task(args.model), "cpu")
    space = space_from_dict({**GPU_SPACE, "trials": args.trials})
    quick = TimingConfig(warmup=1, rounds=3, min_block_s=0.0)  # counts, not times: the fewest rounds that rank
    config = SearchConfig(budget=BUDGET, trials=args.trials, compile=True, progress=False, timing=quick, final_timing=quick,
                          profile=ProfileConfig(timing=quick), predict_speed=False)  # fmt: skip
    found = {id(b) for b in repeated_blocks(workload.model)}
    prefixes = [name for name, m in workload.model.named_modules() if id(m) in found]
    blocks = len(prefixes)
    shapes = {tuple(m.weight.shape) for m in workload.model.modules() if isinstance(m, torch.nn.Linear)}
    formats = len(GPU_SPACE["layers"]["Linear"])
    began = time.time()
    out = Path(tempfile.mkdtemp(prefix="autoprec-compile-count-"))  # the search's files: only the counts are kept
    STAGE[0] = "profile"
    load_or_profile(workload, space, out, config)  # saved there, for the search to reuse
    STAGE[0] = "search (trials and final re-measure; the profile reused)"
    result = search(workload, space, config, out)
    wall = time.time() - began
    trials = result.trials
    done = int((trials["state"] == "COMPLETE").sum()) if "state" in trials else len(trials)
    block_policies = [len({json.dumps(p) for p in _block_formats(row, prefixes)}) for _, row in trials.iterrows()]
    record = {
        "model": str(args.model.relative_to(ROOT)) if args.model.is_relative_to(ROOT) else str(args.model),
        "size": os.environ["AUTOPREC_GPT2_SIZE"] if args.model.parent.name == "gpt2" else "as shipped",
        "blocks": blocks,
        "linear_shapes": len(shapes),
        "formats": formats,
        "graphs": dict(COUNT),
        "profile_graphs_per_shape_format": COUNT["profile"] / (len(shapes) * formats),
        "trials": done,
        "distinct_block_policies_per_trial": block_policies,
        "wall_s": round(wall, 1),
        "torch": torch.__version__,
        "command": "python benchmarks/compile_count.py " + " ".join(sys.argv[1:]),
    }
    print(json.dumps(record, indent=2))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"{record['model'].split('/')[-2]}.json").write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    return 0


def _block_formats(row, prefixes: list[str]) -> list[dict[str, str]]:  # type: ignore[no-untyped-def]
    """A trial's formats per repeated block (the trials.csv columns under each block's name), one dict a block."""
    per: list[dict[str, str]] = [{} for _ in prefixes]
    for column, value in row.items():
        for i, prefix in enumerate(prefixes):
            if str(column).startswith(prefix + "."):
                per[i][str(column)[len(prefix) + 1 :]] = str(value)
    return per


if __name__ == "__main__":
    sys.exit(main())
