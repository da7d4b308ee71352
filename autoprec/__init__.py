"""autoprec: automatic per-layer precision tuning for PyTorch training.

`import autoprec` is the runtime a training script needs: load a policy file, apply it to a model, compile,
and the GradScaler it asks for. It imports torch only (torchao when an fp8 layer is applied) and prints
nothing. The tuner that writes policies (profile each layer, search with Optuna, sweep budgets) is
`autoprec.tune`, with its own dependencies; the `autoprec` command line runs it.
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any

from autoprec.apply import applied_summary, apply_policy, compile_model
from autoprec.errors import UserError
from autoprec.formats import Format
from autoprec.policy import LossScale, Policy, load_policy
from autoprec.scaler import grad_scaler

__all__ = [
    "load_policy", "apply_policy", "compile_model", "grad_scaler", "applied_summary", "Policy", "LossScale",
    "Format", "UserError",
]  # fmt: skip

# The tuner's names, once importable from here; they live in autoprec.tune now.
_MOVED = (
    "load_task", "prepare", "Task", "Workload", "load_space", "SearchSpace", "Layout", "profile", "Profile",
    "ProfileConfig", "search", "SearchConfig", "SearchResult", "Mode", "sweep", "SweepResult",
)  # fmt: skip


# search and sweep keep the signatures they had here: the pipeline's steps, autoprec.tune.searcher's and sweeper's
_HOME = {"search": "autoprec.tune.searcher", "sweep": "autoprec.tune.sweeper"}


def __getattr__(name: str) -> Any:
    if name == "tune":  # autoprec.tune without importing it first, as the README writes it
        return importlib.import_module("autoprec.tune")
    if name in _MOVED:
        warnings.warn(
            f"autoprec.{name} has moved to {_HOME.get(name, 'autoprec.tune')}.{name}; import it from there (the old name "
            "goes away in 0.3)",
            DeprecationWarning,
            stacklevel=2,
        )
        # search and sweep keep the signatures they had here: the steps, now autoprec.tune.searcher/sweeper's
        return getattr(importlib.import_module(_HOME.get(name, "autoprec.tune")), name)
    raise AttributeError(f"module 'autoprec' has no attribute {name!r}")
