"""What the export targets share: how an fp8 format's GEMMs are named (recipe_key), the policy's fp8 layers per
recipe, what an fp8-only target leaves out, and the two ways text from a policy enters a written Python file (an
escaped comment, JSON string data), so that nothing read from a policy becomes code (see the package docstring)."""

from __future__ import annotations

import ast
import dataclasses
import io
import json
import os
import stat
import tokenize
from collections.abc import Iterable, Mapping
from pathlib import Path

from autoprec.errors import UserError, printable, shown
from autoprec.formats import Format
from autoprec.policy import ROOT, Policy
from autoprec.tune.export.base import HIGH, Gemms

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
    its family says them (FormatFamily.block_scaled_gemms); None for a format of a family that quantises in no blocks."""
    return fmt.family.block_scaled_gemms(fmt)


def blockscaled_recipe(fmt: Format) -> str | None:
    """What the training frameworks call a block-scaled format's recipe (BlockScaledFamily.recipe_name: "mxfp8",
    "nvfp4", "mxfp8_rceil_wgrad_with_hp"); None for the other per-GEMM mixes and for other families' formats."""
    return fmt.family.recipe_name(fmt)


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
    """What an fp8-only target leaves out: a lowered root and the non-fp8, non-fp32 layers per format, and fp32
    layers inside a lowered root (fp32_under_a_lowered_root), as lines. `skip`: formats the target writes, or
    reports in lines of its own."""
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
    return lines + fp32_under_a_lowered_root(policy, tool)  # autocast runs an unconverted fp32 layer lowered too


def gather_not_expressed(policy: Policy, tool: str) -> list[str]:
    """A line for the policy's fp8 all-gather under FSDP2 (Policy.fsdp_fp8_all_gather), for a target whose file has
    no setting for it; none where the policy does not set it."""
    gathered = sorted(str(f) for f in policy.fp8_all_gathered)
    if not gathered:
        return []
    return [
        f"fsdp_fp8_all_gather: the policy all-gathers the weights of its {', '.join(gathered)} layers in fp8 under "
        f"FSDP2; this {tool} file has no setting for it, so they gather in their own dtype there"
    ]


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


def gathered_recipes(policy: Policy) -> list[str]:
    """The recipe keys (recipe_key) whose layers the policy all-gathers in fp8 under FSDP2 (its fsdp_fp8_all_gather,
    for the formats whose family gathers in fp8: torchao's tensorwise recipe), in the policy's order; [] where off."""
    keys = [recipe_key(f) for f in policy.layers.values() if f in policy.fp8_all_gathered]
    return list(dict.fromkeys(k for k in keys if k is not None))


def str_list(value: object, name: str, path: Path) -> list[str]:
    """`value` (a file's `name` table) as a list of strings; UserError naming the file otherwise."""
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        got = printable(repr(value))[:80]
        raise UserError(f"{path}: {name} must be a list of recipe names (strings), got {got}: export the policy again")
    return value


def _comments(source: str, title: str, lines: list[str], last: str | None) -> str:
    """The policy file's name and what is not expressed, as comment lines: escaped (errors.printable), so that
    no line break or control character from the policy or its file name reaches the code or a terminal."""
    out = [f"# policy file: {printable(source)}", f"# {title}:"]
    out += [f"#   - {printable(line)}" for line in lines] or ["#   (nothing: every listed layer is in the file or fp32)"]
    return "\n".join(out + (["#", f"# {last}"] if last else []))


def _json_literal(value: object) -> str:
    """Python source for `json.loads(<value as JSON>)`, the JSON text in string literals (repr escapes every quote,
    backslash and line break; json.dumps writes ASCII): a layer name is data here, whatever it holds."""
    lines = json.dumps(value, indent=4).splitlines(keepends=True)
    return "json.loads(\n" + "".join(f"    {line!r}\n" for line in lines) + ")"


# --- reading an exported file back as data, for `autoprec verify` (nothing in it is run) ---

GEMM_NAMES = ("fprop", "dgrad", "wgrad")


