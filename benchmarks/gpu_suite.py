"""The GPU suite: everything autoprec must show on a GPU, in pieces that each fit a 9-minute device call.

    python benchmarks/gpu_suite.py --out results/<device>                  # every part, then summary.md
    python benchmarks/gpu_suite.py --out results/<device> --part gpt2      # one part (tests, bench, tinylm, gpt2)
    python benchmarks/gpu_suite.py --out DIR --smoke --device cpu          # the same path, tiny, on a CPU (< 3 min)

Parts, each writing under --out and printing its wall time:

- `tests`: the test suite (its CUDA tests run only on a GPU), output in tests.txt;
- `bench`: benchmarks/fp8_linear.py --compile (every fp8 recipe the device runs, against bf16) and benchmarks/overhead.py
  --compile, output in fp8_linear.txt and overhead.txt;
- `tinylm`, `gpt2`: a compiled `autoprec search` (budget 0.02 on -(mean eval loss)) of examples/tinylm and of
  examples/gpt2 (GPT-2-small class), each in search-<model>/ with its policy.json, trials, finalists and a
  summary.md, beside the alternatives measured in the same run (fp32, TF32, uniform bf16, torchao fp8
  everywhere with its filter, the profile-greedy policy);
- `summary`: summary.md, one row per searched model from the search folders present (runs after any part).

--smoke shrinks everything (gpt2 at AUTOPREC_GPT2_SIZE=tiny with Linears in fp32 or fp8 only, 2 trials, short
timing, the CUDA tests only, one small benchmark shape; tinylm is left out) so CI runs the whole path on a CPU;
its numbers mean nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's autoprec, whatever the working directory

PARTS = ("tests", "bench", "tinylm", "gpt2")
MODELS = {"tinylm": ROOT / "examples" / "tinylm" / "model.py", "gpt2": ROOT / "examples" / "gpt2" / "model.py"}
BUDGET = 0.02
TRIALS = {"tinylm": 24, "gpt2": 16}  # what fits a 9-minute piece on an H100 is the goal; --trials overrides
import torch  # noqa: E402

from autoprec.formats import default_device  # noqa: E402
from autoprec.tune.alternatives import BF16, FP8_EVERYWHERE, FP32, TF32  # noqa: E402
from autoprec.tune.records import Measured  # noqa: E402

COLUMNS = (FP32, TF32, BF16, FP8_EVERYWHERE)


def run(cmd: list[str], out: Path, *, env: dict[str, str] | None = None) -> int:
    """Run a command with its output in `out` (and echoed), from the repository root."""
    print("$", " ".join(cmd), flush=True)
    proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, **(env or {})}, capture_output=True, text=True)
    text = proc.stdout + proc.stderr
    out.write_text(f"$ {' '.join(cmd)}\n\n{text}", encoding="utf-8")
    print(text[-3000:], flush=True)
    return proc.returncode


def part_tests(out: Path, args: argparse.Namespace) -> int:
    # this suite's own smoke test would run the suite again inside this piece: left to CI
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--deselect", "tests/test_gpu_suite.py"]
    if args.smoke:  # the CUDA tests (they skip on a CPU), not the whole suite CI has just run
        cmd += ["tests/test_apply.py", "tests/test_apply_compile.py", "-k", "cuda or kernels"]
    return run(cmd, out / "tests.txt")


def part_bench(out: Path, args: argparse.Namespace) -> int:
    fp8 = [sys.executable, "benchmarks/fp8_linear.py", "--compile", "--device", args.device]
    over = [sys.executable, "benchmarks/overhead.py", "--compile", "--device", args.device]
    if args.smoke:
        fp8 += ["--shapes", "64", "--rounds", "1"]
        over += ["--width", "32", "--depth", "1", "--rounds", "1"]
    return run(fp8, out / "fp8_linear.txt") | run(over, out / "overhead.txt")


def part_search(name: str, out: Path, args: argparse.Namespace) -> int:
    if args.smoke:
        os.environ["AUTOPREC_GPT2_SIZE"] = "tiny"  # read when model.py is imported, just below
    from autoprec.files import write_text
    from autoprec.tune import SearchConfig, load_space, load_task, prepare
    from autoprec.tune.api import search_and_report
    from autoprec.tune.config import ProfileConfig, TimingConfig
    from autoprec.tune.space import space_from_dict

    device = torch.device(args.device)
    task = load_task(MODELS[name])
    folder = out / f"search-{name}"
    trials = args.trials or (2 if args.smoke else TRIALS[name])
    extra, space = {}, load_space()
    if args.smoke:  # every compile costs seconds on a CPU: fewer formats, trials and rounds
        tiny = TimingConfig(warmup=1, rounds=2, min_block_s=0.0)
        extra = dict(timing=tiny, final_timing=tiny, finalists=1, profile=ProfileConfig(batches=1, timing=tiny))
        space = space_from_dict({"default": ["fp32", "bf16"], "layers": {"Linear": ["fp32", "fp8"]}, "trials": trials})
    config = SearchConfig(budget=BUDGET, trials=trials, compile=True, progress=not args.smoke, **extra)
    command = f"python benchmarks/gpu_suite.py --out {args.out} --part {name}" + (" --smoke" if args.smoke else "")
    start = time.perf_counter()
    result = search_and_report(prepare(task, device), space, config, folder, command=command)
    wall = time.perf_counter() - start  # the reports' drawing included: a second or two beside the search
    row = {"model": name + (" (tiny)" if args.smoke and name == "gpt2" else ""), "wall_s": wall, "trials": trials,
           "chosen": Measured.of(result.policy).chosen, "device": result.profile.device,
           "finals": json.loads(result.finals.to_frame().to_json(orient="records"))}  # fmt: skip
    write_text(folder / "result.json", json.dumps(row, indent=2) + "\n")
    print(f"{name}: chose {row['chosen']} in {wall:.0f} s ({trials} trials)")
    return 0


def summary(out: Path) -> str:
    """One row per searched model: step time of each alternative and of the policy, speedup over uniform bf16,
    the policy's metric drop and the search's wall time."""
    from autoprec.tune.memory import human_bytes
    from autoprec.tune.report import markdown_table

    headers = ["model", *(f"{c} ms" for c in COLUMNS), "policy ms", *(f"{c} / bf16" for c in ("fp32", "fp8 everywhere", "policy")),
               "policy drop", "chosen", "search s"]  # fmt: skip
    rows, device = [], "?"
    for path in sorted(out.glob("search-*/result.json")):
        r = json.loads(path.read_text(encoding="utf-8"))
        device = r["device"]
        # a candidate that failed or never ran has no step time (null): NaN, shown as "-"
        ms = {f["candidate"]: float("nan") if f["effective_step_ms"] is None else f["effective_step_ms"] for f in r["finals"]}
        bf16 = ms.get(BF16, float("nan"))
        chosen = next(f for f in r["finals"] if f["candidate"] == r["chosen"])
        ratio = [bf16 / ms.get(c, float("nan")) for c in (FP32, FP8_EVERYWHERE, r["chosen"])]
        rows.append([r["model"], *(ms.get(c, float("nan")) for c in COLUMNS), ms[r["chosen"]], *ratio,
                     chosen["metric_drop"], r["chosen"], round(r["wall_s"])])  # fmt: skip
    memory_rows = []
    for path in sorted(out.glob("search-*/result.json")):
        r = json.loads(path.read_text(encoding="utf-8"))
        peak = {f["candidate"]: f.get("peak_bytes") for f in r["finals"]}  # absent in results from before memory
        memory_rows.append([r["model"], *(human_bytes(peak.get(c)) for c in (FP32, BF16, FP8_EVERYWHERE, r["chosen"]))])
    text = (
        f"# autoprec GPU suite: {device}\n\n`python benchmarks/gpu_suite.py --out {out}`\n\n"
        + markdown_table(headers, rows)
        + "\n\nPeak memory per training step (the model and optimizer state plus the step's peak above it; "
        "autoprec.tune.memory: the CUDA allocator's peak on a GPU, '-' where not measured):\n\n"
        + markdown_table(["model", "fp32", "uniform bf16", "fp8 everywhere", "policy"], memory_rows)
        + f"\n\nStep times are effective training-step milliseconds (compiled, re-measured together, interleaved); "
        f"x / bf16 is the speedup over uniform bf16 autocast (above 1: faster); a missing alternative (nan) was not "
        f"measured here (TF32 needs CUDA; fp8 everywhere needs fp8 kernels, tensorwise fp8 in the space and a layer "
        f"torchao's filter converts) or failed (search-<model>/finalists.csv says why). "
        f"Budget {BUDGET} on -(mean eval loss). Per model: search-<model>/summary.md.\n"
    )
    (out / "summary.md").write_text(text, encoding="utf-8")
    return text


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="output folder, e.g. results/h100-sxm")
    parser.add_argument("--part", choices=(*PARTS, "summary", "all"), default="all")
    parser.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes: the whole path on a CPU in minutes")
    parser.add_argument("--trials", type=int, help="trials per search (default: tinylm 24, gpt2 16; smoke 2)")
    args = parser.parse_args()
    args.device = args.device or str(default_device())
    if not args.smoke and args.device == "cpu":
        print("gpu_suite: the full suite is for a GPU; on a CPU run it with --smoke", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    parts = PARTS if args.part == "all" else () if args.part == "summary" else (args.part,)
    if args.smoke:
        parts = tuple(p for p in parts if p != "tinylm")  # tinylm is not tiny; gpt2 tiny stands for both searches
    status = 0
    for part in parts:
        start = time.perf_counter()
        if part == "tests":
            status |= part_tests(out, args)
        elif part == "bench":
            status |= part_bench(out, args)
        else:
            status |= part_search(part, out, args)
        print(f"gpu_suite: part {part} took {time.perf_counter() - start:.0f} s", flush=True)
    print(summary(out))
    return 1 if status else 0


if __name__ == "__main__":
    sys.exit(main())
