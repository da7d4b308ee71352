"""A policy's fp8 layers in another training tool's terms (`autoprec export`). What the target cannot express
(bf16 or fp16 layers, a lowered model root, a recipe or a layer set the tool has no setting for) is listed, never
dropped silently; nothing is put in fp8 that the policy did not measure in that recipe.

- `torchao`: a Python file with the fp8 layers per recipe (or per-GEMM mix: its format's name), each one's GEMMs
  as data, the one function that builds their Float8LinearConfig (autoprec.formats.float8_linear_config, its source
  copied), a `module_filter_fn` per recipe for `torchao.float8.convert_to_float8_training`, and `convert(model)`.
- `torchtitan`: a Python file whose `float8_converters(model_config)` gives torchtitan's
  `Float8LinearConverter.Config` per recipe, its `filter_fqns` (substrings of the layers to skip) computed from
  that model config so that exactly the policy's fp8 layers convert. torchtitan 0.3 offers rowwise recipes only,
  by name: no per-GEMM mix (fp8-fwd, fp8-fwd-dgrad, ...).
- `megatron`: a JSON file of Megatron-core `TransformerConfig` fields and the Megatron-LM arguments that say the
  same. Megatron (through Transformer Engine) runs fp8 per transformer layer, in one contiguous run: the first and
  last layers may stay in the model's dtype. The export takes the longest run of layers that the policy runs wholly
  in torchao's tensorwise recipe (Megatron's `tensorwise`: dynamic per-tensor scales, e4m3 forward, e5m2 gradients);
  it has no per-GEMM mix (Transformer Engine runs all three GEMMs of a linear in fp8 or none).

Nothing read from a policy becomes code in a written Python file: the layer names are JSON text inside string
literals (repr), parsed at import; the policy file's name and the lines about what is left out are comments, their
non-printable characters escaped (errors.printable); the docstrings hold no text from the policy.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import re
from pathlib import Path

from autoprec.errors import UserError, printable, shown
from autoprec.files import write_text
from autoprec.formats import Format, float8_linear_config, fp8_input_dtype
from autoprec.policy import ROOT, Policy

SUFFIXES = {"torchao": ".py", "torchtitan": ".py", "megatron": ".json"}  # target -> the written file's suffix
TARGETS = tuple(SUFFIXES)
TORCHTITAN_RECIPES = ("rowwise", "rowwise_with_gw_hp")  # Float8LinearConverter.Config.recipe_name in torchtitan 0.3
# torchao recipe -> Megatron's (fp8 format, fp8_recipe) that computes the same: only tensorwise has a twin there
MEGATRON_RECIPES = {"tensorwise": ("hybrid", "tensorwise")}
_NUMBERED = re.compile(r"^(?P<stack>.+?)\.(?P<index>\d+)\.(?P<rest>.+)$")  # 'blocks.3.attn.qkv': block 3 of 'blocks'
MAX_LAYERS = 100_000  # transformer layers a megatron export counts: models have hundreds; the export walks them


def recipe_key(fmt: Format) -> str | None:
    """How the export names an fp8 format's GEMMs: torchao's recipe name, or the format's own name for a per-GEMM
    mix torchao has no recipe for; None for a format torchao's float8 training does not run."""
    gemms = fmt.spec.fp8
    return None if gemms is None else gemms.recipe or fmt.value


SHOWN = 6  # layer names per line; the rest are counted (the policy file lists them all)


def _layers(names: list[str], verb: str = "runs") -> str:
    """ "layer 'a' runs" or "3 layers ('a', 'b', 'c') run": one line per reason, however many layers."""
    if len(names) == 1:
        return f"layer {names[0]!r} {verb}"
    shown = ", ".join(repr(n) for n in names[:SHOWN]) + (f" and {len(names) - SHOWN} more" if len(names) > SHOWN else "")
    return f"{len(names)} layers ({shown}) {verb.removesuffix('s')}"


def not_expressed(policy: Policy, tool: str = "torchao") -> list[str]:
    """What an fp8-only target leaves out: a lowered root and the non-fp8, non-fp32 layers per format, as lines."""
    lines: list[str] = []
    by_format: dict[Format, list[str]] = {}
    for name, fmt in policy.layers.items():
        if recipe_key(fmt) is None and fmt is not Format.FP32:
            by_format.setdefault(fmt, []).append(name)
    why = f"not a {tool} float8 recipe, so not in the export; run it with autocast or autoprec.apply_policy"
    for fmt, names in by_format.items():
        if ROOT in names:
            lines.append(f"the model root (every op outside a listed layer) runs in {fmt.value}: {why}")
            names = [n for n in names if n != ROOT]
        if names:
            lines.append(f"{_layers(names)} in {fmt.value}: {why}")
    return lines


