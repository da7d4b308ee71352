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

import difflib
import inspect
import re
from pathlib import Path

from autoprec.errors import UserError
from autoprec.files import write_text
from autoprec.formats import Format
from autoprec.policy import ROOT, Policy
from autoprec.tune.export._common import (
    _comments,
    _json_literal,
    _layers,
    assigned,
    blockscaled_gemms,
    blockscaled_recipe,
    fp8_layers,
    gather_not_expressed,
    not_expressed,
    policy_gemms,
    read_python,
    recipe_key,
    same_module,
    str_table,
)
from autoprec.tune.export.base import HIGH, ExportTarget, Resolved, register_export_target

TORCHTITAN_RECIPES = ("rowwise", "rowwise_with_gw_hp")  # Float8LinearConverter.Config.recipe_name in torchtitan 0.3
# the blockscaled formats' recipe_name -> torchtitan's converter that runs it: both convert a Linear's three GEMMs
BLOCKSCALED_CONVERTERS = {"mxfp8": "MXFP8LinearConverter", "nvfp4": "NVFP4LinearConverter"}


# torchtitan's MoE router projection (torchtitan/models/common/moe.py, TokenChoiceTopKRouter.gate): its main branch
# builds it as RouterGateLinear, which every quantization converter refuses (_validate_quantizable_linear raises)
ROUTER_GATE = re.compile(r"(?:.*\.)?router\.gate")


def router_gates(policy: Policy) -> list[str]:
    """The policy's quantized router gates, which no converter may select."""
    return [n for n, f in policy.layers.items() if ROUTER_GATE.fullmatch(n) and (recipe_key(f) or blockscaled_gemms(f))]


def blockscaled_layers(policy: Policy) -> dict[str, list[str]]:
    """ "mxfp8"/"nvfp4" (the converter's format) -> the policy's layers torchtitan's converter runs in it."""
    found: dict[str, list[str]] = {}
    gates = router_gates(policy)
    for name, fmt in policy.layers.items():  # a block-scaled root: not_expressed says it ('' would select every fqn)
        if (recipe := blockscaled_recipe(fmt)) in BLOCKSCALED_CONVERTERS and recipe is not None and name != ROOT:
            if name not in gates:
                found.setdefault(recipe, []).append(name)
    return found


def titan_fp8_layers(policy: Policy) -> dict[str, list[str]]:
    """torchtitan recipe -> the policy's layers its Float8 converter runs in it (no router gate)."""
    gates = router_gates(policy)
    found = {r: [n for n in names if n not in gates] for r, names in fp8_layers(policy).items() if r in TORCHTITAN_RECIPES}
    return {r: names for r, names in found.items() if names}


def skip_list(names, keep):
    """Float8LinearConverter's filter_fqns for the layers `keep` of the Linears `names`: every other one. torchtitan
    skips every fqn that contains a filter, so a filter inside a kept name is refused."""
    skip = [name for name in names if name not in keep]
    clash = [(s, k) for s in skip for k in keep if s in k]
    if clash:
        raise ValueError(
            f"filter {clash[0][0]!r} would also skip fp8 layer {clash[0][1]!r}: "
            "torchtitan's filter_fqns match substrings, so this layer set cannot be written"
        )
    return skip


