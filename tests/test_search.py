import copy
import dataclasses
import json
import math
import shutil
import sys
from pathlib import Path

import optuna
import pandas as pd
import pytest
import torch
from builders import NoFp16Kernel, WithNoFp16Kernel, made_up_peak
from short_timing import FAST_PROFILE, TINY
from timings import FASTER, FormatClock, using

from autoprec import LossScale, Policy, UserError, apply_policy, grad_scaler, load_policy
from autoprec.tune import SearchConfig, load_task, prepare
from autoprec.tune._core._budget import Budgets
from autoprec.tune._core._config import Mode
from autoprec.tune._core._profile_row import ProfileRow
from autoprec.tune._core._space import space_from_dict
from autoprec.tune._measure._choices import build_choices, greedy_params, loss_scale_choice, policy_from_params
from autoprec.tune._measure._gradients import LayerGradients, scale_table
from autoprec.tune._measure._metric import NoiseFloor, metric_of
from autoprec.tune._measure._profile_data import Profile
from autoprec.tune._search._objective import INFEASIBLE, over_budget
from autoprec.tune._search._pipeline import search

MODELS = Path(__file__).parent / "models"
SPACE = space_from_dict({"default": ["fp32", "bf16"], "layers": {"Linear": ["fp32", "bf16", "fp16"]}, "trials": 6})
FAST = dict(
    trials=6, timing=TINY, final_timing=TINY, finalists=2, progress=False,
    profile=FAST_PROFILE,
)  # fmt: skip


def fake_profile(rows: list[tuple], grad_ranges: pd.DataFrame | None = None) -> Profile:
    """rows: (layer, format, metric_drop, time_ms, finite, overflow[, grad_overflow])."""
    records = []
    for layer, fmt, drop, ms, finite, overflow, *grad in rows:
        fp32_ms = next(r[3] for r in rows if r[0] == layer and r[1] == "fp32")
        records.append({
            "layer": layer, "type": "Linear", "shape": "8x8", "format": fmt, "status": "ok", "reason": "",
            "sqnr_db": 40.0, "grad_sqnr_db": 40.0, "metric": 1 - drop, "metric_drop": drop, "finite": finite,
            "overflow": overflow, "max_abs": 1e5 if overflow else 1.0, "time_ms": ms, "time_spread": 0.01,
            "time_vs_fp32": ms / fp32_ms, "grad_overflow": grad[0] if grad else math.nan,
        })  # fmt: skip
    return Profile(
        [ProfileRow(**r) for r in records],
        fp32_metric=1.0,
        metric_name="m",
        device="cpu",
        fingerprint="x",
        grad_ranges=grad_ranges,
    )


def test_choices_follow_the_measurements_not_a_rule():
    # The same layer: where fp16 measured fast and bf16 slow, fp16 is kept and bf16 dropped; and vice versa.
    fast_fp16 = fake_profile(
        [("a", "fp32", 0, 1.0, True, False), ("a", "bf16", 0, 2.0, True, False), ("a", "fp16", 0, 0.5, True, False)]
    )
    fast_bf16 = fake_profile(
        [("a", "fp32", 0, 1.0, True, False), ("a", "bf16", 0, 0.5, True, False), ("a", "fp16", 0, 2.0, True, False)]
    )
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
    prof = fake_profile(
        [("a", "fp32", 0, 1.0, True, False), ("a", "fp16", 0, 0.5, True, False), ("b", "fp32", 0, 1.0, True, False)]
    )
    choices = build_choices(prof, SPACE, 0.01, torch.device("cpu"))
    params = {"default": "bf16", "layer:a": "fp16", "loss_scale:init_scale_log2": 12,
              "loss_scale:growth_interval": 500, "loss_scale:dynamic": True}  # fmt: skip
    policy = policy_from_params(params, choices)
    assert {k: v.value for k, v in policy.layers.items()} == {"": "bf16", "a": "fp16", "b": "fp32"}
    assert policy.loss_scale.init_scale == 4096 and policy.loss_scale.growth_interval == 500


# every trial timed: the tests below count trials, and a space that --timings slower shrinks to two policies would
# stop early (tests/test_cost.py and tests/test_speed.py test the stopping rule)
TIMED = {**FAST, "predict_speed": False}


@pytest.fixture(scope="module")
def searched(tmp_path_factory):
    out = tmp_path_factory.mktemp("search")
    workload = prepare(load_task(MODELS / "overflow_mlp.py"), "cpu")
    result = search(workload, SPACE, SearchConfig(budget=0.05, **TIMED), out)
    return workload, result, out


def test_search_writes_a_policy_that_applies_within_budget(searched):
    workload, result, out = searched
    for name in ("policy.json", "profile.csv", "trials.csv", "finalists.csv", "study.journal"):
        assert (out / name).is_file(), name
    policy = load_policy(out / "policy.json")
    model = apply_policy(load_task(MODELS / "overflow_mlp.py").build_model(), out / "policy.json")
    assert result.profile.fp32_metric - metric_of(workload, model) <= 0.05
    m = policy.measured
    assert set(m["results"]) == {"fp32", "uniform bf16", "profile greedy", "policy"} and m["budget"] == 0.05
    assert m["results"]["fp32"]["speedup"] == 1.0 and m["results"]["policy"]["step_ms"] > 0
    assert {"torch", "torchao", "optuna"} <= set(m["versions"]) and m["device"].startswith("cpu")


def test_the_policy_says_how_many_rounds_its_finalists_were_timed(searched):
    _, result, _ = searched
    rounds = {r.rounds for r in result.finals if r.runs}
    assert len(rounds) == 1 and 1 <= min(rounds) <= 2 * TINY.rounds  # all timed together (twice the rounds if noisy)
    assert result.policy.measured["timing"].startswith(f"eager; median of {min(rounds)} interleaved rounds (up to {TINY.rounds}")


