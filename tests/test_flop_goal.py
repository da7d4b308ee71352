"""The FLOP goal (autoprec/tune/_decide/_flops.py, issue 40): planning for a device this machine is not, by each Linear's GEMM
FLOPs weighted by a target's nominal dense throughput (_targets.py). An estimate, labelled as one everywhere; its
trials are not timed, so a search on a CPU plans for a B200."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from short_timing import FAST_PROFILE, TINY

from autoprec import load_policy
from autoprec.formats import (
    REGISTRY,
    Format,
    FormatFamily,
    caller_precision,
    families,
    register_family,
    register_format,
    unregister_family,
    unregister_format,
)
from autoprec.policy import ROOT, Policy
from autoprec.tune import SearchConfig, load_task, prepare
from autoprec.tune._core._profile_row import ProfileRow
from autoprec.tune._core._space import space_from_dict
from autoprec.tune._core._targets import B200, H100, Target, register_target, unregister_target
from autoprec.tune._decide._flops import FLOPS, Flops, estimated_speedup, format_of, gemm_flops
from autoprec.tune._decide._goals import SPEED
from autoprec.tune._measure import _predict as predictor
from autoprec.tune._measure._predict import LinearShape, Step
from autoprec.tune._measure._step_shapes import step_from_rows
from autoprec.tune._search._pipeline import search

MODELS = Path(__file__).parent / "models"
FP4 = "toy-fp4"  # a toy format the family says runs its GEMMs in nvfp4 (fprop, dgrad) and bf16 (wgrad)


class ToyFp4Family(FormatFamily):
    """Says its Linears' GEMMs run (nvfp4, nvfp4, bf16); computes them in fp32, exactly, except on a Linear of 4
    outputs, whose logits it makes NaN: the one layer that cannot take it (the profile rules it out; changed logits
    alone can score above this untrained model's own accuracy, below chance)."""

    name = "toy-fp4"

    def gemm_precisions(self, fmt: Format, outer: str | None = None) -> tuple[str, str, str]:
        return ("nvfp4", "nvfp4", "bf16")

    def module_problem(self, fmt: Format, module: torch.nn.Module) -> str | None:
        return None if type(module) is torch.nn.Linear else f"{fmt} covers nn.Linear only"

    def forward(self, fmt, module, inner, device_type, args, kwargs):
        outer = torch.is_autocast_enabled(device_type)
        (x, *_) = args
        with torch.autocast(device_type, enabled=False):
            out = torch.nn.functional.linear(x.float(), module.weight, module.bias)
        return caller_precision(out * math.nan if module.out_features == 4 else out, outer)


@pytest.fixture
def fp4():
    before_formats, before_families = list(REGISTRY), families()
    register_family(ToyFp4Family)
    fmt = register_format(FP4, family="toy-fp4", inside="toy: nvfp4 fprop and dgrad, bf16 wgrad (computed in fp32)",
                          fallback=Format.FP32, risky=True, linear_only=True)  # fmt: skip
    yield fmt
    unregister_format(FP4)
    unregister_family("toy-fp4")
    assert list(REGISTRY) == before_formats and families() == before_families


# A target priced by its GEMMs' compute alone (no memory traffic, no launch cost): what these tests of the search's
# mechanics need from 64-wide layers on 16 rows, which on any real GPU are launch-bound, so every format ties there.
COMPUTE_ONLY = "compute-only"


@pytest.fixture
def compute_only():
    target = register_target(
        Target(
            COMPUTE_ONLY, "B200's rates, free memory and launches", dict(B200.tflops), "tests", bandwidth_tbs=1e9, launch_us=0.0
        )
    )
    yield target
    unregister_target(COMPUTE_ONLY)


def two_layers() -> list[ProfileRow]:
    """A profile's rows for a 2-layer MLP (32 -> 64 -> 4) that saw 16 rows per training step, and a ReLU."""
    return [
        ProfileRow(layer="fc1", type="Linear", shape="64x32", tokens=16.0, format="fp32", status="ok"),
        ProfileRow(layer="fc1", type="Linear", shape="64x32", tokens=16.0, format="bf16", status="ok"),
        ProfileRow(layer="head", type="Linear", shape="4x64", tokens=16.0, format="fp32", status="ok"),
        ProfileRow(layer="act", type="ReLU", shape="", tokens=16.0, format="fp32", status="ok"),
    ]


def test_the_flop_count_and_the_estimate_match_a_hand_computation():
    flops = gemm_flops(two_layers())
    assert flops == {"fc1": 2 * 16 * 64 * 32, "head": 2 * 16 * 4 * 64}  # per GEMM; the ReLU counts none
    f1, f2 = 65536.0, 8192.0
    bf16, fp8, fp32 = 2250e12, 4500e12, 75e12  # B200's nominal dense rates
    all_bf16 = 3 * (f1 + f2) / bf16
    policy = Policy(layers={ROOT: Format.FP32, "fc1": Format.FP8, "head": Format.BF16})
    assert estimated_speedup(policy, flops, B200) == pytest.approx(all_bf16 / (3 * f1 / fp8 + 3 * f2 / bf16))
    # fp8-fwd: fprop in fp8, both gradient GEMMs in strict fp32 (the weight's dtype): far slower than bf16
    fwd = Policy(layers={ROOT: Format.FP32, "fc1": Format.FP8_FWD, "head": Format.BF16})
    assert estimated_speedup(fwd, flops, B200) == pytest.approx(all_bf16 / (f1 / fp8 + 2 * f1 / fp32 + 3 * f2 / bf16))
    # an unlisted layer runs in the root's format: a bf16 root is all-bf16, 1.0 by definition
    assert estimated_speedup(Policy(layers={ROOT: Format.BF16}), flops, B200) == pytest.approx(1.0)
    assert format_of("head.inner", {ROOT: Format.BF16, "head": Format.FP8}) is Format.FP8
    assert estimated_speedup(Policy(layers={ROOT: Format.FP32}), flops, H100) == pytest.approx(67 / 989.5)


def test_the_families_say_what_each_gemm_runs_in(fp4):
    assert Format.BF16.family.gemm_precisions(Format.BF16) == ("bf16", "bf16", "bf16")
    assert Format.FP32.family.gemm_precisions(Format.FP32) == ("fp32", "fp32", "fp32")
    assert Format.FP8.family.gemm_precisions(Format.FP8) == ("fp8", "fp8", "fp8")
    assert Format.FP8_FWD_DGRAD.family.gemm_precisions(Format.FP8_FWD_DGRAD) == ("fp8", "fp8", "bf16")
    assert Format.FP8_FWD.family.gemm_precisions(Format.FP8_FWD) == ("fp8", "fp32", "fp32")
    # the toy's per-GEMM mix weights its work: two GEMMs at 4x bf16, one at bf16
    flops = {"fc": 1e12}
    estimate = estimated_speedup(Policy(layers={ROOT: Format.FP32, "fc": fp4}), flops, B200)
    assert estimate == pytest.approx(3 / (2 / 4 + 1)) == pytest.approx(2.0)


def test_a_target_that_lacks_a_format_refuses_it_naming_what_it_runs(fp4):
    table = [*two_layers(), ProfileRow(layer="fc1", type="Linear", shape="64x32", tokens=16.0, format=FP4, status="ok")]
    config = SearchConfig(budget=0.1, objective="flops", target="h100")
    with pytest.raises(ValueError, match=r"target h100 \(NVIDIA H100 SXM5\) runs fp32, bf16, fp16, fp8: toy-fp4 needs nvfp4"):
        FLOPS.bound(table, config)
    bound = FLOPS.bound(table, SearchConfig(budget=0.1, objective="flops", target="b200"))
    assert isinstance(bound, Flops) and bound.target is B200 and bound.step == step_from_rows(table)


def test_the_config_needs_a_target_for_flops_and_refuses_one_for_other_goals():
    assert SearchConfig(budget=0.1, objective="flops", target="B200").target == "b200"
    with pytest.raises(ValueError, match=r"objective flops needs target: one of b200, h100, h200, gb200"):
        SearchConfig(budget=0.1, objective="flops")
    with pytest.raises(ValueError, match=r"target must be one of b200, h100, h200, gb200, but got 'a100'"):
        SearchConfig(budget=0.1, objective="flops", target="a100")
    with pytest.raises(ValueError, match=r"target applies only to objective flops, not speed"):
        SearchConfig(budget=0.1, target="b200")
    with pytest.raises(ValueError, match=r"max_memory \(--max-memory\) needs each trial's peak memory.*leave it out"):
        SearchConfig(budget=0.1, objective="flops", target="b200", max_memory=10**9)
    assert not FLOPS.timed and FLOPS.targeted and SPEED.timed and not SPEED.targeted


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (["--objective", "flops"], "autoprec: error: --objective flops needs --target: one of b200, h100, h200, gb200"),
        (["--objective", "flops", "--target", "a100"], "--target must be one of b200, h100, h200, gb200, but got 'a100'"),
        (["--objective", "speed", "--target", "b200"], "--target applies only to --objective flops, not speed"),
    ],
)
def test_the_command_line_refuses_a_missing_unknown_or_unwanted_target(flags, said, capsys):
    from autoprec.tune._cli import main

    assert main(["search", str(MODELS / "overflow_mlp.py"), "--device", "cpu", *flags]) == 2
    err = capsys.readouterr().err
    assert said in err and len(err.strip().splitlines()) == 1


