"""The two measurements everything shares: the training-step time and the metric of (task, policy).

Every speed number in autoprec comes from `interleaved_times`: warmed up, device synchronised,
candidates timed in rotating order within each round (so drift hits all alike), median of rounds.
A step the GradScaler skips (inf/NaN gradients) updates nothing, so throughput counts only effective
steps. The metric is either that of the given weights with the policy applied, or (train mode) that
after K training steps from the same weights in the same batch order (`train_and_evaluate`).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import math
import numbers
import statistics
import time
from collections.abc import Callable, Collection, Hashable, Iterator, Mapping, Sequence
from typing import Protocol, TypeVar

import torch
from tqdm.auto import tqdm

from autoprec import devices
from autoprec.apply import apply_on_chosen_device, compile_model
from autoprec.devices import float32_matmul_precision as float32_matmul_precision  # what the tests read
from autoprec.errors import UserError, describe
from autoprec.policy import Policy
from autoprec.scaler import grad_scaler
from autoprec.tensors import map_tensors
from autoprec.tune import memory
from autoprec.tune.config import MEMORY_TRIES, MIN_ROUNDS, NOISY_SPREAD, SETTLED, SETTLED_FINAL_ROUNDS, TimingConfig
from autoprec.tune.task import Workload, check_loss

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
        log.warning("step times spread up to ±%.0f%%, too wide to rank the candidates; timing %d rounds more",
                    50 * spread, rounds)  # fmt: skip
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


def sqnr_db(reference: torch.Tensor, other: torch.Tensor) -> float:
    """Signal-to-quantisation-noise ratio of `other` against `reference`, in dB (inf when equal)."""
    ref, oth = reference.detach().double().flatten(), other.detach().double().flatten()
    noise = torch.linalg.vector_norm(ref - oth)
    if not torch.isfinite(noise):
        return float("nan")
    if noise == 0:
        return float("inf")
    return float(20 * torch.log10(torch.linalg.vector_norm(ref) / noise))


@dataclasses.dataclass(frozen=True)
class Candidate:
    """What one timed training step runs: a policy, and whether fp32 matmuls may use TF32 (CUDA only; a
    process-wide setting, not a per-layer format, so it is set around each of this candidate's steps)."""

    policy: Policy
    tf32: bool = False


def as_candidate(value: Policy | Candidate) -> Candidate:
    return value if isinstance(value, Candidate) else Candidate(value)


def matmul_precision(device: torch.device, tf32: bool) -> contextlib.AbstractContextManager[None]:
    """fp32 matmuls and cuDNN convolutions strict (IEEE) or TF32 for the duration of one step on a device with TF32
    (CUDA), the caller's settings restored after, through the torch API the caller used; on other devices nothing
    changes (TF32 is a CUDA tensor-core mode). See autoprec.devices: Device.matmul_precision."""
    return devices.lookup(device).matmul_precision(device, tf32)


@contextlib.contextmanager
def compile_scope(compiled: bool, candidates: int) -> Iterator[None]:
    """Where compiled candidates are built and stepped. torch.compile keeps its compiled code per code object
    (the model class's forward) and, past `recompile_limit` (8) variants, silently runs the rest eagerly: a
    search that compiles dozens of candidates of one model would time most of them uncompiled. So each set of
    candidates timed together starts from empty caches (torch.compiler.reset(); the compiled kernels stay in
    inductor's on-disk cache, so a graph seen before compiles fast) with room for all of them."""
    if not compiled:
        yield
        return
    import torch._dynamo  # noqa: PLC0415 (costly; only compiled measurement needs it)

    torch.compiler.reset()
    limit = max(64, 16 * candidates)  # regional compilation: one variant per distinct block policy
    config = torch._dynamo.config
    # torch 2.7 renamed cache_size_limit to recompile_limit (the old names stay as aliases for a while)
    new = hasattr(config, "recompile_limit")
    names = ("recompile_limit", "accumulated_recompile_limit") if new else ("cache_size_limit", "accumulated_cache_size_limit")
    patch: dict[str, int | bool] = {names[0]: limit, names[1]: max(256, 4 * limit)}
    if hasattr(config, "fail_on_cache_limit_hit"):  # past the limit: an error (the candidate fails), never eager
        patch["fail_on_cache_limit_hit"] = True
    with config.patch(patch):  # the dict form: torch types the keyword form's values as dicts
        yield


def policy_model(workload: Workload, policy: Policy) -> torch.nn.Module:
    """A fresh copy of the fp32 reference model with `policy` applied."""
    return apply_on_chosen_device(copy.deepcopy(workload.model), policy)


def batch_order(n_batches: int, steps: int, seed: int = 0) -> tuple[int, ...]:
    """Which train batch each of `steps` steps takes: seed 0 cycles through them as given; another seed
    reshuffles them every pass (a different batch order, for the noise floor)."""
    if seed == 0:
        return tuple(i % n_batches for i in range(steps))
    g = torch.Generator().manual_seed(seed)
    order: list[int] = []
    while len(order) < steps:
        order.extend(torch.randperm(n_batches, generator=g).tolist())
    return tuple(order[:steps])


class Trainer:
    """One candidate's model, optimizer and GradScaler, taking training steps over the train batches.

    `order`: the train-batch indices to take in turn (default: as given, cycling). `skipped` counts the
    steps the GradScaler skipped because of inf/NaN gradients: their weights did not change. `compiled`:
    the loss sees `torch.compile(model)` after the policy is applied, as a user who compiles trains;
    `first_step_s` is then the first step's wall time, which holds the compilation. `tf32`: fp32 matmuls
    may use TF32 (CUDA); otherwise they are strict IEEE fp32 on CUDA, whatever the process's setting.
    """

    def __init__(
        self,
        workload: Workload,
        policy: Policy | Candidate,
        *,
        order: Sequence[int] | None = None,
        compiled: bool = False,
    ):
        candidate = as_candidate(policy)
        self.workload = workload
        self.tf32 = candidate.tf32
        self.policy = candidate.policy
        self.model = policy_model(workload, candidate.policy).train()
        self.compiled = compiled
        self._forward_model = compile_model(self.model) if compiled else self.model
        self.first_step_s: float | None = None
        task = workload.task
        self.optimizer = task.optimizer(self.model) if task.optimizer else torch.optim.AdamW(self.model.parameters())
        # its collapse warning would repeat what the caller counts and reports
        self.scaler = grad_scaler(candidate.policy, workload.device, warn=False)
        self.order = tuple(order) if order is not None else tuple(range(len(workload.train)))
        self._next = 0
        self._stepped: set[int] = set()  # the train batches stepped on (a compiled model has seen their shapes)
        self.steps = 0
        self._nonfinite = torch.zeros((), dtype=torch.bool, device=workload.device)

    def step(self, batch_index: int | None = None) -> torch.Tensor:
        """Forward, backward, optimizer step (through the GradScaler) on the next batch in `order` (or on train
        batch `batch_index`, the order left where it was); returns the loss without syncing (but for the first step
        of a compiled model, timed to the end as its compilation)."""
        first = self.steps == 0
        if first:
            synchronize(self.workload.device)
            start = time.perf_counter()
        if batch_index is None:
            batch_index = self.order[self._next % len(self.order)]
            self._next += 1
        batch = self.workload.train[batch_index]
        self._stepped.add(batch_index)
        self.optimizer.zero_grad(set_to_none=True)
        with matmul_precision(self.workload.device, self.tf32):
            loss = check_loss(self.workload.task, self.workload.task.loss_fn(self._forward_model, batch))
            self._nonfinite |= ~torch.isfinite(loss.detach())
            self.scaler.scale(loss).backward()
            self.scaler.step(self.optimizer)
        self.scaler.update()
        self.steps += 1
        if first:
            synchronize(self.workload.device)
            self.first_step_s = time.perf_counter() - start
        return loss

    def warm_shapes(self) -> None:
        """One step on each train-batch shape not yet stepped on (Workload.shape_batches), its wall time added to
        `first_step_s`: a compiled model compiles a new shape's graph here, so compile time is never step time."""
        for index in self.workload.shape_batches:
            if index in self._stepped:
                continue
            synchronize(self.workload.device)
            start = time.perf_counter()
            self.step(index)
            synchronize(self.workload.device)
            self.first_step_s = (self.first_step_s or 0.0) + time.perf_counter() - start

    def __call__(self) -> torch.Tensor:
        """A Step (what a Clock times): the next training step; `model` is the model it trains."""
        return self.step()

    def state(self) -> Iterator[torch.Tensor]:
        """What the candidate keeps between steps: parameters, buffers, optimizer state."""
        yield from self.model.parameters()
        yield from self.model.buffers()
        for per_param in self.optimizer.state.values():
            yield from (v for v in per_param.values() if isinstance(v, torch.Tensor))

    def peak_memory(self) -> int | None:
        """Bytes at the peak of one more training step (see memory.py): the state, plus the rise over the step
        with the gradients freed first. Every candidate is measured on the same batch, the largest (batches may
        differ in size), and on a step that updated the weights: a step the GradScaler skips never runs the
        optimizer's step, whose temporaries may be the peak, so it is measured again (up to MEMORY_TRIES). None
        where the device has no measurement, a profiler of the user's runs, or every try was skipped. Taken after a
        step on that batch (one more if the timing took none), so the optimizer state exists and a compiled model
        is compiled for its shapes."""
        index = largest_batch(self.workload)
        if index not in self._stepped:  # unmeasured: the optimizer state exists, a compiled model has seen its shape
            self.step(index)
        for _ in range(MEMORY_TRIES):
            self.optimizer.zero_grad(set_to_none=True)
            state = memory.state_bytes(self.state())  # before the step: state it creates is in the rise
            skipped = self.scaler.skipped_steps
            rise = memory.rise_bytes(self.workload.device, lambda: self.step(index))
            if rise is None:
                return None
            if self.scaler.skipped_steps == skipped:
                return state + rise
        log.warning("peak memory not measured: the GradScaler skipped %d steps in a row (inf/NaN gradients)", MEMORY_TRIES)
        return None

    @property
    def finite(self) -> bool:
        return not bool(self._nonfinite.item())

    @property
    def skipped(self) -> int:
        """Steps the GradScaler skipped (inf/NaN gradients); read from the check its step() already made."""
        return self.scaler.skipped_steps


@dataclasses.dataclass(frozen=True)
class StepStats:
    """A candidate's training steps as timed: per-call time, whether losses stayed finite, and how many
    of its steps (from its first, warm-up included) the GradScaler skipped. `compile_s`: the seconds of the first
    step and of the first on each other batch shape (Trainer.warm_shapes) when the model was compiled (None when eager). `peak_bytes`: one step's peak memory after the
    timing (Trainer.peak_memory; None where not measured)."""

    timing: Timing
    finite: bool
    steps: int
    skipped: int
    compile_s: float | None = None
    peak_bytes: int | None = None

    @property
    def skip_fraction(self) -> float:
        return self.skipped / self.steps if self.steps else 0.0

    @property
    def effective_ms(self) -> float:
        """Milliseconds per step that updated the weights: skipped steps are wasted work."""
        kept = 1.0 - self.skip_fraction
        return self.timing.median_ms / kept if kept > 0 else math.inf


def fp32_step_failed(workload: Workload, what: str, detail: str, *, compiled: bool) -> UserError:
    """The fp32 step failing is the user's code, not a format's: one message wherever it is found."""
    hint = "; run with --no-compile to measure eagerly" if compiled else ""
    return UserError(f"{workload.task.path}: the {'compiled ' if compiled else ''}{what} failed: {detail}{hint}")


def measure_steps(
    workload: Workload,
    policies: Mapping[str, Policy | Candidate],
    config: TimingConfig = TimingConfig(),
    *,
    progress: str | None = None,
    compiled: bool = False,
) -> dict[str, StepStats]:
    """Training-step time of each policy (or Candidate), interleaved, with finiteness and skipped steps (no peak memory);
    `compiled`: each model under torch.compile, its compilation in the warm-up (see compile_scope). Raises
    naming the first candidate that cannot be built or take a step (measure_steps_or_fail reports them)."""
    stats, failed = measure_steps_or_fail(workload, policies, config, progress=progress, compiled=compiled, peak_memory=False)
    if failed:
        name, error = next(iter(failed.items()))
        raise RuntimeError(f"candidate {name!r} cannot take a training step: {error}")
    return stats


def measure_steps_or_fail(
    workload: Workload,
    policies: Mapping[str, Policy | Candidate],
    config: TimingConfig = TimingConfig(),
    *,
    progress: str | None = None,
    compiled: bool = False,
    enough: Callable[[Mapping[str, Sequence[float]]], bool] | None = None,
    more: Callable[[Mapping[str, Sequence[float]]], int] | None = None,
    peak_memory: bool = True,
) -> tuple[dict[str, StepStats], dict[str, str]]:
    """measure_steps, and (name -> "Error: message") for the candidates whose model or first step failed (the
    user's code in a format it cannot run, a compiler error): a finding about that candidate, not a crash.
    `enough`, `more`: as interleaved_times'. `peak_memory`: each candidate's peak memory, from one more step after the
    timing (StepStats.peak_bytes)."""
    failed: dict[str, str] = {}
    with compile_scope(compiled, len(policies)):
        trainers = {}
        for name, policy in policies.items():
            try:
                trainer = Trainer(workload, policy, compiled=compiled)
                trainer.step()  # builds (and compiles) now, so a failure is this candidate's alone
                if compiled:
                    trainer.warm_shapes()  # and for every batch shape, outside the timed rounds
            except Exception as exc:
                if isinstance(exc, UserError):
                    raise
                failed[name] = describe(exc)
                continue
            trainers[name] = trainer
        work: dict[str, Callable[[], object]] = dict(trainers)  # a Trainer is a Step: its call, its model
        timings = interleaved_times(work, workload.device, config, progress=progress, enough=enough, more=more) if work else {}
        stats = step_stats(trainers, timings)  # the timed steps' counts, before the memory's extra step
        if not peak_memory:
            return stats, failed
        # after the timing, never inside it
        return {n: dataclasses.replace(s, peak_bytes=peak_memory_or_none(trainers[n], n)) for n, s in stats.items()}, failed


def largest_batch(workload: Workload) -> int:
    """The index of the train batch with the most tensor bytes (the first of equals): what peak memory is measured on."""
    sizes = [batch_bytes(batch) for batch in workload.train]
    return max(range(len(sizes)), key=lambda i: (sizes[i], -i))


def batch_bytes(batch: object) -> int:
    """The bytes of every tensor in a (nested) batch."""
    sizes: list[int] = []

    def count(t: torch.Tensor) -> torch.Tensor:
        sizes.append(t.numel() * t.element_size())
        return t  # the same tensor: nothing is copied

    map_tensors(batch, count)
    return sum(sizes)


def peak_memory_or_none(trainer: Trainer, name: str = "a candidate") -> int | None:
    """trainer.peak_memory(); None, with a warning naming the candidate and the error, if that extra step fails (it
    just ran in the timing, so this is the measurement's fault, not the candidate's)."""
    try:
        return trainer.peak_memory()
    except UserError:
        raise
    except Exception as exc:
        log.warning("peak memory of %s not measured: %s", name, describe(exc))
        return None


def step_stats(trainers: Mapping[str, Trainer], timings: Mapping[str, Timing]) -> dict[str, StepStats]:
    return {
        n: StepStats(timings[n], t.finite, t.steps, t.skipped, t.first_step_s if t.compiled else None)
        for n, t in trainers.items()
    }


@dataclasses.dataclass(frozen=True)
class TrainOutcome:
    """The metric after training: K steps from the reference weights; `skipped` of them by the GradScaler."""

    metric: float
    finite: bool
    steps: int
    skipped: int


def train_and_evaluate(workload: Workload, policy: Policy | Candidate, steps: int, *, seed: int = 0) -> TrainOutcome:
    """Train a fresh copy of the reference weights `steps` steps with `policy` (and its GradScaler), then
    evaluate it with the policy applied. `seed` fixes the batch order (see batch_order) and torch's RNG
    (dropout), so two policies with the same seed see the same batches and the same masks. The caller's
    RNG state is left as it was."""
    with devices.lookup(workload.device).fork_rng(workload.device):
        torch.manual_seed(seed)
        trainer = Trainer(workload, policy, order=batch_order(len(workload.train), steps, seed))
        for _ in range(steps):
            trainer.step()
        finite = trainer.finite
        with matmul_precision(workload.device, trainer.tf32):
            metric = metric_of(workload, trainer.model) if finite else math.nan
    return TrainOutcome(metric=metric, finite=finite and math.isfinite(metric), steps=steps, skipped=trainer.skipped)


@dataclasses.dataclass(frozen=True)
class NoiseFloor:
    """How much the all-fp32 metric after K training steps moves by chance.

    `metrics[i]`: fp32 trained with seed i (seed 0: the batches in the given order, the run every
    candidate is compared with; others: reshuffled batches and other dropout masks); `repeat`: seed 0
    once more (the device's own nondeterminism). `spread`: max - min over all of them.
    """

    steps: int
    metrics: tuple[float, ...]
    repeat: float

    @property
    def reference(self) -> float:
        return self.metrics[0]

    @property
    def spread(self) -> float:
        values = [*self.metrics, self.repeat]
        return max(values) - min(values)

    def to_dict(self) -> dict[str, object]:
        return {"train_steps": self.steps, "spread": self.spread, "fp32_metrics_by_seed": list(self.metrics),
                "fp32_seed0_repeat": self.repeat}  # fmt: skip

    @classmethod
    def from_dict(cls, data: object) -> NoiseFloor | None:
        """What to_dict wrote (a policy file's `measured.noise`); None where it is missing or malformed."""
        if not isinstance(data, Mapping):
            return None
        seeds, steps, repeat = data.get("fp32_metrics_by_seed"), data.get("train_steps"), data.get("fp32_seed0_repeat")
        if not isinstance(seeds, (list, tuple)) or not seeds or not isinstance(repeat, (int, float)):
            return None
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in [*seeds, repeat]):
            return None
        if isinstance(steps, bool) or not isinstance(steps, int):
            return None
        return cls(steps=steps, metrics=tuple(float(v) for v in seeds), repeat=float(repeat))


