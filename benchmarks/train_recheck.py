"""Re-check the train-mode searches committed here with a plain training loop, outside the search.

    python benchmarks/train_recheck.py [--out DIR]  (default: results/cpu-xeon-2core/train)

For each train-mode policy.json (digits/ and tinylm/ here, ../loss-scale/underflow_mlp/): K training steps (K = measured.train_steps) from the
model's own build_model() weights, the train batches in their given order, the task's optimizer (or
AdamW), written as a user would write it with apply_policy(model, policy) and grad_scaler(policy); and
the same K steps in fp32. The drop between the two evaluations must stay within the budget plus the
noise floor the search reported. Where the chosen policy has no fp16 layer, the fastest feasible fp16
trial (with its GradScaler settings) is re-checked too. Reads the committed train-mode policies; writes recheck.md to --out (by default beside them).
"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import torch
from common import out_folder  # noqa: E402 (beside this script)

from autoprec import LossScale, Policy, apply_policy, grad_scaler, load_policy
from autoprec.tune import load_task
from autoprec.tune._core._records import Measured
from autoprec.tune._core._tables import markdown_table

ROOT = Path(__file__).resolve().parents[1]
HERE = ROOT / "results/cpu-xeon-2core/train"  # where the files are written (and, for a re-check, read): --out
# model -> (model.py, the folder with its train-mode policy.json)
MODELS = {
    "digits": (ROOT / "examples/digits/model.py", HERE / "digits"),
    "tinylm": (ROOT / "examples/tinylm/model.py", HERE / "tinylm"),
    # fp16 layers with a GradScaler: the underflow model's train-mode search (../loss-scale/run.py)
    "underflow_mlp": (ROOT / "tests/models/underflow_mlp.py", HERE.parent / "loss-scale" / "underflow_mlp"),
}


def evaluate(task, model) -> float:
    model.eval()
    with torch.no_grad():
        if task.evaluate is not None:
            return float(task.evaluate(model))
        losses = [float(task.loss_fn(model, batch)) for batch in task.batches("eval")]
        return -sum(losses) / len(losses)


def train(task, policy: Policy, steps: int) -> tuple[float, int]:
    """The README's training loop; returns the metric and the steps the GradScaler skipped."""
    torch.manual_seed(0)
    model = apply_policy(task.build_model(), policy)
    optimizer = task.optimizer(model) if task.optimizer else torch.optim.AdamW(model.parameters())
    scaler = grad_scaler(policy, "cpu")
    batches = list(task.batches("train"))
    skipped = 0
    model.train()
    for i in range(steps):
        optimizer.zero_grad(set_to_none=True)
        loss = task.loss_fn(model, batches[i % len(batches)])
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        before = scaler.get_scale() if scaler.is_enabled() else None
        scaler.update()
        skipped += before is not None and scaler.get_scale() < before
    return evaluate(task, model), skipped


def fastest_fp16_trial(folder: Path, layers: list[str]) -> tuple[str, Policy, float] | None:
    """The fastest feasible trial that has an fp16 layer, as a policy with its GradScaler settings."""
    trials = pd.read_csv(folder / "trials.csv")
    fp16 = trials[trials["feasible"].eq(True) & trials[layers].eq("fp16").any(axis=1)]
    if fp16.empty:
        return None
    row = fp16.sort_values("speedup", ascending=False).iloc[0]
    ls = LossScale(init_scale=float(row["init_scale"]), growth_interval=int(row["growth_interval"]),
                   growth_factor=float(row["growth_factor"]), backoff_factor=float(row["backoff_factor"]),
                   dynamic=bool(row["dynamic"]))  # fmt: skip
    policy = Policy(layers={"": row["(default)"], **{n: row[n] for n in layers}}, loss_scale=ls)
    return f"trial {int(row['trial'])}", policy, float(row["metric_drop"])


def candidates(folder: Path, policy: Policy) -> list[tuple[str, Policy, float]]:
    """The chosen policy and, where it has no fp16 layer, the fastest fp16 trial (to re-check a GradScaler)."""
    m = Measured.of(policy)
    out = [(str(m.chosen), policy, m.results["policy"].metric_drop)]
    if not policy.uses_fp16:
        extra = fastest_fp16_trial(folder, [n for n in policy.layers if n])
        out += [extra] if extra else []
    return out


def main() -> None:
    global HERE
    HERE = out_folder(__doc__, HERE, ROOT)
    rows = []
    for name, (path, folder) in MODELS.items():
        policy_path = folder / "policy.json"
        if not policy_path.is_file():
            continue
        m = Measured.of(load_policy(policy_path))
        if m.mode != "train" or m.train_steps is None or m.budget is None or m.noise_floor is None:
            raise SystemExit(f"{policy_path}: not a train-mode search's policy (no train steps, budget and noise floor)")
        task, k = load_task(path), m.train_steps
        fp32, _ = train(task, Policy(), k)
        allowed = m.budget + m.noise_floor
        for label, policy, searched_drop in candidates(folder, load_policy(policy_path)):
            lowered, skipped = train(task, policy, k)
            drop = fp32 - lowered
            kind = "fp16 + GradScaler" if policy.uses_fp16 else "no fp16"
            rows.append([name, k, f"{label} ({kind})", m.budget, m.noise_floor, searched_drop,
                         fp32, lowered, drop, skipped, "yes" if drop <= allowed else "NO"])  # fmt: skip
            print(json.dumps(rows[-1]))
    headers = ["model", "K", "policy", "budget", "noise floor", "search's drop", "fp32 re-check", "policy re-check",
               "re-check drop", "skipped", "within budget + noise"]  # fmt: skip
    text = (
        "# Train-mode results re-checked outside the search (CPU)\n\n"
        "`python benchmarks/train_recheck.py [--out DIR]  (default: results/cpu-xeon-2core/train)`: K steps from build_model()'s weights with "
        "apply_policy + grad_scaler(policy), batches in their given order, against K fp32 steps.\n\n"
        + markdown_table(headers, rows)
        + "\n"
    )
    (HERE / "recheck.md").write_text(text, encoding="utf-8")
    print(text)


if __name__ == "__main__":
    main()
