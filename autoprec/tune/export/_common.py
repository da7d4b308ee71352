"""What the export targets share: how an fp8 format's GEMMs are named (recipe_key), the policy's fp8 layers per
recipe, what an fp8-only target leaves out, and the two ways text from a policy enters a written Python file (an
escaped comment, JSON string data), so that nothing read from a policy becomes code (see the package docstring)."""

from __future__ import annotations

import json

from autoprec.errors import printable
from autoprec.formats import Format
from autoprec.formats.blockscaled import BlockScaledFamily
from autoprec.policy import ROOT, Policy

SHOWN = 6  # layer names per line; the rest are counted (the policy file lists them all)


def recipe_key(fmt: Format) -> str | None:
    """How the export names an fp8 format's GEMMs: torchao's recipe name, or the format's own name for a per-GEMM
    mix torchao has no recipe for; None for a format torchao's float8 training does not run."""
    return fmt.family.export_name(fmt)


def _layers(names: list[str], verb: str = "runs") -> str:
    """ "layer 'a' runs" or "3 layers ('a', 'b', 'c') run": one line per reason, however many layers."""
    if len(names) == 1:
        return f"layer {names[0]!r} {verb}"
    shown = ", ".join(repr(n) for n in names[:SHOWN]) + (f" and {len(names) - SHOWN} more" if len(names) > SHOWN else "")
    return f"{len(names)} layers ({shown}) {verb.removesuffix('s')}"


def blockscaled_gemms(fmt: Format) -> tuple[str | None, str | None, str | None] | None:
    """A block-scaled format's (fprop, dgrad, wgrad) element formats, "mxfp8", "nvfp4" or None (high precision), as
    its family says them (gemm_precisions); None for a format of another family."""
    if fmt.family.name != "blockscaled":
        return None
    fprop, dgrad, wgrad = (None if g == "fp32" else g for g in fmt.family.gemm_precisions(fmt))
    return fprop, dgrad, wgrad


def blockscaled_recipe(fmt: Format) -> str | None:
    """What the training frameworks call a block-scaled format's recipe (BlockScaledFamily.recipe_name: "mxfp8",
    "nvfp4", "mxfp8_rceil_wgrad_with_hp"); None for the other per-GEMM mixes and for other families' formats."""
    family = fmt.family
    return family.recipe_name(fmt) if isinstance(family, BlockScaledFamily) else None


def layer_only(fmt: Format) -> bool:
    """Whether `fmt` runs in named Linear layers only, never as a whole model's ops (its family has a root_problem:
    the fp8 and block-scaled formats, which the export targets call quantized recipes)."""
    return fmt.family.root_problem(fmt) is not None


def layer_only_root(policy: Policy) -> Format | None:
    """The model root's format where it is layer-only (apply_policy refuses such a root too); None otherwise. No
    target writes such a root as a layer: it would name the model itself, or, where the tool reads '' as a name,
    modules the policy never named."""
    fmt = policy.layers.get(ROOT)
    return fmt if fmt is not None and layer_only(fmt) else None


def root_not_expressed(policy: Policy, why: str = "") -> list[str]:
    """A line for a model root in a layer-only format (layer_only_root), which every target leaves out of its file;
    `why` adds what writing it would do in the target's tool. None where the root is in another format."""
    fmt = layer_only_root(policy)
    if fmt is None:
        return []
    return [
        f"the model root (every op outside a listed layer) runs in {fmt.value}, a format of named Linear layers only "
        f"(autoprec.apply_policy refuses such a root too: list the Linear layers by name){why}; not in the export"
    ]


def not_expressed(policy: Policy, tool: str = "torchao", skip: frozenset[Format] = frozenset()) -> list[str]:
    """What an fp8-only target leaves out: a lowered root and the non-fp8, non-fp32 layers per format, as lines.
    `skip`: formats the target writes, or reports in lines of its own."""
    lines = root_not_expressed(policy)
    by_format: dict[Format, list[str]] = {}
    for name, fmt in policy.layers.items():
        if name == ROOT and lines:
            continue
        if recipe_key(fmt) is None and fmt is not Format.FP32 and fmt not in skip:
            by_format.setdefault(fmt, []).append(name)
    why = f"not a {tool} float8 recipe, so not in the export; run it with autocast or autoprec.apply_policy"
    for fmt, names in by_format.items():
        if ROOT in names:
            lines.append(f"the model root (every op outside a listed layer) runs in {fmt.value}: {why}")
            names = [n for n in names if n != ROOT]
        if names:
            lines.append(f"{_layers(names)} in {fmt.value}: {why}")
    return lines


def fp32_under_a_lowered_root(policy: Policy, tool: str) -> list[str]:
    """A line for the layers a policy keeps in fp32 inside a lowered model root (the search's protection of them),
    for a target that runs every module it has no recipe for in the model's dtype; none where the root is fp32 or
    a layer-only format (no model dtype: root_not_expressed says it)."""
    root = policy.layers.get(ROOT)
    names = [n for n, f in policy.layers.items() if n != ROOT and f is Format.FP32]
    if root is None or root is Format.FP32 or layer_only_root(policy) is not None or not names:
        return []
    return [
        f"{_layers(names)} in fp32 inside a {root.value} model root: {tool} runs a module it has no recipe for in the "
        f"model's dtype ({root.value} if the model is); keep {'them' if len(names) > 1 else 'it'} in fp32 by hand"
    ]


def fp8_layers(policy: Policy) -> dict[str, list[str]]:
    """torchao recipe (recipe_key) -> the policy's layers in it, in the policy's order; never the model root (an fp8
    root is a layer-only root: root_not_expressed says it)."""
    recipes: dict[str, list[str]] = {}
    for name, fmt in policy.layers.items():
        key = recipe_key(fmt)
        if key is not None and name != ROOT:
            recipes.setdefault(key, []).append(name)
    return recipes


def _comments(source: str, title: str, lines: list[str], last: str | None) -> str:
    """The policy file's name and what is not expressed, as comment lines: escaped (errors.printable), so that
    no line break or control character from the policy or its file name reaches the code or a terminal."""
    out = [f"# policy file: {printable(source)}", f"# {title}:"]
    out += [f"#   - {printable(line)}" for line in lines] or ["#   (nothing: every listed layer is fp8 or fp32)"]
    return "\n".join(out + (["#", f"# {last}"] if last else []))


def _json_literal(value: object) -> str:
    """Python source for `json.loads(<value as JSON>)`, the JSON text in string literals (repr escapes every quote,
    backslash and line break; json.dumps writes ASCII): a layer name is data here, whatever it holds."""
    lines = json.dumps(value, indent=4).splitlines(keepends=True)
    return "json.loads(\n" + "".join(f"    {line!r}\n" for line in lines) + ")"
