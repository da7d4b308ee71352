"""The finalists: every budget gets the same kinds of candidates (its greedy floor, its fastest trials, the safer
variant of its fastest), and the final re-measure times them on, stops or says so as the noise and its cap allow."""

import dataclasses
import types

from builders import finals

from autoprec import Policy
from autoprec.tune import SearchConfig
from autoprec.tune._core._budget import Budgets
from autoprec.tune._core._names import BF16, FP32, GREEDY
from autoprec.tune._core._records import Candidate
from autoprec.tune._decide._alternatives import Alternatives
from autoprec.tune._measure._choices import Choices
from autoprec.tune._search import _finalists as finalists
from autoprec.tune._search._pipeline import search_plan
from autoprec.tune._search._sweeper import sweep_plan

JUDGE = types.SimpleNamespace(budgets=Budgets((0.1,)))  # what final_remeasure reads of the judge: the study's bound


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

    def baselines(workload, space, prof, choices, budget, *, goal=None, cuda_graphs=False):
        return Alternatives(candidates={FP32: Candidate(fp32), GREEDY: Candidate(greedy[budget])}, notes={BF16: "left out here"})

    def fastest(study, choices, k, *, budget, exclude, goal):
        return {n: c for n, c in trials[budget].items() if c not in exclude}

    monkeypatch.setattr(finalists, "baselines", baselines)
    monkeypatch.setattr(finalists, "finalist_policies", fastest)
    started = types.SimpleNamespace(profile=None, choices=choices, study=None, budgets=Budgets((0.0, 0.1)))
    candidates, greedy_names, notes = finalists.gather_candidates(None, None, started, sweep_plan((0.0, 0.1)), 2)
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
    started.budgets = Budgets((0.1,))  # the resolved record, not the plan, says the budgets
    one, _, _ = finalists.gather_candidates(None, None, started, search_plan(), 2)
    assert list(one) == ["fp32", GREEDY, "trial 7"]  # one budget: the greedy policy keeps its plain name


def test_where_the_search_tries_the_fp8_all_gather_its_fastest_is_remeasured_with_that_setting_the_other_way(monkeypatch):
    choices = Choices(default=("bf16",), layers={"a": ("fp32", "bf16", "fp8"), "b": ("fp32", "bf16", "fp8")}, excluded={})
    choices = dataclasses.replace(choices, fp8_all_gather=True)  # a sharded search offering fp8 (tensorwise)
    fastest = Policy(layers={"": "bf16", "a": "fp8", "b": "bf16"}, fsdp_fp8_all_gather=True)
    trials = {"trial 4": Candidate(fastest), "trial 2": Candidate(Policy(layers={"": "bf16", "a": "bf16", "b": "fp8"}))}
    alts = Alternatives(candidates={FP32: Candidate(Policy(layers={"": "fp32", "a": "fp32", "b": "fp32"}))}, notes={})
    monkeypatch.setattr(finalists, "baselines", lambda *a, **kw: alts)
    monkeypatch.setattr(finalists, "finalist_policies", lambda *a, **kw: trials)
    started = types.SimpleNamespace(profile=None, choices=choices, study=None, budgets=Budgets((0.1,)))
    candidates, _, _ = finalists.gather_candidates(None, None, started, search_plan(), 2)
    assert list(candidates) == [FP32, "trial 4", "trial 2", "trial 4, fp16/fp8 -> bf16", "trial 4, fp8 all-gather off"]
    assert candidates["trial 4, fp8 all-gather off"].policy == dataclasses.replace(fastest, fsdp_fp8_all_gather=False)
    trials = {"trial 2": trials["trial 2"]}  # its fastest gathers in its own dtype: the other way is on
    candidates, _, _ = finalists.gather_candidates(None, None, started, search_plan(), 2)
    assert candidates["trial 2, fp8 all-gather on"].policy.fsdp_fp8_all_gather
    started.choices = dataclasses.replace(choices, fp8_all_gather=False)  # one device: no such variant
    assert not any("all-gather" in n for n in finalists.gather_candidates(None, None, started, search_plan(), 2)[0])


