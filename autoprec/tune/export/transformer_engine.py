"""`--to transformer-engine`: a Python file for Transformer Engine's heterogeneous ("fine-grained") quantization: a
table of the policy's mxfp8/nvfp4 layers, each with its three GEMMs' formats, and `custom_recipe()`, which builds
TE's `CustomRecipe` whose quantizer factory gives each tensor slot of those layers its quantizer.

The facts it rests on (NVIDIA/TransformerEngine: docs/features/low_precision_training "Fine-grained quantization
recipes", transformer_engine/pytorch/custom_recipes/quantizer_factories.py, transformer_engine/pytorch/quantization.py
QuantizerRole): `CustomRecipe(qfactory=f)` calls `f(role)` once per quantizer slot of a module; `role` (or None) has
`module_type` ("linear" for te.Linear and the linears of composite modules), `tensor_type` ("input", "weight",
"grad_output", ...) and `name`, the module's `te.Linear(..., name=...)`. fprop consumes input.rowwise and
weight.rowwise, dgrad grad_output.rowwise and weight.columnwise, wgrad input.columnwise and grad_output.columnwise;
`HybridQuantizer(rowwise_quantizer=, columnwise_quantizer=, columnwise_source=)` gives a tensor a different quantizer
per direction, `IdentityQuantizer()` keeps a direction (or a whole slot) in high precision, and `mxfp8_factory` /
`nvfp4_factory` give the quantizers of TE's MXFP8BlockScaling and NVFP4BlockScaling recipes.

The table is data: each layer name a string literal written with repr(), read back by `ast.literal_eval`; the
policy's file name and what is left out are escaped comments. fp8 and high-precision layers are not written (every
layer the table does not name runs in high precision under the recipe) and are listed as not expressed.

HybridQuantizer, IdentityQuantizer and the quantizer factories came in TE 2.19 (_common.TE_NEEDS): `custom_recipe()`
checks the installed version first (require_transformer_engine), and the file records the NVTE_* environment its
CustomRecipe reads (ENVIRONMENT: NVTE_BACKWARD_OVERRIDE unset), which `autoprec verify` checks.
"""

from __future__ import annotations

from pathlib import Path

from autoprec.errors import UserError, printable, shown
from autoprec.files import write_text
from autoprec.formats import Format
from autoprec.policy import ROOT, Policy
from autoprec.tune.export._common import (
    KINDS,
    QUANTIZER_FOR,
    REQUIRE_TE,
    TE_NEEDS,
    _comments,
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
    root_not_expressed,
    same_module,
    te_version_note,
)
from autoprec.tune.export.base import HIGH, ExportTarget, Resolved, register_export_target

TABLE = "GEMMS"  # the written file's table: layer -> (fprop, dgrad, wgrad) formats
ENVIRONMENT = "ENVIRONMENT"  # the written file's NVTE_* variables -> the value TE must read (None: unset)
NAMES = (TABLE, ENVIRONMENT, "quantizer_factory", "quantizer_for", "require_transformer_engine", "custom_recipe")
ENVIRONMENT_RECORDED = nvte_environment(["custom"])  # CustomRecipe's: the same for every policy


def te_gemms(policy: Policy) -> dict[str, tuple[str | None, str | None, str | None]]:
    """The policy's block-scaled layers -> (fprop, dgrad, wgrad): "mxfp8", "nvfp4" or None (high precision). Never the
    model root: TE's role name of a te.Linear built without name= is '', so an entry '' would select every such linear
    (te_not_expressed says it)."""
    return {name: gemms for name, fmt in policy.layers.items() if (gemms := blockscaled_gemms(fmt)) is not None and name != ROOT}


