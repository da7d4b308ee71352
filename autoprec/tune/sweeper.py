"""Sweep: one two-objective study (training-step speedup up, metric drop down) and every budget's policy
read off its Pareto front.

The study's constraint is the largest budget (`config.budget`): a trial over it is not timed, as in a
search. For each budget the fastest trials within it become finalists; all of them, with fp32, uniform
bf16 and the profile-greedy policy of each budget, are re-measured together, interleaved, and each budget
takes the fastest re-measured candidate within it (the safer one where the lead is inside the spread).
A larger budget may choose anything a smaller one could, so its speedup is never lower: where noise
would say otherwise, the smaller budget's choice stands and the table says so.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import optuna
import pandas as pd

from autoprec.tune.choices import Choices
from autoprec.tune.cost import Stopwatch
from autoprec.files import write_atomically
from autoprec.formats import Format
from autoprec.tune.measure import NoiseFloor
from autoprec.policy import ROOT, Policy
from autoprec.tune.profiler import Profile
from autoprec.tune.alternatives import BF16, GREEDY
from autoprec.tune.measure import Candidate
from autoprec.tune.searcher import (
    ALTERNATIVES,
    Started,
    baselines,
    check_out_dir,
    choose,
    final_remeasure,
    finalist_policies,
    measured_record,
    start,
)
from autoprec.tune.space import SearchSpace
from autoprec.tune.study import Objective, SearchConfig, check_storage, run_trials, trial_costs, trials_table
from autoprec.tune.task import Workload

OBJECTIVES = 2  # speedup (maximise), metric drop (minimise)


@dataclasses.dataclass
class SweepResult:
    """`table`: one row per budget (sweep.csv); `policies`: budget -> its policy; `front`: the study's
    Pareto-optimal trials; `finals`: every re-measured candidate."""

    table: pd.DataFrame
    policies: dict[float, Policy]
    front: pd.DataFrame
    trials: pd.DataFrame
    finals: pd.DataFrame
    profile: Profile
    choices: Choices
    study_name: str
    storage: str
    noise: NoiseFloor | None = None
    cost: dict[str, Any] | None = None


def parse_budgets(value: str | Iterable[float]) -> tuple[float, ...]:
    """Budgets from "0,0.002,0.01" or numbers: finite, >= 0, sorted, duplicates dropped."""
    items = [v.strip() for v in value.split(",") if v.strip()] if isinstance(value, str) else list(value)
    budgets = []
    for item in items:
        try:
            b = float(item)
        except (TypeError, ValueError):
            raise ValueError(f"budgets must be numbers separated by commas, but got {item!r} in {value!r}") from None
        if not math.isfinite(b) or b < 0:
            raise ValueError(f"every budget must be a finite number >= 0 (the largest allowed metric drop), but got {item!r}")
        budgets.append(b)
    if not budgets:
        raise ValueError(f"budgets must list at least one number, such as 0,0.005,0.01, but got {value!r}")
    return tuple(sorted(set(budgets)))


def policy_filename(budget: float) -> str:
    return f"policy-budget-{budget:g}.json"


def pareto_front(trials: pd.DataFrame) -> pd.DataFrame:
    """The timed (feasible) trials no other timed trial beats in both speedup and metric drop, by drop."""
    if "feasible" not in trials:
        return trials.iloc[0:0]
    timed = trials[trials["feasible"].eq(True)].dropna(subset=["speedup", "metric_drop"])
    keep = []
    for i, row in timed.iterrows():
        dominated = (
            (timed["speedup"] >= row["speedup"]) & (timed["metric_drop"] <= row["metric_drop"])
            & ((timed["speedup"] > row["speedup"]) | (timed["metric_drop"] < row["metric_drop"]))
        )  # fmt: skip
        if not dominated.any():
            keep.append(i)
    return timed.loc[keep].sort_values(["metric_drop", "speedup"])


def _format_counts(policy: Policy) -> str:
    """`bf16 100, fp32 9` over the listed layers (the model root not counted)."""
    counts: dict[str, int] = {}
    for name, fmt in policy.layers.items():
        if name != ROOT:
            counts[fmt.value] = counts.get(fmt.value, 0) + 1
    return ", ".join(f"{f} {counts[f]}" for f in (x.value for x in Format) if f in counts)


def _candidates(
    workload: Workload, space: SearchSpace, started: Started, study: optuna.Study, budgets: tuple[float, ...], k: int
) -> tuple[dict[str, Candidate], dict[float, str], dict[str, str]]:
    """The alternatives (each budget with its own profile-greedy policy) and each budget's k fastest trials
    within it, without repeats; budget -> the name of its greedy policy; the alternatives not measured."""
    candidates: dict[str, Candidate] = {}

    def add(name: str, candidate: Candidate) -> str:
        same = next((n for n, c in candidates.items() if c == candidate), None)
        if same is None:
            candidates[name] = candidate
        return same or name

    greedy, notes = {}, {}
    for b in budgets:
        alts = baselines(workload, space, started.profile, started.choices, b)
        notes.update(alts.notes)
        for name, candidate in alts.candidates.items():
            label = add(f"{name} {b:g}" if name == GREEDY else name, candidate)
            if name == GREEDY:
                greedy[b] = label
    for b in budgets:
        for name, policy in finalist_policies(study, started.choices, k, budget=b, exclude=list(candidates.values())).items():
            add(name, policy)
    return candidates, greedy, notes


def choose_per_budget(
    finals: pd.DataFrame, candidates: Mapping[str, Candidate], budgets: tuple[float, ...], greedy: Mapping[float, str]
) -> list[tuple[str, str]]:
    """(candidate, why) per budget, ascending: search.choose among the re-measured candidates within it; where
    that measured slower than the previous budget's choice (noise, or the safer pick), the previous stands."""
    speed = dict(zip(finals["candidate"], finals["speedup"]))
    picks: list[tuple[str, str]] = []
    for b in budgets:
        alternatives = [a for a in ALTERNATIVES if a != GREEDY] + [greedy[b]]
        name, why = choose(finals.assign(feasible=finals["runs"] & (finals["metric_drop"] <= b)), candidates, alternatives)
        if picks and speed[name] < speed[picks[-1][0]]:
            before = picks[-1][0]
            name, why = before, f"kept from the smaller budget: {before} measured faster than {name}, this budget's pick"
        picks.append((name, why))
    return picks


