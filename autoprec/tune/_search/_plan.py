"""The pipeline's records (_pipeline.py): what differs between a search and a sweep (`Plan`), a study ready for
trials (`Started`), and what a run measured (`Run`). Data only, below the stages that read them (_provenance.py,
_finalists.py) and the pipeline that makes them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import optuna

from autoprec.tune._core._budget import Budget, Budgets
from autoprec.tune._core._config import SearchConfig
from autoprec.tune._core._names import GREEDY
from autoprec.tune._core._records import Candidate, Chosen, Finals
from autoprec.tune._measure._choices import Choices
from autoprec.tune._measure._coverage import Coverage
from autoprec.tune._measure._profile_data import Profile
from autoprec.tune._report._results import SavedProfile
from autoprec.tune._search._objective import Judge

if TYPE_CHECKING:
    import pandas as pd


@dataclasses.dataclass(frozen=True)
class Plan:
    """What differs between a search and a sweep. `objectives`: 1 (the goal's value, SearchConfig.objective) or 2
    (that and the metric drop, a Pareto front); `budgets`: a sweep's, as the user gave them (a search's one budget is
    its SearchConfig.budget: each run has its budgets in one place, `given_budgets`); the files written: one policy per
    budget, the trials table, the re-measured finalists."""

    objectives: int
    policy_file: Callable[[float], str]
    trials_file: str
    finalists_file: str
    budgets: tuple[Budget, ...] = ()
    # a subfolder for a profile of its own where the output folder's does not serve (a sweep: never over a search's)
    profile_folder: str | None = None

    def __post_init__(self) -> None:
        if self.is_sweep and not self.budgets:
            raise ValueError("a sweep's plan needs its budgets, at least one, such as (Budget(0.0), Budget(0.01))")
        if self.budgets and not self.is_sweep:
            raise ValueError(f"a search's budget is its SearchConfig.budget, not the plan's, but got {self.budgets!r}")

    @property
    def is_sweep(self) -> bool:
        return self.objectives == 2

    def given_budgets(self, config: SearchConfig) -> tuple[Budget, ...]:
        """The budgets as the user gave them, from their one place: a sweep's plan, a search's config.budget. A
        ValueError naming the value and the fix where the other place holds one too, or neither holds any."""
        shown, got = ",".join(map(str, self.budgets)), config.budget
        if self.is_sweep and got is not None:
            raise ValueError(
                f"a sweep's budgets are its own list ({shown}), so config.budget={str(got)!r} would be a second "
                "one: leave it out (SearchConfig(budget=None), the default), and list every budget in budgets="
            )
        if self.is_sweep:
            return self.budgets
        if config.budget is None:
            raise ValueError("a search needs config.budget, e.g. SearchConfig(budget=0.01) or SearchConfig(budget='1%')")
        return (config.budget if isinstance(config.budget, Budget) else Budget(config.budget),)

    def greedy_name(self, budget: float, budgets: Budgets) -> str:
        """Each budget has its own profile-greedy policy; with one budget it keeps the plain name."""
        return GREEDY if len(budgets.absolute) == 1 else f"{GREEDY} {budget:g}"


@dataclasses.dataclass
class Started:
    """A study ready for trials: the profile (and where it is saved), the agreed choices, the study, where it lives,
    the judge (holding the resolved budgets, `budgets`)."""

    profile: Profile
    choices: Choices
    study: optuna.Study
    storage: str
    judge: Judge
    saved: SavedProfile  # where the profile is saved, and whether this run measured it
    config: SearchConfig  # the search's settings, its goal bound to the space and the profile (Goal.bound): once
    coverage: Coverage | None = None  # the tuned layers' share of the step's matmuls (None: it could not be counted)

    @property
    def budgets(self) -> Budgets:
        return self.judge.budgets


@dataclasses.dataclass
class Run:
    """What the pipeline measured: the study's start, every re-measured candidate (`finals`), each budget's
    choice, the trials table, and where the time went."""

    started: Started
    candidates: dict[str, Candidate]
    finals: Finals
    chosen: list[Chosen]
    trials: pd.DataFrame  # trials.csv's rows
    cost: dict[str, Any]
