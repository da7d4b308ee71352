"""`--to torchao`: a Python file with the fp8 layers per recipe (or per-GEMM mix: its format's name), each one's
GEMMs as data, the recipes whose weights FSDP2 all-gathers in fp8 (the policy's fsdp_fp8_all_gather), the one
function that builds their Float8LinearConfig (autoprec.formats.float8_linear_config, its source copied), a
`module_filter_fn` per recipe for `torchao.float8.convert_to_float8_training`, and `convert(model)`.

The MXFP8 layers (mxfp8, and mxfp8-fwd-dgrad: MXFP8 fprop and dgrad, wgrad in high precision) are converted beside
them with torchao 0.18's MX training config, `MXFP8TrainingOpConfig.from_recipe(MXFP8TrainingRecipe(name))`
(torchao/prototype/moe_training/config.py: "mxfp8_rceil", "mxfp8_rceil_wgrad_with_hp"), applied by
`torchao.quantization.quantize_` with a filter per recipe (MX_LAYERS): torchao swaps each selected module's
parameters for MXFP8TrainingWeightWrapperTensor, whose linear runs the recipe. torchao has no other MX or NVFP4 training
recipe for a Linear, so the other block-scaled formats are listed as not expressed.
"""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path

from autoprec.errors import UserError, shown
from autoprec.files import write_text
from autoprec.formats import Format, float8_linear_config, fp8_input_dtype
from autoprec.policy import ROOT, Policy
from autoprec.tune.export._common import (
    GEMM_NAMES,
    _comments,
    _json_literal,
    assigned,
    blockscaled_recipe,
    fp8_layers,
    gathered_recipes,
    not_expressed,
    read_python,
    recipe_key,
    same_module,
    str_list,
    str_table,
)
from autoprec.tune.export.base import HIGH, ExportTarget, Gemms, Resolved, register_export_target

# torchao's Float8LinearRecipeName values -> (their scaling, which GEMMs run in fp8), as
# Float8LinearConfig.from_recipe_name builds them (torchao/float8/config.py): rowwise_with_gw_hp keeps wgrad high
TORCHAO_RECIPES = {
    "tensorwise": ("tensorwise", (True, True, True)),
    "rowwise": ("rowwise", (True, True, True)),
    "rowwise_with_gw_hp": ("rowwise", (True, True, False)),
}


# autoprec's block-scaled recipe names (blockscaled_recipe) -> torchao 0.18's MXFP8TrainingRecipe values that run them
# (MXFP8TrainingOpConfig.from_recipe: both RCEIL scales, e4m3 elements in blocks of 32, as autoprec's MXFP8), and each
# one's GEMMs: wgrad_with_hp keeps wgrad in high precision
TORCHAO_MX_RECIPES = {"mxfp8": "mxfp8_rceil", "mxfp8_rceil_wgrad_with_hp": "mxfp8_rceil_wgrad_with_hp"}
MX_GEMMS: dict[str, Gemms] = {"mxfp8_rceil": ("mxfp8", "mxfp8", "mxfp8"), "mxfp8_rceil_wgrad_with_hp": ("mxfp8", "mxfp8", None)}


def mx_formats() -> frozenset[Format]:
    """The formats the file converts with torchao's MX training config."""
    return frozenset(f for f in Format if blockscaled_recipe(f) in TORCHAO_MX_RECIPES)


def mx_layers(policy: Policy) -> dict[str, list[str]]:
    """torchao MXFP8TrainingRecipe value -> the policy's layers in it, in the policy's order; never the model root
    (root_not_expressed says it: quantize_ would give '' to the root module, every parameter of the model)."""
    found: dict[str, list[str]] = {}
    for name, fmt in policy.layers.items():
        recipe = TORCHAO_MX_RECIPES.get(blockscaled_recipe(fmt) or "")
        if recipe is not None and name != ROOT:
            found.setdefault(recipe, []).append(name)
    return found