def sweep(
    workload: Workload, space: SearchSpace, budgets: Iterable[float] | str, config: SearchConfig, out_dir: str | Path
) -> SweepResult:
    """Search once for every budget; write sweep.csv, one policy file per budget, sweep_trials.csv and
    sweep_finalists.csv to out_dir (the CLI adds sweep.md and pareto.png from the result). `config.budget`
    bounds the study and must be at least the largest budget (the CLI sets it to that)."""
    budgets = parse_budgets(budgets)
    if budgets[-1] > config.budget:
        raise ValueError(
            f"config.budget bounds the sweep's study and must be >= the largest budget, but got "
            f"config.budget={config.budget!r} and budgets up to {budgets[-1]!r}"
        )
    out_dir = Path(out_dir)
    check_out_dir(workload, out_dir)
    check_storage(config)
    out_dir.mkdir(parents=True, exist_ok=True)
    watch = Stopwatch()
    started = start(workload, space, config, out_dir, watch, objectives=OBJECTIVES)
    study, choices = started.study, started.choices
    objective = Objective(workload, choices, space, started.judge, config, objectives=OBJECTIVES)
    run_trials(study, objective, config.trials or space.trials, progress=config.progress)
    trial_costs(study, watch)
    candidates, greedy, notes = _candidates(workload, space, started, study, budgets, config.finalists)
    finals = final_remeasure(workload, candidates, started.judge, config, watch)
    rows, policies = [], {}
    for b, (name, why) in zip(budgets, choose_per_budget(finals, candidates, budgets, greedy)):
        compared = {a: a for a in ALTERNATIVES if a != GREEDY and a in candidates} | {GREEDY: greedy[b]}
        measured = measured_record(workload, started, config, finals, name, b, compared=compared, notes=notes)
        measured.update(why=why, cost=watch.to_dict(), sweep={"budgets": list(budgets), "study_budget": config.budget})
        chosen = candidates[name].policy
        policy = Policy(layers=chosen.layers, loss_scale=chosen.loss_scale, measured=measured)
        policy.save(out_dir / policy_filename(b))
        policies[b] = policy
        rows.append(_row(b, name, why, finals, chosen, greedy[b]))
    table = pd.DataFrame(rows)
    trials = trials_table(study, choices, started.profile)
    front = pareto_front(trials)
    write_atomically(out_dir / "sweep.csv", lambda tmp: table.to_csv(tmp, index=False))
    write_atomically(out_dir / "sweep_trials.csv", lambda tmp: trials.to_csv(tmp, index=False))
    write_atomically(out_dir / "sweep_finalists.csv", lambda tmp: finals.to_csv(tmp, index=False))
    return SweepResult(
        table=table, policies=policies, front=front, trials=trials, finals=finals, profile=started.profile,
        choices=choices, study_name=study.study_name, storage=started.storage, noise=started.judge.noise,
        cost=watch.to_dict(),
    )  # fmt: skip


def _row(budget: float, name: str, why: str, finals: pd.DataFrame, policy: Policy, greedy: str) -> dict[str, Any]:
    by = finals.set_index("candidate")
    r = by.loc[name]
    return {
        "budget": budget,
        "chosen": name,
        "metric": r["metric"],
        "metric_drop": r["metric_drop"],
        "step_ms": r["effective_step_ms"],
        "spread": r["spread"],
        "speedup": r["speedup"],
        "uniform_bf16_speedup": by.loc[BF16, "speedup"],
        "uniform_bf16_drop": by.loc[BF16, "metric_drop"],
        "greedy_speedup": by.loc[greedy, "speedup"],
        "greedy_drop": by.loc[greedy, "metric_drop"],
        "formats": _format_counts(policy),
        "root": policy.layers.get(ROOT, Format.FP32).value,
        "policy_file": policy_filename(budget),
        "why": why,
    }
