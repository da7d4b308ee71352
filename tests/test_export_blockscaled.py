"""The blockscaled formats (mxfp8, nvfp4 and their per-GEMM mixes) in the exports that configure them (issue 40,
section 3): torchtitan's MXFP8/NVFP4 converters, Transformer Engine's CustomRecipe, Megatron's per-module
--te-precision-config-file. Each file is read back by the tool's own parser where it installs on a CPU (torchtitan's
converters, Megatron-core's RecipeConfig and TEQuantizationParams), else (Transformer Engine: it needs CUDA) by
reading its table back as a literal and running its factory against stand-ins of TE's quantizer classes."""

import ast
import copy
import fnmatch
import importlib.util
import sys
import types

import pytest
import yaml
from builders import te_installed
from test_export import HOSTILE, code_shape, printable_lines, sneaked  # noqa: I001  the shared hostile-name checks

from autoprec import Policy
from autoprec.formats import Format
from autoprec.tune.export import export


def left(lines):
    """The export's lines less its notes ("note: ": the Transformer Engine version and environment a file needs)."""
    return [line for line in lines if not line.startswith("note: ")]


def load(path, name="exported_blockscaled"):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# --- torchtitan: its own converters convert exactly the include list's Linears ---

ROLES = ("attention.qkv_linear.wqkv", "attention.wo", "feed_forward.w1", "feed_forward.w2", "feed_forward.w3")


@pytest.fixture
def titan12(monkeypatch):
    """torchtitan's llama3 debug model config grown to 12 layers (so that layers.1 and layers.10 both exist), and its
    MXFP8/NVFP4 converters with the capability check answered yes (the conversion itself is of configs)."""
    llama3 = pytest.importorskip("torchtitan.models.llama3", reason="torchtitan needs Python 3.11 (the test extra has it)")
    import torchtitan.components.quantization.mx as mx
    import torchtitan.components.quantization.nvfp4 as nv
    from torch._inductor import config as inductor

    saved = inductor.get_config_copy()
    for module in (mx, nv):
        monkeypatch.setattr(module, "has_cuda_capability", lambda *args: True)
    model = llama3.model_registry("debugmodel").model
    model.layers = list(model.layers) + [copy.deepcopy(model.layers[0]) for _ in range(12 - len(model.layers))]
    yield model, mx, nv
    inductor.load_config(saved)


def titan_converted(model_config, converters, mx, nv):
    """fqn -> "mxfp8"/"nvfp4" for the Linears torchtitan's own converters convert."""
    from torchtitan.models.common.linear import Linear

    for config in converters:
        cls = mx.MXFP8LinearConverter if isinstance(config, mx.MXFP8LinearConverter.Config) else nv.NVFP4LinearConverter
        model_config = cls(config).convert(model_config)
    kinds = {mx.MXFP8Linear.Config: "mxfp8", nv.NVFP4Linear.Config: "nvfp4"}
    return {fqn: kinds[type(c)] for fqn, c, _, _ in model_config.traverse(Linear.Config) if type(c) in kinds}


def test_torchtitans_include_lists_select_exactly_the_policys_layers_layers_1_not_layers_10(tmp_path, titan12):
    model, mx, nv = titan12
    layers = {f"layers.1.{role}": "mxfp8" for role in ROLES}  # a whole block: its prefix, with the trailing dot
    layers |= {"layers.10.feed_forward.w1": "nvfp4", "layers.10.feed_forward.w3": "nvfp4"}  # part of a block
    layers |= {"layers.11.attention.wo": "mxfp8-fwd-dgrad", "layers.2.attention.wo": "bf16"}
    left_out = export(Policy(layers=layers), "torchtitan", tmp_path / "t.py")
    exported = load(tmp_path / "t.py")
    assert exported.include_fqns(model, "mxfp8") == ["layers.1."]
    assert exported.include_fqns(model, "nvfp4") == ["layers.10.feed_forward.w1", "layers.10.feed_forward.w3"]
    converters = exported.blockscaled_converters(model)
    assert [type(c) for c in converters] == [mx.MXFP8LinearConverter.Config, nv.NVFP4LinearConverter.Config]
    converted = titan_converted(model, converters, mx, nv)
    assert converted == {n: f for n, f in layers.items() if f in ("mxfp8", "nvfp4")}  # no layers.10.* in mxfp8
    assert exported.float8_converters(model) == []
    assert (
        "layer 'layers.11.attention.wo' runs in mxfp8-fwd-dgrad (fprop mxfp8, dgrad mxfp8, wgrad high precision)" in left_out[1]
    )
    assert "no per-GEMM switch" in left_out[1] and "blockscaled_converters() converts" in left_out[-1]


