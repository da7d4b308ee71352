"""The format-family seam (issue 39): a family and its format registered from a test file, without editing
autoprec/, and used by apply_policy, the profile and a search as the built-in ones are."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import timings as timings_module
import torch
from short_timing import TINY

from autoprec import Policy, apply_policy, load_policy
from autoprec.apply import applied_summary
from autoprec.formats import (
    REGISTRY,
    Format,
    FormatFamily,
    caller_precision,
    families,
    format_problem,
    parse_format,
    register_family,
    register_format,
    unregister_family,
    unregister_format,
)
from autoprec.tune import ProfileConfig, SearchConfig, load_task, prepare, profile
from autoprec.tune._core._profile_row import ProfileRow
from autoprec.tune._core._space import space_from_dict
from autoprec.tune._measure import _profiler as profiler_module
from autoprec.tune._measure._choices import build_choices, format_params, params_for, policy_from_params
from autoprec.tune._measure._profile_data import Profile
from autoprec.tune._search._pipeline import search

MODELS = Path(__file__).parent / "models"
TOY = "toy-int8-fakequant"


def fake_int8(t: torch.Tensor) -> torch.Tensor:
    """`t` rounded to int8 with one scale per tensor, kept in its dtype; the gradient passes straight through."""
    scale = t.detach().abs().amax().clamp(min=1e-12) / 127
    return t + ((t / scale).round().clamp(-127, 127) * scale - t).detach()


class ToyInt8Family(FormatFamily):
    """A Linear whose forward fake-quantises its weight and input to int8 per tensor, computed in fp32."""

    name = "toy-int8"

    def module_problem(self, fmt: Format, module: torch.nn.Module) -> str | None:
        if type(module) is not torch.nn.Linear:
            return f"{fmt} covers nn.Linear only, not {type(module).__name__}"
        return None

    def forward(self, fmt, module, inner, device_type, args, kwargs):
        outer = torch.is_autocast_enabled(device_type)
        (x, *rest) = args
        with torch.autocast(device_type, enabled=False):
            out = torch.nn.functional.linear(fake_int8(x.float()), fake_int8(module.weight), module.bias)
        return caller_precision(out, outer)


@pytest.fixture
def toy():
    """The toy family and its format registered for one test; the registries as they were after it."""
    before_formats, before_families = list(REGISTRY), families()
    register_family(ToyInt8Family)
    fmt = register_format(TOY, family="toy-int8", inside="int8 weight and input, one scale each (fake)",
                          fallback=Format.FP32, risky=True, linear_only=True)  # fmt: skip
    yield fmt
    unregister_format(TOY)
    unregister_family("toy-int8")
    assert list(REGISTRY) == before_formats and families() == before_families


def test_a_registered_format_is_a_format_like_the_built_in_ones(toy):
    assert Format(TOY) is toy and parse_format(TOY.upper()) is toy and toy == TOY and str(toy) == TOY
    assert list(Format)[-1] is toy and toy.family.name == "toy-int8" and list(toy.fallbacks()) == [Format.FP32]
    assert format_problem(toy, torch.nn.Conv1d(2, 2, 1), "cpu") == f"{TOY} covers nn.Linear only, not Conv1d"
    assert format_problem(toy, torch.nn.Linear(3, 5), "cpu") is None


def test_unregistered_it_is_no_format_and_the_errors_name_the_choices():
    assert TOY not in [f.value for f in Format]
    with pytest.raises(ValueError, match=r"format must be one of fp32, bf16, .*mxfp8, .*nvfp4, .*, but got 'toy-int8-fakequant'"):
        parse_format(TOY)


def test_a_name_taken_is_refused_with_the_registrys_message(toy):
    with pytest.raises(ValueError, match=r"format 'bf16' is already registered .*unregister_format\('bf16'\) first"):
        register_format("bf16", family="toy-int8", inside="again")
    with pytest.raises(ValueError, match=r"format family 'toy-int8' is already registered \(by .*ToyInt8Family\)"):
        register_family(ToyInt8Family)
    with pytest.raises(ValueError, match="still has formats toy-int8-fakequant"):
        unregister_family("toy-int8")


def test_what_only_a_family_reads_is_the_familys_and_a_fact_it_does_not_take_registers_nothing(toy):
    from autoprec.formats.float8 import Fp8Gemms

    before = list(REGISTRY)
    with pytest.raises(
        ValueError,
        match=r"format family 'toy-int8' takes no autocast: give register_format FormatSpec's fields \(loss_scale, max_value",
    ):
        register_format("toy-int8-bf16", family="toy-int8", inside="again", autocast=torch.bfloat16)
    with pytest.raises(ValueError, match=r"format family 'autocast' takes no gemms"):
        register_format(
            "toy-bf16-gemms", family="autocast", inside="again", autocast=torch.bfloat16, gemms=Fp8Gemms("tensorwise")
        )
    with pytest.raises(
        ValueError, match=r"format 'toy-fp8': gemms must be an Fp8Gemms, such as Fp8Gemms\('tensorwise'\), but got None"
    ):
        register_format("toy-fp8", family="float8", inside="again")
    from autoprec.formats import autocast, float8

    assert list(REGISTRY) == before  # refused whole: neither the spec nor the family's record
    assert "toy-bf16-gemms" not in autocast._DTYPES and "toy-fp8" not in float8._FORMATS
    # a family that kept something before it refused: taken back, and its refusal is the error seen
    kept: dict[str, int] = {}

    class Keeps(ToyInt8Family):
        name = "toy-keeps"

        def add_format(self, fmt, *, bits=8, **facts):
            if bits < 4:  # refused before it kept anything
                raise ValueError(f"{fmt.value}: bits must be 8, not below 4")
            kept[fmt] = bits
            if bits != 8:
                raise ValueError(f"{fmt.value}: bits must be 8")

        def remove_format(self, fmt):
            del kept[fmt]  # a family that forgets only what it kept: the cleanup of a refusal must not mask it

    register_family(Keeps)
    try:
        with pytest.raises(ValueError, match="toy-keeps-4: bits must be 8"):
            register_format("toy-keeps-4", family="toy-keeps", inside="again", bits=4)
        with pytest.raises(ValueError, match="toy-keeps-2: bits must be 8, not below 4"):  # not remove's KeyError
            register_format("toy-keeps-2", family="toy-keeps", inside="again", bits=2)
        assert kept == {} and "toy-keeps-4" not in REGISTRY and "toy-keeps-2" not in REGISTRY
    finally:
        unregister_family("toy-keeps")
    # float8's gradient cast is a tensorwise fp8 GEMM's: refused where none casts the gradient
    with pytest.raises(ValueError, match=r"tensorwise_grad_dtype must be None \(its gradient is cast by no tensorwise"):
        register_format(
            "toy-fp8", family="float8", inside="again", gemms=Fp8Gemms("rowwise"), tensorwise_grad_dtype=torch.float8_e5m2
        )
    with pytest.raises(ValueError, match=r"must be None or an fp8 dtype .*but got torch.bfloat16"):
        register_format(
            "toy-fp8", family="float8", inside="again", gemms=Fp8Gemms("tensorwise"), tensorwise_grad_dtype=torch.bfloat16
        )
    assert list(REGISTRY) == before
    # the family answers for its own formats, and forgets one unregistered; the other families answer None
    fmt = register_format("toy-fp8", family="float8", inside="again", gemms=Fp8Gemms("rowwise", wgrad=False))
    family = fmt.family
    try:
        assert fmt.family.fp8_gemms(fmt) == Fp8Gemms("rowwise", wgrad=False) and not fmt.family.fsdp_fp8_all_gather(fmt)
        assert fmt.family.tensorwise_grad_dtype(fmt) is None and fmt.family.autocast_dtype(fmt) is None
        assert fmt.family.gemm_precisions(fmt) == ("fp8", "fp8", "bf16") and toy.family.fp8_gemms(toy) is None
    finally:
        unregister_format("toy-fp8")
    with pytest.raises(KeyError):
        family.fp8_gemms(fmt)
    assert Format.FP8.family.fp8_gemms(Format.FP8) == Fp8Gemms("tensorwise", recipe="tensorwise")
    assert (
        Format.FP8.family.tensorwise_grad_dtype(Format.FP8) is torch.float8_e5m2
        and Format.BF16.family.autocast_dtype(Format.BF16) is torch.bfloat16
    )


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("INT8FQ", r"format name 'INT8FQ' must be lowercase letters, .*; register it as 'int8fq'$"),
        (" int8fq", r"format name ' int8fq' must be lowercase .*; register it as 'int8fq'$"),
        ("Bf16", r"format name 'Bf16' must be .*; as 'bf16' it is the registered format 'bf16' \(by .*FormatSpec\): give it"),
    ],
)  # fmt: skip
def test_a_format_name_no_policy_could_name_or_one_that_is_a_built_in_once_lower_cased_is_refused(toy, name, expected):
    before = list(REGISTRY)
    with pytest.raises(ValueError, match=expected):
        register_format(name, family="toy-int8", inside="again")
    assert list(REGISTRY) == before and parse_format("bf16").family.name == "autocast"


def test_apply_policy_runs_it_and_records_it(toy):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    x = torch.randn(5, 8)
    ref = model(x)
    apply_policy(model, Policy(layers={"0": TOY, "2": "bf16"}))
    rec = applied_summary(model).layers["0"]
    assert rec.format is toy and rec.module_type == "Linear" and rec.fp8_backend is None and rec.wrapped
    out = model(x)
    assert out.dtype == torch.float32 and 0 < (out - ref).abs().max() < 0.1
    out.sum().backward()
    assert model[0].weight.grad is not None
    with pytest.raises(ValueError, match=f"cannot be {TOY} here: {TOY} covers nn.Linear only, not ReLU"):
        apply_policy(torch.nn.Sequential(torch.nn.ReLU()), Policy(layers={"0": TOY}))


def test_a_policy_file_with_it_round_trips(toy, tmp_path):
    Policy(layers={"fc": TOY}).save(tmp_path / "p.json")
    assert load_policy(tmp_path / "p.json").layers["fc"] is toy


def test_the_profile_measures_it(toy):
    workload = prepare(load_task(MODELS / "overflow_mlp.py"), "cpu")
    space = space_from_dict({"layers": {"Linear": ["fp32", "bf16", TOY]}, "prune": {"slower_than": 1e9}})
    prof = profile(workload, space, ProfileConfig(batches=2, timing=TINY), progress=False)
    rows = [r for r in prof.rows if r.format == TOY]
    assert {r.layer for r in rows} == {"fc1", "big", "head"} and all(r.status == "ok" for r in rows)
    assert all(r.sqnr_db > 20 and r.time_ms > 0 for r in rows)


@pytest.mark.slow
def test_a_search_can_choose_it(toy, timings, tmp_path, monkeypatch):
    # a device where the toy runs faster than bf16 (the "faster" one's 0.5): it beats the uniform bf16 alternative
    base = timings_module.factor
    monkeypatch.setattr(timings_module, "factor", lambda fmt, factors: 0.3 if fmt is toy else base(fmt, factors))
    timings("faster")
    workload = prepare(load_task(MODELS / "overflow_mlp.py"), "cpu")
    space = space_from_dict({"default": ["fp32"], "layers": {"Linear": ["fp32", TOY]}, "trials": 4})
    config = SearchConfig(budget=1.0, trials=4, timing=TINY, final_timing=TINY, finalists=2, progress=False,
                          profile=ProfileConfig(batches=1, timing=TINY), predict_speed=False)  # fmt: skip
    result = search(workload, space, config, tmp_path)
    policy = load_policy(tmp_path / "policy.json")
    assert set(policy.layers.values()) == {Format.FP32, toy} and policy.layers["big"] is toy, policy.layers
    assert result.policy == policy


# ---- registered after autoprec.tune was imported (this file imports it first): nothing there holds a snapshot


def profile_with(fmt: str, layers: int) -> Profile:
    """`layers` repeated blocks' fc (16x16), each measured in fp32, bf16 and `fmt`; `fmt` the fastest (0.3 ms) and
    the deeper layers the more sensitive to it."""
    records = []
    for i in range(layers):
        for name, drop, sqnr, ms in (("fp32", 0.0, math.inf, 1.0), ("bf16", 0.0, 45.0, 0.6), (fmt, 0.001 * i, 30.0 - i, 0.3)):
            records.append({
                "layer": f"blocks.{i}.fc", "type": "Linear", "shape": "16x16", "format": name, "status": "ok",
                "reason": "", "sqnr_db": sqnr, "grad_sqnr_db": sqnr, "metric": 1 - drop, "metric_drop": drop,
                "finite": True, "overflow": False, "max_abs": 1.0, "time_ms": ms, "time_spread": 0.01,
                "time_vs_fp32": ms,
            })  # fmt: skip
    return Profile([ProfileRow(**r) for r in records], fp32_metric=1.0, metric_name="m", device="cpu", fingerprint="x")


def test_the_grouped_layout_offers_a_format_registered_after_the_tuner_was_imported(toy):
    prof = profile_with(TOY, 4)
    space = space_from_dict({"default": ["fp32"], "layers": {"Linear": ["fp32", "bf16", TOY]}, "layout": "grouped"})
    choices = build_choices(prof, space, 1.0, torch.device("cpu"))
    assert choices.layout == "grouped" and choices.groups == {"blocks.*.fc": tuple(f"blocks.{i}.fc" for i in range(4))}
    assert format_params(choices)["group:blocks.*.fc"] == ("fp32", "bf16", TOY)  # the group's options
    params = params_for("fp32", dict.fromkeys(choices.groups["blocks.*.fc"], TOY), choices)
    assert params["group:blocks.*.fc"] == TOY
    policy = policy_from_params(params, choices)
    assert all(policy.layers[f"blocks.{i}.fc"] is toy for i in range(4)), policy.layers


def test_the_ranked_layout_ranks_a_format_registered_after_the_tuner_was_imported(toy):
    prof = profile_with(TOY, 4)
    space = space_from_dict({"default": ["fp32"], "layers": {"Linear": ["fp32", "bf16", TOY]}, "layout": "ranked"})
    choices = build_choices(prof, space, 1.0, torch.device("cpu"))
    assert choices.ranking[TOY] == tuple(f"blocks.{i}.fc" for i in range(4))  # least sensitive first
    assert all(p == (TOY, "bf16") for p in choices.preference.values())  # it profiled fastest
    policy = policy_from_params({f"lowered:{TOY}": 2, "lowered:bf16": 4}, choices)
    assert [policy.layers[f"blocks.{i}.fc"].value for i in range(4)] == [TOY, TOY, "bf16", "bf16"]


@pytest.fixture
def toy_autocast():
    """An autocast-family format (bf16 under another name), registered for one test."""
    fmt = register_format("toy-bf16", family="autocast", inside="torch.autocast(bfloat16), again",
                          autocast=torch.bfloat16, fallback=Format.FP32)  # fmt: skip
    yield fmt
    unregister_format("toy-bf16")


def test_the_profile_runs_an_autocast_format_registered_after_the_tuner_was_imported(toy_autocast, monkeypatch):
    asked = []
    check = profiler_module._autocast_problem

    def spy(module, inputs, fmt, device):
        asked.append(fmt.value)
        return check(module, inputs, fmt, device)

    monkeypatch.setattr(profiler_module, "_autocast_problem", spy)
    workload = prepare(load_task(MODELS / "overflow_mlp.py"), "cpu")
    space = space_from_dict({"layers": {"Linear": ["fp32", "toy-bf16"]}, "prune": {"slower_than": 1e9}})
    prof = profile(workload, space, ProfileConfig(batches=1, timing=TINY), progress=False)
    rows = {r.layer: r for r in prof.rows if r.format == "toy-bf16"}
    assert set(rows) == {"fc1", "big", "head"} and all(r.status == "ok" for r in rows.values())
    assert asked.count("toy-bf16") == 3  # autocast's own check of each layer: it lowers to the format's dtype
    # as bf16 does: the same dtype, so the same numerics
    bf16 = profile(workload, space_from_dict({"layers": {"Linear": ["fp32", "bf16"]}, "prune": {"slower_than": 1e9}}),
                   ProfileConfig(batches=1, timing=TINY), progress=False)  # fmt: skip
    assert [r.sqnr_db for r in rows.values()] == [bf16.row(name, "bf16").sqnr_db for name in rows]


def test_a_stale_format_object_is_resolved_by_its_name_or_refused():
    stale = register_format("toy-stale", family="autocast", inside="again", autocast=torch.bfloat16)
    unregister_format("toy-stale")
    for make in (Format, parse_format, lambda f: Policy(layers={"0": f})):
        with pytest.raises(ValueError, match=r"(?s)(?=.*toy-stale).*fp32, bf16, fp16, fp8"):  # names the registered ones
            make(stale)
    with pytest.raises(ValueError, match="no longer registered"):
        _ = stale.spec
    fresh = register_format("toy-stale", family="autocast", inside="again", autocast=torch.bfloat16)
    try:
        assert Format(stale) is fresh and parse_format(stale) is fresh and Policy(layers={"0": stale}).layers["0"] is fresh
        model = apply_policy(torch.nn.Sequential(torch.nn.Linear(4, 4)), Policy(layers={"0": stale}))
        assert applied_summary(model).layers["0"].format is fresh
    finally:
        unregister_format("toy-stale")


def test_the_exporters_ask_the_family_for_block_scaled_gemms_and_recipes_not_its_name(toy, monkeypatch):
    """A family from outside autoprec that quantises in blocks says so by its own answer; the export targets read
    that, and a family that does not is no block-scaled one (the name "blockscaled" is never compared)."""
    from autoprec.tune.export._common import blockscaled_gemms, blockscaled_recipe

    assert blockscaled_gemms(toy) is None and blockscaled_recipe(toy) is None
    monkeypatch.setattr(ToyInt8Family, "block_scaled_gemms", lambda self, fmt: ("mxfp8", None, None))
    monkeypatch.setattr(ToyInt8Family, "recipe_name", lambda self, fmt: "toy_recipe")
    assert blockscaled_gemms(toy) == ("mxfp8", None, None) and blockscaled_recipe(toy) == "toy_recipe"
    assert blockscaled_gemms(Format("mxfp8")) == ("mxfp8", "mxfp8", "mxfp8") and blockscaled_recipe(Format("mxfp8")) == "mxfp8"


class ZeroFamily(ToyInt8Family):
    """Another family to register the toy format's name under: every output zero."""

    name = "toy-zero"

    def forward(self, fmt, module, inner, device_type, args, kwargs):
        return torch.zeros(*args[0].shape[:-1], module.out_features)


