"""autoprec/tune/_measure/_validate.py and `autoprec validate`: a policy trained beside its baseline over a horizon, and
the phase switch measured where the budget does not hold at the end (tests/models/drifting_mlp.py's arithmetic: each
training step adds the number of layers below bf16 to a drift its metric reads)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from autoprec import Policy, load_policy
from autoprec.tune import load_task, prepare
from autoprec.tune._cli import main
from autoprec.tune._commands.validate import summary
from autoprec.tune._core._budget import Budget
from autoprec.tune._measure._validate import raised, validate, with_switch

MODELS = Path(__file__).parent / "models"


@pytest.fixture(scope="module")
def drifting():
    return prepare(load_task(MODELS / "drifting_mlp.py"), "cpu")


def test_the_baseline_beside_itself_is_the_same_run_step_for_step(drifting):
    """Both arms start from the same weights and take the same batches with the same random draws: the fp32 policy
    beside the fp32 baseline is the same run, bit for bit (the brute-force reference)."""
    v = validate(drifting, Policy(), 6, every=2, budget=0.0)
    assert [p.policy_loss for p in v.curve] == [p.baseline_loss for p in v.curve]
    assert [p.step for p in v.curve if p.drop is not None] == [2, 4, 6] and v.final_drop == 0.0
    assert v.holds and v.switch is None


def test_a_drop_past_the_budget_at_the_end_gets_a_measured_switch_from_before_it_grew(drifting):
    policy = Policy(layers={"fc1": "fp16", "fc2": "bf16"})
    v = validate(drifting, policy, 20, every=2, budget=0.1)
    drops = {p.step: p.drop for p in v.curve if p.drop is not None}
    assert drops == {s: pytest.approx(s / 100) for s in range(2, 21, 2)}  # one layer below bf16: 0.01 a step
    assert v.final_drop == pytest.approx(0.2) and v.holds is False
    # past half the budget at step 6: raised from the last evaluation before, step 4; the drift stops there
    assert v.switch is not None and (v.switch.step, v.switch.from_fraction) == (4, 0.2)
    assert v.switch.layers == {"fc1": "bf16"} and v.switch.drop == pytest.approx(0.04)
    assert v.switch.phase() == {"from_fraction": 0.2, "layers": {"fc1": "bf16"}}
    assert all(p.switched_loss is None for p in v.curve[:4]) and all(p.switched_loss is not None for p in v.curve[4:])
    # what was trained is the schedule written: the policy with that phase, switched in place by follow_schedule
    assert v.switch.policy == Policy(
        layers={"fc1": "fp16", "fc2": "bf16"}, phases=[{"from_fraction": 0.2, "layers": {"fc1": "bf16"}}]
    )


def test_a_scheduled_policy_trains_following_its_schedule(drifting):
    """The schedule validate proposed, validated itself: one layer below bf16 for its first 6 of 20 steps, so the drift
    stops at 0.06 (each step the model reads the formats apply_policy's switch left on it)."""
    policy = Policy(layers={"fc1": "fp16", "fc2": "fp8"}, phases=[{"from_fraction": 0.15, "layers": {"fc2": "bf16"}},
                                                                  {"from_fraction": 0.3, "layers": {"fc1": "bf16"}}])  # fmt: skip
    v = validate(drifting, policy, 20, every=2, budget=0.1)
    drops = {p.step: p.drop for p in v.curve if p.drop is not None}
    # steps 0-2: two layers below bf16, 3-5: one, from step 6 (0.3 of 20) none
    assert drops[2] == pytest.approx(0.04) and drops[6] == pytest.approx(0.09) and drops[20] == pytest.approx(0.09)
    assert v.holds and v.switch is None


def test_a_switch_merged_into_a_phase_is_said_as_written_and_a_schedule_with_nothing_to_raise_gets_none(drifting):
    """A second review: a phase that lowers fc1 later (the switch's step holding nothing below bf16) was said as '0
    layers raised' with an empty phase; a switch merged into an existing phase was said with another fraction."""
    lowers = Policy(layers={"fc1": "bf16"}, phases=[{"from_fraction": 0.5, "layers": {"fc1": "fp16"}}])
    v = validate(drifting, lowers, 20, every=4, budget=0.001)
    assert v.holds is False and v.switch is not None and v.switch.layers == {"fc1": "bf16"}
    # the phase at 0.5 is where fc1 went fp16: raised there, so the schedule is bf16 throughout
    assert v.switch.policy.phase_layers(len(v.switch.policy.phases)) == {"fc1": "bf16"} and v.switch.phase() is None
    assert "1 layer kept at bf16 from step 8 on, where later phases lowered them" in " ".join(summary(v).split())
    at_phase = Policy(layers={"fc1": "fp16", "fc2": "fp16"}, phases=[{"from_fraction": 0.2, "layers": {"fc2": "bf16"}}])
    v = validate(drifting, at_phase, 20, every=4, budget=0.2)  # 0.08 at step 4, past half (0.1) at 8: switch at 4
    assert (
        v.switch is not None
        and v.switch.step == 4
        and v.switch.phase() == {"from_fraction": 0.2, "layers": {"fc2": "bf16", "fc1": "bf16"}}
    )
    assert v.switch.from_fraction == 0.2
    high = Policy(layers={"fc1": "fp32"}, phases=[{"from_fraction": 0.5, "layers": {"fc1": "bf16"}}])
    assert validate(drifting, high, 4, every=2, budget=0.0).switch is None  # nothing below bf16 anywhere


def test_with_switch_raises_from_the_step_on_in_every_later_phase_and_merges_phases():
    layers = {"": "bf16", "a": "nvfp4", "b": "fp8", "c": "fp32"}
    policy = Policy(layers=layers, phases=[{"from_fraction": 0.5, "layers": {"b": "bf16"}},
                                           {"from_fraction": 0.75, "layers": {"c": "fp8"}}])  # fmt: skip
    # from step 5 of 20: a and b raised there; the 0.5 phase (b to bf16) is then a no-op, gone; c's fp8 raised
    assert with_switch(policy, 5, 20) == Policy(layers=layers, phases=[{"from_fraction": 0.25, "layers": {"a": "bf16", "b": "bf16"}},
                                                                       {"from_fraction": 0.75, "layers": {"c": "bf16"}}])  # fmt: skip
    # at a phase's own start: merged into it; from step 0: the first part itself
    assert with_switch(policy, 10, 20).phases[0].layers == {"a": "bf16", "b": "bf16"}
    raised_c = [{"from_fraction": 0.75, "layers": {"c": "bf16"}}]  # c leaves fp32 there as the policy says, to bf16
    assert with_switch(policy, 0, 20) == Policy(layers={**layers, "a": "bf16", "b": "bf16"}, phases=raised_c)
    # a step that is not a round share (7 of 30) starts the phase at that step for the run it was measured on
    assert with_switch(Policy(layers={"a": "fp8"}), 7, 30).phases[0].start_step(30) == 7


def test_a_relative_budget_is_resolved_against_the_baselines_final_metric(drifting):
    v = validate(drifting, Policy(layers={"fc1": "fp16"}), 4, every=2, budget=Budget(0.5, relative=True))
    assert v.budget == 0.0  # the baseline's metric is 0 here: half of it is 0
    assert raised(Policy(layers={"": "bf16", "a": "fp8", "b": "fp32", "c": "nvfp4"}).layers) == {"a": "bf16", "c": "bf16"}
    assert raised(Policy(layers={"": "fp16", "b": "fp32"}).layers) == {"": "bf16"}  # an fp16 root is raised too


@pytest.mark.parametrize(("steps", "every"), [(0, None), (True, None), (4, 0)])
def test_validate_refuses_steps_it_cannot_take(drifting, steps, every):
    with pytest.raises(ValueError, match="must be a whole number >= 1"):
        validate(drifting, Policy(), steps, every=every)


def test_the_command_writes_the_curve_says_the_verdict_and_the_switch(tmp_path, capsys):
    policy = tmp_path / "policy.json"
    Policy(layers={"fc1": "fp16"}, measured={"budget": 0.1}).save(policy)
    argv = ["validate", str(MODELS / "drifting_mlp.py"), str(policy), "--steps", "20", "--every", "2", "--device", "cpu"]
    assert main([*argv, "--out", str(tmp_path / "out"), "--quiet"]) == 0  # the recorded budget, 0.1
    assert main([*argv, "--out", str(tmp_path / "out")]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "the budget does not hold: metric drop 0.2 > 0.1 after 20 steps" in out
    assert (
        'measured switch: 1 layer raised to bf16 from step 4 (20% of the run, later phases too): drop 0.04, the budget holds; its phase in policy_scheduled.json: {"from_fraction": 0.2, "layers": {"fc1": "bf16"}}'
        in out
    )
    for name in ("validate.csv", "validate.json", "validate.png"):
        assert (tmp_path / "out" / name).is_file(), name
    assert "policy_scheduled.json: the policy with the switch as a phase" in out
    scheduled = load_policy(tmp_path / "out" / "policy_scheduled.json")
    assert scheduled.in_phase(1).layers == {"fc1": "bf16"} and scheduled.phases[0].start_step(20) == 4
    assert scheduled.measured == {
        "budget": 0.1,
        "validated": {"steps": 20, "baseline": "fp32", "budget": 0.1, "drop": pytest.approx(0.04)},
    }
    rows = (tmp_path / "out" / "validate.csv").read_text().splitlines()
    assert rows[0].startswith("step,baseline_loss,policy_loss") and len(rows) == 21
    scheduled = tmp_path / "out" / "policy_scheduled.json"
    # validating the proposed schedule where it lies would replace it: refused (a review found it deleted)
    again = ["validate", str(MODELS / "drifting_mlp.py"), str(scheduled), "--steps", "20", "--device", "cpu"]
    assert main([*again, "--out", str(tmp_path / "out")]) == 2
    assert "which is the policy given; give --out another folder" in capsys.readouterr().err and scheduled.is_file()
    assert main([*argv, "--out", str(tmp_path / "out"), "--budget", "0.5", "--quiet"]) == 0  # holds: no switch
    assert not scheduled.exists()  # the earlier run's, not this one's answer
    scheduled.write_text('{"version": 1, "layers": {}}')  # a policy validate did not write stays
    assert main([*argv, "--out", str(tmp_path / "out"), "--budget", "0.5", "--quiet"]) == 0 and scheduled.exists()
    assert main([*argv, "--out", str(tmp_path / "json"), "--budget", "0.5", "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["holds"] is True and record["switch"] is None and record["final_drop"] == pytest.approx(0.2)


@pytest.mark.parametrize(
    ("extra", "said"),
    [(["--steps", "0"], "--steps 0: give the training steps"), (["--steps", "4", "--every", "9"], "--every 9: give a whole"),
     (["--steps", "4", "--budget", "lots"], "--budget lots: a budget must be a number")],
)  # fmt: skip
def test_a_mistake_is_one_line_and_exit_2(tmp_path, capsys, extra, said):
    policy = tmp_path / "policy.json"
    Policy(layers={"fc1": "fp16"}).save(policy)
    code = main(["validate", str(MODELS / "drifting_mlp.py"), str(policy), *extra, "--device", "cpu", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and said in err, err


NAN_FP16 = """
import math
import random

import torch
from torch import nn

from autoprec.apply import applied_summary


def build_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def batches(split):
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(4, 8, generator=g), torch.randint(0, 4, (4,), generator=g))]


def loss_fn(model, batch):
    x, y = batch
    x = x * random.uniform(0.5, 1.5)  # an augmentation drawn from Python's generator
    return nn.functional.cross_entropy(model(x).float(), y)


def evaluate(model):
    summary = applied_summary(model)
    lowered = summary is not None and any(str(r.format) == "fp16" for r in summary.layers.values())
    return math.nan if lowered else -random.random()  # an evaluation that draws too
"""


def test_an_augmentation_and_an_evaluation_drawn_from_pythons_generator_are_the_same_in_both_arms(tmp_path):
    """A review found only torch's generator seeded per step: fp32 beside fp32 differed with random.uniform."""
    path = tmp_path / "model.py"
    path.write_text(NAN_FP16, encoding="utf-8")
    v = validate(prepare(load_task(path), "cpu"), Policy(), 4, every=2, budget=0.0)
    assert [p.policy_loss for p in v.curve] == [p.baseline_loss for p in v.curve] and v.final_drop == 0.0


def test_a_metric_that_goes_non_finite_is_past_the_budget_and_written_as_null(tmp_path, capsys):
    """A review found a NaN drop took no switch step (NaN > x is False) and json.dumps(allow_nan=False) raised."""
    path = tmp_path / "model.py"
    path.write_text(NAN_FP16, encoding="utf-8")
    v = validate(prepare(load_task(path), "cpu"), Policy(layers={"0": "fp16"}), 4, every=2, budget=0.1)
    assert v.holds is False and v.switch is not None and v.switch.step == 0  # raised from the start
    policy = tmp_path / "policy.json"
    Policy(layers={"0": "fp16"}).save(policy)
    argv = ["validate", str(path), str(policy), "--steps", "4", "--every", "2", "--budget", "0.1", "--device", "cpu"]
    assert main([*argv, "--out", str(tmp_path / "out"), "--json"]) == 0  # the switch (all bf16) holds
    record = json.loads(capsys.readouterr().out)
    assert record["final_drop"] is None and record["holds"] is False
    # said as the policy raised throughout, not as a phase from 0 (which no policy file can hold)
    assert main([*argv, "--out", str(tmp_path / "out")]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "1 layer raised to bf16 from the start (the drop passed half the budget at the first evaluation, step 2)" in out
    assert "its phase in" not in out and "call autoprec.follow_schedule" not in out
    assert load_policy(tmp_path / "out" / "policy_scheduled.json").layers == {"0": "bf16"}


@pytest.mark.parametrize(
    ("layers", "extra", "said"),
    [
        ({"nope": "bf16"}, [], "apply_policy refuses this policy for"),
        ({"fc1": "fp16"}, ["--seed", str(10**14)], "--seed 100000000000000: give"),
    ],
    ids=["a policy of another model", "a seed past NumPy's"],
)
def test_a_policy_of_another_model_and_a_seed_too_large_are_one_line(tmp_path, capsys, layers, extra, said):
    policy = tmp_path / "policy.json"
    Policy(layers=layers).save(policy)
    argv = ["validate", str(MODELS / "drifting_mlp.py"), str(policy), "--steps", "2", *extra, "--device", "cpu"]
    code = main([*argv, "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("autoprec: error")]
    assert code == 2 and len(errors) == 1 and said in errors[0] and "Traceback" not in err, err
