"""`autoprec verify` (autoprec/tune/export/verify.py and each target's resolve()): an exported file resolved on a
model's module names by its framework's own matching rules, per linear and GEMM, against the policy. Module names
as torchtitan, Megatron and Hugging Face write them, with `layers.1` beside `layers.10`; each wrong export is a
right one hand-edited, and is caught with its layers named. Where the framework installs on a CPU (torchtitan,
Megatron-core) its own code converts or matches the same names, and the resolver must agree with it."""

import copy
import importlib.util
import os
import re
import sys

import pytest
import yaml

from autoprec import Policy, UserError
from autoprec.tune._cli import main
from autoprec.tune.export import export
from autoprec.tune.export.verify import linear_names, table, verify

TITAN_ROLES = ("attention.qkv_linear.wqkv", "attention.wo", "feed_forward.w1", "feed_forward.w2", "feed_forward.w3")
MEGATRON_ROLES = ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")
HF_ROLES = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj")
HF_ROLES += ("mlp.down_proj",)


def titan_names(head="output"):
    return [f"layers.{i}.{r}" for i in range(12) for r in TITAN_ROLES] + [head]


def megatron_names(head="output_layer"):
    return [f"decoder.layers.{i}.{r}" for i in range(12) for r in MEGATRON_ROLES] + [head]


def hf_names(head="lm_head"):
    return [f"model.layers.{i}.{r}" for i in range(12) for r in HF_ROLES] + [head]


def edit(path, old, new, count=1):
    """Hand-edit an exported file: `old` must be in it."""
    text = path.read_text()
    assert text.count(old) >= count, f"{old!r} not in {path.name}"
    path.write_text(text.replace(old, new))


def differing(path, policy, names, target=None):
    return verify(path, policy, names, target).differing