def test_the_fp16_overflowing_layer_is_never_given_fp16(searched):
    _, result, _ = searched
    assert "fp16" not in result.choices.layers["big"]
    assert "fp16" not in set(result.trials["big"].dropna()) and result.trials["big"].notna().any()
    assert result.policy.layers["big"].value != "fp16"


def test_baselines_are_evaluated_first(searched):
    _, result, _ = searched
    first = result.trials.iloc[0]
    assert {first[c] for c in ("(default)", "fc1", "big", "head")} == {"fp32"}
    assert len(result.trials) == 6


def test_rerun_resumes_the_study(searched):
    workload, result, out = searched
    again = search(workload, SPACE, SearchConfig(budget=0.05, **TIMED), out)
    assert len(again.trials) == 6  # the target was reached: no new trials
    more = search(workload, SPACE, SearchConfig(budget=0.05, **{**TIMED, "trials": 7}), out)
    assert len(more.trials) == 7


def test_resuming_with_another_budget_is_refused(searched):
    workload, _, out = searched
    with pytest.raises(UserError, match=r"different budget.*--study"):
        search(workload, SPACE, SearchConfig(budget=0.2, **FAST), out)


def test_resuming_with_other_weights_of_the_same_structure_is_refused(searched, tmp_path):
    workload, _, out = searched
    out = shutil.copytree(out, tmp_path / "out")  # the search's own folder stays as it was for the other tests
    other = dataclasses.replace(workload, model=copy.deepcopy(workload.model))
    with torch.no_grad():
        next(other.model.parameters()).add_(1.0)  # retrained: the same structure, other values
    with pytest.raises(UserError, match=r"different model weights \(model weights \w+, now \w+\).*--study"):
        search(other, SPACE, SearchConfig(budget=0.05, **FAST), out)


def test_policy_file_is_plain_json(searched):
    _, _, out = searched
    data = json.loads((out / "policy.json").read_text())
    assert set(data) == {"version", "layers", "loss_scale", "measured"} and data["version"] == 1


# ---- modes, loss-scale choices ------------------------------------------------------------------


def test_mode_and_train_options_are_checked():
    with pytest.raises(ValueError, match=r"mode must be one of weights, train, but got 'bogus'"):
        SearchConfig(budget=0.1, mode="bogus")
    with pytest.raises(ValueError, match=r"train_steps must be an integer >= 1, but got 0"):
        SearchConfig(budget=0.1, mode="train", train_steps=0)
    with pytest.raises(ValueError, match=r"noise_runs must be an integer >= 1"):
        SearchConfig(budget=0.1, mode="train", noise_runs=0)
    assert SearchConfig(budget=0.1, mode="TRAIN").mode is Mode.TRAIN
    assert SearchConfig(budget=0.1).mode is Mode.WEIGHTS


def test_fp16_whose_gradients_overflow_unscaled_is_ruled_out():
    prof = fake_profile([("a", "fp32", 0, 1.0, True, False, 0.0), ("a", "fp16", 0, 0.5, True, False, 0.02)])
    choices = build_choices(prof, SPACE, 0.01, torch.device("cpu"))
    assert choices.layers["a"] == ("fp32",)
    assert "gradients overflow even at loss scale 1 (2% of elements above 65504)" in choices.excluded["a"]["fp16"]


def test_train_mode_does_not_judge_the_given_weights_drop():
    prof = fake_profile([("a", "fp32", 0, 1.0, True, False), ("a", "bf16", 0.5, 0.5, True, False)])
    assert build_choices(prof, SPACE, 0.01, torch.device("cpu")).layers["a"] == ("fp32",)
    assert build_choices(prof, SPACE, 0.01, torch.device("cpu"), judge_drop=False).layers["a"] == ("fp32", "bf16")


def grads_of(values: dict[str, float]) -> pd.DataFrame:
    records = {}
    for name, value in values.items():
        records[name] = LayerGradients(name)
        records[name].tensors["weight_grad"].add(torch.full((10,), value))
    return scale_table(records)


def test_the_profile_narrows_the_initial_scale_range(caplog):
    # gradients of 2^-30 need a scale of 2^6 to reach fp16's 2^-24; 2^-2 ones overflow above 2^17
    prof = fake_profile(
        [("a", "fp32", 0, 1.0, True, False), ("a", "fp16", 0, 0.5, True, False),
         ("b", "fp32", 0, 1.0, True, False), ("b", "fp16", 0, 0.5, True, False)],
        grad_ranges=grads_of({"a": 2.0**-30, "b": 2.0**-2}),
    )  # fmt: skip
    choices = build_choices(prof, SPACE, 0.01, torch.device("cpu"))
    assert choices.loss_scale["recommended"] == [6, 17] and choices.loss_scale["init_scale_log2"] == [10, 17]
    assert "low end set by a" in choices.loss_scale["advice"]
    outside = space_from_dict({"layers": {"Linear": ["fp32", "fp16"]}, "loss_scale": {"init_scale_log2": [20, 24]}})
    assert loss_scale_choice(prof, choices, outside)["init_scale_log2"] == [6, 17]  # measured beats the file's guess
    assert "outside the search space" in caplog.text
    no_fp16 = build_choices(fake_profile([("a", "fp32", 0, 1.0, True, False)]), SPACE, 0.01, torch.device("cpu"))
    assert no_fp16.loss_scale["init_scale_log2"] == [10, 24] and no_fp16.loss_scale["recommended"] is None


def test_policy_from_params_reads_every_loss_scale_setting():
    prof = fake_profile([("a", "fp32", 0, 1.0, True, False), ("a", "fp16", 0, 0.5, True, False)])
    choices = build_choices(prof, SPACE, 0.01, torch.device("cpu"))
    params = {"layer:a": "fp16", "loss_scale:init_scale_log2": 11, "loss_scale:growth_interval": 50,
              "loss_scale:growth_factor": 4.0, "loss_scale:backoff_factor": 0.25, "loss_scale:dynamic": False}  # fmt: skip
    ls = policy_from_params(params, choices).loss_scale
    assert (ls.init_scale, ls.growth_interval, ls.growth_factor, ls.backoff_factor, ls.dynamic) == (2048, 50, 4.0, 0.25, False)