def fp8_layers(policy: Policy) -> dict[str, list[str]]:
    """torchao recipe (recipe_key) -> the policy's layers in it, in the policy's order."""
    recipes: dict[str, list[str]] = {}
    for name, fmt in policy.layers.items():
        key = recipe_key(fmt)
        if key is not None:
            recipes.setdefault(key, []).append(name)
    return recipes


def fp8_gemms(policy: Policy) -> dict[str, dict[str, object]]:
    """recipe_key -> its GEMMs as float8_linear_config reads them, for the policy's fp8 formats."""
    return {key: fmt.spec.fp8.to_json() for fmt in policy.layers.values() if fmt.spec.fp8 and (key := recipe_key(fmt))}


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

It runs inside or outside torch.autocast, as apply_policy does: each converted layer runs with autocast off and
its input cast by the rule apply_policy uses (fp8_input_dtype), so torchao computes the same on a CPU as on CUDA
and a per-GEMM mix's high-precision GEMMs get operands of one dtype; outside autocast its output comes back in the
input's dtype. The comments below name the policy file and what the file leaves out.
"""

{header}

from __future__ import annotations

import json
import types
from typing import Any

import torch
from torchao.float8 import convert_to_float8_training

# torchao recipe (or autoprec's name for a per-GEMM mix) -> the fully qualified names of its nn.Linear layers
FP8_LAYERS = {_json_literal(recipes)}

# the same keys -> which GEMMs run in fp8 (fprop, dgrad, wgrad; the others in high precision) and their scaling
FP8_GEMMS = {_json_literal(gemms)}


{builder}

def module_filter_fn(recipe):
    """For convert_to_float8_training: True for the layers this policy runs in `recipe`."""
    names = frozenset(FP8_LAYERS[recipe])
    return lambda module, fqn: fqn in names


def cast_forward(layer, gemms):
    """The layer's forward with autocast off and its input cast by fp8_input_dtype (see the docstring)."""
    inner = layer.forward

    def forward(self, x):
        dev = x.device.type
        outer = torch.is_autocast_enabled(dev)
        dtype = fp8_input_dtype(gemms, self.weight.dtype, torch.get_autocast_dtype(dev) if outer else None)
        with torch.autocast(dev, enabled=False):
            out = inner(x.to(dtype))
        return out if outer else out.to(x.dtype)

    layer.forward = types.MethodType(forward, layer)


def convert(model):
    for recipe in FP8_LAYERS:
        config = float8_linear_config(FP8_GEMMS[recipe])
        model = convert_to_float8_training(model, config=config, module_filter_fn=module_filter_fn(recipe))
        for name in FP8_LAYERS[recipe]:
            cast_forward(model.get_submodule(name), FP8_GEMMS[recipe])
    return model
