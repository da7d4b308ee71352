"""A policy over a training horizon: the baseline (fp32, or uniform bf16) and the policy trained side by side from the
same weights on the same batches with the same random draws, their losses every step and their metrics every few
steps; whether the budget holds at the end; and, where it does not, a phase switch (the policy's layers below bf16
raised to bf16 from a step on) trained from the policy's own state at that step, so the proposal is measured, never
guessed.

A search picks a policy from a short horizon, where a format's damage (NVFP4's, fp8's) may show only late; this is the
check over the run's own length.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from autoprec.formats import Format
from autoprec.policy import ROOT, Policy
from autoprec.tune._core._budget import Budget
from autoprec.tune._measure._metric import batch_order, trained_metric
from autoprec.tune._measure._task import Workload, random_state
from autoprec.tune._measure._trainer import Trainer, release_trainer

BASELINES = ("fp32", "bf16")
# the share of the budget the drop may reach before the switch: the layers are raised there, and the drop still grows a
# little while the raised layers settle
SWITCH_SHARE = 0.5
# --seed's range: each step's and each evaluation's draws are seeded from it, within NumPy's seeds (below 2**32)
SEEDS = 2**32


@dataclasses.dataclass(frozen=True)
class CurvePoint:
    """One step of the run: each arm's training loss, and, where evaluated, each arm's metric (higher is better)."""

    step: int
    baseline_loss: float
    policy_loss: float
    baseline_metric: float | None = None
    policy_metric: float | None = None
    switched_loss: float | None = None
    switched_metric: float | None = None

    @property
    def drop(self) -> float | None:
        """How far the policy's metric is below the baseline's here (None where not evaluated)."""
        if self.baseline_metric is None or self.policy_metric is None:
            return None
        return self.baseline_metric - self.policy_metric

    @property
    def switched_drop(self) -> float | None:
        if self.baseline_metric is None or self.switched_metric is None:
            return None
        return self.baseline_metric - self.switched_metric


@dataclasses.dataclass(frozen=True)
class Switch:
    """A phase switch: from `step` (`from_fraction` of the run) the `layers` run in these formats; `drop` the metric
    drop it measured at the end."""

    step: int
    from_fraction: float
    layers: Mapping[str, str]
    drop: float

    def phase(self) -> dict[str, Any]:
        """The switch as a schedule's phase: from which share of the run, which layers in which format."""
        return {"from_fraction": round(self.from_fraction, 4), "layers": dict(self.layers)}


@dataclasses.dataclass(frozen=True)
class Validation:
    """The side-by-side run: the curve, the budget (None: none given or recorded), and the switch measured where the
    budget did not hold at the end (None otherwise, or where no layer of the policy is below bf16)."""

    steps: int
    baseline: str
    curve: tuple[CurvePoint, ...]
    budget: float | None
    switch: Switch | None = None

    @property
    def final_drop(self) -> float:
        return next(p.drop for p in reversed(self.curve) if p.drop is not None)  # type: ignore[return-value]

    @property
    def holds(self) -> bool | None:
        """Whether the policy's drop at the end is within the budget (never where it is not a number: a metric went
        non-finite); None without a budget."""
        return None if self.budget is None else self.final_drop <= self.budget


def raised(policy: Policy) -> dict[str, str]:
    """The policy's layers below bf16 (fp8, MXFP8, NVFP4, fp16: narrower or scaled) and the format each is raised to:
    bf16, the format a late phase trains them in (Megatron's NVFP4 healing raises a whole model so)."""
    keep = {Format.FP32, Format.BF16}
    return {name: Format.BF16.value for name, fmt in policy.layers.items() if fmt not in keep}  # an fp16 root too


