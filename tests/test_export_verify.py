"""`autoprec verify` (autoprec/tune/export/verify.py and each target's resolve()): an exported file resolved on a
model's module names by its framework's own matching rules, per linear and GEMM, against the policy. Module names
as torchtitan, Megatron and Hugging Face write them, with `layers.1` beside `layers.10`; each wrong export is a
right one hand-edited, and is caught with its layers named. Where the framework installs on a CPU (torchtitan,
Megatron-core) its own code converts or matches the same names, and the resolver must agree with it."""

import copy
import importlib.util
import json
import os
import re
import sys

import pytest
import yaml
from builders import te_installed

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


def test_torchao_resolve_reads_back_which_layer_torchaos_mx_conversion_runs_in_mxfp8(tmp_path):
    """Issue 63, 4: the MXFP8 layers, read as torchao's quantize_ converts them: the first MX recipe that lists a
    layer wraps its parameters (_swap_params skips a wrapped one), and a layer a float8 list converts too runs neither
    as written (unresolved); a mistyped name is said with its close matches."""
    from test_export import mx_configs
    from torch import nn

    path = tmp_path / "p_torchao.py"
    policy = Policy(layers={"blocks.1.fc": "mxfp8", "blocks.10.fc": "mxfp8-fwd-dgrad", "blocks.2.fc": "fp8"})
    export(policy, "torchao", path)
    model = nn.Module()
    model.blocks = nn.ModuleList(nn.Module() for _ in range(11))
    for block in model.blocks:
        block.fc = nn.Linear(32, 32)
    names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    rows = {r.layer: r.resolved for r in verify(path, policy, names).rows}
    assert rows["blocks.1.fc"].gemms == ("mxfp8",) * 3 and rows["blocks.10.fc"].gemms == ("mxfp8", "mxfp8", None)
    assert "MXFP8TrainingOpConfig.from_recipe('mxfp8_rceil')" in rows["blocks.1.fc"].via
    assert differing(path, policy, names) == []
    # blocks.1.fc listed under the wgrad_with_hp recipe too, after its own: torchao keeps the first, as resolve reads it
    edit(path, '"blocks.10.fc"', '"blocks.10.fc",\\n\'\n    \'        "blocks.1.fc"')
    wgrad_hp = {n: c.wgrad_with_hp for n, c in mx_configs(load(path).convert(copy.deepcopy(model))).items()}
    assert wgrad_hp == {"blocks.1.fc": False, "blocks.10.fc": True}
    assert differing(path, policy, names) == [] and "kept out" in table(verify(path, policy, names))
    # the MX layer moved by hand to blocks.3: both differ, by name; in a float8 list too: unresolved; a typo: said
    export(policy, "torchao", path)
    edit(path, '"blocks.1.fc"', '"blocks.3.fc"')
    assert differing(path, policy, names) == ["blocks.1.fc", "blocks.3.fc"]
    edit(path, '"blocks.3.fc"', '"blocks.2.fc"')
    both = {r.layer: r.resolved for r in verify(path, policy, names).rows}["blocks.2.fc"]
    assert both.gemms is None and "after convert_to_float8_training converted it: both convert it" in both.via
    edit(path, "\"blocks.2.fc\"\\n'\n    '    ],", "\"blocks.1.fcx\"\\n'\n    '    ],")
    unknown = verify(path, policy, names).unknown
    assert [(r.layer, r.close[0]) for r in unknown] == [("blocks.1.fcx", "blocks.1.fc")]


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
    assert "Transformer Engine 2.19 or later" in factory
    fp8_utils = pytest.importorskip("megatron.core.fp8_utils", reason="megatron-core is not installed (the test extra has it)")
    with monkeypatch.context() as m:  # Megatron imports the dotted path from PYTHONPATH: the folder of the YAML
        m.syspath_prepend(str(tmp_path))
        te_installed(m, "2.19.0")  # the module checks it when imported
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
    # the head quantized, and the matcher meant to exclude it named as naming no linear of the model
    assert differing(path, policy, megatron_names(head="lm_head")) == ["lm_head", "output_layer"]


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
    assert differing(path, policy, titan_names()) == ["layers.1.attention.wo", "layers.1.attention.wo "]  # and named


