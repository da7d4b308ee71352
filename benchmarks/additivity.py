"""How well does the sum of single-layer metric drops predict the drop of a whole policy?

Regenerates the files in --out (by default the committed folder) (CPU, a few minutes; accuracy numbers only, no timings):

    python benchmarks/additivity.py [--out DIR]  (default: results/cpu-xeon-2core/additivity)

For each example: every tunable layer lowered alone to each format it can run (the profile's metric_drop,
measured the same way: autoprec.tune._measure._metric.evaluate_metric), then 40 seeded random policies (each layer a
random runnable format, the model root fp32 so that every lowered op belongs to a profiled layer), their
measured drop against the sum of their layers' single drops. Also the searched studies committed beside
this folder: their trials, root format included (the profile does not cover the root, so it predicts
nothing for it).
"""

from __future__ import annotations

import dataclasses
import math
import random
import sys
from pathlib import Path

import pandas as pd
import torch
from common import out_folder  # noqa: E402 (beside this script)

from autoprec import Policy
from autoprec.formats import Format, format_problem
from autoprec.tune import load_space, load_task, prepare
from autoprec.tune._core._profile_row import ProfileRow, as_float
from autoprec.tune._core._tables import markdown_table
from autoprec.tune._measure._metric import evaluate_metric
from autoprec.tune._measure._profile_data import Profile

ROOT = Path(__file__).resolve().parents[1]
HERE = ROOT / "results/cpu-xeon-2core/additivity"  # where the files are written (and, for a re-check, read): --out
DEVICE_DIR = HERE.parent
N_RANDOM = 40
BUDGETS = {"digits": 0.01, "digits (eval loss)": 0.01, "tinylm": 0.02}


def workloads():
    digits = prepare(load_task(ROOT / "examples/digits/model.py"), "cpu")
    # the same model scored by -(mean eval loss): continuous, where accuracy on 360 images barely moves
    digits_loss = dataclasses.replace(digits, task=dataclasses.replace(digits.task, evaluate=None))
    tinylm = prepare(load_task(ROOT / "examples/tinylm/model.py"), "cpu")
    return {"digits": digits, "digits (eval loss)": digits_loss, "tinylm": tinylm}


def runnable(workload) -> dict[str, list[str]]:
    modules = dict(workload.model.named_modules())
    out = {}
    for name, formats in load_space().tunable_layers(workload.model).items():
        out[name] = [f.value for f in formats if f is Format.FP32 or format_problem(f, modules[name], workload.device) is None]
    return out


def single_drops(workload, layers: dict[str, list[str]], fp32: float) -> dict[tuple[str, str], float]:
    return {
        (name, fmt): fp32 - evaluate_metric(workload, Policy(layers={name: fmt}))
        for name, formats in layers.items() for fmt in formats if fmt != "fp32"
    }  # fmt: skip


def random_policies(layers: dict[str, list[str]], n: int, seed: int = 0) -> list[dict[str, str]]:
    rng = random.Random(seed)
    seen, out = set(), []
    while len(out) < n:
        policy = {name: rng.choice(formats) for name, formats in layers.items()}
        key = tuple(policy.values())
        if key not in seen and any(f != "fp32" for f in key):
            seen.add(key)
            out.append(policy)
    return out


def stats(predicted: pd.Series, measured: pd.Series, budget: float) -> dict[str, object]:
    ok = predicted.notna() & measured.notna()
    p, m = predicted[ok].astype(float), measured[ok].astype(float)
    const = p.nunique() < 2 or m.nunique() < 2
    return {
        "n": int(ok.sum()),
        "pearson_r": math.nan if const else p.corr(m),
        "spearman_rho": math.nan if const else p.corr(m, method="spearman"),
        "mean_abs_error": (m - p).abs().mean(),
        "max_abs_error": (m - p).abs().max(),
        "mean_measured_minus_predicted": (m - p).mean(),
        "budget": budget,
        "predicted_within_measured_over": int(((p <= budget) & (m > budget)).sum()),
        "predicted_over_measured_within": int(((p > budget) & (m <= budget)).sum()),
    }