def load(path):
    spec = importlib.util.spec_from_file_location(f"verified_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# --- torchao: module_filter_fn per recipe, a later recipe's conversion the one that stays ---

HF_POLICY = Policy(
    layers={
        "": "bf16",
        "model.layers.1.mlp.down_proj": "fp8",
        "model.layers.1.mlp.up_proj": "fp8-rowwise",
        "model.layers.10.self_attn.o_proj": "fp8-fwd",
        "lm_head": "bf16",
    }
)


def test_torchao_export_verifies_and_a_moved_layer_is_caught_by_name(tmp_path):
    path = tmp_path / "p_torchao.py"
    export(HF_POLICY, "torchao", path)
    result = verify(path, HF_POLICY, hf_names())
    assert result.target == "torchao" and result.differing == []
    rows = {r.layer: r for r in result.rows}
    assert rows["model.layers.10.self_attn.o_proj"].resolved.gemms == ("fp8 tensorwise", None, None)  # per GEMM
    assert rows["model.layers.1.mlp.up_proj"].resolved.gemms == ("fp8 rowwise",) * 3
    edit(path, '"model.layers.1.mlp.down_proj"', '"model.layers.10.mlp.down_proj"')  # layers.1 -> layers.10
    assert differing(path, HF_POLICY, hf_names()) == ["model.layers.1.mlp.down_proj", "model.layers.10.mlp.down_proj"]


def test_torchao_verify_checks_the_fp8_all_gather_layer_by_layer(tmp_path):
    import dataclasses

    path = tmp_path / "p_torchao.py"
    gathered = dataclasses.replace(HF_POLICY, fsdp_fp8_all_gather=True)
    export(gathered, "torchao", path)
    rows = {r.layer: r for r in verify(path, gathered, hf_names()).rows}
    assert all(r.ok for r in rows.values())
    assert rows["model.layers.1.mlp.down_proj"].resolved.fp8_all_gather  # fp8, tensorwise: gathered in fp8
    assert not rows["model.layers.1.mlp.up_proj"].resolved.fp8_all_gather  # rowwise: in its own dtype
    assert not rows["model.layers.10.self_attn.o_proj"].resolved.fp8_all_gather  # fp8-fwd: torchao does not gather it
    assert differing(path, HF_POLICY, hf_names()) == ["model.layers.1.mlp.down_proj"]  # the file gathers, the policy not
    edit(path, """'    "tensorwise"\\n'""", "")  # the table emptied by hand
    assert differing(path, gathered, hf_names()) == ["model.layers.1.mlp.down_proj"]  # the policy gathers, the file not
    assert "fp8 tensorwise / fp8 tensorwise / fp8 tensorwise, fp8 all-gather" in table(verify(path, gathered, hf_names()))
    # a rowwise recipe listed by hand: torchao's config refuses to all-gather it in fp8
    edit(path, """'[\\n'""", """'["rowwise"\\n'""")  # the emptied table's opening line
    refused = {r.layer: r for r in verify(path, gathered, hf_names()).rows}["model.layers.1.mlp.up_proj"]
    assert refused.resolved.gemms is None and "tensorwise scaling only" in refused.resolved.via
    edit(path, """'["rowwise"\\n'""", """'[1\\n'""")
    with pytest.raises(UserError, match=r"FSDP_FP8_ALL_GATHER must be a list of recipe names \(strings\), got \[1\]"):
        verify(path, gathered, hf_names())


def test_torchao_resolve_agrees_with_torchaos_own_conversion_where_a_layer_is_in_two_recipes(tmp_path):
    """torchao's swap_linear_layers converts a Float8Linear again (it is an nn.Linear): the later recipe's wins."""
    from torch import nn
    from torchao.float8.float8_linear import Float8Linear

    path = tmp_path / "p_torchao.py"
    policy = Policy(layers={"blocks.1.fc": "fp8", "blocks.10.fc": "fp8-rowwise"})
    export(policy, "torchao", path)
    edit(path, '"blocks.10.fc"', '"blocks.10.fc",\\n\'\n    \'        "blocks.1.fc"')  # blocks.1.fc in rowwise too
    model = nn.Module()
    model.blocks = nn.ModuleList(nn.Module() for _ in range(11))
    for block in model.blocks:
        block.fc = nn.Linear(32, 32)
    names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    converted = load(path).convert(model)
    scaling = {
        n: m.config.cast_config_input.scaling_granularity.value
        for n, m in converted.named_modules()
        if isinstance(m, Float8Linear)
    }
    assert scaling == {"blocks.1.fc": "axiswise", "blocks.10.fc": "axiswise"}  # rowwise: torchao's axiswise scales
    rows = {r.layer: r.resolved.gemms for r in verify(path, policy, names).rows}
    assert rows["blocks.1.fc"] == rows["blocks.10.fc"] == ("fp8 rowwise",) * 3
    assert differing(path, policy, names) == ["blocks.1.fc"]


# --- torchtitan: its converters, in order, each converting what it selects (converted configs too) ---


@pytest.fixture
def titan12(monkeypatch):
    """torchtitan's llama3 debug model config grown to 12 layers, its converters' capability checks answered yes
    (the conversion itself is of configs)."""
    llama3 = pytest.importorskip("torchtitan.models.llama3", reason="torchtitan needs Python 3.11 (the test extra has it)")
    import torchtitan.components.quantization.float8 as f8
    import torchtitan.components.quantization.mx as mx
    import torchtitan.components.quantization.nvfp4 as nv
    from torch._inductor import config as inductor

    saved = inductor.get_config_copy()
    for module in (f8, mx, nv):
        monkeypatch.setattr(module, "has_cuda_capability", lambda *args: True)
    model = llama3.model_registry("debugmodel").model
    model.layers = list(model.layers) + [copy.deepcopy(model.layers[0]) for _ in range(12 - len(model.layers))]
    yield model
    inductor.load_config(saved)


def titan_run(model_config, converters):
    """fqn -> (fprop, dgrad, wgrad) under torchtitan's own converters, applied in order."""
    import torchtitan.components.quantization.float8 as f8
    import torchtitan.components.quantization.mx as mx
    import torchtitan.components.quantization.nvfp4 as nv
    from torchtitan.models.common.linear import Linear

    classes = {f8.Float8LinearConverter.Config: f8.Float8LinearConverter, mx.MXFP8LinearConverter.Config: mx.MXFP8LinearConverter}
    classes[nv.NVFP4LinearConverter.Config] = nv.NVFP4LinearConverter
    for config in converters:
        model_config = classes[type(config)](config).convert(model_config)
    found = {}
    for fqn, c, _, _ in model_config.traverse(Linear.Config):
        if isinstance(c, f8.Float8Linear.Config):
            cast = c._torchao_config.cast_config_grad_output.scaling_granularity.value  # rowwise: axiswise
            wgrad_hp = c._torchao_config.cast_config_input_for_grad_weight.scaling_type.value == "disabled"
            found[fqn] = ("fp8 rowwise", "fp8 rowwise", None if wgrad_hp else "fp8 rowwise") if cast == "axiswise" else None
        else:
            kind = {mx.MXFP8Linear.Config: "mxfp8", nv.NVFP4Linear.Config: "nvfp4"}.get(type(c))
            found[fqn] = (kind,) * 3 if kind else (None, None, None)
    return found


TITAN_POLICY = {
    **{f"layers.1.{r}": "mxfp8" for r in TITAN_ROLES},  # a whole block: 'layers.1.', which layers.10 does not match
    "layers.10.feed_forward.w1": "nvfp4",
    "layers.0.feed_forward.w2": "fp8-rowwise",
    "layers.11.attention.wo": "fp8-rowwise-gw-hp",
}


def test_torchtitan_resolve_agrees_with_torchtitans_own_converters_and_catches_an_overlap(tmp_path, titan12):
    path = tmp_path / "p_torchtitan.py"
    policy = Policy(layers=TITAN_POLICY)
    export(policy, "torchtitan", path)
    names = [fqn for fqn, *_ in titan12.traverse(load(path).Linear.Config)]
    assert "layers.1.attention.wo" in names and "layers.10.attention.wo" in names
    exported = load(path)
    real = titan_run(copy.deepcopy(titan12), exported.float8_converters(titan12) + exported.blockscaled_converters(titan12))
    result = verify(path, policy, names)
    assert {r.layer: r.resolved.gemms for r in result.rows} == real and result.differing == []
    # a later converter overlapping an earlier one: the MXFP8 list also names a rowwise layer, which it re-converts
    edit(path, '"layers.1.attention.wo"', '"layers.1.attention.wo",\\n\'\n    \'        "layers.0.feed_forward.w2"')
    exported = load(path)
    real = titan_run(copy.deepcopy(titan12), exported.float8_converters(titan12) + exported.blockscaled_converters(titan12))
    result = verify(path, policy, names)
    assert {r.layer: r.resolved.gemms for r in result.rows} == real
    assert (
        result.differing == ["layers.0.feed_forward.w2"]
        and "re-converting" in result.rows[names.index("layers.0.feed_forward.w2")].resolved.via
    )


def test_torchtitan_never_writes_an_empty_include_list_which_would_convert_every_linear(tmp_path, titan12):
    path = tmp_path / "p_torchtitan.py"
    policy = Policy(layers={"layers.0.feed_forward.w2": "fp8-rowwise"})
    export(policy, "torchtitan", path)
    edit(path, "BLOCKSCALED_LAYERS = json.loads(\n    '{}'", "BLOCKSCALED_LAYERS = json.loads(\n    '{\"mxfp8\": []}'")
    exported = load(path)
    assert exported.blockscaled_converters(titan12) == []  # not MXFP8LinearConverter.Config(fqns=[])
    names = [fqn for fqn, *_ in titan12.traverse(exported.Linear.Config)]
    assert verify(path, policy, names).differing == []
    # what an empty list does, by torchtitan's own converter: every Linear, the float8 one re-converted
    import torchtitan.components.quantization.mx as mx

    every = titan_run(copy.deepcopy(titan12), [*exported.float8_converters(titan12), mx.MXFP8LinearConverter.Config(fqns=[])])
    assert set(every.values()) == {("mxfp8",) * 3}


def test_a_renamed_head_and_a_router_gate_under_torchtitan(tmp_path):
    """The head renamed to lm_head is skipped like any Linear the policy does not list (the skip list is computed
    from the model's names); a quantized router gate is left out (torchtitan refuses to convert one), which verify
    reports, and a file edited to select it is refused."""
    names = [*titan_names(head="lm_head"), "layers.3.moe.router.gate"]
    policy = Policy(layers={"layers.2.feed_forward.w1": "fp8-rowwise", "layers.3.moe.router.gate": "mxfp8"})
    path = tmp_path / "p_torchtitan.py"
    left_out = export(policy, "torchtitan", path)
    assert any("router gate" in line for line in left_out)
    result = verify(path, policy, names)
    assert result.differing == ["layers.3.moe.router.gate"]  # the export cannot run it as the policy says
    assert {r.layer: r.resolved.gemms for r in result.rows}["lm_head"] == (None, None, None)
    edit(
        path,
        "BLOCKSCALED_LAYERS = json.loads(\n    '{}'",
        'BLOCKSCALED_LAYERS = json.loads(\n    \'{"mxfp8": ["layers.3.moe.router.gate"]}\'',
    )
    rows = {r.layer: r.resolved for r in verify(path, policy, names).rows}
    assert rows["layers.3.moe.router.gate"].gemms is None and "refuses" in rows["layers.3.moe.router.gate"].via


def test_an_edited_function_is_refused_not_guessed(tmp_path):
    path = tmp_path / "p_torchtitan.py"
    policy = Policy(layers={"layers.2.feed_forward.w1": "fp8-rowwise"})
    export(policy, "torchtitan", path)
    edit(path, "skip = [name for name in names if name not in keep]", "skip = []")
    with pytest.raises(UserError, match=r"line \d+ \(def skip_list\(names, keep\):\) differs from what `autoprec export`"):
        verify(path, policy, titan_names())


BLOCKSCALED_POLICY = Policy(layers={"layers.1.attention.wo": "mxfp8", "layers.10.feed_forward.w1": "nvfp4"})
EXTRA = "model.layers.1.mlp.gate_proj"  # a linear HF_POLICY leaves in bf16


@pytest.mark.parametrize(("target", "policy", "names", "old", "new"), [
    ("torchao", HF_POLICY, hf_names, "", f'FP8_LAYERS["tensorwise"].append("{EXTRA}")\n'),
    ("torchao", HF_POLICY, hf_names, "", f'FP8_LAYERS |= {{"rowwise": ["{EXTRA}"]}}\n'),
    ("torchao", HF_POLICY, hf_names, "", "convert = module_filter_fn\n"),
    ("torchao", HF_POLICY, hf_names, "import json\n", "import json\nimport os\n"),
    ("transformer-engine", BLOCKSCALED_POLICY, titan_names, "", 'GEMMS["output"] = ("nvfp4", "nvfp4", "nvfp4")\n'),
    ("torchtitan", Policy(layers=TITAN_POLICY), titan_names, "", 'BLOCKSCALED_LAYERS |= {"nvfp4": ["output"]}\n'),
])  # fmt: skip
def test_any_statement_but_the_tables_data_is_refused_and_comments_and_layout_are_not(tmp_path, target, policy, names, old, new):
    """The file must be what the export writes but for its tables' values: an appended layer, an `|=`, a rebound
    name or an extra import would run without the verifier seeing it (nothing is run to
    find out), so each is refused, naming the file and the line; comments, blank lines and a call's layout are not
    in the syntax tree and change nothing."""
    path = tmp_path / "p.py"
    export(policy, target, path)
    edit(path, "\n\n\ndef ", "\n\n\n# a hand-written note\n\n\ndef ")
    path.write_text(path.read_text().replace(" = json.loads(\n", " = json.loads(  # the table\n\n") + "\n# the end\n")
    assert differing(path, policy, names()) == []
    if not old:  # appended
        old, new = "# the end\n", "# the end\n" + new
    text = path.read_text()
    line = text[: text.index(old) + len(os.path.commonprefix([old, new]))].count("\n") + 1  # where the edit starts
    path.write_text(text.replace(old, new, 1))
    with pytest.raises(UserError, match=rf"^{re.escape(str(path))}: line {line} \(.+\) differs from what `autoprec export`"):
        verify(path, policy, names())


def test_a_table_read_with_more_than_its_json_text_is_refused(tmp_path):
    """Only the tables' values may differ from the export, and only as data: json.loads given an object_hook would
    run it on every object of the table."""
    path = tmp_path / "p_torchao.py"
    export(HF_POLICY, "torchao", path)
    edit(path, ")\n\n# the same keys", ", object_hook=print)\n\n# the same keys")
    with pytest.raises(UserError, match=r"FP8_LAYERS is not data as `autoprec export` writes it"):
        verify(path, HF_POLICY, hf_names())


def test_the_verify_verb_refuses_a_layer_appended_to_a_torchao_table(tmp_path, capsys):
    """The reviewer's case: running the file converts the appended layer, so verify must not say exit 0."""
    HF_POLICY.save(tmp_path / "policy.json")
    (tmp_path / "names.txt").write_text("\n".join(hf_names()) + "\n")
    exported = tmp_path / "p_torchao.py"
    export(HF_POLICY, "torchao", exported)
    args = ["verify", str(exported), "--policy", str(tmp_path / "policy.json"), "--model", str(tmp_path / "names.txt")]
    assert main(args) == 0
    capsys.readouterr()
    exported.write_text(exported.read_text() + f'FP8_LAYERS["tensorwise"].append("{EXTRA}")\n')
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(exported) in err and "FP8_LAYERS['tensorwise'].append" in err


# --- Megatron: TransformerConfig's recipe and first/last bf16 layers; the per-module YAML's matchers ---


def megatron_policy(fmt="fp8", bf16=(0, 11)):
    layers = {f"decoder.layers.{i}.{r}": ("bf16" if i in bf16 else fmt) for i in range(12) for r in MEGATRON_ROLES}
    return Policy(layers={"": "bf16", **layers})


@pytest.mark.parametrize("fmt", ["fp8", "mxfp8", "nvfp4"])
def test_megatron_export_verifies_and_a_miscounted_end_is_caught(tmp_path, fmt):
    path = tmp_path / "p_megatron.json"
    policy = megatron_policy(fmt)
    export(policy, "megatron", path)
    assert differing(path, policy, megatron_names()) == []
    edit(path, '"num_layers_at_end_in_bf16": 1', '"num_layers_at_end_in_bf16": 0')
    assert differing(path, policy, megatron_names()) == [f"decoder.layers.11.{r}" for r in MEGATRON_ROLES]


def test_megatron_counts_the_models_layers_not_the_files(tmp_path, monkeypatch):
    """Megatron counts the last bf16 layers from the model's num_layers: in a model with a layer more than the
    policy names, the policy's last bf16 layer runs in the recipe. Megatron-core's own is_first_last_bf16_layer and the rule without it
    agree."""
    path = tmp_path / "p_megatron.json"
    policy = megatron_policy("fp8", bf16=(0, 11))
    export(policy, "megatron", path)
    names = [*megatron_names(), *(f"decoder.layers.12.{r}" for r in MEGATRON_ROLES)]
    found = differing(path, policy, names)
    assert found == [f"decoder.layers.11.{r}" for r in MEGATRON_ROLES]  # no longer the last: Megatron quantizes it
    monkeypatch.setitem(sys.modules, "megatron.core.fp8_utils", None)  # the re-implementation
    assert differing(path, policy, names) == found


def mp_policy():
    layers = {f"decoder.layers.1.{r}": "mxfp8" for r in MEGATRON_ROLES}
    layers |= {"decoder.layers.2.mlp.linear_fc1": "mxfp8-fwd", "decoder.layers.3.mlp.linear_fc2": "nvfp4-fwd-dgrad"}
    layers |= {"decoder.layers.4.mlp.linear_fc1": "fp8", "output_layer": "bf16", "decoder.layers.10.mlp.linear_fc1": "nvfp4"}
    return Policy(layers={"": "bf16", **layers})


def resolved(path, names, policy):
    return {r.layer: (r.resolved.gemms, r.ok) for r in verify(path, policy, names).rows}


def test_megatron_precision_runs_per_gemm_mixes_through_the_custom_recipe_and_verifies(tmp_path, monkeypatch):
    path = tmp_path / "p_megatron-precision.yaml"
    policy = mp_policy()
    left_out = export(policy, "megatron-precision", path)
    assert not any("per-GEMM" in line for line in left_out)
    content = yaml.safe_load(path.read_text())
    recipe = content["configs"]["mxfp8_fwd"]["training_recipe"]
    assert (
        recipe["fp8_quantization_recipe"] == "custom"
        and recipe["custom_recipe_factory"] == "p_megatron_precision_qfactory.mxfp8_fwd"
    )
    factory = (tmp_path / "p_megatron_precision_qfactory.py").read_text()
    assert "Transformer Engine 2.9 or later" in factory
    fp8_utils = pytest.importorskip("megatron.core.fp8_utils", reason="megatron-core is not installed (the test extra has it)")
    with monkeypatch.context() as m:  # Megatron imports the dotted path from PYTHONPATH: the folder of the YAML
        m.syspath_prepend(str(tmp_path))
        resolved_factory = fp8_utils._resolve_callable_from_python_import_path(recipe["custom_recipe_factory"])
        sys.modules.pop("p_megatron_precision_qfactory", None)  # imported for this test only
        assert resolved_factory.__name__ == "mxfp8_fwd" and callable(resolved_factory)
    rows = resolved(path, megatron_names(), policy)
    assert rows["decoder.layers.2.mlp.linear_fc1"] == (("mxfp8", None, None), True)
    assert rows["decoder.layers.3.mlp.linear_fc2"] == (("nvfp4", "nvfp4", None), True)
    assert all(ok for _, ok in rows.values())
    # the factory edited: fprop and dgrad for mxfp8-fwd
    edit(
        tmp_path / "p_megatron_precision_qfactory.py",
        "'mxfp8_fwd': ('mxfp8', None, None)",
        "'mxfp8_fwd': ('mxfp8', 'mxfp8', None)",
    )
    assert differing(path, policy, megatron_names()) == ["decoder.layers.2.mlp.linear_fc1"]


@pytest.mark.parametrize(
    ("old", "new", "caught"),
    [
        # a matcher not enabled: Megatron skips it, the module falls to '*'
        (
            "    pattern: decoder.layers.10.mlp.linear_fc1\n",
            "    pattern: decoder.layers.10.mlp.linear_fc1\n    enabled: false\n",
            ["decoder.layers.10.mlp.linear_fc1"],
        ),
        # a glob for layer 1 that also matches layers 10 and 11
        (
            "pattern: decoder.layers.1.self_attention.linear_qkv",
            "pattern: decoder.layers.1*.self_attention.linear_qkv",
            ["decoder.layers.11.self_attention.linear_qkv", "decoder.layers.10.self_attention.linear_qkv"],
        ),
        # a quantized config without override_nonquantized_autocast runs no recipe (no global --fp8)
        (
            "      fp8_format: hybrid\n      override_nonquantized_autocast: true",
            "      fp8_format: hybrid",
            ["decoder.layers.4.mlp.linear_fc1"],
        ),
    ],
)
def test_megatron_precision_hand_edits_are_caught_by_megatrons_own_matcher_and_without_it(
    tmp_path, monkeypatch, old, new, caught
):
    pytest.importorskip(
        "megatron.core.quantization.quant_config", reason="megatron-core is not installed (the test extra has it)"
    )
    path = tmp_path / "p.yaml"
    policy = mp_policy()
    export(policy, "megatron-precision", path)
    edit(path, old.replace("    enabled: false\n", ""), new)
    if "enabled: false" in new:  # the exported matcher says enabled: true first; drop it so that false is read
        edit(
            path,
            "    enabled: true\n    pattern: decoder.layers.10.mlp.linear_fc1\n",
            "    pattern: decoder.layers.10.mlp.linear_fc1\n",
        )
    with_megatron = resolved(path, megatron_names(), policy)
    assert sorted(n for n, (_, ok) in with_megatron.items() if not ok) == sorted(caught)
    for module in ("megatron.core.quantization.quant_config", "megatron.core.extensions.transformer_engine"):
        monkeypatch.setitem(sys.modules, module, None)  # the re-implementation
    assert resolved(path, megatron_names(), policy) == with_megatron


def test_megatron_precision_default_matcher_quantizing_a_renamed_head_is_caught(tmp_path):
    """torchtitan#4008's pattern in Megatron's terms: a '*' default in mxfp8 with the head excluded by its old name."""
    path = tmp_path / "p.yaml"
    policy = Policy(layers={f"decoder.layers.{i}.{r}": "mxfp8" for i in range(12) for r in MEGATRON_ROLES})
    export(policy, "megatron-precision", path)
    content = yaml.safe_load(path.read_text())
    content["matchers"] = {
        "head": {"type": "glob", "enabled": True, "pattern": "output_layer", "config": "high_precision"},
        "default": {"type": "glob", "enabled": True, "pattern": "*", "config": "mxfp8"},
    }
    path.write_text("# autoprec export --to megatron-precision\n" + yaml.safe_dump(content, sort_keys=False))
    assert differing(path, policy, megatron_names()) == []
    assert differing(path, policy, megatron_names(head="lm_head")) == ["lm_head"]


# --- Transformer Engine: QuantizerRole.name is the te.Linear's name=, looked up exactly ---


def test_transformer_engine_export_verifies_and_a_renamed_entry_is_caught(tmp_path):
    path = tmp_path / "p_te.py"
    policy = Policy(
        layers={"layers.1.attention.wo": "mxfp8-fwd-nvfp4-dgrad", "layers.10.feed_forward.w1": "nvfp4", "output": "bf16"}
    )
    export(policy, "transformer-engine", path)
    assert "te.Linear(..., name=<its module path" in path.read_text()
    rows = resolved(path, titan_names(), policy)
    assert rows["layers.1.attention.wo"] == (("mxfp8", "nvfp4", None), True) and all(ok for _, ok in rows.values())
    edit(path, "'layers.1.attention.wo':", "'layers.1.attention.wo ':")  # a name no te.Linear has
    assert differing(path, policy, titan_names()) == ["layers.1.attention.wo"]


# --- the verb ---


def test_the_verify_verb_exits_0_1_and_2(tmp_path, capsys):
    policy = megatron_policy("mxfp8")
    policy.save(tmp_path / "policy.json")
    (tmp_path / "names.txt").write_text("\n".join(megatron_names()) + "\n")
    assert main(["export", str(tmp_path / "policy.json"), "--to", "megatron", "--check", str(tmp_path / "names.txt")]) == 0
    out = capsys.readouterr().out
    assert "all 49 linears run as the policy says" in out and "decoder.layers.1.mlp.linear_fc1" in out
    exported = tmp_path / "policy_megatron.json"
    edit(exported, '"num_layers_at_start_in_bf16": 1', '"num_layers_at_start_in_bf16": 2')
    args = ["verify", str(exported), "--policy", str(tmp_path / "policy.json"), "--model", str(tmp_path / "names.txt")]
    assert main(args) == 1
    captured = capsys.readouterr()
    assert "DIFFERS" in captured.out and "decoder.layers.1.mlp.linear_fc2" in captured.err.splitlines()[-1]
    assert main([*args, "--json"]) == 1
    assert '"differing": ["decoder.layers.1.self_attention.linear_qkv"' in capsys.readouterr().out
    assert (
        main(
            [
                "verify",
                str(tmp_path / "names.txt"),
                "--policy",
                str(tmp_path / "policy.json"),
                "--model",
                str(tmp_path / "names.txt"),
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no 'autoprec export --to NAME' line" in err


def test_verify_with_a_to_other_than_the_one_that_wrote_the_file_names_both(tmp_path, capsys):
    """A torchao file verified as Megatron's would be read as JSON and fail on its first line: the file names the
    target that wrote it, and the error says which and how to go on."""
    HF_POLICY.save(tmp_path / "policy.json")
    (tmp_path / "names.txt").write_text("\n".join(hf_names()) + "\n")
    assert main(["export", str(tmp_path / "policy.json"), "--to", "torchao"]) == 0
    exported = tmp_path / "policy_torchao.py"
    assert exported.is_file()
    capsys.readouterr()
    args = ["verify", str(exported), "--policy", str(tmp_path / "policy.json"), "--model", str(tmp_path / "names.txt")]
    assert main([*args, "--to", "megatron"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "written by 'autoprec export --to torchao', not --to megatron" in err, err
    assert "give --to torchao" in err
    assert main([*args, "--to", "torchao"]) == 0  # the right one, given, is taken


def test_verify_reads_a_model_files_linears(tmp_path, capsys):
    """--model model.py: build_model()'s nn.Linear layers by module path."""
    model = "tests/models/wgrad_breaks.py"
    assert linear_names(model) == ["inp", "proj", "head"]
    Policy(layers={"proj": "fp8", "head": "bf16"}).save(tmp_path / "policy.json")
    assert main(["export", str(tmp_path / "policy.json"), "--to", "torchao", "--check", model, "--quiet"]) == 0
    assert main(["verify", str(tmp_path / "policy_torchao.py"), "--policy", str(tmp_path / "policy.json"), "--model", model]) == 0
    Policy(layers={"blocks.0.proj": "fp8"}).save(tmp_path / "other.json")
    assert main(["verify", str(tmp_path / "policy_torchao.py"), "--policy", str(tmp_path / "other.json"), "--model", model]) == 2
    assert "are not linears of this model" in capsys.readouterr().err


def test_the_factory_module_holds_no_code_from_the_yamls_name(tmp_path):
    """The YAML's name is a comment in the factory module, escaped: a name with quotes and a line break is no code."""
    import ast

    out = tmp_path / 'm"""\nimport os\n""".yaml'
    export(Policy(layers={"blocks.1.fc": "mxfp8-fwd"}), "megatron-precision", out)
    (factory,) = tmp_path.glob("*_qfactory.py")
    tree = ast.parse(factory.read_text())
    assert [type(n).__name__ for n in tree.body] == ["Expr", "Assign", "FunctionDef", "FunctionDef"]
    assert [n.name for n in tree.body if isinstance(n, ast.FunctionDef)] == ["quantizer_for", "mxfp8_fwd"]


def test_torchtitan_takes_the_main_branchs_converters_where_installed(tmp_path, titan12, monkeypatch):
    """torchtitan's main branch moved the converters to torchtitan.config.transform with the same Config fields
    (MXFP8's adds linears_saving_inputs_for_backward_in_mxfp8): the file takes them from there where that module is,
    else from 0.3's torchtitan.components.quantization. The main branch is not installable here: a stand-in module
    records what the file builds."""
    import dataclasses
    import types

    import torchtitan.components.quantization.float8 as f8
    import torchtitan.components.quantization.mx as mx

    path = tmp_path / "p_torchtitan.py"
    export(Policy(layers={"layers.0.feed_forward.w2": "fp8-rowwise", "layers.10.attention.wo": "mxfp8"}), "torchtitan", path)
    exported = load(path)
    assert [type(c) for c in exported.float8_converters(titan12) + exported.blockscaled_converters(titan12)] == [
        f8.Float8LinearConverter.Config,
        mx.MXFP8LinearConverter.Config,
    ]
    transform = types.ModuleType("torchtitan.config.transform")
    for name in ("Float8LinearConverter", "MXFP8LinearConverter", "NVFP4LinearConverter"):
        config = dataclasses.make_dataclass("Config", [("given", dict)])
        setattr(transform, name, type(name, (), {"Config": staticmethod(lambda _c=config, **given: _c(given))}))
    monkeypatch.setitem(sys.modules, "torchtitan.config.transform", transform)
    (float8,) = exported.float8_converters(titan12)
    assert float8.given["recipe_name"] == "rowwise" and "layers.0.feed_forward.w2" not in float8.given["filter_fqns"]
    (mxfp8,) = exported.blockscaled_converters(titan12, linears_saving_inputs_for_backward_in_mxfp8=["attention.wo"])
    assert mxfp8.given == {"fqns": ["layers.10.attention.wo"], "linears_saving_inputs_for_backward_in_mxfp8": ["attention.wo"]}


@pytest.mark.parametrize(("target", "name", "text"), [
    ("megatron-precision", "p.yaml", "# autoprec export --to megatron-precision\n" + "[" * 100_000),
    ("torchao", "p.py", "# autoprec export --to torchao\nFP8_LAYERS = " + "(" * 100_000),
    ("megatron", "p.json", '{"written_by": "autoprec export --to megatron", "transformer_config": ' + "[" * 100_000),
])  # fmt: skip
def test_a_damaged_export_is_one_line_not_a_traceback(tmp_path, capsys, target, name, text):
    (tmp_path / name).write_text(text)
    Policy(layers={"fc": "bf16"}).save(tmp_path / "policy.json")
    (tmp_path / "names.txt").write_text("fc\n")
    args = ["verify", str(tmp_path / name), "--policy", str(tmp_path / "policy.json"), "--model", str(tmp_path / "names.txt")]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("autoprec: error:") and name in err


def test_verify_builds_the_model_on_the_meta_device_so_a_model_file_that_trains_its_model_does_not_train(tmp_path):
    """A model file whose build_model() trains (examples/gpt2 does, for an hour on a CPU) is asked for its module
    names only, under the meta device, as docs/model-file.md says; one that cannot build there is one line."""
    (tmp_path / "trains.py").write_text(
        "import torch\n"
        "def build_model():\n"
        "    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))\n"
        "    if torch.get_default_device().type != 'meta':\n"
        "        raise RuntimeError('trained for an hour')\n"
        "    return model\n"
        "def batches(split):\n"
        "    return [torch.randn(2, 4)]\n"
        "def loss_fn(model, batch):\n"
        "    return model(batch).sum()\n",
        encoding="utf-8",
    )
    assert linear_names(tmp_path / "trains.py") == ["0", "2"]
    (tmp_path / "no_meta.py").write_text((tmp_path / "trains.py").read_text().replace("!= 'meta'", "== 'meta'"))
    with pytest.raises(UserError, match=r"no_meta.py: build_model\(\) failed on the meta device .*verify builds the model"):
        linear_names(tmp_path / "no_meta.py")