def noise_floor(workload: Workload, steps: int, runs: int = 3) -> NoiseFloor:
    """Train all-fp32 `runs` times (seeds 0..runs-1) and seed 0 once more; see NoiseFloor."""
    if runs < 1:
        raise ValueError(f"noise runs must be >= 1, but got {runs!r}")
    fp32 = Policy()
    metrics = tuple(train_and_evaluate(workload, fp32, steps, seed=s).metric for s in range(runs))
    repeat = train_and_evaluate(workload, fp32, steps, seed=0).metric
    return NoiseFloor(steps=steps, metrics=metrics, repeat=repeat)


def default_evaluate(workload: Workload, model: torch.nn.Module) -> float:
    """-(mean eval loss): the metric when model.py defines no evaluate()."""
    losses = [check_loss(workload.task, workload.task.loss_fn(model, batch)).float() for batch in workload.eval]
    return -float(torch.stack(losses).mean().item())


def _as_metric(workload: Workload, value: object) -> float:
    """evaluate()'s return value as a float; anything but a real number (or a one-element tensor) is the
    user's bug, named in one line."""
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.dtype.is_complex:
        return float(value.item())
    if isinstance(value, numbers.Real) and not isinstance(value, bool):  # numpy's scalars register as Real
        return float(value)
    item = getattr(value, "item", None)
    if callable(item) and getattr(value, "size", None) == 1 and getattr(getattr(value, "dtype", None), "kind", "x") in "fiu":
        return float(item())  # a one-element numpy array
    shown = (
        f"a tensor of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else f"{type(value).__name__} {value!r:.60}"
    )
    raise UserError(f"{workload.task.path}: evaluate() must return a number (higher is better), but returned {shown}")


def metric_of(workload: Workload, model: torch.nn.Module) -> float:
    """The task's metric (higher is better) of `model`, in eval mode without gradients."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            if workload.task.evaluate is None:
                return default_evaluate(workload, model)
            return _as_metric(workload, workload.task.evaluate(model))
    finally:
        model.train(was_training)


def evaluate_metric(workload: Workload, policy: Policy | Candidate) -> float:
    """The metric of the reference weights with `policy` applied, eagerly: compilation fuses kernels for speed
    and moves the numbers only at rounding level, and compiling every candidate's evaluation would double the
    compilations a search pays."""
    candidate = as_candidate(policy)
    with matmul_precision(workload.device, candidate.tf32):
        return metric_of(workload, policy_model(workload, candidate.policy))


def metric_name(workload: Workload) -> str:
    return "evaluate()" if workload.task.evaluate is not None else "-(mean eval loss)"