def test_a_model_keeps_the_family_it_was_applied_with_when_its_formats_name_is_registered_again(toy):
    """A review found the applied layers found their family by the format's name alone: a plugin's format registered
    again under that name moved every model applied before it to the new family."""
    torch.manual_seed(0)
    model, x = apply_policy(torch.nn.Sequential(torch.nn.Linear(4, 3)), Policy(layers={"0": TOY})), torch.randn(2, 4)
    before = model(x)
    unregister_format(TOY)
    unregister_family("toy-int8")
    register_family(ZeroFamily)
    try:
        register_format(TOY, family="toy-zero", inside="zeros", fallback=Format.FP32, risky=True, linear_only=True)
        again = apply_policy(torch.nn.Sequential(torch.nn.Linear(4, 3)), Policy(layers={"0": TOY}))
        assert again(x).abs().sum() == 0  # a model applied now gets the new family, and the first keeps its own
        assert torch.equal(model(x), before) and before.abs().sum() > 0
    finally:
        unregister_format(TOY)
        unregister_family("toy-zero")
        register_family(ToyInt8Family)  # as the fixture left it, for its teardown
        register_format(TOY, family="toy-int8", inside="int8 weight and input, one scale each (fake)",
                        fallback=Format.FP32, risky=True, linear_only=True)  # fmt: skip