'''


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


@dataclasses.dataclass(frozen=True)
class MegatronExport:
    """What `--to megatron` writes: the block stack found in the policy's layer names, the transformer layers that
    run in fp8, Megatron-core TransformerConfig fields and the Megatron-LM arguments that say the same, for a model
    of `num_layers` transformer layers."""

    stack: str | None
    num_layers: int
    fp8_layers: tuple[int, ...]
    transformer_config: dict[str, object]
    arguments: str
    not_expressed: tuple[str, ...]
    notes: tuple[str, ...] = ()

    def to_dict(self, source: str) -> dict[str, object]:
        return {"written_by": "autoprec export --to megatron", "policy": source, **dataclasses.asdict(self),
                "fp8_layers": list(self.fp8_layers), "not_expressed": list(self.not_expressed), "notes": list(self.notes)}  # fmt: skip


def _blocks(policy: Policy) -> tuple[str | None, dict[int, dict[str, Format]], dict[str, Format]]:
    """(the numbered stack with the most blocks, its blocks' listed layers by role (the name after the block's
    number), the listed layers outside it)."""
    stacks: dict[str, dict[int, dict[str, Format]]] = {}
    for name, fmt in policy.layers.items():
        match = _NUMBERED.match(name)
        if match:
            digits = match["index"].lstrip("0") or "0"
            if len(digits) > len(str(MAX_LAYERS)) or int(digits) >= MAX_LAYERS:  # int() only of a short one
                index = digits if len(digits) <= 20 else f"{digits[:20]}... ({len(digits)} digits)"
                raise UserError(f"layer {shown(name)} is transformer layer {index} of {shown(match['stack'])}: a "
                                f"Megatron export counts at most {MAX_LAYERS} transformer layers")  # fmt: skip
            stacks.setdefault(match["stack"], {}).setdefault(int(digits), {})[match["rest"]] = fmt
    if not stacks:
        return None, {}, {n: f for n, f in policy.layers.items() if n != ROOT}
    stack = max(stacks, key=lambda s: len(stacks[s]))  # the first among equals: dicts keep the policy's order
    inside = stacks[stack]
    listed = {f"{stack}.{i}.{role}" for i, block in inside.items() for role in block}
    return stack, inside, {n: f for n, f in policy.layers.items() if n != ROOT and n not in listed}


def _longest_run(indices: set[int], count: int) -> tuple[int, int]:
    """The longest [start, stop) of consecutive members of `indices` in range(count); the first among equals."""
    best, start = (0, 0), None
    for i in range(count + 1):
        if i < count and i in indices:
            start = i if start is None else start
        elif start is not None:
            best = max(best, (start, i), key=lambda r: r[1] - r[0])
            start = None
    return best


def _spans(indices: list[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> '0-2, 5, 7-8'."""
    spans: list[list[int]] = []
    for i in sorted(indices):
        if spans and i == spans[-1][1] + 1:
            spans[-1][1] = i
        else:
            spans.append([i, i])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


def megatron_export(policy: Policy, num_layers: int | None = None) -> MegatronExport:
    """The Megatron settings closest to `policy` that run no layer in fp8 the policy did not (module docstring).
    A transformer layer runs fp8 only if the policy lists every role any layer of the stack lists (attention and
    MLP linears, say) and runs each in tensorwise fp8: Megatron would put an unlisted linear in fp8 too.
    `num_layers`: the model's transformer layers (default: as many as the policy names); Megatron counts the
    bf16 layers at the end from it."""
    root = policy.layers.get(ROOT, Format.FP32)
    stack, blocks, outside = _blocks(policy)
    named = max(blocks, default=-1) + 1
    if num_layers is not None and num_layers < 1:
        raise UserError(f"--num-layers {num_layers}: a count of transformer layers, at least 1")
    if num_layers is not None and num_layers > MAX_LAYERS:
        raise UserError(f"--num-layers {num_layers}: at most {MAX_LAYERS} transformer layers (models have hundreds)")
    if num_layers is not None and num_layers < named:
        raise UserError(f"--num-layers {num_layers}: the policy names transformer layer {named - 1} of {stack!r}; "
                        f"give at least {named}")  # fmt: skip
    count = named if num_layers is None else num_layers
    roles = {role for block in blocks.values() for role in block}
    whole = {i for i, block in blocks.items()
             if set(block) == roles and all(recipe_key(f) in MEGATRON_RECIPES for f in block.values())}  # fmt: skip
    start, stop = _longest_run(whole, count)
    lines = []
    model_dtype = root if root in (Format.BF16, Format.FP16) else Format.FP32
    other_dtype: dict[Format, list[str]] = {}  # the model root sets the model's dtype, so it is never listed here
    for name, fmt in policy.layers.items():
        if recipe_key(fmt) is None and fmt is not model_dtype:
            other_dtype.setdefault(fmt, []).append(name)
    for fmt, names in other_dtype.items():
        lines.append(f"{_layers(names)} in {fmt.value}: Megatron runs every layer outside fp8 in the model's dtype "
                     f"({model_dtype.value} here)")  # fmt: skip
    fp8_outside = [name for name, fmt in outside.items() if recipe_key(fmt) is not None]
    if fp8_outside:
        where = f"outside the transformer layers ({stack}.N)" if stack else "with no numbered stack of transformer layers"
        lines.append(f"{_layers(fp8_outside)} in fp8 {where}, where Megatron runs no fp8; left in the model's dtype")
    reasons: dict[str, list[int]] = {}
    for i in range(count):
        block = blocks.get(i, {})
        fp8 = [role for role, f in block.items() if recipe_key(f) is not None]
        if any(recipe_key(block[role]) not in MEGATRON_RECIPES for role in fp8):
            why = (f"a linear in an fp8 recipe Megatron has no twin for (it has torchao's {', '.join(MEGATRON_RECIPES)} "
                   "only, and no per-GEMM mix: all three GEMMs of a linear in fp8)")  # fmt: skip
        elif fp8 and i not in whole:
            why = "some linears in fp8 and some not, or unlisted (Megatron runs a layer's linears all in fp8 or none)"
        elif i in whole and not start <= i < stop:
            why = f"wholly fp8 in the policy, but Megatron runs fp8 in one contiguous run of layers, here {start}-{stop - 1}"
        elif i not in blocks and start < stop:
            why = "not in the policy"
        else:
            continue
        reasons.setdefault(why, []).append(i)
    for why, indices in reasons.items():
        lines.append(f"transformer layers {stack}.{{{_spans(indices)}}}: {why}; left out of fp8")
    config: dict[str, object] = {"bf16": model_dtype is Format.BF16, "fp16": model_dtype is Format.FP16}
    args = [f"--{model_dtype.value}"] if model_dtype is not Format.FP32 else []
    notes = []
    if stop > start:
        fmt_name, recipe = MEGATRON_RECIPES["tensorwise"]
        config.update(fp8=fmt_name, fp8_recipe=recipe)
        args += ["--fp8-format", fmt_name, "--fp8-recipe", recipe]
        if start > 0 or stop < count:
            config.update(first_last_layers_bf16=True, num_layers_at_start_in_bf16=start,
                          num_layers_at_end_in_bf16=count - stop)  # fmt: skip
            args += ["--first-last-layers-bf16", "--num-layers-at-start-in-bf16", str(start),
                     "--num-layers-at-end-in-bf16", str(count - stop)]  # fmt: skip
            notes.append("with pipeline parallelism, Megatron requires each of the two bf16 counts to be at most "
                         "num_layers / pipeline stages")  # fmt: skip
        counted = "given" if num_layers is not None else "taken from the policy's layer names (--num-layers to set it)"
        notes.insert(0, f"for a model of {count} transformer layers ({counted}): Megatron counts the fp8 layers from "
                        "num_layers, so with more layers the extra ones would run in fp8")  # fmt: skip
        notes.append("every linear of a transformer layer is taken to be in the policy: one it does not list runs in "
                     "the model's dtype under the policy, but in fp8 under Megatron (the policy file does not say "
                     "which linears a search left out)")  # fmt: skip
        notes.append("Megatron runs its multi-token-prediction layers and a multimodal projector in fp8 whenever fp8 "
                     "is on; they are outside this layer count")  # fmt: skip
    elif fp8_layers(policy):
        lines.append("no transformer layer runs wholly in Megatron's fp8 under the policy: the export sets no fp8")
    return MegatronExport(stack=stack, num_layers=count, fp8_layers=tuple(range(start, stop)),
                          transformer_config=config, arguments=" ".join(args), not_expressed=tuple(lines),
                          notes=tuple(notes))  # fmt: skip


def default_path(policy_path: Path, target: str) -> Path:
    """Beside the policy: <name>_<target><suffix>."""
    return policy_path.with_name(f"{policy_path.stem}_{target}{SUFFIXES[target]}")


def export(policy: Policy, target: str, out: str | Path, *, source: str = "a policy", num_layers: int | None = None) -> list[str]:
    """Write `policy` for `target` to `out`; returns what the target could not express (and says when nothing
    is left to convert). `num_layers`: the model's transformer layers, for megatron only."""
    if target not in TARGETS:
        raise ValueError(f"--to {target!r}: one of {', '.join(TARGETS)}")
    if num_layers is not None and target != "megatron":
        raise UserError(f"--num-layers is for --to megatron (it counts the bf16 layers at the end), not --to {target}")
    if target == "megatron":
        exported = megatron_export(policy, num_layers)
        write_text(out, json.dumps(exported.to_dict(source), indent=2) + "\n")
        return list(exported.not_expressed)
    if target == "torchtitan":
        write_text(out, torchtitan_source(policy, source=source))
        left_out = torchtitan_not_expressed(policy)
        converts = any(r in TORCHTITAN_RECIPES for r in fp8_layers(policy))
        nothing = "the policy has no fp8 layer torchtitan can run: the file's float8_converters() returns []"
    else:
        write_text(out, torchao_source(policy, source=source))
        left_out = not_expressed(policy)
        converts = bool(fp8_layers(policy))
        nothing = "the policy has no fp8 layer: the file's convert(model) changes nothing"
    return left_out if converts else [*left_out, nothing]