def test_a_noisy_final_remeasure_times_on_once_pooled_and_says_so_if_it_stays_noisy(monkeypatch, caplog):
    from autoprec.tune._measure._timing import Stopwatch

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

        monkeypatch.setattr(finalists, "remeasure", remeasure)
        caplog.clear()
        with caplog.at_level("WARNING", logger="autoprec"):
            measured = finalists.final_remeasure(None, {}, JUDGE, config, Stopwatch())
        rounds = config.final_timing.rounds
        assert calls == [(rounds, rounds)] and measured.noisiest() == spread  # one re-measure; a failed run's spread ignored
        assert len([r for r in caplog.records if "still spread up to" in r.message]) == warnings


def test_a_trial_timed_clearly_slower_than_the_fastest_is_not_re_measured():
    import optuna

    from autoprec.tune._decide._goals import MEMORY
    from autoprec.tune._measure._choices import LAYER_PARAM
    from autoprec.tune._search._finalists import finalist_policies

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
    from autoprec.tune._core._config import SETTLED_FINAL_ROUNDS
    from autoprec.tune._measure._timing import Stopwatch

    loud = {"fp32": [10.0, 10.1, 10.0, 9.0, 12.0], "x": [10.0, 20.0, 5.0, 9.0, 14.0]}  # unsettled: spreads wide
    asked = []

    def remeasure(workload, candidates, judge, budget, timing, **kw):
        short = {k: v[: SETTLED_FINAL_ROUNDS - 1] for k, v in loud.items()}
        asked.append((kw["enough"](short), kw["enough"](loud), kw["more"](loud)))
        return finals({"candidate": "fp32", "spread": 0.02, "rounds": 5}, {"candidate": "x", "spread": 0.6, "rounds": 5})

    monkeypatch.setattr(finalists, "remeasure", remeasure)
    config, watch = SearchConfig(budget=0.1, progress=False), Stopwatch()
    finalists.final_remeasure(None, {}, JUDGE, config, watch, cap_s=0.0)  # a cap long spent
    # fewer rounds than SETTLED_FINAL_ROUNDS: on; then stopped at the cap, and no more rounds (no warning promising them)
    assert asked == [(False, True, 0)]
    assert any("stopped at its cap" in name for name in watch.counts)
    assert watch.counts["final re-measure: whole-step timings (each round: every candidate's)"] == 10
    asked.clear()
    finalists.final_remeasure(None, {}, JUDGE, config, Stopwatch(), cap_s=None)  # no cap: the noisy machine's rounds
    assert asked == [(False, False, config.final_timing.rounds)]


def test_on_a_device_the_trials_found_too_noisy_the_final_remeasure_times_no_extra_rounds_and_says_so(monkeypatch, caplog):
    """A loaded machine's default searches stopped for noise after 6 trials, then sat in 35-60 s re-measure rounds
    (issue 38, 6): more rounds at that noise separate nothing. Its configured rounds only, and a plain line."""
    from autoprec.tune._measure._timing import Stopwatch

    loud = {"fp32": [10.0, 10.1, 10.0], "x": [10.0, 20.0, 5.0]}
    asked = []

    def remeasure(workload, candidates, judge, budget, timing, **kw):
        asked.append(kw["more"](loud))
        return finals({"candidate": "fp32", "spread": 0.02}, {"candidate": "x", "spread": 0.6})

    monkeypatch.setattr(finalists, "remeasure", remeasure)
    config = SearchConfig(budget=0.1, progress=False)
    with caplog.at_level("WARNING", logger="autoprec"):
        finalists.final_remeasure(None, {}, JUDGE, config, Stopwatch(), noisy_device=True)
    assert asked == [0]
    assert any("this machine is too noisy to separate these candidates" in r.message for r in caplog.records)
    asked.clear()
    finalists.final_remeasure(None, {}, JUDGE, config, Stopwatch(), noisy_device=False)
    assert asked == [config.final_timing.rounds]  # a device the trials found quiet: a noisy re-measure times on


