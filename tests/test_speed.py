import math
from pathlib import Path

import optuna
import pytest

from autoprec import Policy
from autoprec.formats import Format
from autoprec.tune import SearchConfig, load_task, prepare
from autoprec.tune.choices import build_choices, policy_from_params
from autoprec.tune.space import space_from_dict
from autoprec.tune.speed import MARGIN, MIN_FIT, LayerTimes, Timed, fit, format_of, too_slow
from autoprec.tune.study import Judge, Objective, _finalist_mark
from test_search import fake_profile

MODELS = Path(__file__).parent / "models"


def test_a_layer_runs_in_its_own_format_else_its_nearest_listed_parents_else_the_roots():
    policy = Policy(layers={"": "bf16", "blocks": "fp32", "blocks.1.q": "fp8"})
    assert format_of(policy, "blocks.1.q") is Format.FP8
    assert format_of(policy, "blocks.0.q") is Format.FP32
    assert format_of(policy, "head") is Format.BF16
    assert format_of(Policy(), "head") is Format.FP32


def test_a_policys_features_sum_its_layers_savings_and_say_whether_the_root_is_lowered():
    times = LayerTimes.from_table([
        {"layer": "a", "format": "fp32", "time_ms": 10.0}, {"layer": "a", "format": "bf16", "time_ms": 4.0},
        {"layer": "b", "format": "fp32", "time_ms": 6.0}, {"layer": "b", "format": "bf16", "time_ms": 5.0},
        {"layer": "b", "format": "fp16", "time_ms": math.nan},  # not timed: no prediction for a policy using it
    ])  # fmt: skip
    assert times.features(Policy(layers={"": "bf16"})) == (7.0, 1.0)
    assert times.features(Policy(layers={"a": "bf16", "b": "fp32"})) == (6.0, 0.0)
    assert times.features(Policy(layers={"a": "bf16", "b": "fp16"})) is None


def _timed(per_ms, root_ms, fp32_ms=100.0, noise=()):
    features = [(s, r) for s in (0.0, 2.0, 5.0, 8.0, 11.0) for r in (0.0, 1.0)]
    noise = list(noise) or [0.0] * len(features)
    return [Timed(f, fp32_ms, (fp32_ms - per_ms * f[0] - root_ms * f[1]) * (1 + e)) for f, e in zip(features, noise)]


def test_the_fit_recovers_the_savings_a_step_was_made_of():
    speed_fit = fit(_timed(per_ms=2.0, root_ms=3.0))
    assert speed_fit.per_ms == pytest.approx(2.0) and speed_fit.root_ms == pytest.approx(3.0)
    assert speed_fit.error == pytest.approx(0.0, abs=1e-9) and speed_fit.margin == MARGIN
    assert speed_fit.speedup((5.0, 1.0)) == pytest.approx(100.0 / (100.0 - 10.0 - 3.0))


def test_the_fits_error_is_its_worst_relative_miss_and_widens_the_margin():
    noise = [0.0, 0.3, -0.05, 0.0, 0.02, 0.0, 0.0, 0.01, 0.0, -0.02]
    timed = _timed(per_ms=2.0, root_ms=3.0, noise=noise)
    speed_fit = fit(timed)
    misses = [speed_fit.speedup(t.features, t.fp32_ms) * t.step_ms / t.fp32_ms - 1 for t in timed]
    assert speed_fit.error == pytest.approx(max(abs(m) for m in misses)) and speed_fit.error > MARGIN
    assert speed_fit.margin == speed_fit.error


def test_no_fit_from_too_few_trials_or_where_lowering_saves_nothing():
    assert fit(_timed(2.0, 3.0)[: 2 * MIN_FIT - 3]) is None  # MIN_FIT - 1 of them lower a layer
    assert fit(_timed(per_ms=-1.0, root_ms=0.0)) is None



def test_a_fit_predicts_only_for_a_root_setting_it_has_seen_timed():
    fp32_root = fit([t for t in _timed(2.0, 3.0) if t.features[1] == 0.0])
    assert fp32_root.root_ms == 0.0 and fp32_root.per_ms == pytest.approx(2.0)
    assert fp32_root.covers((3.0, 0.0)) and not fp32_root.covers((3.0, 1.0))
    lowered_root = fit([t for t in _timed(2.0, 3.0) if t.features[1] == 1.0])  # the root's term is the constant part
    assert lowered_root.root_ms == pytest.approx(3.0) and lowered_root.per_ms == pytest.approx(2.0)
    assert lowered_root.covers((0.0, 1.0)) and not lowered_root.covers((3.0, 0.0))


