"""Choices and layouts: how per-layer choices become study parameters, and back into a policy."""

import math

import optuna
import pytest
import torch

from autoprec.tune._core._profile_row import ProfileRow
from autoprec.tune._core._space import Layout, load_space, space_from_dict
from autoprec.tune._measure._choices import (
    Choices,
    build_choices,
    fit,
    format_params,
    greedy_layers,
    greedy_params,
    group_layers,
    params_for,
    policy_from_params,
    role,
    suggest,
    uniform_params,
    warm_starts,
    with_layout,
)
from autoprec.tune._measure._profile_data import Profile

CPU = torch.device("cpu")


def profile_of(layers: dict[str, tuple[str, dict[str, tuple[float, float, float]]]]) -> Profile:
    """layers: name -> (shape, {format: (metric_drop, sqnr_db, time_ms)}); fp32 is added (drop 0, 1 ms)."""
    records = []
    for name, (shape, formats) in layers.items():
        for fmt, (drop, sqnr, ms) in {"fp32": (0.0, math.inf, 1.0), **formats}.items():
            records.append({
                "layer": name, "type": "Linear", "shape": shape, "format": fmt, "status": "ok", "reason": "",
                "sqnr_db": sqnr, "grad_sqnr_db": sqnr, "metric": 1 - drop, "metric_drop": drop, "finite": True,
                "overflow": False, "max_abs": 1.0, "time_ms": ms, "time_spread": 0.01, "time_vs_fp32": ms,
            })  # fmt: skip
    return Profile([ProfileRow(**r) for r in records], fp32_metric=1.0, metric_name="m", device="cpu", fingerprint="x")


def blocks(n: int, *, fp16_out: set[int] = frozenset()) -> Profile:
    """n blocks of q (64x64) and up (256x64), and a head; block i's q loses more the deeper it is."""
    layers = {}
    for i in range(n):
        q = {"bf16": (0.001 * i, 40.0 - i, 0.5)}
        if i not in fp16_out:
            q["fp16"] = (0.0005 * i, 50.0 - i, 0.7)
        layers[f"blocks.{i}.attn.q"] = ("64x64", q)
        layers[f"blocks.{i}.mlp.up"] = ("256x64", {"bf16": (0.0, 45.0, 0.6), "fp16": (0.0, 55.0, 0.8)})
    layers["head"] = ("10x64", {"bf16": (0.002, 30.0, 0.9), "fp16": (0.001, 35.0, 2.0)})
    return profile_of(layers)


def space(**extra):
    return space_from_dict({"default": ["fp32", "bf16"], "layers": {"Linear": ["fp32", "bf16", "fp16"]}, **extra})


def test_role_replaces_block_indices():
    assert role("blocks.11.attn.q") == "blocks.*.attn.q"
    assert role("layers.0") == "layers.*" and role("head") == "head" and role("h2.fc1") == "h2.fc1"


def test_layers_group_by_role_and_shape():
    prof = profile_of({"layers.0": ("64x8", {"bf16": (0, 40, 0.5)}), "layers.1": ("64x64", {"bf16": (0, 40, 0.5)}),
                       "layers.2": ("64x64", {"bf16": (0, 40, 0.5)}), "fixed": ("8x8", {})})  # fmt: skip
    layers = {"layers.0": ("fp32", "bf16"), "layers.1": ("fp32", "bf16"), "layers.2": ("fp32", "bf16"), "fixed": ("fp32",)}
    groups = group_layers(prof, layers)
    assert groups == {"layers.* [Linear 64x8]": ("layers.0",), "layers.* [Linear 64x64]": ("layers.1", "layers.2")}


