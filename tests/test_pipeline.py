"""The pipeline search and sweep share: its plan is checked before anything is written, and every budget gets
the same kinds of candidates (its greedy floor, its fastest trials, the safer variant of its fastest)."""

import types
from pathlib import Path

import pytest
from builders import finals

from autoprec import Policy
from autoprec.tune import SearchConfig, load_task, pipeline, prepare
from autoprec.tune.alternatives import BF16, FP32, GREEDY, Alternatives
from autoprec.tune.choices import Choices
from autoprec.tune.searcher import search_plan
from autoprec.tune.space import space_from_dict
from autoprec.tune.sweeper import sweep_plan
from autoprec.tune.trainer import Candidate

MODELS = Path(__file__).parent / "models"


def test_a_plan_that_cannot_run_is_refused_before_anything_is_written(tmp_path):
    workload = prepare(load_task(MODELS / "overflow_mlp.py"), "cpu")
    space = space_from_dict({"layers": {"Linear": ["fp32"]}})
    with pytest.raises(ValueError, match=r"ascending and not empty, but got \(0.1, 0.0\)"):
        pipeline.run(workload, space, SearchConfig(budget=0.1), tmp_path / "a", sweep_plan((0.1, 0.0)))
    with pytest.raises(ValueError, match=r"config.budget=0.01 and budgets up to 0.5"):
        pipeline.run(workload, space, SearchConfig(budget=0.01), tmp_path / "b", sweep_plan((0.0, 0.5)))
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_search_and_sweep_plans_differ_only_in_budgets_objectives_and_file_names():
    one, many = search_plan(0.01), sweep_plan((0.0, 0.01))
    assert (one.budgets, one.objectives, one.policy_file(0.01), one.trials_file) == ((0.01,), 1, "policy.json", "trials.csv")
    assert (many.objectives, many.policy_file(0.01), many.trials_file) == (2, "policy-budget-0.01.json", "sweep_trials.csv")
    assert one.greedy_name(0.01) == GREEDY and many.greedy_name(0.01) == f"{GREEDY} 0.01"


def test_every_budget_gets_its_greedy_floor_its_finalists_and_the_safer_variant_of_its_fastest(monkeypatch):
    choices = Choices(
        default=("fp32", "bf16"), layers={"a": ("fp32", "bf16", "fp16"), "b": ("fp32", "bf16", "fp16")}, excluded={}
    )
    fp32 = Policy(layers={"": "fp32", "a": "fp32", "b": "fp32"})
    greedy = {
        0.0: Policy(layers={"": "fp32", "a": "fp32", "b": "bf16"}),
        0.1: Policy(layers={"": "fp32", "a": "bf16", "b": "bf16"}),
    }
    trials = {  # budget -> its fastest trials, fastest first
        0.0: {"trial 3": Candidate(Policy(layers={"": "fp32", "a": "fp16", "b": "fp32"}))},
        0.1: {"trial 7": Candidate(Policy(layers={"": "fp32", "a": "fp16", "b": "fp16"})), "trial 3": Candidate(fp32)},
    }

    def baselines(workload, space, prof, choices, budget):
        return Alternatives(candidates={FP32: Candidate(fp32), GREEDY: Candidate(greedy[budget])}, notes={BF16: "left out here"})

    def finalists(study, choices, k, *, budget, exclude, goal):
        return {n: c for n, c in trials[budget].items() if c not in exclude}

    monkeypatch.setattr(pipeline, "baselines", baselines)
    monkeypatch.setattr(pipeline, "finalist_policies", finalists)
    started = types.SimpleNamespace(profile=None, choices=choices, study=None)
    candidates, greedy_names, notes = pipeline.gather_candidates(None, None, started, sweep_plan((0.0, 0.1)), 2)
    assert greedy_names == {0.0: "profile greedy 0", 0.1: "profile greedy 0.1"} and notes == {BF16: "left out here"}
    assert candidates["trial 3, fp16/fp8 -> bf16"].policy.layers["a"].value == "bf16"  # the 0 budget's fastest, made safer
    # the 0.1 budget's safer variant is its greedy policy, already there: measured once, under that name
    assert "trial 7, fp16/fp8 -> bf16" not in candidates and "trial 7" in candidates
    assert list(candidates) == [
        "fp32",
        "profile greedy 0",
        "profile greedy 0.1",
        "trial 3",
        "trial 3, fp16/fp8 -> bf16",
        "trial 7",
    ]
    one, _, _ = pipeline.gather_candidates(None, None, started, search_plan(0.1), 2)
    assert list(one) == ["fp32", GREEDY, "trial 7"]  # one budget: the greedy policy keeps its plain name