def fp8_gemms(policy: Policy) -> dict[str, dict[str, object]]:
    """recipe_key -> its GEMMs as float8_linear_config reads them, for the policy's fp8 formats."""
    return {
        key: gemms.to_json()
        for fmt in policy.layers.values()
        if (gemms := fmt.family.fp8_gemms(fmt)) and (key := recipe_key(fmt))
    }


def torchao_source(policy: Policy, *, source: str = "a policy") -> str:
    """The torchao file's text (see the module docstring)."""
    recipes = fp8_layers(policy)
    gemms = fp8_gemms(policy)
    # autoprec's own code: one config builder and one input rule for apply_policy and this file
    builder = inspect.getsource(fp8_input_dtype) + "\n\n" + inspect.getsource(float8_linear_config)
    last = None if recipes or mx_layers(policy) else "The policy has no fp8 or MXFP8 layer: convert(model) changes nothing."
    header = _comments(
        source,
        "not expressed here (torchao's float8 and MXFP8 training conversions know their recipes only)",
        torchao_not_expressed(policy),
        last,
    )
    return f'''"""torchao float8 training for a policy's fp8 layers (written by `autoprec export --to torchao`).

    from this_file import convert
    model = convert(model)   # before torch.compile, after moving the model to its device

It runs inside or outside torch.autocast: each converted layer runs with autocast off and its input cast by the
rule apply_policy uses (fp8_input_dtype), so torchao computes the same on a CPU as on CUDA and a per-GEMM mix's
high-precision GEMMs get operands of one dtype; outside autocast its output comes back in the input's dtype. Unlike
apply_policy it does not pad: on a GPU, keep every batch's token count divisible by 16 and never empty. Where
FSDP_FP8_ALL_GATHER names a recipe, FSDP2 (fully_shard after convert) all-gathers its layers' weights in fp8: call
torchao.float8.precompute_float8_dynamic_scale_for_fsdp(model) after each optimizer step, as the search did. The
comments below name the policy file and what the file leaves out.

MX_LAYERS' layers are converted by torchao's MX training config for their MXFP8TrainingRecipe (quantize_ with
mx_filter_fn): they run torchao's MXFP8 kernels (a GPU of compute capability 10.0) and return bf16, the recipe's
out_dtype; torchao keeps a layer's first MX conversion, so a layer listed twice runs the first recipe.
"""

{header}

from __future__ import annotations

import dataclasses
import json
import types
from typing import Any

import torch
from torchao.float8 import convert_to_float8_training

# torchao recipe (or autoprec's name for a per-GEMM mix) -> the fully qualified names of its nn.Linear layers
FP8_LAYERS = {_json_literal(recipes)}

# the same keys -> which GEMMs run in fp8 (fprop, dgrad, wgrad; the others in high precision) and their scaling
FP8_GEMMS = {_json_literal(gemms)}

# the FP8_LAYERS keys whose weights FSDP2 all-gathers in fp8 (torchao's enable_fsdp_float8_all_gather)
FSDP_FP8_ALL_GATHER = {_json_literal(gathered_recipes(policy))}

# torchao MXFP8TrainingRecipe value ("mxfp8_rceil", "mxfp8_rceil_wgrad_with_hp") -> the fully qualified names of its
# nn.Linear layers, converted with MXFP8TrainingOpConfig.from_recipe
MX_LAYERS = {_json_literal(mx_layers(policy))}


{builder}

def module_filter_fn(recipe):
    """For convert_to_float8_training: True for the layers this policy runs in `recipe`."""
    names = frozenset(FP8_LAYERS[recipe])
    return lambda module, fqn: fqn in names


def mx_filter_fn(recipe):
    """For quantize_: True for the layers this policy runs in torchao's MX training recipe `recipe`."""
    names = frozenset(MX_LAYERS[recipe])
    return lambda module, fqn: fqn in names


def cast_forward(layer, gemms):
    """The layer's forward with autocast off and its input cast by fp8_input_dtype (see the docstring). The class's
    forward, called on `self`: a deep copy of the model (an EMA, an eval copy) computes with its own weights."""
    inner = type(layer).forward

    def forward(self, input):
        dev = input.device.type
        outer = torch.is_autocast_enabled(dev)
        dtype = fp8_input_dtype(gemms, self.weight.dtype, torch.get_autocast_dtype(dev) if outer else None)
        with torch.autocast(dev, enabled=False):
            out = inner(self, input.to(dtype))
        return out if outer else out.to(input.dtype)

    layer.forward = types.MethodType(forward, layer)


def convert(model):
    for recipe in FP8_LAYERS:
        config = float8_linear_config(FP8_GEMMS[recipe])
        config = dataclasses.replace(config, enable_fsdp_float8_all_gather=recipe in FSDP_FP8_ALL_GATHER)
        model = convert_to_float8_training(model, config=config, module_filter_fn=module_filter_fn(recipe))
        for name in FP8_LAYERS[recipe]:
            cast_forward(model.get_submodule(name), FP8_GEMMS[recipe])
    if MX_LAYERS:
        from torchao.prototype.moe_training.config import MXFP8TrainingOpConfig, MXFP8TrainingRecipe
        from torchao.quantization import quantize_

        for recipe in MX_LAYERS:
            for name in MX_LAYERS[recipe]:
                model.get_submodule(name)  # a name the model lacks raises here, as for the fp8 layers
            config = MXFP8TrainingOpConfig.from_recipe(MXFP8TrainingRecipe(recipe))
            quantize_(model, config, filter_fn=mx_filter_fn(recipe))
    return model
'''


