"""`--to megatron`: a JSON file of Megatron-core `TransformerConfig` fields and the Megatron-LM arguments that say
the same. Megatron (through Transformer Engine) runs one quantized recipe per transformer layer, in one contiguous
run: the first and last layers may stay in the model's dtype. Its recipes with an autoprec twin (RECIPES): fp8
`tensorwise` (torchao's tensorwise: dynamic per-tensor scales, e4m3 forward, e5m2 gradients), fp8 `mxfp8` with the
e4m3 format (MXFP8BlockScaling: autoprec's mxfp8) and fp4 `nvfp4` (NVFP4BlockScaling: autoprec's nvfp4); fp8 and fp4
exclude each other (TransformerConfig refuses both). The export takes, among them, the longest run of layers that the
policy runs wholly in one recipe; there is no per-GEMM mix (a recipe runs all three GEMMs of a linear). What needs a
recipe per linear is left to `--to megatron-precision`, which the lines say. `--num-layers N` gives the model's
transformer layers when it has more than the policy names.

A layer index is read as Megatron's module names write one, str(int) of nn.ModuleList: ASCII digits without a
leading zero. A name with another number (`layers.01`, a non-ASCII digit) names no Megatron module and is listed.

The file records, under `environment`, the NVTE_* variables its recipe's Transformer Engine class reads
(_common.NVTE): each -> the value TE must read, null for unset; `autoprec verify` checks the process's environment.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import shlex
from pathlib import Path
from types import SimpleNamespace

from autoprec.errors import UserError, shown
from autoprec.files import read_json, write_text
from autoprec.formats import Format
from autoprec.policy import ROOT, Policy
from autoprec.tune._core._numbers import parse_integer
from autoprec.tune.export._common import (
    MEGATRON_TE,
    TE_MIN,
    _layers,
    blockscaled_gemms,
    blockscaled_recipe,
    environment_note,
    environment_table,
    gather_not_expressed,
    layer_only,
    nvte_environment,
    policy_gemms,
    recipe_key,
    regular_file,
    root_not_expressed,
)
from autoprec.tune.export.base import HIGH, ExportTarget, Gemms, Option, Resolved, register_export_target

_FP8_NOTES = (  # megatron/core/transformer/multi_token_prediction.py and models/vision/multimodal_projector.py
    "Megatron runs its multi-token-prediction layers and a multimodal projector in fp8 whenever fp8 is on; they "
    "are outside this layer count",
)
_FP8_SPLIT_NOTES = (  # TransformerConfig.__post_init__ checks the counts when fp8 is set
    "with pipeline parallelism, Megatron requires each of the two bf16 counts to be at most num_layers / pipeline stages",
)


@dataclasses.dataclass(frozen=True)
class MegatronRecipe:
    """A Megatron-core recipe that computes what an autoprec format computes, all three GEMMs of a linear in it.
    `precision` names its TransformerConfig fields, `<precision>` (the format: --<precision>-format) and
    `<precision>_recipe` (--<precision>-recipe), and the per-module YAML's `<precision>_quantization_recipe`."""

    precision: str  # "fp8" or "fp4": Megatron runs one of the two
    format: str  # TransformerConfig.fp8 ("hybrid": e4m3 forward, e5m2 gradients; "e4m3") or .fp4 ("e2m1")
    recipe: str
    notes: tuple[str, ...] = ()  # what Megatron does with it beyond the transformer layers
    split_notes: tuple[str, ...] = ()  # what it requires of the first/last bf16 counts


# autoprec's name for a recipe (recipe_key, blockscaled_recipe) -> Megatron's; the first of equally long runs wins
RECIPES = {
    "tensorwise": MegatronRecipe("fp8", "hybrid", "tensorwise", _FP8_NOTES, _FP8_SPLIT_NOTES),
    "mxfp8": MegatronRecipe("fp8", "e4m3", "mxfp8", _FP8_NOTES, _FP8_SPLIT_NOTES),  # MXFP8: e4m3 for every operand
    "nvfp4": MegatronRecipe("fp4", "e2m1", "nvfp4"),  # MTP layers: "currently ignoring FP4" (multi_token_prediction.py)
}


