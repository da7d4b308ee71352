"""One candidate's training steps: its model with the policy applied, optimizer and GradScaler (`Trainer`), built
where compiled candidates may be (`compile_scope`), and timed interleaved with the others (`measure_steps`).
A step the GradScaler skips (inf/NaN gradients) updates nothing, so throughput counts only effective steps.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import math
import time
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence

import torch

from autoprec import devices
from autoprec.apply import after_optimizer_step, apply_on_chosen_device, compile_model
from autoprec.errors import UserError, describe
from autoprec.policy import Policy
from autoprec.scaler import grad_scaler
from autoprec.schedule import follow_schedule
from autoprec.tensors import map_tensors
from autoprec.tune._core import _memory as memory
from autoprec.tune._core._config import MEMORY_TRIES, TimingConfig
from autoprec.tune._core._records import Candidate, as_candidate
from autoprec.tune._measure._task import Workload, check_loss
from autoprec.tune._measure._timing import Timing, interleaved_times, synchronize

log = logging.getLogger("autoprec")


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


def default_optimizer(model: torch.nn.Module, device: torch.device) -> torch.optim.Optimizer:
    """The optimizer of a model.py that defines none: AdamW, fused where the device says it pays (Device.fused_adamw:
    CUDA). A model.py's own optimizer(model) always wins."""
    fused = devices.lookup(device).fused_adamw or None  # None: torch's own choice (foreach), as before
    return torch.optim.AdamW(model.parameters(), fused=fused)


def policy_model(workload: Workload, policy: Policy) -> torch.nn.Module:
    """A fresh copy of the fp32 reference model with `policy` applied."""
    return apply_on_chosen_device(copy.deepcopy(workload.model), policy)


def trained_model(workload: Workload, policy: Policy) -> torch.nn.Module:
    """policy_model, then sharded as the user trains it where the workload is (Workload.sharding: model.py's
    parallelize after the policy, which names the unsharded modules): what a candidate's steps and metric run on.
    Every candidate starts from a fresh copy of the reference weights, so no trial trains the model the next starts
    from, sharded or not."""
    model = policy_model(workload, policy)
    return workload.sharding.shard(model) if workload.sharding is not None else model


def new_trainer(
    workload: Workload, policy: Policy | Candidate, *, order: Sequence[int] | None = None, compiled: bool = False
) -> Trainer:
    """A Trainer for `policy`, or, on a sharded workload, the leader's handle on one built on every rank together
    (Workload.sharding.trainer), which answers as a Trainer does."""
    if workload.sharding is not None:
        return workload.sharding.trainer(workload, policy, order=order, compiled=compiled)  # type: ignore[no-any-return]
    return Trainer(workload, policy, order=order, compiled=compiled)