@pytest.mark.slow
def test_a_search_on_a_cpu_plans_the_lowest_formats_each_layer_can_take_for_a_b200(fp4, compute_only, tmp_path, timings):
    timings("slower")  # this machine's speed: the toy runs slower than fp32 here, and that does not matter
    workload = prepare(load_task(MODELS / "overflow_mlp.py"), "cpu")
    space = space_from_dict({"default": ["fp32"], "layers": {"Linear": ["fp32", "bf16", FP4]}, "trials": 10})
    config = SearchConfig(budget=0.01, objective="flops", target=COMPUTE_ONLY, trials=10, timing=TINY, final_timing=TINY,
                          finalists=2, progress=False, profile=FAST_PROFILE)  # fmt: skip
    result = search(workload, space, config, tmp_path)

    policy = load_policy(tmp_path / "policy.json")
    assert "non-finite" in result.choices.excluded["head"][FP4]
    # the toy on the head makes the logits NaN (ruled out); fc1 and big take it, the head the next lowest, bf16
    assert policy.layers["fc1"] is fp4 and policy.layers["big"] is fp4 and policy.layers["head"] is Format.BF16
    m = policy.measured
    assert m["objective"] == "flops" and m["estimate"]["goal"] == "flops" and m["estimate"]["target"] == COMPUTE_ONLY
    # a toy format of no known kernel on a 64-wide toy: the estimate says it is outside the validated range
    band = "predicted for COMPUTE-ONLY by autoprec's step-time predictor (outside the validated range: "
    assert m["estimate"]["estimate"] is True and band in m["estimate"]["what"]
    assert m["estimate"]["error"] is None and m["estimate"]["validation_points"] == 0  # outside the validated range
    step = step_from_rows(result.profile.rows)
    assert [(s.name, s.in_features, s.out_features, s.tokens) for s in step.linears] == [
        ("fc1", 32, 64, 16.0), ("big", 64, 64, 16.0), ("head", 64, 4, 16.0)
    ]  # fmt: skip
    assert m["estimate"]["value"] == pytest.approx(predictor.speedup(step, policy, compute_only))
    assert m["results"]["policy"]["estimate"] == pytest.approx(m["estimate"]["value"])
    assert m["why"].startswith(f"the largest predicted step speedup on {COMPUTE_ONLY} within budget: ")
    assert json.loads((tmp_path / "policy.json").read_text())["measured"]["estimate"]["target"] == COMPUTE_ONLY

    trials = result.trials
    assert trials["step_ms"].isna().all() or "step_ms" not in trials  # no trial was timed here
    summary = result.summary()
    assert summary.startswith(f"chosen: {m['chosen']}, ") and band in summary
    assert f"predicted {COMPUTE_ONLY}" in summary and "speedup here" in summary and f"not on {COMPUTE_ONLY}" in summary

    from autoprec.tune._report._show import show_policy

    shown = show_policy(policy)
    assert band in shown and f"predicted {COMPUTE_ONLY}" in shown and "speedup here" in shown


