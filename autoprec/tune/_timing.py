"""Every speed number in autoprec: the clock step times are read through, and `interleaved_times`.

Warmed up, device synchronised, candidates timed in rotating order within each round (so drift hits all alike),
median of rounds; the noise helpers (`noisiest`, `more_if_noisy`, `all_settled`) read the rounds' spread.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import statistics
import time
from collections.abc import Callable, Collection, Hashable, Mapping, Sequence
from typing import Protocol, TypeVar

import torch
from tqdm.auto import tqdm

from autoprec import devices
from autoprec.tune._config import MIN_ROUNDS, NOISY_SPREAD, SETTLED, SETTLED_FINAL_ROUNDS, TimingConfig

log = logging.getLogger("autoprec")

# What names the timed callables (a candidate's name, a layer's Format): the timings come back under the same keys.
Key = TypeVar("Key", bound=Hashable)


@dataclasses.dataclass(frozen=True)
class Timing:
    """Per-step milliseconds: the median over rounds and their relative spread, the interquartile range
    over the median (robust to the odd stalled round that (max - min) would report as noise)."""

    median_ms: float
    spread: float
    samples_ms: tuple[float, ...]

    @classmethod
    def from_samples(cls, samples: list[float]) -> Timing:
        med = statistics.median(samples)
        if len(samples) >= 4:
            q1, _, q3 = statistics.quantiles(samples, n=4, method="inclusive")
        else:
            q1, q3 = min(samples), max(samples)
        spread = (q3 - q1) / med if med > 0 else 0.0
        return cls(median_ms=med, spread=spread, samples_ms=tuple(samples))


def spread_text(spread: float | None) -> str:
    """How every table, line and warning writes a spread (Timing.spread, as stored: the interquartile range over the
    median), in percent; "-" where there is none. Not halved: the spread a tie is judged by (separation.separated) is
    the one the reader sees."""
    if spread is None or not math.isfinite(spread):
        return "-"
    return f"{100 * spread:.1f}%"


def synchronize(device: torch.device) -> None:
    """Wait for the work queued on `device` (its registered Device's synchronize; nothing on the CPU)."""
    devices.lookup(device).synchronize(device)


@dataclasses.dataclass(frozen=True)
class Step:
    """One unit of timed work (a training step, a layer's forward and backward) and the model it runs, so that a
    clock standing in for a device (tests, replays) can price it by the formats applied to that model."""

    run: Callable[[], object]
    model: torch.nn.Module | None = None

    def __call__(self) -> object:
        return self.run()


class Clock(Protocol):
    """Times `calls` calls of one unit of work on `device`: the seconds they took in all. Every step time in
    autoprec is read through CLOCK, so nothing that decides on speed reads the machine but through it."""

    def time(self, work: Callable[[], object], calls: int, device: torch.device) -> float: ...


class DeviceClock:
    """The real clock: wall time between two device synchronisations."""

    def time(self, work: Callable[[], object], calls: int, device: torch.device) -> float:
        synchronize(device)
        start = time.perf_counter()
        for _ in range(calls):
            work()
        synchronize(device)
        return time.perf_counter() - start


# The clock step times are read from. Library code never replaces it; the tests put a clock there that prices a
# step by its formats (tests/timings.py), so that what they assert never depends on which formats this machine runs fast.
CLOCK: Clock = DeviceClock()


def interleaved_times(
    work: Mapping[Key, Callable[[], object]],
    device: torch.device,
    config: TimingConfig = TimingConfig(),
    *,
    progress: str | None = None,
    enough: Callable[[Mapping[Key, Sequence[float]]], bool] | None = None,
    warmed: Collection[Key] = (),
    more: Callable[[Mapping[Key, Sequence[float]]], int] | None = None,
) -> dict[Key, Timing]:
    """Time each callable (one unit of work, e.g. one training step) interleaved with the others.
    `progress`: a label for a progress bar over the rounds (None: no bar). `enough(samples)`: asked after each
    round from MIN_ROUNDS on, with each callable's per-step milliseconds so far; True stops early (a
    sequential test: the answer is already clear), else the rounds run to `config.rounds`. `warmed`: callables
    warmed up before (a baseline timed again beside each new candidate): one warm-up call each. `more(samples)`:
    asked once when the rounds end, how many rounds to time on, pooled with these (more_if_noisy), `enough`
    still asked after each; 0: none."""
    names = list(work)
    if not names:
        return {}
    slowest = 1e-6
    for name in names:
        for _ in range(0 if name in warmed else config.warmup - 1):
            work[name]()
        slowest = max(slowest, CLOCK.time(work[name], 1, device))  # the last warm-up call (or one more) sizes the blocks
    # One block size for every callable, from the slowest: each takes as many steps in every round, so no
    # candidate's median comes from a handful of steps beside another's hundreds (a GradScaler's early skips weigh
    # alike), and a slow candidate does not stretch the rounds. (Their batches may differ in position: a warmed
    # baseline skipped its warm-up calls.)
    block = max(1, min(config.max_steps_per_block, math.ceil(config.min_block_s / slowest)))
    steps: dict[Key, int] = dict.fromkeys(names, block)
    samples: dict[Key, list[float]] = {name: [] for name in names}

    def rounds(first: int, last: int) -> None:
        for r in tqdm(range(first, last), desc=progress, unit="round", disable=progress is None, leave=False):
            k = r % len(names)
            for name in names[k:] + names[:k]:  # rotate so no candidate always runs first
                samples[name].append(CLOCK.time(work[name], steps[name], device) * 1e3 / steps[name])
            if enough is not None and r + 1 >= MIN_ROUNDS and r + 1 < last and enough(samples):
                return

    rounds(0, config.rounds)
    done = min(map(len, samples.values()))
    extra = more(samples) if more is not None else 0
    if extra > 0:  # the same warm models and block sizes: no rebuilding, recompiling or warming again
        rounds(done, done + extra)
    return {name: Timing.from_samples(samples[name]) for name in names}


def noisiest(samples: Mapping[str, Sequence[float]]) -> float:
    """The widest spread (Timing.spread) among the callables' samples so far (0 when none)."""
    return max((Timing.from_samples(list(v)).spread for v in samples.values() if v), default=0.0)


def more_if_noisy(rounds: int) -> Callable[[Mapping[str, Sequence[float]]], int]:
    """interleaved_times' `more`: `rounds` more rounds when a spread is beyond NOISY_SPREAD (a loaded machine), so
    the median and spread come from up to twice the rounds (the sequential test may stop them sooner), at the cost
    of those rounds alone; else none."""

    def more(samples: Mapping[str, Sequence[float]]) -> int:
        spread = noisiest(samples)
        if spread <= NOISY_SPREAD:
            return 0
        log.warning(
            "step times spread up to %s, too wide to rank the candidates; timing %d rounds more", spread_text(spread), rounds
        )
        return rounds

    return more


def all_settled(samples: Mapping[str, Sequence[float]]) -> bool:
    """The final re-measure's sequential test: from SETTLED_FINAL_ROUNDS rounds on, every candidate's spread
    (Timing.spread) is within SETTLED, so more rounds would not change a ranking the spreads allow."""
    if min((len(v) for v in samples.values()), default=0) < SETTLED_FINAL_ROUNDS:
        return False
    return all(Timing.from_samples(list(v)).spread <= SETTLED for v in samples.values())


def probe_times(
    work: Mapping[Key, Callable[[], object]], device: torch.device, *, warmup: int = 2, repeats: int = 3
) -> dict[Key, float]:
    """The fastest of a few calls each after warm-up, in ms: enough to spot a format many times slower."""
    out: dict[Key, float] = {}
    for name, fn in work.items():
        for _ in range(warmup):
            fn()
        out[name] = min(CLOCK.time(fn, 1, device) for _ in range(repeats)) * 1e3
    return out