def committed_profile(folder: Path) -> Profile | None:
    """The profile table a committed run wrote (its drops only: no fp32 metric, device or fingerprint). Read as a table,
    not with Profile.load, which reads the current profile format only; these records of past runs keep theirs."""
    path = folder / "profile.csv"
    if not path.is_file():
        return None
    table = pd.read_csv(path, dtype={"layer": str, "type": str, "shape": str, "format": str, "status": str})
    rows = [  # the columns every profile format had: what predicted_drop reads
        ProfileRow(
            layer=r["layer"],
            type=r["type"],
            shape=r["shape"],
            format=r["format"],
            status=r["status"],
            metric_drop=as_float(r["metric_drop"]),
        )
        for r in table.to_dict("records")
    ]
    return Profile(rows=rows, fp32_metric=math.nan, metric_name="", device="", fingerprint="")


def searched_trials(model: str, prof: Profile, folder: str) -> pd.DataFrame | None:
    """(predicted, measured) for a committed study's trials; predicted from its own profile."""
    path = DEVICE_DIR / folder / "trials.csv"
    if not path.is_file():
        return None
    trials = pd.read_csv(path)
    trials = trials[trials["state"] == "COMPLETE"]
    layers = prof.layers()
    trials = trials.assign(predicted_drop=[prof.predicted_drop({n: r[n] for n in layers}) for _, r in trials.iterrows()])
    return trials


def main() -> None:
    global HERE
    HERE = out_folder(__doc__, HERE, ROOT)
    torch.manual_seed(0)
    rows = []
    for model, workload in workloads().items():
        print(f"{model}: single layers and {N_RANDOM} random policies", file=sys.stderr)
        fp32 = evaluate_metric(workload, Policy())
        layers = runnable(workload)
        singles = single_drops(workload, layers, fp32)
        table = []
        for i, policy in enumerate(random_policies(layers, N_RANDOM)):
            predicted = sum(singles[(n, f)] for n, f in policy.items() if f != "fp32")
            measured = fp32 - evaluate_metric(workload, Policy(layers=policy))
            table.append({"policy": i, **policy, "predicted_drop": predicted, "measured_drop": measured})
        table = pd.DataFrame(table)
        slug = model.replace(" (eval loss)", "_eval_loss")
        table.to_csv(HERE / f"random_{slug}.csv", index=False)
        pd.DataFrame([{"layer": n, "format": f, "metric_drop": d} for (n, f), d in singles.items()]).to_csv(
            HERE / f"single_{slug}.csv", index=False
        )
        rows.append(
            {
                "model": model,
                "policies": "random, root fp32",
                **stats(table["predicted_drop"], table["measured_drop"], BUDGETS[model]),
            }
        )
    for model, folder, mode in (("digits", "digits", "weights"), ("tinylm", "tinylm", "weights"),
                                ("digits", "train/digits", "train"), ("tinylm", "train/tinylm", "train")):  # fmt: skip
        prof = committed_profile(DEVICE_DIR / folder)
        if prof is None:
            continue
        trials = searched_trials(model, prof, folder)
        if trials is None:
            continue
        trials.to_csv(HERE / f"searched_{folder.replace('/', '_')}.csv", index=False)
        rows.append({"model": model, "policies": f"searched trials ({mode} mode, {folder}/)",
                     **stats(trials["predicted_drop"], trials["metric_drop"], BUDGETS[model])})  # fmt: skip
    out = pd.DataFrame(rows)
    out.to_csv(HERE / "additivity.csv", index=False)
    text = (
        "# Does the sum of single-layer drops predict a policy's drop? (CPU)\n\n"
        "`python benchmarks/additivity.py [--out DIR]  (default: results/cpu-xeon-2core/additivity)`; see this script's docstring for the method. "
        "predicted: the sum of the policy's layers' single-layer metric drops (weights mode, from the "
        "profile); measured: the policy's own drop (weights mode, or after K training steps for the train-mode "
        "studies). The last two columns count policies on the wrong side of the budget.\n\n"
        + markdown_table(list(out.columns), out.values.tolist())
        + "\n"
    )
    (HERE / "summary.md").write_text(text, encoding="utf-8")
    print(text)


if __name__ == "__main__":
    main()