def te_not_expressed(policy: Policy) -> list[str]:
    """The policy's layers outside the block-scaled formats, per format: the recipe runs them in high precision; and
    a block-scaled (or fp8) model root, which the table leaves out."""
    root = root_not_expressed(
        policy,
        ": Transformer Engine names every te.Linear built without name= '', so a table entry '' would run each of those in it",
    )
    by_format: dict[Format, list[str]] = {}
    for name, fmt in policy.layers.items():
        if name == ROOT and root:
            continue
        if blockscaled_gemms(fmt) is None and fmt is not Format.FP32:
            by_format.setdefault(fmt, []).append(name)
    lines = []
    for fmt, names in by_format.items():
        why = (
            "this file writes the mxfp8/nvfp4 formats only (use --to megatron-precision or --to torchao for fp8); "
            "the recipe runs it in high precision"
            if fmt.family.fp8_gemms(fmt) is not None
            else "the recipe runs every layer it does not list in the model's own dtype, which this file does not set"
        )
        if ROOT in names:
            lines.append(f"the model root (every op outside a listed layer) runs in {fmt.value}: {why}")
            names = [n for n in names if n != ROOT]
        if names:
            lines.append(f"{_layers(names)} in {fmt.value}: {why}")
    return [
        *root,
        *lines,
        *fp32_under_a_lowered_root(policy, "Transformer Engine"),
        *gather_not_expressed(policy, "Transformer Engine"),
    ]


def _table_literal(gemms: dict[str, tuple[str | None, str | None, str | None]]) -> str:
    """A dict display of string and None literals, one layer a line: repr() escapes every quote, backslash, line
    break and non-printable character of a name, so a name is a literal whatever it holds."""
    if not gemms:
        return "{}"
    rows = "".join(f"    {name!r}: {tuple(g)!r},\n" for name, g in gemms.items())
    return "{\n" + rows + "}"


def te_source(policy: Policy, *, source: str = "a policy") -> str:
    """The Transformer Engine file's text (see the module docstring)."""
    gemms = te_gemms(policy)
    last = None if gemms else "The policy has no mxfp8/nvfp4 layer: the recipe runs every layer in high precision."
    header = _comments(source, "not expressed here", te_not_expressed(policy), last)
    needs = [f"# needs {TE_NEEDS}", "# the environment Transformer Engine must read (ENVIRONMENT; `autoprec verify` checks it):"]
    needs += [f"#   - {printable(line)}" for line in environment_lines(ENVIRONMENT_RECORDED)]
    header = "\n".join([header, *needs])
    return f'''"""Transformer Engine heterogeneous quantization for a policy's mxfp8/nvfp4 layers (written by
`autoprec export --to transformer-engine`). Build each TE linear with the name the policy gives it, then:

    import transformer_engine.pytorch as te
    from this_file import custom_recipe
    layer = te.Linear(4096, 4096, name="layers.0.attention.wo")   # the policy's layer name
    with te.autocast(enabled=True, recipe=custom_recipe()):
        out = model(x)

GEMMS maps a layer name to its three GEMMs' formats (fprop, dgrad, wgrad): "mxfp8" (TE's MXFP8BlockScaling
quantizers), "nvfp4" (NVFP4BlockScaling's) or None (high precision). A layer GEMMS does not name runs in high
precision; so does a te.Linear built without name= (TE names it '', which GEMMS never holds).

TE calls quantizer_factory(role) once per quantizer slot of a module, `role` a QuantizerRole (module_type,
tensor_type, name) or None. Its `name` is the name= the module was built with, so the selection needs every
listed layer built as te.Linear(..., name=<its module path, exactly as GEMMS writes it>); module_type is "linear" for
te.Linear, LayerNormLinear and the linears of LayerNormMLP and MultiheadAttention, which take their names from TE.
`autoprec verify` reads GEMMS under that rule. custom_recipe() first checks that the installed Transformer Engine is
one this file runs on (require_transformer_engine). ENVIRONMENT is the environment TE must read: TE reads these
NVTE_* variables into its recipes when it is imported, and `autoprec verify` checks the process's against it.
The comments below name the policy file, what the file leaves out and what it needs.
"""

{header}

# layer name -> (fprop, dgrad, wgrad): "mxfp8", "nvfp4" or None (high precision)
{TABLE} = {_table_literal(gemms)}

# NVTE_* variable -> the value Transformer Engine must read for this recipe (None: unset)
{ENVIRONMENT} = {ENVIRONMENT_RECORDED!r}


def quantizer_factory(role):
    """The quantizer for one slot: a listed linear's (by its te.Linear name=) from quantizer_for; any other
    module's, and a slot without a role, high precision."""
    import transformer_engine.pytorch as te

    gemms = {TABLE}.get(role.name) if role is not None and role.module_type == "linear" else None
    return te.IdentityQuantizer() if gemms is None else quantizer_for(role, gemms)


{QUANTIZER_FOR}

{REQUIRE_TE}

def custom_recipe():
    """TE's CustomRecipe for this policy: pass it to te.autocast(recipe=...)."""
    require_transformer_engine()
    from transformer_engine.common.recipe import CustomRecipe

    return CustomRecipe(qfactory=quantizer_factory)
'''