def recipe_name(fmt: Format) -> str | None:
    """RECIPES' key of the Megatron recipe that runs `fmt`, or None where none does (a per-GEMM mix, rowwise fp8, a
    dtype)."""
    name = recipe_key(fmt) or blockscaled_recipe(fmt)
    return name if name in RECIPES else None


def megatron_recipe(fmt: Format) -> MegatronRecipe | None:
    """The Megatron recipe that runs `fmt` (recipe_name), or None."""
    name = recipe_name(fmt)
    return None if name is None else RECIPES[name]


_INDEX = re.compile(r"0|[1-9][0-9]*")  # a layer index as nn.ModuleList names a child (str(int)): 'decoder.layers.3'
_NUMBER = re.compile(r"\d+")  # a name segment any reader could take for a number ('01', Arabic-Indic digits)
_NUMBERED = re.compile(r"^(?P<stack>.+?)\.(?P<index>0|[1-9][0-9]*)\.(?P<rest>.+)$")  # 'blocks.3.attn.qkv': block 3
MAX_LAYERS = 100_000  # transformer layers a megatron export counts: models have hundreds; the export walks them


@dataclasses.dataclass(frozen=True)
class MegatronExport:
    """What `--to megatron` writes: the block stack found in the policy's layer names, the recipe (RECIPES' key,
    None: none), the transformer layers that run in it, Megatron-core TransformerConfig fields and the Megatron-LM
    arguments that say the same, for a model of `num_layers` transformer layers."""

    stack: str | None
    num_layers: int
    recipe: str | None
    quantized_layers: tuple[int, ...]
    transformer_config: dict[str, object]
    arguments: str
    not_expressed: tuple[str, ...]
    notes: tuple[str, ...] = ()
    environment: dict[str, str | None] = dataclasses.field(default_factory=dict)  # NVTE_* -> value (None: unset)

    def to_dict(self, source: str) -> dict[str, object]:
        return {
            "written_by": "autoprec export --to megatron",
            "policy": source,
            **dataclasses.asdict(self),
            "quantized_layers": list(self.quantized_layers),
            "not_expressed": list(self.not_expressed),
            "notes": list(self.notes),
        }


def misnumbered(policy: Policy) -> list[str]:
    """The policy's names with a segment Megatron's module names never hold where a number is (a leading zero, a
    non-ASCII digit): they name no Megatron module."""
    return [name for name in policy.layers if any(_NUMBER.fullmatch(s) and not _INDEX.fullmatch(s) for s in name.split("."))]


def misnumbered_lines(names: list[str]) -> list[str]:
    """The line for `names` (misnumbered), none where there are none."""
    if not names:
        return []
    return [
        f"{_layers(names, 'names')} a layer by a number Megatron's module names never hold (a leading zero or a "
        "non-ASCII digit: they count 0, 1, 2, ... in ASCII): no Megatron module has that name, so it is not read as "
        "a layer index; not in the export"
    ]


def _blocks(policy: Policy) -> tuple[str | None, dict[int, dict[str, Format]], dict[str, Format], list[str]]:
    """(the numbered stack with the most blocks, its blocks' listed layers by role (the name after the block's
    number), the listed layers outside it, the names no Megatron module has (_misnumbered))."""
    stacks: dict[str, dict[int, dict[str, Format]]] = {}
    unnamed = misnumbered(policy)
    for name, fmt in policy.layers.items():
        match = _NUMBERED.match(name)
        if match and name not in unnamed:
            index = match["index"]  # ASCII digits, no leading zero: int() of a short one only
            if len(index) > len(str(MAX_LAYERS)) or int(index) >= MAX_LAYERS:
                shown_index = index if len(index) <= 20 else f"{index[:20]}... ({len(index)} digits)"
                raise UserError(
                    f"layer {shown(name)} is transformer layer {shown_index} of {shown(match['stack'])}: a "
                    f"Megatron export counts at most {MAX_LAYERS} transformer layers"
                )
            stacks.setdefault(match["stack"], {}).setdefault(int(index), {})[match["rest"]] = fmt
    others = {n: f for n, f in policy.layers.items() if n != ROOT and n not in unnamed}
    if not stacks:
        return None, {}, others, unnamed
    stack = max(stacks, key=lambda s: len(stacks[s]))  # the first among equals: dicts keep the policy's order
    inside = stacks[stack]
    listed = {f"{stack}.{i}.{role}" for i, block in inside.items() for role in block}
    return stack, inside, {n: f for n, f in others.items() if n not in listed}, unnamed


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