# ---- train mode, end to end ---------------------------------------------------------------------

FP16_SPACE = space_from_dict({"default": ["fp32"], "layers": {"Linear": ["fp32", "fp16"]}, "prune": {"slower_than": 100.0}})
TRAIN = dict(FAST, trials=5, mode="train", train_steps=10, noise_runs=2)


def train_plainly(task, policy, steps: int) -> float:
    """What a user's script does with the written policy: apply it, grad_scaler(policy), train, evaluate."""
    torch.manual_seed(0)
    model = apply_policy(task.build_model(), policy)
    optimizer = task.optimizer(model)
    scaler = grad_scaler(policy, "cpu")
    train = list(task.batches("train"))
    model.train()
    for i in range(steps):
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(task.loss_fn(model, train[i % len(train)])).backward()
        scaler.step(optimizer)
        scaler.update()
    return task.evaluate(model.eval())


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("train")
    workload = prepare(load_task(MODELS / "underflow_mlp.py"), "cpu")
    with using(FormatClock(FASTER)):  # fp16 must pay for the trials to search its loss scales
        result = search(workload, FP16_SPACE, SearchConfig(budget=0.02, **TRAIN), out)
    return workload, result, out


def test_train_mode_records_mode_steps_and_noise_floor(trained):
    _, result, out = trained
    m = load_policy(out / "policy.json").measured
    assert m["mode"] == "train" and m["train_steps"] == 10
    assert m["noise_floor"] == result.noise.spread >= 0 and len(m["noise"]["fp32_metrics_by_seed"]) == 2
    assert m["fp32_metric"] == result.noise.reference
    assert m["loss_scale_search"]["recommended"][0] >= 12  # ~1e-9 gradients need a large scale
    assert {"skipped_steps", "steps", "train_skipped_steps", "effective_step_ms"} <= set(m["results"]["policy"])


def test_train_mode_trials_use_the_recommended_scales_and_skip_nothing(trained):
    _, result, _ = trained
    trials = result.trials
    assert {"predicted_drop", "skipped", "train_skipped", "effective_step_ms"} <= set(trials.columns)
    lo, hi = result.choices.loss_scale["init_scale_log2"]
    fp16 = trials[trials[["fc1", "fc2", "head"]].eq("fp16").any(axis=1)]
    assert len(fp16), "TPE sampled no fp16 trial"
    assert fp16["init_scale"].between(2.0**lo, 2.0**hi).all()
    assert (fp16["train_skipped"] == 0).all() and (fp16["metric_drop"] <= 0.02).all()


def trial_policy(row: pd.Series) -> Policy:
    layers = {"": row["(default)"], **{n: row[n] for n in ("fc1", "fc2", "head")}}
    if "fp16" not in layers.values():
        return Policy(layers=layers)
    ls = LossScale(init_scale=float(row["init_scale"]), growth_interval=int(row["growth_interval"]),
                   growth_factor=float(row["growth_factor"]), backoff_factor=float(row["backoff_factor"]),
                   dynamic=bool(row["dynamic"]))  # fmt: skip
    return Policy(layers=layers, loss_scale=ls)


def test_train_mode_result_holds_when_rechecked_with_the_written_policy(trained):
    workload, result, out = trained
    task, budget, noise = workload.task, 0.02, result.noise.spread
    fp32 = train_plainly(task, Policy(), 10)
    assert fp32 == result.noise.reference
    assert fp32 - train_plainly(task, load_policy(out / "policy.json"), 10) <= budget + noise
    # every feasible trial, fp16 ones with their GradScaler included, holds as well
    for _, row in result.trials[result.trials["feasible"].eq(True)].iterrows():
        assert fp32 - train_plainly(task, trial_policy(row), 10) <= budget + noise, row["trial"]


def test_resuming_in_another_mode_is_refused(trained):
    workload, _, out = trained
    with pytest.raises(UserError, match=r"different mode \(mode train, 10 steps, now weights\)"):
        search(workload, FP16_SPACE, SearchConfig(budget=0.02, **FAST), out)


def test_a_budget_below_the_noise_floor_warns(trained, caplog, monkeypatch):
    workload, result, out = trained
    module = sys.modules["autoprec.tune._search._objective"]
    monkeypatch.setattr(module, "noise_floor", lambda *a, **k: NoiseFloor(10, (0.5, 0.6), 0.5))
    search(workload, FP16_SPACE, SearchConfig(budget=0.01, **{**TRAIN, "trials": 1}, study_name="low"), out)
    assert "budget 0.01 is below the noise floor 0.1" in caplog.text


@pytest.mark.slow
def test_a_finished_train_mode_study_whose_result_stands_measures_no_noise_floor_again(tmp_path, monkeypatch):
    workload = prepare(load_task(MODELS / "underflow_mlp.py"), "cpu")
    result = search(workload, FP16_SPACE, SearchConfig(budget=0.02, **{**TRAIN, "trials": 2}), tmp_path)

    def measured_again(*args, **kwargs):
        raise AssertionError("the noise floor was measured again")

    monkeypatch.setattr(sys.modules["autoprec.tune._search._objective"], "noise_floor", measured_again)
    again = search(workload, FP16_SPACE, SearchConfig(budget=0.02, **{**TRAIN, "trials": 2}), tmp_path)
    assert again.noise == result.noise and again.policy.measured["noise"] == result.policy.measured["noise"]
    for edited in ({"train_steps": 10, "fp32_metrics_by_seed": "12", "fp32_seed0_repeat": 1.0},
                   {"train_steps": 10, "fp32_metrics_by_seed": [1.0, float("nan")], "fp32_seed0_repeat": 1.0},
                   {"train_steps": True, "fp32_metrics_by_seed": [1.0], "fp32_seed0_repeat": 1.0}):  # fmt: skip
        assert NoiseFloor.from_dict(edited) is None  # a hand-edited file: the noise floor is measured again
    assert NoiseFloor.from_dict(result.noise.to_dict()) == result.noise
    # a policy file whose noise floor is of another step count is not this study's result: measured again
    data = json.loads((tmp_path / "policy.json").read_text())
    data["measured"]["noise"]["train_steps"] = 999
    (tmp_path / "policy.json").write_text(json.dumps(data))
    with pytest.raises(AssertionError, match="the noise floor was measured again"):
        search(workload, FP16_SPACE, SearchConfig(budget=0.02, **{**TRAIN, "trials": 2}), tmp_path)