def test_a_noisy_final_remeasure_times_on_once_pooled_and_says_so_if_it_stays_noisy(monkeypatch, caplog):
    from autoprec.tune.cost import Stopwatch

    def table(spread):
        return finals({"candidate": "fp32", "spread": 0.02}, {"candidate": "x", "spread": spread},
                      {"candidate": "broken", "runs": False, "feasible": False, "spread": 3.0})  # fmt: skip

    config = SearchConfig(budget=0.1, progress=False)
    loud = {"fp32": [10.0, 10.1, 10.0], "x": [10.0, 20.0, 5.0]}
    for spread, warnings in ((0.1, 0), (0.6, 1)):
        calls = []

        def remeasure(workload, candidates, judge, budget, timing, calls=calls, spread=spread, **kw):
            calls.append((timing.rounds, kw["more"](loud)))  # how many rounds more a noisy first pass gets
            return table(spread)

        monkeypatch.setattr(pipeline, "remeasure", remeasure)
        caplog.clear()
        with caplog.at_level("WARNING", logger="autoprec"):
            measured = pipeline.final_remeasure(None, {}, None, config, Stopwatch())
        rounds = config.final_timing.rounds
        assert calls == [(rounds, rounds)] and measured.noisiest() == spread  # one re-measure; a failed run's spread ignored
        assert len([r for r in caplog.records if "still spread up to" in r.message]) == warnings


def test_a_trial_timed_clearly_slower_than_the_fastest_is_not_re_measured():
    import optuna

    from autoprec.tune.choices import LAYER_PARAM
    from autoprec.tune.goals import MEMORY
    from autoprec.tune.pipeline import finalist_policies

    choices = Choices(default=("fp32",), layers={"a": ("fp32", "bf16", "fp16"), "b": ("fp32", "bf16")}, excluded={})
    study = optuna.create_study(direction="maximize")
    dist = {LAYER_PARAM + "a": optuna.distributions.CategoricalDistribution(["fp32", "bf16", "fp16"]),
            LAYER_PARAM + "b": optuna.distributions.CategoricalDistribution(["fp32", "bf16"])}  # fmt: skip
    for (a, b), speedup, spread in [(("bf16", "bf16"), 2.0, 0.10), (("fp16", "bf16"), 1.85, 0.10), (("bf16", "fp32"), 1.5, 0.10)]:
        attrs = {"feasible": True, "speedup": speedup, "spread": spread, "metric_drop": 0.0, "rounds": 3}
        params = {LAYER_PARAM + "a": a, LAYER_PARAM + "b": b}
        study.add_trial(optuna.trial.create_trial(value=speedup, params=params, distributions=dist, user_attrs=attrs))
    # 1.85 * 1.05 reaches 2.0 * 0.95: inside the spreads, re-measured; 1.5 * 1.05 does not
    assert list(finalist_policies(study, choices, 3)) == ["trial 0", "trial 1"]
    assert list(finalist_policies(study, choices, 3, goal=MEMORY)) == []  # by memory: no peaks here, none


def test_past_its_cap_the_final_remeasure_stops_once_it_has_enough_rounds_and_times_no_more(monkeypatch):
    from autoprec.tune.config import SETTLED_FINAL_ROUNDS
    from autoprec.tune.cost import Stopwatch

    loud = {"fp32": [10.0, 10.1, 10.0, 9.0, 12.0], "x": [10.0, 20.0, 5.0, 9.0, 14.0]}  # unsettled: spreads wide
    asked = []

    def remeasure(workload, candidates, judge, budget, timing, **kw):
        short = {k: v[: SETTLED_FINAL_ROUNDS - 1] for k, v in loud.items()}
        asked.append((kw["enough"](short), kw["enough"](loud), kw["more"](loud)))
        return finals({"candidate": "fp32", "spread": 0.02, "rounds": 5}, {"candidate": "x", "spread": 0.6, "rounds": 5})

    monkeypatch.setattr(pipeline, "remeasure", remeasure)
    config, watch = SearchConfig(budget=0.1, progress=False), Stopwatch()
    pipeline.final_remeasure(None, {}, None, config, watch, cap_s=0.0)  # a cap long spent
    # fewer rounds than SETTLED_FINAL_ROUNDS: on; then stopped at the cap, and no more rounds (no warning promising them)
    assert asked == [(False, True, 0)]
    assert any("stopped at its cap" in name for name in watch.counts)
    assert watch.counts["final re-measure: whole-step timings (each round: every candidate's)"] == 10
    asked.clear()
    pipeline.final_remeasure(None, {}, None, config, Stopwatch(), cap_s=None)  # no cap: the noisy machine's rounds
    assert asked == [(False, False, config.final_timing.rounds)]


def test_the_final_cap_is_a_share_of_the_whole_search_and_none_when_only_re_measuring():
    import time

    from autoprec.tune.config import FINAL_SHARE
    from autoprec.tune.cost import Stopwatch

    watch = Stopwatch()
    watch.add("profile: layer timing", 30.0)
    watch.add("trials: measuring step times (an earlier run's trials too)", 50.0)
    now = time.perf_counter()
    assert pipeline._final_cap(SearchConfig(budget=0.1), watch, now, ran=3) == pytest.approx(FINAL_SHARE * 80.0, rel=1e-3)
    assert pipeline._final_cap(SearchConfig(budget=0.1, remeasure=True), watch, now, ran=0) is None
    within = pipeline._final_cap(SearchConfig(budget=0.1, time_budget=10.0), watch, now - 4.0, ran=3)
    assert 5.9 < within <= 6.0  # what is left of the time budget, less than the share


