"""Timing cut short, for the tests that run profiles and searches: there the numbers do not matter, only that
every step of the path runs. One place, so a change to TimingConfig or ProfileConfig is made once."""

from autoprec.tune.config import ProfileConfig, TimingConfig

TINY = TimingConfig(warmup=1, rounds=2, min_block_s=0.0)
FAST_PROFILE = ProfileConfig(batches=1, timing=TINY)