def test_a_candidate_is_left_untimed_only_where_even_its_margin_keeps_it_below_the_mark():
    timed = _timed(per_ms=2.0, root_ms=3.0)  # an exact fit: the margin is MARGIN
    predicted = 100.0 / (100.0 - 2.0 * 1.0 - 3.0)  # features (1.0, 1.0)
    assert too_slow(timed, (1.0, 1.0), predicted * (1 + MARGIN) * 1.001)[0] == pytest.approx(predicted)
    assert too_slow(timed, (1.0, 1.0), predicted * (1 + MARGIN) * 0.999) is None  # might be a finalist: timed
    assert too_slow(timed, (1.0, 1.0), None) is None  # no mark yet
    assert too_slow(timed, None, 2.0) is None  # a format without a profiled time
    assert too_slow(timed[:3], (1.0, 1.0), 2.0) is None  # too few trials to fit


SPACE = space_from_dict({"default": ["fp32", "bf16"], "layers": {"Linear": ["fp32", "bf16"]}, "layout": "per_layer"})
# fc1 saves 6 ms in bf16, big 2, head 0.2: a policy with fc1 in fp32 saves little
PROFILE = [("fc1", "fp32", 0, 10.0, True, False), ("fc1", "bf16", 0, 4.0, True, False),
           ("big", "fp32", 0, 10.0, True, False), ("big", "bf16", 0, 8.0, True, False),
           ("head", "fp32", 0, 2.0, True, False), ("head", "bf16", 0, 1.8, True, False)]  # fmt: skip


def _searched(monkeypatch, *, predict_speed: bool):
    """A study of overflow_mlp whose step times come from a known formula (the layer savings twice over, the root
    5 ms), so which trials the prediction leaves untimed is deterministic."""
    workload = prepare(load_task(MODELS / "overflow_mlp.py"), "cpu")
    prof = fake_profile(PROFILE)
    choices = build_choices(prof, SPACE, 1.0, workload.device)
    times = LayerTimes.from_table(prof.table.to_dict("records"))
    timed = []

    def fake_time(self, trial, policy, constraint):
        saving, root = times.features(policy)
        step = 100.0 - 2.0 * saving - 5.0 * root
        timed.append(trial.number)
        for key, value in dict(step_ms=step, fp32_step_ms=100.0, rounds=3, spread=0.0, speedup=100.0 / step).items():
            trial.set_user_attr(key, value)
        return True, constraint

    monkeypatch.setattr(Objective, "_time", fake_time)
    config = SearchConfig(budget=1.0, finalists=2, progress=False, predict_speed=predict_speed)
    objective = Objective(workload, choices, SPACE, Judge(workload, config, 0.5), config, layer_times=times)
    study = optuna.create_study(direction="maximize", sampler=optuna.samplers.RandomSampler(seed=3))
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study.optimize(objective, n_trials=40)
    return study, choices, times, timed


def test_a_trial_predicted_too_slow_to_be_a_finalist_is_not_timed(monkeypatch):
    study, choices, times, timed = _searched(monkeypatch, predict_speed=True)
    untimed = [t for t in study.trials if "untimed" in t.user_attrs]
    assert untimed and len(timed) < len(study.trials) - len(untimed) + 1
    for t in untimed:
        assert t.number not in timed
        saving, root = times.features(policy_from_params(t.params, choices))
        truth = 100.0 / (100.0 - 2.0 * saving - 5.0 * root)
        assert t.user_attrs["predicted_speedup"] == pytest.approx(truth) == t.user_attrs["speedup"]  # the fit is exact here
        before = optuna.create_study(direction="maximize")
        before.add_trials([s for s in study.trials if s.number < t.number])
        assert truth * (1 + MARGIN) < _finalist_mark(before, 2)  # surely not a finalist when it was skipped
    # the two fastest policies were timed, whatever came first
    best = sorted(study.trials, key=lambda t: -t.user_attrs["speedup"])[:2]
    assert all("untimed" not in t.user_attrs for t in best)


def test_without_prediction_every_new_policy_is_timed(monkeypatch):
    study, _, _, timed = _searched(monkeypatch, predict_speed=False)
    assert not any("untimed" in t.user_attrs for t in study.trials)
    new = {t.number for t in study.trials if "reused_from" not in t.user_attrs}
    fp32 = {t.number for t in study.trials if set(t.params.values()) == {"fp32"}}  # the baseline itself: never timed
    assert set(timed) == new - fp32 and len(timed) > 5
