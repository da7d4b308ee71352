"""The pipeline search and sweep share: its plan is checked before anything is written, its time budget is kept
or said to be overrun, and a full disk is named (its finalists: tests/test_finalists.py)."""

import dataclasses
from pathlib import Path

import pytest

from autoprec.tune import SearchConfig, load_task, prepare
from autoprec.tune._core._budget import Budget, Budgets, resolve_budgets
from autoprec.tune._core._names import GREEDY
from autoprec.tune._core._space import space_from_dict
from autoprec.tune._search import _pipeline as pipeline
from autoprec.tune._search._pipeline import search_plan
from autoprec.tune._search._sweeper import sweep_plan

MODELS = Path(__file__).parent / "models"


def test_a_plan_that_cannot_run_is_refused_before_anything_is_written(tmp_path):
    """A run's budgets live in one place: a sweep's in its plan, a search's in SearchConfig.budget. A sweep given a
    config budget too (a second, contradictory bound) and a search given none are refused, naming the value and
    the fix, before the fp32 metric is evaluated or a file written."""
    workload = prepare(load_task(MODELS / "overflow_mlp.py"), "cpu")
    space = space_from_dict({"layers": {"Linear": ["fp32"]}})
    with pytest.raises(
        ValueError, match=r"budgets are its own list \(0,1%\), so config.budget='0.5' would be a second one: leave it out"
    ):
        pipeline.run(workload, space, SearchConfig(budget=0.5), tmp_path / "a", sweep_plan("0,1%"))
    with pytest.raises(ValueError, match=r"config.budget='2%' would be a second one"):
        pipeline.run(workload, space, SearchConfig(budget="2%"), tmp_path / "a", sweep_plan([0, "1%"]))
    with pytest.raises(ValueError, match=r"a search needs config.budget, e.g. SearchConfig\(budget=0.01\)"):
        pipeline.run(workload, space, SearchConfig(), tmp_path / "b", search_plan())
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    assert "fp32_metric" not in vars(workload)  # the cached property was never read: nothing evaluated
    with pytest.raises(ValueError, match="a search's budget is its SearchConfig.budget, not the plan's"):
        dataclasses.replace(search_plan(), budgets=(Budget(0.1),))
    with pytest.raises(ValueError, match="a sweep's plan needs its budgets"):
        dataclasses.replace(sweep_plan("0.1"), budgets=())


def test_search_and_sweep_plans_differ_only_in_budgets_objectives_and_file_names():
    one, many = search_plan(), sweep_plan((0.0, "1%"))
    assert (one.budgets, one.objectives, one.policy_file(0.01), one.trials_file) == ((), 1, "policy.json", "trials.csv")
    assert (many.objectives, many.policy_file(0.01), many.trials_file) == (2, "policy-budget-0.01.json", "sweep_trials.csv")
    assert many.budgets == (Budget(0.0), Budget(0.01, relative=True))  # as given: resolved by the run, once
    assert one.given_budgets(SearchConfig(budget="1%")) == (Budget(0.01, relative=True),)
    assert one.given_budgets(SearchConfig(budget=0.01)) == (Budget(0.01),) and many.given_budgets(SearchConfig()) == many.budgets
    assert one.greedy_name(0.01, Budgets((0.01,))) == GREEDY and many.greedy_name(0.01, Budgets((0.0, 0.01))) == f"{GREEDY} 0.01"
    # two budgets the user gave that resolve to one are one budget: one policy file, the greedy policy's plain name
    assert many.greedy_name(0.01, resolve_budgets(many.budgets, lambda: 0.0)) == GREEDY


