"""autoprec.tune: the tuner that writes policy files. Profile each layer's sensitivity and speed per format on
your device, search per-layer formats and loss-scale settings with Optuna for the fastest training step within
an accuracy budget (`search`), or one study for several budgets (`sweep`).

A training script does not need this package: `import autoprec` (the runtime) applies what it wrote.
"""

from autoprec.tune.profiler import Profile, ProfileConfig, profile
from autoprec.tune.searcher import Mode, SearchConfig, SearchResult, search
from autoprec.tune.space import Layout, SearchSpace, load_space
from autoprec.tune.sweeper import SweepResult, sweep
from autoprec.tune.task import Task, Workload, load_task, prepare

__all__ = [
    "load_task", "prepare", "Task", "Workload", "load_space", "SearchSpace", "Layout",
    "profile", "Profile", "ProfileConfig", "search", "SearchConfig", "SearchResult", "Mode", "sweep", "SweepResult",
]  # fmt: skip
