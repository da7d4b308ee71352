"""Timing cut short, for the tests that run profiles and searches: there the numbers do not matter, only that
every step of the path runs. One place, so a change to TimingConfig or ProfileConfig is made once."""

from autoprec.tune._core._config import ProfileConfig, TimingConfig

TINY = TimingConfig(warmup=1, rounds=2, min_block_s=0.0, warmup_s=0.0, min_steps=1)
FAST_PROFILE = ProfileConfig(batches=1, timing=TINY)


def fixed_layer_times(ratios):
    """A stand-in for the layer timing: fp32 1 ms, each other format `ratios[format]` times that."""

    def time_layer(workload, name, module, inputs, formats, config):
        return {f: (1.0 if f.value == "fp32" else ratios[f.value], 0.0, None) for f in formats}, {}

    return time_layer