def test_a_relative_budget_is_resolved_once_from_the_fp32_metric_the_profile_measures(tmp_path, monkeypatch):
    """SearchConfig keeps "1%" as given; the pipeline resolves it against _metric.workload_fp32_metric, the one (checked)
    evaluation of the fp32 model the profile reads too, and every stage after reads that record: the study's bound,
    the policy's budget and how it was given."""
    from short_timing import FAST_PROFILE, TINY

    from autoprec import load_policy
    from autoprec.tune._measure import _metric as metric
    from autoprec.tune._search._pipeline import search

    calls, real = [], metric.checked_fp32_metric
    monkeypatch.setattr(metric, "checked_fp32_metric", lambda workload: calls.append(1) or real(workload))
    workload = prepare(load_task(MODELS / "overflow_mlp.py"), "cpu")
    space = space_from_dict({"default": ["fp32", "bf16"], "layers": {"Linear": ["fp32", "bf16"]}})
    config = SearchConfig(
        budget="1%", trials=2, timing=TINY, final_timing=TINY, finalists=1, progress=False, profile=FAST_PROFILE
    )
    assert config.budget == Budget(0.01, relative=True)
    told = []
    result = search(workload, space, config, tmp_path, announce=told.append)
    assert len(calls) == 1  # the budget's resolution and the profile: one fp32 metric, evaluated (twice) once
    fp32 = result.profile.fp32_metric
    [budgets] = told
    assert budgets.absolute == (float(f"{0.01 * abs(fp32):.4g}"),) and budgets.bound == budgets.absolute[0]
    measured = load_policy(tmp_path / "policy.json").measured
    assert measured["budget"] == budgets.bound and measured["budget_given"] == budgets.given[budgets.bound]
    assert measured["budget_given"] == f"1% of |fp32 metric {fp32:.6g}| = {0.01 * abs(fp32):.4g}"
    assert _study_key(tmp_path)["budget"] == repr(budgets.bound)  # the study is the resolved budget's


def _study_key(out):
    import optuna

    from autoprec.tune._search._storage import KEY_ATTR

    storage = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(str(out / "study.journal")))
    [summary] = optuna.get_all_study_summaries(storage)
    study = optuna.load_study(study_name=summary.study_name, storage=storage)
    return study.trials[0].user_attrs[KEY_ATTR]


def test_the_final_cap_is_a_share_of_the_whole_search_and_none_when_only_re_measuring(monkeypatch):
    import time

    from autoprec.tune._core._config import FINAL_SHARE

    now = time.perf_counter()
    monkeypatch.setattr(pipeline.time, "perf_counter", lambda: now)  # the clock stands still: no load moves the answer
    from autoprec.tune._measure._timing import Stopwatch

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

    from autoprec.tune._core._config import BUDGET_FINAL_SHARE
    from autoprec.tune._search._pipeline import search

    class Deadline(Exception):
        pass

    def trials(study, objective, target, *, progress=True, after_trial=None):
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

    from autoprec.tune._search._pipeline import search

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
        pipeline._say_if_overrun(60.0, 60.0 * 1.2, {"the profile": 60.0})  # within the stated tolerance: nothing
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
        pipeline.run(workload, space, SearchConfig(budget=0.1, storage=url), tmp_path / "out", search_plan())
    assert "s3cret" not in str(err.value) and "alice:***@db.example:5432/autoprec" in str(err.value)


def test_the_overrun_line_after_a_resume_says_this_runs_time_in_parts_that_add_up_to_it(monkeypatch, tmp_path, caplog):
    """After a resume the line read "took 3.4 min (trials: 4.7 min, ...)": its parts came from the cost table, which
    counts the earlier runs' trials too. Here an earlier run's trials are 30 min of the cost table."""
    import re

    from short_timing import FAST_PROFILE, TINY

    from autoprec.tune._search._pipeline import search

    real = pipeline.trial_costs

    def with_an_earlier_run(study, watch):
        real(study, watch)
        watch.add("trials: measuring step times", 1800.0)  # what a resumed study's earlier trials add

    monkeypatch.setattr(pipeline, "trial_costs", with_an_earlier_run)
    workload = prepare(load_task(MODELS / "overflow_mlp.py"), "cpu")
    space = space_from_dict({"default": ["fp32", "bf16"], "layers": {"Linear": ["fp32", "bf16"]}})
    config = SearchConfig(budget=0.05, time_budget=1e-4, timing=TINY, final_timing=TINY, profile=FAST_PROFILE, progress=False)
    with caplog.at_level("WARNING", logger="autoprec"):
        search(workload, space, config, tmp_path)
    [line] = [r.message for r in caplog.records if " overrun: the search took " in r.message]
    whole = float(re.search(r"the search took ([0-9.]+) min", line).group(1))
    parts = [float(m) for m in re.findall(r"([0-9.]+) min", line.split("(", 1)[1].split(")")[0])]
    assert "the profile" in line and "the trials" in line and "the final re-measure" in line and "the rest" in line
    assert all(p <= whole for p in parts) and abs(sum(parts) - whole) <= 0.05 * (len(parts) + 1), line  # rounding only