def test_the_estimate_is_never_nan_and_needs_a_bound_goal():
    with pytest.raises(RuntimeError, match="bound"):
        FLOPS.estimated(Policy(layers={ROOT: Format.FP32}))
    assert math.isfinite(estimated_speedup(Policy(layers={ROOT: Format.FP32}), {}, B200))


@pytest.mark.slow
def test_a_flops_search_on_a_cpu_writes_a_policy_with_mxfp8_or_nvfp4_layers_labelled_an_estimate(compute_only, tmp_path, timings):
    """Issue 40's "done when": the blockscaled formats have no kernel on a CPU, so a speed search rules them out (their
    time here is an emulation's); a plan for a device that runs them, and where they pay, keeps them and writes them,
    as a prediction."""
    timings("slower")
    workload = prepare(load_task(MODELS / "overflow_mlp.py"), "cpu")
    lowest = ["fp32", "bf16", "mxfp8", "nvfp4"]
    space = space_from_dict({"default": ["fp32"], "layers": {"Linear": lowest}, "trials": 12})
    config = SearchConfig(budget=0.5, objective="flops", target=COMPUTE_ONLY, trials=12, timing=TINY, final_timing=TINY,
                          finalists=2, progress=False, profile=FAST_PROFILE)  # fmt: skip
    result = search(workload, space, config, tmp_path)

    policy = load_policy(tmp_path / "policy.json")
    blockscaled = {n: f.value for n, f in policy.layers.items() if f.family.name == "blockscaled"}
    assert blockscaled, {n: f.value for n, f in policy.layers.items()}
    kept = [r for r in result.profile.rows if r.layer == "big" and r.format in ("mxfp8", "nvfp4")]
    assert {r.timed_as for r in kept} == {"no kernel on this device"} and all(r.status == "ok" for r in kept)
    m = policy.measured
    assert m["estimate"]["target"] == COMPUTE_ONLY and m["estimate"]["estimate"] is True
    assert m["estimate"]["value"] > 1.0  # faster than all-bf16 where only the GEMMs' compute counts


