"""The FLOP goal (`--objective flops --target b200`): for planning where the formats' kernels are not on this machine,
the most GEMM work in the lowest formats within the budget, weighted by each format's nominal dense throughput on a
named target (_targets.py). Its value is an estimate from FLOP counts, never a measured speed:

    estimated speedup = sum over GEMMs of FLOPs / rate(bf16)  /  sum over GEMMs of FLOPs / rate(the GEMM's format)

over every nn.Linear's three GEMMs (fprop, dgrad, wgrad: 2 * tokens * in * out FLOPs each, tokens the rows its calls
took per training step, from the profile) and the target's rates for the element format each GEMM runs in
(FormatFamily.gemm_precisions). The baseline is the same model all in bf16 on that target: 1.0 is all-bf16's GEMM
time, 2.0 half of it. Layers that are not Linears, and everything in a step that is not a GEMM (attention's matmuls,
norms, the optimizer), are counted nowhere: the estimate is of the Linears' GEMM time alone. A layer the policy does
not list runs in the format of its nearest listed ancestor, else the root's (a bf16 root: its Linears in bf16).

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

from autoprec.formats import Format, autocast_name, parse_format
from autoprec.policy import ROOT, Policy
from autoprec.tune._alternatives import ALTERNATIVES, BF16, FP32, NOT_A_POLICY
from autoprec.tune._goals import Goal, register_goal
from autoprec.tune._records import Finals
from autoprec.tune._targets import Target, target_named

if TYPE_CHECKING:
    from autoprec.tune._config import SearchConfig
    from autoprec.tune._profile_data import ProfileRow
    from autoprec.tune._records import TrialRecord
    from autoprec.tune._space import SearchSpace
    from autoprec.tune._trainer import Candidate

BASELINE = "bf16"  # the estimate's 1.0: the model's Linears all in bf16 on the target


def gemm_flops(rows: Iterable[ProfileRow]) -> dict[str, float]:
    """FLOPs of each of a Linear layer's three GEMMs per training step (2 * tokens * in * out), by layer, from a
    profile's rows (its first row per layer: type, shape "out x in", tokens). A layer whose type is not a Linear (by
    name: Linear and its subclasses named ...Linear), or whose tokens were not recorded, is not counted."""
    out: dict[str, float] = {}
    for row in rows:
        if row.layer in out:
            continue
        dims, tokens = row.shape.split("x"), row.tokens
        if not row.type.endswith("Linear") or len(dims) != 2 or tokens is None or not (math.isfinite(tokens) and tokens > 0):
            continue
        out[row.layer] = 2.0 * float(tokens) * int(dims[0]) * int(dims[1])
    return out


def format_of(name: str, layers: Mapping[str, Format]) -> Format:
    """The format layer `name` runs in under a policy's `layers`: its own, else its nearest listed ancestor's, else
    the root's (fp32 where the policy lists no root)."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        found = layers.get(".".join(parts[:i]))
        if found is not None:
            return found
    return layers.get(ROOT, Format.FP32)


def outer_autocast(name: str, layers: Mapping[str, Format]) -> str | None:
    """The autocast layer `name` is called under: that of its nearest listed ancestor whose format sets one (fp32 turns
    it off; an fp8 or block-scaled layer's leaves the caller's), else the root's: "bf16", "fp16", or None."""
    parts = name.split(".")
    for i in range(len(parts) - 1, 0, -1):  # the nearest listed ancestor that sets the autocast: fp32 turns it off
        around = layers.get(".".join(parts[:i]))
        if around is not None and (around is Format.FP32 or around.spec.autocast is not None):
            return autocast_name(around.spec.autocast)
    return autocast_name(layers.get(ROOT, Format.FP32).spec.autocast)


def gemm_precisions(fmt: Format, outer: str | None = None) -> tuple[str, str, str]:
    """What each GEMM of a Linear in `fmt` runs in, called under the autocast `outer` (its family's answer)."""
    return fmt.family.gemm_precisions(fmt, outer)


def lacking(formats: Collection[Format], target: Target) -> dict[str, list[str]]:
    """The formats among `formats` whose GEMMs need an element format `target` does not run, with those."""
    out: dict[str, list[str]] = {}
    for fmt in formats:
        missing = sorted({p for p in gemm_precisions(fmt) if p not in target.tflops}, key=str)
        if missing:
            out[fmt.value] = missing
    return out


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
    """All-bf16's nominal GEMM time on `target` over `policy`'s (1.0: as fast as all-bf16; 1.0 too with no Linear)."""
    seconds, _ = gemm_seconds(policy, flops, target)
    base = 3 * sum(flops.values()) / (target.tflops[BASELINE] * 1e12)
    return base / seconds if seconds > 0 else 1.0


def describe(value: float, target: str) -> str:
    """The estimate in words, as every report shows it."""
    return f"estimated {value:.2f}x all-{BASELINE} GEMM throughput on {target} (FLOP count, not measured)"