def _small_search(tmp_path, **changes):
    from short_timing import FAST_PROFILE, TINY

    from autoprec.tune._search._pipeline import search

    workload = prepare(load_task(MODELS / "overflow_mlp.py"), "cpu")
    space = space_from_dict({"default": ["fp32", "bf16"], "layers": {"Linear": ["fp32", "bf16"]}})
    config = SearchConfig(budget=0.05, trials=4, timing=TINY, final_timing=TINY, finalists=1, profile=FAST_PROFILE,
                          progress=False, **changes)  # fmt: skip
    return search(workload, space, config, tmp_path)


def test_a_search_stopped_in_its_trials_leaves_every_trial_it_finished_in_the_trial_log(tmp_path, monkeypatch):
    """A probe stopped at its deadline lost its trials: trials.csv was written at the end only. It is written after
    each trial (whole, renamed into place), and the final re-measure's rounds so far after each round."""
    import csv

    from autoprec.tune._search import _objective as objective_module

    class Stopped(BaseException):  # a deadline's kill, Ctrl-C: no handler of a trial's failure takes it
        pass

    real = objective_module.Objective.__call__
    ran = []

    def stopped_after_one(self, trial):  # one: on a device where bf16 is far slower, the search stops after two
        if len(ran) == 1:
            raise Stopped
        ran.append(trial.number)
        return real(self, trial)

    monkeypatch.setattr(objective_module.Objective, "__call__", stopped_after_one)
    with pytest.raises(Stopped):
        _small_search(tmp_path)
    rows = list(csv.DictReader(open(tmp_path / "trials.csv")))
    assert [(int(r["trial"]), r["(default)"]) for r in rows if r["state"] == "COMPLETE"] == [(0, "fp32")]
    assert not list(tmp_path.glob(".trials.csv.*"))  # no temporary file left beside it

    monkeypatch.setattr(objective_module.Objective, "__call__", real)
    written = []
    real_write = pipeline.write_atomically

    def watch(path, write):
        written.append(path.name)
        if path.name == "finalists.partial.csv" and written.count(path.name) == 2:
            real_write(path, write)
            raise Stopped  # killed after the second round's rows were written
        return real_write(path, write)

    monkeypatch.setattr(pipeline, "write_atomically", watch)
    with pytest.raises(Stopped):
        _small_search(tmp_path / "again")
    partial = list(csv.DictReader(open(tmp_path / "again" / "finalists.partial.csv")))
    assert {"fp32", "uniform bf16"} <= {r["candidate"] for r in partial}
    # the rounds so far: two, or one for a candidate retired after the first (where bf16 is far slower, it may be)
    assert all(int(r["rounds"]) in (1, 2) and float(r["step_ms"]) > 0 for r in partial)
    fp32 = next(r for r in partial if r["candidate"] == "fp32")  # the baseline is timed in every round
    assert float(fp32["speedup"]) == 1.0 and int(fp32["rounds"]) == 2
    assert not (tmp_path / "again" / "finalists.csv").exists()  # a result, written only as a whole
    assert written.count("trials.csv") >= 2  # after each of its trials


def test_no_trial_s_trainer_holds_its_state_on_the_device_into_the_final_re_measure(tmp_path, monkeypatch):
    """The trials' eager fp32 baseline and each trial's candidate stayed on the device (a policy model is freed by
    no reference count: its forward is bound to it) beside every candidate the final re-measure builds."""
    import weakref

    from autoprec.tune._core import _memory as memory
    from autoprec.tune._measure import _trainer as trainer_module

    built = weakref.WeakSet()
    real_init = trainer_module.Trainer.__init__

    def init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        built.add(self)

    monkeypatch.setattr(trainer_module.Trainer, "__init__", init)
    holding = []
    real_final = pipeline.final_remeasure

    def final(*args, **kwargs):
        holding.append(sum(memory.state_bytes(t.state()) > 0 for t in list(built)))
        return real_final(*args, **kwargs)

    monkeypatch.setattr(pipeline, "final_remeasure", final)
    result = _small_search(tmp_path)
    assert len(result.trials) >= 2 and holding == [0]
    assert sum(memory.state_bytes(t.state()) > 0 for t in list(built)) == 0