# --- the environment: Transformer Engine's NVTE_* variables, recorded by the export, checked by verify ---

NVFP4_ENVIRONMENT = {"NVTE_BACKWARD_OVERRIDE": None, "NVTE_NVFP4_DISABLE_RHT": "0",
                     "NVTE_NVFP4_DISABLE_STOCHASTIC_ROUNDING": "0", "NVTE_NVFP4_DISABLE_2D_QUANTIZATION": "0",
                     "NVTE_NVFP4_ROW_SCALED_ACTIVATION": "0", "NVTE_NVFP4_4OVER6": "none"}  # fmt: skip


@pytest.mark.parametrize(("target", "recorded"), [
    ("megatron", NVFP4_ENVIRONMENT),  # NVFP4BlockScaling
    ("megatron-precision", NVFP4_ENVIRONMENT),  # its nvfp4 config
    ("transformer-engine", {"NVTE_BACKWARD_OVERRIDE": None}),  # CustomRecipe: its factories set the rest
    ("torchao", {}),  # no Transformer Engine
])  # fmt: skip
def test_verify_checks_the_environment_the_export_records(tmp_path, target, recorded):
    """Issue 63, 4: Transformer Engine reads NVTE_* variables into its recipes when it is imported (NVTE_BACKWARD_OVERRIDE
    runs dgrad and wgrad in high precision under every recipe; NVTE_NVFP4_DISABLE_RHT drops NVFP4's Hadamard
    transform): verify passed a file that ran otherwise. Read as TE reads them ("1" only turns a flag on)."""
    path = tmp_path / f"p_{target}"
    policy = megatron_policy("nvfp4")
    export(policy, target, path)
    result = verify(path, policy, megatron_names(), environ={})
    assert result.environment == recorded and result.environment_mismatches == ()
    read_as_te = {"NVTE_NVFP4_DISABLE_RHT": "0", "NVTE_NVFP4_DISABLE_2D_QUANTIZATION": "true", "NVTE_NVFP4_4OVER6": "none"}
    assert verify(path, policy, megatron_names(), environ=read_as_te).environment_mismatches == ()
    changed = {"NVTE_BACKWARD_OVERRIDE": "dequantized", "NVTE_NVFP4_DISABLE_RHT": "1", "NVTE_FLASH_ATTN": "0"}
    result = verify(path, policy, megatron_names(), environ=changed)
    expected = [
        "NVTE_BACKWARD_OVERRIDE is 'dequantized' here, the export expects unset: Transformer Engine reads it when "
        "imported; 'high_precision' or 'dequantized' runs dgrad and wgrad in high precision, whatever the recipe says",
        "NVTE_NVFP4_DISABLE_RHT is '1' here, the export expects unset or 0: Transformer Engine reads it when imported; 1 "
        "drops the random Hadamard transform on wgrad's operands",
    ]
    assert list(result.environment_mismatches) == [line for line in expected if line.split()[0] in recorded]
    assert not recorded or (result.differing == [] and not result.ok and not result.to_dict()["matches"])  # fails on it
    assert result.to_dict()["environment"] == {"expected": recorded, "mismatches": list(result.environment_mismatches)}


def test_an_edited_environment_record_is_caught_not_trusted(tmp_path):
    """A review found verify took the file's own record as the expectation: a record edited to expect
    NVTE_BACKWARD_OVERRIDE=high_precision passed with the variable set, though TE then runs dgrad and wgrad in high
    precision. The expectation is the policy's export's record."""
    path = tmp_path / "p_megatron-precision.yaml"
    policy = megatron_policy("mxfp8")
    export(policy, "megatron-precision", path)
    edit(path, "NVTE_BACKWARD_OVERRIDE: null", "NVTE_BACKWARD_OVERRIDE: high_precision")  # the record, by hand
    result = verify(path, policy, megatron_names(), environ={"NVTE_BACKWARD_OVERRIDE": "high_precision"})
    assert not result.ok and result.differing == []
    said = " ".join(result.environment_mismatches)
    assert (
        "the file records the environment {'NVTE_BACKWARD_OVERRIDE': 'high_precision'}, but this policy's export records" in said
    )
    assert "NVTE_BACKWARD_OVERRIDE is 'high_precision' here, the export expects unset" in said