def test_auto_picks_per_layer_then_grouped_then_ranked_by_size():
    assert build_choices(blocks(2), space(), 1.0, CPU).layout == "per_layer"  # 5 searched layers
    grouped = build_choices(blocks(12), space(), 1.0, CPU)  # 25 layers, 3 roles
    assert grouped.layout == "grouped" and set(grouped.groups) == {"blocks.*.attn.q", "blocks.*.mlp.up", "head"}
    ranked = build_choices(blocks(12), space(max_params=2), 1.0, CPU)  # 3 roles > 2
    assert ranked.layout == "ranked" and set(ranked.ranking) == {"bf16", "fp16"}
    assert "ranked: 2 parameters" in ranked.describe() and "25 searched layers" in ranked.describe()
    assert build_choices(blocks(12), space(layout="per_layer"), 1.0, CPU).layout == "per_layer"  # asked for


def test_grouped_members_take_the_next_safer_format_where_the_profile_ruled_one_out():
    prof = blocks(4, fp16_out={2})
    choices = build_choices(prof, space(layout="grouped"), 1.0, CPU)
    assert choices.layers["blocks.2.attn.q"] == ("fp32", "bf16")
    assert format_params(choices)["group:blocks.*.attn.q"] == ("fp32", "bf16", "fp16")
    policy = policy_from_params({"default": "bf16", "group:blocks.*.attn.q": "fp16", "group:blocks.*.mlp.up": "bf16"}, choices)
    got = {k: v.value for k, v in policy.layers.items()}
    assert [got[f"blocks.{i}.attn.q"] for i in range(4)] == ["fp16", "fp16", "bf16", "fp16"]
    assert got["blocks.0.mlp.up"] == "bf16" and got["head"] == "fp32" and got[""] == "bf16"
    assert fit("fp8", ("fp32",)) == "fp32" and fit("bf16", ("fp32", "fp16")) == "fp32"


def test_ranked_lowers_the_least_sensitive_first_in_the_format_each_profiled_fastest():
    choices = build_choices(blocks(4), space(layout="ranked"), 1.0, CPU)
    bf16_order = choices.ranking["bf16"]
    # by single-layer drop, the higher SQNR first among equal drops (q of block 2 and the head both lose 0.002)
    assert bf16_order[:4] == ("blocks.0.mlp.up", "blocks.1.mlp.up", "blocks.2.mlp.up", "blocks.3.mlp.up")
    assert bf16_order[4:] == ("blocks.0.attn.q", "blocks.1.attn.q", "blocks.2.attn.q", "head", "blocks.3.attn.q")
    policy = policy_from_params({"lowered:bf16": 5, "lowered:fp16": 0}, choices)
    lowered = {k for k, v in policy.layers.items() if v.value == "bf16" and k}
    assert lowered == set(bf16_order[:5])
    # In both formats' sets, a layer takes the one it profiled faster in (bf16 0.6 ms < fp16 0.8 ms).
    both = policy_from_params({"lowered:bf16": 9, "lowered:fp16": 9}, choices)
    assert both.layers["blocks.0.mlp.up"].value == "bf16" and both.layers["head"].value == "bf16"


def test_ranked_and_grouped_express_uniform_policies_exactly():
    for layout in ("per_layer", "grouped", "ranked"):
        choices = build_choices(blocks(4), space(layout=layout), 1.0, CPU)
        policy = policy_from_params(uniform_params(choices, "bf16"), choices)
        assert {v.value for v in policy.layers.values()} == {"bf16"}, layout
        policy = policy_from_params(uniform_params(choices, "fp32"), choices)
        assert {v.value for v in policy.layers.values()} == {"fp32"}, layout


