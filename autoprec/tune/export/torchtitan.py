"""`--to torchtitan`: a Python file whose `float8_converters(model_config)` gives torchtitan's
`Float8LinearConverter.Config` per recipe, its `filter_fqns` (substrings of the layers to skip) computed from that
model config so that exactly the policy's fp8 layers convert. torchtitan 0.3 offers rowwise recipes only, by name:
no per-GEMM mix (fp8-fwd, fp8-fwd-dgrad, ...).

Its `blockscaled_converters(model_config)` gives `MXFP8LinearConverter.Config` and `NVFP4LinearConverter.Config`
(torchtitan/components/quantization/mx.py and nvfp4.py) for the policy's mxfp8 and nvfp4 layers. Their `fqns` are an
include list matched by substring (`target_fqn in fqn`), so the file writes a whole numbered block as its prefix with
a trailing dot ("layers.1.", which does not match "layers.10.*"), as torchtitan's own `nvfp4_bf16_tail_fqns` does,
and any other layer by its full name, and refuses a list that would select a Linear the policy does not run in that
format. Both converters run all three GEMMs in their format (torchtitan sets no per-GEMM switch: torchao's
MXFP8Linear defaults, RCEIL scales, wgrad_with_hp=False), so the per-GEMM mixes (mxfp8-fwd, mxfp8-fwd-dgrad,
nvfp4-fwd, ...) are listed as not expressed.
"""

from __future__ import annotations

from pathlib import Path

from autoprec.files import write_text
from autoprec.formats import Format
from autoprec.policy import ROOT, Policy
from autoprec.tune.export._common import (
    _comments,
    _json_literal,
    _layers,
    blockscaled_gemms,
    blockscaled_recipe,
    fp8_layers,
    not_expressed,
)
from autoprec.tune.export.base import ExportTarget, register

TORCHTITAN_RECIPES = ("rowwise", "rowwise_with_gw_hp")  # Float8LinearConverter.Config.recipe_name in torchtitan 0.3
# the blockscaled formats' recipe_name -> torchtitan's converter that runs it: both convert a Linear's three GEMMs
BLOCKSCALED_CONVERTERS = {"mxfp8": "MXFP8LinearConverter", "nvfp4": "NVFP4LinearConverter"}


def blockscaled_layers(policy: Policy) -> dict[str, list[str]]:
    """ "mxfp8"/"nvfp4" (the converter's format) -> the policy's layers torchtitan's converter runs in it."""
    found: dict[str, list[str]] = {}
    for name, fmt in policy.layers.items():  # a block-scaled root: not_expressed says it ('' would select every fqn)
        if (recipe := blockscaled_recipe(fmt)) in BLOCKSCALED_CONVERTERS and recipe is not None and name != ROOT:
            found.setdefault(recipe, []).append(name)
    return found


def _blockscaled_not_expressed(policy: Policy) -> list[str]:
    by_format: dict[Format, list[str]] = {}
    for name, fmt in policy.layers.items():
        if blockscaled_gemms(fmt) is not None and blockscaled_recipe(fmt) not in BLOCKSCALED_CONVERTERS and name != ROOT:
            by_format.setdefault(fmt, []).append(name)
    lines = []
    for fmt, names in by_format.items():
        fprop, dgrad, wgrad = (g or "high precision" for g in blockscaled_gemms(fmt) or ())
        lines.append(
            f"{_layers(names)} in {fmt.value} (fprop {fprop}, dgrad {dgrad}, wgrad {wgrad}): torchtitan's "
            "MXFP8 and NVFP4 converters run all three GEMMs in their format, with no per-GEMM switch, so "
            "not in the export"
        )
    return lines


def torchtitan_not_expressed(policy: Policy) -> list[str]:
    blockscaled = frozenset(f for f in policy.layers.values() if blockscaled_gemms(f) is not None)
    lines = not_expressed(policy, "torchtitan", skip=blockscaled) + _blockscaled_not_expressed(policy)
    per_gemm = {fmt.value for fmt in policy.layers.values() if fmt.spec.fp8 is not None and fmt.spec.fp8.recipe is None}
    for recipe, names in fp8_layers(policy).items():
        if recipe not in TORCHTITAN_RECIPES:
            what = f"{recipe}, fp8 per GEMM (no torchao recipe)" if recipe in per_gemm else f"fp8 recipe {recipe!r}"
            lines.append(
                f"{_layers(names)} in {what}: torchtitan's float8 converter offers "
                f"{' and '.join(TORCHTITAN_RECIPES)} only, so not in the export (torchtitan trains in its "
                "mixed-precision dtype what it does not convert)"
            )
    return lines


