"""Every speed number in autoprec: the clock step times are read through, `interleaved_times`, the rules that tell
one speedup from another, and the search's own stopwatch.

Warmed up, device synchronised, candidates timed in rotating order within each round (so drift hits all alike),
median of rounds, each round's sample the mean of a block of steps; on a device with a queue of its own the
device's time and the host's apart (a host-bound step is named as such); the garbage collector frozen after the
warm-up and paused inside each timed block. The noise helpers (`noisiest`, `more_if_noisy`, `all_settled`) read
the rounds' spread, and three rules (`separated`, `beaten`, `may_beat`, at the bottom) tell one speedup from another
beyond it. `Stopwatch` times the search itself: where its time goes, stage by stage.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import math
import statistics
import sys
import time
from collections.abc import Callable, Collection, Hashable, Iterator, Mapping, Sequence
from typing import Protocol, TypeVar

import torch
from tqdm.auto import tqdm

from autoprec import devices
from autoprec.devices import BlockTime
from autoprec.errors import UserError
from autoprec.tune._core._config import HOST_BOUND, MIN_ROUNDS, NOISY_SPREAD, SETTLED, SETTLED_FINAL_ROUNDS, TimingConfig

log = logging.getLogger("autoprec")

# What names the timed callables (a candidate's name, a layer's Format): the timings come back under the same keys.
Key = TypeVar("Key", bound=Hashable)


@dataclasses.dataclass(frozen=True)
class Timing:
    """Per-step milliseconds: the median over rounds and their relative spread, the interquartile range
    over the median (robust to the odd stalled round that (max - min) would report as noise). On a device with a
    queue of its own the samples are the device's time, and `host_ms` the median of the host's time issuing a step
    (None elsewhere: there the two are one), and `busy_ms` the device's busy time a step, from a block timed with
    the host's issuing kept out of it (Device.time_block's `kernels`; None where the device has no queue)."""

    median_ms: float
    spread: float
    samples_ms: tuple[float, ...]
    host_ms: float | None = None
    busy_ms: float | None = None

    @classmethod
    def from_samples(cls, samples: list[float], host: Sequence[float] = (), busy_ms: float | None = None) -> Timing:
        med = statistics.median(samples)
        if len(samples) >= 4:
            q1, _, q3 = statistics.quantiles(samples, n=4, method="inclusive")
        else:
            q1, q3 = min(samples), max(samples)
        spread = (q3 - q1) / med if med > 0 else 0.0
        host_ms = statistics.median(host) if host else None
        return cls(median_ms=med, spread=spread, samples_ms=tuple(samples), host_ms=host_ms, busy_ms=busy_ms)

    @property
    def host_bound(self) -> bool:
        """The device was busy for at most HOST_BOUND of the step's time and waited on the host for the rest, so no
        format changes this step's time (CUDA graphs or a larger batch would), and its spread is the host's jitter,
        not the device's. Unknown (False) where the device's busy time was not measured."""
        return self.busy_ms is not None and self.median_ms > 0 and self.busy_ms <= HOST_BOUND * self.median_ms


def spread_text(spread: float | None) -> str:
    """How every table, line and warning writes a spread (Timing.spread, as stored: the interquartile range over the
    median), in percent; "-" where there is none. Not halved: the spread a tie is judged by (`separated`, below) is
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
    clock standing in for a device (tests, replays) can price it by the formats applied to that model. `kernels`:
    time the device's work alone (Device.time_block), as a lone layer's step is: its launch overhead is no cost of
    its format, and inside a whole step the host issues it while the device runs the layers before."""

    run: Callable[[], object]
    model: torch.nn.Module | None = None
    kernels: bool = False

    def __call__(self) -> object:
        return self.run()


class Clock(Protocol):
    """Times `calls` calls of one unit of work on `device`: the seconds they took in all, or a BlockTime (the
    device's seconds and the host's apart). Every step time in autoprec is read through CLOCK, so nothing that
    decides on speed reads the machine but through it."""

    def time(self, work: Callable[[], object], calls: int, device: torch.device) -> float | BlockTime: ...


class DeviceClock:
    """The real clock: the device's own (Device.time_block): wall time between two synchronisations on the CPU, the
    GPU's events around the block and the host's issuing time apart on CUDA. Work whose `kernels` attribute is True
    (a layer's step in the profile) is timed by the device's busy time alone, not the host's launch overhead."""

    def time(self, work: Callable[[], object], calls: int, device: torch.device) -> BlockTime:
        kernels = bool(getattr(work, "kernels", False))
        # work that runs on every rank of a sharded search (_ranks.py) is told the block once and times it on each
        # rank, the slowest rank's time its time: a message per step would be inside the time
        on_ranks = getattr(work.run if isinstance(work, Step) else work, "time_on_ranks", None)
        if on_ranks is not None:
            return on_ranks(calls, kernels=kernels)  # type: ignore[no-any-return]
        return devices.lookup(device).time_block(device, work, calls, kernels=kernels)


def as_block(measured: float | BlockTime) -> BlockTime:
    """A clock's answer as a BlockTime (a plain number of seconds: a device without a queue of its own)."""
    return measured if isinstance(measured, BlockTime) else BlockTime(float(measured))


@contextlib.contextmanager
def gc_frozen() -> Iterator[None]:
    """Inside: what the warm-up left frozen (gc.freeze), so the collections that still run (between timed blocks)
    walk only the rounds' own objects, not a model's worth of them; unfrozen after. Not collected first: a full
    collection costs 0.3-0.5 s in a process that imported torch, per timing, and what it would free is freed after.
    Left alone where the caller froze objects already (theirs to unfreeze): library code changes no process-wide
    state for good."""
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


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
    retire: Callable[[Mapping[Key, Sequence[float]]], Collection[Key]] | None = None,
    idle: Callable[[Key], None] | None = None,
    drop: Callable[[Key, Exception | None], None] | None = None,
    each_round: Callable[[Mapping[Key, Sequence[float]]], None] | None = None,
) -> dict[Key, Timing]:
    """Time each callable (one unit of work, e.g. one training step) interleaved with the others.
    Each round's sample is the mean of a block of steps (TimingConfig: the same count for every callable); where
    the clock says the host's time apart, each Timing's host_ms too. `progress`: a label for a progress bar over the rounds (None: no bar). `enough(samples)`: asked after each
    round from MIN_ROUNDS on, with each callable's per-step milliseconds so far; True stops early (a
    sequential test: the answer is already clear), else the rounds run to `config.rounds`. `warmed`: callables
    warmed up before (a baseline timed again beside each new candidate): one warm-up call each. `more(samples)`:
    asked once when the rounds end, how many rounds to time on, pooled with these (more_if_noisy), `enough`
    still asked after each; 0: none. `retire(samples)`: asked after every round, the callables to time no more
    (their rounds so far stand; `enough` and `more` then see the others'): one the rounds put out of the running
    by a gross factor, whose every further step would cost seconds and change no ranking. Never the last one.
    `idle(key)`: told after each of its blocks, outside the time: what it keeps only while stepping can go (a
    trainer's gradients), so the device holds each idle candidate's state alone. `drop(key, error)`: where given, a
    callable that raises in its warm-up or its block (anything but a UserError or an interrupt: out of the device's
    memory, say) is timed no more, its rounds discarded and no Timing returned for it, and `drop` is told with the
    error; one retired is told with None (its rounds so far are its Timing). Either way it is held here no more, and
    the caller may free it; without `drop`, an error ends the timing. `each_round(samples)`: told after every
    round, each callable's per-step milliseconds so far (retired ones' too, dropped ones' not): what a run stopped
    before the end would otherwise lose."""
    work = dict(work)  # this timing's own: a callable dropped or retired is let go from here
    names = list(work)
    if not names:
        return {}
    gone: set[Key] = set()  # raised: no Timing

    def failed(name: Key, exc: Exception) -> None:
        if drop is None or isinstance(exc, UserError):
            raise exc
        gone.add(name)
        del work[name]
        drop(name, exc)

    fastest, slowest = math.inf, 1e-6
    for name in names:
        try:
            if name not in warmed:
                _warm_up(work[name], device, config)
            per_step = _sizing_call(work[name], device)
        except Exception as exc:
            failed(name, exc)
            continue
        if idle is not None:
            idle(name)
        fastest, slowest = min(fastest, max(per_step, 1e-6)), max(slowest, per_step)
    if not work:
        return {}
    # One block size for every callable: each takes as many steps in every round, so no candidate's median comes
    # from a handful of steps beside another's hundreds (a GradScaler's early skips weigh alike). Enough that the
    # fastest's block lasts min_block_s, and never fewer than min_steps (a sample of one step carries all the jitter
    # at its ends), as long as the slowest's block stays within max_block_s: a step of seconds (a CPU's emulated
    # format) has no such jitter to average, and eight of it per round would multiply the search's time. (Their
    # batches may differ in position: a warmed baseline skipped its warm-up calls.)
    block = max(config.min_steps, min(config.max_steps_per_block, math.ceil(config.min_block_s / fastest)))
    block = min(block, max(1, math.floor(config.max_block_s / slowest)))
    steps: dict[Key, int] = dict.fromkeys(names, block)
    samples: dict[Key, list[float]] = {name: [] for name in names}
    host: dict[Key, list[float]] = {name: [] for name in names}

    retired: set[Key] = set()

    def timed() -> dict[Key, list[float]]:
        return {name: samples[name] for name in names if name not in retired and name not in gone}

    def rounds(first: int, last: int) -> None:
        for r in tqdm(range(first, last), desc=progress, unit="round", disable=progress is None, leave=False):
            active = list(timed())
            if not active:
                return
            k = r % len(active)
            for name in active[k:] + active[:k]:  # rotate so no candidate always runs first
                try:
                    with devices.collector_paused():  # no collection of another's garbage inside this block
                        measured = as_block(CLOCK.time(work[name], steps[name], device))
                except Exception as exc:
                    failed(name, exc)
                    continue
                samples[name].append(measured.seconds * 1e3 / steps[name])
                if measured.host_s is not None:
                    host[name].append(measured.host_s * 1e3 / steps[name])
                if idle is not None:
                    idle(name)
            active = list(timed())
            if retire is not None and active:
                out = set(retire(timed())) & set(active)
                if len(out) < len(active):
                    retired.update(out)
                    if drop is not None:  # its rounds stand; the caller may free it now
                        for name in [n for n in names if n in out]:  # in their order, not a set's
                            del work[name]
                            drop(name, None)
            if each_round is not None:
                each_round({name: samples[name] for name in names if name not in gone})
            if not active or enough is not None and r + 1 >= MIN_ROUNDS and r + 1 < last and enough(timed()):
                return

    with gc_frozen():
        rounds(0, config.rounds)
        if not timed():
            return {name: Timing.from_samples(samples[name], host[name]) for name in names if name not in gone and samples[name]}
        done = min(map(len, timed().values()))
        extra = more(timed()) if more is not None else 0
        if extra > 0:  # the same warm models and block sizes: no rebuilding, recompiling or warming again
            rounds(done, done + extra)
        busy = {}
        for name in [n for n in names if n in work and config.busy and host[n]]:
            try:
                busy[name] = _busy_ms(work[name], steps[name], samples[name], device)
            except Exception as exc:  # its rounds stand; only whether it is host-bound is unknown
                if drop is None or isinstance(exc, UserError):
                    raise
    return {name: Timing.from_samples(samples[name], host[name], busy.get(name)) for name in names if name not in gone}