PER_LINEAR = "--to megatron-precision gives each linear its own recipe"


def mixes_note(policy: Policy) -> list[str]:
    """The note for the policy's block-scaled per-GEMM mixes, which only --to megatron-precision writes, through
    Transformer Engine's HybridQuantizer: newer than the TE Megatron-Core 0.19 pins. None where it has none."""
    mixed = [f.value for n, f in policy.layers.items() if n != ROOT and blockscaled_gemms(f) and megatron_recipe(f) is None]
    if not mixed:
        return []
    return [
        f"the per-GEMM mixes ({', '.join(dict.fromkeys(mixed))}) run in Megatron only as --to megatron-precision's "
        f"custom recipes, whose HybridQuantizer needs Transformer Engine {TE_MIN} or later; {MEGATRON_TE}"
    ]


def megatron_export(policy: Policy, num_layers: int | None = None) -> MegatronExport:
    """The Megatron settings closest to `policy` that run no layer in a recipe the policy did not (module
    docstring). A transformer layer runs a recipe only if the policy lists every role any layer of the stack lists
    (attention and MLP linears, say) and runs each in that recipe: Megatron would put an unlisted linear in it too.
    `num_layers`: the model's transformer layers (default: as many as the policy names); Megatron counts the
    bf16 layers at the end from it."""
    root = policy.layers.get(ROOT, Format.FP32)
    stack, blocks, outside, unnamed = _blocks(policy)
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
    whole: dict[str, set[int]] = {}  # RECIPES' key -> the layers wholly in it
    for i, block in blocks.items():
        keys = {recipe_name(f) for f in block.values()}
        if set(block) == roles and len(keys) == 1 and (key := keys.pop()) is not None:
            whole.setdefault(key, set()).add(i)
    runs = {key: _longest_run(whole.get(key, set()), count) for key in RECIPES}
    chosen = max(RECIPES, key=lambda key: runs[key][1] - runs[key][0])  # the first of equally long runs
    start, stop = runs[chosen]
    twin = RECIPES[chosen] if stop > start else None
    lines = root_not_expressed(policy, ": Megatron has no setting for a whole model's ops")
    model_dtype = root if root in (Format.BF16, Format.FP16) else Format.FP32
    other_dtype: dict[Format, list[str]] = {}  # the model root sets the model's dtype, so it is never listed here
    for name, fmt in policy.layers.items():
        if name != ROOT and name not in unnamed and not layer_only(fmt) and fmt is not model_dtype:
            other_dtype.setdefault(fmt, []).append(name)
    for fmt, names in other_dtype.items():
        lines.append(
            f"{_layers(names)} in {fmt.value}: Megatron runs every layer outside its fp8 or fp4 recipe in the model's "
            f"dtype ({model_dtype.value} here)"
        )
    lines += misnumbered_lines(unnamed)
    quantized_outside: dict[Format, list[str]] = {}
    for name, fmt in outside.items():
        if layer_only(fmt):
            quantized_outside.setdefault(fmt, []).append(name)
    where = f"outside the transformer layers ({stack}.N)" if stack else "with no numbered stack of transformer layers"
    for fmt, names in quantized_outside.items():
        lines.append(
            f"{_layers(names)} in {fmt.value} {where}, where Megatron runs no recipe; left in the model's dtype "
            "(--to megatron-precision names modules one by one)"
        )
    offered = ", ".join(f"{r.precision} {r.recipe}" for r in RECIPES.values())
    reasons: dict[str, list[int]] = {}
    for i in range(count):
        block = blocks.get(i, {})
        quantized = [f for f in block.values() if layer_only(f)]
        if any(megatron_recipe(f) is None for f in quantized):
            why = (
                f"a linear in a quantized format Megatron has no recipe for (it has {offered}, each running all three "
                "GEMMs of a linear: no per-GEMM mix, no rowwise fp8)"
            )
        elif quantized and not any(i in layers for layers in whole.values()):
            why = (
                "some linears in a quantized recipe and some not, in two recipes, or unlisted (Megatron runs a layer's "
                f"linears all in one recipe or none; {PER_LINEAR})"
            )
        elif i in whole.get(chosen, set()) and not start <= i < stop:
            why = (
                f"wholly {chosen} in the policy, but Megatron runs its recipe in one contiguous run of layers, here "
                f"{start}-{stop - 1} ({PER_LINEAR})"
            )
        elif (other := next((key for key, layers in whole.items() if i in layers and key != chosen), None)) is not None:
            why = (
                f"wholly {other} in the policy, but Megatron runs one recipe in all its quantized layers (fp8 and fp4 "
                f"exclude each other){f', here {chosen}' if twin else ''} ({PER_LINEAR})"
            )
        elif i not in blocks and twin is not None:
            why = "not in the policy"
        else:
            continue
        reasons.setdefault(why, []).append(i)
    for why, indices in reasons.items():
        lines.append(f"transformer layers {stack}.{{{_spans(indices)}}}: {why}; left in the model's dtype")
    config: dict[str, object] = {"bf16": model_dtype is Format.BF16, "fp16": model_dtype is Format.FP16}
    args = [f"--{model_dtype.value}"] if model_dtype is not Format.FP32 else []
    notes: list[str] = []
    if twin is not None:
        config.update({twin.precision: twin.format, f"{twin.precision}_recipe": twin.recipe})
        args += [f"--{twin.precision}-format", twin.format, f"--{twin.precision}-recipe", twin.recipe]
        counted = "given" if num_layers is not None else "taken from the policy's layer names (--num-layers to set it)"
        notes.append(
            f"for a model of {count} transformer layers ({counted}): Megatron counts the {twin.precision} layers "
            f"from num_layers, so with more layers the extra ones would run in {twin.recipe}"
        )
        if start > 0 or stop < count:
            config.update(first_last_layers_bf16=True, num_layers_at_start_in_bf16=start, num_layers_at_end_in_bf16=count - stop)
            args += [
                "--first-last-layers-bf16",
                "--num-layers-at-start-in-bf16",
                str(start),
                "--num-layers-at-end-in-bf16",
                str(count - stop),
            ]
            notes += twin.split_notes
        notes.append(
            f"every linear of a transformer layer is taken to be in the policy: one it does not list runs in "
            f"the model's dtype under the policy, but in {twin.recipe} under Megatron (the policy file does not say "
            "which linears a search left out)"
        )
        notes += twin.notes
    elif any(layer_only(f) for n, f in policy.layers.items() if n != ROOT):
        lines.append(
            "no transformer layer runs wholly in one of Megatron's recipes under the policy: the export sets no fp8 or fp4"
        )
    lines += gather_not_expressed(policy, "Megatron")
    notes += mixes_note(policy)
    return MegatronExport(
        stack=stack,
        num_layers=count,
        recipe=chosen if twin is not None else None,
        quantized_layers=tuple(range(start, stop)),
        transformer_config=config,
        arguments=" ".join(args),
        not_expressed=tuple(lines),
        notes=tuple(notes),
        environment=nvte_environment([twin.recipe] if twin is not None else []),
    )