def torchtitan_source(policy: Policy, *, source: str = "a policy") -> str:
    """The torchtitan file's text (see the module docstring)."""
    recipes = {r: names for r, names in fp8_layers(policy).items() if r in TORCHTITAN_RECIPES}
    blocks = blockscaled_layers(policy)
    last = None
    if not recipes and not blocks:
        last = "No layer of the policy has a torchtitan converter: float8_converters() and blockscaled_converters() return []."
    header = _comments(source, "not expressed here", torchtitan_not_expressed(policy), last)
    return rf'''"""torchtitan float8 training for a policy's fp8 layers (written by `autoprec export --to torchtitan`).

For torchtitan 0.3. In a config function, the model config first, then the converters computed from it:

    from this_file import float8_converters, blockscaled_converters
    model = model_registry("8B").model
    spec = model_registry("8B", converters=float8_converters(model) + blockscaled_converters(model))

Each converter is torchtitan's Float8LinearConverter.Config for one recipe; its filter_fqns (substrings of the
layers torchtitan skips) name every Linear of the model config but this policy's fp8 layers in that recipe, so
exactly those convert. `options` go to every converter (model_compile_enabled=..., say). torchtitan's
emulate=True is refused: it converts with torchao's default (tensorwise) settings, not the recipe named.

blockscaled_converters gives MXFP8LinearConverter and NVFP4LinearConverter configs (for GPUs of compute capability
10.0) whose `fqns`, an include list torchtitan matches by substring, select exactly this policy's mxfp8 and nvfp4
layers: a numbered block wholly in one format by its prefix with a trailing dot ("layers.1." does not match
"layers.10.attention.wo"), any other layer by its full name. NVFP4 needs every converted Linear's dimensions divisible
by 128 (torchtitan refuses the others when it converts).

The comments below name the policy file and what the file leaves out.
"""

{header}

import json
import re

from torchtitan.components.quantization.float8 import Float8LinearConverter
from torchtitan.models.common.linear import Linear

# torchtitan recipe -> the fully qualified names of its Linear layers
FP8_LAYERS = {_json_literal(recipes)}

# "mxfp8" / "nvfp4" -> the fully qualified names of the Linear layers torchtitan's MXFP8 / NVFP4 converter converts
BLOCKSCALED_LAYERS = {_json_literal(blocks)}


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


def include_fqns(model_config, fmt):
    """The converter's include list for the policy's `fmt` layers: a numbered block's prefix with a trailing dot
    where every Linear it selects is one of them, else the layer's full name. Refuses names the config lacks and a
    list that would select any other Linear (torchtitan matches `target_fqn in fqn`)."""
    names = [fqn for fqn, _config, _parent, _attr in model_config.traverse(Linear.Config)]
    keep = BLOCKSCALED_LAYERS[fmt]
    missing = sorted(set(keep) - set(names))
    if missing:
        raise ValueError(f"policy layers {{missing[:5]}} are not Linear layers of this model config "
                         f"(it has {{len(names)}}, such as {{names[:3]}}): the policy was searched on another model")
    fqns = []
    for name in keep:
        block = re.match(r"(?:.*?\.)?\d+\.", name)  # 'layers.1.attention.wo' -> 'layers.1.'
        prefix = block[0] if block else None
        if prefix and all(n in keep for n in names if prefix in n):
            if prefix not in fqns:
                fqns.append(prefix)
        else:
            fqns.append(name)
    selected = {{n for n in names if any(f in n for f in fqns)}}
    extra = sorted(selected - set(keep))
    if extra:
        raise ValueError(f"torchtitan matches fqns by substring, so {{fmt}}'s include list would also convert "
                         f"{{extra[:5]}}: this layer set cannot be written")
    return fqns


def blockscaled_converters(model_config, **options):
    """MXFP8LinearConverter and NVFP4LinearConverter configs for this policy's mxfp8 and nvfp4 layers (none for a
    format without layers: an empty include list would convert every Linear)."""
    converters = []
    if BLOCKSCALED_LAYERS.get("mxfp8"):
        from torchtitan.components.quantization.mx import MXFP8LinearConverter

        converters.append(MXFP8LinearConverter.Config(fqns=include_fqns(model_config, "mxfp8"), **options))
    if BLOCKSCALED_LAYERS.get("nvfp4"):
        from torchtitan.components.quantization.nvfp4 import NVFP4LinearConverter

        converters.append(NVFP4LinearConverter.Config(fqns=include_fqns(model_config, "nvfp4"), **options))
    return converters
'''


@register
class Torchtitan(ExportTarget):
    name = "torchtitan"
    suffix = ".py"
    summary = "Float8/MXFP8/NVFP4 converter configs that convert exactly the policy's fp8, mxfp8 and nvfp4 layers"

    def write(self, policy: Policy, out: str | Path, *, source: str = "a policy", **options: object) -> list[str]:
        write_text(out, torchtitan_source(policy, source=source))
        left_out = torchtitan_not_expressed(policy)
        if any(r in TORCHTITAN_RECIPES for r in fp8_layers(policy)):
            return left_out
        if blockscaled_layers(policy):
            return [
                *left_out,
                "the policy has no fp8 layer torchtitan can run: the file's float8_converters() returns "
                "[] (its blockscaled_converters() converts the mxfp8/nvfp4 layers)",
            ]
        return [*left_out, "the policy has no fp8 layer torchtitan can run: the file's float8_converters() returns []"]
