"""Search: the pipeline (_pipeline.py) with one budget and one objective, the training-step speedup (or, with
`--objective memory`, the peak memory); writes policy.json, trials.csv and finalists.csv."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from autoprec.tune._core._budget import Budgets
from autoprec.tune._core._config import Mode, SearchConfig, parse_mode
from autoprec.tune._core._space import SearchSpace
from autoprec.tune._measure._task import Workload
from autoprec.tune._report._results import SearchResult
from autoprec.tune._search._pipeline import run
from autoprec.tune._search._plan import Plan

__all__ = ["Mode", "SearchConfig", "SearchResult", "parse_mode", "search", "search_plan"]


def search_plan() -> Plan:
    """A search's plan: its one budget is its SearchConfig.budget."""
    return Plan(objectives=1, policy_file=lambda b: "policy.json", trials_file="trials.csv", finalists_file="finalists.csv")


def search(
    workload: Workload,
    space: SearchSpace,
    config: SearchConfig,
    out_dir: str | Path,
    *,
    announce: Callable[[Budgets], None] | None = None,
) -> SearchResult:
    """Profile, search, re-measure the finalists, and write policy.json, profile.csv, trials.csv to out_dir, within
    `config.budget` (a relative one resolved against the fp32 metric the profile measures, and recorded as given in
    the policy). `announce`: pipeline.run's, told the resolved budget."""
    done = run(workload, space, config, out_dir, search_plan(), announce=announce)
    started = done.started
    return SearchResult(
        policy=done.chosen[0].policy,
        profile=started.profile,
        choices=started.choices,
        trials=done.trials,
        finals=done.finals,
        study_name=started.study.study_name,
        storage=started.storage,
        noise=started.judge.noise,
        cost=done.cost,
    )