NUM_LAYERS = Option(
    "--num-layers",
    help="the model's transformer layers (default: as many as the policy names)",
    purpose="it counts the bf16 layers at the end",
    type=parse_integer,
    metavar="N",
)


@register_export_target
class Megatron(ExportTarget):
    name = "megatron"
    suffix = ".json"
    summary = "TransformerConfig fields and Megatron-LM arguments (fp8 or fp4 per transformer layer)"
    switch = (
        "in the healing style (Megatron-Bridge's NVFP4 healing changes the recipe at a set step): at each phase's first "
        "step, resume from the checkpoint with that phase's file's fields and arguments"
    )
    options = (NUM_LAYERS,)

    def write(
        self, policy: Policy, out: str | Path, *, source: str = "a policy", num_layers: int | None = None, **options: object
    ) -> list[str]:
        exported = megatron_export(policy, num_layers)
        write_text(out, json.dumps(exported.to_dict(source), indent=2) + "\n")
        mixes = [f"note: {line}" for line in mixes_note(policy)]
        return [*exported.not_expressed, *mixes, *environment_note(exported.environment)]

    def resolve(self, exported: Path, module_names: list[str]) -> dict[str, Resolved]:
        return megatron_resolve(exported, module_names)

    def environment(self, exported: Path) -> dict[str, str | None]:
        content = read_json(regular_file(exported))
        recorded = content.get("environment", {}) if isinstance(content, dict) else {}
        return environment_table(recorded, "environment", exported)