def test_per_layer_params_carry_the_greedy_policy_exactly_and_grouped_by_majority():
    prof = blocks(3)
    choices = build_choices(prof, space(layout="per_layer"), 0.0015, CPU)
    greedy = greedy_layers(prof, choices, 0.0015)
    assert set(greedy.values()) == {"fp32", "bf16"}  # the budget stops it part of the way
    policy = policy_from_params(greedy_params(prof, choices, 0.0015), choices)
    assert {k: v.value for k, v in policy.layers.items() if k} == greedy
    grouped = with_layout(choices, prof, Layout.GROUPED, 16)
    params = params_for("bf16", {"blocks.0.attn.q": "bf16", "blocks.1.attn.q": "bf16", "blocks.2.attn.q": "fp32"}, grouped)
    assert params["group:blocks.*.attn.q"] == "bf16"
    tie = params_for("bf16", {"blocks.0.attn.q": "bf16", "blocks.1.attn.q": "fp32"}, grouped)
    assert tie["group:blocks.*.attn.q"] == "fp32"  # a tie goes to the safer format


@pytest.mark.parametrize("layout", ["per_layer", "grouped", "ranked"])
def test_every_layout_suggests_through_optuna_and_round_trips_through_json(layout):
    choices = build_choices(blocks(4), space(layout=layout), 1.0, CPU)
    assert Choices.from_json(choices.to_json()) == choices
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    policies = []
    for _ in range(5):
        trial = study.ask()
        policies.append(suggest(trial, choices, space(layout=layout)))
        assert policy_from_params(trial.params, choices) == policies[-1]
        study.tell(trial, 0.0)
    assert all(set(p.layers) == {"", *choices.layers} for p in policies)


def test_the_space_file_names_the_layout_and_refuses_an_unknown_one():
    assert load_space().layout is Layout.AUTO and load_space().max_params == 16
    assert space(layout="Ranked").layout is Layout.RANKED
    with pytest.raises(ValueError, match=r"layout must be one of auto, per_layer, grouped, ranked, but got 'sorted'"):
        space(layout="sorted")
    with pytest.raises(ValueError, match=r"max_params must be >= 1, but got 0"):
        space(max_params=0)


def test_warm_starts_try_uniform_bf16_and_the_greedy_layers_with_the_root_in_bf16_and_in_fp32():
    prof = blocks(2)
    choices = build_choices(prof, space(layout="per_layer"), 0.0025, CPU)  # the head fits alone, not with q1
    starts = warm_starts(prof, choices, 0.0025)
    roots = [p["default"] for p in starts]
    assert roots == ["bf16", "bf16", "fp32", "fp32"] and len({str(sorted(p.items())) for p in starts}) == 4
    assert all(policy_from_params(p, choices).layers[""].value == p["default"] for p in starts)
    fixed_root = build_choices(prof, space(default=["fp32"], layout="per_layer"), 0.0025, CPU)
    assert len(warm_starts(prof, fixed_root, 0.0025)) == 2  # one root: the fp32-root copies are the same points


def test_describe_says_when_the_profile_left_only_the_root_to_search():
    from autoprec.tune._measure._choices import Choices

    choices = Choices(default=("fp32", "bf16"), layers={"a": ("fp32",), "b": ("fp32",)}, excluded={})
    assert (
        choices.describe()
        == "no layer has a format left beside its fallback after the profile: only the model root's format is searched"
    )


def fp8_profile(tensorwise: bool = True) -> Profile:
    """Two layers profiled in fp8 (tensorwise: FSDP2 gathers it in fp8, where `tensorwise`) and fp8-rowwise (it does
    not), as a profile of a space offering them."""
    formats = {"bf16": (0.0, 45.0, 0.6), "fp8": (0.0, 30.0, 0.4), "fp8-rowwise": (0.0, 32.0, 0.45)}
    if not tensorwise:
        del formats["fp8"]
    return profile_of({"up": ("256x64", formats), "down": ("64x256", formats)})