def fp8_spec_gemms(spec: Mapping[str, object]) -> Gemms:
    """An fp8 spec's JSON (Fp8Spec.to_json, the torchao file's FP8_GEMMS) as per-GEMM labels: "fp8 <scaling>" for a
    GEMM in fp8, None for one in high precision."""
    label = f"fp8 {spec.get('scaling')}"
    fprop, dgrad, wgrad = (label if spec.get(g) is True else None for g in GEMM_NAMES)
    return fprop, dgrad, wgrad


def policy_gemms(fmt: Format) -> Gemms:
    """What a linear the policy runs in `fmt` computes each GEMM in, in the verifier's labels (base.Gemms): a
    block-scaled format's element formats, an fp8 format's "fp8 <scaling>", HIGH for a dtype (the exports set no
    dtype: a framework runs such a layer in the model's)."""
    if (gemms := blockscaled_gemms(fmt)) is not None:
        return gemms
    if (fp8 := fmt.family.fp8_gemms(fmt)) is not None:
        return fp8_spec_gemms(fp8.to_json())
    return HIGH


def _kind(mode: int) -> str:
    """What a file that is not a regular one is, for the message."""
    for test, kind in ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO, a named pipe"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return kind
    return "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "not a plain file"


def regular_file(path: str | Path, fix: str = "give the file `autoprec export` wrote") -> Path:
    """`path`, refused (UserError naming it and `fix`) unless it is a regular file (a link to one is one), checked
    with os.stat before anything opens it: opening a FIFO to read waits for a writer, forever, and a device such as
    /dev/zero never ends."""
    path = Path(path)
    try:
        mode = os.stat(path).st_mode
    except (OSError, ValueError) as exc:  # ValueError: a NUL in the path
        raise UserError(f"{path}: cannot read it ({getattr(exc, 'strerror', None) or exc})") from None
    if not stat.S_ISREG(mode):
        raise UserError(f"{path}: not a regular file ({_kind(mode)}): {fix}")
    return path


def read_regular(path: str | Path, fix: str = "give the file `autoprec export` wrote", limit: int = -1) -> bytes:
    """A regular file's bytes (regular_file), its first `limit` only where given, opened non-blocking and checked
    again on the open descriptor, so a file swapped for a FIFO after the check is refused too, never waited on."""
    path = regular_file(path, fix)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))  # Windows has no FIFOs to wait on
        with os.fdopen(fd, "rb") as f:
            mode = os.fstat(f.fileno()).st_mode
            if not stat.S_ISREG(mode):
                raise UserError(f"{path}: not a regular file ({_kind(mode)}): {fix}")
            return f.read(limit)
    except OSError as exc:
        raise UserError(f"{path}: cannot read it ({exc.strerror or exc})") from None


def read_python(path: Path) -> ast.Module:
    """An exported Python file's syntax tree, parsed from its bytes by Python's own decoding rules (PEP 263: a BOM
    or a coding line), never imported; UserError naming the file otherwise. A coding line other than UTF-8 is
    refused: the export writes UTF-8, and a file Python decodes otherwise can hold, in the bytes of what reads as a
    table's string in UTF-8, code that runs on import (in GBK, a character's last byte and a backslash after it are
    one character, so a quote the backslash escaped in UTF-8 closes the string)."""
    data = read_regular(path)
    try:
        encoding, _ = tokenize.detect_encoding(io.BytesIO(data).readline)  # what Python's import reads it as
    except SyntaxError as exc:  # a BOM with another coding line, an encoding Python does not know
        raise UserError(f"{path}: cannot read it as a Python file ({exc}): remove its coding line") from None
    if encoding not in ("utf-8", "utf-8-sig"):
        raise UserError(
            f"{path}: its coding line says coding {shown(encoding, 40)}, so Python would decode it as {printable(encoding[:40])}, "
            "not as the utf-8 `autoprec export` writes and verify reads: remove that line (or export the policy again)"
        )
    try:
        return ast.parse(data, filename=str(path))  # bytes: decoded as the import decodes them (a BOM dropped)
    except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
        raise UserError(f"{path}: cannot read it as a Python file ({type(exc).__name__}: {exc})") from None


