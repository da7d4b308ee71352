"""benchmarks/search_replay.py's replayed device: what it serves for a policy the trace timed and for one it did not,
and how its clock prices (and counts) whole training steps apart from the profile's layer steps. No search runs here."""

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from autoprec import Policy, apply_policy
from autoprec.tune._measure import _timing as timing
from autoprec.tune._measure._trainer import Trainer
from autoprec.tune._search import _pipeline as pipeline

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import search_replay  # noqa: E402

TRACE = ROOT / "benchmarks" / "traces" / "xeon-amx-2core" / "digits"
ALL_BF16 = ("bf16",) * 5


class Digits(nn.Module):  # the traced model's layer names; sizes do not matter to a whole step's price
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.fc3, self.head = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x):
        return self.head(self.fc3(self.fc2(self.fc1(x))))


class Holder(nn.Module):  # as the profiler times one layer: the layer alone, named "layer"
    def __init__(self, layer):
        super().__init__()
        self.layer = layer


@pytest.fixture(scope="module")
def truth():
    return search_replay.Truth.fit(search_replay.Trace.load(TRACE))


def test_a_finalist_is_served_its_recorded_median_and_an_untimed_policy_the_fitted_model(truth):
    trace = truth.trace
    assert trace.layers == ("fc1", "fc2", "fc3", "head") and trace.budget == 0.01 and trace.n_trials == 30
    assert truth.step_ms(("fp32",) * 5) == pytest.approx(723.284, abs=1e-3)
    assert truth.step_ms(ALL_BF16) == pytest.approx(455.295, abs=1e-3)  # finalists.csv's uniform bf16
    assert truth.spread(ALL_BF16) == pytest.approx(1.032, abs=1e-3)
    untimed = ("bf16", "bf16", "bf16", "bf16", "fp32")  # timed as trial 10 (0.98x fp32's), not re-measured: modelled
    assert untimed not in truth.recorded and truth.ratio(untimed) == truth.modelled_ratio(untimed) < 1
    # what the trace shows: lowered layers save (bf16 root), an fp32 root pays a cast per lowered layer
    assert truth.per_ms > 0 and truth.per_fp32_root_layer > 0
    assert truth.modelled_ratio(("fp32", "bf16", "bf16", "bf16", "bf16")) > 1


def test_serving_every_trials_median_too_takes_the_median_over_a_policys_repeats(truth):
    every = search_replay.Truth.fit(truth.trace, "all")
    trial_10 = ("bf16", "bf16", "bf16", "bf16", "fp32")
    assert every.ratio(trial_10) == pytest.approx(651.985 / 663.969, rel=1e-6)
    assert every.ratio(ALL_BF16) == truth.ratio(ALL_BF16)  # the re-measure's number wins over the trials'
    with pytest.raises(ValueError, match="recorded must be one of"):
        search_replay.Truth.fit(truth.trace, "some")


def test_the_clock_runs_the_work_and_prices_whole_steps_by_policy_and_layer_steps_by_shape(truth):
    clock = search_replay.ReplayClock(truth, Digits, seed=0, noise=0.0)
    ran = []
    whole = apply_policy(Digits(), Policy(layers={"": "bf16"}))
    step = timing.Step(lambda: ran.append(1), whole)
    assert clock.time(step, 3, torch.device("cpu")) == pytest.approx(3 * 0.455295, rel=1e-5)
    layer = timing.Step(lambda: ran.append(1), apply_policy(Holder(nn.Linear(64, 1024)), Policy(layers={"layer": "bf16"})))
    assert clock.time(layer, 2, torch.device("cpu")) == pytest.approx(2 * 8.048715e-3, rel=1e-5)  # fc1's bf16 time
    assert len(ran) == 5
    tally = clock.tally
    assert (tally.whole_timed, tally.layer_timed, tally.other) == (3, 2, 0)
    assert tally.whole_timed_s == pytest.approx(3 * 0.455295, rel=1e-5)


def test_noise_is_seeded_and_median_preserving(truth):
    def prices(seed):
        clock = search_replay.ReplayClock(truth, Digits, seed=seed)
        step = timing.Step(lambda: None, apply_policy(Digits(), Policy(layers={"": "bf16"})))
        return [clock.time(step, 1, torch.device("cpu")) for _ in range(401)]

    a, b = prices(1), prices(1)
    assert a == b and a != prices(2)
    assert sorted(a)[200] == pytest.approx(0.455295, rel=0.15)


def test_replaying_swaps_the_clock_the_step_count_and_the_final_phase_and_restores_them(truth):
    clock = search_replay.ReplayClock(truth, Digits, seed=0, noise=0.0)
    before = timing.CLOCK, Trainer.step, pipeline.final_remeasure
    with search_replay.replaying(clock):
        assert timing.CLOCK is clock and Trainer.step is not before[1] and pipeline.final_remeasure is not before[2]
    assert (timing.CLOCK, Trainer.step, pipeline.final_remeasure) == before