def include_list(names, keep, fmt):
    """The MXFP8/NVFP4 converter's fqns for the layers `keep` of the Linears `names`: a numbered block's prefix with
    a trailing dot where every Linear it selects is kept, else the layer's full name; refuses a list that would
    select any other Linear (torchtitan matches `target_fqn in fqn`)."""
    fqns = []
    for name in keep:
        block = re.match(r"(?:.*?\.)?\d+\.", name)  # 'layers.1.attention.wo' -> 'layers.1.'
        prefix = block[0] if block else None
        if prefix and all(n in keep for n in names if prefix in n):
            if prefix not in fqns:
                fqns.append(prefix)
        else:
            fqns.append(name)
    extra = sorted({n for n in names if any(f in n for f in fqns)} - set(keep))
    if extra:
        raise ValueError(
            f"torchtitan matches fqns by substring, so {fmt}'s include list would also convert "
            f"{extra[:5]}: this layer set cannot be written"
        )
    return fqns


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
    gates = router_gates(policy)
    if gates:
        lines.append(
            f"{_layers(gates, 'is')} a router gate in a quantized format: torchtitan refuses to convert one "
            "(RouterGateLinear on its main branch), so not in the export"
        )
    per_gemm = {
        fmt.value for fmt in policy.layers.values() if (gemms := fmt.family.fp8_gemms(fmt)) is not None and gemms.recipe is None
    }
    for recipe, names in fp8_layers(policy).items():
        if recipe not in TORCHTITAN_RECIPES:
            what = f"{recipe}, fp8 per GEMM (no torchao recipe)" if recipe in per_gemm else f"fp8 recipe {recipe!r}"
            lines.append(
                f"{_layers(names)} in {what}: torchtitan's float8 converter offers "
                f"{' and '.join(TORCHTITAN_RECIPES)} only, so not in the export (torchtitan trains in its "
                "mixed-precision dtype what it does not convert)"
            )
    return lines + gather_not_expressed(policy, "torchtitan")