def assigned(tree: ast.Module, name: str, path: Path) -> object:
    """The value of the file's top-level `name = ...`, read as data: a literal (ast.literal_eval) or
    json.loads(<string literals>), the two forms the export writes; UserError naming the file otherwise."""
    found = [n.value for n in tree.body if isinstance(n, ast.Assign) and [ast.unparse(t) for t in n.targets] == [name]]
    if len(found) != 1:
        raise UserError(f"{path}: expected one top-level {name} = ..., found {len(found)}: export the policy again")
    value = found[0]
    try:
        if (
            isinstance(value, ast.Call)
            and ast.unparse(value.func) == "json.loads"
            and len(value.args) == 1
            and not value.keywords
        ):
            return json.loads(ast.literal_eval(value.args[0]))
        return ast.literal_eval(value)
    except (ValueError, TypeError, SyntaxError, RecursionError):
        raise UserError(f"{path}: {name} is not data as `autoprec export` writes it (a literal or JSON text)") from None


def same_module(tree: ast.Module, written: str, path: Path, tables: tuple[str, ...]) -> None:
    """Refuse a file that differs from what `autoprec export` writes (`written`: a file it wrote) anywhere but the
    values of its top-level `tables` assignments, the data the resolver reads (with `assigned`, which refuses any
    value but data): the verifier knows what the file does only for the export's own statements, so an appended
    `FP8_LAYERS[...].append(...)`, a rebound name or an extra import would run unseen. Comments, blank lines and
    layout are not in the syntax tree, so they may change; the first differing top-level statement is named."""

    def masked(stmt: ast.stmt) -> str:
        (target,) = stmt.targets if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 else (None,)
        if isinstance(target, ast.Name) and target.id in tables:
            stmt = ast.Assign(targets=[target], value=ast.Constant(None))
        return ast.dump(stmt)

    mine, theirs = ast.parse(written).body, tree.body
    try:
        at = next((i for i, (m, t) in enumerate(zip(mine, theirs)) if masked(m) != masked(t)), min(len(mine), len(theirs)))
        if at == len(mine) == len(theirs):
            return
        if at < len(theirs):
            line, what = theirs[at].lineno, ast.unparse(theirs[at]).splitlines()[0]
        else:  # the file stops short
            line, what = (theirs[-1].end_lineno or 1) if theirs else 1, "the end of the file, where the export writes more"
    except RecursionError:
        raise UserError(f"{path}: nested too deeply to compare with what `autoprec export` writes") from None
    raise UserError(
        f"{path}: line {line} ({printable(what[:60] + ('...' if len(what) > 60 else ''))}) differs from what `autoprec "
        "export` writes, so what the file runs cannot be read without running it: export the policy again and edit "
        f"only its tables ({', '.join(tables)})"
    )


def str_table(value: object, name: str, path: Path) -> dict[str, list[str]]:
    """`value` checked to be {str: [str, ...]} (a layer table); UserError naming the file otherwise."""
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and isinstance(v, list) and all(isinstance(x, str) for x in v) for k, v in value.items()
    ):
        raise UserError(f"{path}: {name} must map a name to a list of layer names, got {shown(value)}")
    return value


# --- Transformer Engine's quantizer per slot, for the files that build a CustomRecipe ---

KINDS = ("mxfp8", "nvfp4")  # the GEMM formats quantizer_factory has a TE factory for