@register_export_target
class TransformerEngine(ExportTarget):
    name = "transformer-engine"
    suffix = ".py"
    summary = "a CustomRecipe per module and GEMM (HybridQuantizer) for the policy's mxfp8/nvfp4 layers"
    switch = (
        "a recipe swap, no restart: Transformer Engine takes its recipe at every forward, so from each phase's first "
        "step pass that phase's file's custom_recipe() to te.autocast (its modules rebuild their quantizers when the "
        "recipe changes)"
    )

    def write(self, policy: Policy, out: str | Path, *, source: str = "a policy", **options: object) -> list[str]:
        write_text(out, te_source(policy, source=source))
        left_out = te_not_expressed(policy)
        if not te_gemms(policy):
            left_out.append("the policy has no mxfp8/nvfp4 layer: the file's recipe runs every layer in high precision")
        return [*left_out, te_version_note(), *environment_note(ENVIRONMENT_RECORDED)]

    def resolve(self, exported: Path, module_names: list[str]) -> dict[str, Resolved]:
        return te_resolve(exported, module_names)

    def environment(self, exported: Path) -> dict[str, str | None]:
        tree = read_python(exported)
        same_module(tree, te_source(Policy(layers={})), exported, (TABLE, ENVIRONMENT))
        return environment_table(assigned(tree, ENVIRONMENT, exported), ENVIRONMENT, exported)


def te_resolve(exported: Path, module_names: list[str]) -> dict[str, Resolved]:
    """What CustomRecipe(qfactory=quantizer_factory) runs each linear in, read from the file's GEMMS: TE calls the
    factory with a QuantizerRole whose `name` is the te.Linear's name= (transformer_engine/pytorch/quantization.py,
    QuantizerRole), which the file's header asks to be the module path; the factory looks that name up exactly, and
    gives a name it does not find high precision. An entry that names no linear of the model is given too."""
    tree = read_python(exported)
    same_module(tree, te_source(Policy(layers={})), exported, (TABLE, ENVIRONMENT))
    table = assigned(tree, TABLE, exported)
    if not isinstance(table, dict) or not all(
        isinstance(k, str) and isinstance(v, tuple) and len(v) == 3 and all(g is None or g in KINDS for g in v)
        for k, v in table.items()
    ):
        raise UserError(
            f"{exported}: {TABLE} must map a layer name to (fprop, dgrad, wgrad), each one of {KINDS} or None, got {shown(table)}"
        )
    found = {}
    for name in module_names:
        gemms = table.get(name)
        found[name] = (
            Resolved(HIGH, "not in GEMMS")
            if gemms is None
            else Resolved(tuple(gemms), f"GEMMS[{name!r}] (te.Linear(name={name!r}))")
        )  # type: ignore[arg-type]
    for name, gemms in table.items():  # an entry no linear is named by (a typo): it selects nothing
        if name not in found:
            found[name] = Resolved(tuple(gemms), f"GEMMS[{name!r}]")  # type: ignore[arg-type]
    return found