def test_the_verify_verb_fails_on_an_environment_the_export_does_not_expect(tmp_path, capsys, monkeypatch):
    policy = megatron_policy("mxfp8")
    policy.save(tmp_path / "policy.json")
    (tmp_path / "names.txt").write_text("\n".join(megatron_names()) + "\n")
    monkeypatch.delenv("NVTE_BACKWARD_OVERRIDE", raising=False)
    assert (
        main(["export", str(tmp_path / "policy.json"), "--to", "megatron-precision", "--check", str(tmp_path / "names.txt")]) == 0
    )
    out = capsys.readouterr().out
    assert "note: Transformer Engine's environment, recorded in the file and checked by `autoprec verify`" in out
    assert "environment: as the file records (NVTE_BACKWARD_OVERRIDE)" in out and "not expressed: note" not in out
    args = ["verify", str(tmp_path / "policy_megatron-precision.yaml"), "--policy", str(tmp_path / "policy.json")]
    args += ["--model", str(tmp_path / "names.txt")]
    monkeypatch.setenv("NVTE_BACKWARD_OVERRIDE", "high_precision")
    assert main(args) == 1
    captured = capsys.readouterr()
    said = "NVTE_BACKWARD_OVERRIDE is 'high_precision' here, the export expects unset: Transformer Engine reads it"
    assert "all 49 linears run as the policy says" in captured.out and f"environment differs: {said}" in captured.out
    assert captured.err.splitlines() == [line for line in captured.err.splitlines() if said in line] != []
    assert main([*args, "--json"]) == 1
    printed = json.loads(capsys.readouterr().out)
    assert not printed["matches"] and printed["differing"] == [] and said in printed["environment"]["mismatches"][0]
    # a hand-edited record is data or refused, one line naming the file
    edit(tmp_path / "policy_megatron-precision.yaml", "NVTE_BACKWARD_OVERRIDE: null", "NVTE_BACKWARD_OVERRIDE: [1]")
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "environment must map an NVTE_ variable to its value" in err


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
    assert [type(n).__name__ for n in tree.body] == ["Expr", "Assign", "FunctionDef", "Expr", "FunctionDef", "FunctionDef"]
    assert [n.name for n in tree.body if isinstance(n, ast.FunctionDef)] == [
        "require_transformer_engine",
        "quantizer_for",
        "mxfp8_fwd",
    ]
    assert ast.unparse(tree.body[3]) == "require_transformer_engine()"  # at import: Megatron imports the module


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


# --- issue 60: what verify reads is what the framework runs, and a hostile file is one line ---


def replace_table(path, name, source):
    """Replace the file's top-level `name = ...` statement (its lines) with `source`."""
    import ast

    text = path.read_text(encoding="utf-8")
    (node,) = [n for n in ast.parse(text).body if isinstance(n, ast.Assign) and ast.unparse(n.targets[0]) == name]
    lines = text.splitlines(keepends=True)
    path.write_text("".join([*lines[: node.lineno - 1], source, *lines[node.end_lineno :]]), encoding="utf-8")


# A table entry that is one string when the file is read as UTF-8, but under `# coding: gbk` its U+4E2D's last byte
# and the backslash after it are one GBK character, so the quote closes the string and the call runs on import.
SMUGGLED = 'x\u4e2d\\\', __import__("os").getcwd(), #'
GBK_TABLES = {
    "torchao": (
        "FP8_LAYERS",
        "FP8_LAYERS = {\n    'tensorwise': ['model.layers.1.mlp.down_proj', '" + SMUGGLED + "',\n    ],\n"
        "    'rowwise': ['model.layers.1.mlp.up_proj'],\n    'fp8-fwd': ['model.layers.10.self_attn.o_proj'],\n}\n",
    ),
    "transformer-engine": (
        "GEMMS",
        "GEMMS = {\n    'layers.9.attention.wo\u4e2d\\': 0, __import__(\"os\").getcwd(): 0, #': ('mxfp8', 'mxfp8', 'mxfp8'),\n"
        "    'layers.1.attention.wo': ('mxfp8', 'mxfp8', 'mxfp8'),\n    'layers.10.feed_forward.w1': ('nvfp4', 'nvfp4', 'nvfp4'),\n}\n",
    ),
}