def picky_model(tmp_path):
    """overflow_mlp.py, but its forward refuses to train under autocast (it evaluates fine)."""
    src = (
        (MODELS / "overflow_mlp.py")
        .read_text()
        .replace(
            "    def forward(self, x):\n",
            "    def forward(self, x):\n        if self.training and torch.is_autocast_enabled('cpu'):\n"
            "            raise RuntimeError('no autocast here')\n",
        )
    )
    (tmp_path / "picky.py").write_text(src)
    return tmp_path / "picky.py"


@pytest.mark.slow
def test_offered_fp8_per_gemm_a_search_keeps_the_breaking_weight_gradient_high_precision_and_the_forward_fp8(
    tmp_path, gpu_contract_on
):
    """wgrad_breaks.py: proj's weight gradient breaks in fp8 and fp8-rowwise (the profile rules them out for it), its
    forward does not: with fp8 priced faster, the search gives proj a format that keeps wgrad in high precision and
    runs its forward in fp8, and the other layers plain fp8. On an H100's rules: where torchao only emulates fp8 (a
    CPU's own), the profile does not time it and a timed search does not offer it."""
    workload = prepare(load_task(MODELS / "wgrad_breaks.py"), "cpu")
    offered = ["fp32", "bf16", "fp8", "fp8-rowwise", "fp8-fwd-dgrad", "fp8-rowwise-fwd-dgrad"]
    space = space_from_dict({"default": ["fp32"], "layers": {"Linear": offered}, "trials": 6})
    with using(FormatClock(FASTER)):
        result = search(workload, space, SearchConfig(budget=0.05, **FAST), tmp_path)
    assert {"fp8", "fp8-rowwise"}.isdisjoint(result.choices.layers["proj"])
    assert "its wgrad GEMM measures" in result.choices.excluded["proj"]["fp8"]
    proj, inp = result.policy.layers["proj"], result.policy.layers["inp"]
    gemms = proj.family.fp8_gemms(proj)
    assert gemms is not None and gemms.fprop and "wgrad" in gemms.high_precision, result.policy.layers
    assert inp.family.fp8_gemms(inp) is not None and not inp.family.fp8_gemms(inp).high_precision


def test_a_step_that_fails_in_some_format_makes_that_trial_infeasible_not_the_search(tmp_path):
    # A model that cannot train under autocast (it evaluates fine): the bf16 candidate fails to step,
    # and that trial is infeasible with the reason, while the search goes on.
    workload = prepare(load_task(picky_model(tmp_path)), "cpu")
    from autoprec.tune._search._objective import Judge, Objective

    prof_space = space_from_dict({"default": ["fp32", "bf16"], "layers": {"Linear": ["fp32"]}})
    choices = build_choices(fake_profile([("fc1", "fp32", 0, 1.0, True, False)]), prof_space, 0.05, torch.device("cpu"))
    objective = Objective(
        workload,
        choices,
        prof_space,
        Judge(workload, SearchConfig(budget=0.05, **FAST), 0.0, budgets=Budgets((0.05,))),
        SearchConfig(budget=0.05, **FAST),
    )
    import optuna

    study = optuna.create_study(direction="maximize")
    study.enqueue_trial({"default": "bf16"})
    study.optimize(objective, n_trials=1)
    trial = study.trials[0]
    assert trial.state.name == "COMPLETE" and trial.user_attrs["feasible"] is False
    assert "no autocast here" in trial.user_attrs["error"]


def test_the_objective_judges_a_trial_against_the_resolved_budget_not_the_config_budget_as_given(monkeypatch):
    """The judge holds the record the pipeline resolved once: "10%" of an fp32 metric of 0.5 allows a drop of 0.05,
    so a trial dropping 0.06 is infeasible (and not timed), though 0.06 is below the 0.1 the config holds as given."""
    import optuna

    from autoprec.tune._core._budget import resolve_budgets
    from autoprec.tune._search._objective import Judge, Objective

    workload = prepare(load_task(MODELS / "overflow_mlp.py"), "cpu")
    config = SearchConfig(budget="10%", **FAST)
    budgets = resolve_budgets((config.budget,), lambda: 0.5)
    assert budgets.absolute == (0.05,) and budgets.given == {0.05: "10% of |fp32 metric 0.5| = 0.05"}
    choices = build_choices(fake_profile([("fc1", "fp32", 0, 1.0, True, False)]), SPACE, budgets.bound, torch.device("cpu"))
    judge = Judge(workload, config, 0.5, budgets=budgets)
    monkeypatch.setattr(judge, "safe_metric", lambda policy: (0.44, {}))
    objective = Objective(workload, choices, SPACE, judge, config)
    study = optuna.create_study(direction="maximize")
    study.enqueue_trial({"default": "bf16"})
    study.optimize(objective, n_trials=1)
    record = study.trials[0].user_attrs
    assert record["metric_drop"] == pytest.approx(0.06) and record["feasible"] is False and "step_ms" not in record
    assert study.trials[0].system_attrs["constraints:metric_drop_over_budget"] == pytest.approx(over_budget(0.06, 0.05))