def test_a_time_budget_keeps_four_fifths_of_it_for_the_trials(monkeypatch, tmp_path):
    import time

    from short_timing import FAST_PROFILE, TINY

    from autoprec.tune.config import BUDGET_FINAL_SHARE
    from autoprec.tune.searcher import search

    class Deadline(Exception):
        pass

    def trials(study, objective, target, *, progress=True):
        raise Deadline(objective.deadline)  # what the trials were given, and nothing run

    monkeypatch.setattr(pipeline, "run_trials", trials)
    workload = prepare(load_task(MODELS / "overflow_mlp.py"), "cpu")
    space = space_from_dict({"default": ["fp32", "bf16"], "layers": {"Linear": ["fp32", "bf16"]}})
    config = SearchConfig(budget=0.05, time_budget=100.0, timing=TINY, final_timing=TINY, profile=FAST_PROFILE, progress=False)
    before = time.perf_counter()
    with pytest.raises(Deadline) as given:
        search(workload, space, config, tmp_path)
    after = time.perf_counter()
    # from the search's start (after `before`, before `after`): the final re-measure keeps a quarter of the trials' time
    share = 100.0 / (1 + BUDGET_FINAL_SHARE)
    assert BUDGET_FINAL_SHARE == 0.25 and before + share <= given.value.args[0] <= after + share


def test_on_a_device_the_trials_found_too_noisy_the_final_remeasure_times_no_extra_rounds_and_says_so(monkeypatch, caplog):
    """A loaded machine's default searches stopped for noise after 6 trials, then sat in 35-60 s re-measure rounds
    (issue 38, 6): more rounds at that noise separate nothing. Its configured rounds only, and a plain line."""
    from autoprec.tune.cost import Stopwatch

    loud = {"fp32": [10.0, 10.1, 10.0], "x": [10.0, 20.0, 5.0]}
    asked = []

    def remeasure(workload, candidates, judge, budget, timing, **kw):
        asked.append(kw["more"](loud))
        return finals({"candidate": "fp32", "spread": 0.02}, {"candidate": "x", "spread": 0.6})

    monkeypatch.setattr(pipeline, "remeasure", remeasure)
    config = SearchConfig(budget=0.1, progress=False)
    with caplog.at_level("WARNING", logger="autoprec"):
        pipeline.final_remeasure(None, {}, None, config, Stopwatch(), noisy_device=True)
    assert asked == [0]
    assert any("this machine is too noisy to separate these candidates" in r.message for r in caplog.records)
    asked.clear()
    pipeline.final_remeasure(None, {}, None, config, Stopwatch(), noisy_device=False)
    assert asked == [config.final_timing.rounds]  # a device the trials found quiet: a noisy re-measure times on


def test_a_time_budget_the_profile_used_up_or_the_search_overran_is_said_with_where_the_time_went(monkeypatch, tmp_path, caplog):
    """`--time-budget 4 --compile` ran 0 of 30 trials because the profile used it all, and said nothing (issue 38, 5)."""
    from short_timing import FAST_PROFILE, TINY

    from autoprec.tune.searcher import search

    workload = prepare(load_task(MODELS / "overflow_mlp.py"), "cpu")
    space = space_from_dict({"default": ["fp32", "bf16"], "layers": {"Linear": ["fp32", "bf16"]}})
    config = SearchConfig(budget=0.05, time_budget=1e-4, timing=TINY, final_timing=TINY, profile=FAST_PROFILE, progress=False)
    with caplog.at_level("WARNING", logger="autoprec"):
        result = search(workload, space, config, tmp_path)
    said = [r.message for r in caplog.records]
    assert any("the profile alone took" in m and "no trial runs" in m for m in said), said
    assert any(m.startswith("--time-budget 0.0 min overrun: the search took") and "profile" in m for m in said), said
    assert result.policy.measured["chosen"]  # an answer all the same, from the alternatives
    caplog.clear()
    with caplog.at_level("WARNING", logger="autoprec"):
        pipeline._say_if_overrun(60.0, 60.0 * 1.2, pipeline.Stopwatch())  # within the stated tolerance: nothing
    assert not caplog.records


def test_a_full_disk_while_a_database_holds_the_study_names_it_without_its_password(tmp_path, monkeypatch):
    import errno

    from autoprec import UserError

    workload = prepare(load_task(MODELS / "overflow_mlp.py"), "cpu")
    space = space_from_dict({"layers": {"Linear": ["fp32"]}})
    url = "postgresql+psycopg2://alice:s3cret-pw@db.example:5432/autoprec"

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")  # no file name: the study's write, say

    monkeypatch.setattr(pipeline, "_run", full)
    with pytest.raises(UserError, match="no space left") as err:
        pipeline.run(workload, space, SearchConfig(budget=0.1, storage=url), tmp_path / "out", search_plan(0.1))
    assert "s3cret" not in str(err.value) and "alice:***@db.example:5432/autoprec" in str(err.value)