@pytest.mark.parametrize("target", ["torchao", "transformer-engine"])
def test_a_coding_line_other_than_utf8_is_refused_since_python_would_read_other_code(tmp_path, capsys, target):
    """Python decodes a file by its coding line (PEP 263): verify read the bytes as UTF-8, so a table entry that is
    a string in UTF-8 but code in GBK verified clean and ran on import. A BOM or a utf-8 coding line is how Python
    reads it anyway: verified as before."""
    import ast

    policy, names = (HF_POLICY, hf_names) if target == "torchao" else (BLOCKSCALED_POLICY, titan_names)
    path = tmp_path / "p.py"
    export(policy, target, path)
    clean = path.read_text(encoding="utf-8")
    for head in ("\ufeff", "# -*- coding: utf-8 -*-\n", "\ufeff# vim: set fileencoding=utf-8 :\n"):
        path.write_text(head + clean, encoding="utf-8")
        assert differing(path, policy, names()) == [], head
    table, source = GBK_TABLES[target]
    path.write_text(clean, encoding="utf-8")
    replace_table(path, table, source)
    path.write_bytes(b"# -*- coding: gbk -*-\n" + path.read_bytes())
    value = next(n.value for n in ast.parse(path.read_bytes()).body if isinstance(n, ast.Assign) and n.targets[0].id == table)
    assert any(isinstance(n, ast.Call) for n in ast.walk(value))  # what Python runs: a call, not a string
    policy.save(tmp_path / "policy.json")
    (tmp_path / "names.txt").write_text("\n".join(names()) + "\n")
    args = ["verify", str(path), "--policy", str(tmp_path / "policy.json"), "--model", str(tmp_path / "names.txt")]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(path) in err and "coding 'gbk'" in err and "utf-8" in err, err


def converted_gemms(model):
    """fqn -> (fprop, dgrad, wgrad) as torchao's converted Float8Linear runs them: a GEMM is in fp8 unless its
    operands' casts are disabled, scaled as its first operand is (axiswise: rowwise)."""
    from torchao.float8.config import ScalingGranularity, ScalingType
    from torchao.float8.float8_linear import Float8Linear

    def label(cast):
        if cast.scaling_type is ScalingType.DISABLED:
            return None
        return "fp8 " + ("rowwise" if cast.scaling_granularity is ScalingGranularity.AXISWISE else "tensorwise")

    return {
        n: (
            label(m.config.cast_config_input),
            label(m.config.cast_config_grad_output),
            label(m.config.cast_config_input_for_grad_weight),
        )
        for n, m in model.named_modules()
        if isinstance(m, Float8Linear)
    }


@pytest.mark.parametrize(("old", "new", "differs"), [
    ('"recipe": null', '"recipe": "tensorwise"', True),  # a recipe name wins over the flags: all three in fp8
    ('"dgrad": false', '"dgrad": 1', True),  # truthy: dgrad in fp8
    ('"dgrad": false', '"dgrad": "yes"', True),
    ('"wgrad": false', '"wgrad": [0]', True),
    ('"recipe": null', '"recipe": "rowwise_with_gw_hp"', True),
    ('"scaling": "tensorwise"', '"scaling": "TENSORWISE"', False),  # anything but "rowwise" scales per tensor
    ('"dgrad": false', '"dgrad": 0', False),  # falsy: high precision, as written
])  # fmt: skip
def test_torchao_fp8_gemms_are_read_as_the_files_convert_reads_them(tmp_path, old, new, differs):
    """An fp8-fwd entry edited to a recipe name or a truthy flag verified clean, while convert() ran dgrad (and
    wgrad) in fp8: verify reads each entry with the file's own rules, checked against torchao's conversion."""
    from torch import nn

    path = tmp_path / "p_torchao.py"
    policy = Policy(layers={"blocks.1.fc": "fp8-fwd", "blocks.10.fc": "fp8"})
    export(policy, "torchao", path)
    text = path.read_text()
    assert text.count(old) >= 1
    path.write_text(text.replace(old, new, 1))  # the first entry: fp8-fwd's
    model = nn.Module()
    model.blocks = nn.ModuleList(nn.Module() for _ in range(11))
    for block in model.blocks:
        block.fc = nn.Linear(32, 32)
    names = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    real = converted_gemms(load(path).convert(model))
    rows = {r.layer: r for r in verify(path, policy, names).rows}
    assert {n: rows[n].resolved.gemms for n in real} == real
    assert (rows["blocks.1.fc"].ok, rows["blocks.10.fc"].ok) == (not differs, True)


