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

A per-GEMM mix (mxfp8-fwd, nvfp4-fwd-dgrad, mxfp8-fwd-nvfp4-dgrad) runs Megatron's custom recipe: its config sets
`fp8_quantization_recipe: custom` and `custom_recipe_factory: "<module>.<mix>"`, which Megatron-core 0.16 imports by
that dotted path (megatron/core/fp8_utils.py, _resolve_callable_from_python_import_path) and passes to Transformer
Engine as `CustomRecipe(qfactory=...)` (_get_custom_recipe) for that module alone. The module,
`<yaml stem>_qfactory.py`, is written beside the YAML (its folder must be on PYTHONPATH), never over a file autoprec
did not write (ours_or_absent); each mix's factory gives the module's quantizer slots the formats of its three
GEMMs (_common.QUANTIZER_FOR, the function the TE file holds too). Its HybridQuantizer needs Transformer Engine 2.19,
newer than the 2.18 Megatron-Core 0.19 pins: the module checks the installed version when Megatron imports it
(require_transformer_engine), and the YAML's header and the export's lines say the conflict.

The YAML records, under `environment` (a key Megatron-Core's RecipeConfig does not read), the NVTE_* variables the
TE recipes of its configs read (_common.NVTE): each -> the value TE must read, null for unset; `autoprec verify`
checks the process's environment against it.

A quantized config sets `override_nonquantized_autocast: true`, so the module runs its recipe also where no global
--fp8/--fp4 recipe is on; the last matcher, "*", gives every other module the high-precision config, which overrides
a global recipe (override_quantized_autocast defaults to true): the modules run as the policy says. Rowwise and per-GEMM
fp8 layers (Megatron has no rowwise recipe, TE's factories none for them) and layers in a dtype other than the
model's are listed as not expressed.
"""

from __future__ import annotations

import fnmatch
import functools
import glob
import re
import textwrap
from pathlib import Path

import yaml

from autoprec.errors import UserError, printable
from autoprec.errors import shown as _shown
from autoprec.files import write_text
from autoprec.formats import Format
from autoprec.policy import ROOT, Policy
from autoprec.tune.export._common import (
    KINDS,
    MEGATRON_TE,
    QUANTIZER_FOR,
    REQUIRE_TE,
    TE_NEEDS,
    _layers,
    assigned,
    blockscaled_gemms,
    environment_lines,
    environment_note,
    environment_table,
    fp32_under_a_lowered_root,
    gather_not_expressed,
    nvte_environment,
    read_python,
    read_regular,
    root_not_expressed,
    same_module,
    te_version_note,
)
from autoprec.tune.export.base import HIGH, ExportTarget, Gemms, Resolved, register_export_target
from autoprec.tune.export.megatron import megatron_recipe, misnumbered, misnumbered_lines, recipe_gemms

HIGH_PRECISION = "high_precision"  # the config key of the default matcher's (empty) recipe
shown = functools.partial(_shown, limit=40)  # a value read from the YAML, quoted a few dozen characters at most
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")  # a module or function name as the export writes it


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


def factory_module(out: str | Path) -> str:
    """The factory module's name for the YAML `out`: its stem as a Python identifier, then _qfactory."""
    stem = re.sub(r"[^A-Za-z0-9_]", "_", Path(out).stem)
    return f"{'_' if stem[:1].isdigit() else ''}{stem}_qfactory"


def factory_source(mixes: dict[str, Gemms], *, yaml_name: str = "the YAML") -> str:
    """The factory module's text: GEMMS (mix -> (fprop, dgrad, wgrad)), quantizer_for, and one factory per mix.
    The mixes' names are autoprec's format names (_key), never text from the policy."""
    rows = "".join(f"    {key!r}: {gemms!r},\n" for key, gemms in mixes.items())
    factories = "".join(
        f'\n\ndef {key}(role):\n    """The quantizer for one slot of a module Megatron runs in {key}."""\n'
        f"    return quantizer_for(role, GEMMS[{key!r}])\n"
        for key in mixes
    )
    needs = textwrap.fill(f"Needs {TE_NEEDS}; {MEGATRON_TE}. The module checks the version when it is imported.", 116)
    return f'''"""Transformer Engine quantizer factories for the per-GEMM mixes of a Megatron-LM
--te-precision-config-file (written by `autoprec export --to megatron-precision`), named in the comment below.

Megatron-core imports each `custom_recipe_factory: "<this module>.<mix>"` by its dotted path and runs the module the
YAML matches under `CustomRecipe(qfactory=<mix>)`: put this file's folder on PYTHONPATH.
{needs}
"""

# for --te-precision-config-file {printable(yaml_name)}


# mix -> (fprop, dgrad, wgrad): "mxfp8", "nvfp4" or None (high precision)
GEMMS = {{
{rows}}}


{REQUIRE_TE}

require_transformer_engine()


{QUANTIZER_FOR}{factories}'''


_FACTORY_HEAD = "(written by `autoprec export --to megatron-precision`)"  # in every factory module's docstring


def ours_or_absent(factory: Path, out: str | Path) -> None:
    """Refuse to write the factory module over a file autoprec did not write: its name comes from the YAML's
    (`x.yaml` -> `x_qfactory.py`), not from an option the user gave, so a file of theirs by that name would be
    replaced without a word. An earlier export's module (its docstring names the export) is replaced, as --out is."""
    if not (factory.exists() or factory.is_symlink()):
        return
    fix = f"move or remove it, or give --out another name than {printable(str(out))}"
    try:
        head = read_regular(factory, fix, limit=1024).decode("utf-8", errors="replace")
    except UserError as exc:
        raise UserError(f"{exc} (the per-GEMM mixes' factory module goes there)") from None
    if _FACTORY_HEAD not in head:
        raise UserError(
            f"{factory}: exists and autoprec did not write it; the export writes the per-GEMM mixes' factory module "
            f"there, beside the YAML: {fix}"
        )


def precision_config(policy: Policy, factory: str = "autoprec_qfactory") -> tuple[dict[str, object], list[str]]:
    """(the YAML's content, what it cannot express). `factory`: the module the per-GEMM mixes' factories are in."""
    configs: dict[str, object] = {}
    matchers: dict[str, object] = {}
    left_out: dict[tuple[Format, str], list[str]] = {}
    root = root_not_expressed(policy, ": a '*' matcher in its recipe would run every module in it")
    unnamed = misnumbered(policy)  # a pattern of one would match no module of GPTModel.named_modules()
    for name, fmt in policy.layers.items():
        recipe = module_recipe(fmt)
        if (name == ROOT and root) or name in unnamed:
            continue
        if recipe is None and name != ROOT and blockscaled_gemms(fmt) is not None:  # a per-GEMM mix
            recipe = {"fp8_quantization_recipe": "custom", "custom_recipe_factory": f"{factory}.{_key(fmt)}"}
        if recipe is None or name == ROOT:
            if fmt is not Format.FP32:
                if fmt.family.fp8_gemms(fmt) is not None:
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
    recipes = [r.get("fp8_quantization_recipe") or r.get("fp4_quantization_recipe") for r in _training_recipes(configs)]
    lines = []
    for (fmt, why), names in left_out.items():
        if ROOT in names:
            lines.append(f"the model root (every op outside a listed layer) runs in {fmt.value}: {why}")
            names = [n for n in names if n != ROOT]
        if names:
            lines.append(f"{_layers(names)} in {fmt.value}: {why}")
    return {"configs": configs, "matchers": matchers, "environment": nvte_environment(filter(None, recipes))}, [
        *root,
        *lines,
        *misnumbered_lines(unnamed),
        *fp32_under_a_lowered_root(policy, "Megatron"),
        *gather_not_expressed(policy, "Megatron"),
    ]


def _training_recipes(configs: dict[str, object]) -> list[dict]:
    """The configs' training_recipe mappings (as the export writes them)."""
    return [c["training_recipe"] for c in configs.values() if isinstance(c, dict) and isinstance(c.get("training_recipe"), dict)]


def mixes(policy: Policy) -> dict[str, Gemms]:
    """The policy's per-GEMM mixes Megatron runs through the factory module: _key -> (fprop, dgrad, wgrad)."""
    found: dict[str, Gemms] = {}
    for name, fmt in policy.layers.items():
        if name != ROOT and module_recipe(fmt) is None and (gemms := blockscaled_gemms(fmt)) is not None:
            found[_key(fmt)] = gemms
    return found


def precision_yaml(policy: Policy, *, source: str = "a policy", factory: str = "autoprec_qfactory") -> tuple[str, list[str]]:
    """The YAML file's text, and what it cannot express (also its comments, escaped), then what it needs (the
    export's "note: " lines: the Transformer Engine its per-GEMM mixes need, the environment it records)."""
    content, lines = precision_config(policy, factory)
    if len(content["matchers"]) == 1:  # type: ignore[arg-type]
        lines = [*lines, "the policy has no layer in a recipe Megatron runs per module: every module runs in high precision"]
    head = [
        "# Megatron-LM --te-precision-config-file (written by `autoprec export --to megatron-precision`)",
        f"# policy file: {printable(source)}",
        "# not expressed here:",
    ]
    head += [f"#   - {printable(line)}" for line in lines] or ["#   (nothing)"]
    environment = content["environment"]
    notes = environment_note(environment)  # type: ignore[arg-type]
    if mixes(policy):
        notes.insert(0, te_version_note(megatron=True))
        head += [f"# the per-GEMM mixes (custom recipes) need {printable(TE_NEEDS)}", f"# {MEGATRON_TE}"]
    if environment:
        head.append(
            "# environment: the NVTE_* variables Transformer Engine must read (null: unset; `autoprec verify` checks them):"
        )
        head += [f"#   - {printable(line)}" for line in environment_lines(environment)]  # type: ignore[arg-type]
    body = yaml.safe_dump(content, sort_keys=False, allow_unicode=False, width=1000)
    return "\n".join(head) + "\n" + body, [*lines, *notes]


@register_export_target
class MegatronPrecision(ExportTarget):
    name = "megatron-precision"
    suffix = ".yaml"
    summary = "Megatron-LM's per-module --te-precision-config-file (mxfp8, nvfp4, tensorwise fp8 per linear)"
    switch = (
        "in the healing style (Megatron-Bridge's NVFP4 healing changes the recipe at a set step): at each phase's first "
        "step, resume from the checkpoint with --te-precision-config-file set to that phase's file"
    )

    def write(self, policy: Policy, out: str | Path, *, source: str = "a policy", **options: object) -> list[str]:
        module = factory_module(out)
        text, lines = precision_yaml(policy, source=source, factory=module)
        if found := mixes(policy):
            factory = Path(out).with_name(f"{module}.py")
            ours_or_absent(factory, out)  # before anything is written
            text += f"# the per-GEMM mixes' factories: {module}.py beside this file (on PYTHONPATH)\n"
            write_text(factory, factory_source(found, yaml_name=Path(out).name))
        write_text(out, text)
        return lines

    def resolve(self, exported: Path, module_names: list[str]) -> dict[str, Resolved]:
        return precision_resolve(exported, module_names)

    def environment(self, exported: Path) -> dict[str, str | None]:
        content = read_yaml(Path(exported))
        recorded = content.get("environment", {}) if isinstance(content, dict) else {}
        return environment_table(recorded, "environment", exported)


def _matcher_order(content: dict) -> tuple[list[tuple[str, str, str]], dict]:
    """(the enabled glob matchers in order as (name, pattern, config key), the configs), read as Megatron-core's
    RecipeConfig.from_config_dict reads them (megatron/core/quantization/quant_config.py, _build_matchers: a
    matcher without `enabled` true is skipped; "glob" is the one type); UserError, naming the key and the value,
    for what Megatron-core would fail on with a traceback (a list where a mapping or a config's name belongs)."""
    matchers, configs = content.get("matchers"), content.get("configs")
    for key, value in (("matchers", matchers), ("configs", configs)):
        if value is not None and not isinstance(value, dict):
            raise UserError(f"{key} {shown(value)} must be a mapping (name -> settings), as the export writes it")
    matchers, configs = matchers or {}, configs or {}
    choices = ", ".join(shown(k) for k in list(configs)[:6]) or "none: configs is empty"
    order = []
    for name, m in matchers.items():
        if not isinstance(m, dict):
            raise UserError(f"matcher {shown(name)} must be a mapping, got {shown(m)}")
        if not m.get("enabled", False):
            continue
        if m.get("type") != "glob" or not isinstance(m.get("pattern"), str) or m.get("config") is None:
            raise UserError(f"matcher {shown(name)}: Megatron reads type: glob with a pattern and a config, got {shown(m)}")
        if not isinstance(m["config"], str):
            raise UserError(f"matcher {shown(name)}: config {shown(m['config'])} must name one of configs' keys ({choices})")
        order.append((str(name), m["pattern"], m["config"]))
    return order, configs


def _config_key(order: list[tuple[str, str, str]], content: dict, module: str) -> tuple[str | None, str]:
    """(the config key the first enabled matcher matching `module` gives, None: none, that matcher's name): Megatron-
    core's own RecipeConfig where it is installed (get_quant_config_or_none's MatchContext), else the same rule
    (fnmatch.fnmatch of the module path against each pattern, in order)."""
    try:
        from megatron.core.quantization.quant_config import MatchContext, RecipeConfig
    except ImportError:
        return next(((key, name) for name, pattern, key in order if fnmatch.fnmatch(module, pattern)), (None, ""))
    key = RecipeConfig.from_config_dict(content).match_to_config_key(MatchContext(module_path=module, layer_number=None))
    return key, next((name for name, pattern, k in order if k == key and fnmatch.fnmatch(module, pattern)), "")


def _recipe_fields(recipe: object) -> dict:
    """A training_recipe's fields, checked as Megatron-core's TEQuantizationRecipe.parse_from_config checks them
    (megatron/core/extensions/transformer_engine.py) where it is installed, else its defaults and refusals by hand."""
    if not isinstance(recipe, dict):
        raise UserError(f"training_recipe {shown(recipe)} must be a mapping of TEQuantizationRecipe fields")
    defaults = {
        "fp8_quantization_recipe": None,
        "fp4_quantization_recipe": None,
        "custom_recipe_factory": None,
        "fp8_format": "e4m3",
        "override_quantized_autocast": True,
        "override_nonquantized_autocast": False,
        "tp_only_amax_red": False,
    }
    try:
        from megatron.core.extensions.transformer_engine import TEQuantizationRecipe
    except ImportError:
        TEQuantizationRecipe = None
    if TEQuantizationRecipe is None:
        unknown = sorted(set(recipe) - set(defaults))
        if unknown:
            raise UserError(f"training_recipe field {unknown[0]!r} is not one Megatron reads ({', '.join(defaults)})")
        fields = {**defaults, **recipe}
        if fields["fp8_quantization_recipe"] and fields["fp4_quantization_recipe"]:
            raise UserError("fp8 and fp4 quantization settings are mutually exclusive (Megatron refuses both)")
        if (
            "custom" in (fields["fp8_quantization_recipe"], fields["fp4_quantization_recipe"])
            and not fields["custom_recipe_factory"]
        ):
            raise UserError("a custom recipe requires custom_recipe_factory (Megatron refuses it without)")
        return fields
    try:
        parsed = TEQuantizationRecipe.parse_from_config(recipe)
    except (ValueError, TypeError) as exc:
        raise UserError(f"Megatron refuses training_recipe {shown(recipe)}: {exc}") from None
    return {k: getattr(getattr(parsed, k), "value", getattr(parsed, k)) for k in defaults}


def _factory_gemms(exported: Path, dotted: object, key: str) -> Gemms:
    """The GEMMs a custom_recipe_factory "module.mix" (of config `key`) gives, read from the module beside the YAML
    (as written by this target: all but its GEMMS checked against factory_source, GEMMS read as data; nothing is
    imported). Only "<module>.<function>", two Python names, is read: a package path ('pkg.mod.mix') is imported from
    wherever PYTHONPATH finds it, which verify cannot know without importing it."""
    parts = dotted.split(".") if isinstance(dotted, str) else []
    if len(parts) != 2 or not all(_IDENTIFIER.fullmatch(part) for part in parts):
        raise UserError(
            f"config {shown(key)}: custom_recipe_factory {shown(dotted)} is not '<module>.<function>' (two Python names, "
            f"as `autoprec export` writes it, '{Path(exported).stem}_qfactory.mxfp8_fwd'): verify reads that module beside "
            "the YAML and imports nothing; export the policy again"
        )
    module, func = parts
    path = exported.with_name(f"{module}.py")
    tree = read_python(path)
    table = assigned(tree, "GEMMS", path)
    if not isinstance(table, dict) or not all(
        isinstance(v, tuple) and len(v) == 3 and all(g is None or g in KINDS for g in v) for v in table.values()
    ):
        raise UserError(f"{path}: GEMMS must map a mix to (fprop, dgrad, wgrad), each one of {KINDS} or None")
    same_module(tree, factory_source(table), path, ("GEMMS",))
    if func not in table:
        raise UserError(f"{path}: no factory {func!r} (it has {', '.join(map(str, table))})")
    return tuple(table[func])  # type: ignore[return-value]


class _DataLoader(yaml.SafeLoader):
    """yaml.SafeLoader refusing anchors and aliases, which `autoprec export` never writes: a few nested aliases make
    a 1 KB file stand for billions of values, which every reader of them walks (a message quoting one too)."""

    def compose_node(self, parent, index):  # type: ignore[no-untyped-def]  # PyYAML's own signature
        event = self.peek_event()
        alias = isinstance(event, yaml.AliasEvent)
        if alias or getattr(event, "anchor", None) is not None:
            what = f"{'alias *' if alias else 'anchor &'}{printable(str(event.anchor)[:40])}"
            raise _NotData(
                f"line {event.start_mark.line + 1}: a YAML {what}: `autoprec export` writes no anchor or alias, and nested "
                "aliases make a small file stand for billions of values; write each value out (or export the policy again)"
            )
        return super().compose_node(parent, index)


class _NotData(yaml.YAMLError):
    """What _DataLoader refuses."""


def read_yaml(path: Path) -> object:
    """The YAML file's content, read by _DataLoader; UserError naming the file for anything else."""
    try:
        return yaml.load(read_regular(path).decode("utf-8"), Loader=_DataLoader)  # noqa: S506  a SafeLoader
    except _NotData as exc:
        raise UserError(f"{path}: {exc}") from None
    except (UnicodeDecodeError, yaml.YAMLError, RecursionError) as exc:
        raise UserError(f"{path}: cannot read it as YAML ({exc})") from None


def _literal(pattern: str) -> str | None:
    """The one module path a glob pattern matches, as the export writes one (glob.escape: '[*]' for '*'); None for
    a pattern with wildcards, which may match modules that are not linears (verify knows the linears only)."""
    name = re.sub(r"\[([*?[])\]", r"\1", pattern)
    return None if re.search(r"[*?[]", re.sub(r"\[[*?[]\]", "", pattern)) else name


def precision_resolve(exported: Path, module_names: list[str]) -> dict[str, Resolved]:
    """What Megatron runs each linear in under the YAML, with no global --fp8/--fp4 recipe: the first enabled matcher
    matching the module path chooses its config (none: the module runs as the global setting, high precision); a
    quantized config runs only with override_nonquantized_autocast (megatron/core/extensions/transformer_engine.py,
    _get_fp8_autocast_for_quant_recipe); a custom one in its factory's GEMMs. An enabled matcher whose pattern names
    one module (as the export writes them) that no linear of the model is, is given too, by that name."""
    content = read_yaml(Path(exported))
    if not isinstance(content, dict):
        raise UserError(f"{exported}: a --te-precision-config-file is a mapping of configs and matchers")
    try:
        order, configs = _matcher_order(content)

        def under(key: str, matcher: str) -> Resolved:
            config = configs.get(key)
            if not isinstance(config, dict) or config.get("transformer_engine_config_type") != "TEQuantizationParams":
                raise UserError(f"config {shown(key)} (matcher {shown(matcher)}) is not a TEQuantizationParams config")
            try:
                fields = _recipe_fields(config.get("training_recipe"))
            except UserError as exc:
                raise UserError(f"config {shown(key)}: {exc}") from None
            fp8, fp4 = fields["fp8_quantization_recipe"], fields["fp4_quantization_recipe"]
            via = f"matcher {matcher!r} -> config {key!r}"
            if fp8 is None and fp4 is None:
                return Resolved(HIGH, via)
            if not fields["override_nonquantized_autocast"]:
                return Resolved(HIGH, f"{via}, without override_nonquantized_autocast: no recipe runs")
            if "custom" in (fp8, fp4):
                return Resolved(_factory_gemms(Path(exported), fields["custom_recipe_factory"], key), via)
            if fp8 is not None:
                return Resolved(recipe_gemms("fp8", fields["fp8_format"], fp8), via)
            return Resolved(recipe_gemms("fp4", "e2m1", fp4), via)

        found = {}
        for module in module_names:
            key, matcher = _config_key(order, content, module)
            found[module] = Resolved(HIGH, "no enabled matcher matches it") if key is None else under(key, matcher)
        for matcher, pattern, key in order:  # a mistyped name: its matcher selects nothing
            name = _literal(pattern)
            if name is not None and name not in found and not any(fnmatch.fnmatch(m, pattern) for m in module_names):
                found[name] = under(key, matcher)
    except UserError as exc:
        raise UserError(f"{exported}: {exc}") from None
    return found