def test_a_sharded_search_offers_the_fp8_all_gather_where_a_layer_may_take_a_format_fsdp2_gathers_in_fp8():
    fp8_space = space_from_dict({"default": ["bf16"], "layers": {"Linear": ["fp32", "bf16", "fp8", "fp8-rowwise"]}})
    offered = build_choices(fp8_profile(), fp8_space, 1.0, CPU, fp8_all_gather=True)
    assert offered.fp8_all_gather and offered.describe().endswith(
        "; and FSDP2's fp8 all-gather, where a trial has a layer to gather in fp8"
    )
    assert not build_choices(fp8_profile(), fp8_space, 1.0, CPU).fp8_all_gather  # one device: no FSDP2 to gather
    rowwise = space_from_dict({"default": ["bf16"], "layers": {"Linear": ["fp32", "bf16", "fp8-rowwise"]}})
    assert not build_choices(fp8_profile(tensorwise=False), rowwise, 1.0, CPU, fp8_all_gather=True).fp8_all_gather  # nor rowwise
    old = build_choices(fp8_profile(), fp8_space, 1.0, CPU).to_json().replace(', "fp8_all_gather": false', "")
    assert "fp8_all_gather" not in old and not Choices.from_json(old).fp8_all_gather  # a study begun before


def test_the_fp8_all_gather_is_asked_only_of_trials_with_a_layer_fsdp2_gathers_in_fp8_and_reaches_their_policy():
    fp8_space = space_from_dict({"default": ["bf16"], "layers": {"Linear": ["fp32", "bf16", "fp8", "fp8-rowwise"]}})
    choices = build_choices(fp8_profile(), fp8_space, 1.0, CPU, fp8_all_gather=True)
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    asked = {True: 0, False: 0}
    for _ in range(40):
        trial = study.ask()
        policy = suggest(trial, choices, fp8_space)
        assert ("fsdp:fp8_all_gather" in trial.params) is bool(policy.fp8_gatherable)
        assert policy.fsdp_fp8_all_gather is trial.params.get("fsdp:fp8_all_gather", False)
        assert policy_from_params(trial.params, choices) == policy
        asked[policy.fsdp_fp8_all_gather] += "fsdp:fp8_all_gather" in trial.params
        study.tell(trial, 0.0)
    assert asked[True] and asked[False]  # both settings are tried
    # a trial without such a layer never carries it, whatever its params say (a study's older trial, say)
    params = {"layer:up": "fp8-rowwise", "layer:down": "bf16", "fsdp:fp8_all_gather": True}
    assert not policy_from_params(params, choices).fsdp_fp8_all_gather


def test_one_format_assignment_stands_for_both_settings_of_the_fp8_all_gather_where_the_search_offers_it():
    from autoprec.tune._decide._trials import formats_key
    from autoprec.tune._measure._choices import setting_variants

    fp8_space = space_from_dict({"default": ["bf16"], "layers": {"Linear": ["fp32", "bf16", "fp8"]}})
    choices = build_choices(fp8_profile(), fp8_space, 1.0, CPU, fp8_all_gather=True)
    off = policy_from_params({"layer:up": "fp8", "layer:down": "bf16"}, choices)
    variants = setting_variants(off, choices)
    assert [p.fsdp_fp8_all_gather for p in variants] == [False, True] and variants[1].layers == off.layers
    assert len({formats_key(p) for p in variants}) == 2  # timed apart: the stopping rule never takes one for both
    plain = policy_from_params({"layer:up": "bf16", "layer:down": "bf16"}, choices)
    assert setting_variants(plain, choices) == [plain]  # nothing to gather
    one_device = build_choices(fp8_profile(), fp8_space, 1.0, CPU)
    assert setting_variants(off, one_device) == [off]


def test_the_fp8_all_gather_is_searched_where_the_candidates_train_sharded_and_the_goal_measures_them():
    from autoprec.tune._core._goal import goal_named
    from autoprec.tune._measure._choices import searches_fp8_all_gather

    assert searches_fp8_all_gather(True, goal_named("speed")) and searches_fp8_all_gather(True, goal_named("memory"))
    assert not searches_fp8_all_gather(False, goal_named("speed"))  # one device: nothing to all-gather
    assert not searches_fp8_all_gather(True, goal_named("flops"))  # an estimate that prices no communication
