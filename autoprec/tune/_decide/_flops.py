"""The planning goal (`--objective flops --target b200`; the name kept from its first version): for planning where the
formats' kernels are not on this machine, the policy with the largest predicted training-step speedup over uniform
bf16 on a named target (_targets.py) within the budget. Its value is the step-time predictor's (_predict.py), never a
measured speed, and every report says so with the predictor's error band:

    predicted speedup = uniform bf16's predicted step time / the policy's

over the step the profile describes (_step_shapes.step_from_rows): each nn.Linear (by type, any subclass) priced per GEMM
with its format's casts, the optimizer over the profiled layers' parameters and the elementwise work around each
Linear. Attention's matmuls are in no profile: for a model with them, `autoprec predict` (which traces the whole step)
gives the smaller, truer speedup. A layer the policy does not list runs in the format of its nearest listed ancestor,
else the root's.

The lower layer, kept for the block study's tables: `gemm_flops` and `estimated_speedup`, the Linears' GEMM FLOPs at
the datasheet's peak rates alone (an upper bound on what any format can gain: no casts, no efficiency, nothing else
in the step).

A trial under this goal is not timed and its peak memory not measured: its value is arithmetic over its policy, so a
search on a CPU costs the profile, each trial's metric and the final re-measure of the finalists' metric (whose step
times, this machine's, are reported as such). The budget holds as for every goal. A format whose GEMMs need an
element format the target does not run (nvfp4 on an H100) is refused with the search space's formats and the
target's, not counted at another format's speed.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from autoprec.formats import Format, parse_format
from autoprec.policy import Policy
from autoprec.tune._core._goal import Goal, GoalSettings, register_goal
from autoprec.tune._core._names import ALTERNATIVES, BF16, FP32, NOT_A_POLICY
from autoprec.tune._core._records import Finals
from autoprec.tune._core._targets import Target, target_named
from autoprec.tune._measure import _predict as predictor
from autoprec.tune._measure._predict import Step, format_of, lacking, outer_autocast
from autoprec.tune._measure._step_shapes import step_from_rows

if TYPE_CHECKING:
    from autoprec.tune._core._profile_row import ProfileRow
    from autoprec.tune._core._records import Candidate, TrialRecord
    from autoprec.tune._core._space import SearchSpace

BASELINE = predictor.BASELINE  # the prediction's 1.0: the model all in bf16 on the target


def gemm_flops(rows: Iterable[ProfileRow]) -> dict[str, float]:
    """FLOPs of each of a Linear layer's three GEMMs per training step (2 * tokens * in * out), by layer, from a
    profile's rows: the Linears step_from_rows finds (by type, any subclass), with their tokens."""
    return {s.name: 2.0 * s.tokens * s.in_features * s.out_features for s in step_from_rows(rows).linears}


def gemm_precisions(fmt: Format, outer: str | None = None) -> tuple[str, str, str]:
    """What each GEMM of a Linear in `fmt` runs in, called under the autocast `outer` (its family's answer)."""
    return fmt.family.gemm_precisions(fmt, outer)


def gemm_seconds(policy: Policy, flops: Mapping[str, float], target: Target) -> tuple[float, dict[str, float]]:
    """The nominal GEMM time per training step (seconds) of the Linears under `policy` on `target`, and the FLOPs
    by element format. KeyError names a format the target does not run (`lacking` refuses those first)."""
    seconds = 0.0
    by: dict[str, float] = {}
    for name, work in flops.items():
        for precision in gemm_precisions(format_of(name, policy.layers), outer_autocast(name, policy.layers)):
            seconds += work / (target.tflops[precision] * 1e12)
            by[precision] = by.get(precision, 0.0) + work
    return seconds, by


def estimated_speedup(policy: Policy, flops: Mapping[str, float], target: Target) -> float:
    """The lower layer: all-bf16's GEMM time at the datasheet's peak rates on `target` over `policy`'s (1.0: as fast
    as all-bf16; 1.0 too with no Linear). An upper bound on a format's gain, not a prediction: `predicted` is that."""
    seconds, _ = gemm_seconds(policy, flops, target)
    base = 3 * sum(flops.values()) / (target.tflops[BASELINE] * 1e12)
    return base / seconds if seconds > 0 else 1.0


def describe(value: float, target: Target, band_text: str | None = None) -> str:
    """The prediction in words, as every report shows it: the predictor's, with its error band, never a measurement."""
    return predictor.describe(value, target, band_text)


