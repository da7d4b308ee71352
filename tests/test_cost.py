"""Where a search's time goes, and the repeated work it keeps out: repeated layer shapes are timed once,
a policy proposed twice is measured once, the all-fp32 trial reuses the profile's metric."""

import time

import pytest
from short_timing import FAST_PROFILE, TINY
from timings import FASTER, FormatClock, using

from autoprec import Policy
from autoprec.tune import SearchConfig, load_task, prepare, profile
from autoprec.tune._core._records import Measured
from autoprec.tune._core._space import space_from_dict
from autoprec.tune._measure._timing import Stopwatch
from autoprec.tune._report._results import cost_rows, search_summary
from autoprec.tune._search._objective import Judge
from autoprec.tune._search._pipeline import search

# Three blocks of the same shape, and a head of another: the blocks are timed once, the head apart.
REPEATED = """
from collections import OrderedDict
import torch
from torch import nn

def build_model():
    torch.manual_seed(0)
    layers = OrderedDict()
    for i in range(3):
        layers[f"block{i}"] = nn.Linear(32, 32)
        layers[f"act{i}"] = nn.ReLU()
    layers["head"] = nn.Linear(32, 4)
    return nn.Sequential(layers)

def batches(split):
    g = torch.Generator().manual_seed(0 if split == "train" else 1)
    return [(torch.randn(8, 32, generator=g), torch.randint(0, 4, (8,), generator=g)) for _ in range(2)]

def loss_fn(model, batch):
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)
"""


def test_stopwatch_accumulates_sections_and_counts():
    watch = Stopwatch()
    for _ in range(2):
        with watch.section("work"):
            time.sleep(0.01)
    watch.count("avoided", 3)
    d = watch.to_dict()
    assert d["counts"] == {"work": 2, "avoided": 3} and d["seconds"]["work"] >= 0.02
    merged = Stopwatch()
    merged.add("work", 1.0)
    merged.merge(d)
    assert merged.counts["work"] == 3 and merged.counts["avoided"] == 3 and merged.seconds["work"] >= 1.02


def test_cost_rows_show_each_stage_with_its_share():
    rows = cost_rows({"seconds": {"profile": 3.0, "trials": 1.0}, "counts": {"profile": 1, "trials": 4, "reused": 2}})
    assert rows == [
        ["profile", "3.0", "75%", 1],
        ["trials", "1.0", "25%", 4],
        ["total of the stages above", "4.0", "100%", ""],
        ["reused", "-", "-", 2],
    ]


def test_layers_of_one_shape_are_timed_once(write_model):
    workload = prepare(load_task(write_model(REPEATED)), "cpu")
    space = space_from_dict({"layers": {"Linear": ["fp32", "bf16"]}})
    prof = profile(workload, space, FAST_PROFILE, progress=False)
    timed_as = {name: rows["fp32"].timed_as for name, rows in prof.by_layer().items()}
    assert timed_as == {"block0": "block0", "block1": "block0", "block2": "block0", "head": "head"}
    assert prof.row("block2", "bf16").time_ms == prof.row("block0", "bf16").time_ms
    assert prof.row("block2", "bf16").metric_drop != prof.row("block0", "bf16").metric_drop  # measured per layer
    assert prof.cost["counts"]["profile: layer timing (forward + backward per format)"] == 2
    assert prof.cost["counts"]["profile: layer timings reused (same type, shapes and formats)"] == 4


@pytest.fixture(scope="module")
def small_search(tmp_path_factory):
    # One tunable layer in fp32 or bf16, the root fixed: two policies in all, so eight trials repeat them (every trial
    # timed: with its speed predicted, the search would stop once both policies are known, as the test below shows).
    source = REPEATED.replace("for i in range(3)", "for i in range(0)")
    folder = tmp_path_factory.mktemp("cost")
    (folder / "model.py").write_text(source, encoding="utf-8")
    workload = prepare(load_task(folder / "model.py"), "cpu")
    space = space_from_dict({"default": ["fp32"], "layers": {"Linear": ["fp32", "bf16"]}, "prune": {"slower_than": 100.0}})
    config = SearchConfig(
        budget=10.0,
        trials=8,
        timing=TINY,
        final_timing=TINY,
        finalists=1,
        progress=False,
        profile=FAST_PROFILE,
        predict_speed=False,
    )
    trial_evaluations = []  # the policies the trials evaluated (the final re-measure passes Candidates)
    real = Judge.safe_metric
    with pytest.MonkeyPatch.context() as mp, using(FormatClock(FASTER)):  # bf16 must pay for the search to offer it
        mp.setattr(
            Judge,
            "safe_metric",
            lambda judge, p: (trial_evaluations.append(p) if isinstance(p, Policy) else None, real(judge, p))[1],
        )
        result = search(workload, space, config, folder / "out")
    return workload, result, trial_evaluations


def test_a_search_stops_once_every_policy_of_its_space_is_known(small_search, tmp_path):
    workload, before, _ = small_search
    space = space_from_dict({"default": ["fp32"], "layers": {"Linear": ["fp32", "bf16"]}, "prune": {"slower_than": 100.0}})
    config = SearchConfig(budget=10.0, trials=8, timing=TINY, final_timing=TINY, finalists=1, progress=False,
                          profile=FAST_PROFILE)  # fmt: skip
    with using(FormatClock(FASTER)):
        result = search(workload, space, config, tmp_path / "out")
    measured = Measured.of(result.policy)
    assert (
        len(result.trials) == 2 and measured.stopped == "stopped after 2 of 8 trials: every policy of the search space was timed"
    )
    assert measured.cost["counts"]["trials: not run, the search stopped early (why: the summary's `trials:` line)"] == 6
    assert "trials: stopped after 2 of 8 trials" in search_summary(result)
    assert len(before.trials) == 8 and Measured.of(before.policy).stopped is None  # every trial timed: no stop


def test_a_repeated_policy_is_measured_once(small_search):
    _, result, _ = small_search
    trials = result.trials
    layers = ["head"]
    reused = trials["reused_from"].notna()
    assert len(trials) == 8 and len(trials[layers].drop_duplicates()) == 2 and reused.sum() == 6
    for _, row in trials[reused].iterrows():
        source = trials[trials["trial"] == int(row["reused_from"])].iloc[0]
        assert list(row[layers]) == list(source[layers]) and row["speedup"] == source["speedup"]
        assert row["metric"] == source["metric"]


def test_the_all_fp32_trial_takes_the_profiles_metric(small_search):
    _, result, trial_evaluations = small_search
    first = result.trials.iloc[0]
    assert first["metric"] == result.profile.fp32_metric
    assert trial_evaluations and not any(all(f.value == "fp32" for f in p.layers.values()) for p in trial_evaluations)


def test_the_search_reports_where_its_time_went(small_search):
    _, result, _ = small_search
    cost = result.policy.measured["cost"]
    assert cost == result.cost
    names = list(cost["seconds"])
    assert names[0].startswith("profile:") and names[-1].startswith("final re-measure")
    assert {"trials: evaluating the metric", "trials: measuring step times", "trials: sampling, storage, the rest"} <= set(names)
    assert cost["counts"]["trials: a repeated policy, its measurements reused"] >= 1
    assert all(s >= 0 for s in cost["seconds"].values())
    assert cost["seconds"]["trials: measuring step times"] > 0 and cost["seconds"][names[-1]] > 0  # timed work took time
