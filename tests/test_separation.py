"""The three noise rules (autoprec/tune/_measure/_separation.py): each tells one speedup from another at its own mark."""

import types

from autoprec.tune._core._config import SETTLED
from autoprec.tune._measure._separation import beaten, may_beat, separated


def rated(speedup, spread):
    return types.SimpleNamespace(speedup=speedup, spread=spread)


def test_separated_needs_a_lead_beyond_the_mean_spread_whichever_comes_first():
    assert separated(rated(1.2, 0.1), rated(1.0, 0.1)) and separated(rated(1.0, 0.1), rated(1.2, 0.1))
    assert not separated(rated(1.05, 0.1), rated(1.0, 0.1))


def test_beaten_grants_each_side_half_the_wider_spread_and_at_least_settled():
    assert not beaten(1.85, 0.10, 2.0, 0.10)  # 1.85 * 1.05 reaches 2.0 / 1.05
    assert beaten(1.5, 0.10, 2.0, 0.10)
    assert not beaten(2.0 / (1 + SETTLED / 2) ** 2 + 1e-9, 0.0, 2.0, 0.0)  # a spread of 0 still counts as SETTLED


def test_may_beat_raises_the_prediction_by_the_fits_error_and_the_best_by_its_noise():
    assert may_beat(1.0, 0.10, 1.05, 0.04) and not may_beat(1.0, 0.10, 1.05, 0.05)
