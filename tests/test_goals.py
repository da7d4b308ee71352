"""Goals are registered types (autoprec/tune/_decide/_goals.py): a goal defined here, outside autoprec/, is a choice of
SearchConfig and --objective, and a search optimises it end to end (its direction, its trial values, its finalists,
its choice among the re-measured, the study key and the report), with nothing in autoprec/ naming it."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from pathlib import Path

import optuna
import pandas as pd
import pytest
import torch
from short_timing import FAST_PROFILE, TINY

from autoprec.formats import Format
from autoprec.policy import ROOT, Policy
from autoprec.tune import (
    ALTERNATIVES,
    MEMORY,
    SPEED,
    Finals,
    Goal,
    SearchConfig,
    TrialRecord,
    choose,
    goal_named,
    goals,
    load_task,
    prepare,
    register_goal,
    unregister_goal,
)
from autoprec.tune._core._names import NOT_A_POLICY
from autoprec.tune._core._space import space_from_dict
from autoprec.tune._decide._flops import FLOPS
from autoprec.tune._measure._choices import policy_from_params
from autoprec.tune._search._pipeline import search
from autoprec.tune._search._sweeper import pareto_front

MODELS = Path(__file__).parent / "models"
SPACE = space_from_dict({"default": ["fp32", "bf16"], "layers": {"Linear": ["fp32", "bf16", "fp16"]}, "trials": 12})


def fp16_layers(policy: Policy) -> int:
    return sum(fmt is Format.FP16 for name, fmt in policy.layers.items() if name != ROOT)


class MostFp16(Goal):
    """A toy goal: the most layers in fp16 within budget (say, for a device whose fp16 is its fastest format), the
    faster among equals. Deterministic whatever the timings: a count over the policy."""

    name = "most-fp16"
    label = "fp16 layers"
    direction = "maximize"
    summary = "the most fp16 layers"
    infeasible = -1.0
    chosen_for = "the most fp16 layers within budget"

    def value(self, record: TrialRecord, policy: Policy) -> float | None:
        return float(fp16_layers(policy))

    def choose(self, finals: Finals, candidates: Mapping, alternatives: Collection[str] = ALTERNATIVES) -> tuple[str, str]:
        feasible = [r for r in finals if r.feasible and r.candidate not in NOT_A_POLICY]
        if not feasible:
            return "fp32", "nothing within budget"
        count = {r.candidate: fp16_layers(getattr(candidates[r.candidate], "policy", candidates[r.candidate])) for r in feasible}
        most = max(count.values())
        name, why = choose(Finals(r for r in feasible if count[r.candidate] == most), candidates, ())
        return name, f"the most fp16 layers within budget ({most}); among them: {why}"


@pytest.fixture
def most_fp16():
    """The toy goal, registered for the test and unregistered after it."""
    goal = MostFp16()
    register_goal(goal)
    try:
        yield goal
    finally:
        unregister_goal(goal.name)


def test_a_registered_goal_is_a_choice_of_the_config_and_the_command_line(most_fp16, capsys):
    assert goals() == (SPEED, MEMORY, FLOPS, most_fp16) and goal_named("Most-FP16") is most_fp16
    assert SearchConfig(budget=0.1, objective="most-fp16").objective is most_fp16
    assert SearchConfig(budget=0.1, objective=most_fp16).objective is most_fp16
    with pytest.raises(ValueError, match=r"objective must be one of speed, memory, flops, most-fp16, but got 'fast'"):
        SearchConfig(budget=0.1, objective="fast")
    with pytest.raises(ValueError, match=r"goal 'most-fp16' is already registered .*test_goals.MostFp16"):
        register_goal(MostFp16)

    from autoprec.tune._cli import build_parser
    from autoprec.tune._commands.search import search_settings

    args = build_parser().parse_args(["search", "m.py", "--device", "cpu", "--objective", "most-fp16"])
    assert search_settings(args, torch.device("cpu")).objective is most_fp16
    with pytest.raises(SystemExit):
        build_parser().parse_args(["search", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "--objective {speed,memory,flops,most-fp16}" in help_text
    assert (
        "training-step speed (default), the smallest peak memory (for a model or batch that must fit), the largest "
        "predicted step speedup over bf16 on a --target device (the step-time predictor's, not a measurement), or the "
        "most fp16 layers" in help_text
    )


def test_an_unregistered_goal_is_no_choice_again():
    with pytest.raises(ValueError, match=r"objective must be one of speed, memory, flops, but got 'most-fp16'"):
        SearchConfig(budget=0.1, objective="most-fp16")
    with pytest.raises(ValueError, match=r"direction must be 'maximize' or 'minimize'"):
        register_goal(type("Sideways", (MostFp16,), {"name": "sideways", "direction": "up"}))
    assert [g.name for g in goals()] == ["speed", "memory", "flops"]


@pytest.mark.slow
def test_a_search_optimises_a_goal_defined_outside_autoprec(tmp_path, most_fp16, timings):
    timings("faster")  # fp16 pays as bf16 does: by speed, the tie goes to the safer bf16 (choose.choose)
    workload = prepare(load_task(MODELS / "overflow_mlp.py"), "cpu")
    config = SearchConfig(
        budget=0.05, objective="most-fp16", trials=12, timing=TINY, final_timing=TINY, finalists=2, progress=False,
        profile=FAST_PROFILE,
    )  # fmt: skip
    result = search(workload, SPACE, config, tmp_path)

    storage = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(str(tmp_path / "study.journal")))
    study = optuna.load_study(study_name="overflow_mlp", storage=storage)
    assert [d.name for d in study.directions] == ["MAXIMIZE"]
    first = min(study.trials, key=lambda t: t.number)
    assert first.user_attrs["autoprec:key"]["objectives"] == "fp16 layers"  # the goal's label in the study key
    done = [t for t in study.trials if t.state is optuna.trial.TrialState.COMPLETE]
    feasible = [t for t in done if TrialRecord.of(t).feasible]
    for t in done:  # every trial's value is the goal's: its fp16 layers, -1 where over budget
        expected = fp16_layers(policy_from_params(t.params, result.choices)) if TrialRecord.of(t).feasible else -1.0
        assert t.value == expected
    best = max(t.value for t in feasible)
    assert best >= 1  # fc1 and head may run in fp16 (big overflows it): the study found some

    # the written policy is the goal's best: the most fp16 layers of every trial within budget, chosen by its rule
    m = result.policy.measured
    assert m["objective"] == "most-fp16" and m["why"].startswith(f"the most fp16 layers within budget ({best:g})")
    assert fp16_layers(result.policy) == best and m["not_separated"] == []  # ties are a speed goal's
    assert "chosen for the most fp16 layers within budget" in result.summary()
    assert most_fp16.progress(study) == {"best_fp16_layers": f"{best:g}"}
    assert pareto_front(result.trials, most_fp16).empty  # no axis: no front


def test_the_built_in_goals_answer_as_the_tuner_asked_before():
    assert (SPEED.name, SPEED.label, SPEED.direction, SPEED.worst) == ("speed", "speedup", "maximize", 0.0)
    assert (MEMORY.name, MEMORY.label, MEMORY.direction) == ("memory", "peak memory", "minimize")
    assert SPEED.ranks_by_speed and not MEMORY.ranks_by_speed and MEMORY.needs_peak and not SPEED.needs_peak
    record = TrialRecord(feasible=True, speedup=1.5, peak_bytes=2 * 2**20)
    policy = Policy(layers={ROOT: Format.FP32})
    assert SPEED.trial_value(record, policy) == 1.5 and MEMORY.trial_value(record, policy) == 2.0
    over = TrialRecord(feasible=False, speedup=1.5, peak_bytes=2**20)
    assert SPEED.trial_value(over, policy) == 0.0 and MEMORY.trial_value(over, policy) == 1e9
    assert pareto_front(pd.DataFrame(columns=["feasible", "speedup", "metric_drop"]), SPEED).empty


def test_a_goal_under_a_label_another_goal_has_is_refused():
    """The study key records the label: two goals under one label would share, and clash in, one study."""
    from autoprec.tune._core._goal import Goal, goal_named, register_goal
    from autoprec.tune._decide._goals import MEMORY

    class Twin(Goal):
        name, label, direction, summary = "twin-memory", MEMORY.label, "maximize", "the largest peak memory"

        def value(self, record, policy):
            return 0.0

        def choose(self, finals, candidates, alternatives):
            return "fp32", ""

    with pytest.raises(ValueError, match=r"label 'peak memory' is goal 'memory''s"):
        register_goal(Twin)
    with pytest.raises(ValueError):
        goal_named("twin-memory")