@pytest.mark.parametrize("objectives", [1, 2])
def test_a_trials_timing_stops_early_when_its_rounds_place_it_against_the_finalists_or_settle(objectives):
    import optuna

    from autoprec.tune._search._objective import Judge, Objective

    workload = prepare(load_task(MODELS / "overflow_mlp.py"), "cpu")
    config = SearchConfig(budget=0.05, **{**FAST, "finalists": 2})
    choices = build_choices(fake_profile([("fc1", "fp32", 0, 1.0, True, False)]), SPACE, 0.05, torch.device("cpu"))
    objective = Objective(
        workload, choices, SPACE, Judge(workload, config, 0.0, budgets=Budgets((config.budget,))), config, objectives=objectives
    )
    study = optuna.create_study(directions=["maximize"] * objectives)

    def timed(speedup, **attrs):
        study.add_trial(
            optuna.trial.create_trial(values=[speedup] * objectives, user_attrs={"feasible": True, "speedup": speedup, **attrs})
        )

    def rounds(*speedups, fp32=10.0):
        return {"fp32": [fp32] * len(speedups), "policy": [fp32 / s for s in speedups]}

    timed(2.0, rounds=3)
    timed(2.0, rounds=3, reused_from=0)  # a repeat is not a second finalist
    timed(3.0)  # the all-fp32 trial or a repeat: not timed (no rounds), not counted
    enough = objective._settled(study.ask())
    assert not enough(rounds(1.2, 1.6, 1.9)) and not enough(rounds(2.1, 2.6, 2.9))  # fewer than 2 timed: no marks
    study.enqueue_trial({"default": "bf16"})
    warm = study.ask()  # a warm start (enqueued; an alternative, perhaps) counts: re-measured at the end, or ranked above
    for key, value in {"feasible": True, "speedup": 2.5, "rounds": 3}.items():
        warm.set_user_attr(key, value)
    study.tell(warm, [2.5] * objectives)
    assert "fixed_params" in study.trials[-1].system_attrs
    enough = objective._settled(study.ask())
    # every round slower than the 2nd fastest (2.0): its number does not matter, a search stops; a sweep keeps timing
    assert enough(rounds(1.1, 1.3, 1.45)) is (objectives == 1)
    assert enough(rounds(2.6, 2.9, 3.2)) is (objectives == 1)  # every round faster than the fastest (2.5): a finalist
    assert not enough(rounds(1.2, 1.6, 2.2))  # the rounds straddle the 2nd fastest and disagree: time on
    assert enough(rounds(2.4, 2.45, 2.5))  # within SETTLED of each other: settled
    assert enough(rounds(1.0, 1.02, 1.04))  # settled, whatever the marks


def test_the_eager_fp32_baseline_is_warmed_up_in_full_once_then_with_one_call(monkeypatch):
    import optuna

    from autoprec.tune._search import _objective as study_module
    from autoprec.tune._search._objective import Judge, Objective

    real, seen = study_module.interleaved_times, []

    def spy(work, device, config, **kw):
        seen.append(tuple(kw.get("warmed", ())))
        return real(work, device, config, **kw)

    monkeypatch.setattr(study_module, "interleaved_times", spy)
    workload = prepare(load_task(MODELS / "overflow_mlp.py"), "cpu")
    config = SearchConfig(budget=1e9, **FAST)  # every trial within budget: every one is timed
    prof = fake_profile([("fc1", "fp32", 0, 1.0, True, False), ("fc1", "bf16", 0, 0.5, True, False)])
    choices = build_choices(prof, SPACE, 1e9, torch.device("cpu"))
    objective = Objective(workload, choices, SPACE, Judge(workload, config, 0.0, budgets=Budgets((config.budget,))), config)
    study = optuna.create_study(direction="maximize")
    for params in ({"default": "fp32", "layer:fc1": "fp32"}, {"default": "bf16", "layer:fc1": "fp32"},
                   {"default": "bf16", "layer:fc1": "bf16"}):  # fmt: skip
        study.enqueue_trial(params)
    study.optimize(objective, n_trials=3)
    assert seen == [(), ("fp32",)]  # the all-fp32 trial is the baseline itself: not timed
    fp32 = study.trials[0]
    assert fp32.user_attrs["speedup"] == 1.0 and fp32.user_attrs["feasible"] and "step_ms" not in fp32.user_attrs


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    out = tmp_path_factory.mktemp("compiled")
    workload = prepare(load_task(MODELS / "overflow_mlp.py"), "cpu")
    config = SearchConfig(budget=0.05, compile=True, **{**FAST, "trials": 3})
    return workload, search(workload, SPACE, config, out), out


@pytest.mark.slow
def test_a_compiled_search_times_compiled_steps_and_says_so(compiled):
    workload, result, out = compiled
    m = result.policy.measured
    assert m["compiled"] is True and m["timing"].startswith("compiled after apply_policy")
    assert result.profile.compiled and json.loads((out / "profile.json").read_text())["compiled"] is True
    assert "profile: layer timing (forward + backward per format, compiled)" in result.cost["seconds"]
    timed = result.trials[result.trials["step_ms"].notna() & result.trials["reused_from"].isna()]  # all-fp32: not timed
    assert len(timed) and (timed["compile_s"] > 0).all()
    assert any(k.startswith("final re-measure: compiling") for k in result.cost["seconds"])
    assert all(r.compile_s > 0 for r in result.finals)


@pytest.mark.slow
def test_a_compiled_and_an_eager_search_are_different_studies(compiled):
    workload, _, out = compiled
    with pytest.raises(UserError, match=r"compile compiled, now eager"):
        search(workload, SPACE, SearchConfig(budget=0.05, compile=False, **{**FAST, "trials": 3}), out)


