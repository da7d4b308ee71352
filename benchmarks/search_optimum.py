"""How close does the search get to the true optimum? Measure every policy of a small model, then replay
searches against that table.

The model (benchmarks/models/mlp8.py) has 8 Linear layers; each may be fp32, bf16 or fp16 (the root stays
fp32), so there are 3^8 = 6561 policies. Each one's metric is evaluated and its training step timed against
fp32 (interleaved, autoprec.tune._measure._timing; a policy that a first probe already finds more than 1.5x slower than fp32
keeps the probe's ratio, as it cannot be near the optimum). The true optimum under a budget is the fastest
policy in the table within it. Searches then run against the table instead of the device, so many seeds are
cheap and every method sees the same numbers:

- random, all 3^8: Optuna's RandomSampler over every layer's three formats;
- TPE, all 3^8: Optuna's TPESampler (multivariate, with the budget as its constraint), nothing else;
- autoprec: what `autoprec search` does: the profile's choices (formats that alone break the budget or
  measured slower than fp32 by more than 1.25x ruled out), the warm starts (all-fp32, uniform bf16, the
  profile-greedy policy) and TPE; the profile judged per budget as a search does (single-layer drops by group
  testing within a tenth of the budget, config.GROUP_SHARE);
- autoprec, random sampler: the same choices and warm starts, sampled at random (what the sampler adds).

    python benchmarks/search_optimum.py --out results/cpu-epyc-2core/search-optimum

writes policies.csv (the measured table; reused when present), runs.csv (each seed's best after 25 and 50
trials) and summary.md. The table's own noise matters: many policies measure within a few percent of the
best, so the summary counts a search as finding the optimum when its best is tied with it (the optimum's
lead inside the optimum's own spread). Loss scaling is fixed at GradScaler's defaults here (init 2^16), so the search
chooses formats only.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import statistics
import sys
import time
from pathlib import Path

import optuna
import pandas as pd
from tqdm.auto import tqdm

sys.path.insert(0, str(Path(__file__).parent))
from common import add_device_flag, parse_device, print_header  # noqa: E402

from autoprec import Policy
from autoprec.formats import device_name  # noqa: E402
from autoprec.policy import ROOT, model_fingerprint  # noqa: E402
from autoprec.tune import ProfileConfig, load_task, prepare, profile  # noqa: E402
from autoprec.tune._core._config import (
    GROUP_SHARE,  # noqa: E402
    SearchConfig,
    TimingConfig,
)
from autoprec.tune._core._space import space_from_dict  # noqa: E402
from autoprec.tune._measure._choices import Choices, build_choices, greedy_params, suggest, uniform_params  # noqa: E402
from autoprec.tune._measure._metric import evaluate_metric  # noqa: E402
from autoprec.tune._measure._speed import LayerTimes, Timed, too_slow  # noqa: E402
from autoprec.tune._measure._timing import interleaved_times, probe_times  # noqa: E402
from autoprec.tune._measure._trainer import StepStats, Trainer  # noqa: E402
from autoprec.tune._search._storage import sampler_for  # noqa: E402  (the search's own sampler, seeded alike)

MODEL = Path(__file__).parent / "models" / "mlp8.py"
FORMATS = ("fp32", "bf16", "fp16")
SPACE = space_from_dict({
    "default": ["fp32"], "layers": {"Linear": list(FORMATS)}, "layout": "per_layer", "prune": {"slower_than": 1.25},
    # one GradScaler setting, the one the table was measured with: the search picks formats only
    "loss_scale": {"init_scale_log2": [16, 16], "growth_interval": [2000], "dynamic": [True]},
})  # fmt: skip
TIMING = TimingConfig(warmup=1, rounds=5, min_block_s=0.02)
PROBED_ABOVE = 1.5  # a first probe this much slower than fp32: its ratio is kept, not refined
CHECKPOINTS = (25, 50)
BUDGETS = "0,0.0002"
FINALISTS = SearchConfig().finalists  # the prediction's mark is the k-th fastest timed trial


def key(layers: dict) -> str:
    return " ".join(str(getattr(layers[n], "value", layers[n])) for n in sorted(k for k in layers if k != ROOT))


def measure_table(workload, names: list[str], path: Path) -> pd.DataFrame:
    """Every policy's metric and speedup; a table measured before for the same weights on the same device is reused."""
    meta = {"fingerprint": model_fingerprint(workload.model), "device": device_name(str(workload.device)), "timing": str(TIMING)}
    meta_path = path.with_suffix(".json")
    if path.is_file() and meta_path.is_file() and json.loads(meta_path.read_text()) == meta:
        print(f"reusing {path}")
        return pd.read_csv(path)
    baseline = Trainer(workload, Policy(layers={ROOT: "fp32"}))
    fp32_metric = evaluate_metric(workload, Policy(layers={ROOT: "fp32"}))
    rows = []
    for combo in tqdm(list(itertools.product(FORMATS, repeat=len(names))), desc="measuring every policy", unit="policy"):
        policy = Policy(layers={ROOT: "fp32", **dict(zip(names, combo))})
        metric = evaluate_metric(workload, policy)
        trainer = Trainer(workload, policy)
        probe = probe_times({"fp32": baseline.step, "policy": trainer.step}, workload.device, warmup=1, repeats=1)
        if probe["policy"] > PROBED_ABOVE * probe["fp32"]:
            speedup, spread, how = probe["fp32"] / probe["policy"], math.nan, "probe"
        else:
            t = interleaved_times({"fp32": baseline.step, "policy": trainer.step}, workload.device, TIMING)
            stats = StepStats(t["policy"], trainer.finite, trainer.steps, trainer.skipped)
            speedup, spread, how = (
                t["fp32"].median_ms / stats.effective_ms,
                max(t["fp32"].spread, t["policy"].spread),
                "interleaved",
            )
        rows.append({"policy": " ".join(combo), **dict(zip(names, combo)), "metric": metric,
                     "metric_drop": fp32_metric - metric, "speedup": speedup, "spread": spread, "timed": how})  # fmt: skip
    table = pd.DataFrame(rows)
    table.to_csv(path, index=False)
    meta_path.write_text(json.dumps(meta, indent=2) + "\n")
    return table


