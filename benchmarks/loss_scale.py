"""Loss scaling for a model whose fp16 gradients underflow without it (tests/models/underflow_mlp.py).

Regenerates the files in --out (by default the committed folder) (CPU, a few minutes):

    python benchmarks/loss_scale.py [--out DIR]  (default: results/cpu-xeon-2core/loss-scale)

1. The profile's recommended loss-scale range and the layers that bound it (profile.csv, grad_ranges.csv).
2. A train-mode search (K = 20 steps, budget 0.02 accuracy) over a space that offers fp32 or fp16 per
   Linear and keeps fp16 even though it measured slower on this CPU (prune.slower_than 100): the settings
   it chose and the steps its GradScaler skipped (underflow_mlp/).
3. A sweep of the initial scale 2^0 .. 2^48 for the policy with every Linear in fp16, static and dynamic:
   the metric after K steps against fp32's, and the skipped steps while training and while timed
   (sweep.csv): the throughput lost is the fraction of timed steps skipped (no step times: this shared
   2-core CPU is too noisy for them to mean anything here).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pandas as pd
from common import out_folder  # noqa: E402 (beside this script)

from autoprec import LossScale, Policy
from autoprec.tune import SearchConfig, load_task, prepare
from autoprec.tune._core._config import TimingConfig
from autoprec.tune._core._space import space_from_dict
from autoprec.tune._core._tables import markdown_table
from autoprec.tune._measure._metric import noise_floor, train_and_evaluate
from autoprec.tune._measure._trainer import measure_steps
from autoprec.tune._report._plots import plot_all
from autoprec.tune._report._report import gradient_summary
from autoprec.tune._search._pipeline import search

ROOT = Path(__file__).resolve().parents[1]
HERE = ROOT / "results/cpu-xeon-2core/loss-scale"  # where the files are written (and, for a re-check, read): --out
MODEL = ROOT / "tests/models/underflow_mlp.py"
K, BUDGET = 20, 0.02
SPACE = {
    "default": ["fp32"],
    "layers": {"Linear": ["fp32", "fp16"]},
    "loss_scale": {"init_scale_log2": [0, 32], "growth_interval": [10, 50, 200, 2000], "growth_factor": [2.0, 4.0],
                   "backoff_factor": [0.5, 0.25], "dynamic": [True, False]},
    "prune": {"slower_than": 100.0},
    "trials": 20,
}  # fmt: skip
FP16 = {"fc1": "fp16", "fc2": "fp16", "head": "fp16"}
# one step per block: every policy takes the same 11 timed steps (3 warm-up, 1 calibration, 7 rounds)
TIMED = TimingConfig(warmup=3, rounds=7, min_block_s=0.0, max_steps_per_block=1, min_steps=1)


def run_search(workload):
    out = HERE / "underflow_mlp"
    config = SearchConfig(budget=BUDGET, mode="train", train_steps=K, noise_runs=3, progress=False)
    result = search(workload, space_from_dict(SPACE, "loss-scale/run.py"), config, out)
    plot_all(result.profile, out, title="underflow_mlp on cpu")
    return result


def sweep(workload, recommended, fp32: float) -> pd.DataFrame:
    rows = []
    for k in range(0, 49, 4):
        for dynamic in (True, False):
            policy = Policy(layers=FP16, loss_scale=LossScale(init_scale=2.0**k, growth_interval=10, dynamic=dynamic))
            trained = train_and_evaluate(workload, policy, K)
            timed = measure_steps(workload, {"p": policy}, TIMED)["p"]
            rows.append({
                "init_scale_log2": k, "dynamic": dynamic, "recommended": recommended[0] <= k <= recommended[1],
                "metric": trained.metric, "drop": fp32 - trained.metric, "train_skipped": trained.skipped, "train_steps": K,
                "timed_skipped": timed.skipped, "timed_steps": timed.steps, "throughput_lost": timed.skip_fraction,
            })  # fmt: skip
            print(rows[-1], file=sys.stderr)
    return pd.DataFrame(rows)


def best_fp16_trial(trials: pd.DataFrame) -> pd.Series | None:
    fp16 = trials[trials[list(FP16)].eq("fp16").any(axis=1) & trials["feasible"].eq(True)]
    return fp16.sort_values("speedup", ascending=False).iloc[0] if len(fp16) else None


def main() -> None:
    global HERE
    HERE = out_folder(__doc__, HERE, ROOT)
    workload = prepare(load_task(MODEL), "cpu")
    result = run_search(workload)
    advice = result.profile.advice()
    fp32 = train_and_evaluate(workload, Policy(), K).metric
    table = sweep(workload, advice.search_range, fp32)
    table.to_csv(HERE / "sweep.csv", index=False)
    measured = json.loads((HERE / "underflow_mlp" / "policy.json").read_text())["measured"]
    noise = noise_floor(workload, K, 3)
    best = best_fp16_trial(result.trials)
    lines = [
        "# Loss scaling for a model with tiny gradients (underflow_mlp, CPU)",
        "",
        "`python benchmarks/loss_scale.py [--out DIR]  (default: results/cpu-xeon-2core/loss-scale)`: tests/models/underflow_mlp.py weights its loss by "
        "2^-24, so its gradients are ~1e-9, below fp16's smallest subnormal (2^-24 = 6e-8).",
        "",
        "## What the profile recommends",
        "",
        gradient_summary(result.profile.rows, advice, markdown=True),
        "",
        "## What the train-mode search chose",
        "",
        f"Budget {BUDGET} accuracy after {K} training steps, noise floor {measured['noise_floor']:.4g} "
        f"(fp32 accuracy over seeds: {', '.join(f'{v:.4g}' for v in measured['noise']['fp32_metrics_by_seed'])}). "
        f"Searched initial scales: 2^{measured['loss_scale_search']['init_scale_log2'][0]} .. "
        f"2^{measured['loss_scale_search']['init_scale_log2'][1]} (the space file allowed 2^0 .. 2^32).",
        "",
        f"Chosen: {measured['chosen']}, layers {json.dumps(result.policy.to_dict()['layers'])}, loss scale "
        f"{json.dumps(result.policy.loss_scale.to_dict())} ({'used' if result.policy.uses_fp16 else 'GradScaler off: no fp16 layer'}); "
        f"skipped steps while timed {measured['results']['policy']['skipped_steps']} of {measured['results']['policy']['steps']}, "
        f"while training {measured['results']['policy'].get('train_skipped_steps')} of {K}.",
    ]
    finals = result.finals.to_frame()[["candidate", "metric_drop", "skipped", "steps", "train_skipped", "speedup", "feasible"]]
    lines += [
        "",
        "The finalists, re-measured (speedup: measured on this noisy shared 2-core CPU, where fp16 matmuls "
        "run slower than fp32 ones, so a policy without fp16 usually wins here):",
        "",
        markdown_table(list(finals.columns), finals.values.tolist()),
    ]
    if best is not None:
        lines += [
            "",
            f"The fastest feasible trial with fp16 layers (trial {int(best['trial'])}): "
            + ", ".join(f"{n} {best[n]}" for n in FP16)
            + f"; init scale 2^{round(math.log2(best['init_scale']))}, growth interval "
            f"{int(best['growth_interval'])}, growth x{best['growth_factor']:g}, backoff x{best['backoff_factor']:g}, "
            f"{'dynamic' if best['dynamic'] else 'static'}; accuracy drop {best['metric_drop']:.4g}; skipped "
            f"{int(best['train_skipped'])} of {K} training steps and {int(best['skipped'])} of {int(best['steps'])} timed steps.",
        ]
    lines += [
        "",
        "## Sweep: every Linear in fp16, initial scale 2^k, growth interval 10",
        "",
        f"fp32 after {K} steps: accuracy {fp32:.4g}; noise floor "
        f"{noise.spread:.4g}. throughput_lost: the fraction of the timed steps the GradScaler skipped (each "
        "policy takes the same 11 timed steps). The search's step times and speedups (underflow_mlp/) were "
        "measured on this noisy shared 2-core CPU: read them as such.",
        "",
        markdown_table(list(table.columns), table.values.tolist()),
    ]
    (HERE / "summary.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