def test_a_sweep_refuses_the_flops_goal_with_one_error_line_before_the_profile(capsys, tmp_path):
    """A sweep draws each budget's choice on its goal's Pareto axis; flops has none, and the sweep ran, then wrote
    tables without the estimate it optimised (found in review): refused before the profile, pointing at a search per
    budget."""
    from autoprec.tune._cli import main

    argv = ["sweep", str(MODELS / "overflow_mlp.py"), "--device", "cpu", "--budgets", "0.01,0.05",
            "--objective", "flops", "--target", "b200", "--out", str(tmp_path / "out")]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and [line for line in err.splitlines() if "error" in line] == [err.strip().splitlines()[-1]]
    assert "autoprec sweep does not take --objective flops" in err and "autoprec search --objective flops" in err
    assert not (tmp_path / "out" / "profile.csv").exists()


def test_a_space_with_formats_the_target_does_not_run_is_refused_before_the_profile(tmp_path, monkeypatch):
    """An H100 runs no nvfp4: the search said so only after profiling every layer (found in review)."""
    from autoprec.tune._search import _pipeline as pipeline

    monkeypatch.setattr(pipeline, "start", lambda *a, **k: pytest.fail("profiled before refusing the space"))
    workload = prepare(load_task(MODELS / "overflow_mlp.py"), "cpu")
    space = space_from_dict({"default": ["fp32"], "layers": {"Linear": ["fp32", "bf16", "nvfp4"]}, "trials": 4})
    config = SearchConfig(budget=0.1, objective="flops", target="h100", trials=4, progress=False, profile=FAST_PROFILE)
    with pytest.raises(ValueError, match=r"target h100 .* nvfp4 needs nvfp4\. Leave nvfp4 out of the search space"):
        search(workload, space, config, tmp_path)