def replay(
    table: pd.DataFrame,
    choices: Choices,
    budget: float,
    sampler,
    warm: list[dict],
    trials: int,
    layer_times: LayerTimes | None = None,
) -> list[tuple[float, str, int]]:
    """(best feasible speedup, its policy, trials untimed so far) after each trial of a study that reads the table
    instead of measuring. With `layer_times`, as a search that predicts speed (objective.Objective): a feasible
    trial that speed.too_slow finds below the k-th fastest timed trial is told its predicted speedup, is never the
    best (it is not re-measured), and does not join the fit."""
    by_key = table.set_index("policy")
    study = optuna.create_study(direction="maximize", sampler=sampler)
    for params in warm:
        study.enqueue_trial(params)
    best, curve = (0.0, "none"), []
    timed: list[Timed] = []
    speeds: list[float] = []  # timed trials' speedups (not all-fp32): the mark is the k-th fastest
    told: dict[str, float] = {}  # a policy proposed again reuses its first trial's value, as a search does
    untimed = 0
    for _ in range(trials):
        trial = study.ask()
        policy = suggest(trial, choices, SPACE)
        name = key(policy.layers)
        row = by_key.loc[name]
        trial.set_constraint("metric_drop_over_budget", float(row["metric_drop"]) - budget)
        feasible = row["metric_drop"] <= budget
        value = float(row["speedup"]) if feasible else 0.0
        lowered = any(str(getattr(f, "value", f)) != "fp32" for f in policy.layers.values())
        if name not in told and feasible and lowered and layer_times is not None:
            ranked = sorted(speeds, reverse=True)
            mark = ranked[FINALISTS - 1] if len(ranked) >= FINALISTS and ranked[FINALISTS - 1] > 0 else None  # as _finalist_mark
            found = too_slow(timed, layer_times.features(policy), mark)
            if found is None:  # timed: it joins the fit and the mark
                speeds.append(value)
                features = layer_times.features(policy)
                if features is not None:
                    timed.append(Timed(features, 100.0, 100.0 / value))
            else:
                untimed += 1
                told[name] = found[0]
        study.tell(trial, told.setdefault(name, value))
        if told[name] == value:  # untimed trials are never the answer: they are not re-measured
            best = max(best, (value, name))
        curve.append((*best, untimed))
    return curve