def test_torchtitans_include_list_is_refused_where_a_name_would_select_another_linear(tmp_path):
    export(Policy(layers={"e.0": "nvfp4"}), "torchtitan", tmp_path / "t.py")
    sys.modules.setdefault("torchtitan", pytest.importorskip("torchtitan"))
    exported = load(tmp_path / "t.py")

    class Config:  # 'e.0' has no block prefix and is a substring of 'e.01'
        def traverse(self, _cls):
            return iter([("e.0", None, None, None), ("e.01", None, None, None)])

    with pytest.raises(ValueError, match=r"would also convert \['e.01'\]: this layer set cannot be written"):
        exported.include_fqns(Config(), "nvfp4")


def test_a_policy_without_mxfp8_or_nvfp4_layers_gives_torchtitan_no_blockscaled_converter(tmp_path):
    pytest.importorskip("torchtitan")
    left_out = export(Policy(layers={"a": "nvfp4-fwd"}), "torchtitan", tmp_path / "t.py")
    assert load(tmp_path / "t.py").blockscaled_converters(None) == []  # never an empty include list: it converts all
    assert "nvfp4-fwd" in left_out[0] and left_out[-1].endswith("returns []")


# --- Transformer Engine: the table read back as a literal, the factory run against TE's classes' stand-ins ---

MIXED = {"blocks.0.qkv": "mxfp8", "blocks.0.fc1": "nvfp4", "blocks.1.fc1": "mxfp8-fwd-nvfp4-dgrad",
         "blocks.1.fc2": "nvfp4-fwd", "blocks.2.fc1": "mxfp8-fwd-dgrad", "blocks.2.fc2": "fp8", "head": "bf16"}  # fmt: skip


