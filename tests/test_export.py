"""`autoprec export`: each target's file, loaded by that tool (torchao, torchtitan, Megatron-core), converts exactly
the policy's fp8 layers it can express, in their recipes, and lists what it cannot express."""

import ast
import copy
import dataclasses
import importlib.util
import json
import sys
import types

import pytest
import torch
import yaml
from torch import nn

from autoprec import Policy, UserError
from autoprec.formats import Format, fp8_formats
from autoprec.tune._cli import main
from autoprec.tune.export import TARGETS, export

POLICY = Policy(layers={"": "bf16", "a": "fp8", "b": "fp8-rowwise", "c": "bf16", "d": "fp32", "e.0": "fp8"})


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c, self.d = (nn.Linear(32, 32) for _ in range(4))
        self.e = nn.Sequential(nn.Linear(32, 32))
        self.f = nn.Linear(32, 32)  # not in the policy


def left(lines):
    """The export's lines less its notes ("note: ": the Transformer Engine version and environment a file needs)."""
    return [line for line in lines if not line.startswith("note: ")]


def load(path):
    spec = importlib.util.spec_from_file_location(f"exported_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_torchao_file_converts_exactly_the_policys_fp8_layers_with_their_recipes(tmp_path):
    from torchao.float8 import Float8LinearConfig
    from torchao.float8.float8_linear import Float8Linear

    left_out = export(POLICY, "torchao", tmp_path / "policy_torchao.py")
    model = load(tmp_path / "policy_torchao.py").convert(Net())
    converted = {n: m.config for n, m in model.named_modules() if isinstance(m, Float8Linear)}
    assert set(converted) == {"a", "b", "e.0"}
    assert converted["a"] == converted["e.0"] == Float8LinearConfig.from_recipe_name("tensorwise")
    assert converted["b"] == Float8LinearConfig.from_recipe_name("rowwise")
    assert [type(m) for m in (model.c, model.d, model.f)] == [nn.Linear] * 3
    assert (
        len(left_out) == 3 and "model root" in left_out[0] and "bf16" in left_out[0] and "layer 'c' runs in bf16" in left_out[1]
    )
    assert left_out[2].startswith("layer 'd' runs in fp32 inside a bf16 model root")  # autocast would lower it
    assert all(line in (tmp_path / "policy_torchao.py").read_text() for line in left_out)  # in the file, too


def mx_configs(model):
    """Each module whose weight torchao's MX training conversion wrapped -> its MXFP8TrainingOpConfig."""
    from torchao.prototype.moe_training.tensor import MXFP8TrainingWeightWrapperTensor

    return {
        name: module.weight.data.config
        for name, module in model.named_modules()
        if isinstance(getattr(module, "weight", None), torch.Tensor)
        and isinstance(module.weight.data, MXFP8TrainingWeightWrapperTensor)
    }


def test_the_torchao_file_converts_the_policys_mxfp8_layers_with_torchaos_mx_training_config(tmp_path):
    """Issue 63, 4: mxfp8 layers were listed as not a torchao recipe; torchao 0.18's MXFP8TrainingOpConfig runs them
    ("mxfp8_rceil"; mxfp8-fwd-dgrad: "mxfp8_rceil_wgrad_with_hp"), per layer, beside the float8 ones."""
    from torchao.float8.float8_linear import Float8Linear
    from torchao.prototype.moe_training.config import MXFP8TrainingOpConfig, MXFP8TrainingRecipe

    policy = Policy(layers={"a": "mxfp8", "b": "fp8-rowwise", "c": "mxfp8-fwd-dgrad", "d": "nvfp4", "e.0": "mxfp8"})
    left_out = export(policy, "torchao", tmp_path / "p.py")
    model = load(tmp_path / "p.py").convert(Net())
    rceil, with_hp = (
        MXFP8TrainingOpConfig.from_recipe(MXFP8TrainingRecipe(r)) for r in ("mxfp8_rceil", "mxfp8_rceil_wgrad_with_hp")
    )
    assert mx_configs(model) == {"a": rceil, "c": with_hp, "e.0": rceil} and rceil != with_hp
    assert isinstance(model.b, Float8Linear) and [type(m) for m in (model.d, model.f)] == [nn.Linear] * 2
    assert left_out == ["layer 'd' runs in nvfp4: not a torchao float8 recipe, so not in the export; run it with autocast "
                        "or autoprec.apply_policy"]  # fmt: skip
    # a policy of MXFP8 layers only converts them: the file says it changes nothing only where it does
    left_out = export(Policy(layers={"a": "mxfp8"}), "torchao", tmp_path / "q.py")
    assert left_out == [] and mx_configs(load(tmp_path / "q.py").convert(Net())) == {"a": rceil}


def test_the_torchao_file_all_gathers_in_fp8_every_format_the_policy_gathers(tmp_path):
    """fp8-fwd-dgrad (tensorwise, per GEMM) gathers in fp8 too, under its own key; fp8-fwd does not."""
    policy = Policy(layers={"a": "fp8-fwd-dgrad", "b": "fp8-fwd", "e.0": "fp8"}, fsdp_fp8_all_gather=True)
    export(policy, "torchao", tmp_path / "p.py")
    exported = load(tmp_path / "p.py")
    assert exported.FSDP_FP8_ALL_GATHER == ["fp8-fwd-dgrad", "tensorwise"]
    model = exported.convert(Net())
    assert [model.get_submodule(n).config.enable_fsdp_float8_all_gather for n in ("a", "b", "e.0")] == [True, False, True]


def test_the_torchao_file_all_gathers_in_fp8_the_tensorwise_layers_where_the_policy_does(tmp_path):
    gathered = dataclasses.replace(POLICY, fsdp_fp8_all_gather=True)  # a sharded search's choice
    for policy, expected in ((gathered, {"a": True, "b": False, "e.0": True}), (POLICY, dict.fromkeys(("a", "b", "e.0"), False))):
        assert export(policy, "torchao", tmp_path / "p.py") == export(POLICY, "torchao", tmp_path / "q.py")  # nothing lost
        model = load(tmp_path / "p.py").convert(Net())
        assert {n: model.get_submodule(n).config.enable_fsdp_float8_all_gather for n in expected} == expected


def test_a_target_without_the_fp8_all_gather_says_it_leaves_it_out(tmp_path):
    gathered = dataclasses.replace(POLICY, fsdp_fp8_all_gather=True)
    for target in ("torchtitan", "megatron", "megatron-precision", "transformer-engine"):
        left_out = export(gathered, target, tmp_path / f"p{target}")
        said = [line for line in left_out if line.startswith("fsdp_fp8_all_gather:")]
        assert [line for line in left_out if line not in said] == export(POLICY, target, tmp_path / f"q{target}")
        assert len(said) == 1 and "the weights of its fp8 layers in fp8 under FSDP2" in said[0]
        assert "file has no setting for it, so they gather in their own dtype there" in said[0]
        written = (tmp_path / f"p{target}").read_text()
        assert "fsdp_fp8_all_gather" in written  # in the file's own list of what it leaves out, too


PER_GEMM_POLICY = Policy(layers={"a": "fp8-fwd", "b": "fp8-fwd-dgrad", "c": "fp8-rowwise-fwd",
                                 "d": "fp8-rowwise-fwd-dgrad", "e.0": "fp8-fwd-dgrad", "f": "fp8"})  # fmt: skip


def test_the_torchao_file_gives_each_per_gemm_layer_the_config_apply_policy_gives_it(tmp_path):
    from torchao.float8.float8_linear import Float8Linear

    from autoprec import apply_policy

    left_out = export(PER_GEMM_POLICY, "torchao", tmp_path / "p.py")
    exported = load(tmp_path / "p.py")
    assert left_out == [] and exported.FP8_LAYERS["fp8-fwd-dgrad"] == ["b", "e.0"]
    model, applied = exported.convert(Net()), apply_policy(Net(), PER_GEMM_POLICY)
    converted = {n: m.config for n, m in model.named_modules() if isinstance(m, Float8Linear)}
    assert set(converted) == set(PER_GEMM_POLICY.layers)
    for name, config in converted.items():  # apply_policy emulates here; the file leaves that to torchao's default
        assert config == dataclasses.replace(applied.get_submodule(name).config, emulate=False), name
    assert converted["a"].cast_config_grad_output.scaling_type.value == "disabled"  # forward only: no gradient cast
    assert converted["b"].cast_config_input_for_grad_weight.scaling_type.value == "disabled"  # wgrad high precision


ALL_FP8 = [f.value for f in fp8_formats() if f.family.fp8_gemms(f) is not None]


@pytest.mark.parametrize("autocast", [False, True], ids=["outside autocast", "under bf16 autocast"])
@pytest.mark.parametrize("fmt", ALL_FP8)
def test_the_torchao_file_trains_as_its_docstring_says_inside_and_outside_autocast(tmp_path, fmt, autocast, gpu_contract_on):
    """Every per-GEMM mix crashed under bf16 autocast (torchao's high-precision GEMMs got bf16 and fp32 operands),
    though the file's header said to run it with autocast: the file is executed as it says, forward and backward,
    under CUDA's rules (the file leaves emulation to torchao's default: its kernels), and computes what apply_policy
    computes there."""
    from autoprec import apply_policy

    policy = Policy(layers={"a": fmt, "b": fmt})
    export(policy, "torchao", tmp_path / "p.py")
    assert "inside or outside torch.autocast" in (tmp_path / "p.py").read_text()
    torch.manual_seed(0)
    net = nn.Sequential()
    net.a, net.b = nn.Linear(32, 32), nn.Linear(32, 32)
    exported, applied = load(tmp_path / "p.py").convert(copy.deepcopy(net)), apply_policy(copy.deepcopy(net), policy)
    x = torch.randn(16, 32)
    outs = []
    for model in (exported, applied):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            y = model(x)
        y.float().sum().backward()
        outs.append((y.detach(), model.a.weight.grad))
    assert outs[0][0].dtype == outs[1][0].dtype == (outs[0][0].dtype if autocast else torch.float32)
    torch.testing.assert_close(outs[0], outs[1])  # the same rule casts both


def test_a_deep_copy_of_a_converted_model_computes_with_its_own_weights(tmp_path):
    """An EMA or eval copy: the cast forward called the original layer's bound forward, so the copy computed with the
    original's weights and its own got no gradient."""
    export(Policy(layers={"a": "fp8-fwd-dgrad"}), "torchao", tmp_path / "p.py")
    model = load(tmp_path / "p.py").convert(Net())
    twin = copy.deepcopy(model)
    with torch.no_grad():
        twin.a.weight.zero_()
    x = torch.randn(16, 32)
    out = twin.a(x)
    expected = twin.a.bias.to(torch.bfloat16).float().expand_as(out)  # a zero weight: the bias, as bf16 rounds it
    assert torch.equal(out, expected) and not torch.equal(out, model.a(x))
    out.sum().backward()
    assert twin.a.weight.grad is not None and model.a.weight.grad is None
    assert twin.a(input=x).shape == (16, 32)  # called by keyword, as nn.Linear allows


def test_torchtitan_and_megatron_say_they_cannot_express_a_per_gemm_mix(tmp_path):
    left_out = export(PER_GEMM_POLICY, "torchtitan", tmp_path / "t.py")
    assert "layer 'a' runs in fp8-fwd, fp8 per GEMM (no torchao recipe): torchtitan's float8 converter offers" in left_out[0]
    assert len(left_out) == 6 and left_out[-1].startswith("the policy has no fp8 layer torchtitan can run")
    blocks = megatron_policy([("fp8",) * 4, ("fp8", "fp8-fwd-dgrad", "fp8", "fp8")])
    left_out = left(export(Policy(layers=blocks), "megatron", tmp_path / "m.json"))
    assert json.loads((tmp_path / "m.json").read_text())["quantized_layers"] == [0]
    assert left_out == ["transformer layers decoder.layers.{1}: a linear in a quantized format Megatron has no recipe "
                        "for (it has fp8 tensorwise, fp8 mxfp8, fp4 nvfp4, each running all three GEMMs of a linear: no "
                        "per-GEMM mix, no rowwise fp8); left in the model's dtype"]  # fmt: skip


def test_the_export_verb_writes_beside_the_policy_and_lists_what_it_left_out(tmp_path, capsys):
    POLICY.save(tmp_path / "policy.json")
    assert main(["export", str(tmp_path / "policy.json"), "--to", "torchao"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"wrote {tmp_path / 'policy_torchao.py'}" and len(out) == 4 and out[2].startswith("not expressed: layer 'c'")
    assert main(["--quiet", "export", str(tmp_path / "policy.json"), "--to", "torchao"]) == 0
    quiet = capsys.readouterr()  # what the file leaves out stays a warning under --quiet
    assert quiet.out == "" and quiet.err.splitlines()[-2].startswith("not expressed: layer 'c'")
    assert main(["export", str(tmp_path / "policy.json"), "--to", "torchao", "--out", str(tmp_path / "x.py"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["file"] == str(tmp_path / "x.py")
    with pytest.raises(SystemExit):  # argparse names the choices
        main(["export", str(tmp_path / "policy.json"), "--to", "deepspeed"])
    assert "invalid choice: 'deepspeed'" in capsys.readouterr().err


def test_a_policy_without_fp8_layers_says_the_file_converts_nothing(tmp_path):
    left_out = export(Policy(layers={"a": "bf16", "b": "bf16"}), "torchao", tmp_path / "p.py")
    assert left_out[0].startswith("2 layers ('a', 'b') run in bf16: not a torchao float8 recipe")  # one line per reason
    many = export(Policy(layers={f"l{i}": "bf16" for i in range(9)}), "torchao", tmp_path / "q.py")
    assert many[0].startswith("9 layers ('l0', 'l1', 'l2', 'l3', 'l4', 'l5' and 3 more) run in bf16")
    assert left_out[-1] == "the policy has no fp8 or MXFP8 layer: the file's convert(model) changes nothing"
    model = load(tmp_path / "p.py").convert(Net())
    assert all(type(m) in (nn.Linear, nn.Sequential, Net) for m in model.modules())


# --- torchtitan (0.3): its own model config, its own converter, on the CPU (emulate=True, eager) ---

TITAN_POLICY = Policy(layers={"": "bf16", "layers.0.feed_forward.w1": "fp8-rowwise", "layers.0.feed_forward.w3": "fp8-rowwise",
                              "layers.1.feed_forward.w2": "fp8-rowwise-gw-hp", "layers.1.attention.wo": "fp8",
                              "layers.0.attention.wo": "fp32", "lm_head": "bf16"})  # fmt: skip


@pytest.fixture
def llama3():
    """torchtitan's llama3 debug model registry; its rowwise converter sets an inductor flag, restored after."""
    from torch._inductor import config

    llama3 = pytest.importorskip("torchtitan.models.llama3", reason="torchtitan needs Python 3.11 (the test extra has it)")
    saved = config.get_config_copy()
    yield llama3.model_registry
    config.load_config(saved)


def converted(model_config):
    """fqn -> the torchao config torchtitan converted that Linear with."""
    from torchtitan.components.quantization.float8 import Float8Linear
    from torchtitan.models.common.linear import Linear

    return {fqn: config._torchao_config for fqn, config, _, _ in model_config.traverse(Linear.Config)
            if isinstance(config, Float8Linear.Config)}  # fmt: skip


@pytest.fixture
def fp8_capable(monkeypatch, llama3):
    """torchtitan builds a converter only where fp8 kernels are (or with emulate=True, which drops the recipe):
    the conversion itself is of configs, so a CPU can check it once the capability check says yes."""
    import torchtitan.components.quantization.float8 as titan_float8

    monkeypatch.setattr(titan_float8, "has_cuda_capability", lambda *args: True)
    return llama3


def test_the_torchtitan_file_converts_exactly_the_policys_rowwise_layers_with_their_recipes(tmp_path, fp8_capable):
    import torch
    from torchao.float8 import Float8LinearConfig
    from torchtitan.models.common.linear import Linear

    llama3 = fp8_capable
    left_out = export(TITAN_POLICY, "torchtitan", tmp_path / "p_torchtitan.py")
    exported = load(tmp_path / "p_torchtitan.py")
    config = llama3("debugmodel").model
    with torch.device("meta"):  # the config's fqns are the built model's module names, which a search lists
        modules = {n for n, m in config.build().named_modules() if isinstance(m, torch.nn.Linear)}
    assert modules == {fqn for fqn, *_ in config.traverse(Linear.Config)}
    converters = exported.float8_converters(config)
    assert [c.recipe_name for c in converters] == ["rowwise", "rowwise_with_gw_hp"]
    rowwise, gw_hp = (Float8LinearConfig.from_recipe_name(r) for r in ("rowwise", "rowwise_with_gw_hp"))
    assert converted(llama3("debugmodel", converters=converters[:1]).model) == {
        "layers.0.feed_forward.w1": rowwise, "layers.0.feed_forward.w3": rowwise}  # fmt: skip
    assert converted(llama3("debugmodel", converters=converters[1:]).model) == {"layers.1.feed_forward.w2": gw_hp}
    assert converted(llama3("debugmodel", converters=converters).model) == {
        "layers.0.feed_forward.w1": rowwise, "layers.0.feed_forward.w3": rowwise, "layers.1.feed_forward.w2": gw_hp}  # fmt: skip
    with pytest.raises(ValueError, match="emulate=True makes torchtitan convert with torchao's default"):
        exported.float8_converters(config, emulate=True)  # it would drop the recipe: refused
    assert len(left_out) == 4 and "model root" in left_out[0] and "'lm_head' runs in bf16" in left_out[1]
    assert left_out[2].startswith("layer 'layers.0.attention.wo' runs in fp32 inside a bf16 model root")
    assert "layer 'layers.1.attention.wo' runs in fp8 recipe 'tensorwise'" in left_out[3]
    assert all(line in (tmp_path / "p_torchtitan.py").read_text() for line in left_out)


def test_the_torchtitan_file_refuses_a_model_config_without_the_policys_layers(tmp_path, llama3):
    export(Policy(layers={"blocks.0.fc": "fp8-rowwise"}), "torchtitan", tmp_path / "p.py")
    with pytest.raises(ValueError, match=r"\['blocks.0.fc'\] are not Linear layers of this model config .*another model"):
        load(tmp_path / "p.py").float8_converters(llama3("debugmodel").model)


def test_the_torchtitan_file_refuses_a_skip_filter_that_would_catch_an_fp8_layer(tmp_path, llama3):
    export(Policy(layers={"out_proj": "fp8-rowwise"}), "torchtitan", tmp_path / "p.py")

    class Config:  # a model config whose Linear 'out' is a substring of the fp8 layer 'out_proj'
        def traverse(self, _cls):
            return iter([("out", None, None, None), ("out_proj", None, None, None)])

    with pytest.raises(ValueError, match="filter 'out' would also skip fp8 layer 'out_proj'"):
        load(tmp_path / "p.py").filter_fqns(Config(), "rowwise")


def test_a_policy_without_rowwise_layers_gives_torchtitan_no_converter(tmp_path, llama3):
    left_out = export(Policy(layers={"layers.0.attention.wo": "fp8"}), "torchtitan", tmp_path / "p.py")
    assert load(tmp_path / "p.py").float8_converters(llama3("debugmodel").model) == []
    assert left_out[-1].endswith("float8_converters() returns []") and "tensorwise" in left_out[0]


# --- Megatron-core: its TransformerConfig validates the fields, its own layer rule says which layers run fp8 ---


def megatron_policy(blocks):
    """blocks: per transformer layer, (qkv, proj, fc1, fc2) formats."""
    roles = ("attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2")
    return {f"decoder.layers.{i}.{role}": fmt for i, formats in enumerate(blocks) for role, fmt in zip(roles, formats)}


def megatron_fp8_layers(exported, count):
    """Which transformer layers Megatron-core runs in its fp8 or fp4 recipe under the exported TransformerConfig
    fields (fp4_utils.get_fp4_context counts the first and last bf16 layers as is_first_last_bf16_layer does)."""
    pytest.importorskip("megatron.core", reason="megatron-core is not installed (the test extra has it)")
    from megatron.core.fp8_utils import is_first_last_bf16_layer
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(num_layers=count, hidden_size=64, num_attention_heads=4, **exported["transformer_config"])
    quantized = config.fp8 or config.fp4
    return [i for i in range(count) if quantized and not is_first_last_bf16_layer(config, i)], config


def megatron_arguments(exported):
    """The exported Megatron-LM arguments as TransformerConfig fields, each flag named by Megatron's own argparse
    metadata (`--fp8-format` is the field `fp8`)."""
    import dataclasses as dc

    pytest.importorskip("megatron.core", reason="megatron-core is not installed (the test extra has it)")
    from megatron.core.transformer.transformer_config import TransformerConfig

    flags = {}
    for field in dc.fields(TransformerConfig):
        names = field.metadata.get("argparse_meta", {}).get("arg_names", ["--" + field.name.replace("_", "-")])
        flags.update(dict.fromkeys(names, field.name))
    words, parsed = exported["arguments"].split(), {}
    for i, word in enumerate(words):
        if word.startswith("--"):
            value = words[i + 1] if i + 1 < len(words) and not words[i + 1].startswith("--") else True
            parsed[flags[word]] = int(value) if isinstance(value, str) and value.isdigit() else value
    return parsed


def test_the_megatron_file_runs_fp8_in_the_longest_run_of_wholly_tensorwise_layers(tmp_path):
    t, b, r = "fp8", "bf16", "fp8-rowwise"
    layers = megatron_policy([(t,) * 4, (b,) * 4, (t,) * 4, (t,) * 4, (t,) * 4, (t, t, t, b), (r,) * 4])
    left_out = left(export(Policy(layers={"": "bf16", **layers, "output_layer": "fp8"}), "megatron", tmp_path / "m.json"))
    exported = json.loads((tmp_path / "m.json").read_text())
    assert exported["stack"] == "decoder.layers" and exported["num_layers"] == 7 and exported["quantized_layers"] == [2, 3, 4]
    fp8, config = megatron_fp8_layers(exported, 7)
    assert fp8 == [2, 3, 4] and config.bf16 and (config.fp8, config.fp8_recipe) == ("hybrid", "tensorwise")
    # every argument names a TransformerConfig field by Megatron's own argparse metadata, with the exported value
    assert megatron_arguments(exported) == {k: v for k, v in exported["transformer_config"].items() if v is not False}
    assert left_out == exported["not_expressed"] and len(left_out) == 4
    assert "layer 'output_layer' runs in fp8 outside the transformer layers (decoder.layers.N)" in left_out[0]
    assert (
        left_out[1].startswith("transformer layers decoder.layers.{0}: wholly tensorwise in the policy, but")
        and "here 2-4" in left_out[1]
    )
    assert left_out[2].startswith("transformer layers decoder.layers.{5}: some linears in a quantized recipe and some not")
    assert left_out[3].startswith("transformer layers decoder.layers.{6}: a linear in a quantized format Megatron has no recipe")
    assert "for a model of 7 transformer layers (taken from the policy's layer names" in exported["notes"][0]


@pytest.mark.parametrize("blocks, root, expected", [
    ([("fp8",) * 4] * 3, "fp32", [0, 1, 2]),  # every layer: no first/last settings at all
    ([("bf16",) * 4] * 3, "bf16", []),  # no fp8: fp8 unset
    ([("fp8",) * 4, ("fp8", "fp8", "fp8", "fp32"), ("fp8",) * 4, ("fp8",) * 4], "fp32", [2, 3]),
], ids=["all", "none", "end"])  # fmt: skip
def test_the_megatron_fp8_layers_are_what_megatron_runs(tmp_path, blocks, root, expected):
    left_out = left(export(Policy(layers={"": root, **megatron_policy(blocks)}), "megatron", tmp_path / "m.json"))
    exported = json.loads((tmp_path / "m.json").read_text())
    assert megatron_fp8_layers(exported, len(blocks))[0] == expected == exported["quantized_layers"]
    assert ("first_last_layers_bf16" in exported["transformer_config"]) == (0 < len(expected) < len(blocks))
    assert not left_out if expected in ([0, 1, 2], []) else len(left_out) == 2


@pytest.mark.parametrize("fmt, fields", [
    ("mxfp8", {"fp8": "e4m3", "fp8_recipe": "mxfp8", "fp4": None}),  # MXFP8BlockScaling, e4m3 for every operand
    ("nvfp4", {"fp4": "e2m1", "fp4_recipe": "nvfp4", "fp8": None}),  # NVFP4BlockScaling
])  # fmt: skip
def test_megatron_runs_mxfp8_and_nvfp4_layers_in_its_own_recipes(tmp_path, fmt, fields):
    """megatron-core 0.16 has --fp8-recipe mxfp8 and --fp4-format e2m1 --fp4-recipe nvfp4, with the same first/last
    bf16 layers; the export said Megatron could not run either."""
    layers = megatron_policy([("bf16",) * 4, (fmt,) * 4, (fmt,) * 4, ("bf16",) * 4])
    left_out = left(export(Policy(layers={"": "bf16", **layers}), "megatron", tmp_path / "m.json"))
    exported = json.loads((tmp_path / "m.json").read_text())
    quantized, config = megatron_fp8_layers(exported, 4)
    assert quantized == [1, 2] == exported["quantized_layers"] and exported["recipe"] == fmt and left_out == []
    assert {name: getattr(config, name) for name in fields} == fields and config.bf16
    assert megatron_arguments(exported) == {k: v for k, v in exported["transformer_config"].items() if v is not False}


def test_megatron_runs_one_recipe_and_points_the_others_to_megatron_precision(tmp_path):
    """fp8 and fp4 exclude each other in Megatron (TransformerConfig refuses both): the longest run's recipe is
    written, a layer wholly in another recipe is said, with the target that gives each linear its own."""
    m, n = "mxfp8", "nvfp4"
    layers = megatron_policy([(m,) * 4, (m,) * 4, (n,) * 4, (n,) * 4, (n,) * 4, ("mxfp8-fwd",) * 4, (m, m, n, n)])
    lines = export(Policy(layers={"": "bf16", **layers}), "megatron", tmp_path / "m.json")
    left_out = left(lines)
    exported = json.loads((tmp_path / "m.json").read_text())
    # the per-GEMM mix runs only through megatron-precision's HybridQuantizer: TE 2.19, newer than Megatron-Core 0.19's
    mixes = [line for line in lines if line.startswith("note: the per-GEMM mixes (mxfp8-fwd)")]
    assert len(mixes) == 1 and "Transformer Engine 2.19 or later" in mixes[0]
    assert "Megatron-Core 0.19 pins Transformer Engine 2.18" in mixes[0] and mixes[0][len("note: ") :] in exported["notes"]
    assert megatron_fp8_layers(exported, 7)[0] == [2, 3, 4] == exported["quantized_layers"] and exported["recipe"] == n
    assert [line.split(": ", 1)[0] for line in left_out] == [f"transformer layers decoder.layers.{{{i}}}" for i in ("0-1", 5, 6)]
    assert "wholly mxfp8 in the policy, but Megatron runs one recipe in all its quantized layers" in left_out[0]
    assert "here nvfp4 (--to megatron-precision gives each linear its own recipe)" in left_out[0]
    assert "a linear in a quantized format Megatron has no recipe for" in left_out[1]
    assert "in two recipes" in left_out[2] and "--to megatron-precision" in left_out[2]
    fp8_notes = [note for note in exported["notes"] if "fp8" in note and not note.startswith("the per-GEMM mixes")]
    assert not fp8_notes  # fp4: Megatron's MTP layers ignore it


@pytest.mark.parametrize("index", ["01", "\u0661", "\uff11"], ids=["leading zero", "Arabic-Indic 1", "full-width 1"])
def test_a_megatron_layer_index_is_read_as_megatrons_module_names_write_one(tmp_path, index):
    """'decoder.layers.01.fc' was read as layer 1 and, listed after 'decoder.layers.1.fc' (bf16), made it fp8:
    Megatron names its layers str(int), so no module of it has that name."""
    names = ["decoder.layers.0.fc", "decoder.layers.1.fc", f"decoder.layers.{index}.fc", "decoder.layers.2.fc"]
    policy = Policy(layers=dict(zip(names, ["fp8", "bf16", "fp8", "fp8"])))
    left_out = left(export(policy, "megatron", tmp_path / "m.json"))
    exported = json.loads((tmp_path / "m.json").read_text())
    assert megatron_fp8_layers(exported, 3)[0] == [0] == exported["quantized_layers"]
    said = [line for line in left_out if repr(names[2]) in line]
    assert len(said) == 1 and said[0].startswith(f"layer {names[2]!r} names a layer by a number Megatron's module names never")
    assert left_out[-1].startswith("transformer layers decoder.layers.{2}: wholly tensorwise in the policy, but")


@pytest.mark.parametrize("target", TARGETS)
def test_a_model_root_in_fp8_is_said_and_written_as_no_layer(tmp_path, target):
    """A model root in fp8 was dropped without a line by --to megatron and --to torchao; torchao's file then wrapped
    the model itself (model.get_submodule('')) as an fp8 layer. apply_policy refuses such a root too."""
    policy = Policy(layers={"": "fp8", **megatron_policy([("fp8",) * 4] * 2)})
    left_out = export(policy, target, tmp_path / "x")
    assert left_out[0].startswith("the model root (every op outside a listed layer) runs in fp8, a format of named Linear")
    assert "not in the export" in left_out[0] and not any("layer ''" in line for line in left_out)
    if target == "megatron":
        assert json.loads((tmp_path / "x").read_text())["quantized_layers"] == [0, 1]
    if target == "torchao":
        exported = load((tmp_path / "x").rename(tmp_path / "x.py"))
        assert exported.FP8_LAYERS == {"tensorwise": list(megatron_policy([("fp8",) * 4] * 2))}


def test_a_layer_missing_a_role_the_others_list_is_not_wholly_fp8(tmp_path):
    layers = megatron_policy([("fp8",) * 4] * 4)
    del layers["decoder.layers.2.mlp.fc1"]  # excluded from the search: it runs in the model's dtype, not fp8
    left_out = left(export(Policy(layers=layers), "megatron", tmp_path / "m.json"))
    exported = json.loads((tmp_path / "m.json").read_text())
    assert megatron_fp8_layers(exported, 4)[0] == [0, 1] == exported["quantized_layers"]
    assert left_out == ["transformer layers decoder.layers.{2}: some linears in a quantized recipe and some not, in two "
                        "recipes, or unlisted (Megatron runs a layer's linears all in one recipe or none; --to "
                        "megatron-precision gives each linear its own recipe); left in the model's dtype",
                        "transformer layers decoder.layers.{3}: wholly tensorwise in the policy, but Megatron runs its "
                        "recipe in one contiguous run of layers, here 0-1 (--to megatron-precision gives each linear "
                        "its own recipe); left in the model's dtype"]  # fmt: skip


def test_num_layers_counts_the_models_layers_beyond_the_policys(tmp_path, capsys):
    layers = megatron_policy([("bf16",) * 4] + [("fp8",) * 4] * 5)  # the policy names 6 layers, the model has 9
    export(Policy(layers=layers), "megatron", tmp_path / "m.json", num_layers=9)
    exported = json.loads((tmp_path / "m.json").read_text())
    assert megatron_fp8_layers(exported, 9)[0] == [1, 2, 3, 4, 5] == exported["quantized_layers"]  # 6-8 stay out of fp8
    assert exported["transformer_config"]["num_layers_at_end_in_bf16"] == 3
    assert "decoder.layers.{6-8}: not in the policy" in exported["not_expressed"][-1]
    assert "(given)" in exported["notes"][0]
    POLICY.save(tmp_path / "policy.json")
    Policy(layers=layers).save(tmp_path / "six.json")
    assert main(["export", str(tmp_path / "six.json"), "--to", "megatron", "--num-layers", "5"]) == 2
    assert "--num-layers 5: the policy names transformer layer 5 of 'decoder.layers'; give at least 6" in capsys.readouterr().err
    assert main(["export", str(tmp_path / "policy.json"), "--to", "torchao", "--num-layers", "5"]) == 2
    assert "--num-layers is for --to megatron" in capsys.readouterr().err


def test_the_export_verb_names_each_targets_file(tmp_path, capsys):
    POLICY.save(tmp_path / "policy.json")
    for target, name in (("torchtitan", "policy_torchtitan.py"), ("megatron", "policy_megatron.json")):
        assert main(["export", str(tmp_path / "policy.json"), "--to", target, "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["file"] == str(tmp_path / name) and (tmp_path / name).exists()


# --- nothing read from a policy becomes code, and nothing printed or written drives a terminal ---

HOSTILE = 'x"""+str(__import__("os").system("touch pwned"))+"""'  # closes a docstring that quotes it with repr()
HOSTILE_SOURCE = 'p"""\n__import__("os").system("touch pwned")\n"""\x1b]0;title\x07\r\x1b[2J.json'


def sneaked(layers: dict[str, str]) -> Policy:
    """A Policy holding names its validation refuses, as if one got past it: the export must not lean on it."""
    policy = Policy(layers={"a": "bf16"})
    object.__setattr__(policy, "layers", {name: Format(fmt) for name, fmt in layers.items()})
    return policy


def code_shape(text: str) -> str:
    """The file's syntax tree with every string blanked: what the file runs, whatever data it holds."""
    tree = ast.parse(text)
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            node.value = ""
    return ast.dump(tree)


def printable_lines(text: str) -> bool:
    return all(ch.isprintable() for line in text.split("\n") for ch in line)


@pytest.fixture
def titan_stub(monkeypatch):
    """Just the two names a torchtitan export imports, so that importing one needs no torchtitan."""
    names = {"torchtitan.components.quantization.float8": "Float8LinearConverter", "torchtitan.models.common.linear": "Linear"}
    for path, attr in names.items():
        parts = path.split(".")
        for i in range(1, len(parts) + 1):
            monkeypatch.setitem(sys.modules, ".".join(parts[:i]), types.ModuleType(".".join(parts[:i])))
        setattr(sys.modules[path], attr, type(attr, (), {}))


@pytest.mark.parametrize("target", ["torchao", "torchtitan"])
def test_no_text_from_a_policy_becomes_code_in_an_exported_file(tmp_path, monkeypatch, titan_stub, target):
    fp8 = {'y"""+str(__import__("os").system("touch pwned"))+"""': "fp8-rowwise", "b\n)\nimport os#": "fp8-rowwise",
           "d\u2028e\\": "fp8-rowwise-gw-hp", "\U0001d465\udcff": "fp8-rowwise"}  # fmt: skip
    mx = {'m"""\nimport os#': "mxfp8"}  # torchao's MX_LAYERS, torchtitan's MXFP8 include list
    hostile = {HOSTILE: "bf16", "\x1b]0;title\x07": "fp16", **fp8, **mx}
    plain = {"a": "bf16", "c": "fp16", **{f"l{i}": fmt for i, fmt in enumerate(fp8.values())}, "m": "mxfp8"}
    export(sneaked(hostile), target, tmp_path / "hostile.py", source=HOSTILE_SOURCE)
    export(sneaked(plain), target, tmp_path / "plain.py", source="policy.json")
    text = (tmp_path / "hostile.py").read_text(encoding="utf-8")
    assert code_shape(text) == code_shape((tmp_path / "plain.py").read_text(encoding="utf-8"))  # the policy's text is data only
    assert printable_lines(text) and "\\x1b]0;title\\x07" in text  # its comments show it escaped
    monkeypatch.chdir(tmp_path)
    module = load(tmp_path / "hostile.py")
    assert not (tmp_path / "pwned").exists()
    recipes = {"fp8-rowwise": "rowwise", "fp8-rowwise-gw-hp": "rowwise_with_gw_hp"}
    assert module.FP8_LAYERS == {r: [n for n, f in fp8.items() if recipes[f] == r] for r in recipes.values()}  # exactly
    assert target != "torchao" or module.MX_LAYERS == {"mxfp8_rceil": list(mx)}


def test_the_export_verb_refuses_a_policy_whose_layer_name_is_not_a_module_path(tmp_path, capsys):
    data = POLICY.to_dict()
    data["layers"][HOSTILE] = "bf16"
    (tmp_path / "policy.json").write_text(json.dumps(data), encoding="utf-8")
    for target in TARGETS:
        assert main(["export", str(tmp_path / "policy.json"), "--to", target]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and repr(HOSTILE) in err[0] and "not a module path" in err[0], err
    assert [p.name for p in tmp_path.iterdir()] == ["policy.json"]  # nothing written


@pytest.mark.parametrize("out", [True, False], ids=["--out", "beside the policy"])
def test_a_policy_file_name_becomes_no_code_and_is_printed_escaped(tmp_path, capsys, monkeypatch, titan_stub, out):
    monkeypatch.chdir(tmp_path)
    folder = tmp_path / 'f"""\nimport os\x1b[2J'
    folder.mkdir()
    path = POLICY.save(folder / HOSTILE_SOURCE)
    for target in TARGETS:
        written = tmp_path / f"exported_{target}{exporting.SUFFIXES[target]}"
        assert main(["export", str(path), "--to", target, *(["--out", str(written)] if out else [])]) == 0
        printed = capsys.readouterr()
        assert printable_lines(printed.out + printed.err) and "wrote " in printed.out
        if not out:
            written = path.with_name(f"{path.stem}_{target}{written.suffix}")
        if target == "megatron":
            assert json.loads(written.read_text(encoding="utf-8"))["policy"] == str(path)
        elif written.suffix == ".yaml":
            assert printable_lines(written.read_text(encoding="utf-8"))
            assert yaml.safe_load(written.read_text(encoding="utf-8"))["matchers"]  # the name is a comment only
        else:
            assert printable_lines(written.read_text(encoding="utf-8"))
            load(written)
        assert not (tmp_path / "pwned").exists()


@pytest.mark.parametrize(
    "layers, num_layers, expected",
    [({"blocks.99999999999999.fc": "fp8"}, None, "'blocks.99999999999999.fc' is transformer layer 99999999999999"),
     ({f"blocks.{'9' * 5000}.fc": "fp8"}, None, "transformer layer"),
     ({"blocks.0.fc": "fp8"}, 100_000_000_000, "--num-layers 100000000000: at most 100000")],
    ids=["index", "5000-digit index", "--num-layers"],
)  # fmt: skip
def test_a_megatron_layer_count_past_any_model_is_refused_not_counted_to(tmp_path, capsys, layers, num_layers, expected):
    policy = Policy(layers=layers)
    with pytest.raises(UserError) as info:
        export(policy, "megatron", tmp_path / "m.json", num_layers=num_layers)
    assert expected in str(info.value) and "at most 100000" in str(info.value) and len(str(info.value)) < 400
    policy.save(tmp_path / "policy.json")
    extra = [] if num_layers is None else ["--num-layers", str(num_layers)]
    assert main(["export", str(tmp_path / "policy.json"), "--to", "megatron", *extra]) == 2
    assert expected in capsys.readouterr().err and not (tmp_path / "policy_megatron.json").exists()


def test_the_export_verb_refuses_to_write_over_its_policy(tmp_path, capsys, monkeypatch):
    """`export p.json --out p.json` replaced the policy with the export, exit 0."""
    monkeypatch.chdir(tmp_path)
    path = POLICY.save(tmp_path / "p.json")
    (tmp_path / "sub").mkdir()
    (tmp_path / "link.json").symlink_to(path)
    before = path.read_bytes()
    for target in TARGETS:
        for out in ("p.json", str(path), "sub/../p.json", "link.json"):
            assert main(["export", "p.json", "--to", target, "--out", out]) == 2
            err = capsys.readouterr().err.strip().splitlines()
            assert len(err) == 1 and f"--out {out}: that is the policy file p.json" in err[0], err
    assert path.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["link.json", "p.json", "sub"]
    assert main(["export", "link.json", "--to", "megatron", "--out", "p.json"]) == 2  # the other way round too


# --- a target is a registered type: one added from outside autoprec is offered, named and written by the verb ---


@pytest.fixture
def csv_target():
    """A toy `--to csv` target, registered as a user's own module would register it; unregistered after."""
    from autoprec.tune.export import ExportTarget, Option, register_export_target, unregister_export_target

    @register_export_target
    class Csv(ExportTarget):
        name = "csv"
        suffix = ".csv"
        summary = "layer,format lines"
        options = (Option("--sep", help="the separator (default ',')", purpose="it separates a layer from its format"),)

        def write(self, policy, out, *, source="a policy", sep=",", **options):
            rows = [f"{name}{sep}{fmt.value}" for name, fmt in policy.layers.items() if name]
            out.write_text("\n".join([f"layer{sep}format", *rows]) + "\n", encoding="utf-8")
            return ["the model root: a csv has no row for it"] if "" in policy.layers else []

    yield Csv
    unregister_export_target("csv")
    assert "csv" not in exporting.TARGETS


exporting = importlib.import_module("autoprec.tune.export")  # the package (its `export` is the function)
BUILT_IN = ("torchao", "torchtitan", "megatron", "megatron-precision", "transformer-engine")


def test_a_target_registered_from_outside_autoprec_is_offered_and_written_by_the_export_verb(tmp_path, capsys, csv_target):
    POLICY.save(tmp_path / "policy.json")
    assert exporting.TARGETS == (*BUILT_IN, "csv") and exporting.SUFFIXES["csv"] == ".csv"
    with pytest.raises(SystemExit):
        main(["export", "--help"])
    usage = " ".join(capsys.readouterr().out.split())
    assert f"--to {{{','.join(BUILT_IN)},csv}}" in usage and "csv: layer,format lines" in usage
    assert ".csv for csv" in usage and "--sep SEP csv: the separator" in usage
    assert main(["export", str(tmp_path / "policy.json"), "--to", "csv"]) == 0  # beside the policy, with its suffix
    assert capsys.readouterr().out.splitlines() == [f"wrote {tmp_path / 'policy_csv.csv'}",
                                                    "not expressed: the model root: a csv has no row for it"]  # fmt: skip
    assert (tmp_path / "policy_csv.csv").read_text().splitlines() == [
        "layer,format", "a,fp8", "b,fp8-rowwise", "c,bf16", "d,fp32", "e.0,fp8"]  # fmt: skip
    assert main(["export", str(tmp_path / "policy.json"), "--to", "csv", "--sep", ";", "--out", str(tmp_path / "x.csv")]) == 0
    assert (tmp_path / "x.csv").read_text().splitlines()[1] == "a;fp8"
    # its option is its own: refused for another target as megatron's --num-layers is for it
    assert main(["export", str(tmp_path / "policy.json"), "--to", "torchao", "--sep", ";"]) == 2
    assert "--sep is for --to csv (it separates a layer from its format), not --to torchao" in capsys.readouterr().err
    assert main(["export", str(tmp_path / "policy.json"), "--to", "csv", "--num-layers", "4"]) == 2
    assert "--num-layers is for --to megatron (it counts the bf16 layers at the end), not --to csv" in capsys.readouterr().err


def test_the_registry_refuses_a_name_already_taken_and_keeps_the_first(csv_target):
    from autoprec.tune.export import export_target_named, register_export_target

    with pytest.raises(
        ValueError, match=r"export target 'csv' is already registered \(by .*\.Csv\); unregister_export_target\('csv'\)"
    ):
        register_export_target(type("OtherCsv", (csv_target,), {}))
    with pytest.raises(ValueError, match="export target 'torchao' is already registered .*give MyTorchao another name"):
        register_export_target(type("MyTorchao", (csv_target,), {"name": "torchao"}))
    assert (
        type(export_target_named("csv")) is csv_target
        and type(export_target_named("torchao")).__module__ == "autoprec.tune.export.torchao"
    )
    with pytest.raises(ValueError, match="name 'CSV!' must be lowercase"):
        register_export_target(type("Bad", (csv_target,), {"name": "CSV!"}))
    clash = (exporting.Option("--num-layers", help="rows", purpose="mine"),)
    with pytest.raises(ValueError, match="option --num-layers differs from the one export target 'megatron' takes"):
        register_export_target(type("Rows", (csv_target,), {"name": "rows", "options": clash}))
    assert exporting.TARGETS == (*BUILT_IN, "csv")  # nothing refused was registered


@pytest.mark.parametrize("target", ["torchao", "torchtitan"])
def test_a_layer_kept_in_fp32_inside_a_bf16_root_is_said_by_the_fp8_only_targets_too(tmp_path, target):
    """torchao's and torchtitan's files leave the bf16 root to autocast (or torchtitan's mixed-precision dtype),
    which runs an unconverted fp32 layer in bf16 too: said, as the other targets say it, and as verify reports it."""
    left_out = export(Policy(layers={"": "bf16", "a": "fp8-rowwise", "output": "fp32"}), target, tmp_path / "x.py")
    assert any(line.startswith("layer 'output' runs in fp32 inside a bf16 model root") for line in left_out), left_out
    assert not any("fp32" in line for line in export(Policy(layers={"a": "fp8-rowwise", "b": "fp32"}), target, tmp_path / "y"))