class Flops(Goal):
    """The predicted training-step speedup over uniform bf16 on a named target (SearchConfig.target), maximised. The
    registered instance is unbound; the pipeline binds it to a search's profile and target (`bound`), which every
    method that computes a value needs."""

    name = "flops"
    label = "predicted speedup"
    direction = "maximize"
    summary = "the largest predicted step speedup over bf16 on a --target device (the step-time predictor's, not a measurement)"
    infeasible = 0.0
    chosen_for = "the largest predicted step speedup on the target within budget (predicted, not measured)"
    timed = False
    targeted = True
    # the prediction's baseline is uniform bf16, so a list may hold bf16 instead of fp32 as the format a layer keeps:
    # with fp32 as that, a layer kept high would be priced at the target's fp32 rate (75 TFLOP/s on a B200, 30x bf16's)
    fallbacks = ("fp32", BASELINE)

    def __init__(self, target: Target | None = None, step: Step | None = None, kept_in: Format = Format.FP32):
        # the study key records the target beside the label (SearchConfig.target): one study per target
        self.target, self.step = target, step or Step(())
        # the search space's fallback (check_space): fp32 where every list holds it, else bf16; the choice falls back
        # to it, and all-fp32 (measured as the budget's reference) is no policy of a space without fp32
        self.kept_in = kept_in
        self._base_ms: float | None = None

    def check_space(self, space: SearchSpace, config: GoalSettings) -> Flops:
        super().check_space(space, config)
        fp32_everywhere = all(Format.FP32 in formats for _, formats in space.lists())
        return Flops(self.target, self.step, Format.FP32 if fp32_everywhere else Format(BASELINE))

    def check_formats(self, formats: Collection[Format], config: GoalSettings) -> None:
        target = target_named(config.target)
        missing = lacking(formats, target)
        if missing:
            need = "; ".join(f"{f} needs {', '.join(p)}" for f, p in missing.items())
            raise ValueError(
                f"target {target.name} ({target.device}) runs {', '.join(target.runs)}: {need}. Leave "
                f"{', '.join(missing)} out of the search space, or plan for a target that runs them"
            )

    def bound(self, rows: Sequence[ProfileRow], config: GoalSettings) -> Flops:
        self.check_formats([parse_format(f) for f in dict.fromkeys(r.format for r in rows if r.status == "ok")], config)
        return Flops(target_named(config.target), step_from_rows(rows), self.kept_in)

    def layer_cost(self, row: ProfileRow) -> float:
        """The layer's predicted ms per step on the target in the row's format (its GEMMs, casts and conversions),
        called under bf16 (the prediction's baseline); NaN for a layer that is no Linear of the step or a format the
        target does not run. This machine's time says nothing of the target's. The bf16 around it is a heuristic for
        ranking only: under an fp32 root (the other greedy warm start) a per-GEMM format's high-precision GEMMs run
        in fp32."""
        target, step = self._ready()
        shape = next((s for s in step.linears if s.name == row.layer), None)
        if shape is None:
            return math.nan
        try:
            return sum(predictor.linear_parts(shape, Format(row.format), BASELINE, target).values())
        except KeyError:
            return math.nan

    def _ready(self) -> tuple[Target, Step]:
        if self.target is None:
            raise RuntimeError("the flops goal computes nothing before it is bound to a search's profile (Goal.bound)")
        return self.target, self.step

    def estimated(self, policy: Policy) -> float | None:
        target, step = self._ready()
        if self._base_ms is None:  # uniform bf16's, the same for every trial
            self._base_ms = predictor.predict(step, predictor.baseline(), target).ms
        ms = predictor.predict(step, policy, target).ms
        return self._base_ms / ms if ms > 0 else 1.0

    def value(self, record: TrialRecord, policy: Policy) -> float | None:
        return self.estimated(policy)

    def estimate_record(self, policy: Policy, candidates: Mapping[str, Policy | Candidate]) -> dict[str, Any]:
        target, step = self._ready()
        base, mine = predictor.predict(step, predictor.baseline(), target), predictor.predict(step, policy, target)
        value = base.ms / mine.ms if mine.ms > 0 else 1.0
        stated = predictor.regime_band(step, policy)  # a profile's step: no count of the matmuls outside the Linears
        return {
            "goal": self.name,
            "target": target.name,
            "device": target.device,
            "estimate": True,
            "predicted": True,
            "value": value,
            "error": stated.error,
            "validation_points": stated.points,
            "baseline": f"uniform {BASELINE}",
            "what": describe(value, target, stated.text),
            "column": f"predicted {target.name}",
            "detail": (
                f"1.0 = uniform {BASELINE}'s predicted step time on {target.device} ({base.ms:.4g} ms; this policy "
                f"{mine.ms:.4g} ms); counted: the profile's nn.Linear layers (by type) per GEMM with their formats' casts, "
                "the optimizer over the profiled parameters and the elementwise work around each Linear; attention's "
                "matmuls and communication are not in a profile (`autoprec predict` traces the whole step); "
                f"the target: {target.source}"
            ),
            "parts_ms": {"bf16": dict(base.parts), "policy": dict(mine.parts)},
            "tflops": dict(target.tflops),
            "bandwidth_tbs": target.bandwidth_tbs,
            "source": target.source,
            "candidates": {n: self.estimated(_policy(c)) for n, c in candidates.items() if n not in NOT_A_POLICY},
        }

    def choose(
        self, finals: Finals, candidates: Mapping[str, Policy | Candidate], alternatives: Collection[str] = ALTERNATIVES
    ) -> tuple[str, str]:
        """The re-measured candidate within budget with the largest estimate; among equal estimates the smaller
        metric drop, then the one measured first (the alternatives are measured first)."""
        target, _ = self._ready()
        outside = NOT_A_POLICY | ({FP32} if self.kept_in is not Format.FP32 else set())
        feasible = [r for r in finals if r.feasible and r.candidate not in outside and r.candidate in candidates]
        if not feasible:
            if self.kept_in is Format.FP32:
                return FP32, "nothing else within budget"
            return BF16, f"nothing within budget: {BF16}, the search space's fallback (it offers no fp32), though over budget"
        value = {r.candidate: self.estimated(_policy(candidates[r.candidate])) or 0.0 for r in feasible}
        order = {r.candidate: i for i, r in enumerate(finals)}
        best = max(feasible, key=lambda r: (round(value[r.candidate], 9), -r.metric_drop, -order[r.candidate]))
        return best.candidate, (
            f"the largest predicted step speedup on {target.name} within budget: {describe(value[best.candidate], target)}"
        )


def _policy(candidate: Policy | Candidate) -> Policy:
    return candidate if isinstance(candidate, Policy) else candidate.policy


FLOPS = register_goal(Flops())