def test_a_gemm_left_in_high_precision_counts_in_the_autocast_around_the_layer():
    """Under a bf16 root, mxfp8-fwd's dgrad and wgrad run in bf16, not fp32: the estimate priced them at fp32's 75
    TFLOP/s on a B200, so a search never chose a per-GEMM mix there (found in review)."""
    flops = {"fc1": 1e12}
    mx, bf16, fp32 = B200.tflops["mxfp8"], B200.tflops["bf16"], B200.tflops["fp32"]
    under_bf16 = estimated_speedup(Policy(layers={ROOT: Format.BF16, "fc1": Format.MXFP8_FWD}), flops, B200)
    assert under_bf16 == pytest.approx((3 / bf16) / (1 / mx + 2 / bf16))
    under_fp32 = estimated_speedup(Policy(layers={ROOT: Format.FP32, "fc1": Format.MXFP8_FWD}), flops, B200)
    assert under_fp32 == pytest.approx((3 / bf16) / (1 / mx + 2 / fp32))
    # a torchao recipe's high-precision GEMM follows the caller's autocast too; a per-GEMM fp8 mix keeps its fixed rule
    assert Format.FP8_ROWWISE_GW_HP.family.gemm_precisions(Format.FP8_ROWWISE_GW_HP, "bf16") == ("fp8", "fp8", "bf16")
    assert Format.FP8_FWD.family.gemm_precisions(Format.FP8_FWD, "bf16") == ("fp8", "fp32", "fp32")
    # the layer's own fp32 turns autocast off inside it
    assert Format.FP32.family.gemm_precisions(Format.FP32, "bf16") == ("fp32", "fp32", "fp32")


def test_show_of_a_hand_edited_estimate_prints_what_it_can_and_never_a_traceback():
    """A policy file whose measured.estimate lost its results' estimates, or holds a rate that is no number, made
    `autoprec show` fail with an IndexError or a format error (found in review)."""
    from autoprec.tune._report._show import show_policy

    estimate = {"goal": "flops", "target": "b200", "estimate": True, "what": "estimated 2.00x all-bf16 GEMM throughput",
                "tflops": {"bf16": "fast", "nvfp4": 9000.0}}  # fmt: skip
    measured = {"chosen": "policy", "objective": "flops", "estimate": estimate,
                "results": {"policy": {"metric": 1.0, "metric_drop": 0.0, "step_ms": 2.0, "speedup": 1.0}}}  # fmt: skip
    shown = show_policy(Policy(layers={ROOT: Format.BF16}, measured=measured))
    assert "est. b200 (FLOPs)" in shown and "bf16 ?, nvfp4 9000" in shown


def test_the_autocast_around_a_layer_skips_an_ancestor_whose_format_sets_none():
    from autoprec.tune._decide._flops import outer_autocast

    layers = {ROOT: Format.BF16, "x": Format.MXFP8_FWD, "y": Format.FP32, "z": Format.FP16}
    assert outer_autocast("x.sub", layers) == "bf16"  # mxfp8-fwd leaves the caller's autocast: the root's
    assert outer_autocast("y.sub", layers) is None and outer_autocast("z.sub", layers) == "fp16"
    assert outer_autocast("w", layers) == "bf16" and outer_autocast("w", {}) is None


def test_a_flops_search_whose_lists_fall_back_to_bf16_keeps_its_high_layers_in_bf16_not_fp32(compute_only, tmp_path, timings):
    """Priced at the target's fp32 rate (75 TFLOP/s on a B200, 30x bf16's), a layer kept in fp32 made every plan that
    keeps one look far slower than the all-bf16 baseline every hand rule keeps such layers in. The FLOP goal takes bf16
    as a list's fallback: the search runs without fp32 in its lists and writes bf16 where a layer stays high (here the
    head, whose 4 outputs NVFP4 refuses)."""
    timings("slower")
    workload = prepare(load_task(MODELS / "overflow_mlp.py"), "cpu")
    space = space_from_dict({"default": ["bf16"], "layers": {"Linear": ["bf16", "nvfp4"]}, "trials": 8})
    config = SearchConfig(budget=0.5, objective="flops", target=COMPUTE_ONLY, trials=8, timing=TINY, final_timing=TINY,
                          finalists=2, progress=False, profile=FAST_PROFILE)  # fmt: skip
    result = search(workload, space, config, tmp_path)

    policy = load_policy(tmp_path / "policy.json")
    formats = {n: f.value for n, f in policy.layers.items()}
    assert formats[ROOT] == "bf16" and formats["head"] == "bf16" and "fp32" not in formats.values(), formats
    assert "nvfp4" in formats.values() and policy.measured["chosen"] != "fp32"
    # no trial was offered fp32 for a layer: the profile measured it as the reference only
    assert not (result.trials[["fc1", "big", "head"]] == "fp32").any().any()
    assert set(result.trials["head"]) == {"bf16"}