def _busy_ms(work: Callable[[], object], calls: int, samples: Sequence[float], device: torch.device) -> float | None:
    """The device's busy time a step, over one block of `calls` timed with the host's issuing kept out of it (a
    Step's `kernels`): beside the rounds' time, how long the device waited on the host (Timing.host_bound). Work
    timed held already (a layer's step) is its rounds' median. None where the host outran the hold (BlockTime.held):
    then whether the step is host-bound is not known."""
    if getattr(work, "kernels", False):
        return statistics.median(samples)
    held = Step(work, getattr(work, "model", None), kernels=True)
    with devices.collector_paused():
        measured = as_block(CLOCK.time(held, calls, device))
    if measured.held is False:  # the host outran the hold: the device's waits on it are in the time
        return None
    return measured.seconds * 1e3 / calls


def _warm_up(work: Callable[[], object], device: torch.device, config: TimingConfig) -> None:
    """`config.warmup` - 1 calls, and on until `config.warmup_s` seconds of them by the clock (a GPU's clocks and
    caches settle, an allocator reaches its steady state), but no more calls than the first one's time says fill
    those seconds (a step that speeds up a lot after it does not warm up for ever); and on while a call still
    compiled a graph (torch.compile recompiles on a second shape or value), up to RECOMPILE_CALLS more, so no
    timed round holds a compilation. The call after these sizes the blocks (_sizing_call)."""
    spent, calls, least = 0.0, 0, config.warmup - 1
    most = max(least, 1 if config.warmup_s > 0 else 0)
    clean = True
    while calls < least or (spent < config.warmup_s and calls < most) or (not clean and calls < most + RECOMPILE_CALLS):
        before = compiled_graphs()
        block = as_block(CLOCK.time(work, 1, device))
        # the call's own time: a layer's kernels take microseconds of the device where the host spends a millisecond
        # issuing them, so the device's time alone would count thousands of calls into warmup_s
        seconds = max(block.seconds, block.host_s or 0.0)
        if calls == 0:
            most = max(most, math.ceil(config.warmup_s / max(seconds, 1e-6)))
        spent += seconds
        calls += 1
        clean = compiled_graphs() == before


