import math

from autoprec.tune.profile_data import ruled_out


def test_a_slowdown_measured_inside_wide_noise_rules_nothing_out():
    """On a loaded machine a layer's format timed at 2x fp32 with rounds spread ±75% may be as fast as fp32: it stays
    in play (the search times whole steps); measured quietly, or probed many times slower, it is ruled out."""
    row = {"status": "ok", "format": "bf16", "time_vs_fp32": 2.0}
    assert ruled_out({**row, "time_spread": 1.5}, None, 1.25) is None
    assert ruled_out({**row, "time_spread": 0.1}, None, 1.25) == "measured 2.00x the layer's fp32 time on this device"
    assert ruled_out({**row, "time_spread": math.nan}, None, 1.25) is not None  # probed only: the gap dwarfs the noise