def recipe_gemms(precision: str, fmt: object, recipe: object) -> Gemms:
    """What Megatron runs a linear's GEMMs in under a recipe (`precision` "fp8"/"fp4", its format and recipe
    strings), in the verifier's labels: those of the autoprec format with that recipe (RECIPES), else the recipe
    as Megatron names it, which no policy format has."""
    for key, twin in RECIPES.items():
        if (twin.precision, twin.format, twin.recipe) == (precision, fmt, recipe):
            return policy_gemms(next(f for f in Format if recipe_name(f) == key))
    label = f"{precision} {recipe} ({fmt})"
    return label, label, label


def stack_layers(module_names: list[str]) -> tuple[str | None, dict[str, int]]:
    """The model's transformer layers as Megatron's TransformerBlock numbers them: the numbered stack with the most
    layers among the module paths ('decoder.layers'), and each linear in it -> its layer index."""
    stacks: dict[str, dict[str, int]] = {}
    for name in module_names:
        if (match := _NUMBERED.match(name)) and len(match["index"]) <= len(str(MAX_LAYERS)):
            stacks.setdefault(match["stack"], {})[name] = int(match["index"])
    if not stacks:
        return None, {}
    stack = max(stacks, key=lambda s: len(set(stacks[s].values())))
    return stack, stacks[stack]


def _first_last_bf16(config: dict[str, object], num_layers: int, layer: int, said: str = "the file") -> bool:
    """Whether Megatron keeps transformer layer `layer` (0-based) of `num_layers` out of its recipe: Megatron-core's
    own rule where it is installed (megatron/core/fp8_utils.py, is_first_last_bf16_layer; fp4_utils.get_fp4_context
    counts the same), else that rule: with first_last_layers_bf16, the first num_layers_at_start_in_bf16 and the
    last num_layers_at_end_in_bf16 layers. `said` names the settings, for the error."""
    on = bool(config.get("first_last_layers_bf16"))
    start, end = (config.get(k, SETTINGS[k]) if on else 0 for k in ("num_layers_at_start_in_bf16", "num_layers_at_end_in_bf16"))
    if not (isinstance(start, int) and isinstance(end, int)):
        raise UserError(
            f"{said}: num_layers_at_start_in_bf16 and num_layers_at_end_in_bf16 must be integers, got {shown(start, 40)}, "
            f"{shown(end, 40)}: export the policy again"
        )
    try:
        from megatron.core.fp8_utils import is_first_last_bf16_layer
    except ImportError:
        return on and (layer < start or layer >= num_layers - end)
    fields = {"num_layers": num_layers, "first_last_layers_bf16": on, "num_layers_at_start_in_bf16": start}
    return bool(is_first_last_bf16_layer(SimpleNamespace(**fields, num_layers_at_end_in_bf16=end), layer))


