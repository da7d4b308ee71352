"""A search beside a CPU hog, its written policy re-measured on the quiet machine: is it ever slower than what the
user had (uniform bf16, fp32) by more than the re-measured spread?

    python benchmarks/loaded_search.py --out results/<device>/loaded-search [--model examples/digits/model.py] [--trials N]

1. `autoprec search MODEL` runs with one busy process per core beside it (the load issue 31 saw: spreads of ±50%
   and more), writing its policy.json under --out.
2. The hogs stop; the written policy, uniform bf16 and fp32 are re-measured together, interleaved, on the quiet
   machine (trainer.measure_steps, the search's own final timing).
3. It prints, and writes to summary.md, each candidate's quiet speedup and spread, and the verdict: the policy's
   quiet speed against the faster alternative's, beside what the loaded search recorded and whether it called the
   answer a tie (measured.not_separated).

Printed, not asserted: timings on a shared CPU are noise; tests/test_search.py checks the rule through the timing seam.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).parent))
from common import print_header  # noqa: E402

from autoprec import Policy, load_policy  # noqa: E402
from autoprec.tune import load_task, prepare  # noqa: E402
from autoprec.tune._core._config import TimingConfig  # noqa: E402
from autoprec.tune._measure._trainer import measure_steps  # noqa: E402


def _hog(stop: Any) -> None:
    x = 0
    while not stop.is_set():
        for i in range(100_000):
            x += i * i


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="output folder (the search's files and summary.md)")
    parser.add_argument("--model", default="examples/digits/model.py", help="model.py to search (default: the quick start's)")
    parser.add_argument("--budget", default="0.01")
    parser.add_argument("--hogs", type=int, default=os.cpu_count() or 2, help="busy processes beside the search")
    parser.add_argument("--trials", type=int, default=None, help="the search's --trials (default: the space's)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    import torch

    device = torch.device("cpu")
    print_header("a loaded search, re-measured quiet", device)

    stop = multiprocessing.Event()
    hogs = [multiprocessing.Process(target=_hog, args=(stop,), daemon=True) for _ in range(args.hogs)]
    for h in hogs:
        h.start()
    command = [
        sys.executable,
        "-m",
        "autoprec",
        "search",
        args.model,
        "--budget",
        args.budget,
        "--out",
        str(args.out / "search"),
        "--quiet",
        *(["--trials", str(args.trials)] if args.trials else []),
    ]
    start = time.perf_counter()
    try:
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    finally:
        stop.set()
        for h in hogs:
            h.join()
    searched_s = time.perf_counter() - start
    if done.returncode != 0:
        print(done.stderr)
        return done.returncode

    policy = load_policy(args.out / "search" / "policy.json")
    m = policy.measured
    loaded = m["results"]["policy"]
    workload = prepare(load_task(ROOT / args.model), device)
    candidates = {"written policy": policy, "uniform bf16": Policy(layers={"": "bf16"}), "fp32": Policy()}
    quiet = measure_steps(workload, candidates, TimingConfig(rounds=11), progress="quiet re-measure")
    fp32_ms = quiet["fp32"].effective_ms
    rows = []
    for name, stats in quiet.items():
        rows.append(f"| {name} | {fp32_ms / stats.effective_ms:.3f}x | ±{50 * stats.timing.spread:.1f}% |")
    best_alt = min(quiet["uniform bf16"].effective_ms, fp32_ms)
    lag = quiet["written policy"].effective_ms / best_alt - 1
    spread = (quiet["written policy"].timing.spread + quiet["uniform bf16"].timing.spread) / 2
    verdict = "within the re-measured spread" if lag <= spread else "SLOWER than the faster alternative beyond the spread"
    lines = [
        "# A search beside a CPU hog, re-measured quiet",
        "",
        f"`python benchmarks/loaded_search.py --out {args.out} --model {args.model} --budget {args.budget} --hogs {args.hogs}"
        + (f" --trials {args.trials}" if args.trials else "")
        + "`",
        "",
        f"device: {m.get('device')}; the search took {searched_s:.1f} s beside {args.hogs} busy processes",
        "",
        f"loaded search: chose {m.get('chosen')} at {loaded.get('speedup', float('nan')):.3f}x (spread ±{50 * (loaded.get('spread') or 0):.1f}%); "
        f"not separated from: {', '.join(m.get('not_separated') or []) or 'none'}",
        "",
        "| quiet re-measure | speedup over fp32 | spread |",
        "|---|---|---|",
        *rows,
        "",
        f"verdict: the written policy runs {100 * lag:+.1f}% against the faster of uniform bf16 and fp32 "
        f"(mean spread ±{50 * spread:.1f}%): {verdict}",
    ]
    text = "\n".join(lines) + "\n"
    (args.out / "summary.md").write_text(text, encoding="utf-8")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
