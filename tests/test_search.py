import json
import math
from pathlib import Path

import pandas as pd
import pytest
import torch

from autoprec import ProfileConfig, SearchConfig, UserError, apply_policy, load_policy, load_task, prepare, search
from autoprec.measure import TimingConfig, metric_of
from autoprec.profile import COLUMNS, Profile
from autoprec.search import build_choices, greedy_params, policy_from_params
from autoprec.space import space_from_dict

MODELS = Path(__file__).parent / "models"
SPACE = space_from_dict({"default": ["fp32", "bf16"], "layers": {"Linear": ["fp32", "bf16", "fp16"]}, "trials": 6})
TINY = TimingConfig(warmup=1, rounds=2, min_block_s=0.0)
FAST = dict(
    trials=6, timing=TINY, final_timing=TINY, finalists=2, progress=False,
    profile=ProfileConfig(batches=1, timing=TINY),
)  # fmt: skip


def fake_profile(rows: list[tuple]) -> Profile:
    """rows: (layer, format, metric_drop, time_ms, finite, overflow)."""
    records = []
    for layer, fmt, drop, ms, finite, overflow in rows:
        fp32_ms = next(r[3] for r in rows if r[0] == layer and r[1] == "fp32")
        records.append({
            "layer": layer, "type": "Linear", "shape": "8x8", "format": fmt, "status": "ok", "reason": "",
            "sqnr_db": 40.0, "grad_sqnr_db": 40.0, "metric": 1 - drop, "metric_drop": drop, "finite": finite,
            "overflow": overflow, "max_abs": 1e5 if overflow else 1.0, "time_ms": ms, "time_spread": 0.01,
            "time_vs_fp32": ms / fp32_ms,
        })  # fmt: skip
    return Profile(pd.DataFrame(records, columns=COLUMNS), fp32_metric=1.0, metric_name="m", device="cpu", fingerprint="x")


def test_choices_follow_the_measurements_not_a_rule():
    # The same layer: where fp16 measured fast and bf16 slow, fp16 is kept and bf16 dropped; and vice versa.
    fast_fp16 = fake_profile([("a", "fp32", 0, 1.0, True, False), ("a", "bf16", 0, 2.0, True, False), ("a", "fp16", 0, 0.5, True, False)])
    fast_bf16 = fake_profile([("a", "fp32", 0, 1.0, True, False), ("a", "bf16", 0, 0.5, True, False), ("a", "fp16", 0, 2.0, True, False)])
    cpu = torch.device("cpu")
    assert build_choices(fast_fp16, SPACE, 0.01, cpu).layers["a"] == ("fp32", "fp16")
    assert build_choices(fast_bf16, SPACE, 0.01, cpu).layers["a"] == ("fp32", "bf16")
    assert "measured 2.00x" in build_choices(fast_bf16, SPACE, 0.01, cpu).excluded["a"]["fp16"]


def test_choices_drop_overflow_nonfinite_and_over_budget():
    prof = fake_profile([
        ("a", "fp32", 0, 1.0, True, False), ("a", "bf16", 0.02, 0.5, True, False), ("a", "fp16", math.nan, 0.5, False, True),
    ])  # fmt: skip
    choices = build_choices(prof, SPACE, 0.01, torch.device("cpu"))
    assert choices.layers["a"] == ("fp32",)
    assert "overflows" in choices.excluded["a"]["fp16"] or "non-finite" in choices.excluded["a"]["fp16"]
    assert "budget" in choices.excluded["a"]["bf16"]
    assert build_choices(prof, SPACE, 0.05, torch.device("cpu")).layers["a"] == ("fp32", "bf16")


