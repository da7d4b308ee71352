"""`--to torchao`: a Python file with the fp8 layers per recipe (or per-GEMM mix: its format's name), each one's
GEMMs as data, the recipes whose weights FSDP2 all-gathers in fp8 (the policy's fsdp_fp8_all_gather), the one
function that builds their Float8LinearConfig (autoprec.formats.float8_linear_config, its source copied), a
`module_filter_fn` per recipe for `torchao.float8.convert_to_float8_training`, and `convert(model)`.
"""

from __future__ import annotations

import inspect
from pathlib import Path

from autoprec.errors import UserError, shown
from autoprec.files import write_text
from autoprec.formats import float8_linear_config, fp8_input_dtype
from autoprec.policy import Policy
from autoprec.tune.export._common import (
    GEMM_NAMES,
    _comments,
    _json_literal,
    assigned,
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
    last = None if recipes else "The policy has no fp8 layer: convert(model) changes nothing."
    header = _comments(
        source, "not expressed here (torchao's float8 conversion knows fp8 recipes only)", not_expressed(policy), last
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


{builder}

def module_filter_fn(recipe):
    """For convert_to_float8_training: True for the layers this policy runs in `recipe`."""
    names = frozenset(FP8_LAYERS[recipe])
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
    return model
'''


@register_export_target
class Torchao(ExportTarget):
    name = "torchao"
    suffix = ".py"
    summary = "a module_filter_fn file for convert_to_float8_training"

    def write(self, policy: Policy, out: str | Path, *, source: str = "a policy", **options: object) -> list[str]:
        write_text(out, torchao_source(policy, source=source))
        left_out = not_expressed(policy)
        if fp8_layers(policy):
            return left_out
        return [*left_out, "the policy has no fp8 layer: the file's convert(model) changes nothing"]

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
    enable_fsdp_float8_all_gather is `recipe in FSDP_FP8_ALL_GATHER`. A listed name no linear of the model has is
    given too: convert() looks every listed name up (get_submodule), so nothing of the file runs as it says."""
    tree = read_python(exported)
    tables = ("FP8_LAYERS", "FP8_GEMMS", "FSDP_FP8_ALL_GATHER")
    same_module(tree, torchao_source(Policy(layers={})), exported, tables)
    gathered = str_list(assigned(tree, "FSDP_FP8_ALL_GATHER", exported), "FSDP_FP8_ALL_GATHER", exported)
    layers = str_table(assigned(tree, "FP8_LAYERS", exported), "FP8_LAYERS", exported)
    gemms = assigned(tree, "FP8_GEMMS", exported)
    if not isinstance(gemms, dict) or not all(isinstance(gemms.get(k), dict) for k in layers):
        raise UserError(f"{exported}: FP8_GEMMS must give each FP8_LAYERS key its GEMMs ({', '.join(layers)})")
    found = {name: Resolved(HIGH, "no module_filter_fn accepts it") for name in module_names}
    known = set(module_names)
    for recipe, names in layers.items():
        runs = converted(gemms[recipe], recipe)
        gather = recipe in gathered
        via = f"module_filter_fn({recipe!r})" + (", fp8 all-gather" if gather else "")
        for name in names:
            if name not in known:
                found[name] = Resolved(None, f"{via}: convert() looks it up by name (get_submodule)")
            elif isinstance(runs, str):
                found[name] = Resolved(None, f"{via}: {runs}")
            elif gather and runs[1]:  # torchao's Float8LinearConfig asserts a tensorwise weight to all-gather
                found[name] = Resolved(None, f"{via}: torchao all-gathers in fp8 with tensorwise scaling only")
            else:
                found[name] = Resolved(runs[0], via, fp8_all_gather=gather)
    return found
