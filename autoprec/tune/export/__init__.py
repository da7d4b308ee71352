"""A policy's fp8 layers in another training tool's terms (`autoprec export`). What the target cannot express
(bf16 or fp16 layers, a lowered model root, a recipe or a layer set the tool has no setting for) is listed, never
dropped silently; nothing is put in fp8 that the policy did not measure in that recipe.

Each target is one module here, an ExportTarget registered by name (base.py): torchao.py, torchtitan.py and
megatron.py, each describing its file in its docstring; what they share is in _common.py. The command line offers
whatever is registered, with the options each target adds: adding a target is one module, its tests and its docs
(docs/export.md, "Adding an export target"). A target's `resolve` reads its file back as its framework would, for
`autoprec verify` (verify.py), without running it.

Nothing read from a policy becomes code in a written Python file: the layer names are JSON text inside string
literals (repr), parsed at import; the policy file's name and the lines about what is left out are comments, their
non-printable characters escaped (errors.printable); the docstrings hold no text from the policy.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

from autoprec.errors import UserError
from autoprec.policy import Policy
from autoprec.tune.export._schedule import forget_schedule, write_schedule
from autoprec.tune.export.base import (
    HIGH,
    ExportTarget,
    Gemms,
    Option,
    Resolved,
    export_target_named,
    export_targets,
    options,
    register_export_target,
    unregister_export_target,
)

BUILT_IN = (
    "torchao",
    "torchtitan",
    "megatron",
    "megatron_precision",
    "transformer_engine",
)  # modules here that register a target; --to lists them in this order
for _module in BUILT_IN:
    importlib.import_module(f"{__name__}.{_module}")

__all__ = [
    "HIGH",
    "SUFFIXES",
    "TARGETS",
    "ExportTarget",
    "Gemms",
    "Option",
    "Resolved",
    "default_path",
    "export",
    "export_target_named",
    "options",
    "register_export_target",
    "export_targets",
    "unregister_export_target",
]

# Read from the registry when asked for (PEP 562), so that a target registered later is in them too.
TARGETS: tuple[str, ...]  # the registered targets' names
SUFFIXES: dict[str, str]  # target -> the written file's suffix


def __getattr__(name: str) -> Any:
    if name == "TARGETS":
        return tuple(t.name for t in export_targets())
    if name == "SUFFIXES":
        return {t.name: t.suffix for t in export_targets()}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def default_path(policy_path: Path, target: str) -> Path:
    """Beside the policy: <name>_<target><suffix>."""
    return policy_path.with_name(f"{policy_path.stem}_{target}{export_target_named(target).suffix}")


def export(policy: Policy, target: str, out: str | Path, *, source: str = "a policy", **given: Any) -> list[str]:
    """Write `policy` for `target` to `out`; returns what the target could not express (and says when nothing
    is left to convert). `given`: target options by dest (num_layers=N: the model's transformer layers, for
    megatron only); None is not given. An option of another target is refused, naming that target. A policy with
    phases writes one file per phase (`out` the first) and `<name>_schedule.json` listing them (_schedule.py)."""
    chosen = export_target_named(target)
    given = {dest: value for dest, value in given.items() if value is not None}
    for dest in given:
        if any(option.dest == dest for option in chosen.options):
            continue
        owners = [(option, names) for option, names in options().items() if option.dest == dest]
        if not owners:
            raise TypeError(f"export() got an unexpected keyword argument {dest!r}")
        option, names = owners[0]
        raise UserError(f"{option.flag} is for --to {' or --to '.join(names)} ({option.purpose}), not --to {target}")
    if policy.phases:  # a schedule: one file per phase and the list of them (_schedule.py)
        return write_schedule(chosen, policy, Path(out), source=source, **given)
    return chosen.write(policy, out, source=source, **given) + forget_schedule(Path(out))