def test_torchao_fp8_gemms_that_torchao_refuses_are_said_per_layer(tmp_path):
    path = tmp_path / "p_torchao.py"
    policy = Policy(layers={"blocks.1.fc": "fp8-fwd"})
    export(policy, "torchao", path)
    edit(path, '"recipe": null', '"recipe": "rowwize"')  # torchao's from_recipe_name asserts it is one of its names
    with pytest.raises(AssertionError, match="rowwize"):
        from torch import nn

        load(path).convert(nn.ModuleDict({"blocks": nn.ModuleList([nn.Identity(), nn.ModuleDict({"fc": nn.Linear(16, 16)})])}))
    (row,) = [r for r in verify(path, policy, ["blocks.1.fc"]).rows]
    assert row.resolved.gemms is None and "rowwize" in row.resolved.via and "tensorwise, rowwise" in row.resolved.via
    edit(path, '"recipe": "rowwize"', '"recipe": null')
    edit(path, '"dgrad": false,\\n', "")  # convert() reads gemms["dgrad"]: a KeyError
    (row,) = [r for r in verify(path, policy, ["blocks.1.fc"]).rows]
    assert row.resolved.gemms is None and "'dgrad'" in row.resolved.via


def arguments_edit(path, old, new):
    import json

    content = json.loads(path.read_text())
    assert old in content["arguments"], content["arguments"]
    content["arguments"] = content["arguments"].replace(old, new)
    path.write_text(json.dumps(content, indent=2))


@pytest.mark.parametrize(("old", "new", "layers"), [
    ("--fp8-recipe tensorwise", "--fp8-recipe mxfp8", range(1, 11)),  # the recipe
    ("--num-layers-at-end-in-bf16 1", "--num-layers-at-end-in-bf16 0", [11]),  # the last layer quantized
    ("--first-last-layers-bf16 ", "", [0, 11]),  # the counts without their switch: every layer quantized
    ("--fp8-format hybrid --fp8-recipe tensorwise", "", range(1, 11)),  # no recipe at all
    ("--fp8-format hybrid", "--fp8-format 'hybrid'", []),  # a shell reads the quotes away
    ("--num-layers-at-start-in-bf16 1", "--num-layers-at-start-in-bf16=1", []),  # argparse's = form
])  # fmt: skip
def test_megatron_verify_reads_the_arguments_as_megatron_lm_parses_them(tmp_path, old, new, layers):
    """The Megatron-LM command line (`arguments`) is what most users run: edited, it quantized other layers than
    transformer_config while verify read transformer_config only. A layer runs as the policy says only if both do."""
    path = tmp_path / "p_megatron.json"
    policy = megatron_policy("fp8")
    export(policy, "megatron", path)
    arguments_edit(path, old, new)
    expected = [f"decoder.layers.{i}.{r}" for i in layers for r in MEGATRON_ROLES]
    result = verify(path, policy, megatron_names())
    assert result.differing == expected
    for row in result.rows:
        if row.layer in expected:
            assert row.resolved.gemms is None and "arguments" in row.resolved.via and "transformer_config" in row.resolved.via