# TransformerConfig's fields the file sets, with their defaults (megatron/core/transformer/transformer_config.py)
SETTINGS: dict[str, object] = {
    "fp16": False,
    "bf16": False,
    "fp8": None,
    "fp8_recipe": "delayed",
    "fp4": None,
    "fp4_recipe": "nvfp4",
    "first_last_layers_bf16": False,
    "num_layers_at_start_in_bf16": 1,
    "num_layers_at_end_in_bf16": 1,
}


class _ArgumentsRefused(Exception):
    """What Megatron-LM's parser refuses in the file's arguments (argparse's own error, which would exit)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # type: ignore[override]  # argparse exits; verify says it in one line
        raise _ArgumentsRefused(message)


def _choice(flag: str, choices: tuple[str, ...]):
    def parse(value: str) -> str:
        if value not in choices:
            raise argparse.ArgumentTypeError(f"{flag} {shown(value, 40)}: one of {', '.join(choices)}")
        return value

    return parse


def _integer(flag: str):
    def parse(value: str) -> int:
        try:
            return int(value)  # Megatron-LM's type=int
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} {shown(value, 40)}: an integer") from None

    return parse


def arguments_parser() -> argparse.ArgumentParser:
    """Megatron-LM's options for what the file sets, as megatron/training/arguments.py defines them
    (_add_mixed_precision_args, _add_transformer_engine_args: dests, defaults, type=int; its parser takes no
    abbreviations), with megatron-core 0.16 TransformerConfig's choices."""
    p = _Parser(prog="Megatron-LM", allow_abbrev=False, add_help=False, exit_on_error=False)
    p.add_argument("--fp16", action="store_true")
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--fp8-format", dest="fp8", default=SETTINGS["fp8"], type=_choice("--fp8-format", ("e4m3", "hybrid")))
    recipes = ("tensorwise", "delayed", "mxfp8", "blockwise", "custom")
    p.add_argument("--fp8-recipe", dest="fp8_recipe", default=SETTINGS["fp8_recipe"], type=_choice("--fp8-recipe", recipes))
    p.add_argument("--fp4-format", dest="fp4", default=SETTINGS["fp4"], type=_choice("--fp4-format", ("e2m1",)))
    fp4_recipes = ("nvfp4", "custom")
    p.add_argument("--fp4-recipe", dest="fp4_recipe", default=SETTINGS["fp4_recipe"], type=_choice("--fp4-recipe", fp4_recipes))
    p.add_argument("--first-last-layers-bf16", action="store_true")
    for end in ("start", "end"):
        flag = f"--num-layers-at-{end}-in-bf16"
        p.add_argument(flag, type=_integer(flag), default=SETTINGS[f"num_layers_at_{end}_in_bf16"])
    return p


def parse_arguments(text: object, exported: Path) -> dict[str, object]:
    """The file's `arguments` (the Megatron-LM command line a user runs) as the TransformerConfig fields Megatron-LM
    copies them to (core_transformer_config_from_args: same names): split as a shell splits them (shlex), parsed
    by Megatron-LM's own options (arguments_parser). UserError for what Megatron-LM refuses, and for an option the
    export never writes: one that is not a precision setting verify reads (--fp8-param-gather,
    --te-precision-config-file) would change what runs unseen."""
    where = f"{exported}: arguments"
    if not isinstance(text, str):
        raise UserError(f"{where} must be a string of Megatron-LM options, got {shown(text, 40)}: export the policy again")
    try:
        words = shlex.split(text)
    except ValueError as exc:
        raise UserError(
            f"{where} {shown(text, 60)} cannot be split as a shell splits it ({exc}): export the policy again"
        ) from None
    try:
        parsed, extra = arguments_parser().parse_known_args(words)
    except argparse.ArgumentError as exc:
        message = exc.message if "expected" not in exc.message else "it takes a value"
        said = message if message.startswith(exc.argument_name or "-") else f"{exc.argument_name}: {message}"
        raise UserError(f"{where}: Megatron-LM refuses {said}: export the policy again") from None
    except _ArgumentsRefused as exc:
        raise UserError(f"{where}: Megatron-LM refuses them ({exc}): export the policy again") from None
    if extra:
        raise UserError(
            f"{where} hold {shown(extra[0], 40)}, which `autoprec export` never writes: verify reads only the options it "
            f"writes ({', '.join(a.option_strings[0] for a in arguments_parser()._actions)}); remove it or export the "
            "policy again"
        )
    return vars(parsed)


