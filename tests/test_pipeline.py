"""The pipeline search and sweep share: its plan is checked before anything is written, its time budget is kept
or said to be overrun, and a full disk is named (its finalists: tests/test_finalists.py)."""

from pathlib import Path

import pytest

from autoprec.tune import SearchConfig, load_task, pipeline, prepare
from autoprec.tune.alternatives import GREEDY
from autoprec.tune.searcher import search_plan
from autoprec.tune.space import space_from_dict
from autoprec.tune.sweeper import sweep_plan

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


def test_the_final_cap_is_a_share_of_the_whole_search_and_none_when_only_re_measuring(monkeypatch):
    import time

    from autoprec.tune.config import FINAL_SHARE

    now = time.perf_counter()
    monkeypatch.setattr(pipeline.time, "perf_counter", lambda: now)  # the clock stands still: no load moves the answer
    from autoprec.tune.cost import Stopwatch

    watch = Stopwatch()
    watch.add("profile: layer timing", 30.0)
    watch.add("trials: measuring step times (an earlier run's trials too)", 50.0)
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