def _sizing_call(work: Callable[[], object], device: torch.device) -> float:
    """The seconds of one call after the warm-up, which sizes the blocks; taken again while it compiled a graph (up to
    RECOMPILE_CALLS), so neither the sizes nor the rounds after hold a compilation."""
    for _ in range(RECOMPILE_CALLS):
        before = compiled_graphs()
        seconds = as_block(CLOCK.time(work, 1, device)).seconds
        if compiled_graphs() == before:
            break
    return seconds


# Warm-up calls past the configured ones while each still compiles a graph: torch.compile's recompilations of one
# model settle within a few calls (a second shape marks it dynamic once); past these the timing goes on regardless.
RECOMPILE_CALLS = 8


def compiled_graphs() -> int | None:
    """How many frames torch.compile has compiled in this process so far; None where it was never imported (nothing
    compiled, and importing it here would cost seconds)."""
    utils = sys.modules.get("torch._dynamo.utils")
    return None if utils is None else int(utils.counters["frames"]["total"])


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
        out[name] = min(as_block(CLOCK.time(fn, 1, device)).seconds for _ in range(repeats)) * 1e3
    return out


# When one speedup is told apart from another beyond the timing noise: the three rules, named apart and kept together.
#
# Three decisions ask it, of numbers measured with different care, and err on different sides:
#
# - `separated` (the final re-measure; _choose.py): two candidates timed interleaved over many rounds, each with its
#   spread (Timing.spread). Told apart where the faster one's lead is beyond their mean spread. Candidates not
#   told apart are ties: the safer is chosen, and the policy file lists them (choose.not_separated).
# - `beaten` (which trials the final re-measure times; goals.Speed.finalists): a trial's few rounds understate the
#   noise, so the wider of the two spreads counts, at least SETTLED, as a factor on both sides. Only a trial whose fast
#   end is under the best trial's slow end is left out: leaving out one that might win would cost the answer,
#   re-measuring one too many costs only rounds.
# - `may_beat` (when the search stops; speed.ceiling): a predicted speedup, raised by the fit's error, against the best
#   timed trial's, raised by its half-spread; the search goes on while an untried policy may beat it.