def _resolved_under(settings: dict[str, object], said: str, module_names: list[str]) -> dict[str, tuple[Resolved, str]]:
    """Each linear -> (what Megatron runs it in under `settings` (TransformerConfig fields), the model's dtype there);
    `said` names where the settings come from, for the errors."""
    recipe = None
    for precision in ("fp8", "fp4"):
        if settings[precision]:
            if recipe is not None:
                raise UserError(f"{said} sets both fp8 and fp4, which Megatron's TransformerConfig refuses")
            fields = f"{precision}={settings[precision]!r}, {precision}_recipe={settings[f'{precision}_recipe']!r}"
            recipe = recipe_gemms(precision, settings[precision], settings[f"{precision}_recipe"]), fields
    dtype = "fp16" if settings["fp16"] else "bf16" if settings["bf16"] else "fp32"
    stack, layers = stack_layers(module_names)
    count = max(layers.values(), default=-1) + 1
    found = {}
    for name in module_names:
        if recipe is None:
            found[name] = Resolved(HIGH, "no fp8 or fp4 recipe set")
        elif name not in layers:
            found[name] = Resolved(HIGH, f"outside the transformer layers ({stack}.N)")
        elif _first_last_bf16(settings, count, layers[name], said):
            found[name] = Resolved(HIGH, f"a first/last bf16 layer of {count}")
        else:
            found[name] = Resolved(recipe[0], recipe[1])
    return {name: (r, dtype) for name, r in found.items()}


def _said(resolved: Resolved, dtype: str) -> str:
    return " / ".join(g or dtype for g in resolved.gemms or ()) + f" ({resolved.via})"


def megatron_resolve(exported: Path, module_names: list[str]) -> dict[str, Resolved]:
    """What Megatron runs each linear in under the file: its fp8 (or fp4) recipe in every linear of the transformer
    layers (the model's own count, as Megatron counts num_layers) but the first and last bf16 ones, every other
    linear (embedding, output layer) in the model's dtype. The file says it twice, as `transformer_config` (for
    Megatron-core) and as `arguments` (the Megatron-LM command line, parse_arguments): a linear the two run
    differently has no one answer (None, both said)."""
    content = read_json(regular_file(exported))
    config = content.get("transformer_config") if isinstance(content, dict) else None
    if not isinstance(config, dict):
        raise UserError(f"{exported}: no transformer_config object in it: export the policy again")
    from_config = _resolved_under(
        {k: config.get(k, v) for k, v in SETTINGS.items()}, f"{exported}: transformer_config", module_names
    )
    arguments = parse_arguments(content.get("arguments"), exported)  # type: ignore[attr-defined]  # a dict here
    from_arguments = _resolved_under(arguments, f"{exported}: arguments", module_names)
    found = {}
    for name in module_names:
        (a, a_dtype), (b, b_dtype) = from_config[name], from_arguments[name]
        if a.gemms == b.gemms and (a.gemms != HIGH or a_dtype == b_dtype):
            found[name] = a
        else:
            found[name] = Resolved(
                None,
                f"transformer_config runs it in {_said(a, a_dtype)}, arguments in {_said(b, b_dtype)}: export the policy again",
            )
    return found
