"""One (policy, seed) training run from the trained weights, the metric along it, and its csv: what both horizon parts
train and read back.
"""

from __future__ import annotations

import csv
import math
import time
from pathlib import Path

import torch

from .common import write_csv


def run_path(folder: Path, policy: str, seed: int) -> Path:
    return folder / f"{policy}-seed{seed}.csv"


def finished(path: Path, steps: int) -> bool:
    """A run is finished when its csv exists and reached `steps` (written whole, by rename, when it ended)."""
    if not path.exists():
        return False
    with open(path) as f:
        rows = list(csv.DictReader(f))
    return bool(rows) and int(rows[-1]["step"]) >= steps


def train_curve(workload, policy, steps: int, every: int, seed: int, order=None, at=None) -> list[dict]:
    """Train a fresh copy of the reference weights `steps` steps with `policy` as train mode does
    (autoprec.tune._measure._metric.train_and_evaluate: the same Trainer, batch order and seed), taking the metric every `every`
    steps (and at step 0). The model has no dropout and evaluating draws nothing from the RNG, so the metric at step K
    is train_and_evaluate(workload, policy, K, seed=seed)'s. `order` replaces train mode's batch order (horizon2: each
    batch once, in turn); `at`, the steps the metric is taken at, replaces `every`. The Trainer is given the run's
    length (total_steps), so a policy with phases switches in place at its steps (autoprec.follow_schedule); for such a
    policy each row also says the phase the model was in when the metric was taken (`phase`) and the last row the
    step the last switch took effect at (`switched_at`: the first step trained in the last phase)."""
    from autoprec import devices
    from autoprec.apply import applied_summary
    from autoprec.tune._measure._metric import batch_order, metric_of
    from autoprec.tune._measure._trainer import Trainer, matmul_precision

    rows = []
    start = time.perf_counter()
    with devices.lookup(workload.device).fork_rng(workload.device):
        torch.manual_seed(seed)
        order = batch_order(len(workload.train), steps, seed) if order is None else order
        trainer = Trainer(workload, policy, order=order, total_steps=steps)
        phased = bool(getattr(trainer.policy, "phases", ()))
        switched_at = None
        take = set(at) if at is not None else {s for s in range(steps + 1) if s % every == 0 or s == steps}
        for step in range(steps + 1):
            if step in take:
                finite = trainer.finite
                with matmul_precision(workload.device, trainer.tf32):
                    metric = metric_of(workload, trainer.model) if finite else math.nan
                rows.append(
                    {"step": step, "metric": metric, "finite": finite, "skipped": trainer.skipped,
                     "wall_s": round(time.perf_counter() - start, 2)}
                )  # fmt: skip
                if phased:
                    rows[-1]["phase"] = applied_summary(trainer.model).phase
            if step < steps:
                before = applied_summary(trainer.model).phase if phased else 0
                trainer.step()
                if phased and applied_summary(trainer.model).phase != before:
                    switched_at = step
        if phased:
            rows[-1]["switched_at"] = switched_at
    return rows


def write_run(path: Path, rows: list[dict]) -> None:
    tmp = path.with_suffix(".tmp")
    write_csv(tmp, rows)
    tmp.replace(path)


def read_run(path: Path) -> dict[int, float]:
    with open(path) as f:
        return {int(r["step"]): float(r["metric"]) for r in csv.DictReader(f)}


def load_curves(policies, folder: Path, seeds: int, steps: int) -> dict[str, dict[int, dict[int, float]]]:
    """{policy: {seed: {step: metric}}} for the finished runs."""
    curves: dict[str, dict[int, dict[int, float]]] = {}
    for name in policies:
        for seed in range(seeds):
            path = run_path(folder, name, seed)
            if finished(path, steps):
                curves.setdefault(name, {})[seed] = read_run(path)
    return curves


def noise_floor_at(curves, step: int) -> float:
    """The spread (max - min) of bf16's metric at `step` over its seeds: what a drop must exceed to be told from the
    batch order alone (train mode's noise floor, taken against bf16 here and without the repeat of seed 0, which on
    this CPU reproduces seed 0 bit for bit)."""
    values = [run[step] for run in curves.get("bf16", {}).values() if step in run]
    return max(values) - min(values) if len(values) > 1 else math.nan


COLORS = {"nvfp4-all": "#d95f02", "rule-a": "#1b9e77", "rule-b": "#7570b3", "rule-c": "#e7298a", "rule-d": "#66a61e"}
