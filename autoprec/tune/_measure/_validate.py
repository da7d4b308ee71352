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
from autoprec.policy import ROOT, Phase, Policy
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
    drop it measured at the end; `policy` the schedule trained (the policy with the switch as a phase), which
    apply_policy and autoprec.follow_schedule run as it was measured."""

    step: int
    from_fraction: float
    layers: Mapping[str, str]
    drop: float
    policy: Policy
    steps: int = 0  # the run's length, which the schedule's phases are shares of

    def phase(self) -> dict[str, Any] | None:
        """The switch as the schedule written holds it: its phase starting at `step` (merged with one the policy had
        there); None where it holds none there (from the start, step 0: the policy itself raised; or where nothing
        is below bf16 at the step and the switch only keeps later phases from lowering `layers`)."""
        for phase in self.policy.phases:
            if phase.start_step(self.steps) == self.step:
                return phase.to_dict()
        return None


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


def raised(layers: Mapping[str, Format]) -> dict[str, str]:
    """The layers below bf16 (fp8, MXFP8, NVFP4, fp16: narrower or scaled) and the format each is raised to: bf16,
    the format a late phase trains them in (Megatron's NVFP4 healing raises a whole model so)."""
    keep = {Format.FP32, Format.BF16}
    return {name: Format.BF16.value for name, fmt in layers.items() if fmt not in keep}  # an fp16 root too


def with_switch(policy: Policy, step: int, steps: int) -> Policy:
    """`policy` with its layers below bf16 raised to bf16 from step `step` of a run of `steps` to its end: a phase
    starting there (merged into one that starts at the same step; the first part itself where `step` is 0), and the
    same layers kept raised in its later phases. Layers at fp32 or bf16 stay as they are."""
    starts = [0, *(p.start_step(steps) for p in policy.phases)]
    fractions = [0.0, *(p.from_fraction for p in policy.phases)]
    parts = [(start, fraction, policy.phase_layers(i)) for i, (start, fraction) in enumerate(zip(starts, fractions))]
    here = policy.phase_layers(policy.phase_at(step, steps))

    def up(layers: dict[str, Format]) -> dict[str, Format]:
        return {**layers, **{name: Format(fmt) for name, fmt in raised(layers).items()}}

    timeline = [(f, layers) for start, f, layers in parts if start < step]
    # step / steps unrounded: Phase.start_step gives `step` back for any run length
    at = next((f for start, f, _ in parts if start == step), step / steps)
    timeline.append((at, up(here)))
    timeline += [(f, up(layers)) for start, f, layers in parts if start > step]
    phases = []
    for (_, before), (f, after) in zip(timeline, timeline[1:]):
        changed = {name: fmt for name, fmt in after.items() if before.get(name) is not fmt}
        if changed:
            phases.append(Phase(from_fraction=f, layers=changed))
    return dataclasses.replace(policy, layers=timeline[0][1], phases=tuple(phases), fsdp_fp8_all_gather=False)


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
    if result.holds is not False or budget is None:
        return result
    at = _switch_step(curve, budget)
    # what is below bf16 in the phase the switch falls in or any later one: raised from there on
    up = {
        n: f for i in range(policy.phase_at(at, steps), len(policy.phases) + 1) for n, f in raised(policy.phase_layers(i)).items()
    }
    if not up:
        return result  # nothing to raise
    # the schedule trained is the one written: no layer is left in fp8 to all-gather (with_switch turns that off)
    scheduled = with_switch(policy, at, steps)
    if more is not None:
        more(steps)
    after = _arm(workload, scheduled, order, evaluated, seed, progress)
    curve = tuple(
        dataclasses.replace(p, switched_loss=a[0], switched_metric=a[1]) if p.step > at else p for p, a in zip(curve, after)
    )
    drop = curve[-1].switched_drop
    started = next((p.from_fraction for p in scheduled.phases if p.start_step(steps) == at), 0.0)  # as written
    switch = Switch(at, started, up, drop if drop is not None else math.nan, scheduled, steps)
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
) -> list[tuple[float, float | None]]:
    """One arm's (loss, metric or None) per step. A policy with phases switches in place as the run passes each
    (autoprec.follow_schedule, as a user's loop does): the same weights, optimizer state and loss scale go on. Each
    step and each evaluation draws from torch's, Python's and NumPy's generators seeded by (seed, step), the same in
    every arm; the caller's states are given back. The arm's trainer is released as it ends."""
    trainer = Trainer(workload, policy, order=order, total_steps=len(order))
    out: list[tuple[float, float | None]] = []
    try:
        for step in range(1, len(order) + 1):
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
