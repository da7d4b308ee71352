"""`--to torchtitan`: a Python file whose `float8_converters(model_config)` gives torchtitan's
`Float8LinearConverter.Config` per recipe, its `filter_fqns` (substrings of the layers to skip) computed from that
model config so that exactly the policy's fp8 layers convert. torchtitan 0.3 offers rowwise recipes only, by name:
no per-GEMM mix (fp8-fwd, fp8-fwd-dgrad, ...).
"""

from __future__ import annotations

from pathlib import Path

from autoprec.files import write_text
from autoprec.policy import Policy
from autoprec.tune.export._common import _comments, _json_literal, _layers, fp8_layers, not_expressed
from autoprec.tune.export.base import ExportTarget, register

TORCHTITAN_RECIPES = ("rowwise", "rowwise_with_gw_hp")  # Float8LinearConverter.Config.recipe_name in torchtitan 0.3


def torchtitan_not_expressed(policy: Policy) -> list[str]:
    lines = not_expressed(policy, "torchtitan")
    per_gemm = {fmt.value for fmt in policy.layers.values() if fmt.spec.fp8 is not None and fmt.spec.fp8.recipe is None}
    for recipe, names in fp8_layers(policy).items():
        if recipe not in TORCHTITAN_RECIPES:
            what = f"{recipe}, fp8 per GEMM (no torchao recipe)" if recipe in per_gemm else f"fp8 recipe {recipe!r}"
            lines.append(f"{_layers(names)} in {what}: torchtitan's float8 converter offers "
                         f"{' and '.join(TORCHTITAN_RECIPES)} only, so not in the export (torchtitan trains in its "
                         "mixed-precision dtype what it does not convert)")  # fmt: skip
    return lines


def torchtitan_source(policy: Policy, *, source: str = "a policy") -> str:
    """The torchtitan file's text (see the module docstring)."""
    recipes = {r: names for r, names in fp8_layers(policy).items() if r in TORCHTITAN_RECIPES}
    last = None if recipes else "No fp8 layer of the policy has a torchtitan recipe: float8_converters() returns []."
    header = _comments(source, "not expressed here", torchtitan_not_expressed(policy), last)
    return f'''"""torchtitan float8 training for a policy's fp8 layers (written by `autoprec export --to torchtitan`).

For torchtitan 0.3. In a config function, the model config first, then the converters computed from it:

    from this_file import float8_converters
    spec = model_registry("8B", converters=float8_converters(model_registry("8B").model))

Each converter is torchtitan's Float8LinearConverter.Config for one recipe; its filter_fqns (substrings of the
layers torchtitan skips) name every Linear of the model config but this policy's fp8 layers in that recipe, so
exactly those convert. `options` go to every converter (model_compile_enabled=..., say). torchtitan's
emulate=True is refused: it converts with torchao's default (tensorwise) settings, not the recipe named.

The comments below name the policy file and what the file leaves out.
"""

{header}

import json

from torchtitan.components.quantization.float8 import Float8LinearConverter
from torchtitan.models.common.linear import Linear

# torchtitan recipe -> the fully qualified names of its Linear layers
FP8_LAYERS = {_json_literal(recipes)}


def filter_fqns(model_config, recipe):
    """Every Linear of `model_config` but the policy's `recipe` layers; refuses names the config lacks."""
    names = [fqn for fqn, _config, _parent, _attr in model_config.traverse(Linear.Config)]
    keep = FP8_LAYERS[recipe]
    missing = sorted(set(keep) - set(names))
    if missing:
        raise ValueError(f"policy layers {{missing[:5]}} are not Linear layers of this model config "
                         f"(it has {{len(names)}}, such as {{names[:3]}}): the policy was searched on another model")
    skip = [name for name in names if name not in keep]
    clash = [(s, k) for s in skip for k in keep if s in k]  # torchtitan skips every fqn that contains a filter
    if clash:
        raise ValueError(f"filter {{clash[0][0]!r}} would also skip fp8 layer {{clash[0][1]!r}}: "
                         "torchtitan's filter_fqns match substrings, so this layer set cannot be written")
    return skip


def float8_converters(model_config, **options):
    if options.get("emulate"):
        raise ValueError("emulate=True makes torchtitan convert with torchao's default (tensorwise) settings, not this "
                         "policy's rowwise recipes: run on a GPU with fp8 kernels (compute capability 8.9+)")
    return [Float8LinearConverter.Config(recipe_name=recipe, filter_fqns=filter_fqns(model_config, recipe), **options)
            for recipe in FP8_LAYERS]
'''


@register
class Torchtitan(ExportTarget):
    name = "torchtitan"
    suffix = ".py"
    summary = "Float8LinearConverter configs whose filter_fqns convert exactly the policy's fp8 layers"

    def write(self, policy: Policy, out: str | Path, *, source: str = "a policy", **options: object) -> list[str]:
        write_text(out, torchtitan_source(policy, source=source))
        left_out = torchtitan_not_expressed(policy)
        if any(r in TORCHTITAN_RECIPES for r in fp8_layers(policy)):
            return left_out
        return [*left_out, "the policy has no fp8 layer torchtitan can run: the file's float8_converters() returns []"]
