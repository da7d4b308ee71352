"""autoprec/tune/_core/_space.py: the search-space YAML, its errors, and which modules are tunable layers."""

from __future__ import annotations

import dataclasses
import shlex
import sys
import textwrap
from pathlib import Path

import pytest
from torch import nn

from autoprec.errors import UserError
from autoprec.formats import Format
from autoprec.tune._cli import build_parser
from autoprec.tune._core._space import LossScaleRange, SearchSpace, load_space, space_from_dict

REPO = Path(__file__).resolve().parents[1]
SHIPPED = sorted((REPO / "search_spaces").glob("*.y*ml"))
FP32, BF16, FP16, FP8 = Format.FP32, Format.BF16, Format.FP16, Format.FP8


def write_space(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "space.yaml"
    path.write_text(textwrap.dedent(text), encoding="utf-8")
    return path


def space_error(path: Path) -> str:
    with pytest.raises(UserError) as info:
        load_space(path)
    msg = str(info.value)
    assert str(path) in msg, msg
    return msg


# What default.yaml offers an nn.Linear: the whole-layer formats, then fp8 per GEMM
LINEAR = (FP32, BF16, FP16, FP8, Format.FP8_ROWWISE, Format.FP8_ROWWISE_GW_HP,
          Format.FP8_FWD, Format.FP8_FWD_DGRAD, Format.FP8_ROWWISE_FWD, Format.FP8_ROWWISE_FWD_DGRAD)  # fmt: skip


# ---- loading -----------------------------------------------------------------------------------


def test_load_space_default():
    space = load_space()
    assert space.layers["Linear"] == LINEAR
    assert space.layers["Conv2d"] == (FP32, BF16, FP16)
    assert FP8 not in space.layers["MultiheadAttention"]
    assert space.default == (FP32, BF16)
    assert space.sampler == "tpe" and space.trials >= 1
    assert space.source == "default.yaml"
    ls = space.loss_scale  # every GradScaler setting is searched, static scaling included
    assert ls.dynamic == (True, False) and len(ls.growth_factor) > 1 and len(ls.backoff_factor) > 1


def test_load_space_default_matches_the_repository_file():
    assert load_space(REPO / "search_spaces" / "default.yaml").layers == load_space().layers


def test_load_space_default_from_a_source_checkout_without_the_installed_package(monkeypatch):
    # autoprec run uninstalled from a checkout (PYTHONPATH=the checkout, as on the GPU machine) has no package
    # autoprec.search_spaces (pyproject maps it from search_spaces/ at install): the checkout's file is the default
    monkeypatch.setitem(sys.modules, "autoprec.search_spaces", None)  # importing it now raises ModuleNotFoundError
    space = load_space()
    assert space == dataclasses.replace(load_space(REPO / "search_spaces" / "default.yaml"), source="default.yaml")


def test_load_space_custom(tmp_path):
    path = write_space(
        tmp_path,
        """\
        default: [fp32]
        layers:
          Linear: [fp32, bf16]
          Conv2d: [FP32, fp16]      # case-insensitive
        loss_scale:
          init_scale_log2: [8, 12]
          growth_interval: [100]
          growth_factor: [2, 4.0]
          backoff_factor: [0.5, 0.25]
          dynamic: [true, false]
        prune:
          slower_than: 1.5
        sampler: random
        trials: 7
        """,
    )
    space = load_space(path)
    assert space.layers == {"Linear": (FP32, BF16), "Conv2d": (FP32, FP16)}
    assert space.default == (FP32,)
    assert space.loss_scale == LossScaleRange(
        init_scale_log2=(8, 12), growth_interval=(100,), growth_factor=(2, 4.0), backoff_factor=(0.5, 0.25), dynamic=(True, False)
    )
    assert space.prune_slower_than == 1.5
    assert (space.sampler, space.trials, space.source) == ("random", 7, str(path))


def test_load_space_minimal_uses_defaults(tmp_path):
    space = load_space(write_space(tmp_path, "layers:\n  Linear: [fp32, fp8]\n"))
    assert space.layers == {"Linear": (FP32, FP8)}
    assert space.default == (FP32, BF16)
    assert space.loss_scale == LossScaleRange()
    assert (space.sampler, space.trials, space.prune_slower_than) == ("tpe", 30, 1.25)


# ---- errors ------------------------------------------------------------------------------------

SPACE_ERRORS = {
    "unknown-top-level-key": ("layers: {Linear: [fp32]}\ntrails: 5\n", ["unknown key 'trails'", "allowed keys", "trials"]),
    "unknown-module-type": ("layers: {Linr: [fp32, bf16]}\n", ["unknown module type 'Linr'", "Linear"]),
    "not-a-module": ("layers: {Parameter: [fp32]}\n", ["unknown module type 'Parameter'"]),
    "unknown-format": ("layers: {Linear: [fp32, fp4]}\n", ["layers.Linear", "'fp4'", "fp32, bf16, fp16, fp8"]),
    "empty-format-list": ("layers: {Linear: []}\n", ["layers.Linear must be a non-empty list"]),
    "format-not-a-list": ("layers: {Linear: fp32}\n", ["layers.Linear must be a non-empty list"]),
    "no-layers": ("trials: 3\n", ["layers must map torch.nn class names"]),
    "empty-file": ("", ["must be a mapping"]),
    "not-a-mapping": ("- Linear\n", ["must be a mapping"]),
    "invalid-yaml": (  # one line, where and what, not PyYAML's lines quoting "<unicode string>"
        "layers:\n  Linear: [fp32, bf16\n",
        ["not valid YAML at line 3, column 1: expected ',' or ']', but got '<stream end>' (while parsing a flow sequence)"],
    ),
    "yaml-control-character": (
        "layers:\n  Linear: [fp32\x07]\n",
        ["not valid YAML at line 2, column 16: character #x0007 (special characters are not allowed)"],
    ),
    "bad-sampler": ("layers: {Linear: [fp32]}\nsampler: grid\n", ["sampler must be one of tpe, random", "'grid'"]),
    "trials-zero": ("layers: {Linear: [fp32]}\ntrials: 0\n", ["trials must be >= 1"]),
    "trials-not-a-number": ("layers: {Linear: [fp32]}\ntrials: many\n", ["many"]),
    "default-fp8": ("layers: {Linear: [fp32]}\ndefault: [fp32, fp8]\n", ["default", "cannot be fp8"]),
    "prune-unknown": ("layers: {Linear: [fp32]}\nprune: {slower: 2}\n", ["prune: unknown key", "slower_than"]),
    "prune-below-one": ("layers: {Linear: [fp32]}\nprune: {slower_than: 0.5}\n", ["prune.slower_than must be >= 1.0"]),
    "loss-scale-unknown": (
        "layers: {Linear: [fp32]}\nloss_scale: {init_scale: 5}\n",
        ["loss_scale: unknown key 'init_scale'", "growth_factor", "backoff_factor"],
    ),
    "loss-scale-range": (
        "layers: {Linear: [fp32]}\nloss_scale: {init_scale_log2: [20, 10]}\n",
        ["loss_scale.init_scale_log2", "[20, 10]"],
    ),
    "loss-scale-interval": (
        "layers: {Linear: [fp32]}\nloss_scale: {growth_interval: [0]}\n",
        ["loss_scale.growth_interval must be a list of integers >= 1"],
    ),
    "loss-scale-growth-factor": (
        "layers: {Linear: [fp32]}\nloss_scale: {growth_factor: [2.0, 1.0]}\n",
        ["loss_scale.growth_factor must be a non-empty list of numbers > 1", "[2.0, 1.0]"],
    ),
    "loss-scale-backoff-factor": (
        "layers: {Linear: [fp32]}\nloss_scale: {backoff_factor: [0.5, 1.5]}\n",
        ["loss_scale.backoff_factor must be a non-empty list of numbers in (0, 1)", "1.5"],
    ),
    "loss-scale-not-a-list": (
        "layers: {Linear: [fp32]}\nloss_scale: {growth_factor: 2.0}\n",
        ["loss_scale.growth_factor must be a list", "2.0"],
    ),
    "loss-scale-init-not-integers": (
        "layers: {Linear: [fp32]}\nloss_scale: {init_scale_log2: [10.5, 20]}\n",
        ["loss_scale.init_scale_log2 must be [low, high] integers"],
    ),
    "loss-scale-dynamic": (
        "layers: {Linear: [fp32]}\nloss_scale: {dynamic: [maybe]}\n",
        ["loss_scale.dynamic must be a list of true/false"],
    ),
}


@pytest.mark.parametrize("case", list(SPACE_ERRORS))
def test_load_space_errors(tmp_path, case):
    text, expected = SPACE_ERRORS[case]
    msg = space_error(write_space(tmp_path, text))
    assert "\n" not in msg  # the CLI prints it as one line
    for part in expected:
        assert part in msg


# A list's fallback is the goal's to require, at search time (Goal.check_space): fp32 for the measured goals, fp32 or
# bf16 for the FLOP goal, whose estimate's baseline is bf16
NO_FALLBACK = {
    "no-fp32": ("layers: {Linear: [bf16, fp16]}\n", "layers.Linear must include fp32 (the fallback every layer needs), "
                "got ['bf16', 'fp16']"),
    "default-no-fp32": ("layers: {Linear: [fp32]}\ndefault: [bf16]\n", "default must include fp32 (the fallback every "
                        "layer needs), got ['bf16']"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(NO_FALLBACK))
def test_a_list_without_fp32_loads_and_a_measured_goal_refuses_it_naming_the_list(tmp_path, case):
    from autoprec.tune._decide._goals import MEMORY, SPEED

    text, said = NO_FALLBACK[case]
    path = write_space(tmp_path, text)
    space = load_space(path)
    for goal in (SPEED, MEMORY):
        with pytest.raises(ValueError) as info:
            goal.check_fallbacks(space)
        assert str(info.value) == f"{path}: {said}"


def test_the_flop_goal_takes_bf16_as_a_lists_fallback_and_names_the_fix_where_neither_is_there(tmp_path):
    from autoprec.tune._decide._flops import FLOPS

    space = load_space(write_space(tmp_path, "layers: {Linear: [bf16, mxfp8, nvfp4]}\ndefault: [bf16]\n"))
    FLOPS.check_fallbacks(space)
    assert FLOPS.fallback(space.layers["Linear"]) is BF16 and FLOPS.fallback((FP32, BF16)) is FP32
    net = Net()
    assert set(FLOPS.layer_fallbacks(space, net).values()) == {BF16}
    bad = load_space(write_space(tmp_path, "layers: {Linear: [fp32, bf16]}\ndefault: [fp16]\n"))
    with pytest.raises(ValueError, match=r"default must include fp32 or bf16 \(the fallback every layer needs under "
                       r"--objective flops\), got \['fp16'\]; add fp32 to it"):  # fmt: skip
        FLOPS.check_fallbacks(bad)


def test_load_space_missing_file(tmp_path):
    assert "no such search-space file" in space_error(tmp_path / "nope.yaml")


def test_search_space_in_code_validates():
    with pytest.raises(ValueError, match="unknown module type 'Lstm'"):
        SearchSpace(layers={"Lstm": (FP32,)})
    with pytest.raises(ValueError, match="sampler must be one of tpe, random"):
        SearchSpace(layers={"Linear": (FP32,)}, sampler="cmaes")


# ---- tunable layers ----------------------------------------------------------------------------


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.attn = nn.MultiheadAttention(16, 2)  # holds out_proj, an nn.Linear subclass
        self.norm = nn.LayerNorm(16)
        self.block = nn.Sequential(nn.Conv1d(16, 16, 3), nn.ReLU(), nn.Linear(16, 16))
        self.head = nn.Linear(16, 4)


def test_tunable_layers_outermost_in_model_order():
    layers = load_space().tunable_layers(Net())
    assert list(layers) == ["embed", "attn", "block.0", "block.2", "head"]
    assert "attn.out_proj" not in layers
    assert layers["embed"] == LINEAR
    assert layers["attn"] == (FP32, BF16, FP16)
    assert layers["block.0"] == (FP32, BF16, FP16)


def test_tunable_layers_inner_linear_without_attention_in_space():
    space = SearchSpace(layers={"Linear": (FP32, BF16)})
    assert list(space.tunable_layers(Net())) == ["embed", "attn.out_proj", "block.2", "head"]


def test_tunable_layers_model_itself_is_never_a_layer():
    space = SearchSpace(layers={"Linear": (FP32, BF16)})
    assert space.tunable_layers(nn.Linear(4, 4)) == {}
    assert space.offered(nn.ReLU()) is None
    assert space.offered(nn.Linear(2, 2)) == (FP32, BF16)


# ---- shipped YAML files ------------------------------------------------------------------------


def test_search_spaces_are_shipped():
    assert SHIPPED, "no YAML under search_spaces/"


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_shipped_space_starts_with_its_command_and_loads(path):
    first = path.read_text(encoding="utf-8").splitlines()[0]
    assert first.startswith("# autoprec "), f"{path.name} must start with '# autoprec ...', got {first!r}"
    argv = shlex.split(first[len("# autoprec ") :])
    args = build_parser().parse_args(argv)  # a command the CLI accepts (parsed only, not run)
    if getattr(args, "space", None):
        assert (REPO / args.space).resolve() == path.resolve()
    if getattr(args, "model", None):
        assert (REPO / args.model).is_file(), f"{path.name}: the command's model {args.model} does not exist"
    assert load_space(path).layers


def test_a_class_by_import_path_matches_where_it_is_defined_or_re_exported_and_subclasses_too():
    from torch import nn

    from autoprec.tune._core._space import is_instance

    class Custom(nn.Linear):  # a subclass of a listed class is that type
        pass

    assert is_instance(nn.Linear(2, 2), "torch.nn.Linear") and is_instance(Custom(2, 2), "torch.nn.modules.linear.Linear")
    assert is_instance(Custom(2, 2), "torch.nn.Linear") and not is_instance(nn.Conv1d(1, 1, 1), "torch.nn.Linear")
    assert not is_instance(nn.Linear(2, 2), "not_a_package_here.Linear")  # a package not installed matches nothing
    transformers = pytest.importorskip("transformers")
    from transformers.pytorch_utils import Conv1D

    layer = Conv1D(4, 2)
    assert is_instance(layer, "transformers.pytorch_utils.Conv1D") and is_instance(layer, "transformers.Conv1D") is hasattr(
        transformers, "Conv1D"
    )


def test_excluded_modules_and_everything_inside_them_are_not_layers():
    from torch import nn

    model = nn.Sequential()
    model.add_module("encoder", nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)))
    model.add_module("pooler", nn.Sequential(nn.Linear(4, 4)))
    model.add_module("head", nn.Linear(4, 2))
    space = space_from_dict({"layers": {"Linear": ["fp32", "bf16"]}, "exclude": ["pooler", "*.1"]})
    assert list(space.tunable_layers(model)) == ["encoder.0", "head"]  # pooler.0 sits inside pooler
    more = space.with_excludes(["head"], model)
    assert list(more.tunable_layers(model)) == ["encoder.0"] and more.exclude == ("pooler", "*.1", "head")
    with pytest.raises(ValueError, match=r"exclude 'poolr' matches no module of the model \(its modules include encoder"):
        space.with_excludes(["poolr"], model)
    for bad in ("pooler", [3], [""]):
        with pytest.raises(ValueError, match="exclude must be a list of module-name patterns"):
            space_from_dict({"layers": {"Linear": ["fp32"]}, "exclude": bad})