class Trainer:
    """One candidate's model, optimizer and GradScaler, taking training steps over the train batches.

    `order`: the train-batch indices to take in turn (default: as given, cycling). `skipped` counts the
    steps the GradScaler skipped because of inf/NaN gradients: their weights did not change. `compiled`:
    the loss sees `torch.compile(model)` after the policy is applied, as a user who compiles trains;
    `first_step_s` is then the first step's wall time, which holds the compilation. `tf32`: fp32 matmuls
    may use TF32 (CUDA); otherwise they are strict IEEE fp32 on CUDA, whatever the process's setting.
    `total_steps`: the run's length, which a policy with phases needs (each step follows its schedule, as a user's
    loop does with autoprec.follow_schedule).
    """

    def __init__(
        self,
        workload: Workload,
        policy: Policy | Candidate,
        *,
        order: Sequence[int] | None = None,
        compiled: bool = False,
        total_steps: int | None = None,
    ):
        candidate = as_candidate(policy)
        if candidate.policy.phases and total_steps is None:
            raise ValueError("a policy with phases trains over a known run: give Trainer its total_steps")
        self.total_steps = total_steps
        self.workload = workload
        self.tf32 = candidate.tf32
        self.policy = candidate.policy
        self.model = trained_model(workload, candidate.policy).train()
        self.compiled = compiled
        if candidate.cuda_graphs and not compiled:
            raise ValueError("a CUDA-graphs candidate is a compiled one (torch.compile's mode='reduce-overhead')")
        mode = "reduce-overhead" if candidate.cuda_graphs else None
        self._forward_model = compile_model(self.model, mode=mode) if compiled else self.model
        self.first_step_s: float | None = None
        task = workload.task
        self.optimizer = task.optimizer(self.model) if task.optimizer else default_optimizer(self.model, workload.device)
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
        if self.total_steps is not None and self.policy.phases:
            follow_schedule(self.model, step=self.steps, total_steps=self.total_steps)
        self.optimizer.zero_grad(set_to_none=True)
        with matmul_precision(self.workload.device, self.tf32):
            loss = check_loss(self.workload.task, self.workload.task.loss_fn(self._forward_model, batch))
            self._nonfinite |= ~torch.isfinite(loss.detach())
            self.scaler.scale(loss).backward()
            self.scaler.step(self.optimizer)
        self.scaler.update()
        # as a user's loop does: the fp8 weights' scales precomputed after the step; asked only where the policy
        # gathers in fp8, since the call walks the model's modules and this is host time inside timed steps
        if self.policy.fsdp_fp8_all_gather:
            after_optimizer_step(self.model)
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

    def idle(self) -> None:
        """Between its timed blocks: the gradients go (the next step's zero_grad would drop them anyway), so an idle
        candidate holds its weights and optimizer state alone while the others are timed."""
        self.optimizer.zero_grad(set_to_none=True)

    def release(self) -> None:
        """Free what this candidate holds on its device now: its optimizer state, gradients, weights and buffers (left
        empty; it takes no step after this). Dropping the Trainer is not enough: a policy model's forward is bound to
        it (a reference cycle), so its tensors would wait for the cyclic collector, which the timing holds off."""
        self.optimizer.state.clear()
        with torch.no_grad():
            for t in (*self.model.parameters(), *self.model.buffers()):
                t.grad = None
                t.data = t.data.new_empty(0)

    def state(self) -> Iterator[torch.Tensor]:
        """What the candidate keeps between steps: parameters, buffers, optimizer state."""
        yield from self.model.parameters()
        yield from self.model.buffers()
        for per_param in self.optimizer.state.values():
            yield from (v for v in per_param.values() if isinstance(v, torch.Tensor))

    def peak_memory(self) -> int | None:
        """Bytes at the peak of one more training step (see _memory.py): the state, plus the rise over the step
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
        return effective_ms(self.timing.median_ms, self.steps, self.skipped)


def effective_ms(ms: float, steps: int, skipped: int) -> float:
    """A step's `ms` counted for the steps that updated the weights (`skipped` of `steps` by the GradScaler: wasted
    work); inf where every one was skipped."""
    kept = 1.0 - (skipped / steps if steps else 0.0)
    return ms / kept if kept > 0 else math.inf


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
    retire: Callable[[Mapping[str, Sequence[float]]], Collection[str]] | None = None,
    peak_memory: bool = True,
    each_round: Callable[[Mapping[str, Sequence[float]]], None] | None = None,
) -> tuple[dict[str, StepStats], dict[str, str]]:
    """measure_steps, and (name -> "Error: message") for the candidates whose model or first step failed (the
    user's code in a format it cannot run, a compiler error): a finding about that candidate, not a crash.
    `enough`, `more`, `retire`, `each_round`: as interleaved_times'. `peak_memory`: each candidate's peak memory, from
    one more step after its timing (StepStats.peak_bytes): after the last round, or, for one retired early, as it
    retires, between two rounds (outside every round's clock), so that its memory is freed then. A candidate that fails in its timed rounds (out of the
    device's memory, say) is among the failed, and the others are timed on; one retired or failed frees its device
    memory at once (Trainer.release), the others once the timing ends."""
    failed: dict[str, str] = {}
    with compile_scope(compiled, len(policies)):
        trainers: dict[str, Trainer] = {}
        for name, policy in policies.items():
            built: Trainer | None = None
            try:
                built = new_trainer(workload, policy, compiled=compiled)
                built.step()  # builds (and compiles) now, so a failure is this candidate's alone
                if compiled:
                    built.warm_shapes()  # and for every batch shape, outside the timed rounds
            except Exception as exc:
                if isinstance(exc, UserError):
                    raise
                failed[name] = describe(exc)
                release_trainer(built)  # what it built before it failed: freed before the next one is built
                continue
            trainers[name] = built
        # a candidate timed no more (out of the running, or failed in its rounds: out of the device's memory, say) lets
        # go of its model and optimizer state at once, its counts and peak kept; the others go once the timing ends
        done: dict[str, tuple[_Counts, int | None]] = {}

        def drop(name: str, exc: Exception | None) -> None:
            trainer = trainers.pop(name)
            if exc is not None:
                failed[name] = f"failed in its timed rounds: {describe(exc)}"
            else:
                done[name] = (_Counts.of(trainer), peak_memory_or_none(trainer, name) if peak_memory else None)
            _release(trainer)

        try:
            timings = (
                interleaved_times(
                    dict(trainers),  # a Trainer is a Step: its call, its model
                    workload.device,
                    config,
                    progress=progress,
                    enough=enough,
                    more=more,
                    retire=_effective(retire, trainers),
                    idle=lambda name: _idle(trainers[name]),
                    drop=drop,
                    each_round=each_round,
                )
                if trainers
                else {}
            )
            for name, trainer in trainers.items():  # the timed steps' counts, before the memory's extra step
                done[name] = (_Counts.of(trainer), None)
            if peak_memory:  # after the last round (a retired candidate's was taken between rounds, as it retired)
                for name, trainer in trainers.items():
                    done[name] = (done[name][0], peak_memory_or_none(trainer, name))
        finally:
            for trainer in trainers.values():
                _release(trainer)
            trainers.clear()
        stats = {n: done[n][0].stats(timings[n], done[n][1]) for n in timings}
        return stats, failed


@dataclasses.dataclass(frozen=True)
class _Counts:
    """What a candidate's StepStats reads of its trainer, kept when the trainer is released."""

    finite: bool
    steps: int
    skipped: int
    compile_s: float | None

    @classmethod
    def of(cls, trainer: Trainer) -> _Counts:
        return cls(trainer.finite, trainer.steps, trainer.skipped, trainer.first_step_s if trainer.compiled else None)

    def stats(self, timing: Timing, peak_bytes: int | None) -> StepStats:
        return StepStats(timing, self.finite, self.steps, self.skipped, self.compile_s, peak_bytes)


def _idle(trainer: Trainer) -> None:
    idle = getattr(trainer, "idle", None)  # a sharded search's handle has none: its ranks hold their own
    if idle is not None:
        idle()


def _release(trainer: Trainer) -> None:
    """trainer.release(), where it has one (a sharded search's handle frees its ranks' trainers once dropped)."""
    release = getattr(trainer, "release", None)
    if release is not None:
        release()


def release_trainer(trainer: Trainer | None) -> None:
    """Free a trainer's device memory now (Trainer.release), where there is one: what a caller no longer needs."""
    if trainer is not None:
        _release(trainer)


def _effective(
    retire: Callable[[Mapping[str, Sequence[float]]], Collection[str]] | None, trainers: Mapping[str, Trainer]
) -> Callable[[Mapping[str, Sequence[float]]], Collection[str]] | None:
    """`retire` shown each candidate's effective step times so far (StepStats.effective_ms: a step its GradScaler
    skipped updates nothing, so the time counts for the steps taken; inf where a loss went non-finite or every step
    was skipped), so a candidate is put out of the running, and puts others out, by what training with it costs."""
    if retire is None:
        return None

    def effective(samples: Mapping[str, Sequence[float]]) -> Collection[str]:
        shown = {}
        for name, ms in samples.items():
            t = trainers[name]
            shown[name] = [effective_ms(x, t.steps, t.skipped) if t.finite else math.inf for x in ms]
        return retire(shown)

    return effective


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
    return {n: _Counts.of(t).stats(timings[n], None) for n, t in trainers.items()}