def test_the_greedy_and_uniform_starts_keep_a_layer_in_its_lists_fallback():
    from types import SimpleNamespace

    from autoprec.tune._measure._choices import Choices, greedy_layers, uniform_layers

    # fc1 may go nvfp4 (its drop fits), head's nvfp4 breaks the budget: it keeps its fallback, bf16 here, fp32 there
    rows = [("fc1", "fp32", 1.0, 0.0), ("fc1", "bf16", 0.9, 0.0), ("fc1", "nvfp4", 0.5, 0.01),
            ("head", "fp32", 1.0, 0.0), ("head", "bf16", 0.9, 0.0), ("head", "nvfp4", 0.5, 0.9)]  # fmt: skip
    table = {}
    for layer, fmt, ms, drop in rows:
        table.setdefault(layer, {})[fmt] = SimpleNamespace(format=fmt, time_ms=ms, metric_drop=drop)
    prof = SimpleNamespace(by_layer=lambda: table)
    bf16_lists = Choices(default=("bf16",), layers={"fc1": ("bf16", "nvfp4"), "head": ("bf16", "nvfp4")}, excluded={})
    assert greedy_layers(prof, bf16_lists, 0.1) == {"fc1": "nvfp4", "head": "bf16"}
    assert uniform_layers(bf16_lists, "fp32") == {"fc1": "bf16", "head": "bf16"}  # the all-fp32 warm start: the fallback
    fp32_lists = Choices(default=("fp32", "bf16"), layers={"fc1": ("fp32", "nvfp4"), "head": ("fp32", "nvfp4")}, excluded={})
    assert greedy_layers(prof, fp32_lists, 0.1) == {"fc1": "nvfp4", "head": "fp32"}  # as before the FLOP goal's fallback


def test_a_speed_search_still_refuses_a_list_without_fp32_naming_it_before_the_profile(tmp_path, monkeypatch):
    from autoprec.tune._search import _pipeline as pipeline

    monkeypatch.setattr(pipeline, "start", lambda *a, **k: pytest.fail("profiled before refusing the space"))
    workload = prepare(load_task(MODELS / "overflow_mlp.py"), "cpu")
    space = space_from_dict({"default": ["fp32", "bf16"], "layers": {"Linear": ["bf16", "nvfp4"]}, "trials": 4})
    config = SearchConfig(budget=0.1, trials=4, progress=False, profile=FAST_PROFILE)
    with pytest.raises(ValueError) as info:
        search(workload, space, config, tmp_path)
    assert str(info.value) == "<dict>: layers.Linear must include fp32 (the fallback every layer needs), got ['bf16', 'nvfp4']"


def test_the_flop_goals_choice_falls_back_to_uniform_bf16_in_a_space_without_fp32():
    from autoprec.tune._core._names import BF16, FP32
    from autoprec.tune._core._records import Finals, Measurement

    space = space_from_dict({"default": ["bf16"], "layers": {"Linear": ["bf16", "nvfp4"]}})
    config = SearchConfig(budget=0.1, objective="flops", target="b200", progress=False)
    goal = FLOPS.check_space(space, config)
    assert goal.kept_in is Format.BF16 and FLOPS.kept_in is Format.FP32  # the registered instance is left as it was
    bound = goal.bound(two_layers(), config)
    assert bound.kept_in is Format.BF16
    fp32 = Policy(layers={ROOT: Format.FP32})
    bf16 = Policy(layers={ROOT: Format.BF16})

    def row(name, drop, feasible):
        return Measurement(candidate=name, metric=-drop, metric_drop=drop, runs=True, feasible=feasible, step_ms=1.0,
                           skipped=0, steps=1, effective_step_ms=1.0, spread=0.0)  # fmt: skip

    # all-fp32 (the budget's reference, drop 0) is within budget but no policy of this space; uniform bf16 over it
    finals = Finals([row(FP32, 0.0, True), row(BF16, 0.5, False)])
    name, why = bound.choose(finals, {FP32: fp32, BF16: bf16})
    assert name == BF16 and "the search space's fallback" in why
    assert FLOPS.check_space(space_from_dict({"layers": {"Linear": ["fp32", "nvfp4"]}}), config).kept_in is Format.FP32