class Flops(Goal):
    """The estimated GEMM speedup over all-bf16 on a named target (SearchConfig.target), maximised. The registered
    instance is unbound; the pipeline binds it to a search's profile and target (`bound`), which every method that
    computes a value needs."""

    name = "flops"
    label = "estimated GEMM speedup"
    direction = "maximize"
    summary = "the most GEMM work in the lowest formats on a --target device, an estimate from FLOP counts"
    infeasible = 0.0
    chosen_for = "the largest estimated GEMM speedup on the target within budget (FLOP count, not measured)"
    timed = False
    targeted = True
    # the estimate's baseline is all-bf16, so a list may hold bf16 instead of fp32 as the format a layer keeps: with
    # fp32 as that, a layer kept high would be priced at the target's fp32 rate (75 TFLOP/s on a B200, 30x bf16's)
    fallbacks = ("fp32", BASELINE)

    def __init__(self, target: Target | None = None, flops: Mapping[str, float] | None = None, kept_in: Format = Format.FP32):
        # the study key records the target beside the label (SearchConfig.target): one study per target
        self.target, self.flops = target, dict(flops or {})
        # the search space's fallback (check_space): fp32 where every list holds it, else bf16; the choice falls back
        # to it, and all-fp32 (measured as the budget's reference) is no policy of a space without fp32
        self.kept_in = kept_in

    def check_space(self, space: SearchSpace, config: SearchConfig) -> Flops:
        super().check_space(space, config)
        fp32_everywhere = all(Format.FP32 in formats for _, formats in space.lists())
        return Flops(self.target, self.flops, Format.FP32 if fp32_everywhere else Format(BASELINE))

    def check_formats(self, formats: Collection[Format], config: SearchConfig) -> None:
        target = target_named(config.target)
        missing = lacking(formats, target)
        if missing:
            need = "; ".join(f"{f} needs {', '.join(p)}" for f, p in missing.items())
            raise ValueError(
                f"target {target.name} ({target.device}) runs {', '.join(target.runs)}: {need}. Leave "
                f"{', '.join(missing)} out of the search space, or plan for a target that runs them"
            )

    def bound(self, rows: Sequence[ProfileRow], config: SearchConfig) -> Flops:
        self.check_formats([parse_format(f) for f in dict.fromkeys(r.format for r in rows if r.status == "ok")], config)
        return Flops(target_named(config.target), gemm_flops(rows), self.kept_in)

    def layer_cost(self, row: ProfileRow) -> float:
        """The layer's nominal GEMM seconds per step on the target in the row's format, its high-precision GEMMs in
        bf16 (inside the estimate's all-bf16 baseline); NaN for a layer with no FLOP count or a format the target
        does not run. This machine's time says nothing of the target's. The bf16 around it is a heuristic for ranking
        only: under an fp32 root (the other greedy warm start) a per-GEMM format's high-precision GEMMs run in fp32."""
        target, flops = self._ready()
        work = flops.get(row.layer)
        if work is None:
            return math.nan
        try:
            return sum(work / (target.tflops[p] * 1e12) for p in gemm_precisions(Format(row.format), BASELINE))
        except KeyError:
            return math.nan

    def _ready(self) -> tuple[Target, dict[str, float]]:
        if self.target is None:
            raise RuntimeError("the flops goal computes nothing before it is bound to a search's profile (Goal.bound)")
        return self.target, self.flops

    def estimated(self, policy: Policy) -> float | None:
        target, flops = self._ready()
        return estimated_speedup(policy, flops, target)

    def value(self, record: TrialRecord, policy: Policy) -> float | None:
        return self.estimated(policy)

    def estimate_record(self, policy: Policy, candidates: Mapping[str, Policy | Candidate]) -> dict[str, Any]:
        target, flops = self._ready()
        _, by = gemm_seconds(policy, flops, target)
        total = sum(by.values())
        value = estimated_speedup(policy, flops, target)
        return {
            "goal": self.name,
            "target": target.name,
            "device": target.device,
            "estimate": True,
            "value": value,
            "baseline": f"all-{BASELINE}",
            "what": describe(value, target.name),
            "flops_per_step": total,
            "flops_share": {p: by[p] / total for p in sorted(by)} if total else {},
            "tflops": dict(target.tflops),
            "source": target.source,
            "counted": "the nn.Linear layers' three GEMMs (2 x tokens x in x out FLOPs each, tokens per training step "
            "from the profile); other layers and non-GEMM work are not counted",
            "candidates": {
                n: estimated_speedup(_policy(c), flops, target) for n, c in candidates.items() if n not in NOT_A_POLICY
            },
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
            f"the largest estimated GEMM speedup on {target.name} within budget: {describe(value[best.candidate], target.name)}"
        )


def _policy(candidate: Policy | Candidate) -> Policy:
    return candidate if isinstance(candidate, Policy) else candidate.policy


FLOPS = register_goal(Flops())