def test_the_final_remeasure_times_no_more_a_candidate_every_step_of_which_was_grossly_slower_than_fp32s(monkeypatch):
    from autoprec.tune._core._config import GROSS_SLOWDOWN
    from autoprec.tune._measure._timing import Stopwatch

    asked = []

    def remeasure(workload, candidates, judge, budget, timing, **kw):
        asked.append(kw["retire"])
        return finals({"candidate": "fp32", "rounds": 5}, {"candidate": "uniform bf16", "rounds": 2})

    monkeypatch.setattr(finalists, "remeasure", remeasure)
    finalists.final_remeasure(None, {}, JUDGE, SearchConfig(budget=0.1, progress=False), Stopwatch())
    retire = asked[0]
    fp32 = [44.0, 46.0]
    # an AVX2 CPU's uniform bf16: every step 30x fp32's; its two rounds are its row, and fp32 always beats it
    assert retire({"fp32": fp32, "uniform bf16": [1373.0, 1380.0]}) == {"uniform bf16"}
    assert retire({"fp32": fp32[:1], "uniform bf16": [1373.0]}) == set()  # one round's stall is not a verdict
    edge = GROSS_SLOWDOWN * max(fp32)
    assert retire({"fp32": fp32, "slow": [edge * 1.01, edge * 0.99]}) == set()  # a round within the factor: timed on
    assert retire({"fp32": fp32, "trial 3": [40.0, 41.0]}) == set()
    assert retire({"uniform bf16": [1373.0, 1380.0]}) == set()  # no fp32 to hold it against: timed on
    # nothing else was within budget: fp32 is held against no one, however slow
    assert retire({"fp32": [839.0, 840.0], "uniform bf16": [79.0, 80.0]}) == set()


def test_a_candidate_within_budget_puts_a_grossly_slower_one_out_of_the_running_fp32_too():
    """On a GPU fp32's step takes 10x a bf16 one's: once a candidate within budget is that much faster, fp32 cannot
    win and is timed no more (its rounds stand, the speedups' denominator); one over budget puts no one out."""
    fp32, bf16 = [839.0, 840.0], [79.0, 80.0]
    retire = finalists.out_of_the_running({"uniform bf16"})
    assert retire({"fp32": fp32, "uniform bf16": bf16, "trial 2": [310.0, 311.0]}) == {"fp32"}  # 3.9x: timed on
    assert retire({"fp32": fp32, "uniform bf16": bf16, "trial 2": [330.0, 331.0]}) == {"fp32", "trial 2"}
    assert retire({"fp32": fp32[:1], "uniform bf16": bf16[:1]}) == set()  # one round is no verdict
    assert finalists.out_of_the_running(set())({"fp32": fp32, "uniform bf16": bf16}) == set()  # bf16 over budget


def test_the_final_remeasure_judges_the_metrics_first_and_retires_fp32_behind_a_gross_lead_within_the_smallest_budget(timings):
    """The re-measure itself on a device where bf16 steps are 7x faster than fp32's: within budget, uniform bf16 puts
    fp32 out of the running after two rounds; over the smallest budget (a sweep's), or with a memory limit (a faster
    candidate may not fit it), fp32 is timed every round. Each candidate's metric is evaluated once."""
    from pathlib import Path

    from short_timing import TINY

    from autoprec.tune import load_task, prepare
    from autoprec.tune._measure._timing import Stopwatch

    workload = prepare(load_task(Path(__file__).parent / "models" / "overflow_mlp.py"), "cpu")
    every = ["", "fc1", "big", "head"]
    candidates = {"fp32": Candidate(Policy(layers=dict.fromkeys(every, "fp32"))),
                  "uniform bf16": Candidate(Policy(layers=dict.fromkeys(every, "bf16")))}  # fmt: skip
    config = SearchConfig(budget=0.1, progress=False, final_timing=dataclasses.replace(TINY, rounds=6))

    def rounds(drop, budgets=(0.01,), **changes):
        judged = []

        def safe_metric(candidate):
            judged.append(candidate)
            return (0.5 if candidate is candidates["fp32"] else 0.5 - drop), {}

        judge = types.SimpleNamespace(fp32_metric=0.5, safe_metric=safe_metric, budgets=Budgets(budgets))
        timings({"half": 0.05, "fp8": 0.05})
        rows = finalists.final_remeasure(workload, candidates, judge, dataclasses.replace(config, **changes), Stopwatch())
        assert judged == list(candidates.values())  # once each, the timing's rows reuse them
        return rows.by_name("fp32").rounds, rows.by_name("uniform bf16").rounds

    assert rounds(0.0) == (2, 5)  # bf16's rounds agree by the 5th (all_settled)
    assert rounds(0.005, budgets=(0.001, 0.01)) == (5, 5)  # within the larger budget only
    assert rounds(0.0, max_memory=2**40) == (5, 5)


