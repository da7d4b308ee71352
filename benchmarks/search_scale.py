"""A search over 100+ layers: the per-layer, grouped and ranked layouts against uniform bf16 and the
profile-greedy policy, on examples/tinylm/moe12.py (12 blocks, 109 Linears).

The model is profiled once; each layout then runs a full `autoprec search` with the same budget, trials and
seed, reusing that profile (each in its own folder, with its own study). Finally every layout's chosen
policy is re-measured in one interleaved run beside fp32, uniform bf16 and the profile-greedy policy, so the
speedups compare like with like.

    python benchmarks/search_scale.py --out results/cpu-epyc-2core/search-scale [--trials 50] [--budget 0.01]

writes, under --out: profile/ (the shared profile), per_layer/, grouped/, ranked/ (each search's outputs but the
profile),
curves.csv (best speedup so far after each trial, per layout), final.csv and summary.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import sys
import time
from pathlib import Path

import pandas as pd

sys.path.insert(0, str(Path(__file__).parent))
from common import add_device_flag, parse_device, print_header  # noqa: E402

from autoprec.tune import Profile, SearchConfig, load_space, load_task, prepare, profile  # noqa: E402
from autoprec.tune._core._budget import Budgets  # noqa: E402
from autoprec.tune._core._config import TimingConfig  # noqa: E402
from autoprec.tune._core._records import Candidate, Measured  # noqa: E402
from autoprec.tune._core._space import Layout  # noqa: E402
from autoprec.tune._search._finalists import baselines, remeasure  # noqa: E402
from autoprec.tune._search._objective import Judge  # noqa: E402
from autoprec.tune._search._pipeline import search  # noqa: E402

MODEL = Path(__file__).parents[1] / "examples" / "tinylm" / "moe12.py"
LAYOUTS = (Layout.PER_LAYER, Layout.GROUPED, Layout.RANKED)


def curve(trials: pd.DataFrame) -> list[float]:
    """Best feasible speedup after each completed trial, in trial order."""
    best, out = 0.0, []
    for _, row in trials.sort_values("trial").iterrows():
        if row.get("feasible") is True or row.get("feasible") == 1:
            best = max(best, float(row["speedup"]))
        out.append(best)
    return out


def _readable_profile(folder: Path) -> bool:
    try:
        Profile.load(folder)
    except (OSError, ValueError):  # missing, or written by another autoprec version (files.OtherVersion)
        return False
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_device_flag(parser)
    parser.add_argument("--out", required=True)
    parser.add_argument("--trials", type=int, default=50)
    parser.add_argument("--budget", type=float, default=0.01)
    parser.add_argument("--rounds", type=int, default=15, help="rounds of the final interleaved re-measure (default 15)")
    args = parser.parse_args()
    device = parse_device(args.device)
    out = Path(args.out)
    print_header(f"search layouts on 109 layers (moe12), budget {args.budget:g}, {args.trials} trials each", device)
    workload = prepare(load_task(MODEL), device)
    space = load_space()
    if not _readable_profile(out / "profile"):  # none yet, or another version's: profiled once, shared by every layout
        start = time.perf_counter()
        profile(workload, space).save(out / "profile")
        print(f"profiled in {time.perf_counter() - start:.0f} s")
    config = SearchConfig(budget=args.budget, trials=args.trials, seed=0)
    results, curves = {}, {}
    for layout in LAYOUTS:
        folder = out / layout.value
        folder.mkdir(parents=True, exist_ok=True)
        for name in ("profile.csv", "profile.json", "grad_ranges.csv"):  # the same profile for every layout
            shutil.copy(out / "profile" / name, folder / name)
        start = time.perf_counter()
        result = search(workload, dataclasses.replace(space, layout=layout), config, folder)
        for name in ("profile.csv", "profile.json", "grad_ranges.csv"):  # copies of profile/: not kept twice
            (folder / name).unlink()
        chosen = Measured.of(result.policy)
        print(f"{layout.value}: {result.choices.describe()}; {time.perf_counter() - start:.0f} s; "
              f"chose {chosen.chosen} at {chosen.results['policy'].speedup:.3f}x")  # fmt: skip
        results[layout.value] = result
        curves[layout.value] = curve(result.trials)
    pd.DataFrame(curves).rename_axis("trial").to_csv(out / "curves.csv")
    first = next(iter(results.values()))
    # the layout does not change the choices
    candidates = dict(baselines(workload, space, first.profile, first.choices, args.budget).candidates)
    for name, result in results.items():
        candidates[f"{name} search"] = Candidate(dataclasses.replace(result.policy, measured=None))
    judge = Judge(workload, config, first.profile.fp32_metric, budgets=Budgets((args.budget,)))
    final = remeasure(workload, candidates, judge, args.budget, TimingConfig(rounds=args.rounds), progress="final re-measure")
    final.to_csv(out / "final.csv")
    rows = ["| candidate | metric drop | within budget | speedup over fp32 | spread |", "|---|---|---|---|---|"]
    for r in final:
        rows.append(
            f"| {r.candidate} | {r.metric_drop:.4g} | {'yes' if r.feasible else 'no'} | {r.speedup:.3f} | ±{50 * r.spread:.1f}% |"
        )
    reach = ["| layout | parameters | best after 10 / 25 / 50 trials (trial timing) | search time |", "|---|---|---|---|"]
    for name, result in results.items():
        c = curves[name]
        at = " / ".join(f"{c[min(n, len(c)) - 1]:.3f}" for n in (10, 25, 50))
        seconds = sum(result.cost["seconds"].values()) if result.cost else float("nan")
        reach.append(f"| {name} | {result.choices.describe()} | {at} | {seconds:.0f} s |")
    text = (
        f"# Search layouts on 109 layers\n\n`python benchmarks/search_scale.py --out {args.out} --trials {args.trials} "
        f"--budget {args.budget:g}`\n\nDevice: {first.profile.device}. Model: examples/tinylm/moe12.py (12 blocks, 109 Linears), "
        f"metric {first.profile.metric_name}, budget {args.budget:g}, {args.trials} trials per layout (seed 0, warm starts "
        f"included), one shared profile.\n\n## Final re-measure, all together ({args.rounds} interleaved rounds)\n\n"
        + "\n".join(rows)
        + "\n\n## How fast each layout got there\n\n"
        + "\n".join(reach)
        + "\n"
    )
    (out / "summary.md").write_text(text, encoding="utf-8")
    print(text)


if __name__ == "__main__":
    main()
