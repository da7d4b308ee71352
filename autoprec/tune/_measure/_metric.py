"""The metric of (task, policy): that of the given weights with the policy applied (`evaluate_metric`), or (train
mode) that after K training steps from the same weights in the same batch order (`train_and_evaluate`), and how
much the fp32 result moves by chance (`noise_floor`); `sqnr_db`, how far one output is from another.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Mapping

import torch

from autoprec import devices
from autoprec.errors import UserError
from autoprec.policy import Policy
from autoprec.tune._core._config import METRIC_REPEAT_TOLERANCE
from autoprec.tune._core._records import Candidate, as_candidate
from autoprec.tune._measure._task import Workload, check_loss, random_state
from autoprec.tune._measure._trainer import Trainer, matmul_precision, new_trainer, trained_model


def sqnr_db(reference: torch.Tensor, other: torch.Tensor) -> float:
    """Signal-to-quantisation-noise ratio of `other` against `reference`, in dB (inf when equal)."""
    ref, oth = reference.detach().double().flatten(), other.detach().double().flatten()
    noise = torch.linalg.vector_norm(ref - oth)
    if not torch.isfinite(noise):
        return float("nan")
    if noise == 0:
        return float("inf")
    return float(20 * torch.log10(torch.linalg.vector_norm(ref) / noise))


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
    device = devices.lookup(workload.device)
    with device.fork_rng(workload.device):
        device.manual_seed(workload.device, seed)
        trainer = new_trainer(workload, policy, order=batch_order(len(workload.train), steps, seed))
        for _ in range(steps):
            trainer.step()
        finite = trainer.finite
        metric = trained_metric(workload, trainer) if finite else math.nan
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
        return {
            "train_steps": self.steps,
            "spread": self.spread,
            "fp32_metrics_by_seed": list(self.metrics),
            "fp32_seed0_repeat": self.repeat,
        }

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
    compilations a search pays. On a sharded workload, evaluated on every rank together (Workload.sharding)."""
    candidate = as_candidate(policy)
    if workload.sharding is not None:
        return workload.sharding.metric(workload, candidate)
    return evaluate_here(workload, candidate)


def evaluate_here(workload: Workload, candidate: Candidate) -> float:
    """evaluate_metric on this process alone (a rank's part of a sharded evaluation: its model sharded too)."""
    with matmul_precision(workload.device, candidate.tf32):
        return metric_of(workload, trained_model(workload, candidate.policy))


def trained_metric(workload: Workload, trainer: Trainer) -> float:
    """The metric of the model `trainer` trained (its TF32 setting kept), on every rank together where sharded."""
    if workload.sharding is not None:
        return workload.sharding.trained_metric(trainer)
    with matmul_precision(workload.device, trainer.tf32):
        return metric_of(workload, trainer.model)


def metric_name(workload: Workload) -> str:
    return "evaluate()" if workload.task.evaluate is not None else "-(mean eval loss)"


def checked_fp32_metric(workload: Workload) -> float:
    """The all-fp32 model's metric, or one UserError naming the file when the user's evaluate() (or loss_fn on
    the eval batches) fails on it or gives a non-finite number: their bug, not a format's."""
    what = "evaluate()" if workload.task.evaluate is not None else "loss_fn() on the eval batches"
    try:
        # twice, from two different random states: a metric that moves on its own (sampling, a random eval subset,
        # even one drawn from a generator seeded by the process's seed) would rule formats out on its noise
        with random_state(workload, 1):
            fp32_metric = evaluate_metric(workload, Policy())
        with random_state(workload, 2):
            again = evaluate_metric(workload, Policy())
    except UserError:
        raise
    except Exception as exc:
        raise UserError(f"{workload.task.path}: {what} failed on the fp32 model: {type(exc).__name__}: {exc}") from exc
    if not math.isfinite(fp32_metric):
        raise UserError(f"{workload.task.path}: the all-fp32 model's metric is {fp32_metric}; it must be finite")
    if abs(again - fp32_metric) > METRIC_REPEAT_TOLERANCE * max(1.0, abs(fp32_metric)):
        raise UserError(
            f"{workload.task.path}: {what} gave {fp32_metric:.6g}, then {again:.6g} for the same fp32 model: a budget "
            "cannot be judged on a metric that moves on its own; make it deterministic (the same eval batches every "
            "call, no sampling, a fixed seed inside evaluate rather than the process's)"
        )
    return fp32_metric


def workload_fp32_metric(workload: Workload) -> float:
    """The all-fp32 model's metric, checked (checked_fp32_metric: evaluated twice), taken once per workload for the
    budget's resolution and the profile alike (kept in Workload.fp32_metric_seen): the model is never trained in
    place."""
    if workload.fp32_metric_seen is None:
        workload.fp32_metric_seen = checked_fp32_metric(workload)
    return workload.fp32_metric_seen