def torchtitan_source(policy: Policy, *, source: str = "a policy") -> str:
    """The torchtitan file's text (see the module docstring)."""
    recipes = titan_fp8_layers(policy)
    blocks = blockscaled_layers(policy)
    helpers = inspect.getsource(skip_list) + "\n\n" + inspect.getsource(include_list)
    last = None
    if not recipes and not blocks:
        last = "No layer of the policy has a torchtitan converter: float8_converters() and blockscaled_converters() return []."
    header = _comments(source, "not expressed here", torchtitan_not_expressed(policy), last)
    return rf'''"""torchtitan float8 training for a policy's fp8 layers (written by `autoprec export --to torchtitan`).

For torchtitan 0.3 and its main branch, by what is installed: the converters come from torchtitan.config.transform
where that module is (the main branch's layout, which autoprec could not run: its converters' Config fields are the
same), else from torchtitan.components.quantization (0.3). In a config function, the model config first, then the
converters computed from it:

    from this_file import float8_converters, blockscaled_converters
    model = model_registry("8B").model
    spec = model_registry("8B", converters=float8_converters(model) + blockscaled_converters(model))

Each converter is torchtitan's Float8LinearConverter.Config for one recipe; its filter_fqns (substrings of the
layers torchtitan skips) name every Linear of the model config but this policy's fp8 layers in that recipe, so
exactly those convert. `options` go to every converter (model_compile_enabled=..., say; on the main branch
linears_saving_inputs_for_backward_in_mxfp8=[...] to blockscaled_converters). torchtitan's emulate=True is
refused: it converts with torchao's default (tensorwise) settings, not the recipe named.

The converters select disjoint layers, in this order: a converter converts every Linear.Config it selects, an
already converted one too, so a later converter that selected an earlier one's layer (an empty include list selects
all) would re-convert it. A router gate (RouterGateLinear) is never selected: torchtitan refuses to convert it.

blockscaled_converters gives MXFP8LinearConverter and NVFP4LinearConverter configs (for GPUs of compute capability
10.0) whose `fqns`, an include list torchtitan matches by substring, select exactly this policy's mxfp8 and nvfp4
layers: a numbered block wholly in one format by its prefix with a trailing dot ("layers.1." does not match
"layers.10.attention.wo"), any other layer by its full name. NVFP4 needs every converted Linear's dimensions divisible
by 128 (torchtitan refuses the others when it converts).

The comments below name the policy file and what the file leaves out.
"""

{header}

import importlib
import json
import re

from torchtitan.models.common.linear import Linear

# torchtitan recipe -> the fully qualified names of its Linear layers
FP8_LAYERS = {_json_literal(recipes)}

# "mxfp8" / "nvfp4" -> the fully qualified names of the Linear layers torchtitan's MXFP8 / NVFP4 converter converts
BLOCKSCALED_LAYERS = {_json_literal(blocks)}


def converter(name, module):
    """torchtitan's converter class `name`: from torchtitan.config.transform (its main branch) where that is
    installed, else from torchtitan 0.3's torchtitan.components.quantization.<module>."""
    try:
        transform = importlib.import_module("torchtitan.config.transform")
    except ImportError:
        transform = importlib.import_module(f"torchtitan.components.quantization.{{module}}")
    return getattr(transform, name)


def linear_names(model_config, keep):
    """The model config's Linear fqns; refuses `keep` names it lacks."""
    names = [fqn for fqn, _config, _parent, _attr in model_config.traverse(Linear.Config)]
    missing = sorted(set(keep) - set(names))
    if missing:
        raise ValueError(f"policy layers {{missing[:5]}} are not Linear layers of this model config "
                         f"(it has {{len(names)}}, such as {{names[:3]}}): the policy was searched on another model")
    return names


{helpers}

def filter_fqns(model_config, recipe):
    """Every Linear of `model_config` but the policy's `recipe` layers; refuses names the config lacks."""
    keep = FP8_LAYERS[recipe]
    return skip_list(linear_names(model_config, keep), keep)


def float8_converters(model_config, **options):
    if options.get("emulate"):
        raise ValueError("emulate=True makes torchtitan convert with torchao's default (tensorwise) settings, not this "
                         "policy's rowwise recipes: run on a GPU with fp8 kernels (compute capability 8.9+)")
    if not FP8_LAYERS:
        return []
    config = converter("Float8LinearConverter", "float8").Config
    return [config(recipe_name=recipe, filter_fqns=filter_fqns(model_config, recipe), **options) for recipe in FP8_LAYERS]


def include_fqns(model_config, fmt):
    """The converter's include list for the policy's `fmt` layers (include_list); refuses names the config lacks."""
    keep = BLOCKSCALED_LAYERS[fmt]
    return include_list(linear_names(model_config, keep), keep, fmt)


def blockscaled_converters(model_config, **options):
    """MXFP8LinearConverter and NVFP4LinearConverter configs for this policy's mxfp8 and nvfp4 layers (none for a
    format without layers: an empty include list would convert every Linear, re-converting the float8 ones)."""
    converters = []
    if BLOCKSCALED_LAYERS.get("mxfp8"):
        config = converter("MXFP8LinearConverter", "mx").Config
        converters.append(config(fqns=include_fqns(model_config, "mxfp8"), **options))
    if BLOCKSCALED_LAYERS.get("nvfp4"):
        options.pop("linears_saving_inputs_for_backward_in_mxfp8", None)  # an MXFP8 setting only
        config = converter("NVFP4LinearConverter", "nvfp4").Config
        converters.append(config(fqns=include_fqns(model_config, "nvfp4"), **options))
    return converters
'''


@register_export_target
class Torchtitan(ExportTarget):
    name = "torchtitan"
    suffix = ".py"
    summary = "Float8/MXFP8/NVFP4 converter configs that convert exactly the policy's fp8, mxfp8 and nvfp4 layers"
    switch = (
        "a second converter set: at each phase's first step, resume the run from its checkpoint with that phase's "
        "file as the model's converters (torchtitan applies them when it builds the model)"
    )

    def write(self, policy: Policy, out: str | Path, *, source: str = "a policy", **options: object) -> list[str]:
        write_text(out, torchtitan_source(policy, source=source))
        left_out = torchtitan_not_expressed(policy)
        if titan_fp8_layers(policy):
            return left_out
        if blockscaled_layers(policy):
            return [
                *left_out,
                "the policy has no fp8 layer torchtitan can run: the file's float8_converters() returns "
                "[] (its blockscaled_converters() converts the mxfp8/nvfp4 layers)",
            ]
        return [*left_out, "the policy has no fp8 layer torchtitan can run: the file's float8_converters() returns []"]

    def resolve(self, exported: Path, module_names: list[str]) -> dict[str, Resolved]:
        return torchtitan_resolve(exported, module_names)


