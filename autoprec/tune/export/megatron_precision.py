"""`--to megatron-precision`: the YAML file Megatron-LM reads with `--te-precision-config-file`, which gives each
module its own Transformer Engine recipe: the policy's mxfp8, nvfp4 and tensorwise-fp8 linears by name (each in the
recipe megatron.RECIPES gives its format, with its fp8_format), every other module in high precision.

Its schema (NVIDIA/Megatron-LM megatron/core/quantization/quant_config.py, RecipeConfig; and
megatron/core/extensions/transformer_engine.py, TEQuantizationParams / TEQuantizationRecipe): `configs` maps a key to
`{transformer_engine_config_type: TEQuantizationParams, training_recipe: {...}}`, the recipe holding at most one of
`fp8_quantization_recipe` (tensorwise, blockwise, mxfp8, custom) and `fp4_quantization_recipe` (nvfp4, custom), an
empty recipe being high precision; `matchers` is an ordered map of `{type: glob, enabled: true, pattern, config}`, the
first whose fnmatch pattern matches a module's path (GPTModel.named_modules()) choosing its config. A matcher without
`enabled: true` is skipped silently (`matcher.get("enabled", False)`), so every matcher here sets it. Each pattern is
a layer name with its glob characters escaped (glob.escape), so it matches that module only.

A quantized config sets `override_nonquantized_autocast: true`, so the module runs its recipe also where no global
--fp8/--fp4 recipe is on; the last matcher, "*", gives every other module the high-precision config, which overrides
a global recipe (override_quantized_autocast defaults to true): the modules run as the policy says. Per-GEMM mixes
(mxfp8-fwd, nvfp4-fwd-dgrad, ...) have no built-in recipe there (one recipe per module) and are listed as not
expressed; so are rowwise fp8 layers (Megatron has no rowwise recipe) and layers in a dtype other than the model's.
"""

from __future__ import annotations

import glob
from pathlib import Path

import yaml

from autoprec.errors import printable
from autoprec.files import write_text
from autoprec.formats import Format
from autoprec.policy import ROOT, Policy
from autoprec.tune.export._common import _layers, fp32_under_a_lowered_root, root_not_expressed
from autoprec.tune.export.base import ExportTarget, register
from autoprec.tune.export.megatron import megatron_recipe, misnumbered, misnumbered_lines

HIGH_PRECISION = "high_precision"  # the config key of the default matcher's (empty) recipe


def module_recipe(fmt: Format) -> dict[str, object] | None:
    """The TEQuantizationRecipe fields that run `fmt` in Megatron (its recipe, megatron.RECIPES), or None where none
    does. TEQuantizationRecipe has no fp4 format field: nvfp4's is e2m1."""
    twin = megatron_recipe(fmt)
    if twin is None:
        return None
    fmt_field = {"fp8_format": twin.format} if twin.precision == "fp8" else {}
    return {f"{twin.precision}_quantization_recipe": twin.recipe, **fmt_field}


def _key(fmt: Format) -> str:
    return fmt.value.replace("-", "_")


def precision_config(policy: Policy) -> tuple[dict[str, object], list[str]]:
    """(the YAML's content, what it cannot express)."""
    configs: dict[str, object] = {}
    matchers: dict[str, object] = {}
    left_out: dict[tuple[Format, str], list[str]] = {}
    root = root_not_expressed(policy, ": a '*' matcher in its recipe would run every module in it")
    unnamed = misnumbered(policy)  # a pattern of one would match no module of GPTModel.named_modules()
    for name, fmt in policy.layers.items():
        recipe = module_recipe(fmt)
        if (name == ROOT and root) or name in unnamed:
            continue
        if recipe is None or name == ROOT:
            if fmt is not Format.FP32:
                if fmt.family.name == "blockscaled":
                    why = "a per-GEMM mix: Megatron's per-module config gives a module one recipe for all its GEMMs"
                elif fmt.spec.fp8 is not None:
                    why = "an fp8 recipe Megatron has no twin for (its per-module fp8 recipes: tensorwise, blockwise, mxfp8)"
                else:
                    why = (
                        "Megatron runs a module without a quantization recipe in the model's dtype, which this file does not set"
                    )
                left_out.setdefault((fmt, why), []).append(name)
            continue
        key = _key(fmt)
        configs.setdefault(
            key,
            {
                "transformer_engine_config_type": "TEQuantizationParams",
                "training_recipe": {**recipe, "override_nonquantized_autocast": True},
            },
        )
        matchers[f"layer_{len(matchers)}_{key}"] = {"type": "glob", "enabled": True, "pattern": glob.escape(name), "config": key}
    configs[HIGH_PRECISION] = {"transformer_engine_config_type": "TEQuantizationParams", "training_recipe": {}}
    matchers["every_other_module"] = {"type": "glob", "enabled": True, "pattern": "*", "config": HIGH_PRECISION}
    lines = []
    for (fmt, why), names in left_out.items():
        if ROOT in names:
            lines.append(f"the model root (every op outside a listed layer) runs in {fmt.value}: {why}")
            names = [n for n in names if n != ROOT]
        if names:
            lines.append(f"{_layers(names)} in {fmt.value}: {why}")
    return {"configs": configs, "matchers": matchers}, [
        *root,
        *lines,
        *misnumbered_lines(unnamed),
        *fp32_under_a_lowered_root(policy, "Megatron"),
    ]


def precision_yaml(policy: Policy, *, source: str = "a policy") -> tuple[str, list[str]]:
    """The YAML file's text, and what it cannot express (also its comments, escaped)."""
    content, lines = precision_config(policy)
    if len(content["matchers"]) == 1:  # type: ignore[arg-type]
        lines = [*lines, "the policy has no layer in a recipe Megatron runs per module: every module runs in high precision"]
    head = [
        "# Megatron-LM --te-precision-config-file (written by `autoprec export --to megatron-precision`)",
        f"# policy file: {printable(source)}",
        "# not expressed here:",
    ]
    head += [f"#   - {printable(line)}" for line in lines] or ["#   (nothing)"]
    body = yaml.safe_dump(content, sort_keys=False, allow_unicode=False, width=1000)
    return "\n".join(head) + "\n" + body, lines


@register
class MegatronPrecision(ExportTarget):
    name = "megatron-precision"
    suffix = ".yaml"
    summary = "Megatron-LM's per-module --te-precision-config-file (mxfp8, nvfp4, tensorwise fp8 per linear)"

    def write(self, policy: Policy, out: str | Path, *, source: str = "a policy", **options: object) -> list[str]:
        text, lines = precision_yaml(policy, source=source)
        write_text(out, text)
        return lines
