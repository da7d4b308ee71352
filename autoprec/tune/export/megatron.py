"""`--to megatron`: a JSON file of Megatron-core `TransformerConfig` fields and the Megatron-LM arguments that say
the same. Megatron (through Transformer Engine) runs fp8 per transformer layer, in one contiguous run: the first and
last layers may stay in the model's dtype. The export takes the longest run of layers that the policy runs wholly in
torchao's tensorwise recipe (Megatron's `tensorwise`: dynamic per-tensor scales, e4m3 forward, e5m2 gradients); it
has no per-GEMM mix (Transformer Engine runs all three GEMMs of a linear in fp8 or none). `--num-layers N` gives the
model's transformer layers when it has more than the policy names.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

from autoprec.errors import UserError, shown
from autoprec.files import write_text
from autoprec.formats import Format
from autoprec.policy import ROOT, Policy
from autoprec.tune._numbers import parse_integer
from autoprec.tune.export._common import _layers, fp8_layers, recipe_key
from autoprec.tune.export.base import ExportTarget, Option, register

# torchao recipe -> Megatron's (fp8 format, fp8_recipe) that computes the same: only tensorwise has a twin there
MEGATRON_RECIPES = {"tensorwise": ("hybrid", "tensorwise")}
_NUMBERED = re.compile(r"^(?P<stack>.+?)\.(?P<index>\d+)\.(?P<rest>.+)$")  # 'blocks.3.attn.qkv': block 3 of 'blocks'
MAX_LAYERS = 100_000  # transformer layers a megatron export counts: models have hundreds; the export walks them


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
        return {
            "written_by": "autoprec export --to megatron",
            "policy": source,
            **dataclasses.asdict(self),
            "fp8_layers": list(self.fp8_layers),
            "not_expressed": list(self.not_expressed),
            "notes": list(self.notes),
        }


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
                raise UserError(
                    f"layer {shown(name)} is transformer layer {index} of {shown(match['stack'])}: a "
                    f"Megatron export counts at most {MAX_LAYERS} transformer layers"
                )
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
        raise UserError(
            f"--num-layers {num_layers}: the policy names transformer layer {named - 1} of {stack!r}; give at least {named}"
        )
    count = named if num_layers is None else num_layers
    roles = {role for block in blocks.values() for role in block}
    whole = {
        i for i, block in blocks.items() if set(block) == roles and all(recipe_key(f) in MEGATRON_RECIPES for f in block.values())
    }
    start, stop = _longest_run(whole, count)
    lines = []
    model_dtype = root if root in (Format.BF16, Format.FP16) else Format.FP32
    other_dtype: dict[Format, list[str]] = {}  # the model root sets the model's dtype, so it is never listed here
    for name, fmt in policy.layers.items():
        if recipe_key(fmt) is None and fmt is not model_dtype:
            other_dtype.setdefault(fmt, []).append(name)
    for fmt, names in other_dtype.items():
        lines.append(
            f"{_layers(names)} in {fmt.value}: Megatron runs every layer outside fp8 in the model's dtype "
            f"({model_dtype.value} here)"
        )
    fp8_outside = [name for name, fmt in outside.items() if recipe_key(fmt) is not None]
    if fp8_outside:
        where = f"outside the transformer layers ({stack}.N)" if stack else "with no numbered stack of transformer layers"
        lines.append(f"{_layers(fp8_outside)} in fp8 {where}, where Megatron runs no fp8; left in the model's dtype")
    reasons: dict[str, list[int]] = {}
    for i in range(count):
        block = blocks.get(i, {})
        fp8 = [role for role, f in block.items() if recipe_key(f) is not None]
        if any(recipe_key(block[role]) not in MEGATRON_RECIPES for role in fp8):
            why = (
                f"a linear in an fp8 recipe Megatron has no twin for (it has torchao's {', '.join(MEGATRON_RECIPES)} "
                "only, and no per-GEMM mix: all three GEMMs of a linear in fp8)"
            )
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
            config.update(first_last_layers_bf16=True, num_layers_at_start_in_bf16=start, num_layers_at_end_in_bf16=count - stop)
            args += [
                "--first-last-layers-bf16",
                "--num-layers-at-start-in-bf16",
                str(start),
                "--num-layers-at-end-in-bf16",
                str(count - stop),
            ]
            notes.append(
                "with pipeline parallelism, Megatron requires each of the two bf16 counts to be at most "
                "num_layers / pipeline stages"
            )
        counted = "given" if num_layers is not None else "taken from the policy's layer names (--num-layers to set it)"
        notes.insert(
            0,
            f"for a model of {count} transformer layers ({counted}): Megatron counts the fp8 layers from "
            "num_layers, so with more layers the extra ones would run in fp8",
        )
        notes.append(
            "every linear of a transformer layer is taken to be in the policy: one it does not list runs in "
            "the model's dtype under the policy, but in fp8 under Megatron (the policy file does not say "
            "which linears a search left out)"
        )
        notes.append(
            "Megatron runs its multi-token-prediction layers and a multimodal projector in fp8 whenever fp8 "
            "is on; they are outside this layer count"
        )
    elif fp8_layers(policy):
        lines.append("no transformer layer runs wholly in Megatron's fp8 under the policy: the export sets no fp8")
    return MegatronExport(
        stack=stack,
        num_layers=count,
        fp8_layers=tuple(range(start, stop)),
        transformer_config=config,
        arguments=" ".join(args),
        not_expressed=tuple(lines),
        notes=tuple(notes),
    )


NUM_LAYERS = Option(
    "--num-layers",
    help="the model's transformer layers (default: as many as the policy names)",
    purpose="it counts the bf16 layers at the end",
    type=parse_integer,
    metavar="N",
)


@register
class Megatron(ExportTarget):
    name = "megatron"
    suffix = ".json"
    summary = "TransformerConfig fields and Megatron-LM arguments (fp8 per transformer layer)"
    options = (NUM_LAYERS,)

    def write(
        self, policy: Policy, out: str | Path, *, source: str = "a policy", num_layers: int | None = None, **options: object
    ) -> list[str]:
        exported = megatron_export(policy, num_layers)
        write_text(out, json.dumps(exported.to_dict(source), indent=2) + "\n")
        return list(exported.not_expressed)
