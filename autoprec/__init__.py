"""autoprec: automatic per-layer precision tuning for PyTorch training.

`import autoprec` is the runtime a training script needs: load a policy file, apply it to a model, compile,
and the GradScaler it asks for. It imports torch only (torchao when an fp8 layer is applied) and prints
nothing. The tuner that writes policies (profile each layer, search with Optuna, sweep budgets) is
`autoprec.tune`, with its own dependencies; the `autoprec` command line runs it.
"""

from __future__ import annotations

import importlib
from typing import Any

from autoprec.apply import after_optimizer_step, applied_summary, apply_policy, compile_model
from autoprec.errors import UserError
from autoprec.formats import Format
from autoprec.policy import LossScale, Phase, Policy, load_policy
from autoprec.scaler import grad_scaler
from autoprec.schedule import follow_schedule

__all__ = [
    "load_policy",
    "apply_policy",
    "follow_schedule",
    "after_optimizer_step",
    "compile_model",
    "grad_scaler",
    "applied_summary",
    "Policy",
    "Phase",
    "LossScale",
    "Format",
    "UserError",
]


def __getattr__(name: str) -> Any:
    if name == "tune":  # autoprec.tune without importing it first, as the README writes it; imported only when used
        return importlib.import_module("autoprec.tune")
    raise AttributeError(f"module 'autoprec' has no attribute {name!r}")