def te_table(path):
    """The file's GEMMS table, by ast.literal_eval of its literal (the file is not imported)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    [table] = [n.value for n in tree.body if isinstance(n, ast.Assign) and n.targets[0].id == "GEMMS"]
    return ast.literal_eval(table)


def test_the_transformer_engine_file_holds_the_table_and_the_builder_only(tmp_path):
    lines = export(Policy(layers=MIXED), "transformer-engine", tmp_path / "te.py")
    left_out = left(lines)
    tree = ast.parse((tmp_path / "te.py").read_text(encoding="utf-8"))
    names = [t.id for n in tree.body if isinstance(n, ast.Assign) for t in n.targets]
    names += [n.name for n in tree.body if isinstance(n, ast.FunctionDef)]
    assert names == ["GEMMS", "ENVIRONMENT", "quantizer_factory", "quantizer_for", "require_transformer_engine", "custom_recipe"]
    assert all(isinstance(n, (ast.Expr, ast.Assign, ast.FunctionDef)) for n in tree.body)  # no top-level import
    expected = {name: tuple(None if g == "fp32" else g for g in Format(f).family.gemm_precisions(Format(f)))
                for name, f in MIXED.items() if Format(f).family.name == "blockscaled"}  # fmt: skip
    assert te_table(tmp_path / "te.py") == expected
    assert expected["blocks.1.fc1"] == ("mxfp8", "nvfp4", None) and expected["blocks.1.fc2"] == ("nvfp4", None, None)
    assert left_out == [
        "layer 'blocks.2.fc2' runs in fp8: this file writes the mxfp8/nvfp4 formats only (use --to megatron-precision "
        "or --to torchao for fp8); the recipe runs it in high precision",
        "layer 'head' runs in bf16: the recipe runs every layer it does not list in the model's own dtype, which this "
        "file does not set",
    ]
    # what the file needs, said in its comments and the export's lines: TE 2.19 (HybridQuantizer), its environment
    text = (tmp_path / "te.py").read_text(encoding="utf-8")
    assert lines[len(left_out)].startswith("note: needs Transformer Engine 2.19 or later (HybridQuantizer, IdentityQuantizer")
    assert lines[-1].endswith("checked by `autoprec verify`: NVTE_BACKWARD_OVERRIDE unset") and len(lines) == len(left_out) + 2
    assert "# needs Transformer Engine 2.19 or later" in text and "#   - NVTE_BACKWARD_OVERRIDE: unset (" in text
    [environment] = [n.value for n in tree.body if isinstance(n, ast.Assign) and n.targets[0].id == "ENVIRONMENT"]
    assert ast.literal_eval(environment) == {"NVTE_BACKWARD_OVERRIDE": None}


@pytest.fixture
def te_stub(monkeypatch):
    """Stand-ins for the TE names the file uses: each quantizer records what it was built with."""

    class Q:
        def __init__(self, kind, **given):
            self.kind, self.given = kind, given

        def __eq__(self, other):
            return (self.kind, self.given) == (other.kind, other.given)

        def __repr__(self):
            return f"{self.kind}{self.given or ''}"

    modules = {}
    for path in ("transformer_engine", "transformer_engine.pytorch", "transformer_engine.pytorch.custom_recipes",
                 "transformer_engine.pytorch.custom_recipes.quantizer_factories", "transformer_engine.common",
                 "transformer_engine.common.recipe"):  # fmt: skip
        modules[path] = types.ModuleType(path)
        monkeypatch.setitem(sys.modules, path, modules[path])
    te = modules["transformer_engine.pytorch"]
    te.IdentityQuantizer = lambda: Q("hp")
    te.HybridQuantizer = lambda **given: Q("hybrid", **given)
    factories = modules["transformer_engine.pytorch.custom_recipes.quantizer_factories"]
    factories.mxfp8_factory = lambda role: Q("mxfp8")
    factories.nvfp4_factory = lambda role: Q("nvfp4")
    modules["transformer_engine.common.recipe"].CustomRecipe = lambda qfactory: ("CustomRecipe", qfactory)
    te_installed(monkeypatch, "2.19.0")
    return Q


def test_the_transformer_engine_factory_gives_each_gemms_operands_its_format(tmp_path, te_stub):
    Q = te_stub
    export(Policy(layers=MIXED), "transformer-engine", tmp_path / "te.py")
    exported = load(tmp_path / "te.py")
    role = types.SimpleNamespace
    hp, mx, nv = Q("hp"), Q("mxfp8"), Q("nvfp4")

    def slots(name):
        return [exported.quantizer_factory(role(module_type="linear", tensor_type=t, name=name))
                for t in ("input", "weight", "grad_output")]  # fmt: skip

    def hybrid(row, col):
        return Q("hybrid", rowwise_quantizer=row, columnwise_quantizer=col, columnwise_source="original")

    assert slots("blocks.0.qkv") == [mx, mx, mx] and slots("blocks.0.fc1") == [nv, nv, nv]
    # fprop mxfp8, dgrad nvfp4, wgrad high: input fprop|wgrad, weight fprop|dgrad, grad_output dgrad|wgrad
    assert slots("blocks.1.fc1") == [hybrid(mx, hp), hybrid(mx, nv), hybrid(nv, hp)]
    assert slots("blocks.1.fc2") == [hybrid(nv, hp), hybrid(nv, hp), hp]  # forward only
    assert slots("blocks.2.fc1") == [hybrid(mx, hp), mx, hybrid(mx, hp)]  # wgrad high precision
    assert slots("blocks.2.fc2") == slots("head") == slots("unlisted") == [hp, hp, hp]
    assert exported.quantizer_factory(None) == hp
    assert exported.quantizer_factory(role(module_type="linear", tensor_type="output", name="blocks.0.qkv")) == hp
    assert exported.quantizer_factory(role(module_type="dpa", tensor_type="qkv", name="blocks.0.qkv")) == hp
    assert exported.custom_recipe() == ("CustomRecipe", exported.quantizer_factory)


def test_megatrons_custom_recipe_factory_gives_each_gemms_operands_its_format(tmp_path, te_stub):
    """The factory module --to megatron-precision writes beside its YAML: Megatron calls one mix's factory for every
    slot of the module the YAML matched, so it reads no name; a slot without a role is high precision."""
    Q = te_stub
    export(
        Policy(layers={"blocks.1.fc1": "mxfp8-fwd-nvfp4-dgrad", "blocks.2.fc": "nvfp4-fwd"}),
        "megatron-precision",
        tmp_path / "m.yaml",
    )
    factories = load(tmp_path / "m_qfactory.py", "m_qfactory")
    role = types.SimpleNamespace
    hp, mx, nv = Q("hp"), Q("mxfp8"), Q("nvfp4")

    def hybrid(row, col):
        return Q("hybrid", rowwise_quantizer=row, columnwise_quantizer=col, columnwise_source="original")

    def slots(factory):
        return [factory(role(module_type="linear", tensor_type=t, name="")) for t in ("input", "weight", "grad_output")]

    assert slots(factories.mxfp8_fwd_nvfp4_dgrad) == [hybrid(mx, hp), hybrid(mx, nv), hybrid(nv, hp)]
    assert slots(factories.nvfp4_fwd) == [hybrid(nv, hp), hybrid(nv, hp), hp]
    assert factories.nvfp4_fwd(None) == hp


@pytest.mark.parametrize(("version", "said"), [("2.18.0", "Transformer Engine 2.18.0:"), ("1.99", "Transformer Engine 1.99:"),
                                             (None, "Transformer Engine is not installed:")])  # fmt: skip
def test_the_files_refuse_a_transformer_engine_older_than_2_19_naming_the_version_needed(
    tmp_path, te_stub, monkeypatch, version, said
):
    """TE 2.18 (Megatron-Core 0.19's pin) has no HybridQuantizer, IdentityQuantizer or quantizer_factories: the files
    failed on the first slot with an AttributeError or ImportError. The TE file checks in custom_recipe(), the factory
    module when Megatron imports it; both read the version from importlib.metadata only."""
    export(Policy(layers=MIXED), "transformer-engine", tmp_path / "te.py")
    export(Policy(layers={"blocks.1.fc1": "mxfp8-fwd-nvfp4-dgrad"}), "megatron-precision", tmp_path / "m.yaml")
    exported = load(tmp_path / "te.py")
    assert exported.custom_recipe() == ("CustomRecipe", exported.quantizer_factory)  # 2.19.0, from te_stub
    te_installed(monkeypatch, "2.20.2+6ea2a74")
    assert exported.custom_recipe()[0] == "CustomRecipe"
    te_installed(monkeypatch, version)
    with pytest.raises(RuntimeError, match="needs Transformer Engine 2.19 or later") as raised:
        exported.custom_recipe()
    assert str(raised.value).startswith(said) and "Megatron-Core 0.19 pins Transformer Engine 2.18" in str(raised.value)
    with pytest.raises(RuntimeError, match="needs Transformer Engine 2.19 or later"):
        load(tmp_path / "m_qfactory.py", "m_qfactory")


def test_megatron_imports_the_factory_module_only_with_transformer_engine_2_19(tmp_path, monkeypatch):
    """Megatron-Core imports the custom_recipe_factory's module by its dotted path and wraps what the import raises:
    under Megatron-Core 0.19's TE 2.18 its error names the version needed; under 2.19 it resolves."""
    fp8_utils = pytest.importorskip("megatron.core.fp8_utils", reason="megatron-core is not installed (the test extra has it)")
    export(Policy(layers={"blocks.1.fc1": "mxfp8-fwd-nvfp4-dgrad"}), "megatron-precision", tmp_path / "m.yaml")
    monkeypatch.syspath_prepend(str(tmp_path))  # Megatron imports the dotted path from PYTHONPATH
    for version in ("2.18.0", "2.19.0"):
        te_installed(monkeypatch, version)
        sys.modules.pop("m_qfactory", None)  # imported for this test only
        if version == "2.18.0":
            with pytest.raises(ValueError, match="Transformer Engine 2.18.0: this file .* needs Transformer Engine 2.19 or"):
                fp8_utils._resolve_callable_from_python_import_path("m_qfactory.mxfp8_fwd_nvfp4_dgrad")
        else:
            assert callable(fp8_utils._resolve_callable_from_python_import_path("m_qfactory.mxfp8_fwd_nvfp4_dgrad"))
    sys.modules.pop("m_qfactory", None)


@pytest.mark.parametrize("root", ["mxfp8", "nvfp4-fwd"])
def test_a_block_scaled_model_root_is_said_not_written_as_the_name_every_unnamed_te_linear_has(tmp_path, te_stub, root):
    """TE gives a te.Linear built without name= the role name '': the root written as GEMMS[''] ran every such linear
    in the root's format."""
    left_out = left(export(Policy(layers={"": root, "blocks.0.fc1": "nvfp4"}), "transformer-engine", tmp_path / "te.py"))
    assert te_table(tmp_path / "te.py") == {"blocks.0.fc1": ("nvfp4", "nvfp4", "nvfp4")}
    exported, hp = load(tmp_path / "te.py"), te_stub("hp")
    unnamed = [exported.quantizer_factory(types.SimpleNamespace(module_type="linear", tensor_type=t, name=""))
               for t in ("input", "weight", "grad_output")]  # fmt: skip
    assert unnamed == [hp, hp, hp]
    assert len(left_out) == 1 and left_out[0].startswith(f"the model root (every op outside a listed layer) runs in {root}")
    assert "te.Linear built without name= ''" in left_out[0] and f"#   - {left_out[0]}" in (tmp_path / "te.py").read_text()


def test_a_block_scaled_model_root_gives_torchtitan_no_include_name(tmp_path, titan12):
    """'' in an include list matched every fqn (`'' in fqn`): the root is said, its format converts no other Linear."""
    model, mx, nv = titan12
    left_out = export(Policy(layers={"": "mxfp8", "layers.1.attention.wo": "nvfp4"}), "torchtitan", tmp_path / "t.py")
    exported = load(tmp_path / "t.py")
    assert titan_converted(model, exported.blockscaled_converters(model), mx, nv) == {"layers.1.attention.wo": "nvfp4"}
    assert left_out[0].startswith("the model root (every op outside a listed layer) runs in mxfp8, a format of named")


def test_no_text_from_a_policy_becomes_code_in_the_transformer_engine_file(tmp_path, monkeypatch):
    names = {
        HOSTILE: "mxfp8",
        "b\n)\nimport os#": "nvfp4-fwd",
        "d\u2028e\\": "mxfp8-fwd-nvfp4-dgrad",
        "\U0001d465\udcff": "nvfp4",
    }
    export(sneaked({**names, "\x1b]0;title\x07": "bf16"}), "transformer-engine", tmp_path / "hostile.py", source=HOSTILE)
    export(sneaked({f"l{i}": f for i, f in enumerate(names.values())} | {"a": "bf16"}), "transformer-engine",
           tmp_path / "plain.py", source="policy.json")  # fmt: skip
    text = (tmp_path / "hostile.py").read_text(encoding="utf-8")
    assert code_shape(text) == code_shape((tmp_path / "plain.py").read_text(encoding="utf-8"))
    assert printable_lines(text) and "\\x1b]0;title\\x07" in text
    assert list(te_table(tmp_path / "hostile.py")) == list(names)  # exactly the names, as data
    monkeypatch.chdir(tmp_path)
    load(tmp_path / "hostile.py")
    assert not (tmp_path / "pwned").exists()


# --- Megatron: its own RecipeConfig and TEQuantizationParams read the YAML back into the layer -> format table ---


def megatron_formats(path, modules):
    """module path -> what Megatron-core runs it in under the YAML: "mxfp8", "nvfp4", "fp8" (tensorwise), "custom:
    <factory>" (a per-GEMM mix) or "high"."""
    pytest.importorskip("megatron.core", reason="megatron-core is not installed (the test extra has it)")
    from megatron.core.extensions.transformer_engine import TEQuantizationParams
    from megatron.core.quantization.utils import get_quant_config_or_none, load_quantization_recipe

    recipe = load_quantization_recipe(str(path))
    found = {}
    for module in modules:
        training = TEQuantizationParams.parse_from_config(get_quant_config_or_none(module, recipe)).training_recipe
        fp8, fp4 = training.fp8_quantization_recipe, training.fp4_quantization_recipe
        found[module] = {"mxfp8": "mxfp8", "tensorwise": "fp8"}.get(fp8, fp4 or "high")
        if fp8 == "custom":
            found[module] = f"custom: {training.custom_recipe_factory}"
        assert training.override_nonquantized_autocast == (found[module] != "high") and training.override_quantized_autocast
    return found


def test_the_megatron_precision_yaml_runs_each_linear_in_its_policy_format(tmp_path):
    layers = {f"decoder.layers.{i}.mlp.linear_fc1": f for i, f in enumerate(["mxfp8", "nvfp4", "fp8", "mxfp8-fwd"])}
    layers |= {
        "decoder.layers.1.mlp.linear_fc2": "fp8-rowwise",
        "output_layer": "bf16",
        "decoder.layers.10.mlp.linear_fc1": "mxfp8",
    }
    lines = export(Policy(layers={"": "bf16", **layers}), "megatron-precision", tmp_path / "m.yaml")
    left_out = left(lines)
    others = ["decoder.layers.1.mlp.linear_fc10", "decoder.layers.1.self_attention.linear_qkv", "embedding"]
    found = megatron_formats(tmp_path / "m.yaml", [*layers, *others])
    expected = {name: f if f in ("mxfp8", "nvfp4", "fp8") else "high" for name, f in layers.items()}
    expected["decoder.layers.3.mlp.linear_fc1"] = "custom: m_qfactory.mxfp8_fwd"  # Megatron's custom recipe
    assert found == {**expected, **dict.fromkeys(others, "high")}
    content = yaml.safe_load((tmp_path / "m.yaml").read_text())
    assert all(m["enabled"] is True for m in content["matchers"].values())  # Megatron skips a matcher without it
    assert list(content["matchers"].values())[-1]["pattern"] == "*"
    assert [line.split(":")[0] for line in left_out] == [
        "the model root (every op outside a listed layer) runs in bf16", "layer 'output_layer' runs in bf16",
        "layer 'decoder.layers.1.mlp.linear_fc2' runs in fp8-rowwise"]  # fmt: skip
    assert (tmp_path / "m_qfactory.py").exists() and all(
        f"#   - {line}" in (tmp_path / "m.yaml").read_text() for line in left_out
    )
    # the per-GEMM mix needs TE 2.19's HybridQuantizer, which Megatron-Core 0.19's pinned TE 2.18 lacks: said in the
    # YAML's header and the export's lines; the environment its recipes read (tensorwise, mxfp8, nvfp4, custom) recorded
    text = (tmp_path / "m.yaml").read_text()
    notes = lines[len(left_out) :]
    assert notes[0].startswith("note: needs Transformer Engine 2.19 or later") and "Megatron-Core 0.19 pins" in notes[0]
    assert "# Megatron-Core 0.19 pins Transformer Engine 2.18, which has no HybridQuantizer" in text
    assert content["environment"] == {"NVTE_BACKWARD_OVERRIDE": None, "NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES": "0",
        "NVTE_NVFP4_DISABLE_RHT": "0", "NVTE_NVFP4_DISABLE_STOCHASTIC_ROUNDING": "0",
        "NVTE_NVFP4_DISABLE_2D_QUANTIZATION": "0", "NVTE_NVFP4_ROW_SCALED_ACTIVATION": "0", "NVTE_NVFP4_4OVER6": "none"}  # fmt: skip
    assert len(notes) == 2 and all(name in notes[1] for name in content["environment"])
    # without a per-GEMM mix, Megatron's own recipes run: nothing of TE 2.19 is needed, only mxfp8's environment
    lines = export(Policy(layers={"decoder.layers.0.mlp.linear_fc1": "mxfp8"}), "megatron-precision", tmp_path / "n.yaml")
    assert [line for line in lines if "2.19" in line] == [] and not (tmp_path / "n_qfactory.py").exists()
    assert yaml.safe_load((tmp_path / "n.yaml").read_text())["environment"] == {"NVTE_BACKWARD_OVERRIDE": None}


def test_a_name_megatron_never_gives_a_module_is_said_not_matched(tmp_path):
    """'decoder.layers.01.mlp.linear_fc1' (or a non-ASCII digit) names no module of GPTModel.named_modules(), which
    numbers layers str(int): its matcher selected nothing without a word."""
    layers = {"decoder.layers.1.mlp.linear_fc1": "mxfp8", "decoder.layers.01.mlp.linear_fc1": "nvfp4",
              "decoder.layers.\u0662.mlp.linear_fc1": "nvfp4"}  # fmt: skip
    left_out = left(export(Policy(layers=layers), "megatron-precision", tmp_path / "m.yaml"))
    content = yaml.safe_load((tmp_path / "m.yaml").read_text())
    assert [m["pattern"] for m in content["matchers"].values()] == ["decoder.layers.1.mlp.linear_fc1", "*"]
    assert megatron_formats(tmp_path / "m.yaml", ["decoder.layers.1.mlp.linear_fc1"]) == {
        "decoder.layers.1.mlp.linear_fc1": "mxfp8"
    }
    assert left_out == [line for line in left_out if line.startswith("2 layers ('decoder.layers.01.mlp.linear_fc1'")]
    assert len(left_out) == 1 and "no Megatron module has that name" in left_out[0]


def test_a_megatron_pattern_matches_its_layer_only_whatever_the_name_holds(tmp_path):
    names = {"a[0]*?.fc": "mxfp8", "b\n#x: 'y'\u2028": "nvfp4", HOSTILE: "mxfp8"}
    export(sneaked(names), "megatron-precision", tmp_path / "m.yaml", source="p\n- x\x1b[2J.json")
    text = (tmp_path / "m.yaml").read_text(encoding="utf-8")
    assert printable_lines(text) and text.isascii()
    content = yaml.safe_load(text)
    patterns = [m["pattern"] for m in content["matchers"].values()][:-1]
    for name, pattern in zip(names, patterns):
        assert fnmatch.fnmatch(name, pattern) and not fnmatch.fnmatch(name + "x", pattern)
    assert not fnmatch.fnmatch("a0xy.fc", patterns[0])  # its glob characters are escaped
    assert [content["configs"][m["config"]]["training_recipe"] for m in content["matchers"].values()][:-1] == [
        {"fp8_quantization_recipe": "mxfp8", "fp8_format": "e4m3", "override_nonquantized_autocast": True},
        {"fp4_quantization_recipe": "nvfp4", "override_nonquantized_autocast": True},
        {"fp8_quantization_recipe": "mxfp8", "fp8_format": "e4m3", "override_nonquantized_autocast": True}]  # fmt: skip


@pytest.mark.parametrize("target", ["megatron-precision", "transformer-engine"])
def test_a_layer_kept_in_fp32_inside_a_bf16_root_is_said_not_dropped(tmp_path, target):
    """Both tools run a module they have no recipe for in the model's dtype: the searched fp32 protection of `output`
    would be lost without a word (found in review)."""
    left_out = export(Policy(layers={"": "bf16", "a": "mxfp8", "output": "fp32"}), target, tmp_path / "x")
    assert any(line.startswith("layer 'output' runs in fp32 inside a bf16 model root") for line in left_out), left_out
    assert not any("fp32" in line for line in export(Policy(layers={"a": "mxfp8", "b": "fp32"}), target, tmp_path / "y"))


def test_the_megatron_precision_export_never_overwrites_a_factory_module_it_did_not_write(tmp_path, capsys):
    """The factory module's name comes from the YAML's (`x.yaml` -> `x_qfactory.py`), not from an option: a file of
    the user's by that name was replaced without a word. Refused, one line naming it and the fix, nothing written; a
    module an earlier export wrote is replaced as the YAML is."""
    from autoprec.tune._cli import main

    policy = Policy(layers={"decoder.layers.1.mlp.linear_fc1": "mxfp8-fwd"})
    policy.save(tmp_path / "policy.json")
    mine = tmp_path / "x_qfactory.py"
    mine.write_text("def my_work():\n    return 42\n")
    args = ["export", str(tmp_path / "policy.json"), "--to", "megatron-precision", "--out", str(tmp_path / "x.yaml")]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(mine) in err and "autoprec did not write it" in err and "--out" in err, err
    assert mine.read_text() == "def my_work():\n    return 42\n" and not (tmp_path / "x.yaml").exists()
    mine.unlink()
    assert main(args) == 0 and "def mxfp8_fwd(role)" in mine.read_text()
    capsys.readouterr()
    assert main(args) == 0  # its own module, written again
    (tmp_path / "y_qfactory.py").mkdir()  # not a file at all
    assert main([*args[:-1], str(tmp_path / "y.yaml")]) == 2
    assert "y_qfactory.py" in capsys.readouterr().err and not (tmp_path / "y.yaml").exists()