def test_the_profile_greedy_policy_of_a_flop_search_is_priced_on_the_target_not_on_this_machine(compute_only):
    """Emulated here, nvfp4 measures slower than fp32 on this machine; on a B200 it is the cheapest. The greedy policy
    (a warm start and an alternative) of a FLOP search follows the target's price, a speed search this machine's."""
    from types import SimpleNamespace

    from autoprec.tune._core._names import GREEDY
    from autoprec.tune._decide._alternatives import alternatives
    from autoprec.tune._measure._choices import Choices, greedy_layers, warm_starts

    rows = [("fc1", "fp32", 1.0), ("fc1", "bf16", 0.9), ("fc1", "nvfp4", 40.0), ("fc1", "mxfp8", 30.0)]
    table = {"fc1": {f: SimpleNamespace(layer="fc1", format=f, time_ms=ms, metric_drop=0.0) for _, f, ms in rows}}
    prof = SimpleNamespace(by_layer=lambda: table)
    choices = Choices(default=("fp32", "bf16"), layers={"fc1": ("fp32", "bf16", "mxfp8", "nvfp4")}, excluded={})
    goal = Flops(compute_only, Step((LinearShape("fc1", 64, 64, 4096.0),)))
    assert greedy_layers(prof, choices, 0.1) == {"fc1": "bf16"}  # this machine: bf16 is the only saving
    assert greedy_layers(prof, choices, 0.1, cost=goal.layer_cost) == {"fc1": "nvfp4"}  # the target: FP4 the cheapest
    assert goal.layer_cost(table["fc1"]["nvfp4"]) < goal.layer_cost(table["fc1"]["mxfp8"]) < goal.layer_cost(table["fc1"]["bf16"])
    assert math.isnan(goal.layer_cost(SimpleNamespace(layer="other", format="bf16")))  # no FLOP count: unpriced
    starts = warm_starts(prof, choices, 0.1, cost=goal.layer_cost)
    assert any(p.get("layer:fc1") == "nvfp4" for p in starts)
    model = torch.nn.Sequential()
    model.add_module("fc1", torch.nn.Linear(64, 64))
    alts = alternatives(model, torch.device("cpu"), prof, choices, 0.1, cost=goal.layer_cost)
    assert alts.candidates[GREEDY].policy.layers["fc1"] == "nvfp4"
    assert SPEED.layer_cost(table["fc1"]["nvfp4"]) == 40.0  # a measured goal: this machine's time


def test_a_ranked_layout_keeps_the_flop_goals_fallback_out_of_its_ranks_and_prefers_the_targets_cheapest(compute_only):
    """In a space whose lists fall back to bf16, bf16 is no lowered format to rank; and a layer taken for several
    formats takes the target's cheapest, not this machine's fastest: the greedy start survives the layout (found in
    review: it decoded to all bf16)."""
    from types import SimpleNamespace

    from autoprec.tune._measure._choices import Choices, greedy_params, layer_formats, with_layout

    ms = {"bf16": 0.9, "mxfp8": 30.0, "nvfp4": 40.0}  # emulated here: the low formats are slow on this machine
    table = {
        n: {
            f: SimpleNamespace(layer=n, type="Linear", shape="64x64", format=f, time_ms=t, metric_drop=0.001 * i, sqnr_db=30.0)
            for f, t in ms.items()
        }
        for i, n in enumerate(("a", "b", "c"))
    }
    prof = SimpleNamespace(by_layer=lambda: table)
    lists = dict.fromkeys(("a", "b", "c"), ("bf16", "mxfp8", "nvfp4"))
    goal = Flops(compute_only, Step(tuple(LinearShape(n, 64, 64, 4096.0) for n in ("a", "b", "c"))))
    ranked = with_layout(Choices(default=("bf16",), layers=lists, excluded={}), prof, "ranked", 1, cost=goal.layer_cost)
    assert set(ranked.ranking) == {"mxfp8", "nvfp4"}  # the fallback is not ranked
    assert all(p == ("nvfp4", "mxfp8") for p in ranked.preference.values())  # the B200's order, not this CPU's
    params = greedy_params(prof, ranked, 0.0015, cost=goal.layer_cost)  # a and b fit the budget, c does not
    assert layer_formats(params, ranked) == {"a": "nvfp4", "b": "nvfp4", "c": "bf16"}
    by_time = with_layout(Choices(default=("bf16",), layers=lists, excluded={}), prof, "ranked", 1)
    assert all(p == ("mxfp8", "nvfp4") for p in by_time.preference.values())  # a measured goal: this machine's order
