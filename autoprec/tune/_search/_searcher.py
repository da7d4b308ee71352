"""Search: the pipeline (_pipeline.py) with one budget and one objective, the training-step speedup (or, with
`--objective memory`, the peak memory); writes policy.json, trials.csv and finalists.csv."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pandas as pd

from autoprec.policy import Policy
from autoprec.tune._core._budget import Budgets
from autoprec.tune._core._config import Mode, SearchConfig, parse_mode
from autoprec.tune._core._records import Finals
from autoprec.tune._core._space import SearchSpace
from autoprec.tune._measure._choices import Choices
from autoprec.tune._measure._metric import NoiseFloor
from autoprec.tune._measure._profile_data import Profile
from autoprec.tune._measure._task import Workload
from autoprec.tune._search._pipeline import Plan, run

__all__ = ["Mode", "SearchConfig", "SearchResult", "parse_mode", "search", "search_plan"]


@dataclasses.dataclass
class SearchResult:
    policy: Policy
    profile: Profile
    choices: Choices
    trials: pd.DataFrame
    finals: Finals  # every re-measured candidate: the alternatives and the finalists (finals.to_frame(): a DataFrame)
    study_name: str
    storage: str
    noise: NoiseFloor | None = None  # train mode: the fp32 result's spread over seeds
    cost: dict[str, Any] | None = None  # cost.Stopwatch.to_dict(): where this search's time went

    def summary(self, *, markdown: bool = False) -> str:
        """The table the command line prints: each layer's format, then every re-measured candidate."""
        from autoprec.tune._report._report import search_summary

        return search_summary(self, markdown=markdown)


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