def torchao_not_expressed(policy: Policy) -> list[str]:
    """not_expressed, less the MXFP8 formats the file converts with torchao's MX training config."""
    return not_expressed(policy, skip=mx_formats())


@register_export_target
class Torchao(ExportTarget):
    name = "torchao"
    suffix = ".py"
    summary = "a module_filter_fn file for convert_to_float8_training (fp8) and quantize_ (MXFP8)"

    def write(self, policy: Policy, out: str | Path, *, source: str = "a policy", **options: object) -> list[str]:
        write_text(out, torchao_source(policy, source=source))
        left_out = torchao_not_expressed(policy)
        if fp8_layers(policy) or mx_layers(policy):
            return left_out
        return [*left_out, "the policy has no fp8 or MXFP8 layer: the file's convert(model) changes nothing"]

    def resolve(self, exported: Path, module_names: list[str]) -> dict[str, Resolved]:
        return torchao_resolve(exported, module_names)


def converted(spec: dict, key: str) -> tuple[Gemms, bool] | str:
    """What the file's convert() runs a layer of FP8_GEMMS[key] (`spec`) in, read by the rules of the code it holds
    (float8_linear_config, fp8_input_dtype): (its GEMMs, whether its weight is scaled rowwise); a string saying why
    torchao refuses it. A `recipe` that is not None is a torchao recipe name, whatever the flags say
    (Float8LinearConfig.from_recipe_name, which asserts a name it has); else `scaling` == "rowwise" scales rowwise
    and anything else per tensor, and a GEMM runs in fp8 where its flag is truthy (`if not gemms[gemm]`), 1 or
    "yes" as well as true."""
    try:
        recipe = spec["recipe"]
        if recipe is not None:
            if type(recipe) is not str or recipe not in TORCHAO_RECIPES:
                return (
                    f"FP8_GEMMS[{key!r}]['recipe'] {shown(recipe, 40)} is no torchao recipe "
                    f"({', '.join(TORCHAO_RECIPES)}): torchao's Float8LinearConfig.from_recipe_name refuses it"
                )
            scaling, on = TORCHAO_RECIPES[recipe]
        else:
            scaling = "rowwise" if spec["scaling"] == "rowwise" else "tensorwise"
            fprop, dgrad, wgrad = (bool(spec[gemm]) for gemm in GEMM_NAMES)
            on = fprop, dgrad, wgrad
    except KeyError as exc:  # the file's code reads each of them with []
        return f"FP8_GEMMS[{key!r}] has no {shown(exc.args[0], 40)}: the file's convert() raises KeyError"
    gemms = tuple(f"fp8 {scaling}" if fp8 else None for fp8 in on)
    return (gemms[0], gemms[1], gemms[2]), scaling == "rowwise" and on[0]


