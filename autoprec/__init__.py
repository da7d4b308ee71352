"""autoprec: automatic per-layer precision tuning for PyTorch training.

Profile each layer's sensitivity and speed in fp32/bf16/fp16/fp8 on your device, search per-layer
formats and loss-scale settings with Optuna for the fastest training step within an accuracy budget,
and apply the resulting policy file in one call.
"""

from autoprec.apply import applied_summary, apply_policy, compile_model
from autoprec.scaler import grad_scaler
from autoprec.errors import UserError
from autoprec.formats import Format
from autoprec.policy import LossScale, Policy, load_policy
from autoprec.profile import Profile, ProfileConfig, profile
from autoprec.search import Mode, SearchConfig, SearchResult, search
from autoprec.space import Layout, SearchSpace, load_space
from autoprec.sweep import SweepResult, sweep
from autoprec.task import Task, Workload, load_task, prepare

__all__ = [
    # apply a policy in training
    "load_policy", "apply_policy", "compile_model", "grad_scaler", "applied_summary", "Policy", "LossScale", "Format",
    # the pipeline
    "load_task", "prepare", "Task", "Workload", "load_space", "SearchSpace", "Layout",
    "profile", "Profile", "ProfileConfig", "search", "SearchConfig", "SearchResult", "Mode", "sweep", "SweepResult",
    "UserError",
]  # fmt: skip