def test_a_tunable_module_whose_name_a_policy_cannot_hold_is_refused_by_name_before_anything_runs():
    """A ModuleDict key may be any string; a policy file names layers by module paths (policy.MODULE_PATH)."""
    from torch import nn

    model = nn.Module()
    model.d = nn.ModuleDict({"a b": nn.Linear(4, 4), "conv-1": nn.Linear(4, 4)})
    space = space_from_dict({"layers": {"Linear": ["fp32", "bf16"]}})
    with pytest.raises(UserError, match=r"module 'd.a b' of the model: .* --exclude 'd.a b'"):
        space.tunable_layers(model)
    assert list(space.with_excludes(["d.a b"], model).tunable_layers(model)) == ["d.conv-1"]


def billion_laughs(levels: int = 9) -> str:
    """`exclude:` as a list of aliases of aliases: ten 'lol's, each level ten of the one before (10**levels in all)."""
    lines = [
        "layers: {Linear: [fp32, bf16]}",
        "exclude:",
        '  - &l0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]',
    ]
    lines += [f"  - &l{i} [{', '.join([f'*l{i - 1}'] * 10)}]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("levels", [6, 9])
def test_a_yaml_alias_bomb_is_one_line_before_anything_is_built(tmp_path, monkeypatch, levels):
    import autoprec.tune._core._space as space_module

    def built(*args, **kwargs):
        raise AssertionError("a space was built from the bomb")  # before: every walk over it took gigabytes and hours

    monkeypatch.setattr(space_module, "space_from_dict", built)
    path = write_space(tmp_path, billion_laughs(levels))
    msg = space_error(path)
    assert "more than 100000 values once its aliases are expanded" in msg and "\n" not in msg and len(msg) < 400


def test_aliases_that_stay_small_and_an_alias_inside_itself_are_read_as_before_or_refused(tmp_path):
    path = write_space(tmp_path, "layers: {Linear: &f [fp32, bf16], Conv2d: *f}\nexclude: &e [pooler]\n")
    assert load_space(path).layers == {"Linear": (FP32, BF16), "Conv2d": (FP32, BF16)}
    msg = space_error(write_space(tmp_path, "layers: {Linear: [fp32]}\nexclude: &e [pooler, *e]\n"))
    assert "the alias *e is inside what it names" in msg


@pytest.mark.parametrize("depth", [33, 5000])
def test_a_space_file_nested_too_deep_is_one_line(tmp_path, depth):
    # 5000 levels: once a RecursionError traceback out of PyYAML's composer
    path = write_space(tmp_path, "layers: {Linear: [fp32]}\nexclude: " + "[" * depth + "]" * depth + "\n")
    msg = space_error(path)
    assert "nested deeper than 32 levels (line 2)" in msg and "\n" not in msg
    nested = "layers: {Linear: [fp32]}\nexclude: " + "[" * 30 + "]" * 30 + "\n"  # deep, within the bound: read
    assert "exclude must be a list of module-name patterns" in space_error(write_space(tmp_path, nested))


def test_a_space_file_larger_than_any_search_space_is_refused_unread(tmp_path):
    path = write_space(tmp_path, "layers: {Linear: [fp32, bf16]}\n")
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(("# " + "x" * 1000 + "\n") * 1100)  # over 1 MiB of comments: valid YAML, loaded before
    msg = space_error(path)
    assert "over 1048576 bytes, too large for a search-space file" in msg
