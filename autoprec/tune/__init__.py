"""autoprec.tune: the tuner that writes policy files. Profile each layer's sensitivity and speed per format on
your device, search per-layer formats and loss-scale settings with Optuna for the fastest training step within
an accuracy budget (`search`), or one study for several budgets (`sweep`).

`search` and `sweep` take a model and its batches (api.py); the steps behind them, which the command line
drives from a model.py, are `load_task`, `prepare`, `profile`, `searcher.search` and `sweeper.sweep`.
A training script does not need this package: `import autoprec` (the runtime) applies what it wrote.
"""

from autoprec.tune.api import search, sweep
from autoprec.tune.budget import Budget, parse_budget
from autoprec.tune.config import Mode, ProfileConfig, SearchConfig
from autoprec.tune.profile_data import Profile, ProfileRow
from autoprec.tune.profiler import profile
from autoprec.tune.searcher import SearchResult
from autoprec.tune.space import Layout, SearchSpace, load_space
from autoprec.tune.sweeper import SweepResult
from autoprec.tune.task import Task, Workload, load_task, prepare

__all__ = [
    "search",
    "sweep",
    "SearchResult",
    "SweepResult",
    "Budget",
    "parse_budget",
    "load_task",
    "prepare",
    "Task",
    "Workload",
    "load_space",
    "SearchSpace",
    "Layout",
    "profile",
    "Profile",
    "ProfileRow",
    "ProfileConfig",
    "SearchConfig",
    "Mode",
]