def torchao_resolve(exported: Path, module_names: list[str]) -> dict[str, Resolved]:
    """What the file's convert(model) runs each linear in, read from its tables. convert() calls torchao's
    convert_to_float8_training once per FP8_LAYERS key, in order, with module_filter_fn(recipe) = `fqn in
    FP8_LAYERS[recipe]` and the config float8_linear_config(FP8_GEMMS[recipe]) (read by `converted`); torchao
    (torchao/float8/float8_linear_utils.py, swap_linear_layers) swaps every nn.Linear the filter accepts,
    Float8Linear included, so a layer in two lists ends in the later one's config, whose
    enable_fsdp_float8_all_gather is `recipe in FSDP_FP8_ALL_GATHER`. Then it calls quantize_ once per MX_LAYERS
    key, in order, with MXFP8TrainingOpConfig.from_recipe(key) and mx_filter_fn(key); torchao's _swap_params skips a
    parameter it already wrapped, so a layer in two MX lists keeps the first recipe (MX_GEMMS), and one in a float8
    list too runs neither as written (unresolved). A listed name no linear of the model has is given too: convert()
    looks every listed name up (get_submodule), so nothing of the file runs as it says."""
    tree = read_python(exported)
    tables = ("FP8_LAYERS", "FP8_GEMMS", "FSDP_FP8_ALL_GATHER", "MX_LAYERS")
    same_module(tree, torchao_source(Policy(layers={})), exported, tables)
    gathered = str_list(assigned(tree, "FSDP_FP8_ALL_GATHER", exported), "FSDP_FP8_ALL_GATHER", exported)
    layers = str_table(assigned(tree, "FP8_LAYERS", exported), "FP8_LAYERS", exported)
    mx = str_table(assigned(tree, "MX_LAYERS", exported), "MX_LAYERS", exported)
    gemms = assigned(tree, "FP8_GEMMS", exported)
    if not isinstance(gemms, dict) or not all(isinstance(gemms.get(k), dict) for k in layers):
        raise UserError(f"{exported}: FP8_GEMMS must give each FP8_LAYERS key its GEMMs ({', '.join(layers)})")
    found = {name: Resolved(HIGH, "no module_filter_fn accepts it") for name in module_names}
    known = set(module_names)
    missing = "convert() looks it up by name (get_submodule)"
    for recipe, names in layers.items():
        runs = converted(gemms[recipe], recipe)
        gather = recipe in gathered
        via = f"module_filter_fn({recipe!r})" + (", fp8 all-gather" if gather else "")
        for name in names:
            if name not in known:
                found[name] = Resolved(None, f"{via}: {missing}")
            elif isinstance(runs, str):
                found[name] = Resolved(None, f"{via}: {runs}")
            elif gather and runs[1]:  # torchao's Float8LinearConfig asserts a tensorwise weight to all-gather
                found[name] = Resolved(None, f"{via}: torchao all-gathers in fp8 with tensorwise scaling only")
            else:
                found[name] = Resolved(runs[0], via, fp8_all_gather=gather)
    float8 = {name for names in layers.values() for name in names}
    mx_done: dict[str, str] = {}  # layer -> the MX recipe torchao wrapped it in first
    for recipe, names in mx.items():
        via = f"mx_filter_fn({recipe!r}): MXFP8TrainingOpConfig.from_recipe({recipe!r})"
        for name in names:
            if recipe not in MX_GEMMS:
                found[name] = Resolved(
                    None, f"{via}: no MXFP8TrainingRecipe {shown(recipe, 40)} ({', '.join(MX_GEMMS)}): torchao raises"
                )
            elif name not in known:
                found[name] = Resolved(None, f"{via}: {missing}")
            elif name in float8:
                found[name] = Resolved(None, f"{via}, after convert_to_float8_training converted it: both convert it")
            elif name not in mx_done:
                mx_done[name] = recipe
                found[name] = Resolved(MX_GEMMS[recipe], via)
            elif mx_done[name] != recipe:
                found[name] = dataclasses.replace(found[name], via=f"{found[name].via} (first; then {recipe!r}, kept out)")
    return found
