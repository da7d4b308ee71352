"""The two measurements everything shares: the training-step time and the metric of (task, policy).

Every speed number in autoprec comes from `interleaved_times`: warmed up, device synchronised,
candidates timed in rotating order within each round (so drift hits all alike), median of rounds.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import statistics
import time
from collections.abc import Callable, Mapping

import torch

from autoprec.apply import apply_policy, grad_scaler
from autoprec.policy import Policy
from autoprec.task import Workload, check_loss


@dataclasses.dataclass(frozen=True)
class TimingConfig:
    """How long to time: `rounds` interleaved rounds of at least `min_block_s` seconds per candidate."""

    warmup: int = 3
    rounds: int = 7
    min_block_s: float = 0.05
    max_steps_per_block: int = 50

    def __post_init__(self) -> None:
        if self.warmup < 0 or self.rounds < 1 or self.min_block_s < 0 or self.max_steps_per_block < 1:
            raise ValueError(f"TimingConfig needs warmup >= 0, rounds >= 1, min_block_s >= 0, got {self}")


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
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def interleaved_times(
    work: Mapping[str, Callable[[], object]], device: torch.device, config: TimingConfig = TimingConfig()
) -> dict[str, Timing]:
    """Time each callable (one unit of work, e.g. one training step) interleaved with the others."""
    names = list(work)
    steps: dict[str, int] = {}
    for name in names:
        for _ in range(config.warmup):
            work[name]()
        synchronize(device)
        start = time.perf_counter()
        work[name]()
        synchronize(device)
        once = max(time.perf_counter() - start, 1e-6)
        steps[name] = max(1, min(config.max_steps_per_block, math.ceil(config.min_block_s / once)))
    samples: dict[str, list[float]] = {name: [] for name in names}
    for r in range(config.rounds):
        k = r % len(names)
        for name in names[k:] + names[:k]:  # rotate so no candidate always runs first
            synchronize(device)
            start = time.perf_counter()
            for _ in range(steps[name]):
                work[name]()
            synchronize(device)
            samples[name].append((time.perf_counter() - start) * 1e3 / steps[name])
    return {name: Timing.from_samples(samples[name]) for name in names}


def probe_times(
    work: Mapping[str, Callable[[], object]], device: torch.device, *, warmup: int = 2, repeats: int = 3
) -> dict[str, float]:
    """The fastest of a few calls each after warm-up, in ms: enough to spot a format many times slower."""
    out = {}
    for name, fn in work.items():
        for _ in range(warmup):
            fn()
        best = math.inf
        for _ in range(repeats):
            synchronize(device)
            start = time.perf_counter()
            fn()
            synchronize(device)
            best = min(best, time.perf_counter() - start)
        out[name] = best * 1e3
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


def policy_model(workload: Workload, policy: Policy) -> torch.nn.Module:
    """A fresh copy of the fp32 reference model with `policy` applied."""
    return apply_policy(copy.deepcopy(workload.model), policy)


class Trainer:
    """One candidate's model, optimizer and GradScaler, taking training steps over the train batches."""

    def __init__(self, workload: Workload, policy: Policy):
        self.workload = workload
        self.model = policy_model(workload, policy).train()
        task = workload.task
        self.optimizer = task.optimizer(self.model) if task.optimizer else torch.optim.AdamW(self.model.parameters())
        self.scaler = grad_scaler(policy, workload.device)
        self._next = 0
        self.steps = 0
        self.skipped = 0
        self._nonfinite = torch.zeros((), dtype=torch.bool, device=workload.device)

    def step(self) -> torch.Tensor:
        """Forward, backward, optimizer step (through the GradScaler); returns the loss without syncing."""
        batch = self.workload.train[self._next % len(self.workload.train)]
        self._next += 1
        self.optimizer.zero_grad(set_to_none=True)
        loss = check_loss(self.workload.task, self.workload.task.loss_fn(self.model, batch))
        self._nonfinite |= ~torch.isfinite(loss.detach())
        self.scaler.scale(loss).backward()
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.steps += 1
        return loss

    @property
    def finite(self) -> bool:
        return not bool(self._nonfinite.item())


def time_steps(
    workload: Workload, policies: Mapping[str, Policy], config: TimingConfig = TimingConfig()
) -> tuple[dict[str, Timing], dict[str, bool]]:
    """Training-step time of each policy, interleaved; also whether every loss stayed finite."""
    trainers = {name: Trainer(workload, policy) for name, policy in policies.items()}
    timings = interleaved_times({name: t.step for name, t in trainers.items()}, workload.device, config)
    return timings, {name: t.finite for name, t in trainers.items()}


def default_evaluate(workload: Workload, model: torch.nn.Module) -> float:
    """-(mean eval loss): the metric when model.py defines no evaluate()."""
    losses = [check_loss(workload.task, workload.task.loss_fn(model, batch)).float() for batch in workload.eval]
    return -float(torch.stack(losses).mean().item())


def metric_of(workload: Workload, model: torch.nn.Module) -> float:
    """The task's metric (higher is better) of `model`, in eval mode without gradients."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            if workload.task.evaluate is None:
                return default_evaluate(workload, model)
            return float(workload.task.evaluate(model))
    finally:
        model.train(was_training)


def evaluate_metric(workload: Workload, policy: Policy) -> float:
    """The metric of the reference weights with `policy` applied."""
    return metric_of(workload, policy_model(workload, policy))


def metric_name(workload: Workload) -> str:
    return "evaluate()" if workload.task.evaluate is not None else "-(mean eval loss)"