def test_greedy_takes_the_biggest_savings_within_the_summed_drops():
    prof = fake_profile([
        ("a", "fp32", 0, 10.0, True, False), ("a", "bf16", 0.006, 2.0, True, False),
        ("b", "fp32", 0, 10.0, True, False), ("b", "bf16", 0.006, 5.0, True, False),
    ])  # fmt: skip
    choices = build_choices(prof, SPACE, 0.01, torch.device("cpu"))
    params = greedy_params(prof, choices, 0.01)
    assert params["layer:a"] == "bf16" and params["layer:b"] == "fp32"  # a saves more; both would exceed 0.01


def test_policy_from_params_fixes_single_choice_layers_and_sets_loss_scale():
    prof = fake_profile([("a", "fp32", 0, 1.0, True, False), ("a", "fp16", 0, 0.5, True, False), ("b", "fp32", 0, 1.0, True, False)])
    choices = build_choices(prof, SPACE, 0.01, torch.device("cpu"))
    params = {"default": "bf16", "layer:a": "fp16", "loss_scale:init_scale_log2": 12,
              "loss_scale:growth_interval": 500, "loss_scale:dynamic": True}  # fmt: skip
    policy = policy_from_params(params, choices)
    assert {k: v.value for k, v in policy.layers.items()} == {"": "bf16", "a": "fp16", "b": "fp32"}
    assert policy.loss_scale.init_scale == 4096 and policy.loss_scale.growth_interval == 500


def test_budget_must_not_be_negative():
    with pytest.raises(ValueError, match=r"budget must be .*>= 0.*-0.5"):
        SearchConfig(budget=-0.5)


@pytest.fixture(scope="module")
def searched(tmp_path_factory):
    out = tmp_path_factory.mktemp("search")
    workload = prepare(load_task(MODELS / "overflow_mlp.py"), "cpu")
    result = search(workload, SPACE, SearchConfig(budget=0.05, **FAST), out)
    return workload, result, out


def test_search_writes_a_policy_that_applies_within_budget(searched):
    workload, result, out = searched
    for name in ("policy.json", "profile.csv", "trials.csv", "finalists.csv", "study.journal"):
        assert (out / name).is_file(), name
    policy = load_policy(out / "policy.json")
    model = apply_policy(load_task(MODELS / "overflow_mlp.py").build_model(), out / "policy.json")
    assert result.profile.fp32_metric - metric_of(workload, model) <= 0.05
    m = policy.measured
    assert set(m["results"]) == {"fp32", "uniform bf16", "policy"} and m["budget"] == 0.05
    assert m["results"]["fp32"]["speedup"] == 1.0 and m["results"]["policy"]["step_ms"] > 0
    assert {"torch", "torchao", "optuna"} <= set(m["versions"]) and m["device"].startswith("cpu")


def test_the_fp16_overflowing_layer_is_never_given_fp16(searched):
    _, result, _ = searched
    assert "fp16" not in result.choices.layers["big"]
    assert "fp16" not in set(result.trials.get("big", pd.Series(dtype=str)).dropna())
    assert result.policy.layers["big"].value != "fp16"


def test_baselines_are_evaluated_first(searched):
    _, result, _ = searched
    first = result.trials.iloc[0]
    assert {first[c] for c in ("(default)", "fc1", "big", "head")} == {"fp32"}
    assert len(result.trials) == 6


def test_rerun_resumes_the_study(searched):
    workload, result, out = searched
    again = search(workload, SPACE, SearchConfig(budget=0.05, **FAST), out)
    assert len(again.trials) == 6  # the target was reached: no new trials
    more = search(workload, SPACE, SearchConfig(budget=0.05, **{**FAST, "trials": 7}), out)
    assert len(more.trials) == 7


def test_resuming_with_another_budget_is_refused(searched):
    workload, _, out = searched
    with pytest.raises(UserError, match=r"different budget.*--study"):
        search(workload, SPACE, SearchConfig(budget=0.2, **FAST), out)


def test_policy_file_is_plain_json(searched):
    _, _, out = searched
    data = json.loads((out / "policy.json").read_text())
    assert set(data) == {"version", "layers", "loss_scale", "measured"} and data["version"] == 1