def methods(prof, names: list[str], budget: float, seed: int, device):
    """(name, choices, sampler, warm starts, the profile's layer times where the method predicts speed) per method."""
    fixed_scale = {"init_scale_log2": [16, 16]}
    everything = Choices(default=("fp32",), layers=dict.fromkeys(names, FORMATS), excluded={}, loss_scale=fixed_scale)
    pruned = dataclasses.replace(build_choices(prof, SPACE, budget, device), loss_scale=fixed_scale)
    warm = [uniform_params(pruned, "fp32"), uniform_params(pruned, "bf16"), greedy_params(prof, pruned, budget)]
    times = LayerTimes.from_rows(prof.rows)
    return [
        ("random, all 3^8", everything, optuna.samplers.RandomSampler(seed=seed), [], None),
        ("TPE, all 3^8", everything, sampler_for(SPACE, seed), [], None),
        ("autoprec (profile choices, warm starts, TPE)", pruned, sampler_for(SPACE, seed), warm, None),
        ("autoprec, trials predicted too slow left untimed", pruned, sampler_for(SPACE, seed), warm, times),
        ("autoprec's choices and warm starts, random sampler", pruned, optuna.samplers.RandomSampler(seed=seed), warm, None),
    ]


def marginal(table: pd.DataFrame, prof) -> str:
    """Per layer: what bf16 does to the whole step (mean speedup of the fp16-free policies with it in bf16 over
    those with it in fp32) beside what the profile measured of the layer alone, and its single-layer drop."""
    clean = table[~table["policy"].str.contains("fp16")]
    lines = ["| layer | bf16 in the whole step (mean over 128 pairs) | bf16 alone, profiled (x fp32 time) | bf16 alone: metric drop |",
             "|---|---|---|---|"]  # fmt: skip
    for name in sorted(prof.layers()):
        effect = clean.loc[clean[name] == "bf16", "speedup"].mean() / clean.loc[clean[name] == "fp32", "speedup"].mean()
        alone = prof.row(name, "bf16")
        lines.append(f"| {name} | {effect:.3f}x | {alone.time_vs_fp32:.2f}x | {alone.metric_drop:.3g} |")
    return "\n".join(lines) + "\n"


def tied(table: pd.DataFrame, optimum_row: pd.Series) -> pd.Series:
    """Policies the measurement cannot tell from the optimum: the optimum's lead over them is inside the
    optimum's own spread (the interquartile range of its rounds over their median)."""
    return optimum_row["speedup"] / table["speedup"] - 1 < optimum_row["spread"]