def torchtitan_resolve(exported: Path, module_names: list[str]) -> dict[str, Resolved]:
    """What torchtitan runs each linear in under the file's converters, float8_converters() then
    blockscaled_converters() as its header says, computed from its tables with the functions it holds (checked to
    be autoprec's: skip_list, include_list) and torchtitan's own selection rules: Float8LinearConverter.convert
    converts each Linear.Config that no filter_fqns entry is a substring of (components/quantization/utils.py,
    module_filter_fn); MXFP8/NVFP4LinearConverter.convert each one an fqns entry is a substring of, every one for
    an empty list (mx.py, nvfp4.py). Each traverses model_config.traverse(Linear.Config), which yields converted
    configs too (Float8Linear.Config and the others subclass Linear.Config): a later converter re-converts what it
    selects. A selected router gate is refused (the main branch's _validate_quantizable_linear). torchtitan's
    dimension rule for float8 (in and out features divisible by 16) needs the layers' shapes and is not read."""
    tree = read_python(exported)
    same_module(tree, torchtitan_source(Policy(layers={})), exported, ("FP8_LAYERS", "BLOCKSCALED_LAYERS"))
    fp8 = str_table(assigned(tree, "FP8_LAYERS", exported), "FP8_LAYERS", exported)
    blocks = str_table(assigned(tree, "BLOCKSCALED_LAYERS", exported), "BLOCKSCALED_LAYERS", exported)
    converters = []  # (how it is named, does it select this fqn, the GEMMs it runs)
    try:
        for recipe, keep in fp8.items():
            fmt = next((f for f in Format if recipe_key(f) == recipe), None)
            if fmt is None:
                raise ValueError(f"FP8_LAYERS recipe {recipe!r} is not one torchao names (torchtitan: {TORCHTITAN_RECIPES})")
            skip = skip_list(_names(module_names, keep), keep)
            converters.append(
                (f"Float8LinearConverter({recipe})", lambda fqn, skip=skip: not any(s in fqn for s in skip), policy_gemms(fmt))
            )
        for kind in BLOCKSCALED_CONVERTERS:
            if blocks.get(kind):
                fqns = include_list(_names(module_names, blocks[kind]), blocks[kind], kind)
                gemms = (kind, kind, kind)  # both converters run all three GEMMs in their format
                converters.append(
                    (
                        f"{BLOCKSCALED_CONVERTERS[kind]}(fqns={fqns})",
                        lambda fqn, fqns=fqns: not fqns or any(f in fqn for f in fqns),
                        gemms,
                    )
                )
    except ValueError as exc:
        raise UserError(f"{exported}: torchtitan refuses its converters for this model: {exc}") from None
    found = {}
    for name in module_names:
        selected = [(how, gemms) for how, selects, gemms in converters if selects(name)]
        if not selected:
            found[name] = Resolved(HIGH, "no converter selects it")
        elif ROUTER_GATE.fullmatch(name):
            found[name] = Resolved(None, f"a router gate selected by {selected[-1][0]}: torchtitan refuses to convert it")
        else:
            again = f" (re-converting what {', '.join(h for h, _ in selected[:-1])} converted)" if len(selected) > 1 else ""
            found[name] = Resolved(selected[-1][1], selected[-1][0] + again)
    return found


def _names(module_names: list[str], keep: list[str]) -> list[str]:
    """The file's linear_names(): the model's Linears, refusing a listed layer the model lacks."""
    missing = sorted(set(keep) - set(module_names))
    if missing:  # a mistyped name: torchtitan's linear_names() raises, so the file converts nothing
        close = difflib.get_close_matches(missing[0], module_names, n=3)
        resembles = f" ({missing[0]!r} is close to {', '.join(map(repr, close))})" if close else ""
        raise ValueError(f"policy layers {missing[:5]} are not Linear layers of this model{resembles}")
    return module_names
