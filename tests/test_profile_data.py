import math

from autoprec.tune.profile_data import ruled_out


def test_a_slowdown_measured_inside_wide_noise_rules_nothing_out():
    """On a loaded machine a layer's format timed at 2x fp32 with rounds spread ±75% may be as fast as fp32: it stays
    in play (the search times whole steps); measured quietly, or probed many times slower, it is ruled out."""
    row = {"status": "ok", "format": "bf16", "time_vs_fp32": 2.0}
    assert ruled_out({**row, "time_spread": 1.5}, None, 1.25) is None
    assert ruled_out({**row, "time_spread": 0.1}, None, 1.25) == "measured 2.00x the layer's fp32 time on this device"
    assert ruled_out({**row, "time_spread": math.nan}, None, 1.25) is not None  # probed only: the gap dwarfs the noise


def test_a_gemm_below_its_familys_floor_rules_the_format_out_and_the_message_names_the_floor():
    """The floor is the family's for the format: mxfp8's 20 dB, nvfp4's 10 dB, fp8's 20 dB (its message as before);
    autocast's formats are not judged by it (fp16's gradients are measured without a loss scale)."""
    row = {"status": "ok", "time_vs_fp32": math.nan, "sqnr_db": 28.0, "dgrad_sqnr_db": 28.0, "grad_sqnr_db": 28.0}
    low = {**row, "grad_sqnr_db": 12.0}
    assert ruled_out({**low, "format": "mxfp8"}, None, math.inf) == (
        "its wgrad GEMM measures 12.0 dB against fp32, below mxfp8's 20 dB floor"
    )
    assert ruled_out({**low, "format": "nvfp4"}, None, math.inf) is None  # 12 dB is above NVFP4's 10
    assert ruled_out({**row, "dgrad_sqnr_db": 8.5, "format": "nvfp4-fwd-dgrad"}, None, math.inf) == (
        "its dgrad GEMM measures 8.5 dB against fp32, below nvfp4-fwd-dgrad's 10 dB floor"
    )
    assert ruled_out({**low, "format": "fp8-rowwise"}, None, math.inf) == (
        "its wgrad GEMM measures 12.0 dB against fp32, below fp8's 20 dB floor"
    )
    assert ruled_out({**low, "format": "fp16"}, None, math.inf) is None
    assert ruled_out({**row, "format": "mxfp8"}, None, math.inf) is None