def summarise(runs: pd.DataFrame, budgets: list[float], table: pd.DataFrame) -> str:
    lines = []
    for budget in budgets:
        feasible = table[table["metric_drop"] <= budget]
        best = feasible.sort_values("speedup", ascending=False).iloc[0]
        ties = feasible[tied(feasible, best)]
        lines.append(
            f"### Budget {budget:g}\n\nThe measured optimum: {best['speedup']:.3f}x ({best['policy']}, drop "
            f"{best['metric_drop']:.3g}, spread {best['spread']:.1%}); {len(ties)} feasible policies are tied with it "
            f"(its lead inside its spread), down to {ties['speedup'].min():.3f}x.\n"
        )
        rows = ["| method | trials | best found / optimum: median [q1, q3] | runs that found a tied policy | trials not timed (mean) |",
                "|---|---|---|---|---|"]  # fmt: skip
        for (method, n), group in runs[runs["budget"] == budget].groupby(["method", "trials"], sort=False):
            ratio = (group["best"] / best["speedup"]).tolist()
            q = statistics.quantiles(ratio, n=4, method="inclusive") if len(ratio) > 1 else [ratio[0]] * 3
            hits = group["best_policy"].isin(set(ties["policy"])).sum()
            untimed = group["untimed"].mean() if "untimed" in group else 0.0
            rows.append(f"| {method} | {n} | {q[1]:.3f} [{q[0]:.3f}, {q[2]:.3f}] | {hits}/{len(group)} | {untimed:.1f} |")
        lines.append("\n".join(rows) + "\n")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_device_flag(parser)
    parser.add_argument("--out", required=True, help="folder for policies.csv, runs.csv, summary.md")
    parser.add_argument("--budgets", default=BUDGETS, help=f"metric-drop budgets to replay (default {BUDGETS})")
    parser.add_argument("--seeds", type=int, default=20, help="searches per method and budget (default 20)")
    parser.add_argument("--table", type=Path, help="a policies.csv measured before (another run's --out), replayed as it "
                                                   "is instead of measuring one; the summary names it")  # fmt: skip
    args = parser.parse_args()
    device = parse_device(args.device)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print_header("search against the true optimum of every measured policy (mlp8: 8 layers x fp32/bf16/fp16)", device)
    workload = prepare(load_task(MODEL), device)
    prof = profile(workload, SPACE)  # every drop measured alone: the table's layer names, the marginal table
    prof.save(out / "profile")
    budgets = [float(b) for b in args.budgets.split(",")]
    # the profile a search at each budget judges its choices and warm starts by (group testing, as pipeline does);
    # each is measured anew, so its timings (and so its choices) may also differ from the first by timing noise
    searched = {b: profile(workload, SPACE, ProfileConfig(group_tolerance=GROUP_SHARE * b), progress=False) for b in budgets}
    names = sorted(prof.layers())
    start = time.perf_counter()
    if args.table is not None:  # measured by another run (perhaps on another machine): the summary says so
        table, where = pd.read_csv(args.table), f"the table {args.table} (measured by an earlier run, replayed as it is)"
        missing = [n for n in names if n not in table.columns]
        if missing:
            raise SystemExit(f"--table {args.table}: no column for layers {missing}; it was measured for another model")
    else:
        table, where = measure_table(workload, names, out / "policies.csv"), "the table policies.csv"
        print(f"table: {len(table)} policies in {time.perf_counter() - start:.0f} s; "
              f"{(table['timed'] == 'interleaved').sum()} timed interleaved, the rest probed")  # fmt: skip
    records = []
    for budget in budgets:
        for seed in tqdm(range(args.seeds), desc=f"replaying searches, budget {budget:g}", unit="seed"):
            for name, choices, sampler, warm, times in methods(searched[budget], names, budget, seed, device):
                curve = replay(table, choices, budget, sampler, warm, max(CHECKPOINTS), times)
                records += [{"budget": budget, "method": name, "seed": seed, "trials": n, "best": curve[n - 1][0],
                             "best_policy": curve[n - 1][1], "untimed": curve[n - 1][2]} for n in CHECKPOINTS]  # fmt: skip
    runs = pd.DataFrame(records)
    runs.to_csv(out / "runs.csv", index=False)
    interleaved = table[table["timed"] == "interleaved"]
    text = (
        f"# Search against the true optimum\n\n`python benchmarks/search_optimum.py --out {args.out}"
        + (f" --budgets {args.budgets}" if args.budgets != BUDGETS else "")
        + (f" --table {args.table}" if args.table else "")
        + "`\n\n"
        f"Device of the profiles: {prof.device}; the policies' metrics and speedups: {where}. Model: benchmarks/models/mlp8.py, 8 Linear layers x {{fp32, bf16, fp16}}, root fp32: "
        f"{len(table)} policies, each evaluated and timed against fp32 ({len(interleaved)} interleaved, median spread "
        f"{interleaved['spread'].median():.1%}; {len(table) - len(interleaved)} more than {PROBED_ABOVE}x slower than fp32 in a "
        f"first probe keep that ratio). Metric: -(mean eval loss); budget = the largest drop. Each method ran {args.seeds} "
        f"seeds against the table; the counts include warm starts.\n\n"
        + "".join(
            f"Profile choices at budget {b:g}: {json.dumps(dict(build_choices(searched[b], SPACE, b, device).layers))}\n\n"
            for b in budgets
        )
        + marginal(table, prof)
        + "\n"
        + summarise(runs, budgets, table)
    )
    (out / "summary.md").write_text(text, encoding="utf-8")
    print(text)


if __name__ == "__main__":
    main()
