"""A policy's fp8 layers in another training tool's terms (`autoprec export`). What the target cannot express
(bf16 or fp16 layers, a lowered model root) is listed, never dropped silently.

- `torchao`: a Python file with the fp8 layers per recipe, a `module_filter_fn` per recipe for
  `torchao.float8.convert_to_float8_training`, and `convert(model)` that applies them all.
"""

from __future__ import annotations

import json
from pathlib import Path

from autoprec.files import write_text
from autoprec.formats import Format
from autoprec.policy import ROOT, Policy

TARGETS = ("torchao",)


def not_expressed(policy: Policy) -> list[str]:
    """What an fp8-only target leaves out: each non-fp8, non-fp32 layer and a lowered root, as lines."""
    lines = []
    for name, fmt in policy.layers.items():
        if fmt.spec.fp8_recipe is not None or fmt is Format.FP32:
            continue
        where = "the model root (every op outside a listed layer)" if name == ROOT else f"layer {name!r}"
        lines.append(f"{where} runs in {fmt.value}: not a torchao float8 recipe, so not in the export; run it with "
                     "autocast or autoprec.apply_policy")  # fmt: skip
    return lines


def torchao_source(policy: Policy, *, source: str = "a policy") -> str:
    """The torchao file's text (see the module docstring)."""
    recipes: dict[str, list[str]] = {}
    for name, fmt in policy.layers.items():
        if fmt.spec.fp8_recipe is not None:
            recipes.setdefault(fmt.spec.fp8_recipe, []).append(name)
    missing = not_expressed(policy)
    header = "\n".join(f"  - {line}" for line in missing) or "  (nothing: every listed layer is fp8 or fp32)"
    if not recipes:
        header += "\n\nThe policy has no fp8 layer: convert(model) changes nothing."
    layers = json.dumps(recipes, indent=4)
    return f'''"""torchao float8 training for the fp8 layers of {source!r} (written by `autoprec export --to torchao`).

    from this_file import convert
    model = convert(model)   # before torch.compile, after moving the model to its device

Not expressed here (torchao's float8 conversion knows fp8 recipes only):
{header}
"""

from torchao.float8 import Float8LinearConfig, convert_to_float8_training

FP8_LAYERS = {layers}  # torchao recipe -> the fully qualified names of its nn.Linear layers


def module_filter_fn(recipe):
    """For convert_to_float8_training: True for the layers this policy runs in `recipe`."""
    names = frozenset(FP8_LAYERS[recipe])
    return lambda module, fqn: fqn in names


def convert(model):
    for recipe in FP8_LAYERS:
        config = Float8LinearConfig.from_recipe_name(recipe)
        model = convert_to_float8_training(model, config=config, module_filter_fn=module_filter_fn(recipe))
    return model
'''


def export(policy: Policy, target: str, out: str | Path, *, source: str = "a policy") -> list[str]:
    """Write `policy` for `target` to `out`; returns what the target could not express (and says when nothing
    is left to convert)."""
    if target not in TARGETS:
        raise ValueError(f"--to {target!r}: one of {', '.join(TARGETS)}")
    write_text(out, torchao_source(policy, source=source))
    left_out = not_expressed(policy)
    if not any(fmt.spec.fp8_recipe is not None for fmt in policy.layers.values()):
        left_out.append("the policy has no fp8 layer: the file's convert(model) changes nothing")
    return left_out