# A linear's quantizer for one slot given its (fprop, dgrad, wgrad) formats: the TE file and the factory module
# `--to megatron-precision` writes for Megatron's custom recipe both hold this function (one source, here).
QUANTIZER_FOR = '''def quantizer_for(role, gemms):
    """The quantizer for one slot of a linear whose GEMMs run in `gemms` (fprop, dgrad, wgrad: "mxfp8", "nvfp4" or
    None, high precision). Its input, weight and output gradient each get, per direction, the format of the GEMM
    that consumes it (rowwise | columnwise): input fprop | wgrad, weight fprop | dgrad, grad_output dgrad | wgrad;
    any other slot (an output, a gradient TE asks for, a slot without a role): high precision."""
    import transformer_engine.pytorch as te
    from transformer_engine.pytorch.custom_recipes.quantizer_factories import mxfp8_factory, nvfp4_factory

    fprop, dgrad, wgrad = gemms
    rowwise, columnwise = {"input": (fprop, wgrad), "weight": (fprop, dgrad), "grad_output": (dgrad, wgrad)}.get(
        getattr(role, "tensor_type", None), (None, None)
    )

    def quantizer(kind):
        if kind is None:
            return te.IdentityQuantizer()
        return {"mxfp8": mxfp8_factory, "nvfp4": nvfp4_factory}[kind](role)

    if rowwise == columnwise:
        return quantizer(rowwise)
    return te.HybridQuantizer(
        rowwise_quantizer=quantizer(rowwise), columnwise_quantizer=quantizer(columnwise), columnwise_source="original"
    )
'''
# The Transformer Engine the written files need: HybridQuantizer and IdentityQuantizer (transformer_engine.pytorch) and
# transformer_engine.pytorch.custom_recipes.quantizer_factories (mxfp8_factory, nvfp4_factory) came in TE 2.19 ("per-
# direction hybrid quantization through CustomRecipe", its release notes; TE 2.18's wheel has none of the three).
TE_VERSION = (2, 19)
TE_MIN = ".".join(map(str, TE_VERSION))
TE_NEEDS = (  # what the written files need of Transformer Engine
    f"Transformer Engine {TE_MIN} or later (HybridQuantizer, IdentityQuantizer and "
    "transformer_engine.pytorch.custom_recipes.quantizer_factories came in 2.19; CustomRecipe and QuantizerRole are "
    "older); a GPU with MXFP8/NVFP4 kernels (compute capability 10.0)"
)
# Megatron-Core 0.19's pinned Transformer Engine is older than the per-GEMM files need
MEGATRON_TE = (
    f"Megatron-Core 0.19 pins Transformer Engine 2.18, which has no HybridQuantizer: install Transformer Engine "
    f"{TE_MIN} or later over its pin"
)

# The written file's check of the installed Transformer Engine, by its distribution's version (importlib.metadata: the
# version is read, nothing of TE runs), before anything of TE is imported.
REQUIRE_TE = f'''def require_transformer_engine():
    """Raise RuntimeError unless the installed Transformer Engine is {TE_MIN} or later (its version read, nothing
    of it run): this file's HybridQuantizer, IdentityQuantizer and quantizer factories came in {TE_MIN}."""
    import importlib.metadata
    import re

    try:
        found = importlib.metadata.version("transformer_engine")
    except importlib.metadata.PackageNotFoundError:
        found = None
    numbers = re.match(r"(\\d+)\\.(\\d+)", found or "")
    if numbers is None or (int(numbers[1]), int(numbers[2])) < {TE_VERSION!r}:
        raise RuntimeError(
            f"Transformer Engine {{found or 'is not installed'}}: this file (written by `autoprec export`) needs "
            "Transformer Engine {TE_MIN} or later for its per-GEMM quantizers (HybridQuantizer, IdentityQuantizer, "
            "quantizer_factories); "
            "{MEGATRON_TE}"
        )
'''


# --- Transformer Engine's environment: the NVTE_* variables that change what a recipe computes ---


@dataclasses.dataclass(frozen=True)
class NvteVariable:
    """An environment variable Transformer Engine reads into a recipe's field default when it is imported
    (transformer_engine/common/recipe/__init__.py, TE 2.19), and the value the recipe autoprec measured needs it read
    as (`expected`; None: unset). `flag`: TE reads it as `== "1"`, so unset and any other value read as "0"."""

    name: str
    expected: str | None
    flag: bool
    recipes: tuple[str, ...]  # the exports' recipe names (Megatron's, "custom" for CustomRecipe) whose TE recipe reads it
    changes: str  # what another value does

    def read(self, environ: Mapping[str, str]) -> str | None:
        """The value TE reads from `environ` (flags as "1" or "0", the others as set, None where unset)."""
        value = environ.get(self.name)
        if self.flag:
            return "1" if value == "1" else "0"
        return value if value is not None or self.expected is None else self.expected