@pytest.mark.parametrize("mode", ["weights", "train"])
def test_an_alternative_that_cannot_train_is_a_row_with_its_error_not_a_crash(tmp_path, mode):
    # A model that cannot train under autocast: uniform bf16 (an alternative, never a trial here) fails in the
    # re-measure; the search still writes a policy, and the table and the policy file say why.
    workload = prepare(load_task(picky_model(tmp_path)), "cpu")
    space = space_from_dict({"default": ["fp32"], "layers": {"Linear": ["fp32", "fp16"]}, "trials": 2})
    train = {"mode": "train", "train_steps": 2, "noise_runs": 1} if mode == "train" else {}
    result = search(workload, space, SearchConfig(budget=0.05, **{**FAST, "trials": 2}, **train), tmp_path / "out")
    row = result.finals.by_name("uniform bf16")
    assert not row.runs and "no autocast here" in row.error
    assert "no autocast here" in result.policy.measured["results"]["uniform bf16"]["error"]
    from autoprec.tune._report._results import search_summary
    from autoprec.tune._report._show import show_policy

    assert "uniform bf16 failed: RuntimeError: no autocast here" in search_summary(result)
    assert "uniform bf16 failed: RuntimeError: no autocast here" in show_policy(result.policy)


def test_a_journal_with_a_torn_last_line_keeps_every_complete_trial_and_says_what_was_dropped(tmp_path, caplog):
    workload = prepare(load_task(MODELS / "overflow_mlp.py"), "cpu")
    out = tmp_path / "out"
    search(workload, SPACE, SearchConfig(budget=0.05, **{**FAST, "trials": 2}), out)
    journal = out / "study.journal"
    data = journal.read_bytes()
    journal.write_bytes(data[:-25])  # the last record cut short, as by a kill mid-write
    with caplog.at_level("WARNING", logger="autoprec"):
        again = search(workload, SPACE, SearchConfig(budget=0.05, **{**FAST, "trials": 3}), out)
    assert "study.journal: its last line was cut short" in caplog.text and "is dropped" in caplog.text
    assert (again.trials["state"] == "COMPLETE").sum() >= 2
    third = search(workload, SPACE, SearchConfig(budget=0.05, **{**FAST, "trials": 3}), out)  # parses cleanly now
    assert len(third.trials) == len(again.trials)


def test_the_summary_says_when_step_times_were_too_noisy_to_rank(searched):
    import dataclasses

    from autoprec.tune._report._results import search_summary

    _, result, _ = searched
    quiet = dataclasses.replace(result, finals=result.finals.with_each(spread=0.01))
    loud = dataclasses.replace(result, finals=result.finals.with_each(spread=0.9))
    assert "too wide to rank" not in search_summary(quiet)
    assert "note: step times spread up to 90.0% even over more rounds: too wide to rank" in search_summary(loud)


def test_the_summary_names_a_host_bound_step_by_the_devices_busy_time_and_a_faster_cuda_graphs_row(searched):
    """As the H200 measured GPT-2-small: uniform bf16 28.0 ms a step with the GPU busy 8.5 ms of it, 10.7 ms under
    CUDA graphs. The note gives the busy time, and CUDA graphs are said as a way to compile, not chosen."""
    import dataclasses

    from builders import measurement

    from autoprec.tune._core._names import BF16_GRAPHS
    from autoprec.tune._core._records import Finals
    from autoprec.tune._report._results import search_summary

    _, result, _ = searched
    rows = [
        dataclasses.replace(r, step_ms=28.0, busy_ms=8.5, host_ms=28.0, host_bound=True) if r.candidate == "uniform bf16" else r
        for r in result.finals
    ]
    top = max(r.speedup for r in rows if r.feasible)
    rows.append(measurement(BF16_GRAPHS, step_ms=10.7, busy_ms=7.9, speedup=3 * top))
    text = search_summary(dataclasses.replace(result, finals=Finals(rows)))
    assert "note: host-bound: uniform bf16 (the device busy 8.5 of 28 ms a step)" in text
    assert "note: uniform bf16 under CUDA graphs measured 3.00x the chosen policy's speed" in text
    assert "mode='reduce-overhead'" in text


def test_cuda_graphs_add_uniform_bf16_under_them_to_the_remeasure_never_chosen_and_a_finished_study_measures_it(
    tmp_path, monkeypatch
):
    """--cuda-graphs on a CPU standing in for a GPU (compile_model recorded, not run): the re-measure times uniform
    bf16 compiled with mode="reduce-overhead" beside the policies, and the choice never takes it; asked for on a
    finished study that did not measure it, the finalists are measured again rather than the earlier result kept."""
    from autoprec import devices
    from autoprec.tune._core._names import BF16_GRAPHS

    modes = []
    monkeypatch.setattr("autoprec.tune._measure._trainer.compile_model", lambda model, mode=None: modes.append(mode) or model)
    monkeypatch.setattr(devices.lookup("cpu"), "cuda_graphs", True)
    workload = prepare(load_task(MODELS / "overflow_mlp.py"), "cpu")
    fast = {**FAST, "trials": 2, "compile": True}
    first = search(workload, SPACE, SearchConfig(budget=0.05, **fast), tmp_path)
    assert BF16_GRAPHS not in first.finals.names and "reduce-overhead" not in modes
    again = search(workload, SPACE, SearchConfig(budget=0.05, cuda_graphs=True, **fast), tmp_path)
    assert BF16_GRAPHS in again.finals.names and "reduce-overhead" in modes
    assert Policy.from_dict(again.policy.to_dict()).measured["chosen"] != BF16_GRAPHS


# ---- peak memory: measured for every timed candidate, a limit, an objective ----------------------------------


def test_every_re_measured_candidate_and_timed_trial_records_its_peak_memory(searched):
    _, result, out = searched
    ran = [r for r in result.finals if r.runs]
    assert ran and all(r.peak_bytes and r.peak_bytes > 0 for r in ran)
    assert result.finals.by_name("fp32").memory_saving == 0.0
    timed = result.trials[result.trials["rounds"].notna()]
    assert len(timed) and timed["peak_bytes"].notna().all()
    m = result.policy.measured
    assert m["memory"].startswith("CPU tensor allocations") and m["objective"] == "speed" and "max_memory" not in m
    assert m["results"]["policy"]["peak_bytes"] == result.finals.by_name(m["chosen"]).peak_bytes
    assert "peak memory" in result.summary() and "peak_bytes" in (out / "finalists.csv").read_text().splitlines()[0]