@pytest.mark.parametrize(("old", "new", "said"), [
    ("--fp8-format hybrid", "--fp8-format e5m2", "--fp8-format 'e5m2': one of e4m3, hybrid"),
    ("--bf16", "--bf16 --fp8-param-gather", "'--fp8-param-gather', which `autoprec export` never writes"),
    ("--fp8-format hybrid", "--fp8-form hybrid", "'--fp8-form', which `autoprec export` never writes"),  # no abbreviation
    ("--num-layers-at-end-in-bf16 1", "--num-layers-at-end-in-bf16 one", "--num-layers-at-end-in-bf16 'one': an integer"),
    ("--fp8-format hybrid", "--fp8-format 'hybrid", "cannot be split as a shell splits it"),
    ("--num-layers-at-end-in-bf16 1", "--num-layers-at-end-in-bf16", "--num-layers-at-end-in-bf16: it takes a value"),
])  # fmt: skip
def test_megatron_arguments_megatron_lm_would_refuse_are_one_line(tmp_path, capsys, old, new, said):
    path = tmp_path / "p_megatron.json"
    policy = megatron_policy("fp8")
    export(policy, "megatron", path)
    arguments_edit(path, old, new)
    policy.save(tmp_path / "policy.json")
    (tmp_path / "names.txt").write_text("\n".join(megatron_names()) + "\n")
    assert main(["verify", str(path), "--policy", str(tmp_path / "policy.json"), "--model", str(tmp_path / "names.txt")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(path) in err and "arguments" in err and said in err, err


BILLION_LAUGHS = """# autoprec export --to megatron-precision
a: &a ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]
b: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a, *a]
c: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b, *b]
d: &d [*c, *c, *c, *c, *c, *c, *c, *c, *c, *c]
e: &e [*d, *d, *d, *d, *d, *d, *d, *d, *d, *d]
configs: {}
matchers:
  m: {type: glob, enabled: true, pattern: *e, config: x}
"""


@pytest.mark.parametrize("text", [
    BILLION_LAUGHS,  # 10^5 strings here; three lines more make 10^8, which exhausted memory quoting the pattern
    "# autoprec export --to megatron-precision\nconfigs: &c {}\nmatchers: {}\n",  # an anchor alone
])  # fmt: skip
def test_a_yaml_alias_or_anchor_is_refused_before_it_expands(tmp_path, capsys, text):
    path = tmp_path / "p.yaml"
    path.write_text(text)
    Policy(layers={"fc": "bf16"}).save(tmp_path / "policy.json")
    (tmp_path / "names.txt").write_text("fc\n")
    assert main(["verify", str(path), "--policy", str(tmp_path / "policy.json"), "--model", str(tmp_path / "names.txt")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(path) in err and "anchor" in err and "lol" not in err, err
    assert len(err) < len(str(path)) + 300


def verify_edited(tmp_path, old: str, new: str) -> int:
    """`autoprec verify` of a megatron-precision export (two mxfp8 linears, one per GEMM) with `old` edited to `new`."""
    path = tmp_path / "p.yaml"
    policy = Policy(layers={"decoder.layers.2.mlp.linear_fc1": "mxfp8-fwd", "decoder.layers.1.mlp.linear_fc1": "mxfp8"})
    export(policy, "megatron-precision", path)
    edit(path, old, new)
    policy.save(tmp_path / "policy.json")
    (tmp_path / "names.txt").write_text("\n".join(megatron_names()) + "\n")
    return main(["verify", str(path), "--policy", str(tmp_path / "policy.json"), "--model", str(tmp_path / "names.txt")])


@pytest.mark.parametrize(("old", "new"), [
    ("pattern: decoder.layers.1.mlp.linear_fc1", "pattern: [" + "x, " * 5000 + "x]"),  # the matcher quoted
    ("config: mxfp8\n", "config: [" + "x, " * 5000 + "x]\n"),  # the config's name
    ("matchers:", "matchers: [" + "x, " * 5000 + "x]\nother:"),
])  # fmt: skip
def test_a_long_yaml_value_is_quoted_a_few_dozen_characters(tmp_path, capsys, old, new):
    """A value from the YAML in a message is cut to a few dozen characters, however long (80 were quoted)."""
    assert verify_edited(tmp_path, old, new) == 2
    err = capsys.readouterr().err
    quoted = re.findall(r"(?:\{'type'|\['x').*?\.\.\.", err)  # each value as quoted, up to its cut
    assert err.count("\n") == 1 and quoted and all(len(q) <= 45 for q in quoted), err


@pytest.mark.parametrize("fifo", ["exported", "names", "policy", "factory"])
def test_verify_refuses_a_fifo_without_waiting_for_a_writer(tmp_path, capsys, fifo):
    """A named pipe given as a file: opening it to read waited for a writer, forever."""
    import threading

    policy = Policy(layers={"decoder.layers.2.mlp.linear_fc1": "mxfp8-fwd"})
    files = {"exported": tmp_path / "p.yaml", "names": tmp_path / "names.txt", "policy": tmp_path / "policy.json"}
    files["factory"] = tmp_path / "p_qfactory.py"
    export(policy, "megatron-precision", files["exported"])
    policy.save(files["policy"])
    files["names"].write_text("\n".join(megatron_names()) + "\n")
    files[fifo].unlink()
    os.mkfifo(files[fifo])
    args = ["verify", str(files["exported"]), "--policy", str(files["policy"]), "--model", str(files["names"])]
    done = []
    thread = threading.Thread(target=lambda: done.append(main(args)), daemon=True)
    thread.start()
    thread.join(20)
    if thread.is_alive():  # let the waiting open go on, so that the thread ends
        os.close(os.open(files[fifo], os.O_WRONLY | os.O_NONBLOCK))
        thread.join(5)
    assert done == [2]
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(files[fifo]) in err and "not a regular file" in err, err


@pytest.mark.parametrize(("old", "new", "said"), [
    ("custom_recipe_factory: p_qfactory.mxfp8_fwd", "custom_recipe_factory: pkg.mod.mix",
     "custom_recipe_factory 'pkg.mod.mix'"),
    ("custom_recipe_factory: p_qfactory.mxfp8_fwd", "custom_recipe_factory: ../p_qfactory.mxfp8_fwd",
     "custom_recipe_factory '../p_qfactory.mxfp8_fwd'"),
    ("config: mxfp8_fwd", "config: [mxfp8_fwd]", "matcher 'layer_0_mxfp8_fwd': config ['mxfp8_fwd']"),
    ("matchers:", "matchers: []\nother:", "matchers []"),
    ("configs:", "configs: [1]\nother:", "configs [1]"),
    ("training_recipe: {}", "training_recipe: [1]", "training_recipe [1]"),
])  # fmt: skip
@pytest.mark.parametrize("with_megatron", [True, False], ids=["megatron-core", "without"])
def test_megatron_precision_hand_edits_are_one_line_naming_the_key_and_value(
    tmp_path, capsys, monkeypatch, old, new, said, with_megatron
):
    if with_megatron:
        pytest.importorskip("megatron.core.quantization.quant_config", reason="megatron-core is not installed")
    else:
        for module in ("megatron.core.quantization.quant_config", "megatron.core.extensions.transformer_engine"):
            monkeypatch.setitem(sys.modules, module, None)
    path = tmp_path / "p.yaml"
    assert verify_edited(tmp_path, old, new) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("autoprec: error:") and str(path) in err and said in err, err


def test_a_table_entry_naming_no_linear_of_the_model_is_said_with_its_close_matches(tmp_path, capsys):
    """A mistyped layer name in a table selects nothing, silently: verify names the entry and what it resembles,
    exit 1, for each target whose file names layers."""
    path = tmp_path / "p_torchao.py"
    export(HF_POLICY, "torchao", path)
    edit(path, '"model.layers.1.mlp.down_proj"', '"model.layers.1.mlp.down_prj"')
    result = verify(path, HF_POLICY, hf_names())
    assert result.differing == ["model.layers.1.mlp.down_proj", "model.layers.1.mlp.down_prj"]
    stray = result.rows[-1]
    assert stray.layer == "model.layers.1.mlp.down_prj" and not stray.ok and "model.layers.1.mlp.down_proj" in stray.close
    text = table(result)
    assert "names no linear of the model" in text
    last = text.splitlines()[-1]
    assert "the file names a layer the model does not have: 'model.layers.1.mlp.down_prj'" in last
    assert "(close: 'model.layers.1.mlp.down_proj'" in last
    HF_POLICY.save(tmp_path / "policy.json")
    (tmp_path / "names.txt").write_text("\n".join(hf_names()) + "\n")
    args = ["verify", str(path), "--policy", str(tmp_path / "policy.json"), "--model", str(tmp_path / "names.txt")]
    assert main([*args, "--json"]) == 1
    import json

    found = json.loads(capsys.readouterr().out)
    (unknown,) = found["unknown"]
    assert unknown["entry"] == "model.layers.1.mlp.down_prj" and unknown["close_matches"][0] == "model.layers.1.mlp.down_proj"
    # Transformer Engine's GEMMS and Megatron's per-module matchers
    te = tmp_path / "p_te.py"
    export(BLOCKSCALED_POLICY, "transformer-engine", te)
    edit(te, "'layers.10.feed_forward.w1':", "'layers.10.feed_forwrd.w1':")
    result = verify(te, BLOCKSCALED_POLICY, titan_names())
    assert result.differing == ["layers.10.feed_forward.w1", "layers.10.feed_forwrd.w1"]
    assert result.rows[-1].close[0] == "layers.10.feed_forward.w1"
    mp = tmp_path / "p.yaml"
    export(mp_policy(), "megatron-precision", mp)
    edit(mp, "pattern: decoder.layers.10.mlp.linear_fc1", "pattern: decoder.layer.10.mlp.linear_fc1")
    result = verify(mp, mp_policy(), megatron_names())
    assert result.differing == ["decoder.layers.10.mlp.linear_fc1", "decoder.layer.10.mlp.linear_fc1"]
    assert result.rows[-1].close[0] == "decoder.layers.10.mlp.linear_fc1"
    # torchtitan's file refuses a name its model config lacks (linear_names raises): a refused file, exit 2, named
    tt = tmp_path / "p_torchtitan.py"
    titan = Policy(layers={"layers.2.feed_forward.w1": "fp8-rowwise"})
    export(titan, "torchtitan", tt)
    edit(tt, '"layers.2.feed_forward.w1"', '"layers.2.feed_forwad.w1"')
    with pytest.raises(UserError, match=r"'layers.2.feed_forwad.w1' is close to 'layers.2.feed_forward.w1'"):
        verify(tt, titan, titan_names())


FP32_HEAD = {  # target -> a quantized format it writes; the head kept in fp32 inside a bf16 model
    "torchao": "fp8", "torchtitan": "fp8-rowwise", "megatron": "fp8", "megatron-precision": "mxfp8",
    "transformer-engine": "mxfp8",
}  # fmt: skip


@pytest.mark.parametrize("target", list(FP32_HEAD))
def test_a_layer_kept_in_fp32_inside_a_bf16_model_differs_where_the_export_said_it_runs_in_bf16(tmp_path, target):
    """Every target runs a module it has no recipe for in the model's dtype, and its export says so of a layer the
    policy keeps in fp32 inside a bf16 model; verify said "ok" for it."""
    names = [*(f"blocks.{i}.fc" for i in range(3)), "output"]
    fmt = FP32_HEAD[target]
    policy = Policy(layers={"": "bf16", "blocks.0.fc": "bf16", "blocks.1.fc": fmt, "blocks.2.fc": "bf16", "output": "fp32"})
    path = tmp_path / "p.out"
    left_out = export(policy, target, path)
    assert any(line.startswith("layer 'output' runs in fp32") for line in left_out), left_out
    result = verify(path, policy, names, target)
    assert result.differing == ["output"]
    (row,) = [r for r in result.rows if r.layer == "output"]
    assert row.expected == ("fp32",) * 3 and row.resolved.gemms == ("bf16",) * 3 and "bf16" in row.resolved.via
    assert "fp32 / fp32 / fp32" in table(result) and "bf16 / bf16 / bf16" in table(result)
    fp32 = Policy(layers={"blocks.0.fc": "fp32", "blocks.1.fc": fmt, "blocks.2.fc": "fp32", "output": "fp32"})  # an fp32 model
    export(fp32, target, path)
    assert verify(path, fp32, names, target).differing == []