def _remeasure_with_trainers_watched(monkeypatch, timings, oom_after=None):
    """The final re-measure of four candidates of overflow_mlp on a device where bf16 steps are 7x faster than fp32's
    (fp32 out of the running after two rounds), `oom_after`: "trial 2"'s step raising CUDA's out-of-memory error from
    its nth step on (in its timed rounds). Returns the finals and, per timed block, the Trainers alive that still hold
    state on the device (weakly referenced: counting them keeps none alive) and the candidates still timed."""
    import weakref
    from pathlib import Path

    import torch
    from short_timing import TINY

    from autoprec.tune import load_task, prepare
    from autoprec.tune._core import _memory as memory
    from autoprec.tune._measure import _timing as timing
    from autoprec.tune._measure import _trainer as trainer_module
    from autoprec.tune._measure._timing import Stopwatch

    workload = prepare(load_task(Path(__file__).parent / "models" / "overflow_mlp.py"), "cpu")
    every = ["", "fc1", "big", "head"]
    candidates = {
        "fp32": Candidate(Policy(layers=dict.fromkeys(every, "fp32"))),
        "uniform bf16": Candidate(Policy(layers=dict.fromkeys(every, "bf16"))),
        "trial 2": Candidate(Policy(layers={**dict.fromkeys(every, "bf16"), "head": "fp32"})),
        "trial 5": Candidate(Policy(layers={**dict.fromkeys(every, "bf16"), "fc1": "fp32"})),
    }
    built = weakref.WeakSet()
    real_init, real_step = trainer_module.Trainer.__init__, trainer_module.Trainer.step

    def init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        built.add(self)

    def step(self, batch_index=None):
        if oom_after is not None and self.policy == candidates["trial 2"].policy and self.steps >= oom_after:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 5.40 GiB")
        return real_step(self, batch_index)

    monkeypatch.setattr(trainer_module.Trainer, "__init__", init)
    monkeypatch.setattr(trainer_module.Trainer, "step", step)
    clock = timings({"half": 1 / 7, "fp8": 1 / 7})
    blocks = []

    class Watching:
        def time(self, work, calls, device):
            holding = [t for t in list(built) if memory.state_bytes(t.state()) > 0]
            blocks.append(len(holding))
            return clock.time(work, calls, device)

    monkeypatch.setattr(timing, "CLOCK", Watching())
    judge = types.SimpleNamespace(fp32_metric=0.5, safe_metric=lambda c: (0.5, {}), budgets=Budgets((0.01,)))
    config = SearchConfig(budget=0.1, progress=False, final_timing=dataclasses.replace(TINY, rounds=6))
    rows = finalists.final_remeasure(workload, candidates, judge, config, Stopwatch())
    left = [t for t in list(built) if memory.state_bytes(t.state()) > 0]
    return rows, blocks, left


def test_a_candidate_out_of_memory_in_its_timed_rounds_is_infeasible_and_the_re_measure_goes_on(monkeypatch, timings):
    """At 9 or more candidates an H100 ran out of memory inside a timed round, uncaught: the search ended. The
    candidate that runs out is a finding about it (infeasible, its error said), never the end of the search."""
    rows, _, _ = _remeasure_with_trainers_watched(monkeypatch, timings, oom_after=4)  # built, warm, then a round in
    oom = rows.by_name("trial 2")
    assert not oom.runs and not oom.feasible and oom.rounds == 0
    assert "OutOfMemoryError: CUDA out of memory" in oom.error
    for name in ("uniform bf16", "trial 5"):
        assert rows.by_name(name).runs and rows.by_name(name).feasible and rows.by_name(name).rounds >= 2, name
    assert rows.by_name("fp32").rounds == 2  # out of the running all the same: the others' rounds go on


def test_only_the_candidates_still_timed_hold_their_state_on_the_device_during_the_re_measure(monkeypatch, timings):
    """Every candidate's trainer stayed alive through the final re-measure (about 5.4 GiB each on the Llama example):
    one put out of the running or out of memory frees its model and optimizer state at once (a policy model is
    freed by no reference count alone: its forward is bound to it), and none holds any once the re-measure ends."""
    rows, blocks, left = _remeasure_with_trainers_watched(monkeypatch, timings)
    assert max(blocks) <= 4 and blocks[-1] <= 3 and left == []  # fp32 out of the running after two rounds
    rows, blocks, left = _remeasure_with_trainers_watched(monkeypatch, timings, oom_after=4)
    assert max(blocks) <= 4 and blocks[-1] <= 2 and left == []  # and trial 2 out of memory: two still timed
    assert rows.by_name("uniform bf16").peak_bytes is not None and rows.by_name("fp32").peak_bytes is not None