@pytest.fixture
def fake_memory(monkeypatch):
    from autoprec.tune._measure._trainer import Trainer

    monkeypatch.setattr(Trainer, "peak_memory", made_up_peak)


def test_a_memory_limit_makes_every_candidate_over_it_infeasible(tmp_path, fake_memory):
    workload = prepare(load_task(MODELS / "overflow_mlp.py"), "cpu")
    result = search(workload, SPACE, SearchConfig(budget=0.05, max_memory=9000, **FAST), tmp_path)
    fp32 = result.finals.by_name("fp32")
    assert fp32.peak_bytes == 12000 and not fp32.fits and not fp32.feasible  # fp32 itself does not fit
    for r in result.finals:
        assert r.fits == (r.peak_bytes is not None and r.peak_bytes <= 9000)
    assert result.finals.by_name(result.policy.measured["chosen"]).fits
    over = result.trials[result.trials["peak_bytes"].gt(9000)]
    assert len(over) and not over["feasible"].any() and over["error"].str.contains("over --max-memory").all()
    assert result.policy.measured["max_memory"] == 9000
    assert "would not fit --max-memory" in result.summary() and "no: over --max-memory" in result.summary()
    done = load_study(tmp_path).get_trials(states=(optuna.trial.TrialState.COMPLETE,))
    keys = {"constraints:metric_drop_over_budget", "constraints:peak_memory_over_limit"}
    assert done and all(keys <= set(t.system_attrs) for t in done)  # the sampler needs the same constraints on every trial
    for t in done:  # both as shares of their limits: the sampler sums them to rank infeasible trials
        if t.user_attrs.get("peak_bytes") is not None:
            assert t.system_attrs["constraints:peak_memory_over_limit"] == pytest.approx(t.user_attrs["peak_bytes"] / 9000 - 1)
        if t.system_attrs["constraints:metric_drop_over_budget"] < INFEASIBLE:
            assert t.system_attrs["constraints:metric_drop_over_budget"] == pytest.approx(t.user_attrs["metric_drop"] / 0.05 - 1)


def test_the_drop_constraint_is_a_share_of_the_budget_that_stays_below_a_broken_metrics():
    assert over_budget(0.03, 0.02) == pytest.approx(0.5) and over_budget(0.01, 0.02) == pytest.approx(-0.5)
    assert over_budget(0.5, 0.0) == 0.5  # a zero budget: the plain excess
    assert over_budget(1.0, 1e-12) < INFEASIBLE  # a tiny budget still ranks a finite drop before a non-finite one


def test_the_memory_objective_chooses_the_smallest_peak_within_budget(tmp_path, fake_memory):
    workload = prepare(load_task(MODELS / "overflow_mlp.py"), "cpu")
    result = search(workload, SPACE, SearchConfig(budget=0.05, objective="memory", **FAST), tmp_path)
    feasible = [r for r in result.finals if r.feasible and r.candidate != "TF32"]
    chosen = result.finals.by_name(result.policy.measured["chosen"])
    assert chosen.peak_bytes == min(r.peak_bytes for r in feasible)
    assert chosen.peak_bytes < 12000 and "smallest peak memory" in result.policy.measured["why"]
    assert result.policy.measured["objective"] == "memory"
    assert [d.name for d in load_study(tmp_path).directions] == ["MINIMIZE"]


def load_study(out):
    storage = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(str(out / "study.journal")))
    return optuna.load_study(study_name="overflow_mlp", storage=storage)


def test_memory_settings_are_checked_and_a_new_limit_is_another_study(tmp_path, fake_memory):
    with pytest.raises(ValueError, match=r"objective must be one of speed, memory, flops, but got 'fast'"):
        SearchConfig(budget=0.1, objective="fast")
    with pytest.raises(ValueError, match=r"max_memory must be a number of bytes >= 1.*'40GB'"):
        SearchConfig(budget=0.1, max_memory="40GB")
    workload = prepare(load_task(MODELS / "overflow_mlp.py"), "cpu")
    search(workload, SPACE, SearchConfig(budget=0.05, max_memory=20000, **{**FAST, "trials": 2}), tmp_path)
    with pytest.raises(UserError, match=r"different max_memory \(max_memory 20000, now 30000\).*--study"):
        search(workload, SPACE, SearchConfig(budget=0.05, max_memory=30000, **{**FAST, "trials": 2}), tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(10))
def test_under_heavy_timing_noise_the_written_policy_is_never_ranked_above_an_alternative_it_was_not_separated_from(
    tmp_path, timings, seed
):
    """A search beside a CPU hog (step times x exp(N(0, 0.8)): spreads around ±50%) on a device where every bf16 layer
    pays: what it writes is an alternative, or measured faster than the fastest alternative and separated from it by
    the spread (else, a safer policy than that alternative, with the tie recorded); and its true step time (the
    clock's, without noise) is never slower than the faster of fp32 and uniform bf16 by more than the measured spread
    of the tie it was chosen in (its own where none)."""
    import copy

    from autoprec.tune._core._names import BF16, FP32
    from autoprec.tune._measure._timing import separated

    clock = timings("faster", noise=0.8, seed=seed)
    workload = prepare(load_task(MODELS / "overflow_mlp.py"), "cpu")
    # the final re-measure's default rounds (TINY's 2, doubled, leave a median of 4 draws at ±50% to chance)
    final = dataclasses.replace(TINY, rounds=SearchConfig(budget=0.05).final_timing.rounds)
    result = search(workload, SPACE, SearchConfig(budget=0.05, **{**FAST, "final_timing": final}), tmp_path)
    m = result.policy.measured
    alternatives = [result.finals.by_name(a) for a in (FP32, BF16, m["greedy"]) if a in result.finals.names]
    fastest = max((r for r in alternatives if r.feasible), key=lambda r: r.speedup)
    picked = result.finals.by_name(m["chosen"])
    if m["chosen"] not in {r.candidate for r in alternatives}:
        # separated from it and faster, or (a safer policy than a riskier alternative) the tie is recorded and said
        clear = separated(picked, fastest) and picked.speedup > fastest.speedup
        assert clear or fastest.candidate in m["not_separated"], fastest.candidate
    true_s = {name: clock.seconds(apply_policy(copy.deepcopy(workload.model), policy))
              for name, policy in (("chosen", result.policy), (FP32, Policy()), (BF16, Policy(layers={"": "bf16"})))}  # fmt: skip
    # inside a tie the written one is the one with the fewest layers below fp32 (fp32 itself, tied with bf16): its
    # true slowdown is bounded by the widest spread of the tie, the one the summary's first line reports
    tie = max([picked.spread] + [result.finals.by_name(n).spread for n in m["not_separated"]])
    assert true_s["chosen"] / min(true_s[FP32], true_s[BF16]) - 1 <= tie