def validate(
    workload: Workload,
    policy: Policy,
    steps: int,
    *,
    every: int | None = None,
    baseline: str = "fp32",
    budget: float | Budget | None = None,
    seed: int = 0,
    progress: Callable[[int], None] | None = None,
    more: Callable[[int], None] | None = None,
) -> Validation:
    """Train `baseline` and `policy` side by side for `steps` steps, evaluate both every `every` steps (default a tenth
    of the run) and at the end; where `budget` is given (a relative one resolved against the baseline's final metric)
    and the policy's final drop is past it, train the switch too. `progress(n)`: told each step taken, of every arm;
    `more(n)`: told the steps a switch's arm adds, before it starts."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be a whole number >= 1, but got {steps!r}")
    if baseline not in BASELINES:
        raise ValueError(f"baseline must be one of {', '.join(BASELINES)}, but got {baseline!r}")
    every = max(1, steps // 10) if every is None else every
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(f"every must be a whole number >= 1, but got {every!r}")
    order = batch_order(len(workload.train), steps)
    evaluated = {s for s in range(every, steps + 1, every)} | {steps}
    reference = Policy() if baseline == "fp32" else Policy(layers={ROOT: Format.BF16})
    base = _arm(workload, reference, order, evaluated, seed, progress)
    mine = _arm(workload, policy, order, evaluated, seed, progress)
    curve = tuple(
        CurvePoint(step=s, baseline_loss=b[0], policy_loss=p[0], baseline_metric=b[1], policy_metric=p[1])
        for s, b, p in zip(range(1, steps + 1), base, mine)
    )
    if isinstance(budget, Budget):
        budget = budget.resolve(next(p.baseline_metric for p in reversed(curve) if p.baseline_metric is not None))
    result = Validation(steps=steps, baseline=baseline, curve=curve, budget=budget)
    up = raised(policy)
    if result.holds is not False or not up or budget is None:
        return result
    at = _switch_step(curve, budget)
    if more is not None:
        more(steps)
    layers = {**policy.layers, **{n: Format(f) for n, f in up.items()}}
    # no layer is left in fp8 to all-gather so (the policy file refuses the setting without one)
    switched = dataclasses.replace(policy, layers=layers, measured={}, fsdp_fp8_all_gather=False)
    after = _arm(workload, policy, order, evaluated, seed, progress, switch=(at, switched))
    curve = tuple(
        dataclasses.replace(p, switched_loss=a[0], switched_metric=a[1]) if p.step > at else p for p, a in zip(curve, after)
    )
    drop = curve[-1].switched_drop
    switch = Switch(step=at, from_fraction=at / steps, layers=up, drop=drop if drop is not None else math.nan)
    return dataclasses.replace(result, curve=curve, switch=switch)


def _switch_step(curve: Sequence[CurvePoint], budget: float) -> int:
    """The last evaluated step before the drop passed SWITCH_SHARE of the budget (0: from the start)."""
    at = 0
    for point in curve:
        drop = point.drop
        if drop is None:
            continue
        if not math.isfinite(drop) or drop > SWITCH_SHARE * budget:  # a diverged metric is past every share
            return at
        at = point.step
    return at


def _arm(
    workload: Workload,
    policy: Policy,
    order: Sequence[int],
    evaluated: set[int],
    seed: int,
    progress: Callable[[int], None] | None,
    *,
    switch: tuple[int, Policy] | None = None,
) -> list[tuple[float, float | None]]:
    """One arm's (loss, metric or None) per step. `switch` (step, policy): from after that step the run goes on in the
    other policy, from this one's weights, optimizer state and loss scale (a checkpoint loads so: apply_policy keeps
    the fp32 parameter names). Each step and each evaluation draws from torch's, Python's and NumPy's generators
    seeded by (seed, step), the same in every arm; the caller's states are given back. The arm's trainers are released
    as it ends."""
    trainer = Trainer(workload, policy, order=order)
    out: list[tuple[float, float | None]] = []
    try:
        for step in range(1, len(order) + 1):
            if switch is not None and step == switch[0] + 1:
                trainer = _carried(trainer, switch[1], order[switch[0] :])
            with random_state(workload, _seed(seed, step, 0)):  # the same dropout masks, augmentations in every arm
                loss = float(trainer.step().detach())
            metric = None
            if step in evaluated:
                with random_state(workload, _seed(seed, step, 1)):
                    metric = trained_metric(workload, trainer)
            out.append((loss, metric))
            if progress is not None:
                progress(1)
    finally:
        release_trainer(trainer)
    return out


def _seed(seed: int, step: int, kind: int) -> int:
    """The draws of one step's training (kind 0) or evaluation (1): a seed below SEEDS, as NumPy takes."""
    return (seed * 1_000_003 + 2 * step + kind) % SEEDS


def _carried(trainer: Trainer, policy: Policy, order: Sequence[int]) -> Trainer:
    """A Trainer of `policy` that goes on where `trainer` stands: its weights, optimizer state and loss scale; the old
    one is released (both on the device at once only while the state is copied)."""
    after = Trainer(trainer.workload, policy, order=order)
    try:
        after.model.load_state_dict(trainer.model.state_dict())
        after.optimizer.load_state_dict(trainer.optimizer.state_dict())
        if trainer.scaler.is_enabled() and after.scaler.is_enabled():
            after.scaler.load_state_dict(trainer.scaler.state_dict())
    except BaseException:
        release_trainer(after)
        raise
    finally:
        release_trainer(trainer)
    return after