_EVERY = ("tensorwise", "mxfp8", "nvfp4", "custom")  # DelayedScaling's too, which no export writes
NVTE = (
    NvteVariable(
        "NVTE_BACKWARD_OVERRIDE",
        None,
        False,
        _EVERY,
        "'high_precision' or 'dequantized' runs dgrad and wgrad in high precision, whatever the recipe says",
    ),
    NvteVariable("NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES", "0", True, ("tensorwise",), "1 rounds each scale to a power of 2"),
    NvteVariable("NVTE_NVFP4_DISABLE_RHT", "0", True, ("nvfp4",), "1 drops the random Hadamard transform on wgrad's operands"),
    NvteVariable("NVTE_NVFP4_DISABLE_STOCHASTIC_ROUNDING", "0", True, ("nvfp4",), "1 rounds the gradients to nearest"),
    NvteVariable(
        "NVTE_NVFP4_DISABLE_2D_QUANTIZATION", "0", True, ("nvfp4",), "1 scales the weight in 1x16 blocks, not 16x16 tiles"
    ),
    NvteVariable("NVTE_NVFP4_ROW_SCALED_ACTIVATION", "0", True, ("nvfp4",), "1 scales the forward activations per row"),
    NvteVariable("NVTE_NVFP4_4OVER6", "none", False, ("nvfp4",), "another scope chooses each block's scale by 4over6"),
)
_NVTE_BY_NAME = {v.name: v for v in NVTE}


def nvte_environment(recipes: Iterable[str]) -> dict[str, str | None]:
    """What an export records of the environment for the TE recipes it runs (`recipes`: "tensorwise", "mxfp8",
    "nvfp4", "custom"): each variable those recipes read -> the value they need read (None: unset); {} for none."""
    used = set(recipes)
    return {v.name: v.expected for v in NVTE if used & set(v.recipes)}


def _wanted(name: str, expected: str | None) -> str:
    """'unset', 'unset or 0' (where unset reads as the value TE needs) or the value: what the export expects."""
    known = _NVTE_BY_NAME.get(name)
    if expected is None:
        return "unset"
    return f"unset or {expected}" if known is not None and known.read({}) == expected else expected


def environment_lines(environment: Mapping[str, str | None]) -> list[str]:
    """The recorded environment, one variable a line with what another value does, for a file's comments."""
    return [
        f"{name}: {_wanted(name, expected)}" + (f" ({_NVTE_BY_NAME[name].changes})" if name in _NVTE_BY_NAME else "")
        for name, expected in environment.items()
    ]


def environment_note(environment: Mapping[str, str | None]) -> list[str]:
    """The export's line for the environment it recorded (none where it recorded none)."""
    if not environment:
        return []
    said = "; ".join(f"{name} {_wanted(name, expected)}" for name, expected in environment.items())
    return [f"note: Transformer Engine's environment, recorded in the file and checked by `autoprec verify`: {said}"]


def te_version_note(megatron: bool = False) -> str:
    """The export's line for the Transformer Engine a file with HybridQuantizer needs; `megatron`: the file runs under
    Megatron-Core, whose 0.19 pins an older one."""
    return f"note: needs {TE_NEEDS}" + (f"; {MEGATRON_TE}" if megatron else "")


def environment_table(value: object, name: str, path: Path) -> dict[str, str | None]:
    """`value` (a file's recorded environment) checked to be {NVTE_NAME: str or None}; UserError naming the file."""
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and k.startswith("NVTE_") and (v is None or isinstance(v, str)) for k, v in value.items()
    ):
        raise UserError(
            f"{path}: {name} must map an NVTE_ variable to its value (a string, or null: unset), got {shown(value)}: "
            "export the policy again"
        )
    return value


def environment_mismatches(environment: Mapping[str, str | None], environ: Mapping[str, str]) -> list[str]:
    """One line per recorded variable that `environ` (a process's environment) gives another value than the export
    recorded, read as TE reads it (NvteVariable.read; a variable autoprec does not know: as set), naming it, its
    value and the expected one; [] where each matches."""
    lines = []
    for name, expected in environment.items():
        known = _NVTE_BY_NAME.get(name)
        found = known.read(environ) if known else environ.get(name)
        if found == expected:
            continue
        value = environ.get(name)
        here = "unset" if value is None else shown(value, 40)
        want = printable(_wanted(name, expected)[:60])
        why = f": Transformer Engine reads it when imported; {known.changes}" if known else ""
        lines.append(f"{printable(name[:60])} is {here} here, the export expects {want}{why}")
    return lines
