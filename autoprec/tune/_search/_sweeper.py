"""Sweep: one two-objective study (training-step speedup up, metric drop down) and every budget's policy
read off its Pareto front.

The budgets are the sweep's own list (its Plan's; SearchConfig.budget stays None), resolved once by the pipeline;
the study's constraint is the largest (`Budgets.bound`): a trial over it is not timed, as in a search. For each budget the fastest trials within it become finalists; all of them, with fp32, uniform
bf16 and the profile-greedy policy of each budget, are re-measured together, interleaved, and each budget
takes what a search of it would (choose.choose_per_budget, the search's own rule: the fastest re-measured candidate
within it, the safer one where the lead is inside the spread); the table says where that is a tie inside the noise,
from the tie list its policy file records. A larger budget may choose anything a smaller one could, so its speedup
is never measurably lower: where its pick measured slower than a smaller budget's choice beyond the noise, that
choice stands and the table says so.

The profile a search saved in the same folder is reused where it serves the sweep (out_dir.reuse_or_profile); else
the sweep measures its own into SWEEP_PROFILE there, never over the search's files.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from pathlib import Path

import pandas as pd

from autoprec.errors import UserError
from autoprec.files import write_atomically
from autoprec.formats import Format
from autoprec.policy import ROOT, Policy
from autoprec.tune._core._budget import Budget, Budgets, parse_budget_list
from autoprec.tune._core._config import SearchConfig
from autoprec.tune._core._goal import Goal
from autoprec.tune._core._names import BF16
from autoprec.tune._core._records import Chosen, Finals, Measured
from autoprec.tune._core._space import SearchSpace
from autoprec.tune._decide._goals import SPEED
from autoprec.tune._measure._task import Workload
from autoprec.tune._report._results import BudgetRow, SweepResult
from autoprec.tune._search._out_dir import SWEEP_PROFILE
from autoprec.tune._search._pipeline import run
from autoprec.tune._search._plan import Plan

OBJECTIVES = 2  # the goal's value (the speedup, maximised; the peak memory, minimised), metric drop (minimise)


def policy_filename(budget: float) -> str:
    return f"policy-budget-{budget:g}.json"


def pareto_front(trials: pd.DataFrame, goal: Goal = SPEED) -> pd.DataFrame:
    """The timed (feasible) trials no other timed trial beats in both the goal's column (Goal.axis: the speedup, the
    peak memory) and metric drop, by drop; none for a goal without one."""
    column = goal.axis.column if goal.axis is not None else None
    if column is None or "feasible" not in trials or column not in trials:
        return trials.iloc[0:0]
    timed = trials[trials["feasible"].eq(True)].dropna(subset=[column, "metric_drop"])
    # by drop (then the best value first): a trial is on the front when no trial of a smaller drop, or of the
    # same drop, is better; equal trials all stay (one sort, one pass). A minimised value (memory): negated.
    sign = -1.0 if goal.direction == "minimize" else 1.0
    ordered = timed.assign(_value=sign * timed[column].astype(float))
    ordered = ordered.sort_values(["metric_drop", "_value"], ascending=[True, False], kind="stable")
    keep, best, best_drop = [], -math.inf, math.nan
    for i, drop, value in zip(ordered.index, ordered["metric_drop"], ordered["_value"]):
        if value > best or (value == best and drop == best_drop):
            keep.append(i)
            best, best_drop = value, drop
    front = ordered.loc[keep].sort_values(["metric_drop", "_value"], ascending=[True, True], kind="stable")
    return front.drop(columns="_value")


def _format_counts(policy: Policy) -> str:
    """`bf16 100, fp32 9` over the listed layers (the model root not counted)."""
    counts: dict[str, int] = {}
    for name, fmt in policy.layers.items():
        if name != ROOT:
            counts[fmt.value] = counts.get(fmt.value, 0) + 1
    return ", ".join(f"{f} {counts[f]}" for f in (x.value for x in Format) if f in counts)


def sweep_plan(budgets: str | float | Sequence[float | str | Budget]) -> Plan:
    """A sweep's plan, holding its budgets as the user gave them: "0,0.5%,1%" (commas), a number, or a sequence of
    numbers, strings and Budgets (budget.parse_budget_list)."""
    return Plan(
        objectives=OBJECTIVES,
        policy_file=policy_filename,
        trials_file="sweep_trials.csv",
        finalists_file="sweep_finalists.csv",
        budgets=parse_budget_list([budgets] if isinstance(budgets, (int, float)) else budgets),
        profile_folder=SWEEP_PROFILE,
    )


def sweep(
    workload: Workload,
    space: SearchSpace,
    budgets: str | float | Sequence[float | str | Budget],
    config: SearchConfig,
    out_dir: str | Path,
    *,
    announce: Callable[[Budgets], None] | None = None,
) -> SweepResult:
    """Search once for every budget; write sweep.csv, one policy file per budget, sweep_trials.csv and
    sweep_finalists.csv to out_dir (the CLI adds sweep.md and pareto.png from the result), and a profile only where
    none there serves (into SWEEP_PROFILE where out_dir holds one). `budgets` as sweep_plan takes them, relative ones
    resolved against the fp32 metric the profile measures; `config.budget` must be None (the budgets are this list
    alone). `announce`: pipeline.run's, told the resolved budgets."""
    if config.objective.axis is None:  # the front, sweep.csv's columns and pareto.png are drawn on the goal's axis
        raise UserError(
            f"autoprec sweep does not take --objective {config.objective.name}: a sweep draws every budget's choice on "
            f"its goal's axis, and {config.objective.name} has none yet; run `autoprec search --objective "
            f"{config.objective.name} --budget B` for each budget instead"
        )
    done = run(workload, space, config, out_dir, sweep_plan(budgets), announce=announce)
    started = done.started
    table = [_row(c, done.finals) for c in done.chosen]
    frame = pd.DataFrame([dataclasses.asdict(r) for r in table])
    write_atomically(Path(out_dir) / "sweep.csv", lambda tmp: frame.to_csv(tmp, index=False))
    return SweepResult(
        table=table,
        policies={c.budget: c.policy for c in done.chosen},
        front=pareto_front(done.trials, config.objective),
        trials=done.trials,
        finals=done.finals,
        profile=started.profile,
        choices=started.choices,
        study_name=started.study.study_name,
        storage=started.storage,
        noise=started.judge.noise,
        cost=done.cost,
        saved=started.saved,
    )


def _row(chosen: Chosen, finals: Finals) -> BudgetRow:
    r, bf16, greedy, policy = finals.by_name(chosen.name), finals.by_name(BF16), finals.by_name(chosen.greedy), chosen.policy
    return BudgetRow(
        budget=chosen.budget,
        budget_given=Measured.of(policy).budget_given,
        chosen=chosen.name,
        metric=r.metric,
        metric_drop=r.metric_drop,
        step_ms=r.effective_step_ms,
        spread=r.spread,
        speedup=r.speedup,
        uniform_bf16_speedup=bf16.speedup,
        uniform_bf16_drop=bf16.metric_drop,
        greedy_speedup=greedy.speedup,
        greedy_drop=greedy.metric_drop,
        peak_bytes=r.peak_bytes,
        memory_saving=r.memory_saving,
        formats=_format_counts(policy),
        root=policy.layers.get(ROOT, Format.FP32).value,
        policy_file=chosen.file.name,
        why=chosen.why,
        not_separated="; ".join(Measured.of(policy).not_separated),
    )