def test_on_a_noisy_device_a_trial_is_timed_the_fewest_rounds_an_interquartile_spread_needs():
    import optuna

    from autoprec.tune._core._config import NOISE_ROUNDS, NOISY_SPREAD
    from autoprec.tune._decide._trials import device_noise
    from autoprec.tune._measure._timing import noisiest
    from autoprec.tune._search._objective import Judge, Objective

    workload = prepare(load_task(MODELS / "overflow_mlp.py"), "cpu")
    config = SearchConfig(budget=0.05, **{**FAST, "finalists": 2})
    choices = build_choices(fake_profile([("fc1", "fp32", 0, 1.0, True, False)]), SPACE, 0.05, torch.device("cpu"))
    objective = Objective(workload, choices, SPACE, Judge(workload, config, 0.0, budgets=Budgets((config.budget,))), config)

    def rounds(*speedups):
        return {"fp32": [10.0] * len(speedups), "policy": [10.0 / s for s in speedups]}

    close = rounds(1.7, 1.85, 1.95, 1.75)  # they straddle the marks (1.8, 1.9) and disagree, within NOISY_SPREAD
    wide = rounds(1.1, 1.6, 2.4, 1.3)  # ... and spread beyond it
    assert noisiest(close) < NOISY_SPREAD < noisiest(wide)
    for spread, timed_rounds, noisy in ((0.05, 5, False), (2 * NOISY_SPREAD, 5, True), (2 * NOISY_SPREAD, 3, False)):
        study = optuna.create_study(direction="maximize")
        for speedup in (1.5, 1.6, 1.7, 1.8, 1.9):  # five trials timed, each as spread as the device
            attrs = {"feasible": True, "speedup": speedup, "rounds": timed_rounds, "spread": spread}
            study.add_trial(optuna.trial.create_trial(value=speedup, user_attrs=attrs))
        # a spread from 3 rounds is their whole range: it does not count as the device's noise
        assert (device_noise(study) is not None) is (timed_rounds >= NOISE_ROUNDS)
        enough = objective._settled(study.ask())
        assert enough(close) is noisy  # on a noisy device NOISE_ROUNDS are enough, else they are timed on
        assert enough(wide)  # its own rounds are as noisy: more would not rank it either
        for samples in (close, wide):  # never fewer than NOISE_ROUNDS
            assert not enough({k: v[: NOISE_ROUNDS - 1] for k, v in samples.items()})


# ---- a format a layer cannot run in on this device (issue 38) -----------------------------------


def _seq_task(model: torch.nn.Module, shape: tuple[int, ...]):
    from autoprec.tune._api import task_from_objects

    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(*shape, generator=g), torch.randint(0, 4, (shape[0],), generator=g)) for _ in range(2)]
    return task_from_objects(model, lambda m, b: torch.nn.functional.cross_entropy(m(b[0]).float(), b[1]), data, data)


@pytest.mark.slow
def test_a_layer_type_with_no_fp16_kernel_here_searches_to_a_policy_that_keeps_it_out_of_fp16(tmp_path):
    workload = prepare(_seq_task(WithNoFp16Kernel(), (8, 32)), "cpu")
    offered = ["fp32", "bf16", "fp16"]
    no_fp16 = f"{NoFp16Kernel.__module__}.{NoFp16Kernel.__qualname__}"
    space = space_from_dict({"default": ["fp32", "bf16"], "layers": {no_fp16: offered, "Linear": offered}, "trials": 6})
    result = search(workload, space, SearchConfig(budget=0.05, **FAST), tmp_path)
    assert result.choices.excluded["rnn"]["fp16"].startswith("fp16 failed: RuntimeError: could not create a primitive")
    assert (tmp_path / "policy.json").is_file() and str(result.policy.layers.get("rnn", "fp32")) != "fp16"


class _Recurrent(torch.nn.Module):
    """An LSTM, a GRU and a BatchNorm: on a CPU with bf16 kernels but no fp16 LSTM (an AMD EPYC with avx512_bf16),
    the default space's fp16 LSTM failed the profile with oneDNN's error."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lstm = torch.nn.LSTM(8, 16, batch_first=True)
        self.gru = torch.nn.GRU(16, 16, batch_first=True)
        self.norm = torch.nn.BatchNorm1d(16)
        self.head = torch.nn.Linear(16, 4)

    def forward(self, x):
        h, _ = self.gru(self.lstm(x)[0])
        return self.head(self.norm(h.mean(1)))


@pytest.mark.slow
def test_an_lstm_a_gru_and_a_batchnorm_search_to_a_policy_in_the_default_space(tmp_path):
    from autoprec.tune._core._space import load_space

    workload = prepare(_seq_task(_Recurrent(), (8, 3, 8)), "cpu")
    space = dataclasses.replace(load_space(), trials=4)
    result = search(workload, space, SearchConfig(budget=0.05, **{**FAST, "trials": 4}), tmp_path)
    assert (tmp_path / "policy.json").is_file() and {"lstm", "gru", "head"} <= set(result.choices.layers)
    failed = [r for r in result.profile.rows if r.status == "unsupported" and "failed" in r.reason]
    assert all(r.reason.startswith(f"{r.format} failed: ") for r in failed)  # its error, one line
