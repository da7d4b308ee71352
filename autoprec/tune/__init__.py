"""autoprec.tune: the tuner that writes policy files. Profile each layer's sensitivity and speed per format on
your device, search per-layer formats and loss-scale settings with Optuna for the fastest training step within
an accuracy budget (`search`), or one study for several budgets (`sweep`).

What is API: the names in `__all__` below, and the `autoprec.tune.export` package (export targets, a seam of its
own). `search` and `sweep` take a model and its batches; `load_task`, `prepare` and `profile` are the steps the
command line drives from a model.py; a goal (`Goal`, `register_goal`) is the seam for what a search optimises, and
what a goal author uses comes with it (the records its methods read, `TrialRecord`, `Measurement`, `Finals`; the
built-in goals, `SPEED`, `MEMORY`; `Axis`, `INFEASIBLE`, the decision rules `choose`, `choose_smallest` and the
`ALTERNATIVES` they compare with); a FLOP goal's target device is one more (`Target`, `register_target`). What is not: every module here
whose name starts with "_" (the stages: `_profiler`, `_pipeline`, `_objective`, ...); their names and signatures
change without notice, and tests reach into them as torch's tests reach into torch's private modules.
A training script does not need this package: `import autoprec` (the runtime) applies what it wrote.
"""

from autoprec.tune._api import search, sweep
from autoprec.tune._core._budget import Budget, parse_budget
from autoprec.tune._core._config import Mode, ProfileConfig, SearchConfig
from autoprec.tune._core._goal import INFEASIBLE, Axis, Goal, GoalSettings, goal_named, goals, register_goal, unregister_goal
from autoprec.tune._core._names import ALTERNATIVES
from autoprec.tune._core._profile_row import ProfileRow
from autoprec.tune._core._records import Finals, Measured, Measurement, TrialRecord
from autoprec.tune._core._space import Layout, SearchSpace, load_space
from autoprec.tune._core._targets import Target, register_target, target_named, targets, unregister_target
from autoprec.tune._decide._choose import choose, choose_smallest
from autoprec.tune._decide._goals import MEMORY, SPEED
from autoprec.tune._measure._profile_data import Profile
from autoprec.tune._measure._profiler import profile
from autoprec.tune._measure._task import Task, Workload, load_task, prepare
from autoprec.tune._report._results import SearchResult, SweepResult

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
    "Goal",
    "GoalSettings",
    "register_goal",
    "unregister_goal",
    "goals",
    "goal_named",
    "TrialRecord",
    "Measurement",
    "Finals",
    "Measured",
    "SPEED",
    "MEMORY",
    "INFEASIBLE",
    "Axis",
    "ALTERNATIVES",
    "choose",
    "choose_smallest",
    "Target",
    "register_target",
    "targets",
    "target_named",
    "unregister_target",
]