class Rated(Protocol):
    """A re-measured candidate's speedup and its spread (records.Measurement)."""

    @property
    def speedup(self) -> float: ...

    @property
    def spread(self) -> float: ...


def separated(a: Rated, b: Rated) -> bool:
    """Whether the step times tell a and b apart: the faster one's lead is beyond their mean spread."""
    fast, slow = (a, b) if a.speedup >= b.speedup else (b, a)
    return fast.speedup / slow.speedup - 1 > (fast.spread + slow.spread) / 2


def beaten(speedup: float, spread: float, best: float, best_spread: float) -> bool:
    """Whether a trial's timing (`speedup`, `spread`) is separated below the best trial's: its fast end under the
    best's slow end, each by a factor of 1 + half the wider spread, at least SETTLED."""
    # a few rounds' spread understates the noise: the wider of the two, and at least SETTLED, on both sides; as a
    # factor each way (a spread past 2 would put 1 - half below zero, and beat nothing however far apart they ran)
    half = max(spread, best_spread, SETTLED) / 2
    return speedup * (1 + half) < best / (1 + half)


def may_beat(predicted: float, margin: float, best: float, noise: float) -> bool:
    """Whether a `predicted` speedup, raised by the fit's `margin`, is beyond `best` raised by its `noise` (the best
    timed trial's half-spread)."""
    return predicted * (1 + margin) > best * (1 + noise)


# Where a search's time goes: named stages timed with a wall clock, so a user can see what to cut (fewer layers to
# profile, fewer trials, shorter timing) and we can see which repeated work to keep out (results.cost_rows shows it).


class Stopwatch:
    """Seconds and counts per named stage, accumulated over any number of `section` blocks."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.counts: dict[str, int] = {}

    @contextlib.contextmanager
    def section(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - start)

    def add(self, name: str, seconds: float, count: int = 1) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds
        self.counts[name] = self.counts.get(name, 0) + count

    def count(self, name: str, n: int = 1) -> None:
        """A count with no time of its own (work avoided, for example)."""
        self.counts[name] = self.counts.get(name, 0) + n

    def merge(self, other: Mapping[str, Mapping[str, float]] | None) -> None:
        """Add another stopwatch's `to_dict()` (the profile's, for example) to this one."""
        other = other or {}
        seconds, counts = other.get("seconds", {}), other.get("counts", {})
        for name, s in seconds.items():
            self.add(name, float(s), int(counts.get(name, 1)))
        for name, n in counts.items():
            if name not in seconds:
                self.count(name, int(n))

    def to_dict(self) -> dict[str, dict[str, float]]:
        return {"seconds": {k: round(v, 3) for k, v in self.seconds.items()}, "counts": dict(self.counts)}
